//! The socket row: its fields are listed once, in [`fields`], and written two ways from that
//! list: by `Socket`'s `Serialize` impl (serde, for every document that embeds sockets) and by
//! [`write_rows`], which writes the same text straight into a buffer for `snapshot --json` and
//! `GET /v1/sockets` without running every key and fixed string through the JSON string
//! escaper (a third of the rendering time when it did). Free-form strings (command names,
//! units) still go through serde_json.
use std::time::Duration;

use serde::{ser::SerializeMap as _, Serialize, Serializer};
use serde_json::ser::Formatter as _;

use super::SecsFormatter;
use crate::{
    present::round_secs,
    table::{Endpoint, Socket},
};

/// A field's key: its name, and the JSON text that precedes its value in a row.
#[derive(Clone, Copy)]
struct Key {
    name: &'static str,
    /// `,"name":` (keys are plain identifiers: nothing to escape).
    json: &'static str,
}

macro_rules! key {
    ($name:literal) => {
        Key {
            name: $name,
            json: concat!(",\"", $name, "\":"),
        }
    };
}

/// What a row's fields are written to: one method per kind of value.
trait RowWriter {
    type Error;
    fn int(&mut self, key: Key, v: u64) -> Result<(), Self::Error>;
    fn opt_int(&mut self, key: Key, v: Option<u64>) -> Result<(), Self::Error>;
    fn flag(&mut self, key: Key, v: bool) -> Result<(), Self::Error>;
    /// A string from a fixed set that needs no JSON escaping (state, direction).
    fn word(&mut self, key: Key, v: &'static str) -> Result<(), Self::Error>;
    /// A free-form string (escaped), or null.
    fn text(&mut self, key: Key, v: Option<&str>) -> Result<(), Self::Error>;
    fn endpoint(&mut self, key: Key, v: &Endpoint) -> Result<(), Self::Error>;
    /// Seconds to the millisecond ([`round_secs`]), or null.
    fn secs(&mut self, key: Key, v: Option<Duration>) -> Result<(), Self::Error>;
    fn pids(&mut self, key: Key, v: &[u32]) -> Result<(), Self::Error>;
}

/// The row schema: every field of a socket row, in order.
#[inline]
fn fields<W: RowWriter>(s: &Socket, w: &mut W) -> Result<(), W::Error> {
    w.int(key!("inode"), s.inode)?;
    w.opt_int(key!("cookie"), (s.cookie != 0).then_some(s.cookie))?;
    w.endpoint(key!("local"), &s.local)?;
    w.endpoint(key!("peer"), &s.peer)?;
    w.word(key!("state"), s.state.as_str())?;
    w.secs(key!("age_secs"), Some(s.age()))?;
    w.flag(key!("age_exact"), s.age_exact)?;
    w.secs(key!("idle_secs"), s.idle())?;
    w.secs(key!("last_recv_secs"), s.last_recv())?;
    w.secs(key!("last_send_secs"), s.last_send())?;
    w.int(key!("rx_queue"), s.rx_queue.into())?;
    w.int(key!("tx_queue"), s.tx_queue.into())?;
    w.flag(key!("keepalive"), s.keepalive)?;
    w.int(key!("uid"), s.uid.into())?;
    w.word(key!("direction"), s.direction.as_str())?;
    w.int(key!("service_port"), s.service_port.into())?;
    w.int(key!("netns"), s.netns.inode.into())?;
    w.text(key!("netns_name"), s.netns.name.as_deref())?;
    if let Some(o) = &s.owner {
        w.int(key!("pid"), o.pid.into())?;
        w.text(key!("comm"), Some(&o.comm))?;
        w.int(key!("fd"), s.fd.into())?;
        w.text(key!("unit"), o.unit.as_deref())?;
        if let Some(c) = &o.container {
            w.text(key!("container"), Some(&c.id))?;
            w.word(key!("container_runtime"), c.runtime.as_str())?;
            w.text(key!("container_name"), c.name.as_deref())?;
            w.text(key!("container_image"), c.image.as_deref())?;
            w.text(key!("pod_uid"), c.pod_uid.as_deref())?;
            w.text(key!("pod_name"), c.pod_name.as_deref())?;
            w.text(key!("pod_namespace"), c.pod_namespace.as_deref())?;
        }
    }
    if !s.shared_with.is_empty() {
        w.pids(key!("shared_with"), &s.shared_with)?;
    }
    Ok(())
}

impl Serialize for Socket {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = SerdeRow(s.serialize_map(None)?);
        fields(self, &mut map)?;
        map.0.end()
    }
}

/// The serde form: one map entry per field.
struct SerdeRow<M>(M);

impl<M: serde::ser::SerializeMap> RowWriter for SerdeRow<M> {
    type Error = M::Error;
    fn int(&mut self, key: Key, v: u64) -> Result<(), M::Error> {
        self.0.serialize_entry(key.name, &v)
    }
    fn opt_int(&mut self, key: Key, v: Option<u64>) -> Result<(), M::Error> {
        self.0.serialize_entry(key.name, &v)
    }
    fn flag(&mut self, key: Key, v: bool) -> Result<(), M::Error> {
        self.0.serialize_entry(key.name, &v)
    }
    fn word(&mut self, key: Key, v: &'static str) -> Result<(), M::Error> {
        self.0.serialize_entry(key.name, v)
    }
    fn text(&mut self, key: Key, v: Option<&str>) -> Result<(), M::Error> {
        self.0.serialize_entry(key.name, &v)
    }
    fn endpoint(&mut self, key: Key, v: &Endpoint) -> Result<(), M::Error> {
        self.0.serialize_entry(key.name, v)
    }
    fn secs(&mut self, key: Key, v: Option<Duration>) -> Result<(), M::Error> {
        self.0.serialize_entry(key.name, &v.map(round_secs))
    }
    fn pids(&mut self, key: Key, v: &[u32]) -> Result<(), M::Error> {
        self.0.serialize_entry(key.name, v)
    }
}

/// The fast form: compact JSON bytes appended to `out`.
struct FastRow<'a> {
    out: &'a mut Vec<u8>,
}

impl FastRow<'_> {
    #[inline]
    fn key(&mut self, key: Key) {
        self.out.extend_from_slice(key.json.as_bytes());
    }
}

impl RowWriter for FastRow<'_> {
    type Error = serde_json::Error;
    #[inline]
    fn int(&mut self, key: Key, v: u64) -> serde_json::Result<()> {
        self.key(key);
        self.out
            .extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
        Ok(())
    }
    #[inline]
    fn opt_int(&mut self, key: Key, v: Option<u64>) -> serde_json::Result<()> {
        match v {
            Some(v) => self.int(key, v),
            None => {
                self.key(key);
                self.out.extend_from_slice(b"null");
                Ok(())
            }
        }
    }
    #[inline]
    fn flag(&mut self, key: Key, v: bool) -> serde_json::Result<()> {
        self.key(key);
        self.out
            .extend_from_slice(if v { b"true" } else { b"false" });
        Ok(())
    }
    #[inline]
    fn word(&mut self, key: Key, v: &'static str) -> serde_json::Result<()> {
        self.key(key);
        self.out.push(b'"');
        self.out.extend_from_slice(v.as_bytes());
        self.out.push(b'"');
        Ok(())
    }
    #[inline]
    fn text(&mut self, key: Key, v: Option<&str>) -> serde_json::Result<()> {
        self.key(key);
        serde_json::to_writer(&mut *self.out, &v)
    }
    #[inline]
    fn endpoint(&mut self, key: Key, v: &Endpoint) -> serde_json::Result<()> {
        self.key(key);
        self.out.push(b'"');
        v.write_text(self.out);
        self.out.push(b'"');
        Ok(())
    }
    #[inline]
    fn secs(&mut self, key: Key, v: Option<Duration>) -> serde_json::Result<()> {
        self.key(key);
        match v {
            Some(d) => SecsFormatter
                .write_f64(self.out, round_secs(d))
                .map_err(serde_json::Error::io),
            None => {
                self.out.extend_from_slice(b"null");
                Ok(())
            }
        }
    }
    #[inline]
    fn pids(&mut self, key: Key, v: &[u32]) -> serde_json::Result<()> {
        self.key(key);
        self.out.push(b'[');
        for (i, pid) in v.iter().enumerate() {
            if i > 0 {
                self.out.push(b',');
            }
            self.out
                .extend_from_slice(itoa::Buffer::new().format(*pid).as_bytes());
        }
        self.out.push(b']');
        Ok(())
    }
}

/// Append `s` as a compact JSON object (no separator before it).
fn write_row(out: &mut Vec<u8>, s: &Socket) -> serde_json::Result<()> {
    let start = out.len();
    let mut w = FastRow { out };
    fields(s, &mut w)?;
    // Every key was written with a leading comma: the first one opens the object instead.
    out[start] = b'{';
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
            s.set_age(Duration::from_micros(123_456_789 * i as u64));
            s.age_exact = i % 2 == 0;
            s.set_idle((i % 2 == 1).then(|| Duration::from_millis(2500)));
            s.rx_queue = i as u32;
            s.tx_queue = u32::MAX;
            s.uid = 65534;
            s.direction = [Direction::Inbound, Direction::Outbound, Direction::Listen][i % 3];
            s.service_port = 8080;
            s.keepalive = i % 2 == 1;
            rows.push(s.clone());
            s.owner = Some(Arc::new(Owner {
                pid: 77 + i as u32,
                comm: ["java", "we\"ird\\\u{1}", "", "日本", "x"][i].into(),
                unit: (i % 2 == 0).then(|| Arc::from("gw.service")),
                container: None,
            }));
            s.fd = 3;
            rows.push(s.clone());
            s.shared_with = vec![99; i].into_boxed_slice();
            // Beyond the seconds fast path (falls back to the float formatter).
            s.set_age(Duration::from_secs(2_000_000_000));
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

    /// The fast writer writes keys unescaped.
    #[test]
    fn keys_need_no_escaping() {
        let mut s = Socket::new(
            "10.0.0.5:48812".parse().unwrap(),
            "10.0.16.36:80".parse().unwrap(),
            TcpState::Established,
        );
        s.owner = Some(Arc::new(Owner {
            pid: 1,
            comm: "x".into(),
            unit: None,
            container: Some(Arc::new(crate::containers::Container {
                id: "ab".repeat(32),
                runtime: crate::containers::Runtime::Containerd,
                pod_uid: Some("uid".into()),
                pod_name: Some("relay-0".into()),
                pod_namespace: Some("edge".into()),
                name: None,
                image: None,
            })),
        }));
        s.shared_with = vec![2].into_boxed_slice();
        let row = serde_json::to_value(&s).unwrap();
        let keys: Vec<&String> = row.as_object().unwrap().keys().collect();
        assert_eq!(keys.len(), 30);
        for k in keys {
            assert!(
                k.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{k}"
            );
        }
    }
}
