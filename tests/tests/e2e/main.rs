//! connreap end to end, one scenario per file (like aya's `integration-test`), all in one test
//! binary (one link instead of one per file). Every privileged test runs in its own network
//! namespace with real processes and real sockets, written with `connreap_tests::harness`;
//! tests that cannot run (no root, no `ip`, no BTF) print `skipped: <reason>` and pass, except
//! under `CI=true`.
//!
//! - `snapshot`: `connreap snapshot --json` against sockets made by `connreap-testpeer`.
//! - `daemon`: `connreap run` reproducing the incidents; what a webhook receiver got and what
//!   the HTTP API serves.
//! - `reclaim`: reclaim under policy, checked where it has effects (the relay's `/status`, a
//!   real request through the chain, `ss`, the audit log, the API, the processes).
//! - `safety`: faults an adversarial operator would try (issue 16) and what connreap does.
//! - `alerting`: the real Prometheus (Debian's package) scraping the agent with the shipped
//!   rules.
//! - `fixtures_selftest`: the incident fixtures themselves (no namespace, no root, except
//!   `netns_variants`).
//!
//! Every wait is a bounded poll; scans run every second and thresholds and ages are a few
//! seconds, so each test takes well under a minute even on a loaded machine.

mod alerting;
mod daemon;
mod fixtures_selftest;
mod reclaim;
mod safety;
mod snapshot;
