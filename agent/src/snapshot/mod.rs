//! Filters, grouping and rendering of the socket table (`connreap snapshot`, `GET /v1/sockets`).
mod filter;
mod row;
mod table;

use std::time::Duration;

use rustc_hash::{FxHashMap, FxHashSet};
use serde::Serialize;

pub use filter::{Filter, FilterArgs, FilterError};
pub use table::write_table;

use crate::{
    present,
    table::{Socket, TcpState},
};

/// One line of the summary: sockets grouped by (owner process, service port, state).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Group {
    /// The network namespace (see [`crate::table::Netns::label`]).
    pub netns: String,
    pub pid: Option<u32>,
    pub comm: String,
    pub unit: Option<String>,
    /// The container the owner runs in (full id), and its Kubernetes pod (`namespace/name`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    /// Where, for the table's summary lines: the pod, else runtime and short id.
    #[serde(skip)]
    pub place: Option<String>,
    pub service_port: u16,
    pub state: TcpState,
    pub count: usize,
    #[serde(serialize_with = "present::secs")]
    pub oldest_age_secs: Duration,
    /// False when any age in the group is only a lower bound.
    pub oldest_age_exact: bool,
    pub idle_count: usize,
}

/// What a summary line groups by: (namespace inode, owner pid, service port, state).
type GroupKey = (u32, Option<u32>, u16, TcpState);

/// Group sockets, largest group first.
pub fn summarize(socks: &[&Socket], idle_threshold: Duration) -> Vec<Group> {
    let mut groups: FxHashMap<GroupKey, Group> = FxHashMap::default();
    // The group of the previous socket: in display order most sockets are in the same one.
    let mut last: Option<(GroupKey, Group)> = None;
    for s in socks {
        let key = (s.netns.inode, s.pid(), s.service_port, s.state);
        let g = match &mut last {
            Some((k, g)) if *k == key => g,
            _ => {
                if let Some((k, g)) = last.take() {
                    groups.insert(k, g);
                }
                let g = groups.remove(&key).unwrap_or_else(|| Group {
                    netns: s.netns.label(),
                    pid: s.pid(),
                    comm: s.comm().to_string(),
                    unit: s.unit(),
                    container: s.container_id().map(String::from),
                    pod: s.container().and_then(pod_of),
                    place: s.container().map(container_cell),
                    service_port: s.service_port,
                    state: s.state,
                    count: 0,
                    oldest_age_secs: Duration::ZERO,
                    oldest_age_exact: true,
                    idle_count: 0,
                });
                &mut last.insert((key, g)).1
            }
        };
        g.count += 1;
        if s.age() >= g.oldest_age_secs {
            g.oldest_age_secs = s.age();
        }
        g.oldest_age_exact &= s.age_exact;
        if s.idle().is_some_and(|i| i >= idle_threshold) {
            g.idle_count += 1;
        }
    }
    if let Some((k, g)) = last {
        groups.insert(k, g);
    }
    let mut v: Vec<Group> = groups.into_values().collect();
    v.sort_by(|a, b| {
        b.count
            .cmp(&a.count)
            .then(b.oldest_age_secs.cmp(&a.oldest_age_secs))
            .then(a.service_port.cmp(&b.service_port))
    });
    v
}

/// Display order: by owner (command name, then pid), service port and state, oldest first;
/// stable. Owners are ranked once, so the sort compares integers, not strings.
pub fn sort_for_display(socks: &mut [&Socket]) {
    // Owner identity: the shared allocation (one per process; 0 for no owner).
    let id = |s: &Socket| {
        s.owner
            .as_ref()
            .map_or(0, |o| std::sync::Arc::as_ptr(o) as usize)
    };
    let mut seen = FxHashSet::default();
    let mut owners: Vec<(&str, Option<u32>, usize)> = Vec::new();
    for s in socks.iter() {
        if seen.insert(id(s)) {
            owners.push((s.comm(), s.pid(), id(s)));
        }
    }
    owners.sort_unstable();
    // Equal (comm, pid) get equal ranks.
    let mut rank: FxHashMap<usize, usize> =
        FxHashMap::with_capacity_and_hasher(owners.len(), Default::default());
    let mut r = 0;
    for (i, o) in owners.iter().enumerate() {
        if i > 0 && (owners[i - 1].0, owners[i - 1].1) != (o.0, o.1) {
            r += 1;
        }
        rank.insert(o.2, r);
    }
    // One integer per socket: rank, port, state (declared in `Ord` order), then the age
    // reversed, in nanoseconds (584 years fit). Comparing it is a fraction of comparing the
    // tuple, which at 100k sockets was most of the sort.
    socks.sort_by_cached_key(|s| {
        let rank = rank.get(&id(s)).copied().unwrap_or(0) as u128;
        let age = u64::try_from(s.age().as_nanos()).unwrap_or(u64::MAX);
        (rank << 96)
            | (u128::from(s.service_port) << 80)
            | (u128::from(s.state as u8) << 64)
            | u128::from(u64::MAX - age)
    });
}

/// serde_json's compact output, except that non-negative numbers with at most three decimals
/// below 1e9 (every seconds figure) are printed from integers: the same text as serde_json's
/// shortest round-trip float formatting, at a fraction of its cost.
struct SecsFormatter;

impl serde_json::ser::Formatter for SecsFormatter {
    fn write_f64<W: ?Sized + std::io::Write>(&mut self, w: &mut W, v: f64) -> std::io::Result<()> {
        let ms = (v * 1000.0).round();
        if !(0.0..1e12).contains(&ms) || ms / 1000.0 != v {
            return serde_json::ser::CompactFormatter.write_f64(w, v);
        }
        let ms = ms as u64;
        w.write_all(itoa::Buffer::new().format(ms / 1000).as_bytes())?;
        let frac = ms % 1000;
        let digits = [
            b'.',
            b'0' + (frac / 100) as u8,
            b'0' + (frac / 10 % 10) as u8,
            b'0' + (frac % 10) as u8,
        ];
        // At least one decimal ("2.0"), trailing zeros dropped ("2.5", not "2.500").
        let keep = if frac.is_multiple_of(100) {
            2
        } else if frac.is_multiple_of(10) {
            3
        } else {
            4
        };
        w.write_all(&digits[..keep])
    }
}

/// Write `v` as compact JSON (same text as `serde_json::to_writer`, faster for seconds).
pub fn to_json_writer<W: std::io::Write, T: Serialize>(w: W, v: &T) -> serde_json::Result<()> {
    v.serialize(&mut serde_json::Serializer::with_formatter(
        w,
        SecsFormatter,
    ))
}

/// Bytes reserved per JSON socket row: above a row's usual length (about 390 bytes with an
/// owner and its namespace, more with a container), so a buffer of rows is never grown (and
/// copied) while it is written; pages reserved and not written cost no memory.
const ROW_BYTES: usize = 512;

/// `{"count":N,"sockets":[..]}` (GET /v1/sockets): rows written straight into the buffer, no
/// JSON value tree (which took ten times the table's memory for the length of a request).
pub fn socket_list_json(sockets: &[&Socket]) -> serde_json::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(32 + sockets.len() * ROW_BYTES);
    out.extend_from_slice(b"{\"count\":");
    out.extend_from_slice(itoa::Buffer::new().format(sockets.len()).as_bytes());
    out.extend_from_slice(b",\"sockets\":[");
    row::write_rows(&mut out, sockets)?;
    out.extend_from_slice(b"]}");
    Ok(out)
}

/// The `snapshot --json` document, `{"sockets":[..],"summary":[..],"counters":..}`, compact:
/// the same text as [`to_json_writer`] on a struct of those three fields. The socket rows, most
/// of the text (megabytes at tens of thousands of sockets), are rendered on `threads` threads at once, in
/// rounds of a few thousand rows per thread, so the memory held stays small at any size.
pub fn write_snapshot_json<W: std::io::Write, C: Serialize + Sync>(
    w: &mut W,
    sockets: &[&Socket],
    summary: &[Group],
    counters: &C,
    threads: usize,
) -> serde_json::Result<()> {
    // Rows per thread and round; below MIN_ROWS a thread costs more than the rows it renders.
    const ROWS: usize = 4096;
    const MIN_ROWS: usize = 1024;
    let threads = threads.max(1);
    let render = |rows: &[&Socket]| -> serde_json::Result<Vec<u8>> {
        let mut out = Vec::with_capacity(rows.len() * ROW_BYTES);
        row::write_rows(&mut out, rows)?;
        Ok(out)
    };
    let io = serde_json::Error::io;
    w.write_all(b"{\"sockets\":[").map_err(io)?;
    let mut first = true;
    for round in sockets.chunks(ROWS * threads) {
        let n = threads.clamp(1, round.len() / MIN_ROWS + 1);
        let parts: Vec<Vec<u8>> = if n == 1 {
            vec![render(round)?]
        } else {
            std::thread::scope(|scope| {
                let handles: Vec<_> = round
                    .chunks(round.len().div_ceil(n))
                    .map(|rows| scope.spawn(move || render(rows)))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                    .collect::<serde_json::Result<_>>()
            })?
        };
        for part in parts.iter().filter(|p| !p.is_empty()) {
            if !first {
                w.write_all(b",").map_err(io)?;
            }
            w.write_all(part).map_err(io)?;
            first = false;
        }
    }
    w.write_all(b"],\"summary\":").map_err(io)?;
    to_json_writer(&mut *w, &summary)?;
    w.write_all(b",\"counters\":").map_err(io)?;
    to_json_writer(&mut *w, counters)?;
    w.write_all(b"}").map_err(io)
}

/// A pod as `namespace/name`, when its name is known.
fn pod_of(c: &crate::containers::Container) -> Option<String> {
    Some(format!(
        "{}/{}",
        c.pod_namespace.as_ref()?,
        c.pod_name.as_ref()?
    ))
}

/// The POD/CONTAINER cell: the pod's `namespace/name`, else `runtime:name` when the runtime
/// named the container, else `runtime:short-id`.
fn container_cell(c: &crate::containers::Container) -> String {
    pod_of(c).unwrap_or_else(|| {
        let name = c.name.as_deref().unwrap_or_else(|| c.short_id());
        format!("{}:{name}", c.runtime.as_str())
    })
}

/// A value a process, cgroup or runtime file controls, as a person's terminal may show it:
/// control characters (a newline, ESC) escaped.
pub fn printable(s: &str) -> String {
    if !s.chars().any(char::is_control) {
        return s.to_string();
    }
    s.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::{table::render_table, *};
    use crate::table::{Direction, Owner};
    use std::sync::Arc;

    pub(crate) fn sock(
        pid: u32,
        comm: &str,
        state: TcpState,
        port: u16,
        age: u64,
        idle: u64,
    ) -> Socket {
        let mut s = Socket::new(
            "127.0.0.1:45000".parse().unwrap(),
            format!("127.0.0.1:{port}").parse().unwrap(),
            state,
        );
        s.skaddr = 1;
        s.inode = 1;
        s.cookie = 1;
        s.set_age(Duration::from_secs(age));
        s.set_idle(Some(Duration::from_secs(idle)));
        s.direction = Direction::Outbound;
        s.service_port = port;
        s.owner = Some(std::sync::Arc::new(Owner {
            pid,
            comm: comm.into(),
            unit: None,
            container: None,
        }));
        s.fd = 3;
        s
    }

    /// Sockets of one group scattered among others (the summary's fast path only helps runs
    /// of one group): every group's count, oldest age, exactness and idle count are what a
    /// plain count per socket gives.
    #[test]
    fn groups_counted_alike_in_runs_and_scattered() {
        let mut all: Vec<Socket> = (0..500u64)
            .map(|i| {
                let mut s = sock(
                    [10, 20, 30][(i * 7 % 3) as usize],
                    "x",
                    [TcpState::Established, TcpState::CloseWait][(i % 2) as usize],
                    80 + (i * 13 % 4) as u16,
                    i * 31 % 97,
                    i % 60,
                );
                s.age_exact = i % 11 != 0;
                s
            })
            .collect();
        all.sort_by_key(|s| s.pid());
        for order in 0..2 {
            if order == 1 {
                // Interleaved: no two neighbours in one group, where the groups allow it.
                all.sort_by_key(|s| (s.age(), s.service_port));
            }
            let refs: Vec<&Socket> = all.iter().collect();
            let got = summarize(&refs, Duration::from_secs(30));
            let mut want: FxHashMap<GroupKey, (usize, Duration, bool, usize)> =
                FxHashMap::default();
            for s in &all {
                let w = want
                    .entry((s.netns.inode, s.pid(), s.service_port, s.state))
                    .or_insert((0, Duration::ZERO, true, 0));
                w.0 += 1;
                w.1 = w.1.max(s.age());
                w.2 &= s.age_exact;
                w.3 += usize::from(s.idle().is_some_and(|i| i >= Duration::from_secs(30)));
            }
            assert_eq!(got.len(), want.len(), "order {order}");
            for g in &got {
                let w = want[&(0, g.pid, g.service_port, g.state)];
                assert_eq!(
                    (g.count, g.oldest_age_secs, g.oldest_age_exact, g.idle_count),
                    w,
                    "order {order}: {g:?}"
                );
            }
        }
    }

    #[test]
    fn groups_largest_first() {
        let a: Vec<Socket> = (0..3)
            .map(|i| sock(10, "java", TcpState::CloseWait, 80, 100 + i, 50))
            .chain([sock(20, "node", TcpState::Established, 21000, 5, 1)])
            .collect();
        let refs: Vec<&Socket> = a.iter().collect();
        let g = summarize(&refs, Duration::from_secs(30));
        assert_eq!(g.len(), 2);
        assert_eq!(
            (g[0].comm.as_str(), g[0].count, g[0].idle_count),
            ("java", 3, 3)
        );
        assert_eq!(g[0].oldest_age_secs, Duration::from_secs(102));
        assert_eq!(
            (g[1].comm.as_str(), g[1].count, g[1].idle_count),
            ("node", 1, 0)
        );
        let text = render_table(&refs, &g);
        assert!(
            text.contains("3  java (pid 10) port 80 CLOSE_WAIT, oldest 1m42s"),
            "{text}"
        );
    }

    /// Pods by name, containers by runtime and short id, units only outside containers and
    /// cut short, and nothing a process controls reaches the terminal raw.
    #[test]
    fn the_table_names_pods_and_escapes_what_processes_control() {
        use crate::containers::{Container, Runtime};
        let mut a = sock(10, "evil\n\u{1b}[31mx", TcpState::Established, 80, 10, 10);
        let mut b = sock(20, "node", TcpState::Established, 81, 10, 10);
        let mut c = sock(30, "java", TcpState::Established, 82, 10, 10);
        let pod = Container {
            id: "ab".repeat(32),
            runtime: Runtime::Containerd,
            pod_uid: None,
            pod_name: Some("proxy-6d9f".into()),
            pod_namespace: Some("shop".into()),
            name: None,
            image: None,
        };
        let bare = Container {
            id: "cd".repeat(32),
            runtime: Runtime::Docker,
            pod_uid: None,
            pod_name: None,
            pod_namespace: None,
            name: None,
            image: None,
        };
        let owner = |s: &Socket, unit: &str, c: Option<&Container>| {
            Some(Arc::new(Owner {
                unit: Some(Arc::from(unit)),
                container: c.map(|c| Arc::new(c.clone())),
                ..(**s.owner.as_ref().unwrap()).clone()
            }))
        };
        a.owner = owner(
            &a,
            "/user.slice/user-0.slice/session-3-very-long-name-of-a-scope.scope",
            None,
        );
        b.owner = owner(
            &b,
            &format!("/kubepods.slice/cri-containerd-{}.scope", pod.id),
            Some(&pod),
        );
        c.owner = owner(&c, "docker-x.scope", Some(&bare));
        let refs: Vec<&Socket> = vec![&a, &b, &c];
        let text = render_table(&refs, &summarize(&refs, Duration::from_secs(30)));
        assert!(!text.contains('\u{1b}'), "{text}");
        assert_eq!(
            text.lines().filter(|l| l.contains("evil")).count(),
            2,
            "one row and one summary line: {text}"
        );
        assert!(text.contains("evil\\n\\u{1b}[31mx"), "{text}");
        assert!(text.contains("session-3-very-long-name-of-a-s…"), "{text}");
        assert!(text.contains("shop/proxy-6d9f"), "{text}");
        assert!(text.contains("docker:cdcdcdcdcdcd"), "{text}");
        assert!(
            !text.contains("kubepods"),
            "no unit for a container's process: {text}"
        );
        assert!(
            text.contains("node (pid 20, shop/proxy-6d9f) port 81"),
            "{text}"
        );
    }

    #[test]
    fn display_order_matches_the_plain_comparison() {
        let mut all = Vec::new();
        for i in 0..200u64 {
            let (pid, comm) = [(10, "java"), (20, "node"), (5, "node"), (7, "?x")][i as usize % 4];
            let st = [
                TcpState::CloseWait,
                TcpState::Established,
                TcpState::NewSynRecv,
                TcpState::Listen,
                TcpState::SynSent,
            ][(i / 4) as usize % 5];
            let mut s = sock(pid, comm, st, 80 + (i % 3) as u16, i % 7, 0);
            s.set_age(s.age() + Duration::from_millis(i * 7919 % 1000));
            if i % 13 == 0 {
                s.set_age(Duration::MAX);
            }
            s.inode = i;
            if i % 11 == 0 {
                s.owner = None;
            }
            all.push(s);
        }
        let mut fast: Vec<&Socket> = all.iter().collect();
        let mut plain = fast.clone();
        sort_for_display(&mut fast);
        plain.sort_by(|a, b| {
            (a.comm(), a.pid(), a.service_port, a.state)
                .cmp(&(b.comm(), b.pid(), b.service_port, b.state))
                .then(b.age().cmp(&a.age()))
        });
        let inodes = |v: &[&Socket]| v.iter().map(|s| s.inode).collect::<Vec<_>>();
        assert_eq!(inodes(&fast), inodes(&plain));
    }

    #[test]
    fn seconds_print_like_serde_json() {
        let mut values: Vec<f64> = (0..200_000u64).map(|ms| ms as f64 / 1000.0).collect();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            values.push((x % 1_000_000_000_000) as f64 / 1000.0);
        }
        values.extend([1e9, 1e12, 1.5e15, 0.0005, 1.0 / 3.0, 123.456_789, f64::MAX]);
        for v in values {
            let mut fast = Vec::new();
            to_json_writer(&mut fast, &v).unwrap();
            assert_eq!(
                String::from_utf8(fast).unwrap(),
                serde_json::to_string(&v).unwrap()
            );
        }
    }

    #[test]
    fn socket_list_is_count_and_rows() {
        let all: Vec<Socket> = (0..3)
            .map(|i| sock(i, "java", TcpState::CloseWait, 80, 5, 5))
            .collect();
        for n in 0..=3 {
            let refs: Vec<&Socket> = all[..n].iter().collect();
            let body = socket_list_json(&refs).unwrap();
            let plain = serde_json::json!({ "count": n, "sockets": refs });
            let parsed: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(parsed, plain);
        }
    }

    #[test]
    fn snapshot_json_in_slices_is_the_plain_serialization() {
        #[derive(Serialize)]
        struct Out<'a> {
            sockets: &'a [&'a Socket],
            summary: &'a [Group],
            counters: (u32, &'a str),
        }
        let all: Vec<Socket> = (0..9000u64)
            .map(|i| {
                let mut s = sock(i as u32 % 7, "java", TcpState::CloseWait, 80, i, i % 50);
                s.set_age(Duration::from_millis(i * 37));
                s
            })
            .collect();
        for n in [0, 1, 2, 1023, 1024, 2049, 5000, 9000] {
            let refs: Vec<&Socket> = all[..n].iter().collect();
            let summary = summarize(&refs, Duration::from_secs(30));
            let counters = (7, "x");
            let mut plain = Vec::new();
            let out = Out {
                sockets: &refs,
                summary: &summary,
                counters,
            };
            to_json_writer(&mut plain, &out).unwrap();
            for threads in [1, 2, 3, 8] {
                let mut sliced = Vec::new();
                write_snapshot_json(&mut sliced, &refs, &summary, &counters, threads).unwrap();
                assert_eq!(
                    String::from_utf8(sliced).unwrap(),
                    String::from_utf8(plain.clone()).unwrap(),
                    "{n} sockets on {threads} threads"
                );
            }
        }
    }
}
