//! The reclaim audit log (one JSON decision per line) and checks on its decisions.

use std::{collections::BTreeMap, fs, io::ErrorKind, net::SocketAddr, path::Path};

use serde_json::Value;

/// Every line of the audit log at `path`, parsed (none while the file does not exist). A line
/// that is not a JSON object, or a last line without its newline, fails the test.
pub fn read_audit(path: &Path) -> Vec<Value> {
    let text = match fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == ErrorKind::NotFound => return Vec::new(),
        Err(e) => panic!("read {}: {e}", path.display()),
    };
    assert!(
        text.is_empty() || text.ends_with('\n'),
        "audit log does not end with a newline:\n{text}"
    );
    text.lines()
        .enumerate()
        .map(|(i, l)| {
            let v: Value = serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("audit line {} is not JSON ({e}): {l:?}", i + 1));
            assert!(v.is_object(), "audit line {} is not an object: {l}", i + 1);
            v
        })
        .collect()
}

/// The decisions whose `result` is `result` (`killed`, `would-kill`, `skipped`, `failed`).
pub fn result_is<'a>(lines: &'a [Value], result: &str) -> Vec<&'a Value> {
    lines.iter().filter(|d| d["result"] == result).collect()
}

/// The string field `key` of a decision; panics if it is missing or not a string.
pub fn text<'a>(d: &'a Value, key: &str) -> &'a str {
    d[key]
        .as_str()
        .unwrap_or_else(|| panic!("decision without string `{key}`: {d}"))
}

/// The integer field `key` of a decision; panics if it is missing or not an integer.
pub fn int(d: &Value, key: &str) -> u64 {
    d[key]
        .as_u64()
        .unwrap_or_else(|| panic!("decision without integer `{key}`: {d}"))
}

/// Decisions of `result` grouped by round (agent_pid, round).
pub fn per_round(lines: &[Value], result: &str) -> BTreeMap<(u64, u64), usize> {
    let mut m = BTreeMap::new();
    for d in result_is(lines, result) {
        *m.entry((int(d, "agent_pid"), int(d, "round"))).or_default() += 1;
    }
    m
}

/// Decisions naming the address `a` at either end of their 4-tuple.
pub fn naming<'a>(lines: &'a [Value], a: &SocketAddr) -> Vec<&'a Value> {
    let a = a.to_string();
    lines
        .iter()
        .filter(|d| d["local"] == a.as_str() || d["peer"] == a.as_str())
        .collect()
}

/// Every documented audit field is present with the right type.
pub fn assert_decision_shape(d: &Value) {
    for k in [
        "time", "policy", "mode", "result", "local", "peer", "comm", "state",
    ] {
        assert!(d[k].is_string(), "`{k}` missing or not a string: {d}");
    }
    // The cookie may be unknown (null) until the kernel generated one; a kill goes by it.
    assert!(
        d["cookie"].is_string() || d["cookie"].is_null(),
        "`cookie` missing: {d}"
    );
    if d["result"] == "killed" {
        let c = d["cookie"].as_str().unwrap_or("");
        let v = c
            .strip_prefix("0x")
            .and_then(|h| u64::from_str_radix(h, 16).ok());
        assert!(
            v.is_some_and(|v| v != 0),
            "a kill must record the cookie it went by: {d}"
        );
    }
    for k in ["inode", "agent_pid", "round"] {
        assert!(d[k].is_u64(), "`{k}` missing or not an integer: {d}");
    }
    assert!(d["age_secs"].is_number(), "age_secs: {d}");
    for k in ["pid", "unit", "idle_secs", "quota"] {
        assert!(d.get(k).is_some(), "`{k}` missing: {d}");
    }
    assert!(
        ["kill-intent", "would-kill", "killed", "skipped", "failed"].contains(&text(d, "result")),
        "{d}"
    );
}
