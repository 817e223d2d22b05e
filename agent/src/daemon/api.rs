//! HTTP API (axum): health, metrics, sockets, findings, quotas, reclaims. Handlers read what
//! the scan loop published and ask the engine for reclaim rounds; none of them blocks.
use std::{
    sync::{Arc, OnceLock},
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
use tokio::sync::watch;

use crate::{
    alert::notify::Alert,
    config::Config,
    engine::Engine,
    metrics::Metrics,
    quota::QuotaStatus,
    snapshot::{Filter, FilterArgs},
    table::Socket,
    tasks::Supervisor,
};

/// The socket table as the API sees it.
#[derive(Clone, Default)]
pub enum TableView {
    /// The scan loop freed the last table and is building the next one (the daemon never
    /// holds two): readers wait for the next publication.
    #[default]
    Pending,
    Ready(Arc<ServedTable>),
    /// The last scan failed, with why.
    Failed(String),
}

/// A published socket table and its unfiltered `/v1/sockets` body, rendered at most once per
/// scan and only when asked for: a dashboard polling the whole list costs one render per scan,
/// not one per request, and a daemon nobody asks renders nothing. (Rows carry the ages the
/// scan measured, so the body stays true for the table's lifetime.)
pub struct ServedTable {
    pub sockets: Vec<Socket>,
    all: OnceLock<Result<axum::body::Bytes, String>>,
}

impl ServedTable {
    pub fn new(sockets: Vec<Socket>) -> ServedTable {
        ServedTable {
            sockets,
            all: OnceLock::new(),
        }
    }

    /// The `/v1/sockets` body for `filter`: the cached whole list when it selects everything.
    fn render(&self, filter: &Filter) -> Result<axum::body::Bytes, String> {
        let render = |selected: &[&Socket]| {
            crate::snapshot::socket_list_json(selected)
                .map(axum::body::Bytes::from)
                .map_err(|e| e.to_string())
        };
        if *filter == Filter::default() {
            let all: Vec<&Socket> = self.sockets.iter().collect();
            return self.all.get_or_init(|| render(&all)).clone();
        }
        let selected: Vec<&Socket> = self.sockets.iter().filter(|s| filter.matches(s)).collect();
        render(&selected)
    }
}

/// What the scan loop publishes for the API (cheap to clone: the big parts are shared).
#[derive(Clone, Default)]
pub struct Published {
    pub table: TableView,
    /// Sockets in the last table (kept while the next one is built).
    pub sockets: usize,
    pub alerts: Arc<Vec<Alert>>,
    pub quotas: Arc<Vec<QuotaStatus>>,
    pub last_scan: Option<Instant>,
    pub last_scan_error: Option<String>,
    /// Scans (or reclaim rounds) failed in a row: see [`crate::health`].
    pub failures: super::health::Failures,
    pub scans: u64,
    /// Notifications waiting for webhook receivers.
    pub webhook_queued: usize,
    /// The state tracker is detached and could not be re-attached: why.
    pub tracker_problem: Option<String>,
    /// Network namespaces the last scan could not enter or dump (inode, why).
    pub netns_failed: Vec<(u32, String)>,
}

pub struct AppState {
    pub published: watch::Sender<Published>,
    pub metrics: Arc<Metrics>,
    pub cfg: Config,
    pub started: Instant,
    pub engine: Engine,
    /// Bearer token for POST /v1/reclaim (None: endpoint off).
    pub token: Option<String>,
    /// Background tasks; any that failed is a problem on /healthz.
    pub tasks: Supervisor,
}

impl AppState {
    /// The last publication (its big parts are shared, not copied).
    pub fn read(&self) -> Published {
        self.published.borrow().clone()
    }
}

/// The bearer token for POST /v1/reclaim, if configured. Config validation has checked the
/// file (readable, long enough, private); this reads it again for the running daemon.
pub fn read_token(cfg: &Config) -> anyhow::Result<Option<String>> {
    crate::config::read_token(&cfg.api).map_err(|e| anyhow::anyhow!("api.token_file: {e}"))
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
    // Failing (the daemon must be restarted): the engine is gone, scans keep failing or a
    // supervised task stopped; the scan loop has stopped the watchdog pings for the same cause.
    let failed_tasks = st.tasks.failures();
    let fatal = super::health::fatal(
        &p.failures,
        st.engine.status.borrow().dead.as_deref(),
        &failed_tasks,
    );
    // Healthy once a scan has completed and scans keep completing.
    let fresh = age.is_some_and(|a| {
        a <= interval
            .saturating_mul(3)
            .saturating_add(std::time::Duration::from_secs(5))
    });
    let healthy = fresh && fatal.is_none();
    // Scans work, but something a user relies on does not: still 200 (restarting the agent
    // would not help), with each problem named.
    let mut problems: Vec<String> = failed_tasks;
    problems.extend(p.tracker_problem.clone());
    problems.extend(netns_problems(&p.netns_failed));
    if let Some(e) = &st.engine.status.borrow().audit_error {
        problems.push(format!(
            "audit log not writable, enforce policies kill nothing: {e}"
        ));
    }
    let status = match (&fatal, fresh, problems.is_empty()) {
        (Some(_), _, _) => "failing",
        (None, false, _) => "unhealthy",
        (None, true, true) => "ok",
        (None, true, false) => "degraded",
    };
    let body = json!({
        "status": status,
        "cause": fatal,
        "problems": problems,
        "scans": p.scans,
        "last_scan_age_secs": age.map(|a| a.as_secs_f64()),
        "last_scan_error": p.last_scan_error,
        "failed_scans_in_row": p.failures.in_row,
        "sockets": p.sockets,
        "findings": p.alerts.len(),
        "webhook_queued": p.webhook_queued,
        "uptime_secs": st.started.elapsed().as_secs(),
        "reclaim_mechanism": st.engine.mechanism,
    });
    let code = if healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(body)).into_response()
}

/// /healthz problems for the namespaces the last scan could not enter or dump.
fn netns_problems(failed: &[(u32, String)]) -> impl Iterator<Item = String> + '_ {
    failed.iter().map(|(inode, why)| {
        format!("network namespace {inode} not scanned, its sockets are missing: {why}")
    })
}

/// OpenMetrics, or the Prometheus text format when the scraper's `Accept` prefers it.
async fn metrics(State(st): State<Arc<AppState>>, headers: axum::http::HeaderMap) -> Response {
    // Several Accept headers are one list (RFC 9110 5.3).
    let accept: Vec<&str> = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect();
    let accept = (!accept.is_empty()).then(|| accept.join(","));
    let format = crate::metrics::Format::negotiate(accept.as_deref());
    (
        [(header::CONTENT_TYPE, format.content_type())],
        st.metrics.render(format),
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
            "invalid query string: expected state, port, sport, dport, pid, comm, idle_min, netns, container",
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
    let mut rx = st.published.subscribe();
    loop {
        let table = rx.borrow_and_update().table.clone();
        let table = match table {
            TableView::Ready(t) => t,
            // The table was freed for a scan that failed: say so rather than answer with an
            // empty list.
            TableView::Failed(e) => {
                return error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("the last scan failed: {e}"),
                )
            }
            TableView::Pending => {
                if rx.changed().await.is_err() {
                    return error(StatusCode::SERVICE_UNAVAILABLE, "shutting down");
                }
                continue;
            }
        };
        // Filtering and rendering walk the whole table (megabytes at 100k sockets): on the
        // blocking pool, never on a runtime worker that serves other requests.
        let rendered = tokio::task::spawn_blocking(move || table.render(&filter)).await;
        return match rendered {
            Ok(Ok(body)) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
            Ok(Err(e)) => error(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("cannot render the socket table: {e}"),
            ),
            Err(e) => error(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("rendering the socket table failed: {e}"),
            ),
        };
    }
}

#[derive(serde::Deserialize)]
struct FindingsQuery {
    fingerprint: Option<String>,
}

/// The current findings; `?fingerprint=F` keeps that one (alerts' generatorURL points here).
async fn findings(
    State(st): State<Arc<AppState>>,
    q: Result<Query<FindingsQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Ok(Query(q)) = q else {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid query string: expected fingerprint",
        );
    };
    let alerts = st.read().alerts;
    let selected: Vec<&Alert> = alerts
        .iter()
        .filter(|a| {
            q.fingerprint
                .as_ref()
                .is_none_or(|f| *f == a.finding.fingerprint)
        })
        .collect();
    Json(json!({ "findings": selected })).into_response()
}

/// Each quota's reading, with where it is read (`netns` or `container` as configured; null:
/// connreap's own namespace).
async fn quotas(State(st): State<Arc<AppState>>) -> Response {
    let readings = st.read().quotas;
    let list: Vec<serde_json::Value> = readings
        .iter()
        .map(|q| {
            let mut v = serde_json::to_value(q).unwrap_or_else(|_| json!({ "name": q.name }));
            let place = st.cfg.quota.iter().find(|c| c.name == q.name);
            if let Some(o) = v.as_object_mut() {
                o.insert("netns".into(), json!(place.and_then(|c| c.netns.clone())));
                o.insert(
                    "container".into(),
                    json!(place.and_then(|c| c.container.clone())),
                );
            }
            v
        })
        .collect();
    Json(json!({ "quotas": list })).into_response()
}

async fn reclaims(State(st): State<Arc<AppState>>) -> Response {
    let recent = st.engine.status.borrow().recent.clone();
    Json(json!({ "reclaims": *recent })).into_response()
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
    let quotas = st.read().quotas;
    match st.engine.reclaim_now(policy, req.dry_run, quotas).await {
        Ok(round) => Json(round).into_response(),
        Err(e) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("{:#}", anyhow::Error::new(e)),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::{Filter, ServedTable};
    use crate::{detect::testutil::sock, table::TcpState};

    #[test]
    fn the_whole_list_is_rendered_once_per_table_and_filters_render_their_own() {
        let t = ServedTable::new(vec![
            sock(
                7,
                "java",
                "10.0.0.5:40000",
                "10.0.0.6:80",
                TcpState::CloseWait,
            ),
            sock(
                8,
                "node",
                "10.0.0.5:40001",
                "10.0.0.6:80",
                TcpState::Established,
            ),
        ]);
        let all = t.render(&Filter::default()).expect("renders");
        let again = t.render(&Filter::default()).expect("renders");
        assert_eq!(
            all.as_ptr(),
            again.as_ptr(),
            "the cached body, not a new render"
        );
        let v: serde_json::Value = serde_json::from_slice(&all).expect("JSON");
        assert_eq!(v["count"], 2);
        let java = Filter {
            pids: vec![7],
            ..Filter::default()
        };
        let one: serde_json::Value =
            serde_json::from_slice(&t.render(&java).expect("renders")).expect("JSON");
        assert_eq!(one["count"], 1);
        assert_eq!(one["sockets"][0]["comm"], "java");
    }

    #[test]
    fn failed_namespaces_are_health_problems() {
        let failed = [(4026532009u32, "entering it: permission denied".to_string())];
        let p: Vec<String> = super::netns_problems(&failed).collect();
        assert_eq!(
            p,
            ["network namespace 4026532009 not scanned, its sockets are missing: entering it: permission denied"]
        );
        assert_eq!(super::netns_problems(&[]).count(), 0);
    }
}
