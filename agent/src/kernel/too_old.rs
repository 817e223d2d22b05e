//! Telling "this kernel is too old" from other refusals. An old verifier does not say so: it
//! rejects an instruction or a helper it does not know (Linux 5.10 on the tracker's 64-bit
//! compare-and-exchange: `BPF_STX uses reserved fields`). [`diagnose`] maps what the verifier
//! said to the missing feature and the first Linux release that has it, so the one error line
//! names both.

/// The oldest kernel connreap runs on: the newest feature in the table of README's
/// Requirements (64-bit compare-and-exchange in BPF programs).
pub const MIN_KERNEL: (u32, u32) = (5, 12);
/// [`MIN_KERNEL`] as written.
pub const MIN_RELEASE: &str = "5.12";

/// What the running kernel lacks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TooOld {
    /// The running kernel's release (`uname -r`).
    pub release: String,
    /// The missing feature, as a user reads it.
    pub feature: String,
    /// The first Linux release that has it ("5.12").
    pub since: &'static str,
    /// The verifier's line that told, if one did.
    pub evidence: Option<String>,
}

impl std::fmt::Display for TooOld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "kernel too old: Linux {} lacks {} (Linux {}+); connreap needs Linux {MIN_RELEASE} \
             or newer",
            self.release, self.feature, self.since
        )?;
        if let Some(e) = &self.evidence {
            write!(f, " (the verifier said \"{e}\")")?;
        }
        Ok(())
    }
}

/// Verifier messages of kernels that do not know the BPF_ATOMIC instructions of Linux 5.12
/// (before 5.12 only `BPF_XADD`, a plain add, existed in that encoding).
const NO_ATOMICS: [&str; 3] = [
    "BPF_STX uses reserved fields",
    "BPF_XADD uses reserved fields",
    "invalid atomic opcode",
];

/// BPF helpers connreap's programs call: id, name, first Linux release.
const HELPERS: [(u32, &str, &str); 10] = [
    (5, "bpf_ktime_get_ns", "4.1"),
    (16, "bpf_get_current_comm", "4.2"),
    (113, "bpf_probe_read_kernel", "5.5"),
    (118, "bpf_jiffies64", "5.5"),
    (127, "bpf_seq_write", "5.9"),
    (130, "bpf_ringbuf_output", "5.8"),
    (131, "bpf_ringbuf_reserve", "5.8"),
    (137, "bpf_skc_to_tcp_sock", "5.9"),
    (138, "bpf_skc_to_tcp_timewait_sock", "5.9"),
    (162, "bpf_sock_from_file", "5.11"),
];

/// What the verifier log (and the running release) say about a refused program: `Some` when
/// the kernel lacks a feature connreap needs.
pub fn diagnose(verifier_log: &str, release: &str) -> Option<TooOld> {
    let too_old = |feature: String, since, evidence: &str| TooOld {
        release: release.to_string(),
        feature,
        since,
        evidence: Some(evidence.trim().to_string()),
    };
    for line in verifier_log.lines() {
        if NO_ATOMICS.iter().any(|m| line.contains(m)) {
            return Some(too_old(
                "64-bit atomic compare-and-exchange in BPF programs (BPF_ATOMIC cmpxchg)".into(),
                "5.12",
                line,
            ));
        }
        // Newer verifiers: "invalid func unknown#162"; older: "unknown func bpf_x#162" for a
        // helper this program type may not call there.
        if let Some(id) = helper_id(line) {
            let (name, since) = HELPERS
                .iter()
                .find(|(i, _, _)| *i == id)
                .map(|(_, n, s)| (format!("the BPF helper {n}"), *s))
                .unwrap_or_else(|| (format!("BPF helper #{id}"), "?"));
            return Some(too_old(name, since, line));
        }
    }
    // Refused for another reason on a kernel older than the minimum: say the kernel is too old
    // without guessing the feature.
    (release_version(release)? < MIN_KERNEL).then(|| TooOld {
        release: release.to_string(),
        feature: "some of the BPF features connreap uses (see README: Requirements)".into(),
        since: MIN_RELEASE,
        evidence: None,
    })
}

/// The helper id in "invalid func unknown#162" / "unknown func bpf_x#162".
fn helper_id(line: &str) -> Option<u32> {
    let rest = line
        .split_once("invalid func unknown#")
        .or_else(|| line.split_once("unknown func "))?
        .1;
    let digits = rest.rsplit_once('#').map_or(rest, |(_, d)| d);
    let end = digits
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(digits.len());
    digits[..end].parse().ok()
}

/// (major, minor) of a release like "5.10.0-46-cloud-amd64".
fn release_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// The running kernel's release.
pub fn running_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|r| r.trim().to_string())
        .unwrap_or_else(|_| "(unknown release)".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole verifier log of Debian 11's Linux 5.10.262 for the tracker (`connreap -v
    /// snapshot` under QEMU): it fails on the first pass, before any instruction is printed.
    const LOG_5_10: &str = "BPF_STX uses reserved fields\nverification time 226 usec\n\
        stack depth 0+0\nprocessed 0 insns (limit 1000000) max_states_per_insn 0 total_states 0 \
        peak_states 0 mark_read 0\n\n";

    #[test]
    fn cmpxchg_on_5_10_is_named_with_its_release() {
        let d = diagnose(LOG_5_10, "5.10.0-46-cloud-amd64").expect("diagnosed");
        assert_eq!(d.since, "5.12");
        assert!(d.feature.contains("compare-and-exchange"), "{d:?}");
        assert_eq!(d.evidence.as_deref(), Some("BPF_STX uses reserved fields"));
        let line = d.to_string();
        assert!(!line.contains('\n'), "{line}");
        assert_eq!(
            line,
            "kernel too old: Linux 5.10.0-46-cloud-amd64 lacks 64-bit atomic compare-and-exchange \
             in BPF programs (BPF_ATOMIC cmpxchg) (Linux 5.12+); connreap needs Linux 5.12 or \
             newer (the verifier said \"BPF_STX uses reserved fields\")"
        );
        for old in [
            "BPF_XADD uses reserved fields",
            "BPF_ATOMIC uses invalid atomic opcode f1",
        ] {
            assert_eq!(diagnose(old, "5.11.0").map(|d| d.since), Some("5.12"));
        }
    }

    #[test]
    fn a_missing_helper_is_named() {
        let d = diagnose(
            "5: (85) call unknown#162\ninvalid func unknown#162\n",
            "5.4.0",
        )
        .unwrap();
        assert_eq!(
            (d.feature.as_str(), d.since),
            ("the BPF helper bpf_sock_from_file", "5.11")
        );
        let d = diagnose("unknown func bpf_seq_write#127\n", "5.8.0").unwrap();
        assert_eq!(
            (d.feature.as_str(), d.since),
            ("the BPF helper bpf_seq_write", "5.9")
        );
        let d = diagnose("invalid func unknown#999\n", "6.1.0").unwrap();
        assert_eq!((d.feature.as_str(), d.since), ("BPF helper #999", "?"));
    }

    #[test]
    fn other_refusals_say_too_old_only_below_the_minimum() {
        let log = "R1 invalid mem access 'scalar'\n";
        assert_eq!(diagnose(log, "6.1.0-57-cloud-amd64"), None);
        assert_eq!(diagnose(log, "5.12.0"), None);
        assert_eq!(diagnose(log, "garbage"), None);
        let d = diagnose(log, "5.11.22").unwrap();
        assert_eq!((d.since, d.evidence.as_deref()), ("5.12", None));
        assert!(d
            .to_string()
            .starts_with("kernel too old: Linux 5.11.22 lacks "));
    }

    #[test]
    fn parses_releases() {
        assert_eq!(release_version("5.10.0-46-cloud-amd64"), Some((5, 10)));
        assert_eq!(release_version("6.18.44-fc-v1252"), Some((6, 18)));
        assert_eq!(release_version("6"), None);
    }
}
