//! Child processes of the bench: guards that stop them, timed runs with their CPU times, and
//! /proc readers for the daemon's memory and CPU.
use std::{
    io::Read as _,
    process::{Child, Command, ExitStatus, Stdio},
    sync::{Arc, Mutex},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use crate::sys::{check_interrupted, interrupted};
/// A child process: SIGTERM, then SIGKILL after 5 s, and reaped on drop.
pub struct Proc {
    pub what: String,
    pub child: Child,
}

impl Proc {
    pub fn spawn(cmd: &mut Command, what: &str) -> Result<Proc> {
        let child = cmd
            .spawn()
            .with_context(|| format!("cannot start {what}: {cmd:?}"))?;
        Ok(Proc {
            what: what.to_string(),
            child,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Fails when the process has exited.
    pub fn check_alive(&mut self) -> Result<()> {
        if let Some(st) = self.child.try_wait()? {
            bail!("{} exited early: {st}", self.what);
        }
        Ok(())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // SAFETY: signalling our own unreaped child.
            unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
            let end = Instant::now() + Duration::from_secs(5);
            while Instant::now() < end {
                if !matches!(self.child.try_wait(), Ok(None)) {
                    return;
                }
                thread::sleep(Duration::from_millis(20));
            }
            eprintln!("bench: {} ignored SIGTERM; killing it", self.what);
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// Wall and CPU time of one finished command.
#[derive(Clone, Copy, Debug)]
pub struct Timed {
    pub wall: Duration,
    pub user: Duration,
    pub sys: Duration,
}

impl Timed {
    /// The run with the median wall time.
    pub fn median(mut v: Vec<Timed>) -> Timed {
        v.sort_by_key(|t| t.wall);
        v[v.len() / 2]
    }

    /// "wall (user u, sys s)".
    pub fn show(&self) -> String {
        format!(
            "{} (user {}, sys {})",
            crate::report::ms(self.wall),
            crate::report::ms(self.user),
            crate::report::ms(self.sys)
        )
    }
}

fn tv(t: libc::timeval) -> Duration {
    Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
}

/// Run `cmd` (stdin and stdout to /dev/null) and time it: wall clock from spawn to exit, and its
/// CPU times from wait4. Killed after `timeout` or on Ctrl-C.
pub fn timed(cmd: &mut Command, timeout: Duration) -> Result<Timed> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let t0 = Instant::now();
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start {cmd:?}"))?;
    let pid = child.id() as i32;
    let mut stderr = child.stderr.take().context("piped stderr")?;
    let err = thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let exited = Arc::new(Mutex::new(false));
    let watchdog = {
        let exited = exited.clone();
        thread::spawn(move || loop {
            thread::sleep(Duration::from_millis(20));
            let done = exited.lock().unwrap_or_else(|e| e.into_inner());
            if *done {
                return false;
            }
            if t0.elapsed() > timeout || interrupted() {
                // SAFETY: the child is not reaped yet (we hold the lock that reaping waits for).
                unsafe { libc::kill(pid, libc::SIGKILL) };
                return true;
            }
        })
    };
    // Wait for exit without reaping, so the watchdog can never signal a recycled pid.
    // SAFETY: waitid on our own child with a zeroed siginfo.
    let rc = unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        libc::waitid(
            libc::P_PID,
            pid as u32,
            &mut info,
            libc::WEXITED | libc::WNOWAIT,
        )
    };
    let wall = t0.elapsed();
    *exited.lock().unwrap_or_else(|e| e.into_inner()) = true;
    if rc != 0 {
        bail!("waitid: {}", std::io::Error::last_os_error());
    }
    let mut status = 0;
    // SAFETY: reaping our exited child; rusage is plain data.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: reaping our own exited child into a valid status and rusage.
    if unsafe { libc::wait4(pid, &mut status, 0, &mut ru) } != pid {
        bail!("wait4: {}", std::io::Error::last_os_error());
    }
    let killed = watchdog.join().unwrap_or(false);
    let stderr = err.join().unwrap_or_default();
    check_interrupted()?;
    if killed {
        bail!("{cmd:?} killed after {timeout:?}");
    }
    let st = <ExitStatus as std::os::unix::process::ExitStatusExt>::from_raw(status);
    if !st.success() {
        bail!("{cmd:?} failed ({st}): {}", stderr.trim());
    }
    Ok(Timed {
        wall,
        user: tv(ru.ru_utime),
        sys: tv(ru.ru_stime),
    })
}

/// `/proc/PID/status` field in kB (VmRSS, VmHWM).
pub fn status_kb(pid: u32, field: &str) -> Result<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    s.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .with_context(|| format!("no {field} in /proc/{pid}/status"))
}

/// (utime, stime) of a process from /proc/PID/stat.
pub fn cpu_times(pid: u32) -> Result<(Duration, Duration)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the parenthesised comm; utime and stime are fields 14 and 15.
    let rest = s.rsplit_once(')').context("bad /proc/PID/stat")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let tick = |i: usize| -> Result<Duration> {
        let v: f64 = f.get(i).context("short /proc/PID/stat")?.parse()?;
        Ok(Duration::from_secs_f64(v / hz))
    };
    Ok((tick(11)?, tick(12)?))
}

/// Resident memory of a process by kind, in kB, from /proc/PID/smaps: (anonymous: heap,
/// stacks, allocator arenas; BPF maps mmapped by the process, e.g. a ring buffer; files:
/// the binary and libraries).
pub fn rss_by_kind(pid: u32) -> Result<(u64, u64, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/smaps"))?;
    let (mut anon, mut bpf, mut file) = (0, 0, 0);
    let mut kind = 0;
    for l in s.lines() {
        if let Some(kb) = l.strip_prefix("Rss:") {
            let kb: u64 = kb.trim().trim_end_matches("kB").trim().parse().unwrap_or(0);
            match kind {
                1 => bpf += kb,
                2 => file += kb,
                _ => anon += kb,
            }
        } else if l
            .split_whitespace()
            .next()
            .is_some_and(|a| a.contains('-') && !a.ends_with(':'))
        {
            let name = l.split_whitespace().nth(5).unwrap_or("");
            kind = if name.contains("bpf") {
                1
            } else if name.starts_with('/') {
                2
            } else {
                0
            };
        }
    }
    Ok((anon, bpf, file))
}
