//! A webhook receiver that answers `307 Location: <another host>` must not get the alert
//! re-posted there: the redirect is a failed delivery (counted, logged with the status and the
//! Location), retried, and nothing ever reaches the other address.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpListener},
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    thread,
};

use connreap_tests::{
    fixtures::{run_in_netns, WebhookReceiver},
    harness::{peer, require_privileges, wait_until, Agent, Config, NetNs, TempDir, FINDING, POLL},
};

/// A receiver that answers every request with a redirect to `to`, counting the requests.
fn redirector(ns: &NetNs, to: String) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = run_in_netns(ns.name(), || TcpListener::bind("127.0.0.1:0"))
        .unwrap_or_else(|e| panic!("bind the redirecting receiver: {e}"));
    let addr = listener.local_addr().expect("local addr");
    let hits = Arc::new(AtomicUsize::new(0));
    let counted = hits.clone();
    thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut c) = conn else { continue };
            let mut buf = [0u8; 65536];
            let _ = c.read(&mut buf);
            counted.fetch_add(1, Ordering::SeqCst);
            let _ = write!(
                c,
                "HTTP/1.1 307 Temporary Redirect\r\nLocation: {to}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            );
        }
    });
    (addr, hits)
}

#[test]
fn a_redirecting_webhook_receiver_never_gets_the_alert_re_posted_elsewhere() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("hookredir");
    let dir = TempDir::new("hookredir");
    let thief = WebhookReceiver::start_in_netns(ns.name(), "127.0.0.2:7999".parse().unwrap())
        .unwrap_or_else(|e| panic!("the other receiver: {e}"));
    let stolen = thief.url("/stolen");
    let (at, hits) = redirector(&ns, stolen.clone());
    let url = format!("http://{at}/alerts");
    let (cw, _) = peer(
        &ns,
        &["close-wait", "--addr", "127.0.0.1:7600", "--count", "2"],
    );
    let config = Config::alerting_to(&dir, &url)
        .detect("close_wait_min_age = \"1s\"\nclose_wait_threshold = 2");
    let agent = Agent::start(&ns, &dir, &config);

    let errors = format!(r#"connreap_webhook_sends_total{{receiver="{url}",result="error"}}"#);
    let retried = wait_until(FINDING, POLL, || {
        agent
            .metric(&errors)
            .filter(|n| *n >= 2.0 && hits.load(Ordering::SeqCst) >= 2)
    });
    assert!(
        retried.is_some(),
        "the redirect should count as a failed delivery, retried (requests {}, pid {}): {}",
        hits.load(Ordering::SeqCst),
        cw.pid(),
        agent.metrics()
    );
    assert_eq!(
        thief.count(),
        0,
        "the alert was re-posted to the redirect's Location: {:?}",
        thief.posts()
    );
    let ok = format!(r#"connreap_webhook_sends_total{{receiver="{url}",result="ok"}}"#);
    assert_eq!(agent.metric(&ok).unwrap_or(0.0), 0.0, "{}", agent.metrics());
    let stderr = agent.stderr();
    assert!(
        stderr.lines().any(|l| l.contains("webhook delivery failed")
            && l.contains("307")
            && l.contains(&format!("redirect to {stolen} not followed"))),
        "no log line names the redirect and its Location:\n{stderr}"
    );
}
