//! Test helper for connreap's end-to-end tests: makes TCP sockets in known states, prints one
//! `ready key=value ...` line on stdout once they exist, then holds them until killed.
//!
//! Its comm is `connreap-testpe` (the kernel keeps 15 characters).
use std::{
    io::{Read, Write},
    net::{Ipv6Addr, SocketAddr, TcpListener, TcpStream},
    process::ExitCode,
    thread,
    time::{Duration, Instant},
};

use socket2::{Domain, Socket, Type};

const USAGE: &str = "\
usage: connreap-testpeer close-wait --addr IP:PORT --count N
       connreap-testpeer listen --addr IP:PORT [--chatty-ms M] [--close-after-ms M] [--keepalive]
       connreap-testpeer connect --addr IP:PORT --count N [--chatty-ms M] [--keepalive]
       connreap-testpeer storm --addr IP:PORT [--start-rate R] [--max-rate R] [--duration-ms D]
                         [--thread-name NAME]

close-wait  listen on ADDR, connect N clients, close the accepted side: N clients in CLOSE_WAIT
listen      accept and hold every connection on ADDR
connect     hold N connections to ADDR
storm       connect and close at once, in a loop: START-RATE connections/s (default 20),
            doubling every second up to MAX-RATE (default 320), for DURATION ms (default 10000);
            prints `done connects=N failed=F` afterwards and sleeps until killed; the
            connecting thread is named NAME when given (a thread pool's worker)
--chatty-ms write one byte every M ms on each connection and read whatever arrives
--close-after-ms  (listen) close each accepted connection M ms after accepting it, like a
            server's keep-alive timeout (0: at once)
--keepalive (listen) turn TCP keepalive on (SO_KEEPALIVE) for each accepted connection;
            (connect) for each connection, before it connects
--netns-file PATH  (close-wait, listen, connect) make the sockets inside the network
            namespace PATH (`/run/netns/NAME`, `/proc/PID/ns/net`): setns(2) into it, make
            them, setns(2) back to the namespace the process started in, then print `ready`
            (with `netns=INODE` of PATH's namespace and `home=INODE` of its own) and hold them
            from there

IPv6 addresses go in brackets ([::1]:7000). A v4-mapped address ([::ffff:127.0.0.1]:7000)
listens dual-stack on [::]:PORT and connects from AF_INET6 sockets, like a JVM.
Prints `ready ...` once the sockets exist, then sleeps until killed.";

struct Args {
    mode: String,
    addr: SocketAddr,
    count: usize,
    chatty: Option<Duration>,
    close_after: Option<Duration>,
    keepalive: bool,
    netns_file: Option<std::path::PathBuf>,
    storm: StormArgs,
}

/// `storm`: connections per second, doubling every second from `start_rate` to `max_rate`.
struct StormArgs {
    start_rate: u64,
    max_rate: u64,
    duration: Duration,
    /// The connecting thread's name (the kernel keeps 15 characters).
    thread_name: Option<String>,
}

fn parse_args(argv: &[String]) -> Result<Args, String> {
    let mode = argv.first().ok_or("missing subcommand")?.clone();
    if !["close-wait", "listen", "connect", "storm"].contains(&mode.as_str()) {
        return Err(format!("unknown subcommand `{mode}`"));
    }
    let (mut addr, mut count, mut chatty, mut close_after) = (None, None, None, None);
    let mut storm = StormArgs {
        start_rate: 20,
        max_rate: 320,
        duration: Duration::from_secs(10),
        thread_name: None,
    };
    let mut storm_flags = false;
    let mut keepalive = false;
    let mut netns_file = None;
    let mut rest = argv[1..].iter();
    while let Some(flag) = rest.next() {
        if flag == "--keepalive" {
            keepalive = true;
            continue;
        }
        let value = rest.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let bad = |e: &dyn std::fmt::Display| format!("invalid {flag} `{value}`: {e}");
        match flag.as_str() {
            "--addr" => addr = Some(value.parse::<SocketAddr>().map_err(|e| bad(&e))?),
            "--count" => count = Some(value.parse::<usize>().map_err(|e| bad(&e))?),
            "--chatty-ms" => {
                let ms = value.parse::<u64>().map_err(|e| bad(&e))?;
                if ms == 0 {
                    return Err(bad(&"must be at least 1"));
                }
                chatty = Some(Duration::from_millis(ms));
            }
            "--close-after-ms" => {
                let ms = value.parse::<u64>().map_err(|e| bad(&e))?;
                close_after = Some(Duration::from_millis(ms));
            }
            "--netns-file" => netns_file = Some(std::path::PathBuf::from(value)),
            "--thread-name" => {
                storm.thread_name = Some(value.clone());
                storm_flags = true;
            }
            "--start-rate" | "--max-rate" | "--duration-ms" => {
                let v = value.parse::<u64>().map_err(|e| bad(&e))?;
                if v == 0 {
                    return Err(bad(&"must be at least 1"));
                }
                match flag.as_str() {
                    "--start-rate" => storm.start_rate = v,
                    "--max-rate" => storm.max_rate = v,
                    _ => storm.duration = Duration::from_millis(v),
                }
                storm_flags = true;
            }
            _ => return Err(format!("unknown option `{flag}`")),
        }
    }
    let addr = addr.ok_or("--addr is required")?;
    let count = match (mode.as_str(), count) {
        ("listen" | "storm", None) => 0,
        ("listen" | "storm", Some(_)) => return Err(format!("{mode} takes no --count")),
        (_, Some(n)) if n > 0 => n,
        (_, _) => return Err(format!("{mode} needs --count N (N >= 1)")),
    };
    if mode == "close-wait" && chatty.is_some() {
        return Err("close-wait takes no --chatty-ms".into());
    }
    if mode == "storm" && chatty.is_some() {
        return Err("storm takes no --chatty-ms".into());
    }
    if mode != "listen" && close_after.is_some() {
        return Err("only listen takes --close-after-ms".into());
    }
    if !["listen", "connect"].contains(&mode.as_str()) && keepalive {
        return Err("only listen and connect take --keepalive".into());
    }
    if mode == "storm" && netns_file.is_some() {
        return Err("storm takes no --netns-file".into());
    }
    if mode != "storm" && storm_flags {
        return Err(
            "--start-rate, --max-rate, --duration-ms and --thread-name are for storm only".into(),
        );
    }
    if storm.max_rate < storm.start_rate {
        return Err("--max-rate must be at least --start-rate".into());
    }
    Ok(Args {
        mode,
        addr,
        count,
        chatty,
        close_after,
        keepalive,
        netns_file,
        storm,
    })
}

/// Listen on `addr`; a v4-mapped IPv6 address listens dual-stack on `[::]:PORT` instead.
fn listen(addr: SocketAddr) -> Result<TcpListener, String> {
    let mapped = matches!(addr, SocketAddr::V6(a) if a.ip().to_ipv4_mapped().is_some());
    let bind = if mapped {
        SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), addr.port())
    } else {
        addr
    };
    let fail = |e: std::io::Error| format!("cannot listen on {bind}: {e}");
    let sock = Socket::new(Domain::for_address(bind), Type::STREAM, None).map_err(fail)?;
    sock.set_reuse_address(true).map_err(fail)?;
    if mapped {
        sock.set_only_v6(false).map_err(fail)?;
    }
    sock.bind(&bind.into()).map_err(fail)?;
    // Room for a test's whole burst of connects: a full accept queue drops SYNs, and the
    // client's connect() then waits for a retransmit (1 s, 2 s, ...).
    sock.listen(4096).map_err(fail)?;
    Ok(sock.into())
}

/// The address clients dial: the listener's own port when `addr` asked for port 0.
fn dial_addr(addr: SocketAddr, listener: &TcpListener) -> Result<SocketAddr, String> {
    let port = listener
        .local_addr()
        .map_err(|e| format!("listener address: {e}"))?
        .port();
    Ok(SocketAddr::new(addr.ip(), port))
}

fn connect(addr: SocketAddr) -> Result<TcpStream, String> {
    TcpStream::connect(addr).map_err(|e| format!("cannot connect to {addr}: {e}"))
}

/// [`connect`], with TCP keepalive turned on before the handshake when `keepalive`.
fn connect_with(addr: SocketAddr, keepalive: bool) -> Result<TcpStream, String> {
    if !keepalive {
        return connect(addr);
    }
    let fail = |e: std::io::Error| format!("cannot connect to {addr}: {e}");
    let sock = Socket::new(Domain::for_address(addr), Type::STREAM, None).map_err(fail)?;
    sock.set_keepalive(true).map_err(fail)?;
    sock.connect(&addr.into()).map_err(fail)?;
    Ok(sock.into())
}

/// Where `--netns-file` took the process: back to `home` (its own namespace) once the
/// sockets exist.
struct Away {
    home: std::fs::File,
    /// Inodes of the namespace entered and of the process's own.
    there: u64,
    home_inode: u64,
}

fn setns(f: &std::fs::File, what: &str) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    // SAFETY: setns(2) on an open namespace fd; it changes only the calling thread's network
    // namespace, and sockets keep the namespace they were made in.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } == 0 {
        Ok(())
    } else {
        Err(format!(
            "setns({what}): {}",
            std::io::Error::last_os_error()
        ))
    }
}

/// Enters the namespace at `path` (when given), remembering the way back.
fn go_away(path: Option<&std::path::Path>) -> Result<Option<Away>, String> {
    use std::os::unix::fs::MetadataExt;
    let Some(path) = path else { return Ok(None) };
    let own = "/proc/thread-self/ns/net";
    let home = std::fs::File::open(own).map_err(|e| format!("open {own}: {e}"))?;
    let target = std::fs::File::open(path).map_err(|e| format!("open {}: {e}", path.display()))?;
    let ino = |f: &std::fs::File, what: &str| {
        f.metadata()
            .map(|m| m.ino())
            .map_err(|e| format!("fstat {what}: {e}"))
    };
    let away = Away {
        there: ino(&target, &path.display().to_string())?,
        home_inode: ino(&home, own)?,
        home,
    };
    setns(&target, &path.display().to_string())?;
    Ok(Some(away))
}

/// Back home (when away); the `ready` fields saying where the sockets are.
fn come_back(away: Option<Away>) -> Result<Vec<(&'static str, String)>, String> {
    let Some(away) = away else {
        return Ok(Vec::new());
    };
    setns(&away.home, "the process's own namespace")?;
    Ok(vec![
        ("netns", away.there.to_string()),
        ("home", away.home_inode.to_string()),
    ])
}

/// Keep `conn` open forever; when chatty, write a byte every `every` and read what arrives.
/// Errors (peer gone) stop the traffic, never the hold: the socket stays in whatever state.
fn hold(conn: TcpStream, chatty: Option<Duration>) {
    let Some(every) = chatty else {
        thread::spawn(move || sleep_forever(conn));
        return;
    };
    if let Ok(mut reader) = conn.try_clone() {
        thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while matches!(reader.read(&mut buf), Ok(n) if n > 0) {}
            sleep_forever(reader)
        });
    }
    thread::spawn(move || {
        let mut writer = conn;
        while writer.write_all(b".").is_ok() {
            thread::sleep(every);
        }
        sleep_forever(writer)
    });
}

fn sleep_forever<T>(_keep: T) -> ! {
    loop {
        thread::sleep(Duration::from_secs(3600));
    }
}

fn ready(fields: &[(&str, String)]) {
    let line: Vec<String> = fields.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let mut out = std::io::stdout().lock();
    // A closed stdout only means nobody waits for us: keep the sockets anyway.
    let _ = writeln!(out, "ready {}", line.join(" "));
    let _ = out.flush();
}

fn local_addrs(conns: &[TcpStream]) -> String {
    conns
        .iter()
        .map(|c| c.local_addr().map(|a| a.to_string()).unwrap_or_default())
        .collect::<Vec<_>>()
        .join(",")
}

fn close_wait(args: &Args) -> Result<(), String> {
    let away = go_away(args.netns_file.as_deref())?;
    let listener = listen(args.addr)?;
    let target = dial_addr(args.addr, &listener)?;
    let clients = (0..args.count)
        .map(|_| connect(target))
        .collect::<Result<Vec<_>, _>>()?;
    for _ in 0..args.count {
        let (accepted, _) = listener.accept().map_err(|e| format!("accept: {e}"))?;
        drop(accepted); // FIN to the client: it enters CLOSE_WAIT.
    }
    // A client read returns end-of-file once the FIN has arrived, i.e. once it is in CLOSE_WAIT.
    for c in &clients {
        c.set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(|e| format!("set_read_timeout: {e}"))?;
        match (&*c).read(&mut [0u8; 1]) {
            Ok(0) => {}
            Ok(_) => return Err("client received data instead of a FIN".into()),
            Err(e) => return Err(format!("waiting for the FIN: {e}")),
        }
    }
    let mut fields = vec![
        ("port", target.port().to_string()),
        ("count", clients.len().to_string()),
        ("locals", local_addrs(&clients)),
    ];
    fields.extend(come_back(away)?);
    ready(&fields);
    sleep_forever((listener, clients))
}

fn listen_and_hold(args: &Args) -> Result<(), String> {
    let away = go_away(args.netns_file.as_deref())?;
    let listener = listen(args.addr)?;
    let port = dial_addr(args.addr, &listener)?.port();
    let mut fields = vec![("port", port.to_string())];
    fields.extend(come_back(away)?);
    ready(&fields);
    loop {
        let accepted = listener.accept().and_then(|(conn, peer)| {
            if args.keepalive {
                socket2::SockRef::from(&conn).set_keepalive(true)?;
            }
            Ok((conn, peer))
        });
        match accepted {
            Ok((conn, _)) if args.close_after == Some(Duration::ZERO) => drop(conn),
            Ok((conn, _)) => match args.close_after {
                // The server side of an idle keep-alive timing out: close (FIN) after a while,
                // whatever the client does.
                Some(after) => {
                    thread::spawn(move || {
                        thread::sleep(after);
                        drop(conn);
                    });
                }
                None => hold(conn, args.chatty),
            },
            Err(e) => {
                eprintln!("connreap-testpeer: accept: {e}");
                thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

fn connect_and_hold(args: &Args) -> Result<(), String> {
    let away = go_away(args.netns_file.as_deref())?;
    let clients = (0..args.count)
        .map(|_| connect_with(args.addr, args.keepalive))
        .collect::<Result<Vec<_>, _>>()?;
    let mut fields = vec![
        ("port", args.addr.port().to_string()),
        ("count", clients.len().to_string()),
        ("locals", local_addrs(&clients)),
    ];
    fields.extend(come_back(away)?);
    ready(&fields);
    for c in clients {
        hold(c, args.chatty);
    }
    sleep_forever(())
}

/// Connect and close at once, in a loop, at a rate that doubles every second (a client whose
/// reconnect handlers multiply). Connection errors are counted, never fatal.
fn storm(args: &Args) -> Result<(), String> {
    let StormArgs {
        start_rate,
        max_rate,
        duration,
        ref thread_name,
    } = args.storm;
    ready(&[
        ("port", args.addr.port().to_string()),
        ("start_rate", start_rate.to_string()),
        ("max_rate", max_rate.to_string()),
    ]);
    let target = args.addr;
    // From a second thread (whose id is not the pid), like the thread pools of real clients:
    // the storm must be charged to the process, under the process's name.
    let mut builder = thread::Builder::new();
    if let Some(name) = thread_name {
        builder = builder.name(name.clone());
    }
    let (connects, failed) = builder
        .spawn(move || storm_loop(target, start_rate, max_rate, duration))
        .map_err(|e| format!("cannot start the storm thread: {e}"))?
        .join()
        .map_err(|_| "the storm thread panicked".to_string())?;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "done connects={connects} failed={failed}");
    let _ = out.flush();
    drop(out);
    sleep_forever(())
}

fn storm_loop(addr: SocketAddr, start_rate: u64, max_rate: u64, duration: Duration) -> (u64, u64) {
    let start = Instant::now();
    let (mut connects, mut failed) = (0u64, 0u64);
    let mut next = start;
    while start.elapsed() < duration {
        let second = start.elapsed().as_secs().min(32) as u32;
        let rate = start_rate.saturating_mul(1u64 << second).min(max_rate);
        match TcpStream::connect(addr) {
            Ok(c) => {
                connects += 1;
                drop(c);
            }
            Err(e) => {
                failed += 1;
                if failed <= 3 {
                    eprintln!("connreap-testpeer storm: connect {addr}: {e}");
                }
            }
        }
        next += Duration::from_secs_f64(1.0 / rate as f64);
        let now = Instant::now();
        if next > now {
            thread::sleep(next - now);
        } else if now - next > Duration::from_millis(500) {
            next = now; // fell far behind (loaded machine): do not burst to catch up
        }
    }
    (connects, failed)
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let args = match parse_args(&argv) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("connreap-testpeer: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let result = match args.mode.as_str() {
        "close-wait" => close_wait(&args),
        "listen" => listen_and_hold(&args),
        "storm" => storm(&args),
        _ => connect_and_hold(&args),
    };
    if let Err(e) = result {
        eprintln!("connreap-testpeer {}: {e}", args.mode);
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
