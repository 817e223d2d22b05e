//! Unit tests of config parsing, defaults and errors.
use super::*;
use std::time::Duration;

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

/// Writes `path` (from the repository root) when UPDATE_EXPECT is set, else fails unless it
/// holds `want`.
fn expect_file(path: &str, want: &str) {
    let full = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path);
    if std::env::var_os("UPDATE_EXPECT").is_some() {
        std::fs::write(&full, want).unwrap();
        return;
    }
    let got = std::fs::read_to_string(&full).unwrap_or_default();
    if got != want {
        let first = got
            .lines()
            .zip(want.lines())
            .position(|(g, w)| g != w)
            .unwrap_or(got.lines().count().min(want.lines().count()));
        panic!(
            "{path} is not what the key declarations in agent/src/config generate (first \
             difference at line {}). Regenerate it with\n  \
             UPDATE_EXPECT=1 cargo test -p connreap config\nthen `UPDATE_EXPECT=1 cargo test -p \
             xtask configmap` for deploy/kubernetes/configmap.yaml.",
            first + 1
        );
    }
}

/// The example file and the docs' key table come from the declarations.
#[test]
fn generated_files_are_current() {
    expect_file("connreap.example.toml", &render::example());
    expect_file("docs/config.md", &render::docs());
}

/// Every number, duration and size a configuration can hold has a range (checked against a
/// configuration that sets every key).
#[test]
fn every_number_and_duration_has_a_range() {
    let text = r#"
[[quota]]
name = "relay"
url = "http://127.0.0.1:20080/status"
items = "/endpoints"
port_field = "port"
used_field = "streams"
limit_field = "maxStreams"
poll_interval = "5s"
timeout = "2s"
max_body = "1MiB"
limit = 64
[[policy]]
name = "p"
mode = "enforce"
trigger = "always"
select = { comm = "node", peer_port = 25001 }
min_idle = "10s"
min_age = "10s"
max_per_round = 8
[[webhook]]
url = "http://127.0.0.1:9999/alerts"
timeout = "5s"
queue_capacity = 1024
max_backoff = "1m"
"#;
    let cfg = parse(text, "t").unwrap();
    let doc: toml::Table = toml::from_str(&toml::to_string(&cfg).unwrap()).unwrap();
    let ranged: Vec<String> = render::all_keys()
        .into_iter()
        .filter(|k| k.range.is_some() && k.moved_to.is_none())
        .map(|k| k.path())
        .collect();
    let mut seen = 0;
    for (table, v) in &doc {
        let entries: Vec<&toml::Table> = match v {
            toml::Value::Table(t) => vec![t],
            toml::Value::Array(a) => a.iter().filter_map(toml::Value::as_table).collect(),
            _ => continue,
        };
        for (key, value) in entries.into_iter().flatten() {
            let numeric = match value {
                toml::Value::Integer(_) | toml::Value::Float(_) => true,
                toml::Value::String(s) => {
                    humantime::parse_duration(s).is_ok() || s.parse::<ByteSize>().is_ok()
                }
                _ => false,
            };
            let path = format!("{table}.{key}");
            if numeric {
                seen += 1;
                assert!(ranged.contains(&path), "`{path}` has no range");
            }
        }
    }
    assert_eq!(seen, ranged.len(), "a range for a key that does not exist");
}

/// Parse `text`, which must be invalid; the message.
fn refused(text: &str) -> String {
    parse(text, "c.toml").unwrap_err().to_string()
}

#[test]
fn values_that_would_break_the_daemon_are_refused_naming_line_and_key() {
    let quota = "[[quota]]\nname = \"q\"\nurl = \"http://x/s\"\nport_field = \"p\"\nused_field = \"u\"\nlimit = 1\n";
    let cases: &[(String, &str)] = &[
        (
            "[detect]\nclose_wait_min_age = \"100000000000y\"\n".into(),
            "c.toml:2: `detect.close_wait_min_age`: must be from 0s to 7days (got 100000000000years",
        ),
        (
            "[alerts]\nrepeat_interval = \"100000000000y\"\n".into(),
            "c.toml:2: `alerts.repeat_interval`: must be from 1s to 30days",
        ),
        (
            "[agent]\nscan_interval = \"100000000000y\"\n".into(),
            "c.toml:2: `agent.scan_interval`: must be from 100ms to 1h",
        ),
        (
            "[agent]\nscan_interval = \"10ms\"\n".into(),
            "c.toml:2: `agent.scan_interval`: must be from 100ms to 1h (got 10ms)",
        ),
        (
            format!("{quota}poll_interval = \"0s\"\n"),
            "c.toml:7: `quota[0] (q).poll_interval`: must be from 100ms to 1h (got 0s)",
        ),
        (
            format!("{quota}timeout = \"0s\"\n"),
            "c.toml:7: `quota[0] (q).timeout`: must be from 100ms to 5m",
        ),
        (
            format!("{quota}max_body = \"1GiB\"\n"),
            "c.toml:7: `quota[0] (q).max_body`: must be from 1KiB to 64MiB (got 1GiB)",
        ),
        (
            "[alerts]\ntimeout = \"0s\"\n".into(),
            "c.toml:2: `alerts.timeout`: must be from 100ms to 5m",
        ),
        (
            "[alerts]\nmax_backoff = \"0s\"\n".into(),
            "c.toml:2: `alerts.max_backoff`: must be from 1s to 1day (got 0s)",
        ),
        (
            "[detect]\nstorm_rate = nan\n".into(),
            "c.toml:2: `detect.storm_rate`: must be from 0.001 to 1000000 (got NaN)",
        ),
        (
            "[detect]\nstorm_rate = inf\n".into(),
            "c.toml:2: `detect.storm_rate`: must be from 0.001 to 1000000 (got inf)",
        ),
        (
            "[detect]\nstorm_rate = -1.0\n".into(),
            "c.toml:2: `detect.storm_rate`",
        ),
        (
            "[detect]\nquota_saturation = nan\n".into(),
            "c.toml:2: `detect.quota_saturation`: must be in (0, 1]",
        ),
        (
            "[detect]\nquota_saturation = 0.0\n".into(),
            "c.toml:2: `detect.quota_saturation`: must be in (0, 1]",
        ),
        (
            "[detect]\nstorm_growth_windows = 1000\n".into(),
            "c.toml:2: `detect.storm_growth_windows`",
        ),
        (
            "[detect]\nclose_wait_threshold = 0\n".into(),
            "c.toml:2: `detect.close_wait_threshold`: must be from 1 to 1000000 (got 0)",
        ),
        (
            "[alerts]\nqueue_capacity = 0\n".into(),
            "c.toml:2: `alerts.queue_capacity`",
        ),
        (
            format!("{quota}limit = 0\n").replace("limit = 1\n", ""),
            "c.toml:6: `quota[0] (q).limit`: must be from 1 to 9007199254740992 (got 0)",
        ),
        (
            "[[policy]]\nname = \"p\"\ntrigger = \"always\"\nselect = { comm = \"x\" }\nmin_age = \"100000000000y\"\n".into(),
            "c.toml:5: `policy[0] (p).min_age`",
        ),
        (
            "[[policy]]\nname = \"p\"\ntrigger = \"always\"\nselect = { comm = \"x\" }\nmax_per_round = 0\n".into(),
            "c.toml:5: `policy[0] (p).max_per_round`",
        ),
    ];
    for (text, expected) in cases {
        let e = refused(text);
        assert!(
            e.starts_with(expected),
            "{text}\n-> {e}\nexpected {expected}"
        );
    }
    // The edges of a range are in it.
    parse(
        "[alerts]\nmax_backoff = \"1s\"\ntimeout = \"100ms\"\n",
        "c.toml",
    )
    .unwrap();
    parse(
        "[detect]\nstorm_growth_windows = 0\nclose_wait_min_age = \"0s\"\n",
        "c.toml",
    )
    .unwrap();
}

#[test]
fn unowned_needs_a_port() {
    let policy = |select: &str| {
        format!("[[policy]]\nname = \"p\"\ntrigger = \"always\"\nselect = {{ {select} }}\n")
    };
    let e = refused(&policy("comm = \"?\", unowned = true"));
    assert!(
        e.starts_with("c.toml:4: `policy[0] (p).select.unowned`: unowned = true needs local_port or peer_port"),
        "{e}"
    );
    let c = parse(
        &policy("comm = \"?\", local_port = 80, unowned = true"),
        "c.toml",
    )
    .unwrap();
    assert!(c.policy[0].select.unowned);
    let c = parse(&policy("comm = \"?\""), "c.toml").unwrap();
    assert!(!c.policy[0].select.unowned);
    assert_eq!(
        warnings(&c),
        vec!["policy p: select.comm = \"?\" matches no socket without an owner (that needs select.unowned = true and a port)"]
    );
}

#[test]
fn token_file_problems_are_config_errors() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = std::env::temp_dir().join(format!("connreap-cfgtoken-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, text: &str, mode: u32| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        p.display().to_string()
    };
    let cfg =
        |path: &str| format!("[agent]\nscan_interval = \"1s\"\n[api]\ntoken_file = \"{path}\"\n");
    for (path, says) in [
        (dir.join("missing").display().to_string(), "No such file"),
        (write("short", "too-short\n", 0o600), "9 characters"),
        (
            write("open", "0123456789abcdef\n", 0o644),
            "group or others (mode 644)",
        ),
    ] {
        let e = refused(&cfg(&path));
        assert!(e.starts_with("c.toml:4: `api.token_file`: "), "{e}");
        assert!(e.contains(&path) && e.contains(says), "{e}");
    }
    let good = write("good", "0123456789abcdef\n", 0o600);
    let c = parse(&cfg(&good), "c.toml").unwrap();
    assert!(warnings(&c).is_empty());
    let c = parse(
        &cfg(&good).replace("scan_interval", "listen = \"0.0.0.0:9477\"\nscan_interval"),
        "c.toml",
    )
    .unwrap();
    let w = warnings(&c);
    assert!(
        w.len() == 1 && w[0].contains("0.0.0.0:9477") && w[0].contains("POST /v1/reclaim"),
        "{w:?}"
    );
}

#[test]
fn quotas_and_policies_name_a_namespace_or_a_container() {
    let text = r#"
[[quota]]
name = "blue-relay"
url = "http://127.0.0.1:20080/status"
port_field = "port"
used_field = "streams"
limit = 64
netns = "blue"
[[quota]]
name = "pod-relay"
url = "http://127.0.0.1:20080/status"
port_field = "port"
used_field = "streams"
limit = 64
container = "ABCDEF12"
[[quota]]
name = "host-pool"
process = "java"
peer = "10.0.16.36:80"
limit = 4
netns = "host"
[[policy]]
name = "p"
trigger = "always"
select = { container = "0A1B2C3D", local_port = 20080 }
[[policy]]
name = "q"
trigger = "always"
select = { netns = "4026532000" }
"#;
    let c = parse(text, "t").unwrap();
    assert_eq!(c.quota[0].place(), Some(Place::Netns("blue")));
    assert_eq!(c.quota[1].place(), Some(Place::Container("abcdef12")));
    assert_eq!(c.quota[2].place(), Some(Place::Netns("host")));
    assert_eq!(c.policy[0].select.container.as_deref(), Some("0a1b2c3d"));
    assert_eq!(c.policy[1].select.netns.as_deref(), Some("4026532000"));
    assert_eq!(
        c.quota[1].place().unwrap().to_string(),
        "container abcdef12"
    );
    // Without either: the own namespace (quotas), every namespace (policies).
    let c = parse(
        "[[policy]]\nname = \"p\"\ntrigger = \"always\"\nselect = { comm = \"x\" }\n",
        "t",
    )
    .unwrap();
    assert_eq!(
        (&c.policy[0].select.netns, &c.policy[0].select.container),
        (&None, &None)
    );
    // What is serialized parses back to the same.
    let again = parse(&toml::to_string(&c).unwrap(), "t").unwrap();
    assert_eq!(again, c);
}

#[test]
fn namespace_and_container_errors_name_line_and_key() {
    let quota = "[[quota]]\nname = \"q\"\nurl = \"http://x/s\"\nport_field = \"p\"\nused_field = \"u\"\nlimit = 1\n";
    let policy = |select: &str| {
        format!("[[policy]]\nname = \"p\"\ntrigger = \"always\"\nselect = {{ {select} }}\n")
    };
    let cases: &[(String, &str)] = &[
        (
            format!("{quota}netns = \"blue\"\ncontainer = \"abcd\"\n"),
            "c.toml:8: `quota[0] (q).container`: set netns or container, not both",
        ),
        (
            format!("{quota}container = \"abc\"\n"),
            "c.toml:7: `quota[0] (q).container`: `abc` is not a container id prefix (4 to 64 hex digits)",
        ),
        (
            format!("{quota}container = \"wxyz1234\"\n"),
            "c.toml:7: `quota[0] (q).container`: `wxyz1234` is not a container id prefix",
        ),
        (
            format!("{quota}container = \"{}\"\n", "a".repeat(65)),
            "c.toml:7: `quota[0] (q).container`: ",
        ),
        (
            format!("{quota}netns = \"all\"\n"),
            "c.toml:7: `quota[0] (q).netns`: \"all\" is not one namespace: a quota's ports live in one namespace",
        ),
        (
            format!("{quota}netns = \"\"\n"),
            "c.toml:7: `quota[0] (q).netns`: must not be empty",
        ),
        (
            format!("{quota}netns = \"../etc\"\n"),
            "c.toml:7: `quota[0] (q).netns`: `../etc` is not a namespace name (as under /run/netns), an inode or \"host\"",
        ),
        (
            format!("{quota}netns = \"0\"\n"),
            "c.toml:7: `quota[0] (q).netns`: `0` is not a namespace inode",
        ),
        (
            format!("{quota}netns = 7\n"),
            "c.toml:7:9: `quota[0].netns`: invalid type: integer `7`, expected a string",
        ),
        (
            policy("comm = \"x\", netns = \"blue\", container = \"abcd\""),
            "c.toml:4: `policy[0] (p).select.container`: set netns or container, not both",
        ),
        (
            policy("comm = \"x\", netns = \"all\""),
            "c.toml:4: `policy[0] (p).select.netns`: \"all\" is not one namespace: a policy without netns applies in every namespace",
        ),
        (
            policy("container = \"ab\""),
            "c.toml:4: `policy[0] (p).select.container`: `ab` is not a container id prefix",
        ),
        (
            policy("netns = \"host\""),
            "c.toml:4: `policy[0] (p).select`: selects nothing specific",
        ),
        (
            "[[policy]]\nname = \"p\"\ntrigger = \"always\"\n[policy.select]\ncomm = \"x\"\ncontainer = \"abcd\"\nnetns = \"red\"\n".into(),
            "c.toml:6: `policy[0] (p).select.container`: set netns or container, not both",
        ),
    ];
    for (text, expected) in cases {
        let e = refused(text);
        assert!(
            e.starts_with(expected),
            "{text}\n-> {e}\nexpected {expected}"
        );
    }
    // A container or a namespace other than the host's is specific enough on its own.
    parse(&policy("container = \"abcd\""), "c.toml").unwrap();
    parse(&policy("netns = \"blue\""), "c.toml").unwrap();
}

/// A policy that cannot select anything on any host is a warning that names why.
#[test]
fn policies_that_never_select_are_warned_about() {
    let w = |select: &str| {
        let text = format!(
            "[reclaim]\nprotect_ports = [22]\n[[policy]]\nname = \"p\"\ntrigger = \"always\"\nselect = {{ {select} }}\n"
        );
        warnings(&parse(&text, "c.toml").unwrap())
    };
    let long = w("comm = \"connreap-testpeer\"");
    assert_eq!(long.len(), 1, "{long:?}");
    assert!(
        long[0].contains("policy p: can never select a socket")
            && long[0].contains("write \"connreap-testpe\""),
        "{long:?}"
    );
    assert!(w("comm = \"node\", states = [\"TIME_WAIT\"]")[0].contains("never reclaimed"));
    assert!(w("peer_port = 22")[0].contains("select.peer_port = 22 is in reclaim.protect_ports"));
    assert!(w("comm = \"node\", states = [\"ESTABLISHED\"]").is_empty());
}
