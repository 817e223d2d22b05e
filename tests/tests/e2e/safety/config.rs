//! Configurations that used to pass `check-config` and then break the daemon (overflowing
//! durations, zero periods, NaN rates, unusable token files) are refused by `check-config`
//! and `run` alike with exit 78 naming file:line:key; what stays allowed but risky is warned
//! about; a selector never reaches sockets nobody owns unless it says so; what an error echoes
//! of the file is escaped and capped.

use std::{
    net::{TcpListener, TcpStream},
    os::unix::fs::PermissionsExt as _,
    path::Path,
    time::Duration,
};

use connreap_tests::{
    fixtures::{get_json_in_netns, http::connect, run_in_netns, ss_tcp},
    harness::{
        addr,
        audit::{result_is, text},
        require_privileges, run, wait_until, Agent, Child, Config, NetNs, TempDir, AGENT_START,
        API, CONNREAP_TIMEOUT, HTTP, POLL, SCAN,
    },
};
use serde_json::Value;

/// An HTTP quota source, seven lines: a key added after it is on line 8.
const QUOTA: &str = "[[quota]]\nname = \"relay\"\nurl = \"http://127.0.0.1:20080/status\"\n\
                     items = \"/endpoints\"\nport_field = \"port\"\nused_field = \"streams\"\n\
                     limit_field = \"maxStreams\"\n";

/// (file text, line, key) of each file that must be refused.
fn absurd_files() -> Vec<(String, usize, &'static str)> {
    let policy = |select: &str| {
        format!("[[policy]]\nname = \"p\"\nmode = \"enforce\"\ntrigger = \"always\"\nselect = {{ {select} }}\n")
    };
    vec![
        (
            "[detect]\nclose_wait_min_age = \"100000000000y\"\n".into(),
            2,
            "detect.close_wait_min_age",
        ),
        (
            "[alerts]\nrepeat_interval = \"100000000000y\"\n".into(),
            2,
            "alerts.repeat_interval",
        ),
        (
            "[agent]\nscan_interval = \"100000000000y\"\n".into(),
            2,
            "agent.scan_interval",
        ),
        (
            format!("{QUOTA}poll_interval = \"0s\"\n"),
            8,
            "quota[0] (relay).poll_interval",
        ),
        (
            format!("{QUOTA}timeout = \"0s\"\n"),
            8,
            "quota[0] (relay).timeout",
        ),
        (
            format!("{QUOTA}max_body = \"1GiB\"\n"),
            8,
            "quota[0] (relay).max_body",
        ),
        (
            "[[webhook]]\nurl = \"http://127.0.0.1:9999/alerts\"\ntimeout = \"0s\"\n".into(),
            3,
            "webhook[0].timeout",
        ),
        (
            "[[webhook]]\nurl = \"http://127.0.0.1:9999/alerts\"\nmax_backoff = \"0s\"\n".into(),
            3,
            "webhook[0].max_backoff",
        ),
        // The old location is still checked.
        ("[alerts]\ntimeout = \"0s\"\n".into(), 2, "alerts.timeout"),
        (
            "[detect]\nstorm_rate = nan\n".into(),
            2,
            "detect.storm_rate",
        ),
        (
            "[detect]\nstorm_rate = inf\n".into(),
            2,
            "detect.storm_rate",
        ),
        (
            "[detect]\nstorm_rate = -1.0\n".into(),
            2,
            "detect.storm_rate",
        ),
        (
            "[detect]\nquota_saturation = 0.0\n".into(),
            2,
            "detect.quota_saturation",
        ),
        (
            "[detect]\nquota_saturation = nan\n".into(),
            2,
            "detect.quota_saturation",
        ),
        (
            policy("comm = \"?\", unowned = true"),
            5,
            "policy[0] (p).select.unowned",
        ),
    ]
}

/// `check-config FILE` and `run --config FILE` both exit 78 naming `FILE:LINE:` and `key`.
fn assert_refused(ns: &NetNs, path: &Path, line: usize, key: &str, what: &str) {
    let path = path.display().to_string();
    for args in [vec!["check-config", &path], vec!["run", "--config", &path]] {
        let out = run(&mut ns.connreap(&args), CONNREAP_TIMEOUT);
        let ctx = format!("connreap {} on {what}\n-> {out:?}", args.join(" "));
        assert_eq!(out.status.code(), Some(78), "{ctx}");
        assert!(!out.stderr.contains("panicked"), "{ctx}");
        assert!(
            out.stderr.contains(&format!("{path}:{line}: `{key}`")),
            "must name {path}:{line}: `{key}`: {ctx}"
        );
    }
}

#[test]
fn absurd_values_exit_78_from_check_config_and_run() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("absurd");
    let dir = TempDir::new("absurd");
    for (i, (text, line, key)) in absurd_files().into_iter().enumerate() {
        let path = dir.write(&format!("absurd-{i}.toml"), &text);
        assert_refused(&ns, &path, line, key, &text);
    }
    // Each message says what the range is.
    let path = dir.write("backoff.toml", "[alerts]\nmax_backoff = \"0s\"\n");
    let out = run(
        &mut ns.connreap([Path::new("check-config"), path.as_path()]),
        CONNREAP_TIMEOUT,
    );
    assert!(
        out.stderr.contains("must be from 1s to 1day (got 0s)"),
        "{out:?}"
    );
    assert!(
        get_json_in_netns(ns.name(), addr(API), "/healthz", HTTP).is_err(),
        "nothing may listen after a refused start"
    );
}

/// Config files whose errors would echo what a terminal must not get: an ESC byte in a value
/// (raw, and as the TOML escape `\u001b`, which makes it a real ESC in the value), a 100k-deep
/// nested array (a 200 KB line), a 50 KB name. `check-config` and `run` exit 78 with a short
/// stderr, every control character escaped.
#[test]
fn config_errors_escape_and_cap_what_they_echo() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("cfgecho");
    let dir = TempDir::new("cfgecho");
    let files = [
        (
            "raw-esc",
            "[agent]\nlog_format = \"te\u{1b}]0;owned\u{7}st\"\n".to_string(),
            "te\\u{1b}]0;owned",
        ),
        (
            "toml-esc",
            "[agent]\nlog_format = \"\\u001b[31mred\"\n".to_string(),
            "\\u{1b}[31mred",
        ),
        (
            "deep",
            format!(
                "[agent]\nx = {}{}\n",
                "[".repeat(100_000),
                "]".repeat(100_000)
            ),
            "more bytes",
        ),
        (
            "long-name",
            format!(
                "[[policy]]\nname = \"{}\"\ntrigger = \"always\"\nselect = {{}}\n",
                "n".repeat(50_000)
            ),
            "more bytes",
        ),
    ];
    for (name, text, expect) in files {
        let path = dir.write(&format!("{name}.toml"), &text);
        let path = path.display().to_string();
        for args in [vec!["check-config", &path], vec!["run", "--config", &path]] {
            let out = run(&mut ns.connreap(&args), CONNREAP_TIMEOUT);
            let ctx = format!("connreap {} ({name})", args.join(" "));
            assert_eq!(out.status.code(), Some(78), "{ctx}: {out:?}");
            let err = &out.stderr;
            assert!(err.len() < 1000, "{ctx}: {} bytes of stderr", err.len());
            assert!(
                !err.chars().any(|c| c.is_control() && c != '\n'),
                "{ctx}: a control character reached stderr: {err:?}"
            );
            assert!(err.contains(&path) && err.contains(expect), "{ctx}: {err}");
        }
    }
}

/// The line of the first line of `text` containing `needle`.
fn line_of(text: &str, needle: &str) -> usize {
    text.lines()
        .position(|l| l.contains(needle))
        .map(|i| i + 1)
        .unwrap_or_else(|| panic!("no {needle:?} in\n{text}"))
}

#[test]
fn unusable_token_files_exit_78_and_an_exposed_api_is_warned_about() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("token");
    let dir = TempDir::new("token");
    let token = "0123456789abcdef-token";
    let missing = dir.path("missing-token");
    let short = dir.write("short-token", "0123456789\n");
    let open = dir.write("open-token", &format!("{token}\n"));
    for (file, says) in [
        (&missing, "No such file"),
        (&short, "10 characters"),
        (&open, "group or others (mode 644)"),
    ] {
        let text = Config::new(&dir).token_file(file).to_string();
        // The harness makes token files private; this one must stay readable by others.
        if file == &open {
            std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o644)).unwrap();
        }
        let path = dir.write("connreap.toml", &text);
        assert_refused(
            &ns,
            &path,
            line_of(&text, "token_file"),
            "api.token_file",
            says,
        );
        let out = run(
            &mut ns.connreap([Path::new("check-config"), path.as_path()]),
            CONNREAP_TIMEOUT,
        );
        assert!(
            out.stderr.contains(&file.display().to_string()) && out.stderr.contains(says),
            "{out:?}"
        );
    }

    // A good token, but the API on every address: allowed, with a warning from both.
    let good = dir.write("good-token", &format!("{token}\n"));
    let text = Config::new(&dir)
        .token_file(&good)
        .to_string()
        .replace(&format!("listen = \"{API}\""), "listen = \"0.0.0.0:9477\"");
    let path = dir.write("exposed.toml", &text);
    let out = run(
        &mut ns.connreap([Path::new("check-config"), path.as_path()]),
        CONNREAP_TIMEOUT,
    );
    assert!(out.status.success(), "{out:?}");
    assert!(
        out.stderr.contains("warning") && out.stderr.contains("0.0.0.0:9477"),
        "{out:?}"
    );
    let mut agent = start_raw(&ns, &path);
    let warned = wait_until(AGENT_START, POLL, || {
        let err = agent.stderr();
        err.lines()
            .find(|l| l.contains("WARN") && l.contains("not a loopback address"))
            .map(str::to_string)
    });
    let _ = agent.try_wait();
    assert!(
        warned.is_some_and(|l| l.contains("POST /v1/reclaim")),
        "no WARN line about the exposed API:\n{}",
        agent.stderr()
    );
}

/// `connreap run --config PATH` in `ns`, once /healthz answers 200.
fn start_raw(ns: &NetNs, path: &Path) -> Child {
    let mut cmd = ns.connreap([Path::new("run"), Path::new("--config"), path]);
    let mut child = Child::spawn(&mut cmd, "connreap run");
    let up = wait_until(AGENT_START, POLL, || {
        if let Some(status) = child.try_wait() {
            panic!("connreap run exited ({status}):\n{}", child.stderr());
        }
        get_json_in_netns(ns.name(), addr(API), "/healthz", HTTP)
            .ok()
            .filter(|(code, _)| *code == 200)
    });
    assert!(up.is_some(), "never healthy:\n{}", child.stderr());
    child
}

/// Retries to a receiver that is down are paced by the backoff: with the smallest
/// `max_backoff` allowed (1s), a few WARN lines in 3 s, not thousands.
#[test]
fn retries_to_a_down_receiver_are_paced() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("backoff");
    let dir = TempDir::new("backoff");
    // A quota source nobody serves: quota_source_unavailable fires at once, and its webhook
    // goes to a receiver nobody serves either.
    let text = format!(
        "[agent]\nlisten = \"{API}\"\nscan_interval = \"1s\"\n\n\
         [reclaim]\naudit_log = \"{}\"\n\n[[webhook]]\nurl = \"http://127.0.0.1:9999/alerts\"\n\
         max_backoff = \"1s\"\ntimeout = \"1s\"\n\n{QUOTA}poll_interval = \"1s\"\n",
        dir.path("audit.jsonl").display()
    );
    let path = dir.write("connreap.toml", &text);
    let agent = start_raw(&ns, &path);
    let failures = || agent.stderr().matches("webhook delivery failed").count();
    wait_until(Duration::from_secs(20), POLL, || {
        (failures() > 0).then_some(())
    })
    .unwrap_or_else(|| panic!("no delivery was tried:\n{}", agent.stderr()));
    let before = failures();
    std::thread::sleep(Duration::from_secs(3));
    let during = failures() - before;
    assert!(
        during <= 5,
        "{during} failed deliveries in 3 s with max_backoff 1s:\n{}",
        agent.stderr()
    );
}

/// Connections in a listener's accept queue have no owner (connreap shows comm `?`). An
/// enforce policy with `comm = "?"`, even with the port, kills none of them; only
/// `unowned = true` with a port selects them (here in dry-run).
#[test]
fn sockets_nobody_owns_are_never_killed_by_comm_question_mark() {
    const N: usize = 4;
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("unowned");
    let dir = TempDir::new("unowned");
    // A listener that never accepts: its connections wait in the accept queue.
    let _listener =
        run_in_netns(ns.name(), || TcpListener::bind("127.0.0.1:7500")).expect("bind 7500");
    let clients: Vec<TcpStream> = (0..N)
        .map(|_| connect(Some(ns.name()), addr("127.0.0.1:7500"), HTTP).expect("connect"))
        .collect();
    let policy = |name: &str, mode: &str, select: &str| {
        format!("[[policy]]\nname = \"{name}\"\nmode = \"{mode}\"\ntrigger = \"always\"\nselect = {{ {select} }}\nmax_per_round = 8\n")
    };
    let config = Config::new(&dir)
        .policy(&policy("anything-unowned", "enforce", "comm = \"?\""))
        .policy(&policy(
            "unowned-on-port",
            "enforce",
            "comm = \"?\", local_port = 7500",
        ))
        .policy(&policy(
            "explicit",
            "dry-run",
            "local_port = 7500, unowned = true",
        ));
    let agent = Agent::start(&ns, &dir, &config);

    // connreap sees them, without an owner.
    let queued = wait_until(SCAN * 10, POLL, || {
        let body = agent.get_ok("/v1/sockets");
        let rows: Vec<Value> = body["sockets"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|s| s["local"] == "127.0.0.1:7500" && s["state"] == "ESTABLISHED")
            .cloned()
            .collect();
        (rows.len() == N).then_some(rows)
    })
    .unwrap_or_else(|| panic!("the queued connections never showed:\n{}", agent.ctx()));
    for s in &queued {
        assert!(s["pid"].is_null(), "a queued connection with an owner: {s}");
    }
    // The explicit policy selects exactly them: the rounds ran and saw them.
    let lines = wait_until(SCAN * 15, POLL, || {
        let lines = agent.audit();
        (result_is(&lines, "would-kill").len() >= N).then_some(lines)
    })
    .unwrap_or_else(|| panic!("unowned = true never selected them:\n{}", agent.ctx()));
    agent.wait_scans(3);
    let lines = [lines, agent.audit()].concat();
    for d in &lines {
        assert_eq!(text(d, "policy"), "explicit", "{d}\n{}", agent.ctx());
        assert_eq!(text(d, "local"), "127.0.0.1:7500", "{d}");
        assert_ne!(text(d, "result"), "killed", "{d}");
        assert_ne!(text(d, "result"), "kill-intent", "{d}");
    }
    // Nothing was closed: both ends of every connection are still there.
    let ss = ss_tcp(Some(ns.name())).unwrap();
    for c in &clients {
        let local = c.local_addr().unwrap();
        for (l, p) in [
            (local, addr("127.0.0.1:7500")),
            (addr("127.0.0.1:7500"), local),
        ] {
            assert!(
                ss.iter()
                    .any(|x| x.is_established() && x.local == l && x.peer == p),
                "{l} -> {p} gone: {ss:#?}\n{}",
                agent.ctx()
            );
        }
    }
    assert!(
        agent.stderr().contains(
            "policy anything-unowned: select.comm = \"?\" matches no socket without an owner"
        ),
        "no warning about comm = \"?\":\n{}",
        agent.stderr()
    );
}
