//! Container names and images from the runtimes' files on the host (the list is in the parent
//! module's doc), cached per container id: looked up once, found or not, and forgotten when no
//! process runs in the container any more.
use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
};

use serde::Deserialize;

use super::{kube::read_json, Container, Runtime};

/// containerd task bundles by containerd namespace: Kubernetes (CRI) upstream and k3s, then
/// nerdctl's default namespace.
const CONTAINERD_TASKS: [&str; 3] = [
    "run/containerd/io.containerd.runtime.v2.task/k8s.io",
    "run/k3s/containerd/io.containerd.runtime.v2.task/k8s.io",
    "run/containerd/io.containerd.runtime.v2.task/default",
];
/// containers/storage (podman, CRI-O): the runroot, then the graph root. Each holds
/// `<id>/userdata/config.json` and the index `containers.json`.
const STORAGE_CONTAINERS: [&str; 2] = [
    "run/containers/storage/overlay-containers",
    "var/lib/containers/storage/overlay-containers",
];
const DOCKER_CONTAINERS: &str = "var/lib/docker/containers";

/// What a container is called and runs, as its runtime recorded it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Identity {
    name: Option<String>,
    image: Option<String>,
}

/// Caches container names and images; reads only files on the host (no runtime client).
pub struct ContainerNames {
    root: PathBuf,
    known: HashMap<String, Identity>,
}

impl ContainerNames {
    /// `root` is `/` in production, a scratch directory in tests.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        ContainerNames {
            root: root.into(),
            known: HashMap::new(),
        }
    }

    /// Fill `name`/`image` of `c` from its runtime's state, looked up once per container id.
    pub fn fill(&mut self, c: &mut Container) {
        let root = &self.root;
        let found = self
            .known
            .entry(c.id.clone())
            .or_insert_with(|| lookup(root, c.runtime, &c.id));
        c.name.clone_from(&found.name);
        c.image.clone_from(&found.image);
    }

    /// Forget containers not in `live` (the ids of the processes still cached).
    pub fn retain(&mut self, live: &HashSet<String>) {
        self.known.retain(|id, _| live.contains(id));
    }
}

/// The runtime the cgroup named first, then the others (with the cgroupfs driver the path
/// cannot tell them apart); the first that knows the container wins.
fn lookup(root: &Path, runtime: Runtime, id: &str) -> Identity {
    let others = [
        Runtime::Containerd,
        Runtime::Crio,
        Runtime::Podman,
        Runtime::Docker,
    ]
    .into_iter()
    .filter(|&rt| rt != runtime);
    std::iter::once(runtime)
        .chain(others)
        .find_map(|rt| from_runtime(root, rt, id))
        .unwrap_or_default()
}

/// What `runtime`'s state for container `id` says (`id` is 64 hex: safe in a path).
fn from_runtime(root: &Path, runtime: Runtime, id: &str) -> Option<Identity> {
    let found = match runtime {
        Runtime::Containerd => CONTAINERD_TASKS.iter().find_map(|dir| {
            let a = annotations(&root.join(dir).join(id).join("config.json"))?;
            let name = a
                .get("io.kubernetes.cri.container-name")
                .or_else(|| a.get("nerdctl/name"))
                .cloned();
            let image = a.get("io.kubernetes.cri.image-name").cloned();
            Some(Identity { name, image })
        }),
        Runtime::Crio => STORAGE_CONTAINERS.iter().find_map(|dir| {
            let a = annotations(&root.join(dir).join(id).join("userdata/config.json"))?;
            Some(Identity {
                name: a.get("io.kubernetes.container.name").cloned(),
                image: a.get("io.kubernetes.cri-o.ImageName").cloned(),
            })
        }),
        Runtime::Podman => STORAGE_CONTAINERS
            .iter()
            .find_map(|dir| from_storage_index(&root.join(dir).join("containers.json"), id)),
        Runtime::Docker => {
            let path = root.join(DOCKER_CONTAINERS).join(id).join("config.v2.json");
            let config: DockerConfigV2 = read_json(&path)?;
            Some(Identity {
                name: config.name.map(|n| n.trim_start_matches('/').to_string()),
                image: config.config.and_then(|c| c.image),
            })
        }
    }?;
    let clean = |v: Option<String>| v.filter(|s| is_printable(s));
    let found = Identity {
        name: clean(found.name),
        image: clean(found.image),
    };
    (found != Identity::default()).then_some(found)
}

/// The `annotations` of an OCI runtime spec.
fn annotations(path: &Path) -> Option<HashMap<String, String>> {
    #[derive(Deserialize)]
    struct OciSpec {
        annotations: Option<HashMap<String, String>>,
    }
    read_json::<OciSpec>(path)?.annotations
}

/// containers/storage's `containers.json`: the entry of `id`, its first name and the
/// `image-name` its `metadata` (a JSON document in a string) records.
fn from_storage_index(path: &Path, id: &str) -> Option<Identity> {
    #[derive(Deserialize)]
    struct Entry {
        id: String,
        #[serde(default)]
        names: Vec<String>,
        metadata: Option<String>,
    }
    #[derive(Deserialize)]
    struct Metadata {
        #[serde(rename = "image-name")]
        image_name: Option<String>,
    }
    let entries: Vec<Entry> = read_json(path)?;
    let e = entries.into_iter().find(|e| e.id == id)?;
    let image = e
        .metadata
        .as_deref()
        .and_then(|m| serde_json::from_str::<Metadata>(m).ok())
        .and_then(|m| m.image_name);
    Some(Identity {
        name: e.names.into_iter().next(),
        image,
    })
}

/// The subset of Docker's config.v2.json read here.
#[derive(Deserialize)]
struct DockerConfigV2 {
    #[serde(rename = "Name")]
    name: Option<String>,
    #[serde(rename = "Config")]
    config: Option<DockerConfig>,
}

#[derive(Deserialize)]
struct DockerConfig {
    #[serde(rename = "Image")]
    image: Option<String>,
}

/// A name or image reference fit for a table cell and a log line: 1 to 255 printable ASCII
/// characters without spaces (runtimes allow nothing else in either).
fn is_printable(s: &str) -> bool {
    !s.is_empty() && s.len() <= 255 && s.bytes().all(|b| b.is_ascii_graphic())
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;

    const ID: &str = "572848f866adc908ce49f5dff8b963c70a245041de22f84737902a4c560b115b";

    struct Root(PathBuf);

    impl Root {
        fn new(tag: &str) -> Root {
            let p =
                std::env::temp_dir().join(format!("connreap-names-{tag}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&p);
            fs::create_dir_all(&p).expect("root");
            Root(p)
        }

        fn write(&self, rel: &str, contents: &str) {
            let p = self.0.join(rel);
            fs::create_dir_all(p.parent().expect("parent")).expect("dirs");
            fs::write(p, contents).expect("write");
        }

        fn fill(&self, runtime: Runtime) -> (Option<String>, Option<String>) {
            let mut c = container(runtime);
            ContainerNames::new(&self.0).fill(&mut c);
            (c.name, c.image)
        }
    }

    impl Drop for Root {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn container(runtime: Runtime) -> Container {
        Container {
            id: ID.into(),
            runtime,
            pod_uid: None,
            pod_name: None,
            pod_namespace: None,
            name: None,
            image: None,
        }
    }

    fn some(name: &str, image: &str) -> (Option<String>, Option<String>) {
        (Some(name.into()), Some(image.into()))
    }

    /// containers.json as podman 4 writes it (the entry of a running container, trimmed).
    fn podman_index() -> String {
        format!(
            r#"[{{"id":"{}","names":["other"],"metadata":"{{}}"}},
               {{"id":"{ID}","names":["wt-k8s-probe"],"image":"46254f6482cc",
                 "metadata":"{{\"image-name\":\"localhost/connreap-test-workload:bookworm\",\"image-id\":\"46254f6482cc\",\"name\":\"wt-k8s-probe\"}}",
                 "created":"2026-12-06T07:54:43.316830225Z"}}]"#,
            "a".repeat(64)
        )
    }

    #[test]
    fn podman_from_the_storage_index() {
        let root = Root::new("podman");
        root.write(
            "var/lib/containers/storage/overlay-containers/containers.json",
            &podman_index(),
        );
        assert_eq!(
            root.fill(Runtime::Podman),
            some("wt-k8s-probe", "localhost/connreap-test-workload:bookworm")
        );
    }

    #[test]
    fn docker_containerd_and_crio() {
        let root = Root::new("docker");
        root.write(
            &format!("var/lib/docker/containers/{ID}/config.v2.json"),
            r#"{"Name":"/web","Config":{"Image":"nginx:1.25","Labels":{}}}"#,
        );
        assert_eq!(root.fill(Runtime::Docker), some("web", "nginx:1.25"));

        let root = Root::new("containerd");
        root.write(
            &format!("run/k3s/containerd/io.containerd.runtime.v2.task/k8s.io/{ID}/config.json"),
            r#"{"annotations":{"io.kubernetes.cri.container-name":"relay","io.kubernetes.cri.image-name":"registry.example/relay:2"}}"#,
        );
        assert_eq!(
            root.fill(Runtime::Containerd),
            some("relay", "registry.example/relay:2")
        );

        let root = Root::new("crio");
        root.write(
            &format!("run/containers/storage/overlay-containers/{ID}/userdata/config.json"),
            r#"{"annotations":{"io.kubernetes.container.name":"db","io.kubernetes.cri-o.ImageName":"quay.io/x/db:1"}}"#,
        );
        assert_eq!(root.fill(Runtime::Crio), some("db", "quay.io/x/db:1"));
        // The cgroupfs driver cannot tell runtimes apart: the others are tried too.
        assert_eq!(root.fill(Runtime::Docker), some("db", "quay.io/x/db:1"));
    }

    #[test]
    fn unknown_malformed_or_unprintable_state_gives_nothing() {
        let root = Root::new("none");
        assert_eq!(root.fill(Runtime::Podman), (None, None));
        root.write(
            "var/lib/containers/storage/overlay-containers/containers.json",
            "not json",
        );
        assert_eq!(root.fill(Runtime::Podman), (None, None));
        root.write(
            &format!("var/lib/docker/containers/{ID}/config.v2.json"),
            r#"{"Name":"/bad name\u001b[31m","Config":{"Image":"nginx"}}"#,
        );
        assert_eq!(root.fill(Runtime::Docker), (None, Some("nginx".into())));
    }

    #[test]
    fn looked_up_once_and_forgotten_by_retain() {
        let root = Root::new("cache");
        let mut names = ContainerNames::new(&root.0);
        let mut c = container(Runtime::Podman);
        names.fill(&mut c);
        assert_eq!(c.name, None);
        // Written after the first lookup: not read while the container is cached...
        root.write(
            "var/lib/containers/storage/overlay-containers/containers.json",
            &podman_index(),
        );
        names.fill(&mut c);
        assert_eq!(c.name, None);
        // ...and read once it was forgotten.
        names.retain(&HashSet::new());
        names.fill(&mut c);
        assert_eq!(c.name.as_deref(), Some("wt-k8s-probe"));
    }
}
