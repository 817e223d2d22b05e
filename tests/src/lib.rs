//! connreap's privileged end-to-end tests: the fixtures that reproduce the incidents
//! ([`fixtures`], also run as the binaries `instance-sim`, `relay-sim`, `leaky-proxy` and
//! `connreap-testpeer`) and the [`harness`] the tests in `tests/e2e` are written with.

pub mod fixtures;
pub mod harness;
