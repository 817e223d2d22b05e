//! What the audit log needs at start: the bytes of a torn last line to cut off (a line without
//! its newline, or a last line that is not JSON), and an outcome line for every kill intent
//! whose outcome was never written (the daemon stopped between the two).
use std::{
    collections::HashMap,
    io::{self, BufRead},
};

use serde_json::Value;

/// The reason written on the outcome of an intent left without one.
pub const NOT_EXECUTED: &str = "not executed: the daemon stopped";

/// A kill intent and its outcome share these: policy, local, peer, inode, round, agent_pid.
type IntentKey = (String, String, String, u64, u64, u64);

fn key(v: &Value) -> Option<IntentKey> {
    Some((
        v["policy"].as_str()?.to_string(),
        v["local"].as_str()?.to_string(),
        v["peer"].as_str()?.to_string(),
        v["inode"].as_u64()?,
        v["round"].as_u64()?,
        v["agent_pid"].as_u64()?,
    ))
}

/// Kill intents seen so far without their outcome, in file order.
#[derive(Default)]
pub struct Intents {
    open: HashMap<IntentKey, (usize, Value)>,
    seen: usize,
}

impl Intents {
    /// Take one parsed audit line into account.
    fn line(&mut self, v: Value) {
        let Some(k) = key(&v) else { return };
        match v["result"].as_str() {
            Some("kill-intent") => {
                self.seen += 1;
                self.open.insert(k, (self.seen, v));
            }
            Some("killed" | "failed" | "skipped") => {
                self.open.remove(&k);
            }
            _ => {}
        }
    }

    /// Outcome lines (`failed`, reason [`NOT_EXECUTED`], `time` now) for the intents still
    /// open, except those of a process for which `running(agent_pid)` holds (another connreap
    /// that may be between an intent and its kill right now).
    pub fn outcomes(self, time: &str, running: impl Fn(u64) -> bool) -> Vec<Value> {
        let mut open: Vec<(usize, Value)> = self
            .open
            .into_values()
            .filter(|(_, v)| !v["agent_pid"].as_u64().is_some_and(&running))
            .collect();
        open.sort_by_key(|(n, _)| *n);
        open.into_iter()
            .map(|(_, mut v)| {
                if let Some(o) = v.as_object_mut() {
                    o.insert("time".into(), time.into());
                    o.insert("result".into(), "failed".into());
                    o.insert("reason".into(), NOT_EXECUTED.into());
                    o.remove("mechanism");
                }
                v
            })
            .collect()
    }
}

/// Read the lines of an audit file (an older rotated one first, then the current one) into
/// `intents`; returns the length of the file's whole JSON lines (what to keep: the file less a
/// torn tail).
pub fn read(r: &mut impl BufRead, intents: &mut Intents) -> io::Result<u64> {
    let mut line = Vec::new();
    let (mut offset, mut keep) = (0u64, 0u64);
    loop {
        line.clear();
        let n = r.read_until(b'\n', &mut line)? as u64;
        if n == 0 {
            return Ok(keep);
        }
        offset += n;
        if line.last() != Some(&b'\n') {
            // A last line cut short: everything after the last newline goes.
            return Ok(keep);
        }
        match serde_json::from_slice::<Value>(&line) {
            Ok(v) => {
                intents.line(v);
                keep = offset;
            }
            // An unparseable line in the middle stays (it is history); only the last one is
            // taken as torn.
            Err(_) => keep = offset - n,
        }
    }
}

/// Whether `pid` is a running connreap other than this process.
pub fn other_connreap(pid: u64) -> bool {
    if pid == u64::from(std::process::id()) {
        return false;
    }
    std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim_end() == "connreap")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(result: &str, port: u16, round: u64) -> String {
        format!(
            r#"{{"time":"t","policy":"p","mode":"enforce","result":"{result}","local":"127.0.0.1:{port}","peer":"127.0.0.1:25001","inode":{port},"round":{round},"agent_pid":7{}}}"#,
            if result == "killed" {
                r#","mechanism":"m""#
            } else {
                ""
            }
        ) + "\n"
    }

    fn scan(text: &str) -> (u64, Vec<Value>) {
        let mut intents = Intents::default();
        let keep = read(&mut text.as_bytes(), &mut intents).unwrap();
        (keep, intents.outcomes("now", |_| false))
    }

    #[test]
    fn a_torn_tail_is_cut_and_whole_lines_are_kept() {
        let whole = line("killed", 1, 1) + &line("skipped", 2, 1);
        assert_eq!(scan(&whole).0, whole.len() as u64);
        assert_eq!(scan("").0, 0);
        // No newline at the end.
        let torn = whole.clone() + r#"{"time":"t","poli"#;
        assert_eq!(scan(&torn).0, whole.len() as u64);
        // A last line with its newline that is not JSON (two writes run together).
        let merged = whole.clone() + r#"{"time":"t","pol{"time":"t"}"# + "\n";
        assert_eq!(scan(&merged).0, whole.len() as u64);
        // Only a torn file: all of it goes.
        assert_eq!(scan("{\"ti").0, 0);
        // A bad line in the middle stays: only the tail is repaired.
        let middle = line("killed", 1, 1) + "garbage\n" + &line("killed", 2, 1);
        assert_eq!(scan(&middle).0, middle.len() as u64);
    }

    #[test]
    fn intents_without_outcome_get_a_failed_line() {
        let text = line("kill-intent", 1, 1)
            + &line("kill-intent", 2, 1)
            + &line("kill-intent", 3, 1)
            + &line("killed", 1, 1)
            + &line("skipped", 3, 1)
            // Same socket, next round: its outcome is missing.
            + &line("kill-intent", 1, 2)
            + "{\"result\":\"kill-in";
        let (_, out) = scan(&text);
        assert_eq!(out.len(), 2, "{out:?}");
        for (o, (port, round)) in out.iter().zip([(2u64, 1u64), (1, 2)]) {
            assert_eq!(o["result"], "failed");
            assert_eq!(o["reason"], NOT_EXECUTED);
            assert_eq!(o["inode"], port);
            assert_eq!(o["round"], round);
            assert_eq!(o["agent_pid"], 7);
            assert_eq!(o["policy"], "p");
            assert_eq!(o["mode"], "enforce");
            assert_eq!(o["time"], "now");
        }
        // Intents of a connreap still running are its own business.
        let mut intents = Intents::default();
        read(&mut text.as_bytes(), &mut intents).unwrap();
        assert!(intents.outcomes("now", |pid| pid == 7).is_empty());
    }
}
