//! connreap with the real alerting stack users run next to it (Debian packages): Alertmanager
//! receiving its alerts, Prometheus scraping /metrics with the shipped rules, promtool checking a scrape.

mod alertmanager;
mod metrics_text;
mod prometheus;
