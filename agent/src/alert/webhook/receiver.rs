//! What logs and metrics call a webhook receiver, and why a delivery to it failed.
use std::{error::Error as StdError, io, time::Duration};

/// The receiver's name in metrics and logs: its URL without user, password, query or fragment
/// (where credentials and tokens usually are).
pub fn name(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(mut u) => {
            let _ = u.set_username("");
            let _ = u.set_password(None);
            u.set_query(None);
            u.set_fragment(None);
            u.to_string()
        }
        Err(_) => url.to_string(),
    }
}

/// A failed delivery: the cause in a few words (what an operator acts on), and for request
/// errors the whole error with its sources.
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    pub cause: String,
    pub detail: Option<String>,
}

impl Failure {
    /// The receiver answered with a status that is not a success (a redirect is one: it is
    /// never followed, and its Location is named, escaped and cut short).
    pub fn status(status: reqwest::StatusCode, location: Option<String>) -> Failure {
        let detail = location.filter(|_| status.is_redirection()).map(|l| {
            let shown: String = l.chars().take(200).flat_map(char::escape_debug).collect();
            format!("redirect to {shown} not followed")
        });
        Failure {
            cause: format!("HTTP status {status}"),
            detail,
        }
    }

    /// The request did not get an answer (`timeout`: the client's per-request timeout).
    pub fn error(e: &reqwest::Error, timeout: Duration) -> Failure {
        Failure {
            cause: cause(e, e.is_timeout(), timeout),
            detail: Some(chain(e)),
        }
    }
}

/// `e` and its sources, outermost first.
fn chain(e: &(dyn StdError + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        // Some layers repeat their source's text in their own.
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

/// The cause of a request error: a timeout, the socket error behind it (connection refused,
/// reset, unreachable), a failed DNS lookup, else the innermost error's text.
fn cause(e: &(dyn StdError + 'static), timed_out: bool, timeout: Duration) -> String {
    if timed_out {
        return format!(
            "timeout (no answer within {})",
            humantime::format_duration(timeout)
        );
    }
    let mut innermost = e;
    let mut dns = false;
    let mut source = Some(e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<io::Error>() {
            let known = match io.kind() {
                io::ErrorKind::ConnectionRefused => Some("connection refused"),
                io::ErrorKind::ConnectionReset => Some("connection reset by the receiver"),
                io::ErrorKind::ConnectionAborted => Some("connection aborted"),
                io::ErrorKind::TimedOut => Some("timeout (connect)"),
                io::ErrorKind::HostUnreachable => Some("host unreachable"),
                io::ErrorKind::NetworkUnreachable => Some("network unreachable"),
                io::ErrorKind::AddrNotAvailable => Some("address not available"),
                _ => None,
            };
            if let Some(k) = known {
                return k.to_string();
            }
        }
        // hyper-util's connector names a failed lookup "dns error".
        dns |= s.to_string().starts_with("dns error");
        innermost = s;
        source = s.source();
    }
    if dns {
        format!("DNS lookup failed: {innermost}")
    } else {
        innermost.to_string()
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    fn client(timeout: Duration) -> reqwest::Client {
        reqwest::Client::builder()
            .timeout(timeout)
            .no_proxy()
            .build()
            .unwrap()
    }

    #[test]
    fn names_drop_credentials_and_query() {
        assert_eq!(
            name("http://user:secret@am.example:9093/api/v2/alerts?token=x#f"),
            "http://am.example:9093/api/v2/alerts"
        );
        assert_eq!(
            name("http://127.0.0.1:9999/alerts"),
            "http://127.0.0.1:9999/alerts"
        );
        assert_eq!(name("not a url"), "not a url");
    }

    #[tokio::test]
    async fn connection_refused() {
        // A port nobody listens on: bind one, then free it.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let t = Duration::from_secs(5);
        let e = client(t)
            .post(format!("http://127.0.0.1:{port}/alerts"))
            .send()
            .await
            .unwrap_err();
        let f = Failure::error(&e, t);
        assert_eq!(f.cause, "connection refused", "{f:?}");
        assert!(
            f.detail
                .as_deref()
                .is_some_and(|d| d.contains("Connection refused")),
            "{f:?}"
        );
    }

    #[tokio::test]
    async fn timeout() {
        // Listening (the kernel completes the handshake) but never answering.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let t = Duration::from_millis(200);
        let e = client(t)
            .post(format!("http://{}/alerts", l.local_addr().unwrap()))
            .send()
            .await
            .unwrap_err();
        let f = Failure::error(&e, t);
        assert_eq!(f.cause, "timeout (no answer within 200ms)", "{f:?}");
    }

    #[test]
    fn status() {
        let f = Failure::status(reqwest::StatusCode::SERVICE_UNAVAILABLE, None);
        assert_eq!(f.cause, "HTTP status 503 Service Unavailable");
        let f = Failure::status(
            reqwest::StatusCode::TEMPORARY_REDIRECT,
            Some("http://127.0.0.2:9/stolen\u{1b}[2J".into()),
        );
        assert_eq!(f.cause, "HTTP status 307 Temporary Redirect");
        assert_eq!(
            f.detail.as_deref(),
            Some("redirect to http://127.0.0.2:9/stolen\\u{1b}[2J not followed")
        );
    }

    /// An error with a source, as the connector's layers are.
    #[derive(Debug)]
    struct Layer(&'static str, Box<dyn StdError + Send + Sync>);

    impl std::fmt::Display for Layer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl StdError for Layer {
        fn source(&self) -> Option<&(dyn StdError + 'static)> {
            Some(&*self.1)
        }
    }

    #[test]
    fn dns_failure_and_unknown_causes() {
        let lookup =
            io::Error::other("failed to lookup address information: Name or service not known");
        let e = Layer(
            "error sending request for url (http://am.invalid/)",
            Box::new(Layer("dns error", Box::new(lookup))),
        );
        assert_eq!(
            cause(&e, false, Duration::ZERO),
            "DNS lookup failed: failed to lookup address information: Name or service not known"
        );
        assert_eq!(
            chain(&e),
            "error sending request for url (http://am.invalid/): dns error: failed to lookup \
             address information: Name or service not known"
        );
        let e = Layer("outer", Box::new(io::Error::other("tls handshake eof")));
        assert_eq!(cause(&e, false, Duration::ZERO), "tls handshake eof");
        let e = Layer(
            "outer",
            Box::new(io::Error::from(io::ErrorKind::ConnectionReset)),
        );
        assert_eq!(
            cause(&e, false, Duration::ZERO),
            "connection reset by the receiver"
        );
    }
}
