//! reconnect_storm: new outbound connections per second per (process, peer service port),
//! from the kernel's transition events, window by window (one window per scan). The process is
//! named as `snapshot` names it (its thread-group leader's comm); the connecting threads'
//! names, where they differ, are a detail of the summary.
//!
//! Transition events carry the connecting socket's network namespace (its inode, named as the
//! scan names it) and the process's container as read from /proc/PID/cgroup when the events
//! were drained: a storm of short-lived connections, none of which a scan ever sees, is placed
//! where it happens. Where an event carries no namespace (inode 0) or no container was read
//! (the process had gone), the process's sockets in the scan's table stand in (its sockets to
//! the storm's port, else any of its sockets), looked up once per process.
use std::{
    collections::{BTreeMap, BTreeSet, VecDeque},
    sync::Arc,
    time::Duration,
};

use rustc_hash::FxHashMap;

use super::{identity, Detail, Finding, ProcessCount};
use crate::{
    config::DetectConfig,
    containers::Container,
    table::{Netns, Socket},
};

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConnKey {
    pub pid: u32,
    /// The process's name.
    pub comm: String,
    pub port: u16,
    /// The inode of the connecting sockets' network namespace (0: not known).
    pub netns: u32,
}

/// At most this many thread names are kept per key.
const MAX_THREADS: usize = 4;

#[derive(Debug, Default)]
pub struct StormTracker {
    current: BTreeMap<ConnKey, u64>,
    /// Rates of the last windows, newest last.
    history: BTreeMap<ConnKey, VecDeque<f64>>,
    firing: BTreeSet<ConnKey>,
    /// Names of the threads that made the connections, where not the process's own.
    threads: BTreeMap<ConnKey, BTreeSet<String>>,
    /// Where each tracked process lives, from its sockets (see the module's doc).
    places: BTreeMap<u32, Place>,
    /// connreap's own namespace as the last table named it: the place of a process none of
    /// whose sockets was ever seen.
    own: Option<Arc<Netns>>,
    /// Each tracked process's container as read when its events were drained.
    containers: BTreeMap<u32, Arc<Container>>,
    /// The namespaces of the last scan by inode, and those of tracked keys seen before (a
    /// namespace gone since keeps the name it had while its storm is tracked).
    namespaces: FxHashMap<u32, Arc<Netns>>,
}

/// A process's network namespace and container.
#[derive(Debug, Clone)]
struct Place {
    netns: Arc<Netns>,
    container: Option<Arc<Container>>,
}

impl StormTracker {
    /// One active open (CLOSE -> SYN_SENT, in the connecting process's context).
    #[cfg(test)]
    pub fn record_connect(&mut self, key: ConnKey) {
        let thread = key.comm.clone();
        self.record_connects(key, &thread, 1);
    }

    /// `n` active opens of one key, made by a thread named `thread`.
    pub fn record_connects(&mut self, key: ConnKey, thread: &str, n: u64) {
        if thread != key.comm {
            let names = self.threads.entry(key.clone()).or_default();
            if names.len() < MAX_THREADS {
                names.insert(thread.to_string());
            }
        }
        *self.current.entry(key).or_default() += n;
    }

    /// Process `pid` runs in `container` (None: in none, or gone), as read with its events.
    pub fn record_container(&mut self, pid: u32, container: Option<Arc<Container>>) {
        match container {
            Some(c) => self.containers.insert(pid, c),
            None => self.containers.remove(&pid),
        };
    }

    /// The namespaces the scan at the window's end found, to name those of the keys.
    pub fn set_namespaces(&mut self, spaces: &[Arc<Netns>]) {
        let used: BTreeSet<u32> = self
            .current
            .keys()
            .chain(self.history.keys())
            .map(|k| k.netns)
            .collect();
        self.namespaces.retain(|inode, _| used.contains(inode));
        for ns in spaces {
            self.namespaces.insert(ns.inode, ns.clone());
        }
    }

    /// End the current window of length `window`; update rates and firing state, and place
    /// processes not placed yet from `table` (the scan at the window's end).
    pub fn close_window(&mut self, window: Duration, cfg: &DetectConfig, table: &[Socket]) {
        self.place(table);
        let secs = window.as_secs_f64().max(0.001);
        let keep = cfg.storm_growth_windows + 1;
        let mut keys: BTreeSet<ConnKey> = self.history.keys().cloned().collect();
        keys.extend(self.current.keys().cloned());
        for key in keys {
            let rate = self.current.get(&key).copied().unwrap_or(0) as f64 / secs;
            let h = self.history.entry(key.clone()).or_default();
            h.push_back(rate);
            while h.len() > keep {
                h.pop_front();
            }
            let growing = h.len() == keep && h.iter().zip(h.iter().skip(1)).all(|(a, b)| b > a);
            if rate >= cfg.storm_rate && (growing || self.firing.contains(&key)) {
                self.firing.insert(key.clone());
            } else {
                self.firing.remove(&key);
            }
            if h.iter().all(|r| *r == 0.0) {
                self.history.remove(&key);
                self.threads.remove(&key);
            }
        }
        self.current.clear();
        // Forget processes no longer tracked (their pids may be reused).
        let tracked: BTreeSet<u32> = self.history.keys().map(|k| k.pid).collect();
        self.places.retain(|pid, _| tracked.contains(pid));
        self.containers.retain(|pid, _| tracked.contains(pid));
    }

    /// Place the tracked processes not placed yet: one pass over `table`, only when there are
    /// some.
    fn place(&mut self, table: &[Socket]) {
        if let Some(s) = table.iter().find(|s| s.netns.own) {
            self.own = Some(s.netns.clone());
        }
        let mut wanted: FxHashMap<u32, Vec<u16>> = FxHashMap::default();
        for k in self.current.keys().chain(self.history.keys()) {
            if !self.places.contains_key(&k.pid) {
                wanted.entry(k.pid).or_default().push(k.port);
            }
        }
        if wanted.is_empty() {
            return;
        }
        // Per pid: a socket to one of its storm ports if any (true), else its first socket.
        let mut found: FxHashMap<u32, (bool, &Socket)> = FxHashMap::default();
        for s in table {
            let Some((pid, ports)) = s.pid().and_then(|p| Some((p, wanted.get(&p)?))) else {
                continue;
            };
            let to_port = ports.contains(&s.peer.port());
            let slot = found.entry(pid).or_insert((to_port, s));
            if to_port && !slot.0 {
                *slot = (true, s);
            }
        }
        for (pid, (_, s)) in found {
            let container = s.owner.as_ref().and_then(|o| o.container.clone());
            let place = Place {
                netns: s.netns.clone(),
                container,
            };
            self.places.insert(pid, place);
        }
    }

    /// Where `key`'s connections are made: the namespace its events name and the container its
    /// process was read in; else where its process's sockets were, else connreap's own
    /// namespace.
    fn place_of(&self, key: &ConnKey) -> Place {
        let by_table = self.places.get(&key.pid).cloned().unwrap_or_else(|| Place {
            netns: self.own.clone().unwrap_or_else(Netns::unknown),
            container: None,
        });
        let netns = match key.netns {
            0 => by_table.netns,
            inode => self.namespaces.get(&inode).cloned().unwrap_or_else(|| {
                // Not among the scan's namespaces (gone since): named by its inode.
                Arc::new(Netns {
                    inode,
                    ..Netns::default()
                })
            }),
        };
        let container = self
            .containers
            .get(&key.pid)
            .cloned()
            .or(by_table.container);
        Place { netns, container }
    }

    pub fn findings(&self, cfg: &DetectConfig) -> Vec<Finding> {
        self.firing
            .iter()
            .map(|key| {
                let rates: Vec<f64> = self.history.get(key).map(|h| h.iter().copied().collect()).unwrap_or_default();
                let rate = rates.last().copied().unwrap_or(0.0);
                let shown: Vec<String> = rates.iter().map(|r| format!("{r:.0}")).collect();
                let threads = match self.threads.get(key) {
                    Some(t) if !t.is_empty() => format!(
                        "; connecting thread{}: {}",
                        if t.len() == 1 { "" } else { "s" },
                        t.iter().cloned().collect::<Vec<_>>().join(", ")
                    ),
                    _ => String::new(),
                };
                let place = self.place_of(key);
                let container = place.container.as_deref();
                let mut f = Finding::new(
                    Detail::ReconnectStorm {
                        rate_per_sec: (rate * 10.0).round() / 10.0,
                    },
                    &format!("{}:{}", identity(&key.comm, None, container), key.port),
                    format!(
                        "{} pid {} opens {rate:.0} new connections/s to port {} (threshold {:.0}/s; last windows {}/s){threads}",
                        key.comm, key.pid, key.port, cfg.storm_rate, shown.join(" → ")
                    ),
                )
                .scoped(&place.netns, container);
                f.service_port = Some(key.port);
                f.count = rate.round() as usize;
                f.processes = vec![ProcessCount {
                    pid: Some(key.pid),
                    comm: key.comm.clone(),
                    unit: None,
                    count: rate.round() as usize,
                    container: container.map(|c| c.id.clone()),
                    ..Default::default()
                }];
                f
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> ConnKey {
        ConnKey {
            pid: 5,
            comm: "client".into(),
            port: 443,
            netns: 0,
        }
    }

    fn window(t: &mut StormTracker, n: u64, cfg: &DetectConfig) {
        for _ in 0..n {
            t.record_connect(key());
        }
        t.close_window(Duration::from_secs(1), cfg, &[]);
    }

    #[test]
    fn fires_when_high_and_growing_and_holds_while_high() {
        let cfg = DetectConfig::default();
        let mut t = StormTracker::default();
        window(&mut t, 60, &cfg);
        window(&mut t, 60, &cfg);
        window(&mut t, 60, &cfg);
        assert!(t.findings(&cfg).is_empty(), "steady 60/s is not growing");
        window(&mut t, 80, &cfg);
        window(&mut t, 120, &cfg);
        let f = t.findings(&cfg);
        assert_eq!(f.len(), 1);
        assert_eq!(
            f[0].detail,
            Detail::ReconnectStorm {
                rate_per_sec: 120.0
            }
        );
        assert!(
            f[0].summary
                .contains("client pid 5 opens 120 new connections/s to port 443"),
            "{}",
            f[0].summary
        );
        window(&mut t, 100, &cfg);
        assert_eq!(
            t.findings(&cfg).len(),
            1,
            "still above threshold: keeps firing"
        );
        window(&mut t, 10, &cfg);
        assert!(t.findings(&cfg).is_empty(), "resolved below threshold");
    }

    #[test]
    fn names_the_process_with_its_connecting_threads_as_a_detail() {
        let cfg = DetectConfig::default();
        let mut t = StormTracker::default();
        for n in [60, 80, 120] {
            t.record_connects(key(), "storm-worker", n);
            t.record_connects(key(), "client", 1);
            t.close_window(Duration::from_secs(1), &cfg, &[]);
        }
        let f = t.findings(&cfg);
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].processes[0].comm, "client");
        assert!(
            f[0].summary
                .starts_with("client pid 5 opens 121 new connections/s to port 443"),
            "{}",
            f[0].summary
        );
        assert!(
            f[0].summary.ends_with("; connecting thread: storm-worker"),
            "{}",
            f[0].summary
        );
    }

    /// Events carry no namespace: the process is placed by its sockets in the table (its
    /// sockets to the storm's port first), once; without any, in connreap's own namespace.
    #[test]
    fn processes_are_placed_by_their_sockets() {
        use crate::{
            containers::Runtime,
            detect::{
                scope_testutil::{container, netns, place},
                testutil::sock,
            },
            table::TcpState,
        };
        let cfg = DetectConfig::default();
        let pod = netns(41, Some("cni-x"));
        let other = netns(42, Some("elsewhere"));
        let c = container("c0c0", Runtime::Crio, Some(("shop", "client-1")));
        let to_port = place(
            sock(
                5,
                "client",
                "10.0.0.2:50000",
                "10.0.0.9:443",
                TcpState::SynSent,
            ),
            &pod,
            Some(&c),
        );
        let unrelated = place(
            sock(
                5,
                "client",
                "10.1.0.2:50001",
                "10.1.0.9:80",
                TcpState::Established,
            ),
            &other,
            Some(&c),
        );
        let table = [unrelated, to_port];
        let mut t = StormTracker::default();
        for n in [60, 80, 120] {
            for _ in 0..n {
                t.record_connect(key());
            }
            // The table is seen at the first window only: the place sticks.
            let seen: &[Socket] = if n == 60 { &table } else { &[] };
            t.close_window(Duration::from_secs(1), &cfg, seen);
        }
        let f = t.findings(&cfg);
        assert_eq!(f.len(), 1);
        assert_eq!(
            f[0].fingerprint,
            "reconnect_storm:client@pod:shop/client-1:443@netns:cni-x"
        );
        assert_eq!(
            (f[0].netns, f[0].netns_name.as_deref()),
            (41, Some("cni-x"))
        );
        assert_eq!(f[0].processes[0].container.as_deref(), Some(c.id.as_str()));
        assert!(
            f[0].summary.contains("; in netns cni-x, pod shop/client-1"),
            "{}",
            f[0].summary
        );
        // Never seen in the table: connreap's own namespace, the fingerprint as always.
        let mut t = StormTracker::default();
        for n in [60, 80, 120] {
            window(&mut t, n, &cfg);
        }
        let f = t.findings(&cfg);
        assert_eq!(f[0].fingerprint, "reconnect_storm:client:443");
        assert_eq!(f[0].netns_label(), "host");
    }

    /// Events name the namespace and the container: a storm of connections no scan ever saw
    /// is placed in its pod, apart from a host process of the same name and port; a namespace
    /// gone since keeps the name the scans knew it by.
    #[test]
    fn storms_are_placed_where_their_events_say() {
        use crate::{
            containers::Runtime,
            detect::scope_testutil::{container, netns},
        };
        let cfg = DetectConfig::default();
        let host = Arc::new(Netns {
            inode: 40,
            own: true,
            ..Netns::default()
        });
        let pod = netns(41, Some("cni-x"));
        let c = Arc::new(container(
            "c0c0",
            Runtime::Containerd,
            Some(("shop", "client-1")),
        ));
        let in_pod = ConnKey { netns: 41, ..key() };
        let on_host = ConnKey {
            pid: 6,
            netns: 40,
            ..key()
        };
        let mut t = StormTracker::default();
        for n in [60, 80, 120] {
            t.record_container(5, Some(c.clone()));
            t.record_connects(in_pod.clone(), "client", n);
            t.record_container(6, None);
            t.record_connects(on_host.clone(), "client", n);
            // The pod's namespace is seen at the first scan only (say its last process left
            // it after): the name sticks while the storm is tracked.
            let spaces = if n == 60 {
                vec![host.clone(), pod.clone()]
            } else {
                vec![host.clone()]
            };
            t.set_namespaces(&spaces);
            // No socket of either process is in the table: short-lived connections.
            t.close_window(Duration::from_secs(1), &cfg, &[]);
        }
        let f = t.findings(&cfg);
        let prints: Vec<&str> = f.iter().map(|f| f.fingerprint.as_str()).collect();
        assert_eq!(
            prints,
            [
                "reconnect_storm:client@pod:shop/client-1:443@netns:cni-x",
                "reconnect_storm:client:443",
            ]
        );
        assert_eq!(
            (f[0].netns, f[0].netns_name.as_deref()),
            (41, Some("cni-x"))
        );
        assert_eq!(
            f[0].container.as_ref().map(|c| c.id.as_str()),
            Some(c.id.as_str())
        );
        assert_eq!(f[0].processes[0].container.as_deref(), Some(c.id.as_str()));
        assert!(
            f[0].summary
                .ends_with("; in netns cni-x, pod shop/client-1 (containerd c0c000000000)"),
            "{}",
            f[0].summary
        );
        assert_eq!((f[1].netns, f[1].netns_label().as_str()), (40, "host"));
        assert_eq!(f[1].container, None);
        // A namespace no scan named: its inode.
        let mut t = StormTracker::default();
        let unnamed = ConnKey { netns: 77, ..key() };
        for n in [60, 80, 120] {
            t.record_connects(unnamed.clone(), "client", n);
            t.set_namespaces(std::slice::from_ref(&host));
            t.close_window(Duration::from_secs(1), &cfg, &[]);
        }
        let f = t.findings(&cfg);
        assert_eq!(f[0].fingerprint, "reconnect_storm:client:443@netns:77");
        assert_eq!((f[0].netns, f[0].netns_own), (77, false));
    }

    #[test]
    fn growth_below_threshold_is_quiet() {
        let cfg = DetectConfig::default();
        let mut t = StormTracker::default();
        for n in [1, 2, 4, 8, 16] {
            window(&mut t, n, &cfg);
        }
        assert!(t.findings(&cfg).is_empty());
    }
}
