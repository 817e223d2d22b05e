//! The part of a scan besides the walks: the owner dump (or the last one, reused) and, for the
//! namespaces between their walks, their rows from the sweep and what their last walk carries.
use rustc_hash::{FxHashMap, FxHashSet};

use super::{
    hidden::Look,
    hidden_row, netns_row,
    quiet::{self, Quiet},
    timewait,
    walk::{self, Swept, Walks},
};
use crate::{
    kernel::{self, netns::Namespace, Kernel, KernelError, Owned},
    table::{Holders, TableBuilder},
};
use connreap_ebpf::{OwnerRecord, SweepRecord};

/// A scan's sweep: its dump, and what it read of each namespace.
type SweepResult = (kernel::Dump, FxHashMap<u32, Swept>);

/// The owner dump, and with it, when there are namespaces `between` their walks, their rows:
/// every socket of theirs the state table tracks, held or not, read fresh by the sweep over the
/// table (one pass over every namespace's tracked sockets), plus what each one's last walk
/// carries (its TIME_WAIT and request sockets, and sockets the table had no room for: see
/// `walk::carried_between`). With `look`, the holders of the sweep's sockets in namespaces
/// discovery did not find are noted from the owner dump, and every socket of a namespace that
/// vanished from discovery since the last scan but is still held becomes a row. Returns the
/// owner dump and the sweep (None: the plain owner dump, no namespace between walks, no look).
/// `quiet` are the quiet namespaces (due a walk, not walked: see `quiet::judge`), each with
/// its part of the table: they get their swept rows and what their last walk carries to a
/// quiet scan (`quiet::kept`). A timewait socket whose 60 s are over is carried to
/// no scan.
/// The sweep skips namespace `skip`'s sockets (0: none).
#[allow(clippy::too_many_arguments)]
pub(super) fn owners_and_between(
    kernel: &mut Kernel,
    reuse: bool,
    walks: &Walks,
    skip: u32,
    between: &[Namespace],
    quiet: &[(u32, usize, Quiet)],
    mut look: Option<&mut Look>,
    b: &mut TableBuilder<'_>,
    holders: &mut Holders,
    now_ns: u64,
    hz: u32,
) -> Result<(kernel::Dump, Option<SweepResult>), KernelError> {
    // `reuse`: `holders` are the last dump's (never with a look, which needs a fresh one).
    let owner_dump = |kernel: &mut Kernel, f: &mut dyn FnMut(OwnerRecord)| {
        if reuse {
            Ok(kernel::Dump::default())
        } else {
            kernel.for_each_owner(f)
        }
    };
    if between.is_empty() && quiet.is_empty() && look.is_none() {
        return Ok((owner_dump(kernel, &mut |o| holders.push(&o))?, None));
    }
    if !kernel.sweeps() {
        debug_assert!(!reuse, "a dump is reused only with the sweep");
        // Every namespace was walked (nothing between walks): only the look, through the
        // owner dump that reads other namespaces' held sockets.
        let dump = look_without_sweep(kernel, walks, look, b, holders)?;
        return Ok((dump, None));
    }
    let mut parts: FxHashMap<u32, usize> = quiet.iter().map(|&(i, part, _)| (i, part)).collect();
    parts.extend(between.iter().map(|ns| {
        let last = walks.last(ns.inode);
        let ephemeral = last.and_then(|w| w.ephemeral.clone());
        let keepalive = last.and_then(|w| w.keepalive);
        (
            ns.inode,
            b.begin_namespace(netns_row(ns, keepalive), ephemeral),
        )
    }));
    // The carried full sockets (untracked when walked) of the namespaces read here: one the
    // sweep reads now has a record in the table, and its fresh row replaces the carried one.
    // Only those are looked up (a handful), not every swept socket.
    let carried_full: FxHashSet<u64> = parts
        .keys()
        .filter_map(|inode| walks.last(*inode))
        .flat_map(|w| {
            w.unheld
                .iter()
                .filter(|r| walk::untracked(r))
                .map(|r| r.skaddr)
        })
        .collect();
    let mut swept = FxHashSet::default();
    let mut per_netns: FxHashMap<u32, Swept> = FxHashMap::default();
    // Sockets of namespaces this scan does not know, by address: for the look.
    let mut unknown: FxHashMap<u64, SweepRecord> = FxHashMap::default();
    let sweep = kernel.sweep(skip, |r| {
        per_netns.entry(r.netns).or_default().add(r);
        if let Some(&part) = parts.get(&r.netns) {
            if carried_full.contains(&r.sock.skaddr) {
                swept.insert(r.sock.skaddr);
            }
            b.push_in(part, &r.sock);
        } else if look.as_ref().is_some_and(|l| !l.knows(r.netns)) {
            unknown.insert(r.sock.skaddr, *r);
        }
    })?;
    let mut kept = FxHashSet::default();
    let dump = owner_dump(kernel, &mut |o| {
        holders.push(&o);
        if let (Some(r), Some(l)) = (unknown.get(&o.skaddr), look.as_mut()) {
            if l.see(r.netns, o.tgid, o.fd) {
                kept.insert(r.netns);
            }
        }
    })?;
    // A namespace that vanished from discovery but is still held: all its sockets, with its
    // port range and keepalive as its last walk (while discovered) read them.
    for r in unknown.values().filter(|r| kept.contains(&r.netns)) {
        let part = *parts.entry(r.netns).or_insert_with(|| {
            let last = walks.last(r.netns);
            b.begin_namespace(
                hidden_row(r.netns, last.and_then(|w| w.keepalive)),
                last.and_then(|w| w.ephemeral.clone()),
            )
        });
        b.push_in(part, &r.sock);
    }
    for ns in between {
        if let (Some(last), Some(&part)) = (walks.last(ns.inode), parts.get(&ns.inode)) {
            let carried = walk::carried(last, |a| swept.contains(&a), now_ns, hz);
            for r in carried.filter(|r| timewait::alive(r, now_ns) != Some(false)) {
                b.push_in(part, &r);
            }
        }
    }
    for &(inode, part, q) in quiet {
        if let Some(last) = walks.last(inode) {
            let carried = walk::carried(last, |a| swept.contains(&a), now_ns, hz);
            for r in carried.filter(|r| quiet::kept(r, now_ns, q)) {
                b.push_in(part, &r);
            }
        }
    }
    Ok((dump, Some((sweep, per_netns))))
}

/// The owner dump and, with `look`, the holders of sockets of namespaces discovery did not
/// find, from the pass that also reads other namespaces' held sockets; a namespace that
/// vanished from discovery but is still held keeps those sockets as rows.
fn look_without_sweep(
    kernel: &mut Kernel,
    walks: &Walks,
    mut look: Option<&mut Look>,
    b: &mut TableBuilder<'_>,
    holders: &mut Holders,
) -> Result<kernel::Dump, KernelError> {
    let mut parts: FxHashMap<u32, usize> = FxHashMap::default();
    kernel.for_each_owner_and_elsewhere(|o| match o {
        Owned::Owner(o) => holders.push(&o),
        Owned::Elsewhere(p) => {
            holders.push(&p.owner);
            let inode = p.owner.netns;
            if !look
                .as_mut()
                .is_some_and(|l| l.see(inode, p.owner.tgid, p.owner.fd))
            {
                return;
            }
            let part = *parts.entry(inode).or_insert_with(|| {
                let last = walks.last(inode);
                b.begin_namespace(
                    hidden_row(inode, last.and_then(|w| w.keepalive)),
                    last.and_then(|w| w.ephemeral.clone()),
                )
            });
            b.push_in(part, &p.sock);
        }
    })
}
