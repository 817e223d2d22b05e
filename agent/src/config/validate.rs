//! What a parsed configuration must satisfy beyond its types: every value in the range its key
//! declares (`decl.rs`), sources and policies complete and consistent, the API token usable.
//! A config that passes runs: nothing here is left for the daemon to trip over.
use super::{keys::KeyPath, Config, PolicyConfig, QuotaConfig, Trigger};
use crate::table::TcpState;

/// A validation failure: where, and what is wrong.
pub(super) type Invalid = (KeyPath, String);

fn invalid(key: KeyPath, message: impl Into<String>) -> Invalid {
    (key, message.into())
}

/// `table.key` at the top of the document.
fn top(table: &str, key: &str) -> KeyPath {
    KeyPath::default().key(table).key(key)
}

pub(super) fn validate(cfg: &Config) -> Result<(), Invalid> {
    let root = KeyPath::default;
    cfg.agent.check_ranges(&root().key("agent"))?;
    cfg.detect.check_ranges(&root().key("detect"))?;
    cfg.api.check_ranges(&root().key("api"))?;
    cfg.alerts.check_ranges(&root().key("alerts"))?;
    cfg.reclaim.check_ranges(&root().key("reclaim"))?;
    validate_severity(&cfg.alerts)?;
    super::delivery::validate(cfg)?;
    super::token::read_token(&cfg.api).map_err(|e| invalid(top("api", "token_file"), e))?;
    validate_quotas(cfg)?;
    for (i, w) in cfg.webhook.iter().enumerate() {
        w.check_ranges(&KeyPath::default().entry("webhook", i, None))?;
        if !w.url.starts_with("http://") && !w.url.starts_with("https://") {
            return Err(invalid(
                KeyPath::default().entry("webhook", i, None).key("url"),
                format!("`{}` is not an http(s) URL", w.url),
            ));
        }
    }
    validate_policies(cfg)
}

/// `[alerts.severity]`: known kinds, the levels Alertmanager routes on.
fn validate_severity(a: &super::AlertsConfig) -> Result<(), Invalid> {
    for (kind, level) in &a.severity {
        let known = crate::kind::Kind::ALL.iter().any(|k| k.as_str() == kind);
        if !known {
            return Err(invalid(
                top("alerts", "severity"),
                format!("`{kind}` is not a finding kind"),
            ));
        }
        if !["critical", "warning", "info"].contains(&level.as_str()) {
            return Err(invalid(
                top("alerts", "severity"),
                format!("`{kind} = \"{level}\"`: expected critical, warning or info"),
            ));
        }
    }
    Ok(())
}

fn validate_quotas(cfg: &Config) -> Result<(), Invalid> {
    let mut names = std::collections::HashSet::new();
    for (i, q) in cfg.quota.iter().enumerate() {
        let entry = KeyPath::default().entry("quota", i, Some(&q.name));
        if q.name.is_empty() || !names.insert(q.name.as_str()) {
            return Err(invalid(
                KeyPath::default().entry("quota", i, None).key("name"),
                "must be present and unique",
            ));
        }
        match (&q.url, &q.process) {
            (Some(url), None) => validate_http_quota(&entry, url, q)?,
            (None, Some(_)) => {
                if q.peer.is_none() || q.limit.is_none() {
                    return Err(invalid(
                        entry.clone().key("peer"),
                        "static sources need process, peer and limit",
                    ));
                }
            }
            _ => {
                return Err(invalid(
                    entry.clone().key("url"),
                    "set either url (HTTP JSON source) or process + peer + limit (static source)",
                ))
            }
        }
        q.check_ranges(&entry)?;
        validate_place(
            &entry,
            &q.netns,
            &q.container,
            "a quota's ports live in one namespace",
        )?;
    }
    Ok(())
}

/// `netns` / `container` of a quota or a policy's `select` (`table`): one at most, a netns
/// that names one namespace, a container id prefix of at least 4 hex digits. `all` says what
/// leaving `netns` out says for a policy, and cannot be a quota's.
fn validate_place(
    table: &KeyPath,
    netns: &Option<String>,
    container: &Option<String>,
    why_not_all: &str,
) -> Result<(), Invalid> {
    let key = |k: &str| table.clone().key(k);
    if netns.is_some() && container.is_some() {
        return Err(invalid(
            key("container"),
            "set netns or container, not both (a container names its network namespace)",
        ));
    }
    if let Some(n) = netns {
        let problem = if n.is_empty() {
            Some("must not be empty".to_string())
        } else if n == "all" {
            Some(format!("\"all\" is not one namespace: {why_not_all}"))
        } else if n.contains('/') || n == "." || n == ".." || n.chars().any(char::is_whitespace) {
            Some(format!(
                "`{n}` is not a namespace name (as under /run/netns), an inode or \"host\""
            ))
        } else if n
            .parse::<u64>()
            .is_ok_and(|i| i == 0 || i > u64::from(u32::MAX))
        {
            Some(format!("`{n}` is not a namespace inode"))
        } else {
            None
        };
        if let Some(problem) = problem {
            return Err(invalid(key("netns"), problem));
        }
    }
    if let Some(c) = container {
        if c.len() < 4 || c.len() > 64 || !c.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(invalid(
                key("container"),
                format!("`{c}` is not a container id prefix (4 to 64 hex digits)"),
            ));
        }
    }
    Ok(())
}

fn validate_http_quota(entry: &KeyPath, url: &str, q: &QuotaConfig) -> Result<(), Invalid> {
    let key = |k: &str| entry.clone().key(k);
    if !url.starts_with("http://") && !url.starts_with("https://") {
        return Err(invalid(
            key("url"),
            format!("`{url}` is not an http(s) URL"),
        ));
    }
    let items = q.items.as_deref().unwrap_or("");
    if !items.is_empty() && !items.starts_with('/') {
        return Err(invalid(
            key("items"),
            "must be a JSON pointer like \"/endpoints\"",
        ));
    }
    if q.port_field.is_none() || q.used_field.is_none() {
        return Err(invalid(
            key("port_field"),
            "HTTP sources need port_field and used_field",
        ));
    }
    if q.limit_field.is_none() && q.limit.is_none() {
        return Err(invalid(
            key("limit_field"),
            "set limit_field or a fixed limit",
        ));
    }
    for k in q.port_map.keys() {
        if k.parse::<u16>().is_err() {
            return Err(invalid(key("port_map"), format!("`{k}` is not a port")));
        }
    }
    Ok(())
}

fn validate_policies(cfg: &Config) -> Result<(), Invalid> {
    let mut names = std::collections::HashSet::new();
    for (i, p) in cfg.policy.iter().enumerate() {
        let entry = KeyPath::default().entry("policy", i, Some(&p.name));
        let key = |k: &str| entry.clone().key(k);
        if p.name.is_empty() || !names.insert(p.name.as_str()) {
            return Err(invalid(
                KeyPath::default().entry("policy", i, None).key("name"),
                "must be present and unique",
            ));
        }
        validate_selector(&entry, p)?;
        if p.trigger == Trigger::QuotaSaturated {
            match &p.quota {
                None => {
                    return Err(invalid(
                        key("quota"),
                        "trigger = \"quota-saturated\" needs a quota name",
                    ))
                }
                Some(q) if !cfg.quota.iter().any(|c| &c.name == q) => {
                    return Err(invalid(key("quota"), format!("no [[quota]] named `{q}`")))
                }
                _ => {}
            }
        }
        p.check_ranges(&entry)?;
    }
    Ok(())
}

fn validate_selector(entry: &KeyPath, p: &PolicyConfig) -> Result<(), Invalid> {
    let select = entry.clone().key("select");
    let s = &p.select;
    s.check_ranges(&select)?;
    validate_place(
        &select,
        &s.netns,
        &s.container,
        "a policy without netns applies in every namespace",
    )?;
    // A container or a namespace other than the host's is as specific as a unit.
    if s.comm.is_none()
        && s.pid.is_none()
        && s.unit.is_none()
        && s.local_port.is_none()
        && s.peer_port.is_none()
        && s.peer.is_none()
        && s.container.is_none()
        && s.netns.as_deref().is_none_or(|n| n == "host")
    {
        return Err(invalid(
            select,
            "selects nothing specific: name at least one of comm, pid, unit, local_port, \
             peer_port, peer, container, netns (other than \"host\")",
        ));
    }
    if s.states.contains(&TcpState::Listen) {
        return Err(invalid(
            select.key("states"),
            "LISTEN sockets are never reclaimed",
        ));
    }
    // Sockets with no owner (e.g. connections still in a listener's accept queue) are only
    // reclaimed by a policy that says so and names their port.
    if s.unowned && s.local_port.is_none() && s.peer_port.is_none() {
        return Err(invalid(
            select.key("unowned"),
            "unowned = true needs local_port or peer_port: sockets with no owner are only \
             reclaimed on a port the policy names",
        ));
    }
    Ok(())
}

/// Why policy `p` can select nothing whatever the host holds, if it cannot.
fn never_selects(cfg: &Config, p: &PolicyConfig) -> Option<String> {
    let sel = &p.select;
    if let Some(comm) = sel.comm.as_deref().filter(|c| c.len() > 15) {
        return Some(format!(
            "select.comm = \"{}\" is longer than the 15 bytes the kernel keeps of a command \
             name (write \"{}\")",
            comm.escape_debug(),
            truncate_comm(comm).escape_debug()
        ));
    }
    let never = [TcpState::Listen, TcpState::TimeWait, TcpState::NewSynRecv];
    if !sel.states.is_empty() && sel.states.iter().all(|s| never.contains(s)) {
        return Some("select.states names only states that are never reclaimed (LISTEN, TIME_WAIT, NEW_SYN_RECV)".into());
    }
    for (key, port) in [("local_port", sel.local_port), ("peer_port", sel.peer_port)] {
        if let Some(port) = port.filter(|p| cfg.reclaim.protect_ports.contains(p)) {
            return Some(format!("select.{key} = {port} is in reclaim.protect_ports"));
        }
    }
    None
}

/// The first 15 bytes of `comm` (on a character boundary).
fn truncate_comm(comm: &str) -> &str {
    let mut end = 15.min(comm.len());
    while !comm.is_char_boundary(end) {
        end -= 1;
    }
    &comm[..end]
}

/// What is allowed but probably not meant, one message each (logged by `run` as warnings and
/// printed by `check-config`).
pub fn warnings(cfg: &Config) -> Vec<String> {
    let mut out = super::delivery::warnings(cfg);
    if !cfg.api.token_file.is_empty() && !cfg.agent.listen.ip().is_loopback() {
        out.push(format!(
            "agent.listen {} is not a loopback address and api.token_file is set: \
             POST /v1/reclaim (which closes connections) is reachable from the network",
            cfg.agent.listen
        ));
    }
    for p in &cfg.policy {
        if let Some(why) = never_selects(cfg, p) {
            out.push(format!(
                "policy {}: can never select a socket: {why}",
                p.name
            ));
        }
        if p.select.comm.as_deref() == Some("?") && !p.select.unowned {
            out.push(format!(
                "policy {}: select.comm = \"?\" matches no socket without an owner \
                 (that needs select.unowned = true and a port)",
                p.name
            ));
        }
    }
    // Names and values come from the file: escaped and capped like errors.
    out.into_iter()
        .map(|w| super::shown::shown(&w, super::shown::PART_MAX))
        .collect()
}
