//! Naming a place in the configuration file for error messages: key paths such as
//! `quota[1] (relay).port_field`, and the line each key starts on, taken from the TOML parser's
//! spans (`toml::Spanned`) rather than from the text.
use std::fmt;

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use toml::Spanned;

/// A key path from the document root: `agent.scan_interval`, `quota[1] (relay).url`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct KeyPath(Vec<Seg>);

#[derive(Debug, Clone, PartialEq, Eq)]
enum Seg {
    Key(String),
    /// An array element; `name` is the entry's `name` key, shown in messages only.
    Index {
        index: usize,
        name: Option<String>,
    },
}

impl KeyPath {
    pub(super) fn key(mut self, key: &str) -> Self {
        self.0.push(Seg::Key(key.into()));
        self
    }

    /// Entry `index` of the array of tables `array`, named `name` in messages when given.
    pub(super) fn entry(self, array: &str, index: usize, name: Option<&str>) -> Self {
        let mut p = self.key(array);
        p.0.push(Seg::Index {
            index,
            name: name.map(str::to_string),
        });
        p
    }

    /// The path with every segment after `n` dropped.
    fn prefix(&self, n: usize) -> KeyPath {
        KeyPath(self.0[..n].to_vec())
    }

    /// Whether both name the same place (entry names aside).
    fn same_place(&self, other: &KeyPath) -> bool {
        self.0.len() == other.0.len()
            && self.0.iter().zip(&other.0).all(|(a, b)| match (a, b) {
                (Seg::Key(a), Seg::Key(b)) => a == b,
                (Seg::Index { index: a, .. }, Seg::Index { index: b, .. }) => a == b,
                _ => false,
            })
    }
}

impl fmt::Display for KeyPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, seg) in self.0.iter().enumerate() {
            match seg {
                Seg::Key(k) if i == 0 => f.write_str(k)?,
                Seg::Key(k) => write!(f, ".{k}")?,
                Seg::Index { index, name: None } => write!(f, "[{index}]")?,
                Seg::Index {
                    index,
                    name: Some(name),
                } => write!(f, "[{index}] ({name})")?,
            }
        }
        Ok(())
    }
}

/// Where every key and array element of a document starts (byte offsets).
#[derive(Debug, Default)]
pub(super) struct Positions(Vec<(KeyPath, usize)>);

impl Positions {
    /// The positions in `text`; None when it is not valid TOML.
    pub(super) fn of(text: &str) -> Option<Self> {
        let root: Node = toml::from_str(text).ok()?;
        let mut out = Positions::default();
        out.collect(&KeyPath::default(), &root);
        Some(out)
    }

    fn collect(&mut self, path: &KeyPath, node: &Node) {
        match node {
            Node::Table(entries) => {
                for (key, value) in entries {
                    let path = path.clone().key(key.get_ref());
                    self.0.push((path.clone(), key.span().start));
                    self.collect(&path, value);
                }
            }
            Node::Array(items) => {
                for (index, item) in items.iter().enumerate() {
                    let mut path = path.clone();
                    path.0.push(Seg::Index { index, name: None });
                    self.0.push((path.clone(), item.span().start));
                    self.collect(&path, item.get_ref());
                }
            }
            Node::Value => {}
        }
    }

    /// Where `path` starts, else where the nearest enclosing key or entry that is in the file
    /// starts (a missing key's table).
    pub(super) fn find(&self, path: &KeyPath) -> Option<usize> {
        (1..=path.0.len()).rev().find_map(|n| {
            let p = path.prefix(n);
            self.0
                .iter()
                .find(|(q, _)| q.same_place(&p))
                .map(|(_, at)| *at)
        })
    }

    /// The innermost key or entry that starts on the line `range` and at or before `offset`
    /// (else the first on that line): what a parse error at `offset` is about.
    pub(super) fn at(&self, offset: usize, line: std::ops::Range<usize>) -> Option<&KeyPath> {
        let on_line = || self.0.iter().filter(|(_, at)| line.contains(at));
        on_line()
            .filter(|(_, at)| *at <= offset)
            .max_by_key(|(p, at)| (*at, p.0.len()))
            .or_else(|| on_line().min_by_key(|(_, at)| *at))
            .map(|(p, _)| p)
    }
}

/// The shape of a TOML document with the span of each key and array element. Tables do not
/// carry spans: a table made implicitly (`[a.b]` without `[a]`, dotted keys) has none.
enum Node {
    Table(Vec<(Spanned<String>, Node)>),
    Array(Vec<Spanned<Node>>),
    Value,
}

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(NodeVisitor)
    }
}

struct NodeVisitor;

impl<'de> Visitor<'de> for NodeVisitor {
    type Value = Node;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a TOML value")
    }
    fn visit_bool<E>(self, _: bool) -> Result<Node, E> {
        Ok(Node::Value)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Node, E> {
        Ok(Node::Value)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Node, E> {
        Ok(Node::Value)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Node, E> {
        Ok(Node::Value)
    }
    fn visit_str<E>(self, _: &str) -> Result<Node, E> {
        Ok(Node::Value)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Node, A::Error> {
        let mut entries = Vec::new();
        while let Some(key) = map.next_key::<Spanned<String>>()? {
            entries.push((key, map.next_value()?));
        }
        Ok(Node::Table(entries))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Node, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Node::Array(items))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "[agent]\nscan_interval = \"1s\"\n[[quota]]\nname = \"a\"\n\
                        [[quota]]\nname = \"b\"\nport_map = { \"1\" = 2 }\n\
                        [[policy]]\nselect.comm = \"x\"\n[x.y]\nz = [1, 2]\n";

    fn line_of(p: &Positions, path: &KeyPath) -> Option<usize> {
        p.find(path).map(|at| TEXT[..at].matches('\n').count() + 1)
    }

    #[test]
    fn finds_keys_entries_and_enclosing_tables() {
        let p = Positions::of(TEXT).unwrap();
        let root = KeyPath::default;
        assert_eq!(line_of(&p, &root().key("agent")), Some(1));
        assert_eq!(
            line_of(&p, &root().key("agent").key("scan_interval")),
            Some(2)
        );
        let b = root().entry("quota", 1, Some("b"));
        assert_eq!(b.to_string(), "quota[1] (b)");
        assert_eq!(line_of(&p, &b), Some(5));
        assert_eq!(line_of(&p, &b.clone().key("port_map")), Some(7));
        // A key that is not in the file: its entry's header.
        assert_eq!(line_of(&p, &b.key("url")), Some(5));
        // Implicit tables (dotted keys and headers) have keys with positions too.
        let select = root().entry("policy", 0, None).key("select").key("comm");
        assert_eq!(select.to_string(), "policy[0].select.comm");
        assert_eq!(line_of(&p, &select), Some(9));
        assert_eq!(line_of(&p, &root().key("x").key("y").key("z")), Some(11));
        assert_eq!(line_of(&p, &root().key("nothing")), None);
    }

    #[test]
    fn names_the_innermost_key_on_a_line() {
        let p = Positions::of(TEXT).unwrap();
        let line = |n: usize| {
            let start: usize = TEXT.split_inclusive('\n').take(n - 1).map(str::len).sum();
            start..start + TEXT[start..].find('\n').unwrap()
        };
        let value = TEXT.find("\"1s\"").unwrap();
        assert_eq!(
            p.at(value, line(2)).unwrap().to_string(),
            "agent.scan_interval"
        );
        let two = TEXT.rfind("2]").unwrap();
        assert_eq!(p.at(two, line(11)).unwrap().to_string(), "x.y.z[1]");
        // An error at a header's bracket names the entry it opens.
        let header = TEXT.find("[[policy]]").unwrap();
        assert_eq!(p.at(header, line(8)).unwrap().to_string(), "policy[0]");
        assert!(Positions::of("a = ").is_none());
    }
}
