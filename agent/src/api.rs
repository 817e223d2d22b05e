//! HTTP API (axum): health, metrics, sockets, findings, quotas.
use std::{
    sync::{Arc, Mutex, RwLock},
    time::Instant,
};

use axum::{
    extract::{Query, State},
    http::{header, StatusCode},
    response::{IntoResponse, Response},
    routing::{get, post},
    Json, Router,
};
use serde_json::json;

use crate::{
    alert::Alert, config::Config, metrics::Metrics, quota::QuotaStatus, reclaim::exec::Reclaimer,
    scan::Scanner, snapshot::FilterArgs, table::Socket, webhook::Webhooks,
};

/// What the scan loop publishes for the API.
#[derive(Default)]
pub struct Published {
    pub table: Vec<Socket>,
    /// Sockets in the last table (kept while the next one is built).
    pub sockets: usize,
    /// The scan loop freed `table` and is building the next one (the daemon never holds two
    /// tables): readers wait for [`AppState::table_ready`].
    pub table_pending: bool,
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
    /// Signalled when a scan publishes its table (or fails).
    pub table_ready: tokio::sync::Notify,
    pub scanner: Arc<Mutex<Scanner>>,
    pub reclaimer: Arc<Mutex<Reclaimer>>,
    /// Bearer token for POST /v1/reclaim (None: endpoint off).
    pub token: Option<String>,
    pub webhooks: Webhooks,
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
        .route("/v1/reclaims", get(reclaims))
        .route("/v1/reclaim", post(reclaim))
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
        "sockets": p.sockets,
        "findings": p.alerts.len(),
        "webhook_queued": p.webhook_queued,
        "uptime_secs": st.started.elapsed().as_secs(),
        "reclaim_mechanism": st.reclaimer.lock().map(|r| r.mechanism_name().to_string()).unwrap_or_default(),
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
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("{:#}", anyhow::Error::new(e)),
            )
        }
    };
    loop {
        // Registered before the check, so a publication between the two is not missed.
        let ready = st.table_ready.notified();
        tokio::pin!(ready);
        ready.as_mut().enable();
        {
            let p = st.read();
            if !p.table_pending {
                if let Some(e) = &p.last_scan_error {
                    // The table was freed for a scan that failed: say so rather than answer
                    // with an empty list.
                    return error(
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!("the last scan failed: {e}"),
                    );
                }
                let selected: Vec<&Socket> = p.table.iter().filter(|s| filter.matches(s)).collect();
                return match crate::snapshot::socket_list_json(&selected) {
                    Ok(body) => {
                        ([(header::CONTENT_TYPE, "application/json")], body).into_response()
                    }
                    Err(e) => error(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        format!("cannot render the socket table: {e}"),
                    ),
                };
            }
        }
        ready.await;
    }
}

async fn findings(State(st): State<Arc<AppState>>) -> Response {
    Json(json!({ "findings": st.read().alerts })).into_response()
}

async fn quotas(State(st): State<Arc<AppState>>) -> Response {
    Json(json!({ "quotas": st.read().quotas })).into_response()
}

async fn reclaims(State(st): State<Arc<AppState>>) -> Response {
    let recent = st.reclaimer.lock().map(|r| r.recent()).unwrap_or_default();
    Json(json!({ "reclaims": recent })).into_response()
}

#[derive(serde::Deserialize)]
struct ReclaimRequest {
    policy: String,
    #[serde(default)]
    dry_run: bool,
}

fn authorized(st: &AppState, headers: &axum::http::HeaderMap) -> Result<(), Box<Response>> {
    let Some(token) = &st.token else {
        return Err(Box::new(error(
            StatusCode::NOT_FOUND,
            "POST /v1/reclaim is off: set api.token_file in the config",
        )));
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    // Constant-time comparison of the token bytes.
    let ok = given.is_some_and(|g| {
        g.len() == token.len()
            && g.bytes()
                .zip(token.bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    });
    if ok {
        Ok(())
    } else {
        Err(Box::new(error(
            StatusCode::UNAUTHORIZED,
            "missing or wrong bearer token",
        )))
    }
}

async fn reclaim(
    State(st): State<Arc<AppState>>,
    headers: axum::http::HeaderMap,
    body: Result<Json<ReclaimRequest>, axum::extract::rejection::JsonRejection>,
) -> Response {
    if let Err(r) = authorized(&st, &headers) {
        return *r;
    }
    let req = match body {
        Ok(Json(r)) => r,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("expected {{\"policy\": NAME, \"dry_run\": bool}}: {e}"),
            )
        }
    };
    let Some(policy) = st.cfg.policy.iter().find(|p| p.name == req.policy).cloned() else {
        let names: Vec<&str> = st.cfg.policy.iter().map(|p| p.name.as_str()).collect();
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "no policy named `{}` (configured: {})",
                req.policy,
                names.join(", ")
            ),
        );
    };
    let st2 = st.clone();
    let result = tokio::task::spawn_blocking(move || {
        let quotas = st2.read().quotas.clone();
        let mut scanner = st2.scanner.lock().unwrap_or_else(|e| e.into_inner());
        let table = scanner
            .scan()
            .map_err(|e| format!("{:#}", anyhow::Error::new(e)))?;
        let mut reclaimer = st2.reclaimer.lock().unwrap_or_else(|e| e.into_inner());
        Ok::<_, String>(reclaimer.round(
            &policy,
            &st2.cfg,
            &mut scanner,
            &table,
            &quotas,
            req.dry_run,
        ))
    })
    .await;
    match result {
        Ok(Ok(round)) => {
            crate::daemon::after_round(&st, &round);
            Json(round).into_response()
        }
        Ok(Err(e)) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("scan failed: {e}"),
        ),
        Err(e) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("reclaim task failed: {e}"),
        ),
    }
}
