//! connreap end to end, one scenario per file (like aya's `integration-test`), all in one test
//! binary (one link instead of one per file). Every privileged test runs in its own network
//! namespace with real processes and real sockets, written with `connreap_tests::harness`;
//! tests that cannot run (no root, no `ip`, no BTF) print `skipped: <reason>` and pass, except
//! under `CI=true`.
//!
//! - `snapshot`: `connreap snapshot --json` against sockets made by `connreap-testpeer`.
//! - `daemon`: `connreap run` reproducing the incidents; what a webhook receiver got and what
//!   the HTTP API serves.
//! - `detect`: detectors on the hard cases (a relay hop without `port_map`,
//!   one-sided leaks over a veth pair, process names of threaded clients).
//! - `reclaim`: reclaim under policy, checked where it has effects (the relay's `/status`, a
//!   real request through the chain, `ss`, the audit log, the API, the processes).
//! - `safety`: faults reproduced for real (a full or read-only audit filesystem, API
//!   floods, a second daemon, SIGTERM mid-request, lying quota sources, absurd configs, pins
//!   removed or foreign) and what connreap does about them.
//! - `alerting`: the real Prometheus (Debian's package) scraping the agent with the shipped
//!   rules.
//! - `namespaces`: the daemon in the host's namespace covering pods it did not start:
//!   namespaces and cgroups named like containers', the same port in each (attribution,
//!   filters, one finding per pod, a quota polled inside a namespace, policies scoped to a
//!   container, namespaces that vanish).
//! - `pods`: a node's pod layout for real (a bridge in a "node" namespace, pods on
//!   veth pairs, a Service as an iptables DNAT rule, cgroups named as Docker / containerd /
//!   CRI-O name them): incident 1 across pods with a real Node.js proxy, a pair through a
//!   Service, a ghost of a deleted pod, a storm in a pod, a namespace with no name and no
//!   process.
//! - `fixtures_selftest`: the incident fixtures themselves (no namespace, no root, except
//!   `netns_variants`).
//!
//! Every wait is a bounded poll; scans run every second and thresholds and ages are a few
//! seconds, so each test takes well under a minute even on a loaded machine.

mod alerting;
mod daemon;
mod detect;
mod fixtures_selftest;
mod namespaces;
mod pods;
mod reclaim;
mod safety;
mod snapshot;
