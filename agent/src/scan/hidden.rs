//! Network namespaces that discovery cannot find: no process lives in them and they have no
//! name, but sockets processes hold elsewhere keep them alive (a process `setns`-ed in, opened
//! sockets and came back; then `ip netns del`). Plain data, no kernel access.
//!
//! The owner dump that reads other namespaces' sockets (`Kernel::for_each_owner_and_elsewhere`)
//! sees every socket a process holds with its namespace and holder (pid, fd). A scan that runs
//! it ("looks") notes the holders of the namespaces it did not discover; the next scans enter
//! such a namespace through a holder's socket (`Namespace::held`) and walk it like any other.
//! A scan looks when it runs that dump anyway (namespaces between their walks), on the first
//! scan and once per walk period, and when a namespace of the last scan was not discovered: one
//! whose name was just deleted or whose last process just left is then kept in the same scan
//! (its held sockets, from the dump) if a socket of it is still held.
use std::collections::BTreeMap;

use rustc_hash::{FxHashMap, FxHashSet};

use crate::kernel::netns::Namespace;

/// Holders remembered per namespace (one is enough to enter it; the others stand in when it
/// closes its socket).
pub const MAX_HOLDERS: usize = 4;

/// The namespaces known only through their holders.
#[derive(Debug, Default)]
pub struct Hidden {
    /// (pid, fd) of sockets held in each, freshest first.
    holders: BTreeMap<u32, Vec<(u32, u32)>>,
}

impl Hidden {
    /// Add to `spaces` (what discovery found) each remembered namespace it did not find,
    /// through the first holder `usable` accepts. Holders it refuses are forgotten, and so are
    /// namespaces left without one and those discovery found (they have a process or a name
    /// again).
    pub fn add_to(&mut self, spaces: &mut Vec<Namespace>, usable: impl Fn(&Namespace) -> bool) {
        self.holders.retain(|&inode, holders| {
            if spaces.iter().any(|n| n.inode == inode) {
                return false;
            }
            while let Some(&(pid, fd)) = holders.first() {
                let ns = Namespace::held(inode, pid, fd);
                if usable(&ns) {
                    spaces.push(ns);
                    return true;
                }
                holders.remove(0);
            }
            false
        });
    }

    /// Remember what a scan's look found: the holders of each namespace it did not discover.
    pub fn remember(&mut self, found: FxHashMap<u32, Vec<(u32, u32)>>) {
        for (inode, fresh) in found {
            let known = self.holders.entry(inode).or_default();
            let older = known.iter().filter(|h| !fresh.contains(h)).copied();
            let merged: Vec<(u32, u32)> = fresh.iter().copied().chain(older).collect();
            *known = merged.into_iter().take(MAX_HOLDERS).collect();
        }
    }

    /// Namespaces remembered.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.holders.len()
    }
}

/// What a scan's pass over processes' files looks for besides owners: holders of sockets of
/// namespaces the scan did not discover.
#[derive(Debug, Default)]
pub struct Look {
    /// The scan's namespaces: their sockets are read elsewhere.
    known: FxHashSet<u32>,
    /// Namespaces of the last scan that discovery did not find now.
    vanished: FxHashSet<u32>,
    /// Holders of sockets of each namespace not known, in dump order.
    pub found: FxHashMap<u32, Vec<(u32, u32)>>,
}

impl Look {
    pub fn new(known: FxHashSet<u32>, vanished: FxHashSet<u32>) -> Self {
        Look {
            known,
            vanished,
            found: FxHashMap::default(),
        }
    }

    /// The namespaces of the last scan (`last`) that are not among this scan's (`now`).
    pub fn vanished(last: &[Namespace], now: &[Namespace]) -> FxHashSet<u32> {
        let now: FxHashSet<u32> = now.iter().map(|n| n.inode).collect();
        last.iter()
            .map(|n| n.inode)
            .filter(|i| !now.contains(i))
            .collect()
    }

    /// Whether namespace `inode` is one of the scan's.
    pub fn knows(&self, inode: u32) -> bool {
        self.known.contains(&inode)
    }

    /// Whether no namespace of the last scan is missing from this one's.
    pub fn no_vanished(&self) -> bool {
        self.vanished.is_empty()
    }

    /// A socket of namespace `inode` held by `pid` at `fd`: noted when the namespace is not
    /// known. True when its record goes into this scan's table now (its namespace vanished
    /// from discovery since the last scan: it lives on through this socket).
    pub fn see(&mut self, inode: u32, pid: u32, fd: u32) -> bool {
        if self.known.contains(&inode) {
            return false;
        }
        let holders = self.found.entry(inode).or_default();
        if holders.len() < MAX_HOLDERS && !holders.contains(&(pid, fd)) {
            holders.push((pid, fd));
        }
        self.vanished.contains(&inode)
    }

    /// The vanished namespaces whose sockets [`Look::see`] put into the table, each through
    /// its first holder.
    pub fn kept(&self) -> Vec<Namespace> {
        self.namespaces(|ns| self.vanished.contains(&ns.inode))
    }

    /// The namespaces found, each through the first holder `usable` accepts (a snapshot walks
    /// them at once).
    pub fn namespaces(&self, usable: impl Fn(&Namespace) -> bool) -> Vec<Namespace> {
        let mut inodes: Vec<u32> = self.found.keys().copied().collect();
        inodes.sort_unstable();
        inodes
            .into_iter()
            .filter_map(|inode| {
                self.found[&inode]
                    .iter()
                    .map(|&(pid, fd)| Namespace::held(inode, pid, fd))
                    .find(|ns| usable(ns))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(inodes: &[u32]) -> FxHashSet<u32> {
        inodes.iter().copied().collect()
    }

    #[test]
    fn a_look_notes_holders_of_undiscovered_namespaces_and_keeps_the_vanished() {
        let mut look = Look::new(set(&[1, 2]), set(&[7]));
        assert!(!look.see(2, 10, 3), "a known namespace's socket");
        assert!(!look.see(9, 10, 4), "a namespace never seen: noted only");
        assert!(
            look.see(7, 11, 5),
            "a namespace of the last scan: into the table now"
        );
        for fd in 0..10 {
            look.see(7, 12, fd);
        }
        look.see(9, 10, 4);
        assert_eq!(look.found[&9], vec![(10, 4)], "each holder once");
        assert_eq!(look.found[&7].len(), MAX_HOLDERS);
        assert_eq!(look.found[&7][0], (11, 5), "in dump order");
        assert!(!look.found.contains_key(&2));
        // Through the first holder that can be used.
        let ns = look.namespaces(|n| n.holder() != Some((11, 5)));
        let got: Vec<(u32, Option<(u32, u32)>)> =
            ns.iter().map(|n| (n.inode, n.holder())).collect();
        assert_eq!(got, vec![(7, Some((12, 0))), (9, Some((10, 4)))]);
        assert!(ns.iter().all(|n| !n.own && n.name.is_none()));
        let kept: Vec<(u32, Option<(u32, u32)>)> =
            look.kept().iter().map(|n| (n.inode, n.holder())).collect();
        assert_eq!(kept, vec![(7, Some((11, 5)))], "the vanished one only");
        assert!(!look.no_vanished());
    }

    #[test]
    fn vanished_namespaces_are_those_of_the_last_scan_not_found_now() {
        let ns = |i| Namespace::held(i, 1, 1);
        assert_eq!(
            Look::vanished(&[ns(1), ns(2), ns(3)], &[ns(2), ns(4)]),
            set(&[1, 3])
        );
    }

    #[test]
    fn remembered_namespaces_are_added_through_a_usable_holder_or_forgotten() {
        let mut hidden = Hidden::default();
        let found = |list: &[(u32, &[(u32, u32)])]| {
            list.iter()
                .map(|(i, h)| (*i, h.to_vec()))
                .collect::<FxHashMap<_, _>>()
        };
        hidden.remember(found(&[
            (7, &[(10, 3), (11, 4)]),
            (8, &[(12, 5)]),
            (9, &[(13, 6)]),
        ]));
        // Fresh holders first, the older kept after them, at most MAX_HOLDERS.
        hidden.remember(found(&[(7, &[(14, 7), (15, 8), (10, 3)])]));
        assert_eq!(hidden.holders[&7], vec![(14, 7), (15, 8), (10, 3), (11, 4)]);
        hidden.remember(found(&[(7, &[(16, 9)])]));
        assert_eq!(hidden.holders[&7].len(), MAX_HOLDERS);
        assert_eq!(hidden.holders[&7][0], (16, 9));

        // 8 was discovered (a process lives in it again); 9's only holder is gone; 7's first
        // holder closed its socket, the second still holds one.
        let mut spaces = vec![Namespace::held(8, 99, 99)];
        hidden.add_to(&mut spaces, |n| {
            !matches!(n.holder(), Some((16, 9)) | Some((13, 6)))
        });
        let got: Vec<(u32, Option<(u32, u32)>)> =
            spaces.iter().map(|n| (n.inode, n.holder())).collect();
        assert_eq!(got, vec![(8, Some((99, 99))), (7, Some((14, 7)))]);
        assert_eq!(hidden.len(), 1, "8 and 9 are forgotten");
        assert_eq!(
            hidden.holders[&7][0],
            (14, 7),
            "the closed holder is dropped"
        );
    }
}
