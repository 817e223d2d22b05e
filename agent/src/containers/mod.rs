//! Container attribution: which container (and Kubernetes pod) a process runs in, read from the
//! host without talking to any runtime or API server.
//!
//! The container comes from the process's cgroup path (`/proc/<pid>/cgroup`, see
//! [`from_cgroup`] for the patterns recognised). The pod's name and namespace come from files
//! the kubelet and the runtimes keep on the host ([`PodNames`]), looked up by container id and
//! cached per pod UID. Every file read, relative to the root given to [`PodNames::new`] (`/` in
//! production), is one of:
//!
//! - `/proc/<pid>/cgroup` (read by `kernel::procfs::cgroup`, parsed by [`from_cgroup`]);
//! - containerd (CRI): `run/containerd/io.containerd.runtime.v2.task/k8s.io/<id>/config.json`,
//!   and k3s's `run/k3s/containerd/io.containerd.runtime.v2.task/k8s.io/<id>/config.json`: the
//!   task's OCI spec, annotations `io.kubernetes.cri.sandbox-name`,
//!   `io.kubernetes.cri.sandbox-namespace` (and `io.kubernetes.cri.sandbox-uid`, checked
//!   against the cgroup's pod UID when present);
//! - CRI-O: `run/containers/storage/overlay-containers/<id>/userdata/config.json`, else the
//!   same under `var/lib/containers/storage/`: the OCI spec, where CRI-O copies the kubelet's
//!   container labels as annotations `io.kubernetes.pod.name`, `io.kubernetes.pod.namespace`,
//!   `io.kubernetes.pod.uid` (namespace also from `io.kubernetes.cri-o.Namespace`);
//! - Docker (dockershim / cri-dockerd): `var/lib/docker/containers/<id>/config.v2.json`,
//!   `Config.Labels` `io.kubernetes.pod.name`, `io.kubernetes.pod.namespace`,
//!   `io.kubernetes.pod.uid` (the default data-root only);
//! - the kubelet's pod log directories, whatever the runtime: the names of the entries of
//!   `var/log/pods/`, `<namespace>_<pod name>_<pod uid>` (the default log directory only).
//!
//! Container names and images ([`ContainerNames`]), cached per container id, from:
//!
//! - podman: `var/lib/containers/storage/overlay-containers/containers.json` (else the same
//!   under `run/`): the container's entry, its first `names` and the `image-name` of its
//!   `metadata`;
//! - CRI-O: the `userdata/config.json` above, annotations `io.kubernetes.container.name` and
//!   `io.kubernetes.cri-o.ImageName`;
//! - containerd: the task `config.json` above (and nerdctl's under
//!   `run/containerd/io.containerd.runtime.v2.task/default/`), annotations
//!   `io.kubernetes.cri.container-name` (or `nerdctl/name`) and `io.kubernetes.cri.image-name`;
//! - Docker: the `config.v2.json` above, `Name` and `Config.Image`.
//!
//! The runtime named by the cgroup path is tried first, then the others (with the cgroupfs
//! driver the path cannot tell the runtimes apart), then the log directories. A state file is
//! read only when it is a regular file, at most 4 MiB of it; a missing, unreadable, oversized
//! or malformed file means "not known here", never an error. The kubelet's
//! `var/lib/kubelet/pods/<uid>/etc-hosts` is deliberately not used: it holds the pod's
//! hostname, which `spec.hostname` overrides and which is the node's for host-network pods.
mod cgroup;
mod kube;
mod names;

pub use cgroup::from_cgroup;
pub use kube::PodNames;
pub use names::ContainerNames;

/// The container runtime a cgroup path names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Runtime {
    Docker,
    Containerd,
    Crio,
    Podman,
}

impl Runtime {
    /// The name used in labels and JSON: "docker", "containerd", "crio", "podman".
    pub fn as_str(self) -> &'static str {
        match self {
            Runtime::Docker => "docker",
            Runtime::Containerd => "containerd",
            Runtime::Crio => "crio",
            Runtime::Podman => "podman",
        }
    }
}

/// A container a process runs in, and its Kubernetes pod when it belongs to one.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Container {
    /// The full 64-hex container id, as in the cgroup path.
    pub id: String,
    pub runtime: Runtime,
    /// The pod's UID (with dashes, whatever the cgroup driver), when the path is under kubepods.
    pub pod_uid: Option<String>,
    /// Filled by [`PodNames::fill`].
    pub pod_name: Option<String>,
    pub pod_namespace: Option<String>,
    /// The container's name and image as its runtime recorded them; filled by
    /// [`ContainerNames::fill`].
    pub name: Option<String>,
    pub image: Option<String>,
}

impl Container {
    /// The first 12 characters of the id, as `docker ps` shows it.
    pub fn short_id(&self) -> &str {
        self.id.get(..12).unwrap_or(&self.id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runtimes_and_short_ids() {
        for (rt, name) in [
            (Runtime::Docker, "docker"),
            (Runtime::Containerd, "containerd"),
            (Runtime::Crio, "crio"),
            (Runtime::Podman, "podman"),
        ] {
            assert_eq!(rt.as_str(), name);
            assert_eq!(
                serde_json::to_string(&rt).expect("serializes"),
                format!("\"{name}\"")
            );
        }
        let mut c = Container {
            id: format!("0123456789ab{}", "c".repeat(52)),
            runtime: Runtime::Docker,
            pod_uid: None,
            pod_name: None,
            pod_namespace: None,
            name: None,
            image: None,
        };
        assert_eq!(c.short_id(), "0123456789ab");
        c.id = "short".into();
        assert_eq!(c.short_id(), "short");
    }
}
