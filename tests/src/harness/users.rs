//! Users of incident 1 who stay: one HTTP client connection each, opened from inside a
//! (client pod's) network namespace, kept open on an SSE page and watched: a quiet page
//! (`/events`, nothing after the head) or a live one (`/ticks`, `data: tick N` every second).
//! Users who leave are [`crate::fixtures::abandon_requests_with`].
//!
//! A reader thread per user reads everything that arrives, so a stream that ends (the proxy
//! closing the user's connection because its upstream was killed) is seen at once.

use std::{
    io::{Read, Write},
    net::{Shutdown, SocketAddr, TcpStream},
    sync::{Arc, Mutex},
    thread,
    time::{Duration, Instant},
};

use super::{
    consts::{HTTP, POLL},
    netns::NetNs,
    process::wait_until,
};
use crate::fixtures::{http::connect, ss_tcp};

/// What a user's reader thread has seen.
#[derive(Debug, Default)]
struct Seen {
    /// Everything received.
    bytes: Vec<u8>,
    /// `data: tick` lines received, and when the last one arrived.
    ticks: u64,
    last_tick: Option<Instant>,
    /// Why the stream ended (EOF, error), once it has.
    ended: Option<String>,
}

/// One user on an SSE page through the proxy; the connection is closed on drop.
pub struct User {
    ns: String,
    path: String,
    /// The user's own address (in its namespace).
    pub local: SocketAddr,
    stream: TcpStream,
    seen: Arc<Mutex<Seen>>,
    reader: Option<thread::JoinHandle<()>>,
}

impl User {
    /// Opens `GET path` (SSE) on `proxy` from inside `ns` and waits until the response head
    /// arrived, which must be `200`: the stream goes through the whole chain.
    pub fn open(ns: &NetNs, proxy: SocketAddr, path: &str) -> User {
        let stream = connect(Some(ns.name()), proxy, HTTP)
            .unwrap_or_else(|e| panic!("user in {}: connect {proxy}: {e}", ns.name()));
        let local = stream.local_addr().expect("local address");
        let request = format!(
            "GET {path} HTTP/1.1\r\nHost: {proxy}\r\nUser-Agent: connreap-e2e-user\r\nAccept: text/event-stream\r\nCache-Control: no-cache\r\n\r\n"
        );
        (&stream)
            .write_all(request.as_bytes())
            .unwrap_or_else(|e| panic!("user {local}: send GET {path}: {e}"));
        let seen = Arc::new(Mutex::new(Seen::default()));
        let reader = {
            let (mut r, seen) = (stream.try_clone().expect("clone"), Arc::clone(&seen));
            thread::spawn(move || read_all(&mut r, &seen))
        };
        let user = User {
            ns: ns.name().to_string(),
            path: path.to_string(),
            local,
            stream,
            seen,
            reader: Some(reader),
        };
        let head = wait_until(HTTP, POLL / 5, || user.head());
        match head {
            Some(line) if line.starts_with("HTTP/1.1 200") => user,
            other => panic!(
                "user {local}: GET {path} through {proxy} answered {other:?}, not 200 (received {:?})",
                user.text()
            ),
        }
    }

    /// The response's status line, once the whole head arrived.
    fn head(&self) -> Option<String> {
        let s = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let text = String::from_utf8_lossy(&s.bytes);
        text.contains("\r\n\r\n")
            .then(|| text.lines().next().unwrap_or_default().to_string())
    }

    fn text(&self) -> String {
        let s = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        String::from_utf8_lossy(&s.bytes).into_owned()
    }

    /// Whether this user is on a live page (`/ticks`).
    pub fn live(&self) -> bool {
        self.path.starts_with("/ticks")
    }

    /// Ticks received so far.
    pub fn ticks(&self) -> u64 {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).ticks
    }

    /// `Ok` while the user still has its stream: the connection never ended, `ss` in its
    /// namespace shows it ESTABLISHED, and on a live page a tick arrived within the last
    /// 2.5 s. Otherwise what is wrong.
    pub fn check(&self) -> Result<(), String> {
        let (ended, ticks, last_tick) = {
            let s = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            (s.ended.clone(), s.ticks, s.last_tick)
        };
        if let Some(why) = ended {
            return Err(format!("{}: its stream ended: {why}", self.describe()));
        }
        let socks = ss_tcp(Some(&self.ns)).map_err(|e| format!("ss in {}: {e}", self.ns))?;
        match socks.iter().find(|s| s.local == self.local) {
            Some(s) if s.is_established() => {}
            Some(s) => return Err(format!("{}: socket in {}", self.describe(), s.state)),
            None => return Err(format!("{}: no socket in ss", self.describe())),
        }
        if self.live() {
            let fresh = last_tick.is_some_and(|t| t.elapsed() < Duration::from_millis(2500));
            if !fresh {
                return Err(format!(
                    "{}: live page, but no tick for {:?} ({ticks} so far)",
                    self.describe(),
                    last_tick.map(|t| t.elapsed())
                ));
            }
        }
        Ok(())
    }

    /// Who this user is, for failure messages.
    pub fn describe(&self) -> String {
        format!("user {} on {} (ns {})", self.local, self.path, self.ns)
    }
}

impl Drop for User {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(Shutdown::Both);
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

fn read_all(r: &mut TcpStream, seen: &Mutex<Seen>) {
    let mut buf = [0u8; 4096];
    let why = loop {
        match r.read(&mut buf) {
            Ok(0) => break "end of stream (FIN from the proxy)".to_string(),
            Ok(n) => {
                let mut s = seen.lock().unwrap_or_else(|e| e.into_inner());
                let before = count_ticks(&s.bytes);
                s.bytes.extend_from_slice(&buf[..n]);
                let after = count_ticks(&s.bytes);
                if after > before {
                    s.ticks = after;
                    s.last_tick = Some(Instant::now());
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => break format!("read error: {e}"),
        }
    };
    seen.lock().unwrap_or_else(|e| e.into_inner()).ended = Some(why);
}

fn count_ticks(bytes: &[u8]) -> u64 {
    bytes
        .windows(b"data: tick".len())
        .filter(|w| *w == b"data: tick")
        .count() as u64
}

/// Users still connected (every one of `users` must be): `Ok` or every failure, one a line.
pub fn check_all(users: &[User]) -> Result<(), String> {
    let errors: Vec<String> = users.iter().filter_map(|u| u.check().err()).collect();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("\n"))
    }
}
