//! The audit log: one JSON line per decision, only ever appended to, rotated by size. Kill
//! intents are written and fsynced before the kill (write-ahead), so a kill never happens
//! without a durable line saying so. The file is always a sequence of whole JSON lines: a
//! failed write is truncated back to where it began (under an flock, so no other appender's
//! line is cut), and at first use a torn tail is cut off and every kill intent left without an
//! outcome gets one (`failed`, "not executed: the daemon stopped").
use std::{
    collections::HashMap,
    fs::{self, OpenOptions},
    io::{BufReader, Seek, Write},
    path::PathBuf,
};

use super::{
    audit_repair::{self, Intents},
    Decision, Outcome,
};
use crate::flock::Exclusive;

/// A socket as audit lines name it: local and peer address, inode.
type SocketId = (String, String, u64);

/// What a decision said about a socket: its result and reason.
type Verdict = (Outcome, Option<String>);

/// Rounds a remembered skip/would-kill survives without being decided again.
const FORGET_AFTER: u64 = 10;

fn socket_id(d: &Decision) -> SocketId {
    (d.local.clone(), d.peer.clone(), d.inode)
}

pub struct AuditLog {
    path: PathBuf,
    /// Rotate when the file would grow past this (0: never).
    max_bytes: u64,
    /// Rotated files kept (`audit.jsonl.1` newest ... `.N` oldest).
    keep: usize,
    /// The last skip/would-kill line written per (policy, socket): repeated ones are not
    /// written again while nothing about them changes.
    last: HashMap<(String, SocketId), (Verdict, u64)>,
    /// Rounds seen per policy (the clock of `last`).
    policy_rounds: HashMap<String, u64>,
    /// Whether the file was repaired (torn tail, intents without outcome) by this process.
    repaired: bool,
}

/// What [`AuditLog::repair`] did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Repair {
    /// Bytes of a torn last line cut off.
    pub torn_bytes: u64,
    /// Outcome lines written for kill intents that had none.
    pub outcomes: usize,
}

/// Why an audit write failed (the path is in the message).
#[derive(Debug, thiserror::Error)]
#[error("audit log {path}: {error}")]
pub struct AuditError {
    path: String,
    error: std::io::Error,
}

impl AuditLog {
    pub fn new(path: PathBuf, max_bytes: u64, keep: usize) -> AuditLog {
        AuditLog {
            path,
            max_bytes,
            keep,
            last: HashMap::new(),
            policy_rounds: HashMap::new(),
            repaired: false,
        }
    }

    /// Repair the file once per process, before its first use: cut a torn last line off and
    /// write a `failed` outcome ("not executed: the daemon stopped") for every kill intent
    /// without one (except a running connreap's), fsynced. Both are logged (WARN). A missing
    /// file needs nothing. On error it is tried again at the next use, which fails until then.
    pub fn repair(&mut self) -> Result<Repair, AuditError> {
        if self.repaired {
            return Ok(Repair::default());
        }
        let f = match OpenOptions::new().read(true).write(true).open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.repaired = true;
                return Ok(Repair::default());
            }
            Err(e) => return Err(self.error(e)),
        };
        let _locked = Exclusive::lock(&f).map_err(|e| self.error(e))?;
        let mut intents = Intents::default();
        let rotated = PathBuf::from(format!("{}.1", self.path.display()));
        if let Ok(old) = fs::File::open(&rotated) {
            // An intent written before a rotation may have its outcome in the current file.
            let _ = audit_repair::read(&mut BufReader::new(old), &mut intents);
        }
        let len = f.metadata().map_err(|e| self.error(e))?.len();
        let keep =
            audit_repair::read(&mut BufReader::new(&f), &mut intents).map_err(|e| self.error(e))?;
        let mut done = Repair::default();
        if keep < len {
            f.set_len(keep)
                .and_then(|()| f.sync_data())
                .map_err(|e| self.error(e))?;
            done.torn_bytes = len - keep;
            tracing::warn!(file = %self.path.display(), bytes_removed = done.torn_bytes,
                "audit log: cut off a torn last line (a write cut short before this start)");
        }
        let time = crate::present::rfc3339(chrono::Utc::now());
        let outcomes = intents.outcomes(&time, audit_repair::other_connreap);
        if !outcomes.is_empty() {
            self.write_locked(&f, &lines(&outcomes).map_err(|e| self.error(e))?, true)?;
            done.outcomes = outcomes.len();
            tracing::warn!(file = %self.path.display(), intents = done.outcomes,
                reason = audit_repair::NOT_EXECUTED,
                "audit log: kill intents without an outcome line: written as failed");
        }
        self.repaired = true;
        Ok(done)
    }

    fn error(&self, error: std::io::Error) -> AuditError {
        AuditError {
            path: self.path.display().to_string(),
            error,
        }
    }

    /// Whether the file can be opened for appending (a cheap pre-check; the write itself is
    /// what counts, since opening succeeds on a full disk).
    pub fn check(&mut self) -> Result<(), AuditError> {
        self.open().map(drop).map_err(|e| self.error(e))?;
        self.repair().map(drop)
    }

    fn open(&self) -> std::io::Result<fs::File> {
        if let Some(dir) = self.path.parent() {
            fs::create_dir_all(dir)?;
        }
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
    }

    /// Append `decisions` in one write(2) (a line and its newline in separate writes could be
    /// spliced by another appender or cut by a crash); with `durable`, fsync before returning.
    /// A failed or short write is an error, the file is truncated back to its length before the
    /// write, and the caller must not act on these lines.
    pub fn append<T: serde::Serialize>(
        &mut self,
        decisions: &[T],
        durable: bool,
    ) -> Result<(), AuditError> {
        let buf = lines(decisions).map_err(|e| self.error(e))?;
        if buf.is_empty() {
            return Ok(());
        }
        self.repair()?;
        self.rotate_for(buf.len() as u64)
            .map_err(|e| self.error(e))?;
        let f = self.open().map_err(|e| self.error(e))?;
        let _locked = Exclusive::lock(&f).map_err(|e| self.error(e))?;
        self.write_locked(&f, &buf, durable)
    }

    /// Write `buf` at the end of `f` (locked by the caller); on any failure truncate `f` back to
    /// its length before the write, so the file is as it was.
    fn write_locked(&self, mut f: &fs::File, buf: &[u8], durable: bool) -> Result<(), AuditError> {
        let before = f
            .seek(std::io::SeekFrom::End(0))
            .map_err(|e| self.error(e))?;
        let written = f
            .write_all(buf)
            .and_then(|()| if durable { f.sync_data() } else { f.flush() });
        if let Err(e) = written {
            if let Err(t) = f.set_len(before).and_then(|()| f.sync_data()) {
                tracing::error!(file = %self.path.display(), length = before, error = %t,
                    "audit log: cannot truncate a failed write back");
            }
            return Err(self.error(e));
        }
        Ok(())
    }

    /// A socket whose kill intent was just written: its outcome line is always written (never
    /// taken as a repeat of an earlier skip).
    pub fn intended(&mut self, policy: &str, intents: &[Decision]) {
        for d in intents {
            self.last.remove(&(policy.to_string(), socket_id(d)));
        }
    }

    /// Drop skip/would-kill decisions identical to the last one written for the same policy
    /// and socket. A socket a round does not mention (another one took its place among the
    /// oldest, or it closed) is remembered for FORGET_AFTER more rounds of its policy, so one
    /// that drifts in and out of a round's selection is not written again each time.
    pub fn dedupe(&mut self, policy: &str, decisions: &[Decision]) -> Vec<Decision> {
        let round = {
            let r = self.policy_rounds.entry(policy.to_string()).or_default();
            *r += 1;
            *r
        };
        let mut out = Vec::with_capacity(decisions.len());
        for d in decisions {
            let key = (policy.to_string(), socket_id(d));
            let repeatable = matches!(d.result, Outcome::Skipped | Outcome::WouldKill);
            let what = (d.result, d.reason.clone());
            match self.last.get_mut(&key) {
                Some(last) if repeatable && last.0 == what => {
                    last.1 = round;
                    continue;
                }
                _ if repeatable => {
                    self.last.insert(key, (what, round));
                }
                _ => {
                    self.last.remove(&key);
                }
            }
            out.push(d.clone());
        }
        self.last
            .retain(|(p, _), (_, seen)| p != policy || round - *seen <= FORGET_AFTER);
        out
    }

    /// Forget what was written for `policy`: its lines could not be written, so the next
    /// round writes every decision again instead of taking the lost ones as written.
    pub fn forget(&mut self, policy: &str) {
        self.last.retain(|(p, _), _| p != policy);
    }

    /// Rotate first if appending `extra` bytes would pass `max_bytes`.
    fn rotate_for(&self, extra: u64) -> std::io::Result<()> {
        if self.max_bytes == 0 {
            return Ok(());
        }
        let len = match fs::metadata(&self.path) {
            Ok(m) => m.len(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        if len == 0 || len + extra <= self.max_bytes {
            return Ok(());
        }
        let numbered = |n: usize| PathBuf::from(format!("{}.{n}", self.path.display()));
        if self.keep == 0 {
            return fs::remove_file(&self.path);
        }
        let _ = fs::remove_file(numbered(self.keep));
        for n in (1..self.keep).rev() {
            match fs::rename(numbered(n), numbered(n + 1)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        fs::rename(&self.path, numbered(1))
    }
}

/// `items` as JSON lines.
fn lines<T: serde::Serialize>(items: &[T]) -> std::io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    for d in items {
        serde_json::to_writer(&mut buf, d)?;
        buf.push(b'\n');
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::{config::parse, detect::testutil::sock, reclaim::Mode, table::TcpState};

    fn decisions(n: u16, result: Outcome) -> Vec<Decision> {
        let c = parse(
            "[[policy]]\nname = \"p\"\ntrigger = \"always\"\nselect = { comm = \"node\" }\n",
            "t",
        )
        .unwrap();
        (0..n)
            .map(|i| {
                let s = sock(
                    10,
                    "node",
                    &format!("127.0.0.1:{}", 40000 + i),
                    "127.0.0.1:25001",
                    TcpState::Established,
                );
                super::super::decision(&c.policy[0], &Mode::DryRun, &s, &None, result, None, 1)
            })
            .collect()
    }

    #[test]
    fn repeated_skips_are_written_once_and_again_after_a_change() {
        let mut log = AuditLog::new(PathBuf::from("/nonexistent"), 0, 0);
        let d = decisions(3, Outcome::WouldKill);
        assert_eq!(log.dedupe("p", &d).len(), 3);
        assert_eq!(log.dedupe("p", &d).len(), 0, "same decisions again");
        let mut changed = d.clone();
        changed[1].result = Outcome::Skipped;
        assert_eq!(log.dedupe("p", &changed).len(), 1);
        // A socket left out of a few rounds is still remembered...
        assert_eq!(log.dedupe("p", &d[..1]).len(), 0);
        assert_eq!(log.dedupe("p", &changed).len(), 0);
        // ... and forgotten after FORGET_AFTER rounds without it: new again afterwards.
        for _ in 0..=FORGET_AFTER {
            assert_eq!(log.dedupe("p", &d[..1]).len(), 0);
        }
        assert_eq!(log.dedupe("p", &d).len(), 2);
        // Lines that could not be written are not taken as written.
        log.forget("p");
        assert_eq!(log.dedupe("p", &d).len(), 3);
        // Kills are never deduplicated.
        let k = decisions(1, Outcome::Killed);
        assert_eq!(log.dedupe("p", &k).len(), 1);
        assert_eq!(log.dedupe("p", &k).len(), 1);
    }

    #[test]
    fn an_intended_socket_always_gets_its_outcome_written() {
        let mut log = AuditLog::new(PathBuf::from("/nonexistent"), 0, 0);
        let mut skip = decisions(1, Outcome::Skipped);
        skip[0].reason = Some("at the re-check: serves a connected downstream".into());
        assert_eq!(log.dedupe("p", &skip).len(), 1);
        // The same skip after a kill intent for that socket is its outcome: written again.
        log.intended("p", &decisions(1, Outcome::KillIntent));
        assert_eq!(log.dedupe("p", &skip).len(), 1);
        assert_eq!(
            log.dedupe("p", &skip).len(),
            0,
            "a plain repeat is still deduplicated"
        );
    }

    #[test]
    fn a_failed_write_leaves_the_file_as_it_was_and_repair_runs_once() {
        let dir = std::env::temp_dir().join(format!("connreap-audit-rep-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("audit.jsonl");
        let mut intent = serde_json::to_value(&decisions(1, Outcome::KillIntent)[0]).unwrap();
        intent["agent_pid"] = 4_194_305.into();
        fs::write(&path, format!("{intent}\n{{\"torn")).unwrap();
        let mut log = AuditLog::new(path.clone(), 0, 0);
        let done = log.repair().unwrap();
        assert_eq!(
            done,
            Repair {
                torn_bytes: 6,
                outcomes: 1
            }
        );
        assert_eq!(log.repair().unwrap(), Repair::default(), "once per process");
        let text = fs::read_to_string(&path).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[1]["result"], "failed");
        assert_eq!(lines[1]["reason"], super::super::audit_repair::NOT_EXECUTED);
        assert_eq!(lines[1]["agent_pid"], 4_194_305);
        // A write that fails (here on a read-only fd; a full disk in the e2e tests) leaves the
        // file as it was.
        let ro = fs::File::open(&path).unwrap();
        let err = log.write_locked(&ro, b"{\"x\":1}\n", true);
        assert!(err.is_err());
        assert_eq!(fs::read_to_string(&path).unwrap(), text);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn lines_name_the_namespace_and_container() {
        let dir = std::env::temp_dir().join(format!("connreap-audit-ns-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let path = dir.join("audit.jsonl");
        let id = "3f2a".repeat(16);
        let mut d = decisions(2, Outcome::Killed);
        let s = sock(
            10,
            "node",
            "127.0.0.1:40000",
            "127.0.0.1:25001",
            TcpState::Established,
        );
        let s = crate::quota::placed(s, 2, Some(&id));
        d[1].netns = s.netns.inode;
        d[1].netns_name = s.netns.name.as_deref().map(String::from);
        d[1].container = s.container_id().map(String::from);
        let mut log = AuditLog::new(path.clone(), 0, 0);
        log.append(&d, true).unwrap();
        let text = fs::read_to_string(&path).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines[0]["netns"], 0);
        assert!(lines[0]["netns_name"].is_null() && lines[0].get("container").is_none());
        assert_eq!(lines[1]["netns"], 2);
        assert_eq!(lines[1]["netns_name"], "blue");
        assert_eq!(lines[1]["container"], id.as_str());
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn rotates_by_size_keeping_n_files() {
        let dir = std::env::temp_dir().join(format!("connreap-audit-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let path = dir.join("audit.jsonl");
        let mut log = AuditLog::new(path.clone(), 2000, 2);
        for _ in 0..20 {
            log.append(&decisions(2, Outcome::Killed), true).unwrap();
        }
        let size = |p: &Path| fs::metadata(p).map(|m| m.len()).unwrap_or(0);
        assert!(size(&path) <= 2000, "{}", size(&path));
        assert!(size(&dir.join("audit.jsonl.1")) > 0);
        assert!(size(&dir.join("audit.jsonl.2")) > 0);
        assert!(!dir.join("audit.jsonl.3").exists());
        for p in [&path, &dir.join("audit.jsonl.1")] {
            let text = fs::read_to_string(p).unwrap();
            assert!(text.ends_with('\n'));
            for line in text.lines() {
                serde_json::from_str::<serde_json::Value>(line).unwrap();
            }
        }
        let _ = fs::remove_dir_all(&dir);
    }
}
