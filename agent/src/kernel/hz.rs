//! CONFIG_HZ (the jiffies clock rate), to turn the kernel's jiffies into durations.
use std::{
    fs,
    io::{BufRead, BufReader},
};

/// CONFIG_HZ from the kernel config, or measured from /proc/timer_list.
pub fn kernel_hz() -> u32 {
    if let Some(hz) = config_hz() {
        return hz;
    }
    measure_hz().unwrap_or_else(|| {
        tracing::warn!("cannot determine CONFIG_HZ; assuming 250 for idle times");
        250
    })
}

/// CONFIG_HZ from a kernel config, reading no further than its line (about an eighth of a
/// compressed /proc/config.gz, which every `snapshot` would otherwise inflate whole).
fn parse_config_hz(config: impl BufRead) -> Option<u32> {
    config
        .lines()
        .map_while(Result::ok)
        .find_map(|l| l.strip_prefix("CONFIG_HZ=").map(|v| v.trim().parse().ok()))
        .flatten()
}

fn config_hz() -> Option<u32> {
    if let Ok(f) = fs::File::open("/proc/config.gz") {
        if let Some(hz) = parse_config_hz(BufReader::new(flate2::read::GzDecoder::new(f))) {
            return Some(hz);
        }
    }
    let release = fs::read_to_string("/proc/sys/kernel/osrelease").ok()?;
    let f = fs::File::open(format!("/boot/config-{}", release.trim())).ok()?;
    parse_config_hz(BufReader::new(f))
}

fn measure_hz() -> Option<u32> {
    let sample = || -> Option<(u64, u64)> {
        let t = fs::read_to_string("/proc/timer_list").ok()?;
        let now = t
            .lines()
            .find_map(|l| l.strip_prefix("now at "))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()?;
        let j = t
            .lines()
            .find_map(|l| l.strip_prefix("jiffies: "))?
            .trim()
            .parse()
            .ok()?;
        Some((now, j))
    };
    let (n0, j0) = sample()?;
    std::thread::sleep(std::time::Duration::from_millis(200));
    let (n1, j1) = sample()?;
    let rate = (j1 - j0) as f64 * 1e9 / (n1.checked_sub(n0)? as f64);
    [100u32, 250, 300, 1000]
        .into_iter()
        .min_by_key(|hz| (*hz as f64 - rate).abs() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_config_hz() {
        assert_eq!(
            parse_config_hz("# x\nCONFIG_HZ_250=y\nCONFIG_HZ=250\n".as_bytes()),
            Some(250)
        );
        assert_eq!(parse_config_hz("CONFIG_HZ_1000=y\n".as_bytes()), None);
        assert_eq!(
            parse_config_hz("CONFIG_HZ=x\nCONFIG_HZ=100\n".as_bytes()),
            None
        );
    }
}
