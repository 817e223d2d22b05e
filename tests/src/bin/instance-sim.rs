//! instance-sim: the application instance behind the relay in incident 1.
//!
//! `instance-sim [--listen 127.0.0.1:21000] [--name sim]`
//!
//! - `GET /json`   -> 200 `application/json` `{"ok":true,"instance":"<name>"}`, then close.
//! - `GET /events` -> 200 `text/event-stream` head, then nothing ever: a quiet SSE stream held
//!   open until the peer closes.
//! - `GET /ticks`  -> SSE writing `data: tick N\n\n` at once and then every second, until the
//!   peer goes away.
//! - anything else -> 404.
//!
//! Prints `ready` on stdout once listening. One thread per connection.

use std::io::{self, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use connreap_tests::fixtures::http::{read_request, write_json, write_response};

/// The application instance behind the relay in incident 1.
#[derive(clap::Parser)]
struct Args {
    #[arg(long, default_value = "127.0.0.1:21000")]
    listen: SocketAddr,
    /// Reported in /json.
    #[arg(long, default_value = "sim")]
    name: String,
}

fn main() {
    let Args { listen, name } = clap::Parser::parse();
    let listener = TcpListener::bind(listen).unwrap_or_else(|e| {
        eprintln!("instance-sim: bind {listen}: {e}");
        std::process::exit(1)
    });
    println!("ready");
    let _ = io::stdout().flush();
    for conn in listener.incoming() {
        match conn {
            Ok(stream) => {
                let name = name.clone();
                std::thread::spawn(move || {
                    let _ = handle(stream, &name);
                });
            }
            Err(e) => {
                eprintln!("instance-sim: accept: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

const SSE_HEAD: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nConnection: keep-alive\r\n\r\n";

fn handle(mut stream: TcpStream, name: &str) -> io::Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let Some(req) = read_request(&mut reader)? else {
        return Ok(());
    };
    if !req.method.eq_ignore_ascii_case("GET") {
        return write_response(&mut stream, 405, "text/plain", b"GET only");
    }
    match req.path() {
        "/json" => write_json(
            &mut stream,
            200,
            &serde_json::json!({"ok": true, "instance": name}),
        ),
        "/events" => {
            stream.write_all(SSE_HEAD)?;
            stream.flush()?;
            // Quiet stream: hold the connection, discard whatever arrives, end on peer close.
            let mut buf = [0u8; 4096];
            loop {
                match reader.read(&mut buf) {
                    Ok(0) => return Ok(()),
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
        }
        "/ticks" => {
            stream.write_all(SSE_HEAD)?;
            let mut n: u64 = 0;
            loop {
                stream.write_all(format!("data: tick {n}\n\n").as_bytes())?;
                stream.flush()?;
                n += 1;
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        _ => write_response(&mut stream, 404, "text/plain", b"not found"),
    }
}
