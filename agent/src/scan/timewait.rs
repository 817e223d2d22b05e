//! What a walk's TIME_WAIT sockets do between walks (plain data, no kernel access): each lives
//! a fixed 60 s from the kernel's stamp of its entry (`tw_entry_ms`, 6.13+), so a scan can
//! tell which of those a walk read are still alive without visiting them, and carry them
//! while the kernel's count of timewait sockets agrees (see `quiet::judge`).
use connreap_ebpf::{sock_flags, tcp_state, SockRecord};

use super::walk::TCP_SYN_RECV;

/// Whether a walk's record is a timewait socket (not a full socket, not a request socket).
pub fn is_timewait(r: &SockRecord) -> bool {
    r.flags & sock_flags::FULL == 0 && r.state != TCP_SYN_RECV
}

/// Whether a walk's record is a TIME_WAIT socket with the kernel's stamp of its entry.
pub fn stamped(r: &SockRecord) -> bool {
    r.state == tcp_state::TIME_WAIT && r.flags & sock_flags::TW_ENTRY != 0
}

/// How long a TIME_WAIT socket lives: `TCP_TIMEWAIT_LEN`, a kernel constant (no sysctl).
const TIMEWAIT_LIFE_MS: u32 = 60_000;
/// How late its timer may fire: the timer wheel rounds a 60 s timeout up to its level's
/// granularity, 512 jiffies at HZ 100 to 1000 (5.12 s at HZ 100); plus a margin.
const TIMEWAIT_LATE_MS: u32 = 6_000;
/// How early it may seem to die. The stamp is the socket's clock as of its last refresh
/// (`tcp_mstamp`, usually its last send), so it can precede the timer's arming by up to a
/// round trip, more when the peer's FIN came late: such a socket outlives `gone` (a quiet
/// scan's count then differs and it walks; between walks its row leaves early).
const TIMEWAIT_EARLY_MS: u32 = 1_000;

/// Milliseconds since a TIME_WAIT socket's stamp, at `now_ns` (a stamp ahead of now: above
/// `u32::MAX / 2`). Both are CLOCK_MONOTONIC; the stamp is its low 32 bits in ms.
pub fn age_ms(r: &SockRecord, now_ns: u64) -> u32 {
    ((now_ns / 1_000_000) as u32).wrapping_sub(r.tw_entry_ms)
}

/// Whether a walk's TIME_WAIT socket is still alive at `now_ns` (CLOCK_MONOTONIC): known only
/// from the kernel's stamp of its entry (`TW_ENTRY`, 6.13+) and outside the seconds around its
/// timer's expiry; None otherwise, and for a timewait socket in FIN_WAIT2 (its timeout is a
/// sysctl, and it may yet enter TIME_WAIT and live another 60 s).
pub fn alive(r: &SockRecord, now_ns: u64) -> Option<bool> {
    if !stamped(r) {
        return None;
    }
    let age = age_ms(r, now_ns);
    if age > u32::MAX / 2 {
        // A stamp ahead of now: it entered just now.
        Some(true)
    } else if age < TIMEWAIT_LIFE_MS - TIMEWAIT_EARLY_MS {
        Some(true)
    } else if age >= TIMEWAIT_LIFE_MS + TIMEWAIT_LATE_MS {
        Some(false)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(flags: u8) -> SockRecord {
        SockRecord {
            flags,
            ..SockRecord::default()
        }
    }

    #[test]
    fn a_timewait_socket_lives_60_s_from_its_stamp() {
        let tw = |stamp_ms: u32| SockRecord {
            state: tcp_state::TIME_WAIT,
            tw_entry_ms: stamp_ms,
            ..rec(sock_flags::TW_ENTRY)
        };
        let at = |ms: u64| ms * 1_000_000;
        let r = tw(10_000);
        assert_eq!(alive(&r, at(10_000)), Some(true));
        assert_eq!(alive(&r, at(68_000)), Some(true));
        assert_eq!(alive(&r, at(69_500)), None, "about to end");
        assert_eq!(alive(&r, at(75_000)), None, "its timer late");
        assert_eq!(alive(&r, at(76_000)), Some(false));
        // A stamp just ahead of the reader's clock; the stamp's 32 bits wrap.
        assert_eq!(alive(&r, at(9_999)), Some(true));
        let wrapped = tw(u32::MAX - 1_000);
        assert_eq!(alive(&wrapped, at(u64::from(u32::MAX) + 2_000)), Some(true));
        // Without the kernel's stamp (before 6.13), or in FIN_WAIT2: not known.
        let no_stamp = SockRecord {
            state: tcp_state::TIME_WAIT,
            ..rec(sock_flags::SINCE_KNOWN)
        };
        assert_eq!(alive(&no_stamp, at(1)), None);
        let fin_wait2 = SockRecord {
            state: tcp_state::FIN_WAIT2,
            ..tw(10_000)
        };
        assert_eq!(alive(&fin_wait2, at(10_001)), None);
    }
}
