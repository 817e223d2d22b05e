//! Where a finding lives: the network namespace of its sockets and the container of its owner.
//! Findings of different namespaces never share a fingerprint (every pod listens on 8080);
//! findings of connreap's own namespace keep the fingerprint they always had, so existing
//! silences and dashboards still match.
use serde::{ser::SerializeMap, Serializer};

use crate::{containers::Container, table::Netns};

/// A process as a finding's identity names it: its command, then where it runs. In a
/// container, the Kubernetes pod when its name is known (`java@pod:shop/web-7f9c`), else the
/// runtime and short container id (`java@docker:0123456789ab`): both survive a restart of the
/// process, and the pod's name a restart of its container. Outside one, its systemd unit where
/// it has one (`java@gateway.service`). Never its pid.
pub fn identity(comm: &str, unit: Option<&str>, container: Option<&Container>) -> String {
    match (container, unit) {
        (Some(c), _) => match (&c.pod_namespace, &c.pod_name) {
            (Some(ns), Some(name)) => format!("{comm}@pod:{ns}/{name}"),
            _ => format!("{comm}@{}:{}", c.runtime.as_str(), c.short_id()),
        },
        (None, Some(unit)) => format!("{comm}@{unit}"),
        (None, None) => comm.to_string(),
    }
}

/// What a fingerprint gets appended for the namespace: nothing for connreap's own, else
/// `@netns:` and the namespace's label (its name, else its inode).
pub fn ns_part(netns: &Netns) -> String {
    if netns.own {
        String::new()
    } else {
        format!("@netns:{}", netns.label())
    }
}

/// "pod shop/web-7f9c (containerd 0123456789ab)" / "container docker 0123456789ab" /
/// "container podman web (0123456789ab, image nginx:1.25)" when the runtime named it.
pub fn describe_container(c: &Container) -> String {
    match (&c.pod_namespace, &c.pod_name) {
        (Some(ns), Some(name)) => {
            format!("pod {ns}/{name} ({} {})", c.runtime.as_str(), c.short_id())
        }
        _ => match &c.pod_uid {
            Some(uid) => format!("pod uid {uid} ({} {})", c.runtime.as_str(), c.short_id()),
            None => match (&c.name, &c.image) {
                (Some(name), Some(image)) => format!(
                    "container {} {name} ({}, image {image})",
                    c.runtime.as_str(),
                    c.short_id()
                ),
                (Some(name), None) => {
                    format!("container {} {name} ({})", c.runtime.as_str(), c.short_id())
                }
                _ => format!("container {} {}", c.runtime.as_str(), c.short_id()),
            },
        },
    }
}

/// What a summary gets appended to name where the problem is: nothing for connreap's own
/// namespace outside containers, else "; in netns NAME, pod NS/NAME (RUNTIME ID)".
pub fn summary_part(netns: &Netns, container: Option<&Container>) -> String {
    let place = place_text(netns, container);
    if place.is_empty() {
        String::new()
    } else {
        format!("; in {place}")
    }
}

/// Where a process runs, for people: "netns NAME, pod NS/NAME (RUNTIME ID)"; empty in
/// connreap's own namespace outside containers.
pub fn place_text(netns: &Netns, container: Option<&Container>) -> String {
    let mut parts = Vec::new();
    if !netns.own {
        parts.push(format!("netns {}", netns.label()));
    }
    if let Some(c) = container {
        parts.push(describe_container(c));
    }
    parts.join(", ")
}

/// A finding's container as flat fields, named as snapshot rows name them: `container` (the
/// full id), `container_runtime`, `container_name`, `container_image`, `pod_uid`, `pod_name`,
/// `pod_namespace`; nothing without one.
pub fn ser_container<S: Serializer>(c: &Option<Container>, s: S) -> Result<S::Ok, S::Error> {
    let mut m = s.serialize_map(None)?;
    if let Some(c) = c {
        m.serialize_entry("container", &c.id)?;
        m.serialize_entry("container_runtime", c.runtime.as_str())?;
        m.serialize_entry("container_name", &c.name)?;
        m.serialize_entry("container_image", &c.image)?;
        m.serialize_entry("pod_uid", &c.pod_uid)?;
        m.serialize_entry("pod_name", &c.pod_name)?;
        m.serialize_entry("pod_namespace", &c.pod_namespace)?;
    }
    m.end()
}

#[cfg(test)]
pub(crate) mod testutil {
    use std::sync::Arc;

    use crate::{
        containers::{Container, Runtime},
        table::{Netns, Owner, Socket},
    };

    /// A namespace other than connreap's own.
    pub fn netns(inode: u32, name: Option<&str>) -> Arc<Netns> {
        Arc::new(Netns {
            inode,
            name: name.map(Box::from),
            own: false,
            keepalive: None,
        })
    }

    /// A container whose id starts with `prefix` (12 characters), in pod `pod` when given.
    pub fn container(prefix: &str, runtime: Runtime, pod: Option<(&str, &str)>) -> Container {
        Container {
            id: format!("{prefix:0<12}{}", "f".repeat(52)),
            runtime,
            pod_uid: pod.map(|_| "11111111-2222-3333-4444-555555555555".to_string()),
            pod_name: pod.map(|(_, n)| n.to_string()),
            pod_namespace: pod.map(|(ns, _)| ns.to_string()),
            name: None,
            image: None,
        }
    }

    /// `s` moved into namespace `ns`, its owner into container `c`.
    pub fn place(mut s: Socket, ns: &Arc<Netns>, c: Option<&Container>) -> Socket {
        s.netns = ns.clone();
        if let (Some(c), Some(o)) = (c, &s.owner) {
            s.owner = Some(Arc::new(Owner {
                container: Some(Arc::new(c.clone())),
                ..(**o).clone()
            }));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::{testutil::*, *};
    use crate::containers::Runtime;

    #[test]
    fn a_named_container_is_described_by_name_and_image() {
        let mut c = container("0123456789ab", Runtime::Podman, None);
        assert_eq!(describe_container(&c), "container podman 0123456789ab");
        c.name = Some("web".into());
        assert_eq!(
            describe_container(&c),
            "container podman web (0123456789ab)"
        );
        c.image = Some("nginx:1.25".into());
        assert_eq!(
            describe_container(&c),
            "container podman web (0123456789ab, image nginx:1.25)"
        );
        // The fingerprint does not change with the name.
        assert_eq!(identity("java", None, Some(&c)), "java@podman:0123456789ab");
        let json = serde_json::to_value(Wrap(Some(c))).expect("json");
        assert_eq!(json["container_name"], "web");
        assert_eq!(json["container_image"], "nginx:1.25");
    }

    #[derive(serde::Serialize)]
    struct Wrap(#[serde(serialize_with = "ser_container")] Option<Container>);

    #[test]
    fn identities_name_pod_or_container_never_pid() {
        let pod = container("aaaa", Runtime::Containerd, Some(("shop", "web-1")));
        let bare = container("bbbb", Runtime::Docker, None);
        assert_eq!(identity("java", None, None), "java");
        assert_eq!(
            identity("java", Some("gw.service"), None),
            "java@gw.service"
        );
        assert_eq!(
            identity("java", Some("cri-containerd-aaaa.scope"), Some(&pod)),
            "java@pod:shop/web-1"
        );
        assert_eq!(
            identity("java", Some("docker-bbbb.scope"), Some(&bare)),
            "java@docker:bbbb00000000"
        );
    }

    #[test]
    fn own_namespace_adds_nothing_others_their_label() {
        assert_eq!(ns_part(&Netns::unknown()), "");
        assert_eq!(summary_part(&Netns::unknown(), None), "");
        assert_eq!(ns_part(&netns(4026532001, Some("blue"))), "@netns:blue");
        assert_eq!(ns_part(&netns(4026532001, None)), "@netns:4026532001");
        let c = container("cccc", Runtime::Podman, None);
        assert_eq!(
            summary_part(&netns(7, Some("blue")), Some(&c)),
            "; in netns blue, container podman cccc00000000"
        );
        let p = container("dddd", Runtime::Crio, Some(("shop", "web-2")));
        assert_eq!(
            summary_part(&Netns::unknown(), Some(&p)),
            "; in pod shop/web-2 (crio dddd00000000)"
        );
    }
}
