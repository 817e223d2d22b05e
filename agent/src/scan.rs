//! One scan: run both iterators and merge them into the socket table.
use std::{collections::HashMap, fs};

use crate::{
    kernel::{Kernel, KernelError},
    table::{self, FirstSeen, Socket},
};

pub struct Scanner {
    pub kernel: Kernel,
    host: table::HostInfo,
    first_seen: FirstSeen,
    units: HashMap<u32, Option<String>>,
}

impl Scanner {
    pub fn new(kernel: Kernel) -> Self {
        // The namespace's ephemeral port range (falls back to Linux's default).
        let ephemeral = fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|t| table::parse_port_range(&t))
            .unwrap_or_else(|| table::HostInfo::default().ephemeral);
        Scanner {
            host: table::HostInfo {
                hz: kernel.hz,
                ephemeral,
            },
            kernel,
            first_seen: FirstSeen::default(),
            units: HashMap::new(),
        }
    }

    pub fn scan(&mut self) -> Result<Vec<Socket>, KernelError> {
        let socks = self.kernel.dump_sockets()?;
        let owners = self.kernel.dump_owners()?;
        self.first_seen.update(&socks);
        // Forget units of pids that hold no socket any more (pids get reused).
        let live: std::collections::HashSet<u32> = owners.iter().map(|o| o.tgid).collect();
        self.units.retain(|pid, _| live.contains(pid));
        let units = &mut self.units;
        let mut unit_of = |pid: u32| {
            units
                .entry(pid)
                .or_insert_with(|| {
                    fs::read_to_string(format!("/proc/{pid}/cgroup"))
                        .ok()
                        .and_then(|c| table::unit_from_cgroup(&c))
                })
                .clone()
        };
        Ok(table::build(
            &socks,
            &owners,
            &self.host,
            &self.first_seen,
            &mut unit_of,
        ))
    }
}
