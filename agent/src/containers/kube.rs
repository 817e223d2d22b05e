//! Pod names and namespaces from the runtimes' and the kubelet's files on the host (the list
//! is in the parent module's doc), cached per pod UID.
use std::{
    collections::{HashMap, HashSet},
    fs::{self, File, OpenOptions},
    io::Read,
    os::unix::fs::OpenOptionsExt,
    path::{Path, PathBuf},
};

use serde::{de::DeserializeOwned, Deserialize};

use super::{Container, Runtime};

/// The most of a runtime state file read; a bigger one is not a state file we understand.
const MAX_STATE_FILE: u64 = 4 << 20;

/// Container ids remembered per pod as "looked up, nothing found" (a crash-looping pod makes a
/// new id per restart; the oldest are forgotten, which at worst means one more lookup).
const MAX_TRIED: usize = 16;

/// containerd CRI task bundles (the OCI spec of each container), upstream then k3s.
const CONTAINERD_TASKS: [&str; 2] = [
    "run/containerd/io.containerd.runtime.v2.task/k8s.io",
    "run/k3s/containerd/io.containerd.runtime.v2.task/k8s.io",
];
/// CRI-O (containers/storage) container dirs: the runroot, then the graph root.
const CRIO_CONTAINERS: [&str; 2] = [
    "run/containers/storage/overlay-containers",
    "var/lib/containers/storage/overlay-containers",
];
const DOCKER_CONTAINERS: &str = "var/lib/docker/containers";
/// The kubelet's pod log directories, `<namespace>_<name>_<uid>`.
const POD_LOGS: &str = "var/log/pods";

/// Caches pod name/namespace lookups per pod UID; reads only files on the host (no network
/// client).
pub struct PodNames {
    root: PathBuf,
    pods: HashMap<String, Pod>,
}

#[derive(Default)]
struct Pod {
    /// (name, namespace) once found.
    names: Option<(String, String)>,
    /// Container ids of this pod whose lookup found nothing.
    tried: Vec<String>,
}

impl PodNames {
    /// `root` is `/` in production, a scratch directory in tests.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        PodNames {
            root: root.into(),
            pods: HashMap::new(),
        }
    }

    /// Fill `pod_name`/`pod_namespace` of `c` when they can be read from the kubelet's or a
    /// runtime's state on the host. A container without a pod UID is left alone. Each container
    /// id is looked up at most once while its pod is cached; once found, a pod's names serve
    /// all its containers.
    pub fn fill(&mut self, c: &mut Container) {
        let Some(uid) = c.pod_uid.as_deref() else {
            return;
        };
        if !self.pods.contains_key(uid) {
            self.pods.insert(uid.to_string(), Pod::default());
        }
        let Some(pod) = self.pods.get_mut(uid) else {
            return;
        };
        if pod.names.is_none() && !pod.tried.contains(&c.id) {
            pod.names = lookup(&self.root, c.runtime, &c.id, uid);
            if pod.names.is_none() {
                if pod.tried.len() >= MAX_TRIED {
                    pod.tried.remove(0);
                }
                pod.tried.push(c.id.clone());
            }
        }
        if let Some((name, namespace)) = &pod.names {
            c.pod_name = Some(name.clone());
            c.pod_namespace = Some(namespace.clone());
        }
    }

    /// Forget pods not in `live` (called once per scan with the pod UIDs seen).
    pub fn retain(&mut self, live: &HashSet<String>) {
        self.pods.retain(|uid, _| live.contains(uid));
    }
}

/// The pod's (name, namespace): the runtime the cgroup named first, then the other runtimes,
/// then the kubelet's log directories.
fn lookup(root: &Path, runtime: Runtime, id: &str, uid: &str) -> Option<(String, String)> {
    let others = [Runtime::Containerd, Runtime::Crio, Runtime::Docker]
        .into_iter()
        .filter(|&rt| rt != runtime);
    std::iter::once(runtime)
        .chain(others)
        .find_map(|rt| from_runtime(root, rt, id, uid))
        .or_else(|| from_pod_logs(root, uid))
}

/// What `runtime`'s state for container `id` says (`id` is 64 hex: safe in a path).
fn from_runtime(root: &Path, runtime: Runtime, id: &str, uid: &str) -> Option<(String, String)> {
    match runtime {
        Runtime::Containerd => CONTAINERD_TASKS.iter().find_map(|dir| {
            let spec: OciSpec = read_json(&root.join(dir).join(id).join("config.json"))?;
            pick(
                &spec.annotations?,
                "io.kubernetes.cri.sandbox-name",
                &["io.kubernetes.cri.sandbox-namespace"],
                "io.kubernetes.cri.sandbox-uid",
                uid,
            )
        }),
        Runtime::Crio => CRIO_CONTAINERS.iter().find_map(|dir| {
            let path = root.join(dir).join(id).join("userdata/config.json");
            let spec: OciSpec = read_json(&path)?;
            pick(
                &spec.annotations?,
                "io.kubernetes.pod.name",
                &[
                    "io.kubernetes.pod.namespace",
                    "io.kubernetes.cri-o.Namespace",
                ],
                "io.kubernetes.pod.uid",
                uid,
            )
        }),
        Runtime::Docker => {
            let path = root.join(DOCKER_CONTAINERS).join(id).join("config.v2.json");
            let config: DockerConfigV2 = read_json(&path)?;
            pick(
                &config.config?.labels?,
                "io.kubernetes.pod.name",
                &["io.kubernetes.pod.namespace"],
                "io.kubernetes.pod.uid",
                uid,
            )
        }
        // podman keeps no Kubernetes pod identity.
        Runtime::Podman => None,
    }
}

/// The subset of an OCI runtime spec (config.json) read here.
#[derive(Deserialize)]
struct OciSpec {
    annotations: Option<HashMap<String, String>>,
}

/// The subset of Docker's config.v2.json read here.
#[derive(Deserialize)]
struct DockerConfigV2 {
    #[serde(rename = "Config")]
    config: Option<DockerConfig>,
}

#[derive(Deserialize)]
struct DockerConfig {
    #[serde(rename = "Labels")]
    labels: Option<HashMap<String, String>>,
}

/// (name, namespace) from annotations or labels; None when either is missing or malformed, or
/// when they carry a pod UID other than `uid`.
fn pick(
    kv: &HashMap<String, String>,
    name_key: &str,
    namespace_keys: &[&str],
    uid_key: &str,
    uid: &str,
) -> Option<(String, String)> {
    if kv.get(uid_key).is_some_and(|u| u != uid) {
        return None;
    }
    let name = kv.get(name_key).filter(|n| is_k8s_name(n))?;
    let namespace = namespace_keys
        .iter()
        .find_map(|k| kv.get(*k).filter(|n| is_k8s_name(n)))?;
    Some((name.clone(), namespace.clone()))
}

/// The kubelet's `var/log/pods/<namespace>_<name>_<uid>` entry for `uid`. Names and namespaces
/// hold no `_`, so the split is unambiguous.
fn from_pod_logs(root: &Path, uid: &str) -> Option<(String, String)> {
    fs::read_dir(root.join(POD_LOGS))
        .ok()?
        .filter_map(Result::ok)
        .find_map(|entry| {
            let file_name = entry.file_name();
            let mut parts = file_name.to_str()?.splitn(3, '_');
            let (namespace, name, dir_uid) = (parts.next()?, parts.next()?, parts.next()?);
            (dir_uid == uid && is_k8s_name(name) && is_k8s_name(namespace))
                .then(|| (name.to_string(), namespace.to_string()))
        })
}

/// A Kubernetes object name: a DNS-1123 subdomain (lowercase alphanumerics, `-`, `.`; at most
/// 253), which also covers namespaces (DNS-1123 labels). Anything else is not trusted as one.
fn is_k8s_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.'))
}

/// A JSON state file, when it is a regular file of at most [`MAX_STATE_FILE`] bytes that
/// parses as `T`. Opened non-blocking so a FIFO planted at the path cannot hang the scan.
pub(super) fn read_json<T: DeserializeOwned>(path: &Path) -> Option<T> {
    let file: File = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    if !file.metadata().ok()?.is_file() {
        return None;
    }
    let mut buf = Vec::new();
    file.take(MAX_STATE_FILE + 1).read_to_end(&mut buf).ok()?;
    if buf.len() as u64 > MAX_STATE_FILE {
        return None;
    }
    serde_json::from_slice(&buf).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "3f4e5d6c7b8a99887766554433221100ffeeddccbbaa00112233445566778899";
    const ID2: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
    const UID: &str = "7e2a1c3b-9d4f-4e6a-8b1c-2d3e4f5a6b7c";

    /// A scratch root, emptied first; removed by the caller through `Drop`.
    struct Root(PathBuf);

    impl Root {
        fn new(tag: &str) -> Root {
            let dir = std::env::temp_dir()
                .join(format!("connreap-containers-{tag}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).expect("scratch dir");
            Root(dir)
        }

        fn write(&self, rel: &str, contents: &str) {
            let path = self.0.join(rel);
            fs::create_dir_all(path.parent().expect("has a parent")).expect("mkdir");
            fs::write(path, contents).expect("write");
        }

        fn names(&self) -> PodNames {
            PodNames::new(&self.0)
        }
    }

    impl Drop for Root {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn container(id: &str, runtime: Runtime) -> Container {
        Container {
            id: id.to_string(),
            runtime,
            pod_uid: Some(UID.to_string()),
            pod_name: None,
            pod_namespace: None,
            name: None,
            image: None,
        }
    }

    /// What `fill` puts in a fresh container.
    fn filled(
        names: &mut PodNames,
        id: &str,
        runtime: Runtime,
    ) -> (Option<String>, Option<String>) {
        let mut c = container(id, runtime);
        names.fill(&mut c);
        (c.pod_name, c.pod_namespace)
    }

    fn found(name: &str, namespace: &str) -> (Option<String>, Option<String>) {
        (Some(name.to_string()), Some(namespace.to_string()))
    }

    const NOTHING: (Option<String>, Option<String>) = (None, None);

    /// An OCI spec as a runtime writes it, with these annotations.
    fn oci_spec(annotations: &[(&str, &str)]) -> String {
        let annotations: HashMap<&str, &str> = annotations.iter().copied().collect();
        serde_json::json!({
            "ociVersion": "1.1.0",
            "process": {"user": {"uid": 0, "gid": 0}, "args": ["/app"], "cwd": "/"},
            "root": {"path": "rootfs"},
            "hostname": "web-7d4b9c6f5-x2x9q",
            "linux": {"cgroupsPath": "kubepods-burstable-pod7e2a1c3b_9d4f.slice:cri-containerd:x"},
            "annotations": annotations,
        })
        .to_string()
    }

    fn containerd_spec(name: &str, namespace: &str, uid: &str) -> String {
        oci_spec(&[
            ("io.kubernetes.cri.container-type", "container"),
            ("io.kubernetes.cri.container-name", "web"),
            ("io.kubernetes.cri.sandbox-id", ID2),
            ("io.kubernetes.cri.sandbox-name", name),
            ("io.kubernetes.cri.sandbox-namespace", namespace),
            ("io.kubernetes.cri.sandbox-uid", uid),
        ])
    }

    fn docker_config(labels: serde_json::Value) -> String {
        serde_json::json!({
            "ID": ID,
            "Name": "/k8s_web_web-7d4b9c6f5-x2x9q_shop_7e2a1c3b_0",
            "State": {"Running": true, "Pid": 4242},
            "Config": {"Hostname": "web-7d4b9c6f5-x2x9q", "Image": "nginx", "Labels": labels},
        })
        .to_string()
    }

    fn containerd_path(id: &str) -> String {
        format!("run/containerd/io.containerd.runtime.v2.task/k8s.io/{id}/config.json")
    }

    #[test]
    fn containerd_and_k3s() {
        let root = Root::new("containerd");
        root.write(&containerd_path(ID), &containerd_spec("web-1", "shop", UID));
        let mut names = root.names();
        assert_eq!(
            filled(&mut names, ID, Runtime::Containerd),
            found("web-1", "shop")
        );

        let root = Root::new("k3s");
        root.write(
            &format!("run/k3s/containerd/io.containerd.runtime.v2.task/k8s.io/{ID}/config.json"),
            &containerd_spec("web-1", "shop", UID),
        );
        assert_eq!(
            filled(&mut root.names(), ID, Runtime::Containerd),
            found("web-1", "shop")
        );
    }

    #[test]
    fn crio() {
        let spec = oci_spec(&[
            ("io.kubernetes.cri-o.ContainerType", "container"),
            ("io.kubernetes.cri-o.Name", "k8s_web_web-1_shop_7e2a1c3b_0"),
            ("io.kubernetes.cri-o.Namespace", "shop"),
            ("io.kubernetes.container.name", "web"),
            ("io.kubernetes.pod.name", "web-1"),
            ("io.kubernetes.pod.namespace", "shop"),
            ("io.kubernetes.pod.uid", UID),
        ]);
        for dir in CRIO_CONTAINERS {
            let root = Root::new("crio");
            root.write(&format!("{dir}/{ID}/userdata/config.json"), &spec);
            assert_eq!(
                filled(&mut root.names(), ID, Runtime::Crio),
                found("web-1", "shop")
            );
        }
        // the namespace from CRI-O's own annotation when the label copy is missing
        let root = Root::new("crio-ns");
        root.write(
            &format!("run/containers/storage/overlay-containers/{ID}/userdata/config.json"),
            &oci_spec(&[
                ("io.kubernetes.cri-o.Namespace", "shop"),
                ("io.kubernetes.pod.name", "web-1"),
            ]),
        );
        assert_eq!(
            filled(&mut root.names(), ID, Runtime::Crio),
            found("web-1", "shop")
        );
    }

    #[test]
    fn docker() {
        let root = Root::new("docker");
        root.write(
            &format!("var/lib/docker/containers/{ID}/config.v2.json"),
            &docker_config(serde_json::json!({
                "io.kubernetes.container.name": "web",
                "io.kubernetes.pod.name": "web-1",
                "io.kubernetes.pod.namespace": "shop",
                "io.kubernetes.pod.uid": UID,
            })),
        );
        assert_eq!(
            filled(&mut root.names(), ID, Runtime::Docker),
            found("web-1", "shop")
        );
        // a plain Docker container: no labels
        let root = Root::new("docker-plain");
        root.write(
            &format!("var/lib/docker/containers/{ID}/config.v2.json"),
            &docker_config(serde_json::Value::Null),
        );
        assert_eq!(filled(&mut root.names(), ID, Runtime::Docker), NOTHING);
    }

    #[test]
    fn other_runtimes_and_pod_logs_as_fallbacks() {
        // cgroupfs driver: the path said containerd, the state is Docker's
        let root = Root::new("fallback");
        root.write(
            &format!("var/lib/docker/containers/{ID}/config.v2.json"),
            &docker_config(serde_json::json!({
                "io.kubernetes.pod.name": "web-1",
                "io.kubernetes.pod.namespace": "shop",
            })),
        );
        assert_eq!(
            filled(&mut root.names(), ID, Runtime::Containerd),
            found("web-1", "shop")
        );

        // no runtime state at all: the kubelet's log directory
        let root = Root::new("podlogs");
        fs::create_dir_all(root.0.join(format!(
            "{POD_LOGS}/kube-system_coredns-5d78c9869d-abcde_{}",
            "1".repeat(36)
        )))
        .expect("mkdir");
        fs::create_dir_all(root.0.join(format!("{POD_LOGS}/shop_web-1_{UID}/web"))).expect("mkdir");
        assert_eq!(
            filled(&mut root.names(), ID, Runtime::Podman),
            found("web-1", "shop")
        );
        // a UID with no directory
        let mut other = container(ID, Runtime::Containerd);
        other.pod_uid = Some("2".repeat(36));
        root.names().fill(&mut other);
        assert_eq!((other.pod_name, other.pod_namespace), NOTHING);
    }

    #[test]
    fn mismatched_or_malformed_state_is_ignored() {
        let root = Root::new("bad");
        let mut names = root.names();
        // another pod's UID in the annotations
        root.write(
            &containerd_path(ID),
            &containerd_spec("web-1", "shop", &"9".repeat(36)),
        );
        assert_eq!(filled(&mut names, ID, Runtime::Containerd), NOTHING);
        // names that are not Kubernetes names
        let root = Root::new("bad-names");
        root.write(
            &containerd_path(ID),
            &containerd_spec("Web 1\n", "shop", UID),
        );
        assert_eq!(filled(&mut root.names(), ID, Runtime::Containerd), NOTHING);
        root.write(&containerd_path(ID), &containerd_spec("web-1", "", UID));
        assert_eq!(filled(&mut root.names(), ID, Runtime::Containerd), NOTHING);
        for garbage in [
            "",
            "{",
            "null",
            "[]",
            "{\"annotations\": 7}",
            "{\"annotations\": {\"io.kubernetes.cri.sandbox-name\": 7}}",
            "\u{0}\u{1}binary",
        ] {
            root.write(&containerd_path(ID), garbage);
            assert_eq!(
                filled(&mut root.names(), ID, Runtime::Containerd),
                NOTHING,
                "{garbage:?}"
            );
        }
        // a directory where the file should be
        let root = Root::new("bad-dir");
        fs::create_dir_all(root.0.join(containerd_path(ID))).expect("mkdir");
        assert_eq!(filled(&mut root.names(), ID, Runtime::Containerd), NOTHING);
    }

    #[test]
    fn huge_files_are_not_read() {
        let root = Root::new("huge");
        let padding = "x".repeat(MAX_STATE_FILE as usize);
        let spec = serde_json::json!({
            "annotations": {
                "io.kubernetes.cri.sandbox-name": "web-1",
                "io.kubernetes.cri.sandbox-namespace": "shop",
            },
            "padding": padding,
        });
        root.write(&containerd_path(ID), &spec.to_string());
        assert_eq!(filled(&mut root.names(), ID, Runtime::Containerd), NOTHING);
    }

    #[test]
    fn a_fifo_does_not_block() {
        let root = Root::new("fifo");
        let path = root.0.join(containerd_path(ID));
        fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).expect("no NUL");
        // SAFETY: c_path is a valid NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
        assert_eq!(filled(&mut root.names(), ID, Runtime::Containerd), NOTHING);
    }

    #[test]
    fn cached_per_pod_and_forgotten_by_retain() {
        let root = Root::new("cache");
        let mut names = root.names();
        root.write(&containerd_path(ID), &containerd_spec("web-1", "shop", UID));
        assert_eq!(
            filled(&mut names, ID, Runtime::Containerd),
            found("web-1", "shop")
        );
        // the state gone: the pod's names still serve its other containers
        fs::remove_dir_all(root.0.join("run")).expect("rm");
        assert_eq!(
            filled(&mut names, ID2, Runtime::Containerd),
            found("web-1", "shop")
        );
        // kept while live, forgotten once not
        names.retain(&HashSet::from([UID.to_string()]));
        assert_eq!(
            filled(&mut names, ID2, Runtime::Containerd),
            found("web-1", "shop")
        );
        names.retain(&HashSet::new());
        assert!(names.pods.is_empty());
        assert_eq!(filled(&mut names, ID2, Runtime::Containerd), NOTHING);
    }

    #[test]
    fn misses_are_tried_once_per_container() {
        let root = Root::new("miss");
        let mut names = root.names();
        assert_eq!(filled(&mut names, ID, Runtime::Containerd), NOTHING);
        // the state appears: the same container is not looked up again...
        root.write(&containerd_path(ID), &containerd_spec("web-1", "shop", UID));
        root.write(
            &containerd_path(ID2),
            &containerd_spec("web-1", "shop", UID),
        );
        assert_eq!(filled(&mut names, ID, Runtime::Containerd), NOTHING);
        // ...another container of the pod is, and then serves both
        assert_eq!(
            filled(&mut names, ID2, Runtime::Containerd),
            found("web-1", "shop")
        );
        assert_eq!(
            filled(&mut names, ID, Runtime::Containerd),
            found("web-1", "shop")
        );
        // the remembered misses are bounded
        let mut names = PodNames::new(root.0.join("nothing-here"));
        for i in 0..MAX_TRIED * 2 {
            let id = format!("{i:064x}");
            assert_eq!(filled(&mut names, &id, Runtime::Containerd), NOTHING);
        }
        assert_eq!(names.pods[UID].tried.len(), MAX_TRIED);
    }

    #[test]
    fn containers_outside_pods_are_left_alone() {
        let root = Root::new("nopod");
        root.write(&containerd_path(ID), &containerd_spec("web-1", "shop", UID));
        let mut names = root.names();
        let mut c = container(ID, Runtime::Containerd);
        c.pod_uid = None;
        let before = c.clone();
        names.fill(&mut c);
        assert_eq!(c, before);
        assert!(names.pods.is_empty());
    }
}
