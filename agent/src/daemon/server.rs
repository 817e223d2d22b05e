//! Serving the API with bounded resources: at most `MAX_CONNECTIONS` connections at once (more
//! are closed at accept, so a hostile local client cannot exhaust the daemon's file
//! descriptors and starve its scans), a deadline for each request's headers and for idle
//! keep-alive connections, and an end as soon as shutdown is asked for.
use std::{sync::Arc, time::Duration};

use axum::Router;
use hyper_util::{
    rt::{TokioIo, TokioTimer},
    service::TowerToHyperService,
};
use tokio::{net::TcpListener, sync::Semaphore};

/// Concurrent API connections; more are refused at accept.
pub const MAX_CONNECTIONS: usize = 64;
/// A request's headers must arrive within this; an idle keep-alive connection is closed after it.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// Serve `router` on `listener` until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut refused_logged = false;
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => return,
            r = listener.accept() => r,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning; connections in the backlog wait.
                tracing::warn!(error = %e, "API accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            if !refused_logged {
                tracing::warn!(
                    max = MAX_CONNECTIONS,
                    "API connection limit reached: closing new connections"
                );
                refused_logged = true;
            }
            drop(stream);
            continue;
        };
        refused_logged = false;
        let service = TowerToHyperService::new(router.clone());
        tokio::spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service);
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "API connection ended with an error");
            }
            drop(permit);
        });
    }
}
