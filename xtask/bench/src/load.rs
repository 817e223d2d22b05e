//! The loads: socket holders (a hidden `cargo xtask bench-worker holder` re-executed in a
//! namespace), the loopback connect/accept/send/close churn, and CLOSE_WAIT groups.
use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream},
    process::{ChildStdin, Stdio},
    sync::{mpsc, Arc, Barrier},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use socket2::{Domain, Socket, Type};

use crate::{
    proc::Proc,
    sys::{self, NsHandle},
};

#[derive(clap::Args)]
pub struct WorkerArgs {
    #[command(subcommand)]
    cmd: WorkerCmd,
}

#[derive(clap::Subcommand)]
enum WorkerCmd {
    /// Open CONNS loopback connections to a listener on LISTEN (both ends held here), print
    /// `ready N`, hold them until stdin closes, then reset them and exit.
    Holder {
        #[arg(long)]
        listen: Ipv4Addr,
        #[arg(long)]
        conns: usize,
    },
    /// Run the churn load of measures 1 and 2 in this process's namespace for SECS seconds and
    /// print `conns N secs S` (to study the tracker and daemon by hand, e.g. under perf).
    Churn {
        #[arg(long, default_value_t = 2)]
        workers: u8,
        #[arg(long)]
        secs: u64,
    },
}

pub fn worker(args: WorkerArgs) -> Result<()> {
    match args.cmd {
        WorkerCmd::Holder { listen, conns } => holder(listen, conns),
        WorkerCmd::Churn { workers, secs } => {
            let c = churn(&NsHandle::current()?, workers, Duration::from_secs(secs))?;
            println!("conns {} secs {:.3}", c.conns, c.elapsed.as_secs_f64());
            Ok(())
        }
    }
}

/// Raise the soft open-files limit to the hard one (the hard one cannot be raised here).
pub(super) fn raise_nofile() -> Result<u64> {
    // SAFETY: getrlimit/setrlimit with a valid struct.
    unsafe {
        let mut lim: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            bail!("getrlimit: {}", std::io::Error::last_os_error());
        }
        lim.rlim_cur = lim.rlim_max;
        if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
            bail!("setrlimit: {}", std::io::Error::last_os_error());
        }
        Ok(lim.rlim_cur)
    }
}

fn holder(listen: Ipv4Addr, conns: usize) -> Result<()> {
    let limit = raise_nofile()?;
    if (2 * conns + 16) as u64 > limit {
        bail!(
            "{conns} connections need {} fds; the limit is {limit}",
            2 * conns + 16
        );
    }
    let l = TcpListener::bind((listen, 0)).with_context(|| format!("bind {listen}"))?;
    let addr = l.local_addr()?;
    let mut socks = Vec::with_capacity(2 * conns);
    for i in 0..conns {
        let c = TcpStream::connect(addr).with_context(|| format!("connect #{i} to {addr}"))?;
        let (s, _) = l.accept()?;
        socks.push(c);
        socks.push(s);
    }
    println!("ready {}", socks.len());
    std::io::stdout().flush()?;
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    // Reset instead of FIN: no TIME_WAIT pile-up and a fast exit.
    for s in &socks {
        let _ = socket2::SockRef::from(s).set_linger(Some(Duration::ZERO));
    }
    Ok(())
}

/// Holder processes inside a namespace; they exit (resetting their sockets) on drop.
pub struct Holders {
    procs: Vec<(Proc, Option<ChildStdin>)>,
    pub sockets: usize,
}

impl Holders {
    /// `per.len()` holders, holder i with `per[i]` connections (2 sockets each) to a listener
    /// on 127.0.(i+1).1 (127.1.0.1 and on past the 255th).
    pub fn start(ns: &NsHandle, per: &[usize]) -> Result<Holders> {
        let exe = std::env::current_exe()?;
        let mut h = Holders {
            procs: Vec::new(),
            sockets: 0,
        };
        let mut ready = Vec::new();
        for (i, n) in per.iter().enumerate() {
            let mut cmd = ns.command(&exe);
            cmd.args(["bench-worker", "holder", "--listen"])
                .arg(format!("127.{}.{}.1", (i + 1) / 256, (i + 1) % 256))
                .args(["--conns", &n.to_string()])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit());
            let mut p = Proc::spawn(&mut cmd, &format!("holder {i}"))?;
            let stdin = p.child.stdin.take();
            let stdout = p.child.stdout.take().context("holder stdout")?;
            let (tx, rx) = mpsc::channel();
            std::thread::spawn(move || {
                let mut line = String::new();
                let _ = BufReader::new(stdout).read_line(&mut line);
                let _ = tx.send(line);
            });
            ready.push(rx);
            h.procs.push((p, stdin));
        }
        for (i, rx) in ready.iter().enumerate() {
            let line = sys::wait_for(
                "holders",
                Duration::from_secs(120),
                Duration::from_millis(100),
                || Ok(rx.try_recv().ok()),
            )?;
            let n: usize = line
                .trim()
                .strip_prefix("ready ")
                .and_then(|n| n.parse().ok())
                .with_context(|| format!("holder {i} failed (said {line:?})"))?;
            h.sockets += n;
        }
        Ok(h)
    }
}

impl Drop for Holders {
    fn drop(&mut self) {
        for (_, stdin) in &mut self.procs {
            stdin.take();
        }
        // Proc's drop waits for each to exit (SIGTERM/SIGKILL if they hang).
        self.procs.clear();
    }
}

/// Result of one churn round.
#[derive(Clone, Copy, Debug)]
pub struct Churn {
    pub conns: u64,
    pub elapsed: Duration,
}

impl Churn {
    pub fn rate(&self) -> f64 {
        self.conns as f64 / self.elapsed.as_secs_f64()
    }
}

const IP_BIND_ADDRESS_NO_PORT: libc::c_int = 24;
const SOURCES: u8 = 64;

fn connect_from(src: Ipv4Addr, dst: SocketAddr) -> Result<TcpStream> {
    let s = Socket::new(Domain::IPV4, Type::STREAM, None)?;
    let one: libc::c_int = 1;
    // SAFETY: setsockopt with a valid int option on our socket.
    unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&s),
            libc::IPPROTO_IP,
            IP_BIND_ADDRESS_NO_PORT,
            &one as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as u32,
        )
    };
    s.bind(&SocketAddrV4::new(src, 0).into())?;
    s.connect(&dst.into())?;
    Ok(s.into())
}

/// `workers` threads in `ns`, each running connect / accept / send 64 B / server close / client
/// close as fast as it can for `dur`. The server closes first, so TIME_WAIT stays on the
/// server side; clients rotate over 64 source addresses, so ephemeral ports never run out.
pub fn churn(ns: &NsHandle, workers: u8, dur: Duration) -> Result<Churn> {
    let barrier = Arc::new(Barrier::new(workers as usize + 1));
    let mut threads = Vec::new();
    for w in 0..workers {
        let barrier = barrier.clone();
        let ns = ns.clone();
        threads.push(std::thread::spawn(move || {
            let l = ns
                .enter()
                .and_then(|()| Ok(TcpListener::bind((Ipv4Addr::new(127, 0, 0, 20 + w), 0))?));
            // Every worker passes the barrier, even when its bind failed, so none waits forever.
            barrier.wait();
            let l = l?;
            let dst = l.local_addr()?;
            let buf = [7u8; 64];
            let mut rbuf = [0u8; 64];
            let mut n = 0u64;
            let t0 = Instant::now();
            loop {
                let src = Ipv4Addr::new(127, 0, 100 + w, 1 + (n % SOURCES as u64) as u8);
                let mut c = connect_from(src, dst).with_context(|| format!("connect {dst}"))?;
                let (mut s, _) = l.accept()?;
                c.write_all(&buf)?;
                s.read_exact(&mut rbuf)?;
                drop(s);
                if c.read(&mut rbuf)? != 0 {
                    bail!("churn: expected EOF");
                }
                drop(c);
                n += 1;
                if n.is_multiple_of(64) && t0.elapsed() >= dur {
                    return Ok(Churn {
                        conns: n,
                        elapsed: t0.elapsed(),
                    });
                }
            }
        }));
    }
    barrier.wait();
    let mut total = Churn {
        conns: 0,
        elapsed: Duration::ZERO,
    };
    for t in threads {
        let r = t
            .join()
            .map_err(|_| anyhow::anyhow!("churn thread panicked"))??;
        total.conns += r.conns;
        total.elapsed = total.elapsed.max(r.elapsed);
    }
    Ok(total)
}

/// `n` loopback connections to a listener on `port` (below the ephemeral range, like a real
/// service) whose client ends are in CLOSE_WAIT once [`CloseWait::close_peers`] runs. Owned by
/// this process; service port = `port`. The listener stays open, as a server's would.
pub struct CloseWait {
    pub port: u16,
    _listener: TcpListener,
    /// Held open: these are the CLOSE_WAIT sockets.
    _clients: Vec<TcpStream>,
    servers: Vec<TcpStream>,
}

impl CloseWait {
    pub fn open(ns: &NsHandle, n: usize, port: u16) -> Result<CloseWait> {
        ns.run(move || {
            let l = TcpListener::bind((Ipv4Addr::LOCALHOST, port))
                .with_context(|| format!("listen on 127.0.0.1:{port}"))?;
            let (mut clients, mut servers) = (Vec::new(), Vec::new());
            for _ in 0..n {
                clients.push(TcpStream::connect((Ipv4Addr::LOCALHOST, port))?);
                servers.push(l.accept()?.0);
            }
            Ok(CloseWait {
                port,
                _listener: l,
                _clients: clients,
                servers,
            })
        })
    }

    /// Close the server ends: the client ends enter CLOSE_WAIT (synchronously on loopback).
    pub fn close_peers(&mut self) {
        self.servers.clear();
    }
}

/// (TIME_WAIT sockets, tcp_max_tw_buckets) of a namespace.
pub fn time_wait(ns: &NsHandle) -> Result<(u64, u64)> {
    ns.run(|| {
        let stat = std::fs::read_to_string("/proc/thread-self/net/sockstat")?;
        let tw = stat
            .lines()
            .find_map(|l| l.strip_prefix("TCP: "))
            .and_then(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.windows(2)
                    .find(|w| w[0] == "tw")
                    .and_then(|w| w[1].parse().ok())
            })
            .context("no TCP tw in sockstat")?;
        let max = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_max_tw_buckets")?
            .trim()
            .parse()?;
        Ok((tw, max))
    })
}

/// Churn until the namespace's TIME_WAIT population reaches its cap (at most `max`), so that
/// measured rounds run in the steady state of a busy server rather than while it fills up.
pub fn warm_up(ns: &NsHandle, workers: u8, max: Duration) -> Result<(u64, u64)> {
    let end = Instant::now() + max;
    loop {
        churn(ns, workers, Duration::from_secs(1))?;
        let (tw, max) = time_wait(ns)?;
        if tw * 100 >= max * 95 || Instant::now() > end {
            return Ok((tw, max));
        }
    }
}
