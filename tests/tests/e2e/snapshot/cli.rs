//! The command line around the snapshot: bad filters (exit 2) and a reader that stops early.

use connreap_tests::harness::{peer, require_privileges, run, NetNs, CONNREAP_TIMEOUT};

#[test]
fn bad_filters_fail_with_one_line_errors() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("bad");
    for (args, names) in [
        (&["--port", "http"][..], "invalid port `http`"),
        (&["--port", "80,70000"][..], "invalid port `70000`"),
        (&["--state", "BOGUS"][..], "BOGUS"),
        (&["--pid", "self"][..], "invalid pid `self`"),
        (&["--idle-min", "soon"][..], "invalid idle-min `soon`"),
        (&["--dport", "9-1"][..], "invalid dport `9-1`"),
        (&["--sport", "0"][..], "invalid sport `0`"),
        (&["--state", "connectd"][..], "connectd"),
    ] {
        let mut cmd = ns.connreap(["snapshot", "--json"]);
        cmd.args(args);
        let out = run(&mut cmd, CONNREAP_TIMEOUT);
        let ctx = format!("connreap snapshot --json {}: {out:?}", args.join(" "));
        assert_eq!(
            out.status.code(),
            Some(2),
            "bad input exits 2 (1 is for runtime failures): {ctx}"
        );
        assert!(!out.stderr.contains("panicked"), "{ctx}");
        assert_eq!(out.stderr.trim().lines().count(), 1, "one line: {ctx}");
        assert!(out.stderr.starts_with("connreap: "), "{ctx}");
        assert!(out.stderr.contains(names), "must name the cause: {ctx}");
        assert!(out.stdout.is_empty(), "no JSON on failure: {ctx}");
    }
}

/// `connreap snapshot | head`: a reader that stops early ends the snapshot quietly, with
/// success, in both output formats (no panic, no error message; logs may remain).
#[test]
fn a_reader_that_stops_early_is_no_error() {
    use std::{io::Read as _, process::Stdio};
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("pipe");
    let (_server, _) = peer(&ns, &["listen", "--addr", "127.0.0.1:7700"]);
    // 2000 sockets: either format is well over a pipe's 64 KiB buffer.
    let (_client, _) = peer(
        &ns,
        &["connect", "--addr", "127.0.0.1:7700", "--count", "1000"],
    );
    for args in [&["snapshot"][..], &["snapshot", "--json"]] {
        let mut child = ns
            .connreap(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start connreap");
        let mut stdout = child.stdout.take().expect("piped stdout");
        let mut head = [0u8; 16];
        stdout.read_exact(&mut head).expect("the first bytes");
        drop(stdout);
        let out = child.wait_with_output().expect("wait for connreap");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && !stderr.contains("panicked") && !stderr.contains("connreap: "),
            "`connreap {}` | head: {}\n{stderr}",
            args.join(" "),
            out.status
        );
    }
}

/// A full disk under the output (`connreap snapshot > /dev/full`): a failed exit and one line
/// naming where the write went, in both output formats.
#[test]
fn a_full_output_device_is_a_named_error() {
    use std::process::Stdio;
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("full");
    let (_server, _) = peer(&ns, &["listen", "--addr", "127.0.0.1:7701"]);
    for args in [&["snapshot"][..], &["snapshot", "--json"]] {
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .expect("open /dev/full");
        let out = ns
            .connreap(args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(full))
            .stderr(Stdio::piped())
            .output()
            .expect("run connreap");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let ctx = format!(
            "connreap {} > /dev/full: {}\n{stderr}",
            args.join(" "),
            out.status
        );
        assert!(
            out.status.code().is_some_and(|c| c != 0),
            "must exit non-zero: {ctx}"
        );
        assert!(!stderr.contains("panicked"), "{ctx}");
        let last = stderr.trim().lines().last().unwrap_or_default();
        assert!(
            last.starts_with("connreap: writing the snapshot to standard output: ")
                && last.contains("No space left on device"),
            "must name the output and the cause: {ctx}"
        );
    }
}
