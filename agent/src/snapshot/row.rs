//! One `snapshot --json` socket row, written straight into a buffer: the same text as
//! `Socket`'s `Serialize` through [`super::to_json_writer`] (the tests compare them), without
//! running every key and fixed string through the JSON string escaper, which was a third of
//! the rendering time. Free-form strings (command names, units) still go through serde_json.
use std::time::Duration;

use serde_json::ser::Formatter as _;

use super::SecsFormatter;
use crate::table::{round_secs, Socket};

fn num(out: &mut Vec<u8>, key: &[u8], v: impl itoa::Integer) {
    out.extend_from_slice(key);
    out.extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
}

fn text(out: &mut Vec<u8>, key: &[u8], v: &str) {
    out.extend_from_slice(key);
    out.push(b'"');
    out.extend_from_slice(v.as_bytes());
    out.push(b'"');
}

fn secs(out: &mut Vec<u8>, key: &[u8], d: Option<Duration>) -> std::io::Result<()> {
    out.extend_from_slice(key);
    match d {
        Some(d) => SecsFormatter.write_f64(out, round_secs(d)),
        None => {
            out.extend_from_slice(b"null");
            Ok(())
        }
    }
}

/// Append `s` as a compact JSON object (no separator before it).
fn write_row(out: &mut Vec<u8>, s: &Socket) -> serde_json::Result<()> {
    let io = serde_json::Error::io;
    num(out, b"{\"inode\":", s.inode);
    if s.cookie != 0 {
        num(out, b",\"cookie\":", s.cookie);
    } else {
        out.extend_from_slice(b",\"cookie\":null");
    }
    out.extend_from_slice(b",\"local\":\"");
    s.local.write_text(out);
    out.extend_from_slice(b"\",\"peer\":\"");
    s.peer.write_text(out);
    out.push(b'"');
    text(out, b",\"state\":", s.state.as_str());
    secs(out, b",\"age_secs\":", Some(s.age)).map_err(io)?;
    out.extend_from_slice(if s.age_exact {
        b",\"age_exact\":true"
    } else {
        b",\"age_exact\":false"
    });
    secs(out, b",\"idle_secs\":", s.idle).map_err(io)?;
    secs(out, b",\"last_recv_secs\":", s.last_recv()).map_err(io)?;
    secs(out, b",\"last_send_secs\":", s.last_send()).map_err(io)?;
    num(out, b",\"rx_queue\":", s.rx_queue);
    num(out, b",\"tx_queue\":", s.tx_queue);
    num(out, b",\"uid\":", s.uid);
    text(out, b",\"direction\":", s.direction.as_str());
    num(out, b",\"service_port\":", s.service_port);
    if let Some(o) = &s.owner {
        num(out, b",\"pid\":", o.pid);
        out.extend_from_slice(b",\"comm\":");
        serde_json::to_writer(&mut *out, &*o.comm)?;
        num(out, b",\"fd\":", s.fd);
        out.extend_from_slice(b",\"unit\":");
        serde_json::to_writer(&mut *out, &o.unit.as_deref())?;
    }
    if let Some((first, rest)) = s.shared_with.split_first() {
        num(out, b",\"shared_with\":[", *first);
        for pid in rest {
            num(out, b",", *pid);
        }
        out.push(b']');
    }
    out.push(b'}');
    Ok(())
}

/// Append `rows` as JSON objects separated by commas (the inside of an array).
pub(super) fn write_rows(out: &mut Vec<u8>, rows: &[&Socket]) -> serde_json::Result<()> {
    for (i, s) in rows.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_row(out, s)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::table::{Direction, Owner, TcpState};

    /// Rows of every shape: with and without owner, unit, cookie, idle times and sharers; IPv6
    /// and mapped addresses; names that need escaping; ages beyond the integer fast path.
    #[test]
    fn rows_are_the_serde_text() {
        let mut rows = Vec::new();
        for (i, state) in [
            TcpState::Established,
            TcpState::CloseWait,
            TcpState::TimeWait,
            TcpState::Listen,
            TcpState::NewSynRecv,
        ]
        .into_iter()
        .enumerate()
        {
            let (local, peer) = match i % 3 {
                0 => ("10.0.0.5:48812", "10.0.16.36:80"),
                1 => ("[::1]:45000", "[::ffff:10.0.16.36]:8080"),
                _ => ("0.0.0.0:0", "255.255.255.255:65535"),
            };
            let mut s = Socket::new(local.parse().unwrap(), peer.parse().unwrap(), state);
            s.inode = 1000 + i as u64;
            s.cookie = if i % 2 == 0 { 0 } else { u64::MAX };
            s.age = Duration::from_micros(123_456_789 * i as u64);
            s.age_exact = i % 2 == 0;
            s.idle = (i % 2 == 1).then(|| Duration::from_millis(2500));
            s.rx_queue = i as u32;
            s.tx_queue = u32::MAX;
            s.uid = 65534;
            s.direction = [Direction::Inbound, Direction::Outbound, Direction::Listen][i % 3];
            s.service_port = 8080;
            rows.push(s.clone());
            s.owner = Some(Arc::new(Owner {
                pid: 77 + i as u32,
                comm: ["java", "we\"ird\\\u{1}", "", "日本", "x"][i].into(),
                unit: (i % 2 == 0).then(|| Arc::from("gw.service")),
            }));
            s.fd = 3;
            rows.push(s.clone());
            s.shared_with = vec![99; i].into_boxed_slice();
            // Beyond the seconds fast path (falls back to the float formatter).
            s.age = Duration::from_secs(2_000_000_000);
            rows.push(s);
        }
        for s in &rows {
            let mut fast = Vec::new();
            write_row(&mut fast, s).unwrap();
            let mut plain = Vec::new();
            super::super::to_json_writer(&mut plain, s).unwrap();
            assert_eq!(
                String::from_utf8(fast).unwrap(),
                String::from_utf8(plain).unwrap()
            );
        }
    }
}
