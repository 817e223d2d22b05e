//! Unit tests of config parsing, defaults and errors.
use super::*;

const EXAMPLE: &str = include_str!("../../../connreap.example.toml");

#[test]
fn example_config_equals_defaults() {
    let parsed = parse(EXAMPLE, "connreap.example.toml").expect("example parses");
    assert_eq!(parsed, Config::default());
}

#[test]
fn example_config_mentions_every_default_key() {
    let defaults = toml::to_string(&Config::default()).unwrap();
    for line in defaults.lines() {
        if let Some((key, value)) = line.split_once(" = ") {
            if value == "[]" {
                continue; // quota/webhook/policy lists: shown commented out
            }
            assert!(
                EXAMPLE.contains(&format!("{key} = ")),
                "connreap.example.toml lacks `{key}`; regenerate it from Config::default()"
            );
        }
    }
}

#[test]
fn issue_contract_keys_parse() {
    let text = r#"
[agent]
listen = "127.0.0.1:9477"
scan_interval = "5s"
[detect]
close_wait_min_age = "30s"
close_wait_threshold = 16
stuck_pair_min_idle = "5m"
stuck_pair_threshold = 16
quota_saturation = 0.9
[[quota]]
name = "relay"
url = "http://127.0.0.1:20080/status"
items = "/endpoints"
port_field = "port"
used_field = "streams"
limit_field = "maxStreams"
poll_interval = "5s"
[[quota]]
name = "gateway-pool"
process = "java"
peer = "10.0.16.36:80"
limit = 1000
[[webhook]]
url = "http://127.0.0.1:9999/alerts"
format = "json"
"#;
    let c = parse(text, "t.toml").unwrap();
    assert_eq!(c.quota.len(), 2);
    assert_eq!(c.detect.stuck_pair_min_idle, Duration::from_secs(300));
    assert_eq!(c.webhook[0].format, WebhookFormat::Json);
}

#[test]
fn errors_name_file_line_and_key() {
    let e = parse("[detect]\nclose_wait_threshhold = 3\n", "/etc/x.toml").unwrap_err();
    let msg = e.to_string();
    assert!(msg.starts_with("/etc/x.toml:2:"), "{msg}");
    assert!(msg.contains("close_wait_threshhold"), "{msg}");

    let e = parse("[agent]\nscan_interval = \"soon\"\n", "c.toml")
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("c.toml:2:"), "{e}");

    let e = parse("[detect]\nquota_saturation = 1.5\n", "c.toml")
        .unwrap_err()
        .to_string();
    assert!(e.contains("detect.quota_saturation"), "{e}");

    let e = parse("[[quota]]\nname = \"r\"\nurl = \"http://x/s\"\n", "c.toml")
        .unwrap_err()
        .to_string();
    assert!(e.contains("quota[0] (r)"), "{e}");
}

#[test]
fn every_error_names_line_and_key() {
    let e = parse("[agent]\nscan_interval = \"soon\"\n", "c.toml")
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("c.toml:2:17: `agent.scan_interval`: invalid value"),
        "{e}"
    );
    let e = parse(
        "[agent]\nscan_interval = \"1s\"\n\n[detect]\nclose_wait_threshold = 4\nquota_saturation = 1.5\n",
        "c.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.starts_with("c.toml:6: `detect.quota_saturation`: must be in (0, 1]"),
        "{e}"
    );
    let text =
        "[[webhook]]\nurl = \"http://a/\"\n[[webhook]]\nformat = \"json\"\nurl = \"ftp://x\"\n";
    let e = parse(text, "c.toml").unwrap_err().to_string();
    assert!(e.starts_with("c.toml:5: `webhook[1].url`"), "{e}");
    let text = "[[quota]]\nname = \"a\"\nurl = \"http://x/s\"\nport_field = \"p\"\nused_field = \"u\"\nlimit = 1\n[[quota]]\nname = \"r\"\nurl = \"http://x/s\"\n";
    let e = parse(text, "c.toml").unwrap_err().to_string();
    assert!(e.starts_with("c.toml:7: `quota[1] (r).port_field`"), "{e}");
    let e = parse("[[quota]]\nname = \"q\"\nurl = \"http://x/s\"\nport_field = \"p\"\nused_field = \"u\"\nlimit = 1\nport_map = { \"x\" = 1 }\n", "c.toml")
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("c.toml:7: `quota[0] (q).port_map`"), "{e}");
    let e = parse(
        "# ≥ ünïcödé\r\n[detect]\r\n# ≥\r\nstorm_rate = -1.0\r\n",
        "c.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(e.starts_with("c.toml:4: `detect.storm_rate`"), "{e}");
}

#[test]
fn destroy_mechanism_is_one_of_three() {
    let c = parse("[reclaim]\nmechanism = \"bpf-iter\"\n", "c.toml").unwrap();
    assert_eq!(c.reclaim.mechanism, DestroyMechanism::BpfIter);
    let c = parse("[reclaim]\nmechanism = \"netlink\"\n", "c.toml").unwrap();
    assert_eq!(c.reclaim.mechanism, DestroyMechanism::Netlink);
    let e = parse("[reclaim]\nmechanism = \"ebpf\"\n", "c.toml")
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("c.toml:2:"), "{e}");
    assert!(
        e.contains("reclaim.mechanism") && e.contains("bpf-iter"),
        "{e}"
    );
}

#[test]
fn parse_errors_name_nested_keys_and_entries() {
    let e = parse(
        "[[policy]]\nname = \"p\"\ntrigger = \"always\"\nselect = { comm = \"x\", states = [\"BOGUS\"] }\n",
        "c.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.starts_with("c.toml:4:33: `policy[0].select.states`: unknown TCP state `BOGUS`"),
        "{e}"
    );
    let e = parse("[[policy]]\nname = \"p\"\nselect.comm = \"x\"\n", "c.toml")
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("c.toml:1:1: `policy[0]`: missing field `trigger`"),
        "{e}"
    );
    // Dotted keys have positions too.
    let e = parse(
        "[[policy]]\nname = \"p\"\ntrigger = \"always\"\nselect.comm = \"x\"\nselect.states = [\"LISTEN\"]\n",
        "c.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.starts_with("c.toml:5: `policy[0] (p).select.states`: LISTEN"),
        "{e}"
    );
}

#[test]
fn text_that_is_not_toml_quotes_its_line() {
    let e = parse("[agent]\nscan_interval = 5s\n", "c.toml")
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("c.toml:2:18: `scan_interval = 5s`: "), "{e}");
}

#[test]
fn unreadable_files_keep_the_cause() {
    let e = load(Path::new("/nonexistent/connreap.toml")).unwrap_err();
    assert_eq!(
        format!("{:#}", anyhow::Error::new(e)),
        "/nonexistent/connreap.toml: cannot read: No such file or directory (os error 2)"
    );
}
