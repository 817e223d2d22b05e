//! `connreap_sockets` series do not grow with ephemeral ports: hundreds of TIME_WAIT sockets
//! left by a server whose listener is gone, each with another peer port, are one series.

use std::collections::BTreeSet;

use connreap_tests::harness::{
    require_privileges, wait_until, Agent, Child, Config, NetNs, TempDir, POLL, READY_TIMEOUT, SCAN,
};

const CONNECTIONS: usize = 400;

#[test]
fn time_wait_sockets_of_a_gone_listener_are_not_one_series_per_ephemeral_port() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("series");
    let dir = TempDir::new("series");
    let mut agent = Agent::start(&ns, &dir, &Config::new(&dir));
    // The server closes first (its ends go to TIME_WAIT), the clients close after, then the
    // listener is closed: hundreds of TIME_WAIT sockets on 7900, each to another peer port.
    let script = format!(
        "import socket, time\n\
         l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
         l.bind(('127.0.0.1', 7900)); l.listen(1024)\n\
         cs = [socket.create_connection(('127.0.0.1', 7900)) for _ in range({CONNECTIONS})]\n\
         ss = [l.accept()[0] for _ in range({CONNECTIONS})]\n\
         [s.close() for s in ss]\n\
         time.sleep(0.2)\n\
         [c.close() for c in cs]\n\
         l.close()\n\
         print('ready', flush=True)\n\
         time.sleep(600)\n"
    );
    let mut server = Child::spawn(
        ns.command("python3").args(["-c", &script]),
        "python3 server",
    );
    server.wait_ready(READY_TIMEOUT);
    let ports = wait_until(SCAN * 10, POLL, || {
        agent.assert_alive();
        let m = agent.metrics();
        let tw: Vec<_> = m
            .samples()
            .iter()
            .filter(|s| {
                s.name == "connreap_sockets"
                    && s.labels.get("state").map(String::as_str) == Some("TIME_WAIT")
            })
            .cloned()
            .collect();
        let total: f64 = tw.iter().map(|s| s.value).sum();
        (total >= CONNECTIONS as f64).then_some(tw)
    })
    .unwrap_or_else(|| panic!("the TIME_WAIT sockets never showed:\n{}", agent.metrics()));
    let labels: BTreeSet<String> = ports
        .iter()
        .map(|s| s.labels.get("service_port").cloned().unwrap_or_default())
        .collect();
    // 7900 (the gone listener's, outside the ephemeral range), `ephemeral`, and the agent's
    // API port for its own scrapes' TIME_WAIT sockets: never one per peer port.
    assert!(
        labels.len() <= 3
            && labels
                .iter()
                .all(|l| l == "ephemeral" || l.parse::<u16>().is_ok_and(|p| p < 32768)),
        "{} TIME_WAIT series for {CONNECTIONS} sockets, service_port labels {labels:?}",
        ports.len()
    );
}
