//! Prometheus checks in `cargo xtask test`: the shipped alerting rules (`promtool check rules`
//! and their unit tests with `promtool test rules`), and a live scrape of the agent's /metrics
//! in the Prometheus text format through `promtool check metrics`. Debian's `prometheus`
//! package brings promtool (and the server the e2e tests start); it is installed with the
//! other test packages when missing.
use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    path::PathBuf,
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{bail, Context, Result};

use connreap_bench::{agent::Daemon, sys};

use crate::{root, run};

fn rules_dir() -> PathBuf {
    root().join("deploy/prometheus")
}

fn has_promtool() -> bool {
    Command::new("promtool")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

fn is_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// Install the e2e tests' Debian packages (`prometheus` brings promtool) unless promtool is
/// there. Without root it is skipped with a warning (an error under `CI=true`); returns
/// whether promtool is available.
pub fn ensure() -> Result<bool> {
    if has_promtool() {
        return Ok(true);
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        if is_ci() {
            bail!("promtool missing and not root: cannot install the prometheus package");
        }
        eprintln!("xtask: promtool not found and not root: skipping the Prometheus checks (`sudo cargo xtask setup` installs it)");
        return Ok(false);
    }
    crate::setup::ensure_test_packages()?;
    Ok(true)
}

/// `promtool check rules` and `promtool test rules` on deploy/prometheus (the rules' unit
/// tests, and the same rules on the labels the Prometheus Operator attaches).
pub fn check_rules() -> Result<()> {
    let dir = rules_dir();
    run(Command::new("promtool")
        .arg("check")
        .arg("rules")
        .arg(dir.join("connreap-rules.yml")))?;
    run(Command::new("promtool")
        .arg("test")
        .arg("rules")
        .arg(dir.join("connreap-rules.test.yml"))
        .arg(root().join(crate::monitoring::KUBERNETES_RULES_TEST)))
}

/// The Prometheus text format a scraper gets from a running agent (in its own namespace, with
/// a webhook receiver configured so the receiver-labelled series exist), through
/// `promtool check metrics`.
pub fn check_live_metrics() -> Result<()> {
    let (_lock, _) = sys::e2e_lock(Duration::from_secs(600))?;
    let t0 = std::time::Instant::now();
    let ns = sys::NetNs::new("promtool")?;
    let dir = std::env::temp_dir().join(format!("connreap-promtool-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = scrape_and_check(&ns.handle(), &dir);
    eprintln!("xtask: live /metrics check took {:.1?}", t0.elapsed());
    if result.is_ok() {
        let _ = std::fs::remove_dir_all(&dir);
    } else {
        eprintln!("xtask: kept {} (agent log)", dir.display());
    }
    result
}

fn scrape_and_check(ns: &sys::NsHandle, dir: &std::path::Path) -> Result<()> {
    let extra = "\n[[webhook]]\nurl = \"http://127.0.0.1:9/hook\"\n";
    let daemon = Daemon::start(ns, dir, "promtool", "1s", extra)?;
    let (content_type, body) = get_text_format(ns)?;
    drop(daemon);
    if !content_type.starts_with("text/plain; version=0.0.4") {
        bail!("/metrics with Accept: text/plain answered {content_type:?}");
    }
    if let Err(said) = check_metrics(&body)? {
        bail!("promtool check metrics on a live scrape:\n{said}\n--- scrape:\n{body}");
    }
    eprintln!(
        "xtask: promtool check metrics: a live scrape ({} series) is clean",
        body.lines().filter(|l| !l.starts_with('#')).count()
    );
    Ok(())
}

/// `promtool check metrics` on `body`: Ok(Err(what it said)) when it found anything to say
/// (an error or a lint), Err when it could not run.
pub fn check_metrics(body: &str) -> Result<std::result::Result<(), String>> {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("start promtool check metrics")?;
    child
        .stdin
        .take()
        .context("promtool stdin")?
        .write_all(body.as_bytes())?;
    let out = child.wait_with_output()?;
    let said =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    if !out.status.success() || !said.trim().is_empty() {
        return Ok(Err(format!("({}) {said}", out.status)));
    }
    Ok(Ok(()))
}

/// GET /metrics asking for the Prometheus text format: (Content-Type, body).
fn get_text_format(ns: &sys::NsHandle) -> Result<(String, String)> {
    let addr: SocketAddr = connreap_bench::agent::LISTEN.parse()?;
    ns.run(move || {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(
            s,
            "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nAccept: text/plain; version=0.0.4\r\nConnection: close\r\n\r\n"
        )?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw)?;
        let raw = String::from_utf8(raw).context("/metrics is not UTF-8")?;
        let (head, body) = raw.split_once("\r\n\r\n").context("bad HTTP response")?;
        if !head.starts_with("HTTP/1.1 200") {
            bail!("GET /metrics: {}", head.lines().next().unwrap_or_default());
        }
        if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
            bail!("GET /metrics: chunked answer (not expected from the agent)");
        }
        let content_type = head
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-type").then(|| v.trim().to_string())
            })
            .unwrap_or_default();
        Ok((content_type, body.to_string()))
    })
}
