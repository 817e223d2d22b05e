//! Where the time goes, with `perf` when it is installed: flat CPU profiles of a command, a
//! process or the whole machine, summarised as top symbols and per-component totals. Used only
//! to explain a figure (a missed target); measures never depend on it.
use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{bail, Context, Result};

use crate::{proc::Proc, sys};

pub fn available() -> bool {
    Command::new("perf")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// (percent of samples, dso, symbol), largest first.
pub struct Profile(pub Vec<(f64, String, String)>);

fn report(data: &Path) -> Result<Profile> {
    let out = Command::new("perf")
        .arg("report")
        .arg("-i")
        .arg(data)
        .args(["--no-children", "--sort", "dso,sym", "--stdio", "-q"])
        .stderr(Stdio::null())
        .output()
        .context("perf report")?;
    let _ = std::fs::remove_file(data);
    let mut rows = Vec::new();
    for l in String::from_utf8_lossy(&out.stdout).lines() {
        let mut it = l.split_whitespace();
        let Some(pct) = it
            .next()
            .and_then(|p| p.strip_suffix('%')?.parse::<f64>().ok())
        else {
            continue;
        };
        let dso = it.next().unwrap_or_default().to_string();
        let _marker = it.next();
        let sym = it.collect::<Vec<_>>().join(" ");
        rows.push((pct, dso, sym));
    }
    if rows.is_empty() {
        bail!("perf recorded no samples");
    }
    Ok(Profile(rows))
}

fn data_file(dir: &Path, tag: &str) -> PathBuf {
    dir.join(format!("perf-{tag}.data"))
}

/// Profile `cmd` (a `perf` command already set up, e.g. to run in a namespace) running `args`.
pub fn command(mut perf: Command, args: &[&str], dir: &Path, tag: &str) -> Result<Profile> {
    let data = data_file(dir, tag);
    let st = perf
        .args(["record", "-q", "-F", "1999", "-o"])
        .arg(&data)
        .arg("--")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()?;
    if !st.success() {
        bail!("perf record failed: {st}");
    }
    report(&data)
}

/// A `perf record` of a running process (`Some(pid)`) or of every CPU (`None`).
pub struct Recording {
    proc: Proc,
    data: PathBuf,
}

impl Recording {
    pub fn start(pid: Option<u32>, dir: &Path, tag: &str) -> Result<Recording> {
        let data = data_file(dir, tag);
        let mut cmd = Command::new("perf");
        cmd.args(["record", "-q", "-F", "1999", "-o"]).arg(&data);
        match pid {
            Some(p) => cmd.args(["-p", &p.to_string()]),
            None => cmd.arg("-a"),
        };
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let proc = Proc::spawn(&mut cmd, "perf record")?;
        // Let perf set up its events before the interesting part starts.
        sys::sleep(Duration::from_millis(300))?;
        Ok(Recording { proc, data })
    }

    pub fn finish(mut self) -> Result<Profile> {
        // SIGINT makes perf write its data and exit; its exit status varies with how the signal
        // lands, so the report decides whether data was written.
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.proc.pid() as i32, libc::SIGINT) };
        let _ = self.proc.child.wait()?;
        report(&self.data)
    }
}

/// Component of a symbol: the crate of a Rust path, "allocator" for malloc/free, "kernel: sym"
/// for kernel symbols.
fn component(dso: &str, sym: &str) -> String {
    if dso.contains("kernel") || dso == "[bpf]" || sym.starts_with("bpf_prog_") {
        return format!("kernel: {sym}");
    }
    let s = sym.trim_start_matches('<');
    if dso.starts_with("libc") {
        let alloc = [
            "malloc",
            "free",
            "realloc",
            "_int_",
            "unlink_chunk",
            "calloc",
        ];
        if alloc.iter().any(|a| s.contains(a)) {
            return "allocator (malloc/free)".into();
        }
        return format!("libc: {s}");
    }
    match s.split_once("::") {
        Some((krate, _)) => format!("{krate} (Rust crate)"),
        None => format!("{dso}: {s}"),
    }
}

impl Profile {
    /// `n` largest symbols: "12.3 % sym".
    pub fn top(&self, n: usize) -> Vec<String> {
        self.0
            .iter()
            .take(n)
            .map(|(p, _, s)| format!("{p:.1} % {s}"))
            .collect()
    }

    /// `n` largest components (kernel symbols stay separate, user code is grouped by crate).
    pub fn components(&self, n: usize) -> Vec<String> {
        let mut acc: Vec<(String, f64)> = Vec::new();
        for (p, dso, sym) in &self.0 {
            let c = component(dso, sym);
            match acc.iter_mut().find(|(k, _)| *k == c) {
                Some((_, v)) => *v += p,
                None => acc.push((c, *p)),
            }
        }
        acc.sort_by(|a, b| b.1.total_cmp(&a.1));
        acc.into_iter()
            .take(n)
            .map(|(c, p)| format!("{p:.1} % {c}"))
            .collect()
    }

    /// Kernel symbols on the state tracker's path, by part, as % of all samples.
    pub fn tracker_parts(&self) -> Vec<(&'static str, f64, Vec<String>)> {
        const PARTS: [(&str, &[&str]); 6] = [
            ("program body (JIT)", &["connreap_set_state"]),
            (
                "state table (CONNREAP_STATE; kernel map code only in the hash variant)",
                &[
                    "htab_",
                    "alloc_htab_elem",
                    "bpf_mem_",
                    "unit_alloc",
                    "unit_free",
                    "lookup_nulls_elem_raw",
                    "bpf_map_lookup",
                    "bpf_map_update",
                    "bpf_map_delete",
                    "pcpu_",
                ],
            ),
            ("ring buffer (CONNREAP_EVENTS)", &["ringbuf", "irq_work"]),
            (
                "other helpers",
                &[
                    "bpf_get_current",
                    "bpf_ktime",
                    "bpf_jiffies64",
                    "ktime_get_mono_fast",
                    "bpf_probe_read",
                    "copy_from_kernel_nofault",
                    "strscpy",
                ],
            ),
            (
                "tracepoint dispatch (__traceiter + bpf_trace_run)",
                &[
                    "__traceiter_inet_sock",
                    "__bpf_trace_inet_sock",
                    "bpf_trace_run",
                    "perf_trace_",
                    "trace_call_bpf",
                    "bpf_prog_run_array",
                ],
            ),
            (
                "__bpf_prog_enter/exit",
                &[
                    "__bpf_prog_enter",
                    "__bpf_prog_exit",
                    "migrate_disable",
                    "migrate_enable",
                ],
            ),
        ];
        let mut out = Vec::new();
        for (name, pats) in PARTS {
            let hits: Vec<&(f64, String, String)> = self
                .0
                .iter()
                .filter(|(_, dso, s)| {
                    (dso.contains("kernel") || dso == "[bpf]" || s.starts_with("bpf_prog_"))
                        && pats.iter().any(|p| s.contains(p))
                        && (name.starts_with("program") || !s.starts_with("bpf_prog_"))
                })
                .collect();
            let total: f64 = hits.iter().map(|h| h.0).sum();
            let syms = hits
                .iter()
                .take(4)
                .map(|h| format!("{} {:.2} %", h.2, h.0))
                .collect();
            out.push((name, total, syms));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_symbols() {
        assert_eq!(
            component(
                "connreap",
                "<core::hash::sip::Hasher<S> as core::hash::Hasher>::write"
            ),
            "core (Rust crate)"
        );
        assert_eq!(
            component("libc.so.6", "_int_malloc"),
            "allocator (malloc/free)"
        );
        assert_eq!(
            component("[kernel.kallsyms]", "htab_map_update_elem"),
            "kernel: htab_map_update_elem"
        );
        let p = Profile(vec![
            (
                3.0,
                "[kernel.kallsyms]".into(),
                "__bpf_ringbuf_reserve".into(),
            ),
            (
                1.0,
                "[bpf]".into(),
                "bpf_prog_abc_connreap_set_state".into(),
            ),
            (0.5, "[kernel.kallsyms]".into(), "trace_call_bpf".into()),
        ]);
        let parts = p.tracker_parts();
        assert_eq!(parts[0].1, 1.0);
        assert_eq!(parts[2].1, 3.0);
        assert_eq!(parts[4].1, 0.5);
    }
}
