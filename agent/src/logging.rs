//! Log output on stderr: text (one line per event, `key=value` fields quoted logfmt-style when
//! needed) or JSON (one object per line), each line led by its syslog priority (`<3>` ... `<7>`)
//! when stderr is the systemd journal, which reads that prefix (sd-daemon(3)).
use std::{fmt, io::IsTerminal as _};

use serde::{Deserialize, Serialize};
use tracing::{field::Field, Event, Level, Subscriber};
use tracing_subscriber::{
    field::Visit,
    fmt::{format::Writer, FmtContext, FormatEvent, FormatFields, MakeWriter, SubscriberBuilder},
    registry::LookupSpan,
    EnvFilter,
};

/// `--log-format` / `[agent] log_format`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// `TIME LEVEL TARGET: message key=value ...`, values with spaces, quotes or `=` quoted.
    #[default]
    Text,
    /// One JSON object per line: timestamp, level, target, message and every field.
    Json,
}

/// An error that can repeat many times in a burst (a webhook queue overflowing): logged once
/// at once, then at most once per `every` with how many happened since the last line.
#[derive(Debug)]
pub struct Repeats {
    every: std::time::Duration,
    last_line: Option<std::time::Instant>,
    /// Events since the last line.
    pending: u64,
}

impl Repeats {
    pub fn new(every: std::time::Duration) -> Repeats {
        Repeats {
            every,
            last_line: None,
            pending: 0,
        }
    }

    /// Count one event; [`Repeats::due`] says when to log it.
    pub fn record(&mut self) {
        self.pending += 1;
    }

    /// Events counted but not yet logged, once `every` has passed since the last line.
    pub fn due(&mut self, now: std::time::Instant) -> Option<u64> {
        let due = self
            .last_line
            .is_none_or(|t| now.saturating_duration_since(t) >= self.every);
        if self.pending == 0 || !due {
            return None;
        }
        self.last_line = Some(now);
        Some(std::mem::take(&mut self.pending))
    }
}

/// How log lines are written.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    pub format: LogFormat,
    /// Lead each line with its syslog priority, for the journal (no timestamp either: the
    /// journal has its own).
    pub journal: bool,
    /// Colours (text on a terminal only).
    pub ansi: bool,
}

impl Options {
    /// `format` on this process's stderr.
    pub fn for_stderr(format: LogFormat) -> Options {
        let journal = stderr_is_journal();
        Options {
            format,
            journal,
            ansi: format == LogFormat::Text && !journal && std::io::stderr().is_terminal(),
        }
    }
}

/// Install the global subscriber: `RUST_LOG` if set, else connreap at info (debug with
/// `verbose`).
pub fn init(verbose: bool, opts: Options) {
    let default = if verbose {
        "connreap=debug"
    } else {
        "connreap=info"
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    // A subscriber set already (never in the binary) is kept.
    let _ = tracing::subscriber::set_global_default(subscriber(opts, filter, std::io::stderr));
}

/// The subscriber for `opts`, writing to `writer`.
pub fn subscriber<W>(
    opts: Options,
    filter: EnvFilter,
    writer: W,
) -> Box<dyn Subscriber + Send + Sync>
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let b: SubscriberBuilder<_, _, _, W> = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(opts.ansi);
    let journal = opts.journal;
    match (opts.format, journal) {
        (LogFormat::Text, false) => Box::new(b.fmt_fields(Logfmt).finish()),
        (LogFormat::Text, true) => Box::new(
            b.without_time()
                .fmt_fields(Logfmt)
                .map_event_format(Priority)
                .finish(),
        ),
        (LogFormat::Json, false) => Box::new(json(b).finish()),
        (LogFormat::Json, true) => Box::new(json(b).map_event_format(Priority).finish()),
    }
}

type JsonBuilder<W> = SubscriberBuilder<
    tracing_subscriber::fmt::format::JsonFields,
    tracing_subscriber::fmt::format::Format<tracing_subscriber::fmt::format::Json>,
    EnvFilter,
    W,
>;

fn json<W>(
    b: SubscriberBuilder<
        tracing_subscriber::fmt::format::DefaultFields,
        tracing_subscriber::fmt::format::Format,
        EnvFilter,
        W,
    >,
) -> JsonBuilder<W>
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    b.json()
        .flatten_event(true)
        .with_current_span(false)
        .with_span_list(false)
}

/// Whether stderr is connected to the journal: `JOURNAL_STREAM` (set by systemd) names its
/// device and inode, and stderr still is that stream (not redirected since).
fn stderr_is_journal() -> bool {
    let Some(v) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Some((dev, ino)) = v.to_str().and_then(|s| s.split_once(':')) else {
        return false;
    };
    let (Ok(dev), Ok(ino)) = (dev.parse::<u64>(), ino.parse::<u64>()) else {
        return false;
    };
    // SAFETY: fstat on fd 2 into a zeroed stat buffer we own.
    let st = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        (libc::fstat(2, &mut st) == 0).then_some(st)
    };
    st.is_some_and(|st| st.st_dev == dev && st.st_ino == ino)
}

/// The syslog priority of a level (sd-daemon(3): `<3>` error ... `<7>` debug).
pub fn priority(level: &Level) -> u8 {
    match *level {
        Level::ERROR => 3,
        Level::WARN => 4,
        Level::INFO => 6,
        Level::DEBUG | Level::TRACE => 7,
    }
}

/// An event format led by the event's syslog priority.
struct Priority<F>(F);

impl<S, N, F> FormatEvent<S, N> for Priority<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'w> FormatFields<'w> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        write!(writer, "<{}>", priority(event.metadata().level()))?;
        self.0.format_event(ctx, writer, event)
    }
}

/// Text fields as `key=value`, the value quoted (with `"` and `\` escaped) when it is empty or
/// holds a space, a quote, `=`, a backslash or a control character, so a line splits into its
/// fields unambiguously. The message comes first, unquoted, with control characters escaped so
/// an event stays on one line.
pub struct Logfmt;

impl<'w> FormatFields<'w> for Logfmt {
    fn format_fields<R: tracing_subscriber::field::RecordFields>(
        &self,
        writer: Writer<'w>,
        fields: R,
    ) -> fmt::Result {
        let mut v = LogfmtVisitor {
            writer,
            empty: true,
            result: Ok(()),
        };
        fields.record(&mut v);
        v.result
    }
}

struct LogfmtVisitor<'w> {
    writer: Writer<'w>,
    empty: bool,
    result: fmt::Result,
}

impl LogfmtVisitor<'_> {
    fn write(&mut self, field: &Field, value: &str) {
        if self.result.is_err() || field.name().starts_with("log.") {
            return;
        }
        let sep = if std::mem::take(&mut self.empty) {
            ""
        } else {
            " "
        };
        self.result = match field.name() {
            "message" => write!(self.writer, "{sep}{}", one_line(value)),
            name => {
                let name = name.strip_prefix("r#").unwrap_or(name);
                write!(self.writer, "{sep}{name}={}", quote(value))
            }
        };
    }
}

impl Visit for LogfmtVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.write(field, value);
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        // The error and its causes, outermost first.
        let mut text = value.to_string();
        let mut source = value.source();
        while let Some(s) = source {
            text.push_str(": ");
            text.push_str(&s.to_string());
            source = s.source();
        }
        self.write(field, &text);
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.write(field, &format!("{value:?}"));
    }
}

/// `value` as a logfmt value: bare when it is safe, else in double quotes with `"`, `\` and
/// control characters escaped.
pub fn quote(value: &str) -> std::borrow::Cow<'_, str> {
    let unsafe_char =
        |c: char| c.is_whitespace() || c.is_control() || matches!(c, '"' | '=' | '\\');
    if !value.is_empty() && !value.chars().any(unsafe_char) {
        return value.into();
    }
    let mut out = String::with_capacity(value.len() + 2);
    out.push('"');
    for c in value.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => out.push_str(&c.escape_unicode().to_string()),
            c => out.push(c),
        }
    }
    out.push('"');
    out.into()
}

/// A message with its control characters (line breaks) escaped.
fn one_line(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.chars().any(char::is_control) {
        return s.into();
    }
    s.chars()
        .map(|c| match c {
            '\n' => "\\n".to_string(),
            '\r' => "\\r".to_string(),
            '\t' => "\\t".to_string(),
            c if c.is_control() => c.escape_unicode().to_string(),
            c => c.to_string(),
        })
        .collect::<String>()
        .into()
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    #[test]
    fn repeats_log_the_first_at_once_then_one_line_per_interval_with_the_count() {
        let t0 = std::time::Instant::now();
        let s = std::time::Duration::from_secs;
        let mut r = Repeats::new(s(10));
        r.record();
        assert_eq!(r.due(t0), Some(1));
        for i in 1..147 {
            r.record();
            assert_eq!(r.due(t0 + std::time::Duration::from_millis(i)), None);
        }
        assert_eq!(r.due(t0 + s(5)), None);
        assert_eq!(r.due(t0 + s(10)), Some(146));
        assert_eq!(r.due(t0 + s(30)), None, "nothing new: no line");
        r.record();
        assert_eq!(r.due(t0 + s(31)), Some(1));
    }

    /// A writer into a shared buffer.
    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Buf {
        type Writer = Buf;
        fn make_writer(&'a self) -> Buf {
            self.clone()
        }
    }

    /// What `emit` logs with `format` (journal or not), as text.
    fn capture(format: LogFormat, journal: bool, emit: impl FnOnce()) -> String {
        let buf = Buf::default();
        let opts = Options {
            format,
            journal,
            ansi: false,
        };
        let sub = subscriber(opts, EnvFilter::new("trace"), buf.clone());
        tracing::subscriber::with_default(sub, emit);
        let bytes = buf.0.lock().unwrap().clone();
        String::from_utf8(bytes).unwrap()
    }

    fn delivery_failed() {
        let url = "http://127.0.0.1:9/alerts";
        let why = "HTTP 503 Service Unavailable";
        tracing::warn!(%url, error = %why, kind = "close_wait_buildup", count = 12, empty = "",
            quoted = "say \"hi\"", eq = "a=b", retry_in = ?std::time::Duration::from_secs(2),
            "webhook delivery failed; will retry");
    }

    #[test]
    fn text_quotes_values_that_need_it() {
        let out = capture(LogFormat::Text, false, delivery_failed);
        assert_eq!(out.lines().count(), 1, "{out}");
        let (_, rest) = out.split_once(" WARN ").unwrap_or_else(|| panic!("{out}"));
        assert_eq!(
            rest.trim_end(),
            "connreap::logging::tests: webhook delivery failed; will retry \
             url=http://127.0.0.1:9/alerts error=\"HTTP 503 Service Unavailable\" \
             kind=close_wait_buildup count=12 empty=\"\" quoted=\"say \\\"hi\\\"\" \
             eq=\"a=b\" retry_in=2s"
        );
        // The line starts with an RFC 3339 timestamp, not a priority.
        assert!(out.starts_with("20"), "{out}");
    }

    #[test]
    fn text_keeps_an_event_on_one_line() {
        let out = capture(LogFormat::Text, false, || {
            tracing::info!(detail = "two\nlines", "first\nsecond")
        });
        assert_eq!(out.lines().count(), 1, "{out}");
        assert!(
            out.contains(r#"first\nsecond detail="two\nlines""#),
            "{out}"
        );
    }

    #[test]
    fn text_errors_name_their_causes() {
        let e = std::io::Error::other("connection refused");
        let outer = anyhow::Error::new(e).context("webhook delivery failed");
        let err: &(dyn std::error::Error + 'static) = outer.as_ref();
        let out = capture(LogFormat::Text, false, || tracing::error!(error = err, "x"));
        assert!(
            out.contains(r#"x error="webhook delivery failed: connection refused""#),
            "{out}"
        );
    }

    #[test]
    fn json_is_one_object_per_line_with_flat_fields() {
        let out = capture(LogFormat::Json, false, delivery_failed);
        assert_eq!(out.lines().count(), 1, "{out}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        assert_eq!(v["level"], "WARN", "{v}");
        assert_eq!(v["message"], "webhook delivery failed; will retry", "{v}");
        assert_eq!(v["error"], "HTTP 503 Service Unavailable", "{v}");
        assert_eq!(v["count"], 12, "{v}");
        assert_eq!(v["quoted"], "say \"hi\"", "{v}");
        assert_eq!(v["target"], "connreap::logging::tests", "{v}");
        assert!(v["timestamp"].is_string(), "{v}");
    }

    #[test]
    fn journal_lines_lead_with_the_syslog_priority() {
        let out = capture(LogFormat::Text, true, || {
            tracing::error!("e");
            tracing::warn!("w");
            tracing::info!("i");
            tracing::debug!("d");
        });
        let prefixes: Vec<&str> = out.lines().map(|l| &l[..3]).collect();
        assert_eq!(prefixes, ["<3>", "<4>", "<6>", "<7>"], "{out}");
        // No timestamp: the journal stamps every line itself.
        assert!(
            out.lines().next().unwrap().starts_with("<3>ERROR "),
            "{out}"
        );
        let out = capture(LogFormat::Json, true, || tracing::warn!(n = 1, "w"));
        let line = out.trim();
        assert!(line.starts_with("<4>{"), "{out}");
        let v: serde_json::Value = serde_json::from_str(&line[3..]).unwrap();
        assert_eq!(v["message"], "w");
    }

    #[test]
    fn quote_cases() {
        for (raw, quoted) in [
            ("plain", "plain"),
            ("12.5", "12.5"),
            ("127.0.0.1:80", "127.0.0.1:80"),
            ("", "\"\""),
            ("two words", "\"two words\""),
            ("a=b", "\"a=b\""),
            ("back\\slash", "\"back\\\\slash\""),
            ("tab\there", "\"tab\\there\""),
            ("bell\u{7}", "\"bell\\u{7}\""),
            ("naïve", "naïve"),
        ] {
            assert_eq!(quote(raw), quoted, "{raw:?}");
        }
    }

    #[test]
    fn config_key_takes_text_or_json() {
        let cfg = crate::config::parse("[agent]\nlog_format = \"json\"\n", "t.toml").unwrap();
        assert_eq!(cfg.agent.log_format, LogFormat::Json);
        let e = crate::config::parse("[agent]\nlog_format = \"xml\"\n", "t.toml").unwrap_err();
        let e = e.to_string();
        assert!(e.contains("t.toml:2:") && e.contains("log_format"), "{e}");
        assert!(e.contains("text") && e.contains("json"), "{e}");
        assert_eq!(priority(&Level::TRACE), 7);
    }
}
