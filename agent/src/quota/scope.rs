//! Which sockets a quota counts: those of the network namespace it names.
//!
//! A `[[quota]]` without `netns`/`container` is connreap's own namespace; `netns = "NAME|INODE|
//! host"` is that namespace. `container = "PREFIX"` is the namespace of that container, not its
//! processes alone: a quota limits what arrives on a port of the namespace, whoever holds the
//! socket (a pod's sidecar, a connection still in the listener's accept queue, which has no
//! owner yet). The container's namespaces are read off the table (the namespaces its
//! processes' sockets live in), so one with no socket has none here; its source is polled in
//! the namespace /proc names for it (see `poller`).
use std::sync::Arc;

use crate::{
    config::{Place, QuotaConfig},
    table::{Netns, Socket},
};

/// The namespace(s) of one quota, resolved against a table.
#[derive(Debug, Clone)]
pub struct Scope<'a> {
    place: Option<Place<'a>>,
    /// For a container: the namespaces its processes' sockets live in.
    spaces: Vec<Arc<Netns>>,
}

impl<'a> Scope<'a> {
    /// The scope of `cfg` in `table`.
    pub fn of(cfg: &'a QuotaConfig, table: &[Socket]) -> Scope<'a> {
        Scope::at(cfg.place(), table)
    }

    /// The scope of a place (None: connreap's own namespace) in `table`.
    pub fn at(place: Option<Place<'a>>, table: &[Socket]) -> Scope<'a> {
        let mut spaces: Vec<Arc<Netns>> = Vec::new();
        if let Some(Place::Container(prefix)) = place {
            for s in table {
                let theirs = s.container_id().is_some_and(|id| id.starts_with(prefix));
                if theirs && !spaces.iter().any(|n| n.inode == s.netns.inode) {
                    spaces.push(s.netns.clone());
                }
            }
        }
        Scope { place, spaces }
    }

    /// Whether `s` is one of the quota's sockets' namespace.
    pub fn contains(&self, s: &Socket) -> bool {
        match self.place {
            None => s.netns.own,
            Some(Place::Netns(wanted)) => s.netns.matches(wanted),
            Some(Place::Container(_)) => self.spaces.iter().any(|n| n.inode == s.netns.inode),
        }
    }

    /// What a quota finding's fingerprint gets appended for the place the quota names:
    /// nothing for connreap's own namespace (the fingerprints they always had), else
    /// `@netns:NAME` or `@container:PREFIX` as configured (stable whatever the table holds).
    pub fn fingerprint_part(&self) -> String {
        match self.place {
            None => String::new(),
            Some(Place::Netns(n)) => format!("@netns:{n}"),
            Some(Place::Container(c)) => format!("@container:{c}"),
        }
    }

    /// Where, for a finding's summary: None for connreap's own namespace (the usual case, said
    /// nothing about), else `in netns blue` / `in the netns of container 3f2a9c (4026532301)`.
    pub fn describe(&self) -> Option<String> {
        match self.place? {
            Place::Netns(n) => Some(format!("in netns {n}")),
            Place::Container(c) if self.spaces.is_empty() => Some(format!(
                "in the netns of container {c} (none of its processes holds a socket)"
            )),
            Place::Container(c) => {
                let labels: Vec<String> = self.spaces.iter().map(|n| n.label()).collect();
                Some(format!(
                    "in the netns of container {c} ({})",
                    labels.join(", ")
                ))
            }
        }
    }
}

/// `s` moved to namespace `ns` (an inode; 1 is connreap's own, 2 is named "blue") and, when
/// `container` is given and it has an owner, into that container.
#[cfg(test)]
pub(crate) fn placed(mut s: Socket, ns: u32, container: Option<&str>) -> Socket {
    use crate::containers::{Container, Runtime};
    s.netns = Arc::new(Netns {
        inode: ns,
        name: (ns == 2).then(|| "blue".into()),
        own: ns == 1,
        keepalive: None,
    });
    if let Some(owner) = s.owner.as_mut() {
        let mut o = (**owner).clone();
        o.container = container.map(|id| {
            Arc::new(Container {
                id: id.to_string(),
                runtime: Runtime::Docker,
                pod_uid: None,
                pod_name: None,
                pod_namespace: None,
                name: None,
                image: None,
            })
        });
        *owner = Arc::new(o);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{detect::testutil::sock, table::TcpState};

    fn in_ns(ns: u32, container: Option<&str>) -> Socket {
        let s = sock(
            10,
            "relay",
            "127.0.0.1:20080",
            "127.0.0.1:40000",
            TcpState::Established,
        );
        placed(s, ns, container)
    }

    fn table() -> Vec<Socket> {
        let c = "3f2a".repeat(16);
        let mut unowned = in_ns(3, None);
        unowned.owner = None; // still in the listener's accept queue, in the container's netns
        vec![
            in_ns(1, None),
            in_ns(2, None),
            in_ns(3, Some(&c)),
            unowned,
            in_ns(4, Some(&"ab".repeat(32))),
        ]
    }

    fn members(place: Option<Place<'_>>) -> Vec<usize> {
        let t = table();
        let scope = Scope::at(place, &t);
        (0..t.len()).filter(|i| scope.contains(&t[*i])).collect()
    }

    #[test]
    fn a_quota_counts_only_its_namespace() {
        assert_eq!(members(None), vec![0], "no netns/container: connreap's own");
        assert_eq!(members(Some(Place::Netns("host"))), vec![0]);
        assert_eq!(members(Some(Place::Netns("blue"))), vec![1]);
        assert_eq!(members(Some(Place::Netns("2"))), vec![1]);
        assert_eq!(members(Some(Place::Netns("9"))), Vec::<usize>::new());
        // A container: its namespace, including the socket nobody holds yet.
        assert_eq!(members(Some(Place::Container("3f2a3f"))), vec![2, 3]);
        assert_eq!(members(Some(Place::Container("abab"))), vec![4]);
        assert_eq!(members(Some(Place::Container("ffff"))), Vec::<usize>::new());
    }

    #[test]
    fn the_place_is_described() {
        let t = table();
        assert_eq!(Scope::at(None, &t).describe(), None);
        let d = |p| Scope::at(Some(p), &t).describe().unwrap();
        assert_eq!(d(Place::Netns("blue")), "in netns blue");
        assert_eq!(
            d(Place::Container("3f2a")),
            "in the netns of container 3f2a (3)"
        );
        assert_eq!(
            d(Place::Container("ffff")),
            "in the netns of container ffff (none of its processes holds a socket)"
        );
    }
}
