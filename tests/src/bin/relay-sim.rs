//! relay-sim: the relay of incident 1, with its per-port stream quota (a pure counter, no
//! idle reclaim).
//!
//! `relay-sim --dial LOCAL=TARGET [--dial LOCAL=TARGET ...] [--status 127.0.0.1:20080]
//!            [--max-streams 64]`
//!
//! For each dial slot it listens on LOCAL. Each accepted connection is a stream: if the live
//! stream count for TARGET's port is already >= max, the dial is refused (`dialDenied` and
//! `refused` counted) and the connection closed at once; otherwise it connects to TARGET
//! (`streamsOpened` counted; a failed connect counts `refused`) and pipes bytes both ways.
//! When either side sees EOF or an error, both sockets are shut down and the count drops.
//!
//! `GET /status` on the status address:
//! `{"endpoints":[{"port":21000,"dialPort":25001,"streams":N,"maxStreams":64}],
//!   "dialDenied":D,"refused":R,"streamsOpened":O}`
//!
//! Prints `ready` once every listener is up.

use std::collections::HashMap;
use std::io::{self, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use connreap_tests::fixtures::http::{read_request, write_json, write_response};

#[derive(Clone, Copy)]
struct Slot {
    local: SocketAddr,
    target: SocketAddr,
}

#[derive(Default)]
struct State {
    /// Live streams per target port.
    streams: HashMap<u16, u64>,
    dial_denied: u64,
    refused: u64,
    streams_opened: u64,
}

type Shared = Arc<Mutex<State>>;

/// The relay of incident 1, with its per-port stream quota.
#[derive(clap::Parser)]
struct Args {
    /// A dial slot LOCAL=TARGET (repeatable, at least one).
    #[arg(long = "dial", required = true, value_parser = parse_slot)]
    slots: Vec<Slot>,
    #[arg(long, default_value = "127.0.0.1:20080")]
    status: SocketAddr,
    #[arg(long, default_value_t = 64)]
    max_streams: u64,
}

fn parse_slot(v: &str) -> Result<Slot, String> {
    v.split_once('=')
        .and_then(|(l, t)| Some((l.parse().ok()?, t.parse().ok()?)))
        .map(|(local, target)| Slot { local, target })
        .ok_or_else(|| format!("expected LOCAL=TARGET socket addresses, got `{v}`"))
}

fn main() {
    let Args {
        slots,
        status,
        max_streams,
    } = clap::Parser::parse();

    let state: Shared = Arc::new(Mutex::new(State::default()));
    let status_listener = bind(status);
    let listeners: Vec<(Slot, TcpListener)> = slots.iter().map(|s| (*s, bind(s.local))).collect();

    let mut threads = Vec::new();
    for (slot, listener) in listeners {
        let state = state.clone();
        threads.push(std::thread::spawn(move || {
            dial_slot_loop(slot, listener, state, max_streams)
        }));
    }
    {
        let state = state.clone();
        threads.push(std::thread::spawn(move || {
            status_loop(status_listener, slots, state, max_streams)
        }));
    }
    println!("ready");
    let _ = io::stdout().flush();
    for t in threads {
        let _ = t.join();
    }
}

fn bind(addr: SocketAddr) -> TcpListener {
    TcpListener::bind(addr).unwrap_or_else(|e| {
        eprintln!("relay-sim: bind {addr}: {e}");
        std::process::exit(1)
    })
}

fn dial_slot_loop(slot: Slot, listener: TcpListener, state: Shared, max: u64) {
    let port = slot.target.port();
    for conn in listener.incoming() {
        let conn = match conn {
            Ok(c) => c,
            Err(e) => {
                eprintln!("relay-sim: accept on {}: {e}", slot.local);
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        {
            let mut st = state.lock().unwrap();
            let live = st.streams.entry(port).or_default();
            if *live >= max {
                st.dial_denied += 1;
                st.refused += 1;
                drop(st);
                drop(conn); // "busy": close at once, no bytes
                continue;
            }
            *live += 1; // reserve the slot before dialing
        }
        let state = state.clone();
        std::thread::spawn(move || {
            run_stream(conn, slot.target, &state);
            let mut st = state.lock().unwrap();
            if let Some(live) = st.streams.get_mut(&port) {
                *live = live.saturating_sub(1);
            }
        });
    }
}

fn run_stream(downstream: TcpStream, target: SocketAddr, state: &Shared) {
    let upstream = match TcpStream::connect_timeout(&target, Duration::from_secs(5)) {
        Ok(u) => u,
        Err(e) => {
            eprintln!("relay-sim: dial {target}: {e}");
            state.lock().unwrap().refused += 1;
            return;
        }
    };
    state.lock().unwrap().streams_opened += 1;
    let (Ok(d2), Ok(u2)) = (downstream.try_clone(), upstream.try_clone()) else {
        let _ = downstream.shutdown(Shutdown::Both);
        let _ = upstream.shutdown(Shutdown::Both);
        return;
    };
    let other = std::thread::spawn(move || copy_then_close(&d2, &u2));
    copy_then_close(&upstream, &downstream);
    let _ = other.join();
}

/// Copies `from` -> `to` until EOF or an error on either side, then shuts down both sockets
/// (which also ends the copy running the other way).
fn copy_then_close(from: &TcpStream, to: &TcpStream) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        match (&*from).read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if (&*to).write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

fn status_loop(listener: TcpListener, slots: Vec<Slot>, state: Shared, max: u64) {
    let slots: Arc<[Slot]> = slots.into();
    for conn in listener.incoming() {
        let Ok(mut stream) = conn else {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        let (slots, state) = (slots.clone(), state.clone());
        std::thread::spawn(move || serve_status(&mut stream, &slots, &state, max));
    }
}

fn serve_status(stream: &mut TcpStream, slots: &[Slot], state: &Shared, max: u64) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let Ok(clone) = stream.try_clone() else {
        return;
    };
    let req = match read_request(&mut BufReader::new(clone)) {
        Ok(Some(r)) => r,
        _ => return,
    };
    if !(req.method.eq_ignore_ascii_case("GET") && req.path() == "/status") {
        let _ = write_response(stream, 404, "text/plain", b"not found");
        return;
    }
    let doc = {
        let st = state.lock().unwrap();
        let endpoints: Vec<serde_json::Value> = slots
            .iter()
            .map(|s| {
                serde_json::json!({
                    "port": s.target.port(),
                    "dialPort": s.local.port(),
                    "streams": st.streams.get(&s.target.port()).copied().unwrap_or(0),
                    "maxStreams": max,
                })
            })
            .collect();
        serde_json::json!({
            "endpoints": endpoints,
            "dialDenied": st.dial_denied,
            "refused": st.refused,
            "streamsOpened": st.streams_opened,
        })
    };
    let _ = write_json(stream, 200, &doc);
}
