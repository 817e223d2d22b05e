//! Policy configuration errors.

use std::process::Command;

use connreap_tests::harness::{connreap_bin, run, Config, TempDir, CONNREAP_TIMEOUT};

#[test]
fn a_policy_selecting_nothing_specific_is_a_config_error() {
    let dir = TempDir::new("cfg");
    let policy = r#"[[policy]]
name = "everything-established"
mode = "enforce"
trigger = "always"
select = { states = ["ESTABLISHED"] }
"#;
    let broad = Config::reclaiming(&dir).policy(policy);
    let path = dir.write("broad.toml", &broad.to_string());
    let out = run(
        Command::new(connreap_bin()).arg("check-config").arg(&path),
        CONNREAP_TIMEOUT,
    );
    assert_eq!(out.status.code(), Some(78), "{out:?}");
    assert!(
        out.stderr.contains("everything-established") && out.stderr.contains("select"),
        "must name the policy and the key: {out:?}"
    );
    assert!(!broad.audit().exists());

    // The same file with a selector is fine.
    let narrow = Config::reclaiming(&dir)
        .policy(&policy.replace("{ states", "{ comm = \"leaky-proxy\", states"));
    let path = dir.write("ok.toml", &narrow.to_string());
    let out = run(
        Command::new(connreap_bin()).arg("check-config").arg(&path),
        CONNREAP_TIMEOUT,
    );
    assert!(out.status.success(), "{out:?}");
}
