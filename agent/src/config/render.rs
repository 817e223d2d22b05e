//! The files generated from the key declarations: `connreap.example.toml` (which the man page
//! connreap.toml(5), the packaged conffile and the Kubernetes ConfigMap are made from, in
//! xtask) and the key table of docs/config.md. A test compares them with the files in the
//! repository; `UPDATE_EXPECT=1` writes them instead.
use super::{
    decl::KeyDecl, AgentConfig, AlertsConfig, ApiConfig, Config, DetectConfig, PolicyConfig,
    QuotaConfig, ReclaimConfig, Selector, WebhookConfig,
};

/// Widest line of the generated comments.
const WIDTH: usize = 92;
/// Where (0-based) the `#` of an entry key's comment is.
const COMMENT_AT: usize = 33;

const HEADER: &str = "\
# connreap configuration: every key below is shown with its built-in default.
# Copy to /etc/connreap/connreap.toml and change what you need; this file is generated from
# the key declarations in agent/src/config (`UPDATE_EXPECT=1 cargo test -p connreap config`).
# Validate with:
#   connreap check-config /etc/connreap/connreap.toml
";

/// The arrays of tables: name, what the example says before its entry, its keys.
fn entries() -> Vec<(&'static str, &'static str, Vec<KeyDecl>)> {
    vec![
        (
            "quota",
            "Quota sources (none by default). Each is an HTTP JSON source (url, items, \
             port_field, used_field, and limit_field or a fixed limit; e.g. a relay's GET \
             /status) or a static source (process, peer and limit; e.g. an HTTP client pool's \
             max-per-route):",
            QuotaConfig::keys(),
        ),
        (
            "webhook",
            "Webhooks (none by default: findings are logged and served on /v1/findings).",
            WebhookConfig::keys(),
        ),
        (
            "policy",
            "Reclaim policies (none by default). See docs/reclaim.md. `select` takes any of \
             the keys indented below it; a policy must name at least one of comm, pid, unit, \
             local_port, peer_port, peer, container or a netns other than \"host\".",
            policy_keys(),
        ),
    ]
}

/// A policy's keys with its `select` keys right after `select`.
fn policy_keys() -> Vec<KeyDecl> {
    let mut keys = PolicyConfig::keys();
    let at = keys
        .iter()
        .position(|k| k.name == "select")
        .map_or(keys.len(), |i| i + 1);
    keys.splice(at..at, Selector::keys());
    keys
}

/// The top-level tables, in the file's order.
fn top() -> Vec<Vec<KeyDecl>> {
    vec![
        AgentConfig::keys(),
        DetectConfig::keys(),
        ApiConfig::keys(),
        AlertsConfig::keys(),
        ReclaimConfig::keys(),
    ]
}

/// Every declared key.
pub(super) fn all_keys() -> Vec<KeyDecl> {
    let mut all: Vec<KeyDecl> = top().into_iter().flatten().collect();
    all.extend(entries().into_iter().flat_map(|(_, _, keys)| keys));
    all
}

/// `text` as comment lines: the first led by `first`, the others by `rest` (each then a
/// space).
fn wrap(text: &str, first: &str, rest: &str) -> String {
    let mut out = String::new();
    let mut line = first.to_string();
    let mut empty = true;
    for word in text.split_whitespace() {
        if !empty && line.len() + 1 + word.len() > WIDTH {
            out.push_str(line.trim_end());
            out.push('\n');
            line = rest.to_string();
        }
        line.push(' ');
        line.push_str(word);
        empty = false;
    }
    out.push_str(line.trim_end());
    out.push('\n');
    out
}

/// The doc with what the declaration adds: the default in words, the range.
fn full_doc(k: &KeyDecl, with_default: bool) -> String {
    let mut doc = k.doc.clone();
    match (with_default, k.default_is) {
        (true, Some("required")) => doc.push_str(" Required."),
        (true, Some(d)) => doc.push_str(&format!(" Default: {d}.")),
        _ => {}
    }
    if let Some(r) = &k.range {
        doc.push_str(&format!(" Range: {r}."));
    }
    doc
}

/// The default of a top-level key, as TOML.
fn default_value(defaults: &toml::Table, k: &KeyDecl) -> Option<toml::Value> {
    let (table, rest) = k.table.split_once('.').unwrap_or((k.table, ""));
    let mut v = defaults.get(table)?;
    if !rest.is_empty() {
        v = v.get(rest)?;
    }
    v.get(k.name).cloned()
}

/// connreap.example.toml.
pub(super) fn example() -> String {
    let defaults = toml::Table::try_from(Config::default()).expect("defaults serialize");
    let mut out = String::from(HEADER);
    for keys in top() {
        let Some(first) = keys.first() else { continue };
        out.push_str(&format!("\n[{}]\n", first.table));
        let mut subtables = Vec::new();
        for k in keys.iter().filter(|k| k.moved_to.is_none()) {
            match default_value(&defaults, k) {
                Some(toml::Value::Table(_)) => subtables.push(k),
                Some(v) => {
                    out.push_str(&wrap(&full_doc(k, true), "#", "#"));
                    out.push_str(&format!("{} = {v}\n", k.name));
                }
                None => panic!("`{}` has no default", k.path()),
            }
        }
        for k in subtables {
            out.push_str(&format!("\n[{}.{}]\n", k.table, k.name));
            out.push_str(&wrap(&full_doc(k, true), "#", "#"));
            if let Some(e) = k.example {
                out.push_str(&format!("# {e}\n"));
            }
        }
    }
    for (table, intro, keys) in entries() {
        out.push('\n');
        out.push_str(&wrap(intro, "#", "#"));
        out.push_str(&format!("# [[{table}]]\n"));
        for k in &keys {
            let indent = if k.table.contains('.') { "  " } else { "" };
            let example = k
                .example
                .unwrap_or_else(|| panic!("`{}` has no example", k.path()));
            let line = format!("# {indent}{} = {example}", k.name);
            let pad = format!("#{}#", " ".repeat(COMMENT_AT - 1));
            if line.len() >= COMMENT_AT {
                out.push_str(&line);
                out.push('\n');
                out.push_str(&wrap(&full_doc(k, true), &pad, &pad));
            } else {
                let first = format!("{line:<COMMENT_AT$}#");
                out.push_str(&wrap(&full_doc(k, true), &first, &pad));
            }
        }
    }
    out
}

/// A markdown table cell: pipes escaped, one line.
fn cell(s: &str) -> String {
    s.replace('|', "\\|")
}

/// docs/config.md: every key with its type, default, range and meaning.
pub(super) fn docs() -> String {
    let defaults = toml::Table::try_from(Config::default()).expect("defaults serialize");
    let mut out = String::from(
        "# Configuration keys\n\n\
         <!-- Generated from the key declarations in agent/src/config (tables.rs, entries.rs):\n\
         `UPDATE_EXPECT=1 cargo test -p connreap config` rewrites this file. Do not edit. -->\n\n\
         Every key of `/etc/connreap/connreap.toml` (see [The daemon](daemon.md)); the same \
         settings with comments are in [`connreap.example.toml`](../connreap.example.toml) and \
         connreap.toml(5). A value outside its range is refused by `check-config` and `run` \
         (exit 78, naming file, line and key).\n",
    );
    let mut deprecated = Vec::new();
    let mut section = |title: &str, keys: &[KeyDecl], out: &mut String| {
        out.push_str(&format!(
            "\n## {title}\n\n| Key | Type | Default | Range | Meaning |\n|---|---|---|---|---|\n"
        ));
        for k in keys {
            if let Some(to) = k.moved_to {
                deprecated.push(format!(
                    "- `{}`: moved to `{to}` (still accepted, with a warning; an error when \
                     both are set)\n",
                    k.path()
                ));
                continue;
            }
            let default = match default_value(&defaults, k) {
                Some(toml::Value::Table(t)) if t.is_empty() => "(empty)".to_string(),
                Some(v) => format!("`{v}`"),
                None => k.default_is.map_or("(none)".into(), str::to_string),
            };
            out.push_str(&format!(
                "| `{}` | {} | {} | {} | {} |\n",
                k.path(),
                cell(k.ty),
                cell(&default),
                cell(k.range.as_deref().unwrap_or("")),
                cell(&k.doc)
            ));
        }
    };
    for keys in top() {
        let title = format!("`[{}]`", keys[0].table);
        section(&title, &keys, &mut out);
    }
    for (table, _, keys) in entries() {
        section(&format!("`[[{table}]]` entries"), &keys, &mut out);
    }
    out.push_str("\n## Deprecated keys\n\n");
    for d in deprecated {
        out.push_str(&d);
    }
    out
}
