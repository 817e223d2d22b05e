//! The snapshot's table, the output a person reads: one line per socket in aligned columns,
//! then the summary by owner, service port and state.
//!
//! At 100k sockets the rows are most of the work. They are rendered in two passes over slices
//! of the rows, each slice on its own thread: the first writes every row's cells into one
//! buffer per slice (no String per cell) and measures the columns; the second pads the cells
//! to the widths of all slices. The cells an owner decides (namespace, container, pid,
//! command, unit) are rendered once per run of rows with the same owner and namespace, which
//! the display order makes long, and copied for the others.
use std::{io::Write, sync::Arc};

use super::{container_cell, printable, Group};
use crate::{
    present::{human, push_human},
    table::Socket,
};

const COLUMNS: usize = 12;
const HEADER: [&str; COLUMNS] = [
    "NETNS",
    "POD/CONTAINER",
    "PID",
    "COMM",
    "UNIT",
    "LOCAL",
    "PEER",
    "STATE",
    "AGE",
    "IDLE",
    "RECV-Q",
    "SEND-Q",
];
/// The leading cells that depend only on the owner and the namespace.
const OWNER_CELLS: usize = 5;
/// Below this many rows per thread a thread costs more than the rows it renders.
const MIN_ROWS: usize = 2048;

/// Longest UNIT cell: a cgroup path outside any unit is cut to its last component and this.
const UNIT_WIDTH: usize = 32;

/// The UNIT cell: only for processes outside containers (a container's cgroup says nothing
/// more than its POD/CONTAINER cell), the last path component, at most [`UNIT_WIDTH`].
fn unit_cell(s: &Socket) -> String {
    if s.container().is_some() {
        return "-".into();
    }
    let Some(unit) = s.owner.as_ref().and_then(|o| o.unit.as_deref()) else {
        return "-".into();
    };
    let last = unit.rsplit('/').find(|c| !c.is_empty()).unwrap_or(unit);
    if last.chars().count() <= UNIT_WIDTH {
        return last.to_string();
    }
    let head: String = last.chars().take(UNIT_WIDTH - 1).collect();
    format!("{head}…")
}

/// Characters in `b`, which holds whole UTF-8 sequences (one per byte that does not continue
/// one).
fn width(b: &[u8]) -> usize {
    b.iter().filter(|&&c| c & 0xC0 != 0x80).count()
}

/// A row being written at the end of a [`Cells`] buffer.
struct RowCells<'a> {
    text: &'a mut Vec<u8>,
    ends: [u32; COLUMNS],
    /// Cells ended so far.
    n: usize,
}

impl RowCells<'_> {
    /// End the cell written since the previous one ended.
    fn end(&mut self) {
        if let Some(e) = self.ends.get_mut(self.n) {
            *e = self.text.len() as u32;
        }
        self.n += 1;
    }

    /// Write a whole cell.
    fn cell(&mut self, b: &[u8]) {
        self.text.extend_from_slice(b);
        self.end();
    }
}

/// The cells of a slice of rows, in one buffer.
#[derive(Default)]
struct Cells {
    text: Vec<u8>,
    /// Per row, where each cell ends in `text` (a row starts where the previous one ended).
    ends: Vec<[u32; COLUMNS]>,
    widths: [usize; COLUMNS],
}

impl Cells {
    fn with_rows(n: usize) -> Self {
        Cells {
            text: Vec::with_capacity(n * 96),
            ends: Vec::with_capacity(n),
            widths: [0; COLUMNS],
        }
    }

    fn row_start(&self, i: usize) -> usize {
        i.checked_sub(1)
            .map_or(0, |p| self.ends[p][COLUMNS - 1] as usize)
    }

    /// The cells of row `i`.
    fn cells(&self, i: usize) -> impl Iterator<Item = &[u8]> + '_ {
        let mut start = self.row_start(i);
        self.ends[i].iter().map(move |&end| {
            let cell = &self.text[start..end as usize];
            start = end as usize;
            cell
        })
    }

    /// Count a row just written (its cells' `ends`) into the column widths.
    fn finish_row(&mut self, ends: [u32; COLUMNS]) {
        self.ends.push(ends);
        let mut start = self.row_start(self.ends.len() - 1);
        for (w, end) in self.widths.iter_mut().zip(ends) {
            *w = (*w).max(width(&self.text[start..end as usize]));
            start = end as usize;
        }
    }

    /// The first pass over `rows`.
    fn render(rows: &[&Socket]) -> Self {
        let mut c = Cells::with_rows(rows.len());
        // The row whose owner cells the next rows may copy: (owner, namespace) and its index.
        let mut last: Option<((usize, usize), usize)> = None;
        for s in rows {
            let key = (
                s.owner.as_ref().map_or(0, |o| Arc::as_ptr(o) as usize),
                Arc::as_ptr(&s.netns) as usize,
            );
            let same = last.filter(|(k, _)| *k == key).map(|(_, i)| i);
            // That row's start and the ends of its owner cells.
            let prefix = same.map(|i| {
                let mut ends = [0u32; OWNER_CELLS];
                ends.copy_from_slice(&c.ends[i][..OWNER_CELLS]);
                (c.row_start(i), ends)
            });
            let mut r = RowCells {
                text: &mut c.text,
                ends: [0; COLUMNS],
                n: 0,
            };
            match prefix {
                // The same cells as that row: its bytes copied, cell by cell.
                Some((mut start, ends)) => {
                    for e in ends {
                        r.text.extend_from_within(start..e as usize);
                        start = e as usize;
                        r.end();
                    }
                }
                None => {
                    r.cell(printable(&s.netns.label()).as_bytes());
                    match s.container() {
                        Some(ct) => r.cell(printable(&container_cell(ct)).as_bytes()),
                        None => r.cell(b"-"),
                    }
                    match s.pid() {
                        Some(p) => r.cell(itoa::Buffer::new().format(p).as_bytes()),
                        None => r.cell(b"-"),
                    }
                    r.cell(printable(s.comm()).as_bytes());
                    r.cell(printable(&unit_cell(s)).as_bytes());
                }
            }
            s.local.write_text(r.text);
            r.end();
            s.peer.write_text(r.text);
            r.end();
            r.cell(s.state.as_str().as_bytes());
            if !s.age_exact {
                r.text.extend_from_slice("≥".as_bytes());
            }
            push_human(r.text, s.age());
            r.end();
            match s.idle() {
                Some(d) => {
                    push_human(r.text, d);
                    r.end();
                }
                None => r.cell(b"-"),
            }
            r.cell(itoa::Buffer::new().format(s.rx_queue).as_bytes());
            r.cell(itoa::Buffer::new().format(s.tx_queue).as_bytes());
            let ends = r.ends;
            c.finish_row(ends);
            if same.is_none() {
                last = Some((key, c.ends.len() - 1));
            }
        }
        c
    }

    /// The second pass: every row as a line, its cells padded to `widths` and joined by two
    /// spaces. The last cell (SEND-Q, a number) is not padded: the line has no trailing blanks.
    fn lines(&self, widths: &[usize; COLUMNS], out: &mut Vec<u8>) {
        for i in 0..self.ends.len() {
            line(self.cells(i), widths, out);
        }
    }
}

fn line<'a>(cells: impl Iterator<Item = &'a [u8]>, widths: &[usize; COLUMNS], out: &mut Vec<u8>) {
    for (n, (cell, w)) in cells.zip(widths).enumerate() {
        if n > 0 {
            out.extend_from_slice(b"  ");
        }
        out.extend_from_slice(cell);
        if n + 1 < COLUMNS {
            let pad = w.saturating_sub(width(cell));
            out.resize(out.len() + pad, b' ');
        }
    }
    out.push(b'\n');
}

/// Both passes over `socks` in slices, one thread each (up to `threads`).
fn rows(socks: &[&Socket], threads: usize) -> Vec<Vec<u8>> {
    let n = threads.clamp(1, socks.len() / MIN_ROWS + 1);
    let slices: Vec<&[&Socket]> = socks.chunks(socks.len().div_ceil(n).max(1)).collect();
    let cells: Vec<Cells> = if slices.len() <= 1 {
        slices.iter().map(|r| Cells::render(r)).collect()
    } else {
        std::thread::scope(|scope| {
            let handles: Vec<_> = slices
                .iter()
                .map(|r| scope.spawn(move || Cells::render(r)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect()
        })
    };
    let mut widths = HEADER.map(str::len);
    for c in &cells {
        for (w, cw) in widths.iter_mut().zip(c.widths) {
            *w = (*w).max(cw);
        }
    }
    let mut head = Vec::new();
    line(HEADER.iter().map(|h| h.as_bytes()), &widths, &mut head);
    let mut parts = vec![head];
    let render = |c: &Cells| {
        let mut out = Vec::with_capacity(c.ends.len() * (widths.iter().sum::<usize>() + 24));
        c.lines(&widths, &mut out);
        out
    };
    if cells.len() <= 1 {
        parts.extend(cells.iter().map(render));
    } else {
        std::thread::scope(|scope| {
            let handles: Vec<_> = cells
                .iter()
                .map(|c| scope.spawn(move || render(c)))
                .collect();
            for h in handles {
                parts.push(h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
            }
        });
    }
    parts
}

/// The summary below the rows: one line per group, largest first.
fn summary(socks: usize, groups: &[Group]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(out, "\n{socks} sockets. By owner, service port and state:");
    for g in groups {
        let _ = writeln!(
            out,
            "{:>6}  {} (pid {}{}{}) port {} {}, oldest {}{}",
            g.count,
            printable(&g.comm),
            g.pid.map(|p| p.to_string()).unwrap_or_else(|| "?".into()),
            match (&g.place, &g.unit) {
                (Some(place), _) => format!(", {}", printable(place)),
                (None, Some(u)) => format!(", {}", printable(u.rsplit('/').next().unwrap_or(u))),
                (None, None) => String::new(),
            },
            if g.netns == "host" {
                String::new()
            } else {
                format!(", netns {}", printable(&g.netns))
            },
            g.service_port,
            g.state,
            if g.oldest_age_exact { "" } else { "≥" },
            human(g.oldest_age_secs),
        );
    }
    out
}

/// Write the table of `socks` (in display order) and the summary of `groups` to `w`, the rows
/// rendered on up to `threads` threads.
pub fn write_table<W: Write>(
    w: &mut W,
    socks: &[&Socket],
    groups: &[Group],
    threads: usize,
) -> std::io::Result<()> {
    for part in rows(socks, threads) {
        w.write_all(&part)?;
    }
    w.write_all(summary(socks.len(), groups).as_bytes())
}

/// [`write_table`] as a string, on one thread (tests).
#[cfg(test)]
pub fn render_table(socks: &[&Socket], groups: &[Group]) -> String {
    let mut out = Vec::new();
    // Writing to a Vec cannot fail.
    let _ = write_table(&mut out, socks, groups, 1);
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::{summarize, tests::sock};
    use crate::table::TcpState;
    use std::time::Duration;

    /// The table as it was first written, one String per cell: the text the fast renderer
    /// must reproduce.
    fn plain_table(socks: &[&Socket]) -> String {
        let mut rows: Vec<[String; COLUMNS]> = vec![HEADER.map(String::from)];
        for s in socks {
            rows.push([
                printable(&s.netns.label()),
                s.container()
                    .map(|c| printable(&container_cell(c)))
                    .unwrap_or_else(|| "-".into()),
                s.pid().map(|p| p.to_string()).unwrap_or_else(|| "-".into()),
                printable(s.comm()),
                printable(&unit_cell(s)),
                s.local.to_string(),
                s.peer.to_string(),
                s.state.to_string(),
                if s.age_exact {
                    human(s.age())
                } else {
                    format!("≥{}", human(s.age()))
                },
                s.idle().map(human).unwrap_or_else(|| "-".into()),
                s.rx_queue.to_string(),
                s.tx_queue.to_string(),
            ]);
        }
        let mut widths = [0usize; COLUMNS];
        for r in &rows {
            for (w, c) in widths.iter_mut().zip(r) {
                *w = (*w).max(c.chars().count());
            }
        }
        let mut out = String::new();
        for r in &rows {
            let line: Vec<String> = r
                .iter()
                .zip(widths)
                .map(|(c, w)| format!("{c}{}", " ".repeat(w - c.chars().count())))
                .collect();
            out.push_str(line.join("  ").trim_end());
            out.push('\n');
        }
        out
    }

    /// Many rows (several slices on several threads), runs of one owner broken by others,
    /// owners without a process, wide and non-ASCII cells, inexact ages, IPv6 peers.
    #[test]
    fn the_fast_table_is_the_plain_one_on_any_number_of_threads() {
        let mut socks = Vec::new();
        let wide = Arc::new(crate::table::Owner {
            pid: 4_000_000,
            comm: "日本語-proxy\n".into(),
            unit: Some(Arc::from(
                "/system.slice/a-very-long-unit-name-that-is-cut-short.service",
            )),
            container: None,
        });
        for i in 0..9000u64 {
            let mut s = sock(
                10 + (i / 700) as u32,
                ["java", "node", "x"][(i / 700 % 3) as usize],
                [
                    TcpState::Established,
                    TcpState::CloseWait,
                    TcpState::TimeWait,
                ][(i % 3) as usize],
                80 + (i % 5) as u16,
                i * 37 % 200_000,
                i % 90_000,
            );
            if i % 997 == 0 {
                s.owner = None;
            }
            if i % 1999 == 1 {
                s.owner = Some(wide.clone());
            }
            if i % 4 == 1 {
                s.age_exact = false;
                s.set_idle(None);
            }
            if i % 13 == 0 {
                s.peer = "[2001:db8::1]:443".parse().unwrap();
            }
            s.tx_queue = (i * i % 100_000) as u32;
            socks.push(s);
        }
        let refs: Vec<&Socket> = socks.iter().collect();
        let groups = summarize(&refs, Duration::from_secs(30));
        let want = plain_table(&refs) + &summary(refs.len(), &groups);
        for threads in [1, 2, 3, 8] {
            let mut out = Vec::new();
            write_table(&mut out, &refs, &groups, threads).unwrap();
            let got = String::from_utf8(out).unwrap();
            if got != want {
                let first = got
                    .lines()
                    .zip(want.lines())
                    .position(|(a, b)| a != b)
                    .unwrap_or(0);
                panic!(
                    "{threads} threads: line {first} differs:\n{}\n{}",
                    got.lines().nth(first).unwrap_or_default(),
                    want.lines().nth(first).unwrap_or_default()
                );
            }
        }
        assert_eq!(render_table(&[], &[]), plain_table(&[]) + &summary(0, &[]));
    }
}
