//! What the daemon tells webhook receivers: alert lifecycle events and reclaim rounds, as typed
//! values that `webhook` renders per receiver format.
use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::{
    detect::{Finding, QuotaRef, MAX_SOCKETS},
    present::{ser_rfc3339, ser_rfc3339_opt},
    reclaim::{exec::RoundResult, Decision, Mode, Outcome},
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Firing,
    Resolved,
}

/// A finding as sent to webhooks and served on /v1/findings.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Alert {
    #[serde(flatten)]
    pub finding: Finding,
    pub status: Status,
    pub host: String,
    #[serde(serialize_with = "ser_rfc3339")]
    pub started_at: DateTime<Utc>,
    #[serde(
        serialize_with = "ser_rfc3339_opt",
        skip_serializing_if = "Option::is_none"
    )]
    pub ended_at: Option<DateTime<Utc>>,
    /// Resolved alerts: how long the alert fired, in seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_secs: Option<f64>,
    /// Updates: what changed since the last notification (`count 8 -> 59`,
    /// `verdict pending -> leak`, `new process node pid 812`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub change: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Notification {
    /// A finding started firing.
    Fired(Alert),
    /// A firing finding, sent again (its verdict changed, or the repeat interval passed).
    Updated(Alert),
    /// A finding cleared; carries its last observed content.
    Resolved(Alert),
    /// Unchanged and not due for an update: re-posted to Alertmanager receivers only, which
    /// forget alerts that are not re-posted.
    Refresh(Alert),
    /// A reclaim round closed sockets.
    Reclaimed(Reclaimed),
}

impl Notification {
    /// What a log line names this notification by.
    pub fn key(&self) -> &str {
        match self {
            Notification::Fired(a)
            | Notification::Updated(a)
            | Notification::Resolved(a)
            | Notification::Refresh(a) => &a.finding.fingerprint,
            Notification::Reclaimed(r) => &r.policy,
        }
    }
}

/// A process whose sockets a round closed, in one network namespace.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReclaimedProcess {
    pub pid: Option<u32>,
    pub comm: String,
    pub count: usize,
    /// The network namespace of those sockets: its inode, and its name when it has one.
    pub netns: u32,
    pub netns_name: Option<String>,
    /// The full id of the container the process runs in, when it runs in one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
}

/// A network namespace a round closed sockets in.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReclaimedNamespace {
    pub netns: u32,
    pub netns_name: Option<String>,
    /// What alerts and metrics call it: its name, "host" for connreap's own, else its inode.
    pub label: String,
    pub count: usize,
    /// The full ids of the containers whose sockets were closed there (sorted).
    pub containers: Vec<String>,
}

/// The `reclaimed` event: one per round that closed anything.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Reclaimed {
    /// Always "reclaimed" (the JSON body's kind, like a finding's).
    pub kind: &'static str,
    /// Always "firing": an event, it never resolves.
    pub status: &'static str,
    pub host: String,
    pub policy: String,
    pub mode: Mode,
    pub count: usize,
    pub summary: String,
    pub processes: Vec<ReclaimedProcess>,
    /// Where the closed sockets were, one entry per network namespace (by inode).
    pub namespaces: Vec<ReclaimedNamespace>,
    /// The destroy mechanism that closed them (`netlink-sock-destroy`, `bpf-sock-destroy`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mechanism: Option<&'static str>,
    pub quota: Option<QuotaRef>,
    /// The killed sockets' decisions (at most MAX_SOCKETS).
    pub sockets: Vec<Decision>,
    #[serde(serialize_with = "ser_rfc3339")]
    pub time: DateTime<Utc>,
}

/// A decision's namespace as alerts name it: its name, "host" for connreap's own, else its
/// inode (as [`crate::table::Netns::label`]).
fn netns_label(d: &Decision) -> String {
    match (&d.netns_name, d.netns_own) {
        (Some(n), _) => n.clone(),
        (None, true) => "host".to_string(),
        (None, false) => d.netns.to_string(),
    }
}

/// What the summary appends to say where the sockets were: nothing when all were in
/// connreap's own namespace outside containers; `; in netns NAME[, container ID]` for one
/// namespace; `; in netns A (2), netns B (3)` for several.
fn where_part(namespaces: &[ReclaimedNamespace], own: &[bool]) -> String {
    if namespaces.iter().all(|n| n.containers.is_empty()) && own.iter().all(|o| *o) {
        return String::new();
    }
    let short = |id: &str| id.get(..12).unwrap_or(id).to_string();
    match namespaces {
        [n] => {
            let mut parts = Vec::new();
            if !own.first().copied().unwrap_or(true) {
                parts.push(format!("netns {}", n.label));
            }
            match n.containers.as_slice() {
                [] => {}
                [c] => parts.push(format!("container {}", short(c))),
                cs => parts.push(format!("{} containers", cs.len())),
            }
            format!("; in {}", parts.join(", "))
        }
        ns => {
            let each: Vec<String> = ns
                .iter()
                .map(|n| format!("netns {} ({})", n.label, n.count))
                .collect();
            format!("; in {}", each.join(", "))
        }
    }
}

impl Reclaimed {
    /// The event for a round, if it closed anything.
    pub fn from_round(host: &str, round: &RoundResult, time: DateTime<Utc>) -> Option<Reclaimed> {
        let killed: Vec<&Decision> = round
            .decisions
            .iter()
            .filter(|d| d.result == Outcome::Killed)
            .collect();
        let n = killed.len();
        if n == 0 {
            return None;
        }
        type Owner<'a> = (Option<u32>, &'a str, u32, Option<&'a str>);
        let mut owners: BTreeMap<Owner, (Option<&str>, usize)> = BTreeMap::new();
        // By inode: (the first decision seen there, its count, its containers).
        let mut spaces: BTreeMap<u32, (&Decision, usize, BTreeSet<&str>)> = BTreeMap::new();
        for d in &killed {
            let key = (d.pid, d.comm.as_str(), d.netns, d.container.as_deref());
            owners.entry(key).or_insert((d.netns_name.as_deref(), 0)).1 += 1;
            let space = spaces.entry(d.netns).or_insert((d, 0, BTreeSet::new()));
            space.1 += 1;
            space.2.extend(d.container.as_deref());
        }
        let own: Vec<bool> = spaces.values().map(|(d, _, _)| d.netns_own).collect();
        let namespaces: Vec<ReclaimedNamespace> = spaces
            .into_values()
            .map(|(d, count, containers)| ReclaimedNamespace {
                netns: d.netns,
                netns_name: d.netns_name.clone(),
                label: netns_label(d),
                count,
                containers: containers.into_iter().map(String::from).collect(),
            })
            .collect();
        let quota_text = round
            .quota
            .as_ref()
            .map(|q| format!(" ({} quota at {}/{} before)", q.name, q.used, q.limit))
            .unwrap_or_default();
        let mut mechanisms: Vec<&'static str> = killed.iter().filter_map(|d| d.mechanism).collect();
        mechanisms.sort_unstable();
        mechanisms.dedup();
        Some(Reclaimed {
            kind: "reclaimed",
            status: "firing",
            host: host.to_string(),
            policy: round.policy.clone(),
            mode: round.mode.clone(),
            count: n,
            summary: format!(
                "policy {} closed {n} socket{}{quota_text}{}",
                round.policy,
                if n == 1 { "" } else { "s" },
                where_part(&namespaces, &own)
            ),
            processes: owners
                .into_iter()
                .map(
                    |((pid, comm, netns, container), (netns_name, count))| ReclaimedProcess {
                        pid,
                        comm: comm.to_string(),
                        count,
                        netns,
                        netns_name: netns_name.map(String::from),
                        container: container.map(String::from),
                    },
                )
                .collect(),
            namespaces,
            mechanism: match mechanisms.as_slice() {
                [m] => Some(*m),
                _ => None,
            },
            quota: round.quota.clone(),
            sockets: killed.into_iter().take(MAX_SOCKETS).cloned().collect(),
            time,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        config::parse,
        containers::Runtime,
        detect::{
            scope_testutil::{container, netns, place},
            testutil::sock,
        },
        reclaim::decision,
        table::{Netns, Socket, TcpState},
    };

    /// A killed decision of policy "leaks" about `s`, closed by `mechanism`.
    fn killed(s: &Socket, mechanism: &'static str) -> Decision {
        let text = "[[policy]]\nname = \"leaks\"\nmode = \"enforce\"\ntrigger = \"always\"\n\
                    select = { comm = \"java\", states = [\"CLOSE_WAIT\"] }\n";
        let p = parse(text, "t").unwrap().policy.remove(0);
        let mut d = decision(&p, &Mode::Enforce, s, &None, Outcome::Killed, None, 1);
        d.mechanism = Some(mechanism);
        d
    }

    fn round(decisions: Vec<Decision>) -> RoundResult {
        RoundResult {
            policy: "leaks".into(),
            mode: Mode::Enforce,
            note: None,
            quota: None,
            decisions,
            audit_error: None,
        }
    }

    /// `n` CLOSE_WAIT sockets of java `pid` on port 8080 (the same port in every namespace).
    fn leak(pid: u32, n: u16) -> Vec<Socket> {
        (0..n)
            .map(|i| {
                let peer = format!("127.0.0.1:{}", 40000 + i);
                sock(pid, "java", "127.0.0.1:8080", &peer, TcpState::CloseWait)
            })
            .collect()
    }

    /// Two namespaces, one a pod's: each process entry and each namespace entry says where,
    /// the summary names both, the old fields stay as they were.
    #[test]
    fn from_round_names_the_namespaces_it_closed_sockets_in() {
        let (a, b) = (netns(4026532001, Some("cni-a")), netns(4026532002, None));
        let c = container("abcdef", Runtime::Containerd, Some(("shop", "web-1")));
        let mut decisions: Vec<Decision> = leak(7, 2)
            .into_iter()
            .map(|s| killed(&place(s, &a, Some(&c)), "bpf-sock-destroy"))
            .collect();
        decisions.extend(
            leak(8, 3)
                .into_iter()
                .map(|s| killed(&place(s, &b, None), "bpf-sock-destroy")),
        );
        // A skipped decision elsewhere names no namespace of the event.
        let mut skipped = killed(&place(leak(9, 1).remove(0), &netns(5, None), None), "x");
        skipped.result = Outcome::Skipped;
        decisions.push(skipped);
        let time = "2026-12-05T10:00:00Z".parse().unwrap();
        let r = Reclaimed::from_round("node-1", &round(decisions), time).unwrap();
        assert_eq!(r.count, 5);
        assert_eq!(
            r.summary,
            "policy leaks closed 5 sockets; in netns cni-a (2), netns 4026532002 (3)"
        );
        assert_eq!(r.mechanism, Some("bpf-sock-destroy"));
        let j = serde_json::to_value(&r).unwrap();
        assert_eq!(
            j["processes"],
            serde_json::json!([
                {"pid": 7, "comm": "java", "count": 2, "netns": 4026532001u32,
                 "netns_name": "cni-a", "container": c.id},
                {"pid": 8, "comm": "java", "count": 3, "netns": 4026532002u32, "netns_name": null},
            ])
        );
        assert_eq!(
            j["namespaces"],
            serde_json::json!([
                {"netns": 4026532001u32, "netns_name": "cni-a", "label": "cni-a", "count": 2,
                 "containers": [c.id]},
                {"netns": 4026532002u32, "netns_name": null, "label": "4026532002", "count": 3,
                 "containers": []},
            ])
        );
        for key in [
            "kind", "status", "host", "policy", "mode", "count", "quota", "time",
        ] {
            assert!(j.get(key).is_some(), "{key} missing: {j}");
        }
        let sockets = j["sockets"].as_array().unwrap();
        assert_eq!(sockets.len(), 5);
        assert!(sockets.iter().all(|d| d["mechanism"] == "bpf-sock-destroy"));
        assert_eq!(sockets[0]["netns_name"], "cni-a");
        assert!(sockets[0].get("netns_own").is_none(), "{}", sockets[0]);
    }

    /// One namespace: the summary names it and the container; connreap's own namespace
    /// outside containers: the summary is as it always was.
    #[test]
    fn from_round_summary_names_one_namespace_or_none_for_the_own() {
        let a = netns(4026532001, Some("cni-a"));
        let c = container("abcdef", Runtime::Docker, None);
        let decisions = leak(7, 1)
            .into_iter()
            .map(|s| killed(&place(s, &a, Some(&c)), "netlink-sock-destroy"))
            .collect();
        let time = "2026-12-05T10:00:00Z".parse().unwrap();
        let r = Reclaimed::from_round("node-1", &round(decisions), time).unwrap();
        assert_eq!(
            r.summary,
            "policy leaks closed 1 socket; in netns cni-a, container abcdef000000"
        );
        let own = leak(7, 2)
            .into_iter()
            .map(|s| killed(&place(s, &Netns::unknown(), None), "netlink-sock-destroy"))
            .collect();
        let r = Reclaimed::from_round("node-1", &round(own), time).unwrap();
        assert_eq!(r.summary, "policy leaks closed 2 sockets");
        assert_eq!(r.namespaces[0].label, "host");
        assert!(Reclaimed::from_round("node-1", &round(Vec::new()), time).is_none());
    }
}
