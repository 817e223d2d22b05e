//! Proves the incident-1 fixtures work: instance-sim <- relay-sim <- leaky-proxy on plain
//! loopback with free ports (no namespace, no root), the QuotaServer modes and the
//! WebhookReceiver. One extra test exercises the `*_in_netns` variants; it needs root and
//! `ip` and is skipped (with a message) without them.

use std::io::Write;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use connreap_tests::fixtures::{
    abandon_requests, abandon_requests_in_netns, free_addr, get_json, get_json_in_netns, http_get,
    http_get_in_netns, http_post_json, http_post_json_in_netns, relay_status_json,
    ss_established_on_port, wait_until, EndpointStatus, QuotaMode, QuotaServer, ReadyChild,
    SsSocket, TempNetns, WebhookReceiver,
};
use connreap_tests::fixtures::{http::connect, ss_tcp};
use connreap_tests::harness::{program, Chain, ChainAddrs, INSTANCE_SIM, READY_TIMEOUT};
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(5);

#[test]
fn incident1_chain_leaks_fills_quota_and_recovers_on_proxy_restart() {
    let mut chain = Chain::spawn(None, ChainAddrs::free(4));
    let ChainAddrs {
        instance: inst,
        dial,
        proxy,
        ..
    } = chain.addrs;

    // The relay's status document has the documented shape.
    assert_eq!(
        chain.status(),
        relay_status_json(
            &[EndpointStatus {
                port: inst.port(),
                dial_port: dial.port(),
                streams: 0,
                max_streams: 4
            }],
            0,
            0,
            0
        )
    );

    // The real path works: 200 WITH a body, and the stream is released afterwards.
    chain.assert_json_ok();
    assert!(
        wait_until(T, || chain.streams() == 0),
        "stream not released"
    );

    // Four users open a quiet SSE page and give up after a second ...
    chain.leak(4, Duration::from_secs(1));
    // ... and the quota is full, for good.
    assert!(wait_until(T, || chain.streams() == 4), "{}", chain.status());
    let st = chain.status();
    assert_eq!(st["streamsOpened"], json!(5));
    assert_eq!(st["dialDenied"], json!(0));

    // Every new request is refused by the relay and answered 503 busy by the proxy.
    let (code, body) = chain.get_json();
    assert_eq!((code, body.as_str()), (503, "busy"));
    let st = chain.status();
    assert_eq!(st["dialDenied"], json!(1));
    assert_eq!(st["refused"], json!(1));
    assert_eq!(st["endpoints"][0]["streams"], json!(4));

    assert_idle_pairs_as_ss_shows_them(&chain);

    // Only a restart of the proxy frees it.
    chain.kill_proxy();
    assert!(wait_until(T, || chain.streams() == 0), "{}", chain.status());
    assert!(wait_until(T, || {
        ss_established_on_port(None, dial.port()).is_ok_and(|v| v.is_empty())
            && ss_established_on_port(None, inst.port()).is_ok_and(|v| v.is_empty())
    }));
    chain.restart_proxy();
    chain.assert_json_ok();
    assert!(wait_until(T, || chain.streams() == 0));

    // A busy long-lived stream works through the chain; a client leaving it leaks it too
    // (the proxy keeps draining the upstream), although it is never idle.
    let ab = abandon_requests(proxy, "/ticks", 1, Duration::from_millis(1200)).unwrap();
    assert_eq!(ab.responded, 1);
    assert!(wait_until(T, || chain.streams() == 1), "{}", chain.status());
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(chain.streams(), 1, "leaked streams are never reclaimed");
}

/// What the operators saw with `ss -tn`: 4 idle ESTABLISHED pairs proxy<->relay (held by the
/// proxy and the relay) and 4 relay<->instance, all with empty queues; the clients' sockets
/// to the proxy are gone.
fn assert_idle_pairs_as_ss_shows_them(chain: &Chain) {
    let ChainAddrs {
        instance: inst,
        dial,
        proxy,
        ..
    } = chain.addrs;
    let mut last: Vec<SsSocket> = Vec::new();
    let ok = wait_until(T, || {
        let (Ok(d), Ok(i), Ok(p)) = (
            ss_established_on_port(None, dial.port()),
            ss_established_on_port(None, inst.port()),
            ss_established_on_port(None, proxy.port()),
        ) else {
            return false;
        };
        let proxy_side = d.iter().filter(|x| x.peer == dial).count();
        let relay_side = d.iter().filter(|x| x.local == dial).count();
        let relay_out = i.iter().filter(|x| x.peer == inst).count();
        let instance_side = i.iter().filter(|x| x.local == inst).count();
        let idle = d.iter().chain(&i).all(|x| x.recv_q == 0 && x.send_q == 0);
        let owners_ok = d
            .iter()
            .filter(|x| x.peer == dial)
            .all(|x| x.pids.is_empty() || x.pids.contains(&chain.proxy_pid()))
            && d.iter()
                .filter(|x| x.local == dial)
                .all(|x| x.pids.is_empty() || x.pids.contains(&chain.relay_pid()));
        last = d.into_iter().chain(i).chain(p.iter().cloned()).collect();
        proxy_side == 4
            && relay_side == 4
            && relay_out == 4
            && instance_side == 4
            && idle
            && owners_ok
            && p.is_empty()
    });
    assert!(ok, "unexpected sockets: {last:#?}");
}

#[test]
fn ticks_stream_is_busy() {
    let inst = free_addr();
    let _instance = ReadyChild::spawn(
        program(INSTANCE_SIM),
        ["--listen", &inst.to_string()],
        READY_TIMEOUT,
    )
    .unwrap();
    // A raw reader: head, then tick 0 at once and tick 1 about a second later.
    use std::io::Read;
    let mut c = std::net::TcpStream::connect_timeout(&inst, T).unwrap();
    c.set_read_timeout(Some(T)).unwrap();
    std::io::Write::write_all(&mut c, b"GET /ticks HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let t0 = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !String::from_utf8_lossy(&got).contains("data: tick 1\n\n") {
        let n = c.read(&mut buf).unwrap();
        assert!(n > 0, "closed early: {:?}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
        assert!(t0.elapsed() < Duration::from_secs(4));
    }
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
    assert!(text.contains("Content-Type: text/event-stream"), "{text}");
    assert!(text.contains("data: tick 0\n\n"));
    assert!(t0.elapsed() >= Duration::from_millis(800));
    // Unknown paths are 404, /json is JSON.
    assert_eq!(http_get(inst, "/nope", T).unwrap().0, 404);
    let (code, v) = get_json(inst, "/json", T).unwrap();
    assert_eq!((code, v), (200, json!({"ok": true, "instance": "sim"})));
}

#[test]
fn quota_server_modes() {
    let good = relay_status_json(
        &[EndpointStatus {
            port: 21000,
            dial_port: 25001,
            streams: 64,
            max_streams: 64,
        }],
        7,
        7,
        100,
    );
    let q = QuotaServer::start(
        "127.0.0.1:0".parse().unwrap(),
        QuotaMode::Json(good.clone()),
    )
    .unwrap();
    let a = q.addr();
    assert_eq!(get_json(a, "/status", T).unwrap(), (200, good));

    q.set_mode(QuotaMode::Http500);
    assert_eq!(http_get(a, "/status", T).unwrap().0, 500);

    q.set_mode(QuotaMode::Garbage);
    let (code, body) = http_get(a, "/status", T).unwrap();
    assert_eq!(code, 200);
    assert!(serde_json::from_str::<Value>(&body).is_err(), "{body}");

    q.set_mode(QuotaMode::JsonWithoutEndpoints);
    let (code, v) = get_json(a, "/status", T).unwrap();
    assert_eq!(code, 200);
    assert!(v.is_object() && v.get("endpoints").is_none(), "{v}");

    q.set_mode(QuotaMode::Hang);
    let t0 = Instant::now();
    let err = http_get(a, "/status", Duration::from_millis(400)).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "{err}");
    assert!(t0.elapsed() >= Duration::from_millis(350));
    assert!(t0.elapsed() < Duration::from_secs(3));

    q.set_json(json!({"endpoints": []}));
    assert_eq!(
        get_json(a, "/status", T).unwrap(),
        (200, json!({"endpoints": []}))
    );
    assert_eq!(http_get(a, "/other", T).unwrap().0, 404);
    assert_eq!(q.hits(), 6);

    q.stop();
    assert!(
        http_get(a, "/status", T).is_err(),
        "stopped server still answers"
    );
}

#[test]
fn webhook_receiver_records_and_survives_an_outage() {
    let addr = free_addr();
    // Down at first: nothing listens.
    let w = WebhookReceiver::new_stopped(addr);
    assert!(!w.is_running());
    assert!(http_post_json(addr, "/hook", &json!({"n": 0}), T).is_err());

    w.restart().unwrap();
    let (code, _) = http_post_json(addr, "/hook?x=1", &json!({"n": 1, "kind": "leak"}), T).unwrap();
    assert_eq!(code, 200);
    let p = w
        .wait_for_body(T, |b| b["kind"] == "leak")
        .expect("POST recorded");
    assert_eq!(p.path, "/hook?x=1");
    assert_eq!(p.content_type.as_deref(), Some("application/json"));
    assert_eq!(p.body, json!({"n": 1, "kind": "leak"}));
    assert!(p.at.elapsed() < T);

    // Receiver down for a while, then up on the same address; history is kept.
    w.stop();
    assert!(http_post_json(addr, "/hook", &json!({"n": 2}), T).is_err());
    w.restart().unwrap();
    w.set_status(500);
    let (code, _) = http_post_json(addr, "/hook", &json!({"n": 3}), T).unwrap();
    assert_eq!(code, 500);
    let all = w.wait_for_count(2, T);
    let ns: Vec<&Value> = all.iter().map(|p| &p.body["n"]).collect();
    assert_eq!(ns, [&json!(1), &json!(3)]);
    assert!(all[0].at <= all[1].at);
    assert_eq!(http_get(addr, "/hook", T).unwrap().0, 405);
    // A predicate nobody matches times out.
    let t0 = Instant::now();
    assert!(w
        .wait_for(Duration::from_millis(200), |p| p.body["n"] == 99)
        .is_none());
    assert!(t0.elapsed() >= Duration::from_millis(180));
}

#[test]
fn netns_variants() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("skipped: netns_variants needs root");
        return;
    }
    let ns = match TempNetns::create("crfx") {
        Ok(ns) => ns,
        Err(e) => {
            println!("skipped: cannot create a network namespace: {e}");
            return;
        }
    };
    let n = ns.name();
    // A port that is free on the host: whatever listens on it inside `ns` must not be
    // reachable from the host namespace.
    let addr = free_addr();

    let w = WebhookReceiver::start_in_netns(n, addr).unwrap();
    assert_eq!(
        http_post_json_in_netns(n, addr, "/h", &json!({"in": "ns"}), T)
            .unwrap()
            .0,
        200
    );
    assert!(w.wait_for_body(T, |b| b["in"] == "ns").is_some());
    assert!(
        http_post_json(addr, "/h", &json!({}), T).is_err(),
        "host reached the namespace's receiver"
    );
    w.stop();

    let q =
        QuotaServer::start_in_netns(n, addr, QuotaMode::Json(json!({"endpoints": []}))).unwrap();
    assert_eq!(
        get_json_in_netns(n, addr, "/status", T).unwrap(),
        (200, json!({"endpoints": []}))
    );
    q.stop();

    // The binaries inside the namespace, on their default ports.
    let inst: SocketAddr = "127.0.0.1:21000".parse().unwrap();
    let child = ReadyChild::spawn_in_netns(
        n,
        program(INSTANCE_SIM),
        ["--listen", "127.0.0.1:21000"],
        READY_TIMEOUT,
    )
    .unwrap();
    let (code, body) = http_get_in_netns(n, inst, "/json", T).unwrap();
    assert_eq!(code, 200);
    assert!(!body.is_empty());
    let ab = abandon_requests_in_netns(n, inst, "/events", 2, Duration::from_millis(300)).unwrap();
    assert_eq!((ab.connected, ab.responded), (2, 2));
    // ss inside the namespace sees a held stream and who owns it; the host's ss does not.
    let held = connect(Some(n), inst, T).unwrap();
    (&held)
        .write_all(b"GET /events HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let pid = child.pid();
    assert!(wait_until(T, || {
        ss_established_on_port(Some(n), 21000).is_ok_and(|v| {
            v.len() == 2 && v.iter().any(|x| x.local == inst && x.pids.contains(&pid))
        })
    }));
    assert!(ss_tcp(None).unwrap().iter().all(|x| !x.pids.contains(&pid)));
    drop(held);
    drop(child);
}
