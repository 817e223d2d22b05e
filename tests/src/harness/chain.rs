//! Incident 1's chain of real processes: instance-sim <- relay-sim (a quota of streams per
//! target port) <- leaky-proxy (never aborts its upstream when a user leaves).

use std::{net::SocketAddr, time::Duration};

use serde_json::{json, Value};

use super::{
    consts::{
        DIAL, HTTP, INSTANCE, INSTANCE_SIM, LEAKY_PROXY, MAX_STREAMS, PROXY, READY_TIMEOUT,
        RELAY_SIM, RELAY_STATUS,
    },
    netns::NetNs,
    process::program,
};
use crate::fixtures::{
    abandon_requests_with, free_addr, http_request_ns, ss_tcp, GiveUp, HttpResponse, ReadyChild,
    SsSocket,
};

/// Where the chain's processes listen.
#[derive(Debug, Clone, Copy)]
pub struct ChainAddrs {
    pub instance: SocketAddr,
    /// The relay's dial slot for `instance`: the proxy's upstream.
    pub dial: SocketAddr,
    /// The relay's `GET /status`.
    pub status: SocketAddr,
    pub proxy: SocketAddr,
    /// The relay's quota of streams.
    pub max_streams: u64,
}

impl ChainAddrs {
    /// The production ports ([`INSTANCE`], [`DIAL`], [`RELAY_STATUS`], [`PROXY`],
    /// [`MAX_STREAMS`]), for a chain in a test's own namespace.
    pub fn incident() -> ChainAddrs {
        let a = |s: &str| s.parse().expect("socket address");
        ChainAddrs {
            instance: a(INSTANCE),
            dial: a(DIAL),
            status: a(RELAY_STATUS),
            proxy: a(PROXY),
            max_streams: MAX_STREAMS,
        }
    }

    /// Free loopback ports of the host's namespace, with a quota of `max_streams`.
    pub fn free(max_streams: u64) -> ChainAddrs {
        ChainAddrs {
            instance: free_addr(),
            dial: free_addr(),
            status: free_addr(),
            proxy: free_addr(),
            max_streams,
        }
    }
}

/// The three processes, killed when dropped.
pub struct Chain {
    ns: Option<String>,
    pub addrs: ChainAddrs,
    _instance: ReadyChild,
    relay: ReadyChild,
    proxy: ReadyChild,
}

impl Chain {
    /// The chain on the production ports inside `ns`, checked to serve `GET /json` through
    /// proxy -> relay -> instance.
    pub fn start(ns: &NetNs) -> Chain {
        let chain = Chain::spawn(Some(ns.name()), ChainAddrs::incident());
        let (code, body) = chain.get_json();
        assert_eq!(code, 200, "fresh chain must serve /json: {body:?}");
        chain
    }

    /// Starts the processes (inside namespace `ns`, or in the host's) and waits until each is
    /// ready; sends no request.
    pub fn spawn(ns: Option<&str>, addrs: ChainAddrs) -> Chain {
        let instance = spawn(ns, INSTANCE_SIM, &["--listen", &addrs.instance.to_string()]);
        let relay = spawn(
            ns,
            RELAY_SIM,
            &[
                "--dial",
                &format!("{}={}", addrs.dial, addrs.instance),
                "--status",
                &addrs.status.to_string(),
                "--max-streams",
                &addrs.max_streams.to_string(),
            ],
        );
        let proxy = spawn(ns, LEAKY_PROXY, &proxy_args(&addrs));
        Chain {
            ns: ns.map(str::to_string),
            addrs,
            _instance: instance,
            relay,
            proxy,
        }
    }

    pub fn relay_pid(&self) -> u32 {
        self.relay.pid()
    }

    /// The running proxy's pid (after [`Chain::kill_proxy`], the dead one's).
    pub fn proxy_pid(&self) -> u32 {
        self.proxy.pid()
    }

    /// SIGKILL the proxy: the kernel closes its sockets, which frees the relay's streams.
    pub fn kill_proxy(&mut self) {
        self.proxy
            .kill()
            .unwrap_or_else(|e| panic!("kill leaky-proxy: {e}"));
    }

    /// A new proxy on the same ports (the old one must be gone).
    pub fn restart_proxy(&mut self) {
        self.proxy = spawn(self.ns.as_deref(), LEAKY_PROXY, &proxy_args(&self.addrs));
    }

    /// `GET /status` of the relay: (status, body) or the error.
    fn try_status(&self) -> std::io::Result<(u16, Value)> {
        let r = self.request(self.addrs.status, "/status")?;
        let v = r.json().map_err(std::io::Error::other)?;
        Ok((r.status, v))
    }

    /// The relay's `/status` document; it must answer 200.
    pub fn status(&self) -> Value {
        let (code, v) = self
            .try_status()
            .unwrap_or_else(|e| panic!("relay /status: {e}"));
        assert_eq!(code, 200, "{v}");
        v
    }

    /// The relay's open streams, `None` when /status does not answer.
    pub fn try_streams(&self) -> Option<u64> {
        self.try_status()
            .ok()
            .and_then(|(_, v)| v["endpoints"][0]["streams"].as_u64())
    }

    /// The relay's open streams.
    pub fn streams(&self) -> u64 {
        let st = self.status();
        st["endpoints"][0]["streams"]
            .as_u64()
            .unwrap_or_else(|| panic!("relay /status without endpoints[0].streams: {st}"))
    }

    /// A real request through proxy -> relay -> instance: (status, body).
    pub fn get_json(&self) -> (u16, String) {
        let r = self
            .request(self.addrs.proxy, "/json")
            .unwrap_or_else(|e| panic!("GET /json through the proxy: {e}"));
        (r.status, r.text())
    }

    /// `GET /json` through the chain answers 200 with the instance's JSON body.
    pub fn assert_json_ok(&self) {
        let (code, body) = self.get_json();
        assert_eq!(code, 200, "GET /json through the chain: {body:?}");
        assert!(!body.is_empty(), "200 without a body");
        let v: Value = serde_json::from_str(&body)
            .unwrap_or_else(|e| panic!("GET /json body is not JSON ({e}): {body:?}"));
        assert_eq!(v["ok"], json!(true), "{body}");
    }

    /// The proxy's upstream sockets (leaky-proxy -> relay dial slot) in `state` as `ss` names
    /// it (`ESTAB`, ...).
    pub fn proxy_upstreams(&self, state: &str) -> Vec<SsSocket> {
        ss_tcp(self.ns.as_deref())
            .unwrap_or_else(|e| panic!("ss: {e}"))
            .into_iter()
            .filter(|x| {
                x.state == state && x.peer == self.addrs.dial && x.pids.contains(&self.proxy.pid())
            })
            .collect()
    }

    /// `n` users open a quiet SSE page through the proxy and give up after `give_up_after`.
    /// Each of them must have got the page's head: a stream through the whole chain.
    pub fn leak(&self, n: usize, give_up_after: Duration) {
        let ab = abandon_requests_with(
            self.ns.as_deref(),
            self.addrs.proxy,
            "/events",
            n,
            give_up_after,
            GiveUp::Close,
        )
        .unwrap_or_else(|e| panic!("abandon {n} requests: {e}"));
        assert_eq!(ab.connected, n, "{ab:?}");
        assert_eq!(
            ab.responded, n,
            "every SSE head must reach its client (a stream through the whole chain): {ab:?}"
        );
    }

    fn request(&self, to: SocketAddr, path: &str) -> std::io::Result<HttpResponse> {
        http_request_ns(self.ns.as_deref(), to, "GET", path, &[], &[], HTTP)
    }
}

fn proxy_args(addrs: &ChainAddrs) -> [String; 4] {
    [
        "--listen".to_string(),
        addrs.proxy.to_string(),
        "--upstream".to_string(),
        addrs.dial.to_string(),
    ]
}

fn spawn<S: AsRef<str>>(ns: Option<&str>, name: &str, args: &[S]) -> ReadyChild {
    let args: Vec<&str> = args.iter().map(AsRef::as_ref).collect();
    let started = match ns {
        Some(ns) => ReadyChild::spawn_in_netns(ns, program(name), &args, READY_TIMEOUT),
        None => ReadyChild::spawn(program(name), &args, READY_TIMEOUT),
    };
    started.unwrap_or_else(|e| panic!("cannot start {name} {args:?}: {e}"))
}
