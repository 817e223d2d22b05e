//! The agent's `GET /metrics` (Prometheus/OpenMetrics text), parsed into samples.

use std::{collections::BTreeMap, fmt};

/// One sample line: `name{label="value",...} value [timestamp]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// A parsed exposition. Displays as the text it was parsed from (for failure messages).
#[derive(Debug, Clone)]
pub struct Metrics {
    text: String,
    samples: Vec<Sample>,
}

impl Metrics {
    /// Parses every sample; `# ...` lines (HELP, TYPE, UNIT, EOF) and blank lines are skipped.
    /// A line that is neither is an error naming it.
    pub fn parse(text: &str) -> Result<Metrics, String> {
        let samples = text
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
            .map(|l| parse_sample(l).ok_or_else(|| format!("not a metrics sample: {l:?}")))
            .collect::<Result<_, _>>()?;
        Ok(Metrics {
            text: text.to_string(),
            samples,
        })
    }

    pub fn samples(&self) -> &[Sample] {
        &self.samples
    }

    /// The value of the series `series`, written as in the exposition: `name` alone or
    /// `name{label="value",...}` with exactly that set of labels (in any order).
    pub fn value(&self, series: &str) -> Option<f64> {
        let want = parse_series(series)
            .unwrap_or_else(|| panic!("not a series: {series:?}"))
            .0;
        self.samples
            .iter()
            .find(|s| (&s.name, &s.labels) == (&want.0, &want.1))
            .map(|s| s.value)
    }
}

impl fmt::Display for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

type Series = (String, BTreeMap<String, String>);

fn parse_sample(line: &str) -> Option<Sample> {
    let ((name, labels), rest) = parse_series(line)?;
    let rest = rest.strip_prefix(' ')?;
    // The value, then an optional timestamp.
    let mut fields = rest.split_whitespace();
    let value = parse_value(fields.next()?)?;
    if fields.next().is_some_and(|t| t.parse::<f64>().is_err()) || fields.next().is_some() {
        return None;
    }
    Some(Sample {
        name,
        labels,
        value,
    })
}

fn parse_value(v: &str) -> Option<f64> {
    match v {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => v.parse().ok(),
    }
}

/// `name` or `name{k="v",...}` at the start of `s`, and what follows it.
fn parse_series(s: &str) -> Option<(Series, &str)> {
    let end = s.find(['{', ' ']).unwrap_or(s.len());
    let name = &s[..end];
    let name_ok = name.chars().enumerate().all(|(i, c)| {
        c.is_ascii_alphabetic() || c == '_' || c == ':' || (i > 0 && c.is_ascii_digit())
    });
    if name.is_empty() || !name_ok {
        return None;
    }
    let mut rest = &s[end..];
    let mut labels = BTreeMap::new();
    if let Some(mut r) = rest.strip_prefix('{') {
        loop {
            if let Some(after) = r.strip_prefix('}') {
                rest = after;
                break;
            }
            let (key, after) = r.split_once("=\"")?;
            let (value, after) = unescape_until_quote(after)?;
            labels.insert(key.to_string(), value);
            r = after.strip_prefix(',').unwrap_or(after);
        }
    }
    Some(((name.to_string(), labels), rest))
}

/// A label value up to its closing quote (`\\`, `\"` and `\n` escaped), and the text after it.
fn unescape_until_quote(s: &str) -> Option<(String, &str)> {
    let mut out = String::new();
    let mut chars = s.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Some((out, &s[i + 1..])),
            '\\' => match chars.next()?.1 {
                'n' => out.push('\n'),
                other => out.push(other),
            },
            c => out.push(c),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_samples_and_finds_series_by_label_set() {
        let text = "# HELP connreap_findings Current findings.\n\
                    # TYPE connreap_findings gauge\n\
                    connreap_findings{kind=\"reconnect_storm\"} 2\n\
                    connreap_reclaims_total{policy=\"a\",result=\"killed\"} 3 1700000000\n\
                    connreap_sockets{state=\"ESTABLISHED\",comm=\"say \\\"hi\\\", ok\",service_port=\"80\"} 1\n\
                    connreap_webhook_dropped_total 0\n\
                    # EOF\n";
        let m = Metrics::parse(text).unwrap();
        assert_eq!(m.samples().len(), 4);
        assert_eq!(
            m.value(r#"connreap_findings{kind="reconnect_storm"}"#),
            Some(2.0)
        );
        assert_eq!(
            m.value(r#"connreap_reclaims_total{result="killed",policy="a"}"#),
            Some(3.0)
        );
        assert_eq!(m.value(r#"connreap_reclaims_total{policy="a"}"#), None);
        assert_eq!(m.value("connreap_webhook_dropped_total"), Some(0.0));
        assert_eq!(m.value("connreap_webhook"), None);
        assert_eq!(m.samples()[2].labels["comm"], "say \"hi\", ok");
        assert_eq!(m.to_string(), text);
    }

    #[test]
    fn rejects_what_is_not_a_sample() {
        for bad in [
            "connreap_x",
            "connreap_x{a=\"b\" 1",
            "connreap_x one",
            "9x 1",
            "x 1 2 3",
        ] {
            assert!(Metrics::parse(bad).is_err(), "{bad:?}");
        }
    }
}
