//! HTTP API (axum): health, metrics, sockets, findings, quotas.
use std::{
    sync::{Arc, RwLock},
    time::Instant,
};

use axum::{
    extract::{Query, State},
    http::{header, StatusCode},
    response::{IntoResponse, Response},
    routing::get,
    Json, Router,
};
use serde_json::json;

use crate::{
    alert::Alert, config::Config, metrics::Metrics, quota::QuotaStatus, snapshot::FilterArgs,
    table::Socket,
};

/// What the scan loop publishes for the API.
#[derive(Default)]
pub struct Published {
    pub table: Vec<Socket>,
    pub alerts: Vec<Alert>,
    pub quotas: Vec<QuotaStatus>,
    pub last_scan: Option<Instant>,
    pub last_scan_error: Option<String>,
    pub scans: u64,
    /// Notifications waiting for webhook receivers.
    pub webhook_queued: usize,
}

pub struct AppState {
    pub published: RwLock<Published>,
    pub metrics: Arc<Metrics>,
    pub cfg: Config,
    pub started: Instant,
}

impl AppState {
    pub fn read(&self) -> std::sync::RwLockReadGuard<'_, Published> {
        self.published.read().unwrap_or_else(|e| e.into_inner())
    }
    pub fn write(&self) -> std::sync::RwLockWriteGuard<'_, Published> {
        self.published.write().unwrap_or_else(|e| e.into_inner())
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .route("/v1/sockets", get(sockets))
        .route("/v1/findings", get(findings))
        .route("/v1/quotas", get(quotas))
        .with_state(state)
}

fn error(status: StatusCode, msg: impl Into<String>) -> Response {
    (status, Json(json!({ "error": msg.into() }))).into_response()
}

async fn healthz(State(st): State<Arc<AppState>>) -> Response {
    let p = st.read();
    let interval = st.cfg.agent.scan_interval;
    let age = p.last_scan.map(|t| t.elapsed());
    // Healthy once a scan has completed and scans keep completing.
    let healthy = age.is_some_and(|a| a <= interval * 3 + std::time::Duration::from_secs(5));
    let body = json!({
        "status": if healthy { "ok" } else { "unhealthy" },
        "scans": p.scans,
        "last_scan_age_secs": age.map(|a| a.as_secs_f64()),
        "last_scan_error": p.last_scan_error,
        "sockets": p.table.len(),
        "findings": p.alerts.len(),
        "webhook_queued": p.webhook_queued,
        "uptime_secs": st.started.elapsed().as_secs(),
    });
    let code = if healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(body)).into_response()
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        st.metrics.render(),
    )
        .into_response()
}

async fn sockets(
    State(st): State<Arc<AppState>>,
    q: Result<Query<FilterArgs>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Ok(Query(args)) = q else {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid query string: expected state, port, pid, comm, idle_min",
        );
    };
    let filter = match args.parse() {
        Ok(f) => f,
        Err(e) => return error(StatusCode::BAD_REQUEST, e),
    };
    let p = st.read();
    let selected: Vec<&Socket> = p.table.iter().filter(|s| filter.matches(s)).collect();
    Json(json!({ "count": selected.len(), "sockets": selected })).into_response()
}

async fn findings(State(st): State<Arc<AppState>>) -> Response {
    Json(json!({ "findings": st.read().alerts })).into_response()
}

async fn quotas(State(st): State<Arc<AppState>>) -> Response {
    Json(json!({ "quotas": st.read().quotas })).into_response()
}
