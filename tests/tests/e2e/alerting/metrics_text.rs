//! `curl /metrics | promtool check metrics`, as an operator checks an agent by hand: with no
//! Accept header the agent answers the Prometheus text format, promtool finds nothing to
//! complain about, and the agent's own `process_*` metrics describe the agent's process.

use std::{
    io::Write as _,
    process::{Command, Stdio},
    time::{SystemTime, UNIX_EPOCH},
};

use connreap_tests::harness::{require_privileges, Agent, Config, Metrics, NetNs, TempDir, API};

/// Whether `program --version` runs; missing, the test is skipped, except under `CI=true`
/// (`cargo xtask test` installs curl and promtool).
fn have(program: &str) -> bool {
    let ok = Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        assert!(
            std::env::var("CI").map_or(true, |v| v != "true" && v != "1"),
            "CI=true but {program} is missing (cargo xtask test installs it)"
        );
        println!("skipped: {program} is not installed");
    }
    ok
}

#[test]
fn curl_metrics_without_accept_passes_promtool_with_process_metrics() {
    let Some(_env) = require_privileges() else {
        return;
    };
    if !have("curl") || !have("promtool") {
        return;
    }
    let ns = NetNs::new("mtext");
    let dir = TempDir::new("mtext");
    let before = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    let mut agent = Agent::start(&ns, &dir, &Config::new(&dir));

    // `-H Accept:` removes the header curl sends by default.
    let out = ns
        .command("curl")
        .args([
            "-sS",
            "--fail",
            "--max-time",
            "10",
            "-H",
            "Accept:",
            "-D",
            "-",
        ])
        .arg(format!("http://{API}/metrics"))
        .output()
        .expect("run curl");
    let raw = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "curl: {}\n{raw}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (head, body) = raw.split_once("\r\n\r\n").expect("headers then body");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4; charset=utf-8"),
        "{head}"
    );
    assert!(!body.contains("# EOF"), "{body}");

    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start promtool");
    promtool
        .stdin
        .take()
        .expect("stdin")
        .write_all(body.as_bytes())
        .expect("feed promtool");
    let checked = promtool.wait_with_output().expect("promtool");
    let said = String::from_utf8_lossy(&checked.stdout).to_string()
        + &String::from_utf8_lossy(&checked.stderr);
    assert!(
        checked.status.success() && said.trim().is_empty(),
        "promtool check metrics: {said}\n--- body:\n{body}"
    );

    let m = Metrics::parse(body).expect("parse");
    let v = |series: &str| {
        m.value(series)
            .unwrap_or_else(|| panic!("{series} missing:\n{body}"))
    };
    let after = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    let start = v("process_start_time_seconds");
    // Clock-tick resolution (10 ms) and the boot-time rounding (1 s) allow a little slack.
    assert!(
        start >= before - 2.0 && start <= after,
        "process_start_time_seconds {start} not between {before} and {after}"
    );
    let rss = v("process_resident_memory_bytes");
    let vsz = v("process_virtual_memory_bytes");
    assert!(rss > 1e6 && rss < 2e9, "resident {rss}");
    assert!(vsz >= rss, "virtual {vsz} < resident {rss}");
    // The agent holds its BPF maps, programs, links and sockets open.
    let open = v("process_open_fds");
    let max = v("process_max_fds");
    assert!(open >= 5.0 && open < max, "open {open}, max {max}");
    // The agent's own numbers, read after the scrape: its CPU time and its fd table.
    let pid = agent.pid();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("agent stat");
    let fields: Vec<&str> = stat[stat.rfind(')').expect("comm") + 2..]
        .split_whitespace()
        .collect();
    // utime and stime (fields 14 and 15), in clock ticks of 1/100 s on Linux.
    let ticks: f64 =
        fields[11].parse::<f64>().expect("utime") + fields[12].parse::<f64>().expect("stime");
    let cpu = v("process_cpu_seconds_total");
    assert!(
        cpu >= 0.0 && cpu <= ticks / 100.0 && ticks / 100.0 - cpu < 1.0,
        "process_cpu_seconds_total {cpu}, /proc/{pid}/stat says {} s",
        ticks / 100.0
    );
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count() as f64)
        .expect("agent fds");
    assert!(
        (open - fds).abs() <= 8.0,
        "process_open_fds {open}, /proc/{pid}/fd {fds}"
    );
    agent.assert_alive();
}
