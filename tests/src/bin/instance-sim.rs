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

const USAGE: &str = "usage: instance-sim [--listen ADDR (default 127.0.0.1:21000)] [--name NAME]";

fn main() {
    let mut listen: SocketAddr = "127.0.0.1:21000".parse().unwrap();
    let mut name = "sim".to_string();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        let mut value = || {
            inline
                .clone()
                .or_else(|| args.next())
                .unwrap_or_else(|| die(&flag))
        };
        match flag.as_str() {
            "--listen" => listen = value().parse().unwrap_or_else(|_| die("--listen")),
            "--name" => name = value(),
            "-h" | "--help" => {
                println!("{USAGE}");
                return;
            }
            _ => die(&arg),
        }
    }
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

fn die(what: &str) -> ! {
    eprintln!("instance-sim: bad or incomplete argument {what:?}\n{USAGE}");
    std::process::exit(2)
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
