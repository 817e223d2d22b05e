//! leaky-proxy: the buggy platform proxy of incident 1.
//!
//! `leaky-proxy [--listen 127.0.0.1:8080] [--upstream 127.0.0.1:25001]`
//!
//! For each client connection it reads the request head, opens ONE new upstream TCP
//! connection (no pooling), forwards the client's bytes upstream and the upstream's bytes to
//! the client.
//!
//! The modelled bug: when the client goes away (EOF or reset on the client socket), the proxy
//! closes its client-side socket but never closes or aborts the upstream connection. The
//! upstream is released only when the upstream response ends (upstream EOF); until then the
//! proxy keeps reading and discarding it. A quiet SSE request whose client gave up therefore
//! leaks one idle ESTABLISHED proxy<->relay connection (and the relay's stream) forever.
//!
//! If the upstream closes or resets before sending any byte (the relay refusing a dial),
//! the client gets `503 Service Unavailable` with body `busy`. If the upstream cannot be
//! reached at all, `502`.
//!
//! Prints `ready` once listening.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use connreap_tests::fixtures::http::write_response;

const MAX_HEAD: usize = 64 * 1024;

/// The buggy platform proxy of incident 1.
#[derive(clap::Parser)]
struct Args {
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    #[arg(long, default_value = "127.0.0.1:25001")]
    upstream: SocketAddr,
}

fn main() {
    let Args { listen, upstream } = clap::Parser::parse();
    let listener = TcpListener::bind(listen).unwrap_or_else(|e| {
        eprintln!("leaky-proxy: bind {listen}: {e}");
        std::process::exit(1)
    });
    println!("ready");
    let _ = io::stdout().flush();
    for conn in listener.incoming() {
        match conn {
            Ok(client) => {
                std::thread::spawn(move || handle(client, upstream));
            }
            Err(e) => {
                eprintln!("leaky-proxy: accept: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// Reads from the client until the end of the request head. `None` if the client closed
/// (or broke) first. The returned bytes may include the start of a body.
fn read_head(client: &TcpStream) -> Option<Vec<u8>> {
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        if head.len() > MAX_HEAD {
            return None;
        }
        match (&*client).read(&mut buf) {
            Ok(0) => return None,
            Ok(n) => head.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
    Some(head)
}

fn handle(mut client: TcpStream, upstream_addr: SocketAddr) {
    let Some(head) = read_head(&client) else {
        let _ = client.shutdown(Shutdown::Both);
        return;
    };
    // One fresh upstream connection per request: no pool.
    let upstream = match TcpStream::connect_timeout(&upstream_addr, Duration::from_secs(5)) {
        Ok(u) => u,
        Err(e) => {
            let msg = format!("upstream {upstream_addr} unreachable: {e}");
            let _ = write_response(&mut client, 502, "text/plain", msg.as_bytes());
            let _ = client.shutdown(Shutdown::Both);
            return;
        }
    };
    let (Ok(client_r), Ok(upstream_w)) = (client.try_clone(), upstream.try_clone()) else {
        let _ = client.shutdown(Shutdown::Both);
        return;
    };

    // client -> upstream
    let to_upstream = std::thread::spawn(move || {
        if (&upstream_w).write_all(&head).is_err() {
            return; // upstream broken: the other direction notices and answers the client
        }
        let mut buf = [0u8; 16 * 1024];
        loop {
            match (&client_r).read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    if (&upstream_w).write_all(&buf[..n]).is_err() {
                        return;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        // THE BUG: the client went away. Close the client side only; the upstream
        // connection is neither closed nor aborted (it is released only when the upstream
        // response ends).
        let _ = client_r.shutdown(Shutdown::Both);
    });

    // upstream -> client
    let mut got_any = false;
    let mut client_alive = true;
    let mut buf = [0u8; 16 * 1024];
    loop {
        match (&upstream).read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                got_any = true;
                // Once the client is gone the bytes are read and dropped: the upstream stays
                // open with empty queues, exactly like the incident.
                if client_alive && client.write_all(&buf[..n]).is_err() {
                    client_alive = false;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    if !got_any && client_alive {
        // The relay refused the dial (closed/reset before any byte).
        let _ = write_response(&mut client, 503, "text/plain", b"busy");
    }
    // The upstream response ended: only now is everything released.
    let _ = client.shutdown(Shutdown::Both);
    let _ = upstream.shutdown(Shutdown::Both);
    let _ = to_upstream.join();
}
