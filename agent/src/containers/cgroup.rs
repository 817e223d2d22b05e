//! The container (and pod UID) a cgroup path names.
//!
//! Recognised path components, with or without the systemd cgroup driver, v1 or v2:
//! - `docker-<id>.scope` (Docker, systemd driver); `<id>` under a `docker` component (cgroupfs);
//! - `cri-containerd-<id>.scope` (containerd CRI, inside kubepods or not);
//! - `crio-<id>.scope` / `crio-<id>` (CRI-O; `crio-conmon-<id>` is the monitor, not the
//!   container);
//! - `libpod-<id>.scope` / `libpod-<id>` (podman, rootful, rootless or `libpod_parent`;
//!   `libpod-conmon-<id>` is the monitor);
//! - a bare `<id>` right under a kubepods `pod<uid>` component (cgroupfs driver). containerd
//!   and Docker (cri-dockerd) both name it so, and the path cannot tell them apart: it is called
//!   containerd, the common case ([`super::PodNames`] still tries every runtime's state);
//!
//! `<id>` is exactly 64 lowercase hex digits. The deepest matching component wins, so a
//! subgroup below a container's (`.../docker-<id>.scope/init.scope`) is still that container.
//! The pod UID comes from a `kubepods[-<qos>]-pod<uid>.slice` component (systemd driver, where
//! `_` stands for `-`) or a `pod<uid>` component below a kubepods one (cgroupfs driver).
use super::{Container, Runtime};

/// The v1 hierarchies whose path is tried first, in this order; then the others.
const V1_PREFERRED: [&str; 4] = ["pids", "memory", "cpu", "name=systemd"];

/// `<prefix><id>[.scope]` components and the runtime each names.
const PREFIXES: [(&str, Runtime); 4] = [
    ("docker-", Runtime::Docker),
    ("cri-containerd-", Runtime::Containerd),
    ("crio-", Runtime::Crio),
    ("libpod-", Runtime::Podman),
];

/// Parse the contents of /proc/<pid>/cgroup into the container its path names, if any: the
/// cgroup v2 (`0::`) path first, then the v1 lines, preferring the `pids`, `memory`, `cpu`
/// and `name=systemd` hierarchies. (On a hybrid host the v2 path is often `/`.)
pub fn from_cgroup(contents: &str) -> Option<Container> {
    let v2 = contents.lines().filter_map(|l| l.strip_prefix("0::"));
    let v1: Vec<(&str, &str)> = contents
        .lines()
        .filter_map(|l| {
            let mut it = l.splitn(3, ':');
            let (_id, controllers, path) = (it.next()?, it.next()?, it.next()?);
            (!controllers.is_empty()).then_some((controllers, path))
        })
        .collect();
    let preferred = V1_PREFERRED.iter().flat_map(|want| {
        v1.iter()
            .filter(move |(ctl, _)| ctl.split(',').any(|c| c == *want))
            .map(|&(_, path)| path)
    });
    let rest = v1.iter().map(|&(_, path)| path);
    v2.chain(preferred)
        .chain(rest)
        .find_map(|path| from_path(path.trim()))
}

/// The container one cgroup path names.
fn from_path(path: &str) -> Option<Container> {
    let comps: Vec<&str> = path.split('/').filter(|c| !c.is_empty()).collect();
    let (at, id, runtime) = (0..comps.len())
        .rev()
        .find_map(|i| container_component(&comps[..=i]).map(|(id, rt)| (i, id, rt)))?;
    Some(Container {
        id: id.to_string(),
        runtime,
        pod_uid: pod_uid(&comps[..at]),
        pod_name: None,
        pod_namespace: None,
        name: None,
        image: None,
    })
}

/// Whether the last of `comps` is a container's cgroup (its ancestors decide for a bare id).
fn container_component<'a>(comps: &[&'a str]) -> Option<(&'a str, Runtime)> {
    let (&comp, ancestors) = comps.split_last()?;
    let stem = comp.strip_suffix(".scope").unwrap_or(comp);
    for (prefix, runtime) in PREFIXES {
        if let Some(id) = stem.strip_prefix(prefix) {
            // `crio-conmon-<id>` / `libpod-conmon-<id>` fail here: not 64 hex.
            return is_container_id(id).then_some((id, runtime));
        }
    }
    if !is_container_id(comp) {
        return None;
    }
    match ancestors.split_last() {
        Some((&"docker", _)) => Some((comp, Runtime::Docker)),
        Some((&"libpod_parent", _)) => Some((comp, Runtime::Podman)),
        // cgroupfs driver: the path does not say which CRI runtime; containerd is the common one.
        Some((parent, above))
            if parent.starts_with("pod") && above.iter().any(|c| c.contains("kubepods")) =>
        {
            Some((comp, Runtime::Containerd))
        }
        _ => None,
    }
}

/// The pod UID from the components above a container's, when they sit under kubepods.
fn pod_uid(ancestors: &[&str]) -> Option<String> {
    let kubepods = ancestors.iter().position(|c| c.contains("kubepods"))?;
    ancestors[kubepods..].iter().rev().find_map(|c| {
        let raw = match c.strip_suffix(".slice") {
            // kubepods-pod<uid>.slice, kubepods-burstable-pod<uid>.slice, kubelet-kubepods-...
            Some(stem) => stem.rsplit_once("-pod")?.1,
            None => c.strip_prefix("pod")?,
        };
        let uid = raw.replace('_', "-");
        is_pod_uid(&uid).then_some(uid)
    })
}

/// 64 lowercase hex digits.
fn is_container_id(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// A pod UID: a dashed UUID, or the 32 hex digits of a static pod's manifest hash.
fn is_pod_uid(s: &str) -> bool {
    (32..=36).contains(&s.len())
        && s.bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f' | b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "3f4e5d6c7b8a99887766554433221100ffeeddccbbaa00112233445566778899";
    const UID: &str = "7e2a1c3b-9d4f-4e6a-8b1c-2d3e4f5a6b7c";

    /// A cgroup v1 (hybrid) file: every controller at `path`, the unified hierarchy at `/`.
    fn v1(path: &str) -> String {
        let ctls = [
            "pids",
            "hugetlb",
            "net_cls,net_prio",
            "perf_event",
            "memory",
            "devices",
            "cpu,cpuacct",
            "freezer",
            "blkio",
            "cpuset",
        ];
        let mut s = String::new();
        for (i, c) in ctls.iter().enumerate() {
            s.push_str(&format!("{}:{c}:{path}\n", 12 - i));
        }
        s.push_str("2:rdma:/\n");
        s.push_str(&format!("1:name=systemd:{path}\n0::/\n"));
        s
    }

    fn v2(path: &str) -> String {
        format!("0::{path}\n")
    }

    /// Both the v1 and the v2 file for `path` give (id, runtime, pod uid).
    fn check(path: &str, runtime: Runtime, pod_uid: Option<&str>) {
        for contents in [v1(path), v2(path)] {
            let c = from_cgroup(&contents).unwrap_or_else(|| panic!("no container in {path}"));
            assert_eq!(c.id, ID, "{path}");
            assert_eq!(c.runtime, runtime, "{path}");
            assert_eq!(c.pod_uid.as_deref(), pod_uid, "{path}");
            assert_eq!((c.pod_name, c.pod_namespace), (None, None));
        }
    }

    fn none(path: &str) {
        for contents in [v1(path), v2(path)] {
            assert_eq!(from_cgroup(&contents), None, "{contents}");
        }
    }

    #[test]
    fn docker() {
        check(
            &format!("/system.slice/docker-{ID}.scope"),
            Runtime::Docker,
            None,
        );
        check(&format!("/docker/{ID}"), Runtime::Docker, None);
        check(
            &format!("/system.slice/docker-{ID}.scope/init.scope"),
            Runtime::Docker,
            None,
        );
        check(
            &format!("/system.slice/docker-{ID}.scope/app/worker"),
            Runtime::Docker,
            None,
        );
        // rootless
        check(
            &format!("/user.slice/user-1000.slice/user@1000.service/user.slice/docker-{ID}.scope"),
            Runtime::Docker,
            None,
        );
    }

    #[test]
    fn kubernetes_systemd_driver() {
        let u = UID.replace('-', "_");
        for qos in ["burstable", "besteffort"] {
            check(
                &format!(
                    "/kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{u}.slice/cri-containerd-{ID}.scope"
                ),
                Runtime::Containerd,
                Some(UID),
            );
        }
        // guaranteed: straight under kubepods.slice
        check(
            &format!("/kubepods.slice/kubepods-pod{u}.slice/cri-containerd-{ID}.scope"),
            Runtime::Containerd,
            Some(UID),
        );
        check(
            &format!("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/crio-{ID}.scope"),
            Runtime::Crio,
            Some(UID),
        );
        // crun's `container` subgroup below CRI-O's scope
        check(
            &format!("/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{u}.slice/crio-{ID}.scope/container"),
            Runtime::Crio,
            Some(UID),
        );
        // cri-dockerd
        check(
            &format!("/kubepods.slice/kubepods-pod{u}.slice/docker-{ID}.scope"),
            Runtime::Docker,
            Some(UID),
        );
        // kind / nested kubelet: the kubepods slices under a kubelet slice
        check(
            &format!("/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod{u}.slice/cri-containerd-{ID}.scope"),
            Runtime::Containerd,
            Some(UID),
        );
        // static pod: the UID is the manifest's 32-hex hash
        let hash = "0123456789abcdef0123456789abcdef";
        check(
            &format!("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{hash}.slice/cri-containerd-{ID}.scope"),
            Runtime::Containerd,
            Some(hash),
        );
    }

    #[test]
    fn kubernetes_cgroupfs_driver() {
        for qos in ["burstable/", "besteffort/", ""] {
            check(
                &format!("/kubepods/{qos}pod{UID}/{ID}"),
                Runtime::Containerd,
                Some(UID),
            );
        }
        check(
            &format!("/kubepods/burstable/pod{UID}/crio-{ID}"),
            Runtime::Crio,
            Some(UID),
        );
        check(
            &format!("/kubelet/kubepods/burstable/pod{UID}/{ID}"),
            Runtime::Containerd,
            Some(UID),
        );
    }

    #[test]
    fn containerd_crio_and_podman_outside_kubernetes() {
        check(
            &format!("/system.slice/cri-containerd-{ID}.scope"),
            Runtime::Containerd,
            None,
        );
        check(
            &format!("/machine.slice/crio-{ID}.scope"),
            Runtime::Crio,
            None,
        );
        check(
            &format!("/machine.slice/libpod-{ID}.scope"),
            Runtime::Podman,
            None,
        );
        check(
            &format!("/machine.slice/libpod-{ID}.scope/container"),
            Runtime::Podman,
            None,
        );
        check(
            &format!("/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{ID}.scope"),
            Runtime::Podman,
            None,
        );
        check(
            &format!("/libpod_parent/libpod-{ID}"),
            Runtime::Podman,
            None,
        );
    }

    #[test]
    fn monitors_are_not_containers() {
        let u = UID.replace('-', "_");
        none(&format!(
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/crio-conmon-{ID}.scope"
        ));
        none(&format!("/machine.slice/libpod-conmon-{ID}.scope"));
        none(&format!(
            "/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-conmon-{ID}.scope"
        ));
        none("/libpod_parent/conmon");
    }

    #[test]
    fn host_processes_are_not_containers() {
        for path in [
            "/",
            "/system.slice/nginx.service",
            "/system.slice/docker.service",
            "/system.slice/containerd.service",
            "/user.slice/user-1000.slice/session-4.scope",
            "/init.scope",
            "/kubepods.slice/kubepods-burstable.slice",
            "/docker",
            "",
        ] {
            none(path);
        }
        // ids that are not 64 lowercase hex
        none(&format!("/system.slice/docker-{}.scope", &ID[..63]));
        none(&format!("/system.slice/docker-{ID}0.scope"));
        none(&format!("/system.slice/docker-{}.scope", ID.to_uppercase()));
        none(&format!(
            "/system.slice/docker-{}.scope",
            ID.replace('f', "g")
        ));
        // a bare id under something that is neither docker nor a pod
        none(&format!("/system.slice/app.service/{ID}"));
        none(&format!("/pod{UID}/{ID}"));
        for garbage in [
            "",
            "garbage",
            "::::",
            "0::",
            "12:pids",
            "\n\n",
            "0::/docker/\n",
        ] {
            assert_eq!(from_cgroup(garbage), None, "{garbage:?}");
        }
    }

    #[test]
    fn v1_hierarchies_are_tried_in_order() {
        let docker = format!("/docker/{ID}");
        // only the memory hierarchy moved: still found
        let contents = format!("12:pids:/\n8:memory:{docker}\n1:name=systemd:/\n0::/\n");
        assert_eq!(from_cgroup(&contents).map(|c| c.id).as_deref(), Some(ID));
        // a non-preferred hierarchy as the last resort
        let contents = format!("5:freezer:{docker}\n1:name=systemd:/\n");
        assert_eq!(from_cgroup(&contents).map(|c| c.id).as_deref(), Some(ID));
        // the v2 path wins over the v1 lines
        let other = "ab".repeat(32);
        let contents = format!("12:pids:/docker/{other}\n0::/system.slice/docker-{ID}.scope\n");
        assert_eq!(from_cgroup(&contents).map(|c| c.id).as_deref(), Some(ID));
        // v2 path not a container (containerd.service on a hybrid host): the v1 lines decide
        let contents = format!("12:pids:{docker}\n0::/system.slice/containerd.service\n");
        assert_eq!(from_cgroup(&contents).map(|c| c.id).as_deref(), Some(ID));
        // trailing whitespace and a CRLF do not break a path
        let contents = format!("0::/docker/{ID}  \r\n");
        assert_eq!(from_cgroup(&contents).map(|c| c.id).as_deref(), Some(ID));
    }

    #[test]
    fn pod_uids_need_kubepods_and_a_uid() {
        // not under kubepods: no pod UID even with a pod-looking slice
        check(
            &format!(
                "/system.slice/app-pod{}.slice/cri-containerd-{ID}.scope",
                UID.replace('-', "_")
            ),
            Runtime::Containerd,
            None,
        );
        // a malformed UID is dropped, the container kept
        check(
            &format!("/kubepods.slice/kubepods-podxyz.slice/cri-containerd-{ID}.scope"),
            Runtime::Containerd,
            None,
        );
        // nested: the innermost container, the pod above it
        let u = UID.replace('-', "_");
        let outer = "ab".repeat(32);
        check(
            &format!(
                "/kubepods.slice/kubepods-pod{u}.slice/cri-containerd-{outer}.scope/docker/{ID}"
            ),
            Runtime::Docker,
            Some(UID),
        );
    }
}
