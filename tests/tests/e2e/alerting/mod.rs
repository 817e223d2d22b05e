//! The agent with the alerting systems operators run: a real Prometheus scraping /metrics with
//! the shipped rules.

mod prometheus;
