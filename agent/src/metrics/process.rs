//! The agent's own `process_*` metrics, read from /proc/self at each scrape under the names
//! the Prometheus client libraries use (so dashboards and rules written for any exporter
//! work): CPU time, resident and virtual memory, open and maximum file descriptors, start
//! time. Written as OpenMetrics families; `exposition::to_prometheus` renames the counter for
//! the text format like every other family.
use std::fmt::Write as _;

/// The fields of /proc/self/stat used here.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Stat {
    /// utime + stime, in clock ticks.
    cpu_ticks: u64,
    /// Start time after boot, in clock ticks.
    start_ticks: u64,
    virtual_bytes: u64,
    resident_pages: u64,
}

/// /proc/<pid>/stat: the command name (field 2) is in parentheses and may hold spaces or
/// parentheses itself, so the fields are counted from after the last `)`.
fn parse_stat(text: &str) -> Option<Stat> {
    let rest = &text[text.rfind(')')? + 1..];
    // After ")": field 3 (state) is index 0, so field N is index N - 3.
    let f: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| f.get(n - 3)?.parse::<u64>().ok();
    Some(Stat {
        cpu_ticks: field(14)? + field(15)?,
        start_ticks: field(22)?,
        virtual_bytes: field(23)?,
        resident_pages: field(24)?,
    })
}

/// The soft limit on open files from /proc/self/limits (None when unlimited or unreadable).
fn parse_max_fds(limits: &str) -> Option<u64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// `btime` from /proc/stat: the boot time in seconds since the epoch.
fn parse_btime(stat: &str) -> Option<u64> {
    stat.lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()
}

fn sysconf(name: libc::c_int) -> Option<u64> {
    // SAFETY: sysconf has no preconditions; it returns -1 for unknown names.
    let v = unsafe { libc::sysconf(name) };
    u64::try_from(v).ok().filter(|&v| v > 0)
}

/// The families, in OpenMetrics text (no `# EOF`); a metric whose source cannot be read is
/// left out rather than reported as 0.
pub fn render() -> String {
    let stat = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|t| parse_stat(&t));
    let ticks = sysconf(libc::_SC_CLK_TCK);
    let page = sysconf(libc::_SC_PAGESIZE);
    let btime = std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|t| parse_btime(&t));
    let open_fds = std::fs::read_dir("/proc/self/fd")
        .ok()
        .map(|d| d.count() as u64);
    let max_fds = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|t| parse_max_fds(&t));

    let mut out = String::new();
    let mut family = |name: &str, kind: &str, help: &str, unit: Option<&str>, value: String| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        if let Some(u) = unit {
            let _ = writeln!(out, "# UNIT {name} {u}");
        }
        let sample = if kind == "counter" {
            format!("{name}_total")
        } else {
            name.to_string()
        };
        let _ = writeln!(out, "{sample} {value}");
    };
    if let (Some(s), Some(t)) = (stat, ticks) {
        family(
            "process_cpu_seconds",
            "counter",
            "Total user and system CPU time spent in seconds.",
            Some("seconds"),
            format!("{}", s.cpu_ticks as f64 / t as f64),
        );
    }
    if let Some(n) = open_fds {
        // read_dir's own descriptor is among those listed.
        family(
            "process_open_fds",
            "gauge",
            "Number of open file descriptors.",
            None,
            n.saturating_sub(1).to_string(),
        );
    }
    if let Some(n) = max_fds {
        family(
            "process_max_fds",
            "gauge",
            "Maximum number of open file descriptors.",
            None,
            n.to_string(),
        );
    }
    if let Some(s) = stat {
        family(
            "process_virtual_memory_bytes",
            "gauge",
            "Virtual memory size in bytes.",
            Some("bytes"),
            s.virtual_bytes.to_string(),
        );
        if let Some(p) = page {
            family(
                "process_resident_memory_bytes",
                "gauge",
                "Resident memory size in bytes.",
                Some("bytes"),
                (s.resident_pages * p).to_string(),
            );
        }
        if let (Some(b), Some(t)) = (btime, ticks) {
            family(
                "process_start_time_seconds",
                "gauge",
                "Start time of the process since unix epoch in seconds.",
                Some("seconds"),
                format!("{}", b as f64 + s.start_ticks as f64 / t as f64),
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_a_command_holding_spaces_and_parentheses() {
        // Fields 14, 15 (utime, stime), 22 (starttime), 23 (vsize), 24 (rss).
        let text = "4242 (my (odd) cmd) S 1 4242 4242 0 -1 4194560 100 0 0 0 \
                    250 50 0 0 20 0 3 0 123456 104857600 2560 18446744073709551615 \
                    1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0\n";
        assert_eq!(
            parse_stat(text),
            Some(Stat {
                cpu_ticks: 300,
                start_ticks: 123456,
                virtual_bytes: 104857600,
                resident_pages: 2560,
            })
        );
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn parses_limits_and_btime() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max processes             4096                 4096                 processes \n\
                      Max open files            16384                20000                files     \n";
        assert_eq!(parse_max_fds(limits), Some(16384));
        let unlimited =
            "Max open files            unlimited            unlimited            files\n";
        assert_eq!(parse_max_fds(unlimited), None);
        assert_eq!(
            parse_btime("cpu  1 2 3\nbtime 1700000000\nprocesses 9\n"),
            Some(1_700_000_000)
        );
    }

    #[test]
    fn this_process_is_described() {
        let text = render();
        for name in [
            "process_cpu_seconds_total ",
            "process_open_fds ",
            "process_max_fds ",
            "process_virtual_memory_bytes ",
            "process_resident_memory_bytes ",
            "process_start_time_seconds ",
        ] {
            assert!(
                text.contains(&format!("\n{name}")),
                "{name} missing:\n{text}"
            );
        }
        let value = |name: &str| -> f64 {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{name}:\n{text}"))
        };
        assert!(value("process_resident_memory_bytes") > 1e6);
        assert!(value("process_open_fds") >= 3.0);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let start = value("process_start_time_seconds");
        assert!(
            start <= now + 1.0 && start > now - 86400.0,
            "{start} vs {now}"
        );
    }
}
