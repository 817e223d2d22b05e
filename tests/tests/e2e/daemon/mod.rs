//! `connreap run` end to end: real processes and real sockets reproducing the incidents, the
//! agent started inside the test's namespace with a config file, and assertions on what a
//! webhook receiver got and what the HTTP API serves.

mod config;
mod flush;
mod own_namespace;
mod owners;
mod pool_leak;
mod quota_source;
mod relay;
mod restart_alerts;
mod series;
mod storm;
mod webhook_redirect;
mod webhook_retry;
