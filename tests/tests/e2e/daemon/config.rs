//! Invalid configuration: `check-config` and `run` refuse it with exit code 78 (EX_CONFIG),
//! naming the file, the line and the key.

use std::path::Path;

use connreap_tests::{
    fixtures::http_get_in_netns,
    harness::{addr, require_privileges, run, Config, NetNs, TempDir, API, CONNREAP_TIMEOUT, HTTP},
};

/// (file text, line, key) of each invalid file.
const CASES: [(&str, usize, &str); 4] = [
    (
        "[agent]\nscan_interval = \"1s\"\n\n[detect]\nclose_wait_threshhold = 3\n",
        5,
        "close_wait_threshhold",
    ),
    (
        "[agent]\nlisten = \"127.0.0.1:9477\"\nscan_interval = \"soon\"\n",
        3,
        "scan_interval",
    ),
    (
        "[agent]\nscan_interval = \"1s\"\n\n[detect]\nclose_wait_threshold = 4\nquota_saturation = 1.5\n",
        6,
        "quota_saturation",
    ),
    (
        "[agent]\nscan_interval = \"1s\"\n\n[[webhook]]\nurl = \"http://127.0.0.1:9999/a\"\n\n[[webhook]]\nformat = \"json\"\nurl = \"ftp://example\"\n",
        9,
        "url",
    ),
];

#[test]
fn invalid_config_exits_78_naming_file_line_and_key() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("badcfg");
    let dir = TempDir::new("badcfg");
    for (i, (text, line, key)) in CASES.into_iter().enumerate() {
        let path = dir.write(&format!("bad-{i}.toml"), text);
        let path = path.display().to_string();
        let out = run(&mut ns.connreap(["check-config", &path]), CONNREAP_TIMEOUT);
        let ctx = format!("connreap check-config on\n{text}\n-> {out:?}");
        assert_eq!(out.status.code(), Some(78), "{ctx}");
        assert!(!out.stderr.contains("panicked"), "{ctx}");
        assert!(out.stderr.contains(&path), "must name the file: {ctx}");
        assert!(
            out.stderr.contains(&format!("{path}:{line}:")),
            "must name line {line} as {path}:{line}: {ctx}"
        );
        assert!(out.stderr.contains(key), "must name the key `{key}`: {ctx}");

        // `run` refuses to start with it, with the same message and exit code.
        let out = run(
            &mut ns.connreap(["run", "--config", &path]),
            CONNREAP_TIMEOUT,
        );
        let ctx = format!("connreap run --config on\n{text}\n-> {out:?}");
        assert_eq!(out.status.code(), Some(78), "{ctx}");
        assert!(out.stderr.contains(&format!("{path}:{line}:")), "{ctx}");
        assert!(out.stderr.contains(key), "{ctx}");
    }
    assert!(
        http_get_in_netns(ns.name(), addr(API), "/healthz", HTTP).is_err(),
        "nothing may listen after a refused start"
    );

    // A good file passes; the example with every default passes.
    let good = Config::alerting(&dir).detect("close_wait_threshold = 4");
    let good = dir.write("good.toml", &good.to_string());
    let good = good.display().to_string();
    let out = run(&mut ns.connreap(["check-config", &good]), CONNREAP_TIMEOUT);
    assert!(out.status.success(), "{out:?}");
    assert!(
        out.stdout.contains(&good) && out.stdout.contains("1 webhooks"),
        "{out:?}"
    );
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../connreap.example.toml");
    let out = run(
        &mut ns.connreap([Path::new("check-config"), example.as_path()]),
        CONNREAP_TIMEOUT,
    );
    assert!(out.status.success(), "{out:?}");
}
