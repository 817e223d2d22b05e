//! One scan: run the iterators and merge them into the socket table. The kernel and /proc are
//! reached only through `kernel` (the dumps, `kernel::procfs`); this module only drives them.
//! Which namespaces a scan walks whole, and what it carries between walks, is in `walk`; the
//! namespaces only held sockets keep alive, in `hidden`.
mod between;
mod hidden;
mod owners;
mod quiet;
mod timewait;
mod walk;

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
    time::{Duration, Instant},
};

use crate::{
    containers::{self, ContainerNames, PodNames},
    kernel::{
        advise_huge_pages,
        netns::{self, FindError, Namespace},
        procfs, Kernel, KernelError, NsEvent, Owned,
    },
    table::{self, FirstSeen, Holders, Netns, ProcessFacts, Socket, TableBuilder},
};
use hidden::{Hidden, Look};
use quiet::Quiet;
use rustc_hash::{FxHashMap, FxHashSet};
pub use walk::every as walk_every;
use walk::{Swept, Walked, Walks};

/// A process's unit and container (with its pod, name and image when known), from one read of
/// its cgroup file.
fn process_facts(pid: u32, pods: &mut PodNames, names: &mut ContainerNames) -> ProcessFacts {
    let Some(cgroup) = procfs::cgroup(pid) else {
        return ProcessFacts::default();
    };
    let container = containers::from_cgroup(&cgroup).map(|mut c| {
        pods.fill(&mut c);
        names.fill(&mut c);
        Arc::new(c)
    });
    ProcessFacts {
        unit: procfs::unit_from_cgroup(&cgroup).map(Arc::from),
        container,
    }
}

/// What the last scan saw of the host's network namespaces.
#[derive(Debug, Default, Clone)]
pub struct NamespaceReport {
    /// Namespaces dumped.
    pub scanned: usize,
    /// Of those, namespaces walked whole (iter/tcp inside them) by this scan; the others'
    /// rows are their sockets held by a process, read now, and the rest carried from their
    /// last walk (see `walk`).
    pub walked: usize,
    /// Namespaces that went away between discovery and their dump (their sockets are gone).
    pub gone: usize,
    /// Namespaces that could not be entered or dumped, and why: their sockets are missing
    /// from the table (so none of them can be selected for a kill either).
    pub failed: Vec<(u32, String)>,
    /// Every namespace the scan found, as its rows name them.
    pub known: Vec<Arc<Netns>>,
}

pub struct Scanner {
    pub kernel: Kernel,
    /// The namespaces of the last scan, for acting inside one (see `kernel::netns::run_in`).
    pub namespaces: Vec<Namespace>,
    pub namespace_report: NamespaceReport,
    /// Dump only these namespaces (names, inodes, "host"); empty: every one.
    only: Vec<String>,
    host: table::HostInfo,
    first_seen: FirstSeen,
    /// Unit and container of each pid holding sockets (read once per process).
    facts: HashMap<u32, ProcessFacts>,
    pods: PodNames,
    names: ContainerNames,
    /// Size of the previous table, to size the next one.
    last_len: usize,
    /// Which namespaces each scan walks (every one on every scan unless set otherwise).
    walks: Walks,
    /// Namespaces known only through sockets processes hold in them.
    hidden: Hidden,
    /// What the last sweep read of each namespace (see `quiet::judge`).
    swept: FxHashMap<u32, Swept>,
    /// The last owner dump's holders, what the kernel counted when it was taken, and whether
    /// the last table had a socket waiting to be accepted (see `owners`).
    held: Holders,
    dumped: Option<owners::Dumped>,
    pending_accept: bool,
}

impl Scanner {
    pub fn new(kernel: Kernel) -> Self {
        // The namespace's ephemeral port range (falls back to Linux's default).
        let ephemeral =
            procfs::ephemeral_ports().unwrap_or_else(|| table::HostInfo::default().ephemeral);
        Scanner {
            host: table::HostInfo {
                hz: kernel.hz,
                ephemeral,
            },
            kernel,
            namespaces: Vec::new(),
            namespace_report: NamespaceReport::default(),
            only: Vec::new(),
            first_seen: FirstSeen::default(),
            facts: HashMap::new(),
            pods: PodNames::new("/"),
            names: ContainerNames::new("/"),
            last_len: 0,
            walks: Walks::new(1),
            hidden: Hidden::default(),
            swept: FxHashMap::default(),
            held: Holders::default(),
            dumped: None,
            pending_accept: false,
        }
    }

    /// Walk each namespace other than connreap's own once per `every` scans instead of on
    /// every scan (see `walk`): for the daemon, whose scans repeat. One-shot scans walk all.
    pub fn walk_every(&mut self, every: u64) {
        self.walks = Walks::new(every);
    }

    /// Dump only the namespaces `wanted` names (a name, an inode, "host"), not every one: a
    /// one-shot snapshot of one namespace costs what it did when connreap saw only its own (each
    /// namespace's dump walks the kernel's host-wide TCP table). A name that matches nothing
    /// fails the scan, naming it; an inode discovery does not find is looked for among the
    /// sockets processes hold (a namespace with no process and no name), at the cost of one
    /// pass over every process's files.
    pub fn only(&mut self, wanted: Vec<String>) {
        self.only = wanted;
    }

    /// One scan, the owner dump after the socket dump (so a socket seen has had the time to
    /// get its owner): what the daemon and reclaim decisions use.
    pub fn scan(&mut self) -> Result<Vec<Socket>, KernelError> {
        self.scan_with(false, &[])
    }

    /// A scan that walks the namespaces `inodes` whatever their turn: the re-check before a
    /// kill, which must not see a carried row of a socket gone since its namespace's last walk.
    pub fn scan_walking(&mut self, inodes: &[u32]) -> Result<Vec<Socket>, KernelError> {
        self.scan_with(false, inodes)
    }

    /// One scan with both dumps at once (see [`Kernel::for_each_both`]): for a one-shot
    /// snapshot, where the wall time is what a person waits for.
    pub fn scan_parallel(&mut self) -> Result<Vec<Socket>, KernelError> {
        self.scan_with(true, &[])
    }

    /// What the kernel counts that changes sockets' owners (see `owners`); None when a count
    /// cannot be read (then no owner dump is reused).
    fn counts(&self) -> Option<owners::Counts> {
        let transitions = self.kernel.transitions().ok()??;
        Some(owners::Counts {
            transitions,
            processes: procfs::processes()?,
        })
    }

    fn scan_with(&mut self, parallel: bool, forced: &[u32]) -> Result<Vec<Socket>, KernelError> {
        // Socket records become table rows as they are read.
        let start = Instant::now();
        let start_ns = procfs::monotonic_ns();
        // Read before any dump: a change counted after it forces the next scan's owner dump.
        // A snapshot never reuses a dump: it needs none.
        let counts = if parallel { None } else { self.counts() };
        // Taken now: a scan that fails after taking the kept holders leaves no dump to reuse,
        // so the next scan dumps.
        let last_dump = self.dumped.take();
        // Room for some growth: a table that outgrows its capacity is copied whole.
        let mut rows = Vec::with_capacity(self.last_len + self.last_len / 16 + 64);
        advise_huge_pages(&mut rows);
        let mut b = TableBuilder::into_rows(&self.host, &mut self.first_seen, rows, start_ns);
        self.walks.scans += 1;
        // Every namespace (or those asked for), rediscovered on each scan: pods come and go.
        let every = self.only.is_empty();
        let mut spaces = if every {
            netns::discover().map_err(KernelError::Netns)?
        } else {
            let mut spaces: Vec<Namespace> = Vec::new();
            for wanted in &self.only {
                let ns = find(&mut self.kernel, wanted)?;
                if !spaces.iter().any(|n| n.inode == ns.inode) {
                    spaces.push(ns);
                }
            }
            spaces
        };
        // And those only held sockets keep alive, found by earlier scans (see `hidden`).
        let mut look = None;
        if every {
            self.hidden.add_to(&mut spaces, usable);
            let known = spaces.iter().map(|n| n.inode).collect();
            look = Some(Look::new(known, Look::vanished(&self.namespaces, &spaces)));
        }
        let discovered = start.elapsed();
        // Without the sweep (a kernel that refuses it), every scan walks every namespace.
        let sweeps = !parallel && self.walks.every > 1 && self.kernel.sweeps();
        // This scan enters its own namespace, the namespaces never walked and those whose turn
        // it is; the others ("between walks") come from the sweep and the owner dump below.
        let (to_walk, between): (Vec<Namespace>, Vec<Namespace>) = spaces
            .iter()
            .cloned()
            .partition(|ns| ns.own || parallel || !sweeps || self.walks.due(ns.inode, forced));
        // What each entered namespace leaves for the scans until its next walk.
        let mut walked: Vec<(u32, Walked)> = Vec::new();
        // What a walk of the own namespace read that the sweep would (for the next scan's
        // judgement of it: see `quiet::judge`).
        let mut own_walk = Swept::default();
        let mut in_own = false;
        // Each entered namespace's part of the table (for the quiet ones' swept rows).
        let mut entered: FxHashMap<u32, usize> = FxHashMap::default();
        let on_socket = |e: NsEvent<'_>| match e {
            NsEvent::Enter(ns) => {
                // Read on the thread inside the namespace: its own sysctl.
                let ephemeral = procfs::ephemeral_ports();
                let keepalive = procfs::keepalive();
                let part = b.begin_namespace(netns_row(ns, keepalive), ephemeral.clone());
                entered.insert(ns.inode, part);
                in_own = ns.own;
                walked.push((
                    ns.inode,
                    Walked {
                        ephemeral,
                        keepalive,
                        at_ns: start_ns,
                        unheld: Vec::new(),
                        transitions: counts.as_ref().map(|c| c.transitions),
                    },
                ));
            }
            NsEvent::Socket(r) => {
                if let Some((_, w)) = walked.last_mut() {
                    // The own namespace is never between walks: only what quiet scans carry
                    // is kept (untracked and timewait sockets, not request sockets).
                    let keep = if in_own {
                        own_walk.add_walked(&r);
                        walk::untracked(&r) || timewait::is_timewait(&r)
                    } else {
                        walk::carried_between(&r)
                    };
                    if keep {
                        w.unheld.push(r);
                    }
                }
                b.push(&r)
            }
        };
        // The last owner dump is reused when nothing that changes owners was counted since
        // (see `owners`), at most once per walk period in a row; never by a re-check before a
        // kill or a snapshot.
        let reuse = !parallel
            && forced.is_empty()
            && sweeps
            && owners::reusable(
                last_dump.as_ref(),
                counts.as_ref(),
                self.walks.every - 1,
                self.pending_accept,
                |pid| self.held.holds(pid),
                procfs::holds_sockets,
            );
        // A scan looks for hidden namespaces when its owner dump reads other namespaces'
        // sockets anyway, when one of the last scan's was not discovered, and once per walk
        // period; a snapshot always (it has no last scan).
        if let Some(l) = &look {
            if !parallel
                && (between.is_empty() || reuse)
                && l.no_vanished()
                && !self.walks.look_due()
            {
                look = None;
            }
        }
        let reuse = reuse && look.is_none();
        let mut holders = if reuse {
            std::mem::take(&mut self.held)
        } else {
            Holders::default()
        };
        let mut quiet: Vec<(u32, Quiet)> = Vec::new();
        let (mut all, owners, swept) = if parallel {
            let mut on_socket = on_socket;
            let (mut sockets, owners) = self.kernel.for_each_both(
                &to_walk,
                &mut on_socket,
                look.is_some(),
                |o| match o {
                    Owned::Owner(o) => holders.push(&o),
                    Owned::Elsewhere(p) => {
                        holders.push(&p.owner);
                        if let Some(l) = look.as_mut() {
                            l.see(p.owner.netns, p.owner.tgid, p.owner.fd);
                        }
                    }
                },
            )?;
            // What it found is walked now, like every namespace a snapshot shows.
            let found = look
                .take()
                .map(|l| l.namespaces(usable))
                .unwrap_or_default();
            if !found.is_empty() {
                sockets.absorb(self.kernel.for_each_socket(&found, &mut on_socket)?);
                spaces.extend(found);
            }
            (sockets, owners, None)
        } else {
            // A namespace due for its walk (the own one on every scan) that has nothing the
            // sweep cannot read is not walked ("quiet"): its rows come from the sweep like those
            // between walks, plus what its last walk found that the sweep cannot read.
            let (walks, last_sweep) = (&self.walks, &self.swept);
            let must_walk = |ns: &Namespace| {
                let last = walks.last(ns.inode);
                let judged = if forced.contains(&ns.inode) || !sweeps {
                    None
                } else {
                    last.and_then(|w| {
                        // No TCP state transition on the host since its walk's scan began.
                        let settled = w.transitions.is_some()
                            && w.transitions == counts.as_ref().map(|c| c.transitions);
                        quiet::judge(
                            procfs::sockstat(),
                            last_sweep.get(&ns.inode),
                            &w.carried_at(start_ns),
                            walks.due(ns.inode, forced),
                            settled,
                        )
                    })
                };
                if let Some(q) = judged {
                    quiet.push((ns.inode, q));
                }
                judged.is_none()
            };
            let sockets = self
                .kernel
                .for_each_socket_where(&to_walk, must_walk, on_socket)?;
            let quiet_parts: Vec<(u32, usize, Quiet)> = quiet
                .iter()
                .filter_map(|&(i, q)| Some((i, *entered.get(&i)?, q)))
                .collect();
            // The sweep skips the own namespace's sockets when it was walked.
            let own = spaces.iter().find(|n| n.own).map_or(0, |n| n.inode);
            let skip = if quiet.iter().any(|(i, _)| *i == own) {
                0
            } else {
                own
            };
            let (owners, swept) = between::owners_and_between(
                &mut self.kernel,
                reuse,
                &self.walks,
                skip,
                &between,
                &quiet_parts,
                look.as_mut(),
                &mut b,
                &mut holders,
                start_ns,
                self.host.hz,
            )?;
            (sockets, owners, swept)
        };
        let mut kept = 0;
        if let Some(look) = look {
            // The namespaces that vanished from discovery but not from the owner dump are in
            // this scan's table: keep them among its namespaces (for acting in them).
            for ns in look.kept() {
                if !spaces.iter().any(|n| n.inode == ns.inode) {
                    spaces.push(ns);
                    kept += 1;
                }
            }
            self.hidden.remember(look.found);
        }
        let walked_count = all.namespaces;
        all.namespaces += all.quiet + between.len() + kept;
        let mut own_walked = None;
        for (inode, w) in walked {
            let judged = quiet.iter().find(|(i, _)| *i == inode).map(|(_, q)| *q);
            let w = match (self.walks.last(inode), judged) {
                (Some(last), Some(q)) => w.after_quiet(last, start_ns, q),
                _ => {
                    if spaces.iter().any(|n| n.own && n.inode == inode) {
                        own_walked = Some((inode, own_walk));
                    }
                    w
                }
            };
            self.walks.record(inode, w);
        }
        self.walks
            .retain(|inode| spaces.iter().any(|n| n.inode == inode));
        for (inode, e) in &all.failed {
            tracing::warn!(
                netns = inode,
                error = format!("{e:#}"),
                "network namespace not scanned; its sockets are missing from this scan"
            );
        }
        self.namespace_report = NamespaceReport {
            scanned: all.namespaces,
            walked: walked_count,
            gone: all.gone,
            failed: all
                .failed
                .iter()
                .map(|(i, e)| (*i, format!("{e:#}")))
                .collect(),
            known: spaces
                .iter()
                .map(|ns| netns_row(ns, self.walks.last(ns.inode).and_then(|w| w.keepalive)))
                .collect(),
        };
        log_hidden(&self.namespaces, &spaces);
        self.namespaces = spaces;
        let sockets = all.dump;
        let dumps_done = Instant::now();
        let end_ns = procfs::monotonic_ns();
        // Forget pids that hold no socket any more (pids get reused), and pods and containers
        // none of them runs in.
        let live: HashSet<u32> = holders.pids().collect();
        self.facts.retain(|pid, _| live.contains(pid));
        let (facts, pods, names) = (&mut self.facts, &mut self.pods, &mut self.names);
        let mut facts_of = |pid: u32| {
            facts
                .entry(pid)
                .or_insert_with(|| process_facts(pid, pods, names))
                .clone()
        };
        let table = b.finish(&mut holders, end_ns, &mut facts_of);
        self.held = holders;
        // A reused dump is compared with this scan's processes next: those it looked into.
        self.dumped = match (reuse, last_dump) {
            (true, Some(d)) => Some(owners::Dumped {
                at: counts.unwrap_or(d.at),
                reused: d.reused + 1,
            }),
            _ => counts.map(|at| owners::Dumped { at, reused: 0 }),
        };
        self.pending_accept = table.iter().any(owners::pending_accept);
        let live_pods: HashSet<String> = self
            .facts
            .values()
            .filter_map(|f| f.container.as_ref()?.pod_uid.clone())
            .collect();
        self.pods.retain(&live_pods);
        let live_containers: HashSet<String> = self
            .facts
            .values()
            .filter_map(|f| Some(f.container.as_ref()?.id.clone()))
            .collect();
        self.names.retain(&live_containers);
        self.last_len = table.len();
        // Where a scan's time goes, for `RUST_LOG=connreap::scan=debug` and the benchmarks:
        // each dump's time in the kernel (the iterator producing records) and in total (plus
        // decoding them here), the sweep's when namespaces were between their walks, all
        // dumps' wall time (their sum, or the longer one in a parallel scan), then the merge.
        let us = |d: Duration| d.as_micros() as u64;
        tracing::debug!(
            namespaces = all.namespaces,
            walked = walked_count,
            others_walked = all.others,
            discover_us = us(discovered),
            sockets = sockets.records,
            owner_records = owners.records,
            socket_dump_kernel_us = us(sockets.in_kernel),
            socket_dump_us = us(sockets.total),
            owner_dump_kernel_us = us(owners.in_kernel),
            owner_dump_us = us(owners.total),
            owners_reused = reuse,
            quiet = all.quiet,
            swept = swept.as_ref().map_or(0, |(d, _)| d.records),
            sweep_kernel_us = swept.as_ref().map_or(0, |(d, _)| us(d.in_kernel)),
            sweep_us = swept.as_ref().map_or(0, |(d, _)| us(d.total)),
            dumps_us = us(dumps_done - start),
            merge_us = us(dumps_done.elapsed()),
            "scan"
        );
        if connreap_ebpf::SK_STORAGE {
            self.kernel.log_sk_pass();
        }
        // Kept until the next sweep: a scan that walks everything tells nothing new of them.
        if let Some((_, per_netns)) = swept {
            self.swept = per_netns;
        }
        // The sweep skipped a walked own namespace: its walk's count stands in.
        if let Some((inode, counted)) = own_walked {
            self.swept.insert(inode, counted);
        }
        Ok(table)
    }
}

/// Say once which namespaces this scan (`now`) knows only through a socket a process holds,
/// that the last one (`last`) did not know that way.
fn log_hidden(last: &[Namespace], now: &[Namespace]) {
    for ns in now {
        let Some((pid, fd)) = ns.holder() else {
            continue;
        };
        if !last
            .iter()
            .any(|n| n.inode == ns.inode && n.holder().is_some())
        {
            tracing::info!(
                netns = ns.inode,
                pid,
                fd,
                "network namespace with no process in it and no name, alive through sockets processes hold: scanned through the socket at fd {fd} of pid {pid}"
            );
        }
    }
}

/// Whether a namespace can be entered through its holder (one that cannot for another reason
/// than its holder having let go is kept: its walk reports why).
fn usable(ns: &Namespace) -> bool {
    !matches!(ns.check(), Err(e) if e.is_gone())
}

/// The namespace `wanted` names (see [`Scanner::only`]).
fn find(kernel: &mut Kernel, wanted: &str) -> Result<Namespace, KernelError> {
    let inode = match (netns::find(wanted), wanted.parse::<u32>()) {
        (Err(FindError::NoNetns(_)), Ok(inode)) => inode,
        (found, _) => return found.map_err(KernelError::FindNetns),
    };
    let mut look = Look::new(FxHashSet::default(), FxHashSet::default());
    kernel.for_each_owner_and_elsewhere(|o| {
        if let Owned::Elsewhere(p) = o {
            if p.owner.netns == inode {
                look.see(inode, p.owner.tgid, p.owner.fd);
            }
        }
    })?;
    look.namespaces(usable)
        .pop()
        .ok_or_else(|| KernelError::FindNetns(FindError::NoNetns(wanted.to_string())))
}

/// A namespace with no name, known through the sockets held in it.
fn hidden_row(inode: u32, keepalive: Option<crate::table::Keepalive>) -> Arc<Netns> {
    Arc::new(Netns {
        inode,
        keepalive,
        ..Netns::default()
    })
}

/// A namespace as the table's rows name it.
fn netns_row(ns: &Namespace, keepalive: Option<crate::table::Keepalive>) -> Arc<Netns> {
    Arc::new(Netns {
        inode: ns.inode,
        name: ns.name.as_deref().map(Box::from),
        own: ns.own,
        keepalive,
    })
}
