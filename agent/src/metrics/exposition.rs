//! The two text formats GET /metrics answers in. prometheus-client encodes OpenMetrics only;
//! the Prometheus text format (0.0.4) differs in what matters here by naming counter families
//! with their `_total` sample name, having no `info` type (an info metric is a gauge named
//! `_info`), no `# UNIT` lines and no `# EOF`. prometheus-client writes no `_created` samples
//! and no exemplars for these metrics.
use std::collections::HashMap;

/// An exposition format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// `application/openmetrics-text; version=1.0.0`, when the scraper asks for it (Prometheus
    /// does).
    OpenMetrics,
    /// `text/plain; version=0.0.4`, the classic Prometheus text format: the default
    /// (`curl | promtool check metrics`, older scrapers).
    Prometheus,
}

impl Format {
    pub fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Format::Prometheus => "text/plain; version=0.0.4; charset=utf-8",
        }
    }

    /// The format an `Accept` header asks for: OpenMetrics only when it lists
    /// `application/openmetrics-text` with a quality above zero and at least that of
    /// `text/plain` (as Prometheus 2.x and later ask); the Prometheus text format otherwise,
    /// including without a header or with `*/*` alone, so that `curl | promtool check metrics`
    /// and text-only scrapers get what they parse.
    pub fn negotiate(accept: Option<&str>) -> Format {
        let Some(accept) = accept else {
            return Format::Prometheus;
        };
        let (mut open, mut text) = (None::<f32>, None::<f32>);
        for range in accept.split(',') {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or("").to_ascii_lowercase();
            let q = parts
                .filter_map(|p| p.strip_prefix("q=").or_else(|| p.strip_prefix("Q=")))
                .find_map(|q| q.trim().parse::<f32>().ok())
                .unwrap_or(1.0);
            let slot = match media.as_str() {
                "application/openmetrics-text" => &mut open,
                "text/plain" => &mut text,
                _ => continue,
            };
            *slot = Some(slot.map_or(q, |old| old.max(q)));
        }
        match open {
            Some(o) if o > 0.0 && o >= text.unwrap_or(0.0) => Format::OpenMetrics,
            _ => Format::Prometheus,
        }
    }
}

/// OpenMetrics text (as prometheus-client writes it) rewritten in the Prometheus text format.
pub fn to_prometheus(openmetrics: &str) -> String {
    // Family name -> its type, from the TYPE lines (HELP comes before TYPE, so a first pass).
    let types: HashMap<&str, &str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .collect();
    // The name a family has in the Prometheus format, and its type there.
    let renamed = |name: &str| -> (String, &'static str) {
        match types.get(name).copied() {
            Some("counter") => (format!("{name}_total"), "counter"),
            Some("info") => (format!("{name}_info"), "gauge"),
            Some("gauge") => (name.to_string(), "gauge"),
            Some("histogram") => (name.to_string(), "histogram"),
            Some("summary") => (name.to_string(), "summary"),
            _ => (name.to_string(), "untyped"),
        }
    };
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            let help = help.replace('\\', "\\\\");
            out.push_str(&format!("# HELP {} {help}\n", renamed(name).0));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let name = rest.split_once(' ').map_or(rest, |(n, _)| n);
            let (name, kind) = renamed(name);
            out.push_str(&format!("# TYPE {name} {kind}\n"));
        } else if line.starts_with('#') {
            // # UNIT and # EOF have no counterpart.
        } else if !is_created(line, &types) {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// Whether `line` is the `_created` sample of a counter (or histogram) family.
fn is_created(line: &str, types: &HashMap<&str, &str>) -> bool {
    let name = line.split(['{', ' ']).next().unwrap_or("");
    name.strip_suffix("_created")
        .is_some_and(|family| matches!(types.get(family), Some(&"counter" | &"histogram")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negotiates_like_prometheus_and_promtool_ask() {
        use Format::*;
        for (accept, want) in [
            (None, Prometheus),
            (Some("*/*"), Prometheus),
            (Some("application/json"), Prometheus),
            // Prometheus 2.x's scrape Accept header.
            (Some("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"), OpenMetrics),
            (Some("application/openmetrics-text"), OpenMetrics),
            (Some("text/plain; version=0.0.4"), Prometheus),
            (Some("text/plain;version=0.0.4;q=0.9, application/openmetrics-text;q=0.5"), Prometheus),
            (Some("text/plain;q=0.5, application/openmetrics-text;q=0.5"), OpenMetrics),
            (Some("application/openmetrics-text;q=0"), Prometheus),
            (Some("text/plain;q=0"), Prometheus),
            (Some("Text/Plain"), Prometheus),
        ] {
            assert_eq!(Format::negotiate(accept), want, "{accept:?}");
        }
    }

    #[test]
    fn rewrites_counters_info_unit_and_eof() {
        let om = "# HELP connreap_build Build of this agent.\n\
                  # TYPE connreap_build info\n\
                  connreap_build_info{version=\"0.1.0\",commit=\"abc\"} 1\n\
                  # HELP connreap_scan_errors Scans that failed.\n\
                  # TYPE connreap_scan_errors counter\n\
                  connreap_scan_errors_total 2\n\
                  connreap_scan_errors_created 1700000000.0\n\
                  # HELP connreap_run_time_seconds Run time \\ in seconds.\n\
                  # TYPE connreap_run_time_seconds counter\n\
                  # UNIT connreap_run_time_seconds seconds\n\
                  connreap_run_time_seconds_total{program=\"p\"} 0.5\n\
                  # HELP connreap_findings Active findings.\n\
                  # TYPE connreap_findings gauge\n\
                  connreap_findings{kind=\"close_wait_buildup\"} 1\n\
                  # HELP connreap_scan_duration_seconds Scan time.\n\
                  # TYPE connreap_scan_duration_seconds histogram\n\
                  connreap_scan_duration_seconds_sum 0.1\n\
                  connreap_scan_duration_seconds_count 1\n\
                  connreap_scan_duration_seconds_bucket{le=\"+Inf\"} 1\n\
                  # EOF\n";
        assert_eq!(
            to_prometheus(om),
            "# HELP connreap_build_info Build of this agent.\n\
             # TYPE connreap_build_info gauge\n\
             connreap_build_info{version=\"0.1.0\",commit=\"abc\"} 1\n\
             # HELP connreap_scan_errors_total Scans that failed.\n\
             # TYPE connreap_scan_errors_total counter\n\
             connreap_scan_errors_total 2\n\
             # HELP connreap_run_time_seconds_total Run time \\\\ in seconds.\n\
             # TYPE connreap_run_time_seconds_total counter\n\
             connreap_run_time_seconds_total{program=\"p\"} 0.5\n\
             # HELP connreap_findings Active findings.\n\
             # TYPE connreap_findings gauge\n\
             connreap_findings{kind=\"close_wait_buildup\"} 1\n\
             # HELP connreap_scan_duration_seconds Scan time.\n\
             # TYPE connreap_scan_duration_seconds histogram\n\
             connreap_scan_duration_seconds_sum 0.1\n\
             connreap_scan_duration_seconds_count 1\n\
             connreap_scan_duration_seconds_bucket{le=\"+Inf\"} 1\n"
        );
    }
}
