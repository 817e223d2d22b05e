//! One request to an HTTP quota source: its client, the request with its timeout, the body
//! read up to `max_body`, parsed ([`super::body`]).
use std::time::Duration;

use super::{failed, parse_body, BodyError, QuotaStatus, Source};
use crate::config::{ByteSize, QuotaConfig};

/// Why a poll of an HTTP source gave no reading.
#[derive(Debug, thiserror::Error)]
pub enum PollError {
    /// The request's own timeout: the message says it all.
    #[error("no answer within {}", humantime::format_duration(*.0))]
    Timeout(Duration),
    #[error("cannot connect to {url}")]
    Connect {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("request to {url} failed")]
    Request {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("{url} answered HTTP {status}")]
    Status {
        url: String,
        status: reqwest::StatusCode,
    },
    #[error("reading the body of {url} failed")]
    Body {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    /// More than `quota.max_body`: read no further (`length` is the announced
    /// Content-Length, when there was one).
    #[error("the body of {url} is larger than max_body ({}){}", ByteSize(*.max_body),
        .length.map(|l| format!(": Content-Length {l}")).unwrap_or_default())]
    TooLarge {
        url: String,
        max_body: u64,
        length: Option<u64>,
    },
    #[error(transparent)]
    Parse(#[from] BodyError),
}

/// The body of `resp`, read chunk by chunk and refused as soon as it would exceed `max_body`
/// bytes: at most `max_body` plus one chunk is ever held.
async fn read_body(
    mut resp: reqwest::Response,
    url: &str,
    max_body: u64,
) -> Result<Vec<u8>, PollError> {
    let too_large = |length| PollError::TooLarge {
        url: url.into(),
        max_body,
        length,
    };
    if let Some(length) = resp.content_length().filter(|l| *l > max_body) {
        return Err(too_large(Some(length)));
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|source| PollError::Body {
        url: url.into(),
        source,
    })? {
        if (body.len() + chunk.len()) as u64 > max_body {
            return Err(too_large(None));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// The HTTP client quota sources are polled with: no proxy (a status port is local to the
/// host or the pod), no redirect followed (a source answers where it was asked), and
/// connreap's user agent. Building it fails only when the TLS backend cannot start: an error
/// at start, never a silently different client.
pub fn http_client() -> Result<reqwest::Client, reqwest::Error> {
    reqwest::Client::builder()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .user_agent(concat!("connreap/", env!("CARGO_PKG_VERSION")))
        .build()
}

/// Poll one HTTP source once. Never fails: problems become `error`.
pub async fn poll(
    client: &reqwest::Client,
    cfg: &QuotaConfig,
    timeout: Duration,
    previous: Option<&QuotaStatus>,
) -> QuotaStatus {
    let url = cfg.url.clone().unwrap_or_default();
    // A reading is stamped with the time its request was sent: the source's counts can only
    // reflect what happened before then.
    let now = chrono::Utc::now();
    let result = async {
        let resp = client
            .get(&url)
            .timeout(timeout)
            .send()
            .await
            .map_err(|source| {
                let url = url.clone();
                if source.is_timeout() {
                    PollError::Timeout(timeout)
                } else if source.is_connect() {
                    PollError::Connect { url, source }
                } else {
                    PollError::Request { url, source }
                }
            })?;
        let status = resp.status();
        if !status.is_success() {
            return Err(PollError::Status {
                url: url.clone(),
                status,
            });
        }
        let body = read_body(resp, &url, cfg.max_body()).await?;
        Ok(parse_body(&body, cfg)?)
    }
    .await;
    match result {
        Ok(entries) => QuotaStatus {
            name: cfg.name.clone(),
            source: Source::Http,
            url: Some(url),
            last_poll: Some(now),
            entries,
            error: None,
        },
        // The whole chain: the request error's causes say why it failed.
        Err(e) => failed(cfg, previous, now, format!("{:#}", anyhow::Error::new(e))),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::quota::tests::relay_cfg;

    /// Serves one response with `body`, announced by Content-Length or chunked.
    pub(crate) async fn serve_once(body: Vec<u8>, chunked: bool) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/status", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut req = [0u8; 1024];
            let _ = s.read(&mut req).await;
            let head = if chunked {
                "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n".to_string()
            } else {
                format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", body.len())
            };
            let _ = s.write_all(head.as_bytes()).await;
            for part in body.chunks(64 * 1024) {
                let part = if chunked {
                    [format!("{:x}\r\n", part.len()).as_bytes(), part, b"\r\n"].concat()
                } else {
                    part.to_vec()
                };
                if s.write_all(&part).await.is_err() {
                    return; // the agent stopped reading
                }
            }
            let _ = s.write_all(b"0\r\n\r\n").await;
        });
        url
    }

    #[tokio::test]
    async fn bodies_above_max_body_are_refused_without_reading_them_whole() {
        let client = reqwest::Client::builder().no_proxy().build().unwrap();
        let mut cfg = relay_cfg();
        cfg.max_body = Some(ByteSize(64 * 1024));
        let t = Duration::from_secs(5);
        let big = vec![b' '; 4 << 20];
        for chunked in [false, true] {
            cfg.url = Some(serve_once(big.clone(), chunked).await);
            let q = poll(&client, &cfg, t, None).await;
            let e = q.error.unwrap();
            assert!(e.contains("is larger than max_body (64KiB)"), "{e}");
            assert_eq!(e.contains("Content-Length 4194304"), !chunked, "{e}");
        }
        // Under the cap: read and parsed.
        let ok = br#"{"endpoints":[{"port":1,"streams":1,"maxStreams":4}]}"#.to_vec();
        cfg.url = Some(serve_once(ok, true).await);
        let q = poll(&client, &cfg, t, None).await;
        assert_eq!((q.error, q.entries.len()), (None, 1));
    }
}
