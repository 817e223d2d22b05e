//! Configuration: a TOML file. Every key is declared once (`tables.rs`, `entries.rs`, with the
//! `settings!` macro of `decl.rs`); `connreap.example.toml` and docs/config.md are generated
//! from those declarations (`render.rs`), and a unit test keeps them current.
mod decl;
mod delivery;
mod entries;
mod keys;
mod ranges;
#[cfg(test)]
mod render;
mod shown;
mod size;
mod tables;
mod token;
mod validate;

use std::path::Path;

use serde::{Deserialize, Serialize};

pub use delivery::Delivery;
pub use entries::{PolicyConfig, QuotaConfig, Selector, WebhookConfig};
use keys::{KeyPath, Positions};
pub use ranges::{DEFAULT_MAX_BODY, MAX_COUNT};
pub use shown::{shown, INPUT_MAX};
pub use size::ByteSize;
pub use tables::{AgentConfig, AlertsConfig, ApiConfig, DetectConfig, ReclaimConfig};
pub use token::read_token;
use validate::validate;
pub use validate::warnings;

/// Exit code for an invalid configuration (sysexits.h EX_CONFIG).
pub const EX_CONFIG: u8 = 78;
pub const DEFAULT_PATH: &str = "/etc/connreap/connreap.toml";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: cannot read")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}:{column}: {message}")]
    Parse {
        path: String,
        line: usize,
        column: usize,
        /// The parser's message, led by the key it is about (or, in text that is not valid
        /// TOML, by the line). The parser's own error is not kept as a source: its display
        /// repeats the position with a snippet of the file.
        message: String,
    },
    #[error("{path}:{} `{key}`: {message}", line_part(.line))]
    Invalid {
        path: String,
        /// Line of the key (or of its table) in the file, when it is there.
        line: Option<usize>,
        key: String,
        message: String,
    },
}

impl ConfigError {
    /// The error as it may be printed: every part that comes from the file or its path with
    /// control characters escaped and capped (see [`shown`]).
    fn shown(self) -> ConfigError {
        use shown::{shown, PART_MAX};
        match self {
            ConfigError::Read { path, source } => ConfigError::Read {
                path: shown(&path, PART_MAX),
                source,
            },
            ConfigError::Parse {
                path,
                line,
                column,
                message,
            } => ConfigError::Parse {
                path: shown(&path, PART_MAX),
                line,
                column,
                message: shown(&message, PART_MAX),
            },
            ConfigError::Invalid {
                path,
                line,
                key,
                message,
            } => ConfigError::Invalid {
                path: shown(&path, PART_MAX),
                line,
                key: shown(&key, PART_MAX),
                message: shown(&message, PART_MAX),
            },
        }
    }
}

fn line_part(line: &Option<usize>) -> String {
    line.map(|l| format!("{l}:")).unwrap_or_default()
}

/// The whole configuration. By default there are no quota sources, webhooks or policies:
/// findings are logged and served by the API, and nothing is ever closed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub agent: AgentConfig,
    pub detect: DetectConfig,
    pub api: ApiConfig,
    pub alerts: AlertsConfig,
    pub reclaim: ReclaimConfig,
    pub quota: Vec<QuotaConfig>,
    pub webhook: Vec<WebhookConfig>,
    pub policy: Vec<PolicyConfig>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DestroyMechanism {
    Auto,
    Netlink,
    BpfIter,
}

/// Where a quota's ports, or a policy's sockets, live: `netns = ...` or `container = ...`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place<'a> {
    /// A network namespace: a name, an inode or "host".
    Netns(&'a str),
    /// A container, by lowercase id prefix.
    Container(&'a str),
}

/// `netns` and `container` of a table (validation refuses both at once; netns wins).
fn place_of<'a>(netns: &'a Option<String>, container: &'a Option<String>) -> Option<Place<'a>> {
    match (netns, container) {
        (Some(n), _) => Some(Place::Netns(n)),
        (None, Some(c)) => Some(Place::Container(c)),
        (None, None) => None,
    }
}

impl std::fmt::Display for Place<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Place::Netns(n) => write!(f, "netns {n}"),
            Place::Container(c) => write!(f, "container {c}"),
        }
    }
}

/// An optional string, lowercased (container ids are lowercase hex).
fn lowercase<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    Ok(Option::<String>::deserialize(d)?.map(|s| s.to_ascii_lowercase()))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WebhookFormat {
    Json,
    Alertmanager,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyMode {
    DryRun,
    Enforce,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Trigger {
    QuotaSaturated,
    Always,
}

/// Which selected sockets a round takes first.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Order {
    /// Longest in their state first, then longest idle (the relay operators' rule: age, not
    /// idleness, because quiet streams are legitimately idle).
    #[default]
    OldestFirst,
}

/// What a round does to a socket it takes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Action {
    /// SOCK_DESTROY (or the bpf_sock_destroy fallback): RST where the state calls for it.
    #[default]
    Destroy,
}

impl QuotaConfig {
    pub fn is_http(&self) -> bool {
        self.url.is_some()
    }
    /// The local service port whose sockets count against quota entry `port`.
    pub fn socket_port(&self, port: u16) -> u16 {
        self.port_map
            .get(&port.to_string())
            .copied()
            .unwrap_or(port)
    }
    /// `max_body`, else the default.
    pub fn max_body(&self) -> u64 {
        self.max_body.unwrap_or(DEFAULT_MAX_BODY).0
    }
    /// The namespace or container the quota names; None: connreap's own namespace.
    pub fn place(&self) -> Option<Place<'_>> {
        place_of(&self.netns, &self.container)
    }
}

/// 1-based line and column of byte `offset`.
fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.len() - before.rfind('\n').map(|i| i + 1).unwrap_or(0) + 1;
    (line, column)
}

/// The byte range of the line holding `offset`, without its line break.
fn line_range(text: &str, offset: usize) -> std::ops::Range<usize> {
    let offset = offset.min(text.len());
    let start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
    let end = text[start..].find('\n').map_or(text.len(), |i| start + i);
    start..end
}

/// Parse and validate a configuration text; `path` is only used in messages.
pub fn parse(text: &str, path: &str) -> Result<Config, ConfigError> {
    parse_unshown(text, path).map_err(ConfigError::shown)
}

fn parse_unshown(text: &str, path: &str) -> Result<Config, ConfigError> {
    let cfg: Config = toml::from_str(text).map_err(|e| parse_error(text, path, &e))?;
    validate(&cfg).map_err(|(key, message)| ConfigError::Invalid {
        path: path.into(),
        line: Positions::of(text)
            .and_then(|p| p.find(&key))
            .map(|at| line_col(text, at).0),
        key: key.to_string(),
        message,
    })?;
    Ok(cfg)
}

/// A parse error at file:line:column, naming the key it is about: the innermost key on the
/// error's line, from the parser's spans. Text that is not TOML at all has no keys to name;
/// its line is quoted instead.
fn parse_error(text: &str, path: &str, e: &toml::de::Error) -> ConfigError {
    let message = e.message().to_string();
    let Some(start) = e.span().map(|s| s.start) else {
        return ConfigError::Parse {
            path: path.into(),
            line: 0,
            column: 0,
            message,
        };
    };
    let (line, column) = line_col(text, start);
    let range = line_range(text, start);
    let what = match Positions::of(text) {
        Some(p) => p.at(start, range).map(KeyPath::to_string),
        None => Some(text[range].trim().to_string()).filter(|l| !l.is_empty()),
    }
    .map(|w| shown::shown(&w, shown::INPUT_MAX));
    ConfigError::Parse {
        path: path.into(),
        line,
        column,
        message: match what {
            Some(what) => format!("`{what}`: {message}"),
            None => message,
        },
    }
}

pub fn load(path: &Path) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| {
        ConfigError::Read {
            path: path.display().to_string(),
            source,
        }
        .shown()
    })?;
    parse(&text, &path.display().to_string())
}

/// `--config PATH`, else /etc/connreap/connreap.toml if it exists, else built-in defaults.
pub fn load_default(explicit: Option<&Path>) -> Result<(Config, String), ConfigError> {
    match explicit {
        Some(p) => Ok((load(p)?, p.display().to_string())),
        None if Path::new(DEFAULT_PATH).exists() => {
            Ok((load(Path::new(DEFAULT_PATH))?, DEFAULT_PATH.to_string()))
        }
        None => Ok((Config::default(), "built-in defaults".into())),
    }
}

#[cfg(test)]
mod tests;
