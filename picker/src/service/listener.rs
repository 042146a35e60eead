//! An HTTP accept loop with the bounds `axum::serve` does not expose: concurrent connections,
//! request-head size and the time a client may take to send its head.
//!
//! Past `max_connections` a new connection is still accepted, answered with one OpenAI-style
//! 503 (`too_many_connections`) and closed, so the client learns why instead of waiting in the
//! kernel's backlog. A head larger than `max_header_bytes` gets hyper's 431.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::response::IntoResponse;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use super::core::PickerCore;
use super::errors::ApiError;

/// Connection-level bounds of one listener.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    pub max_connections: usize,
    /// Largest request head (request line and headers), in bytes; at least 8 KiB.
    pub max_header_bytes: usize,
    /// Time a client has to send a complete request head.
    pub header_read_timeout: Duration,
}

/// Serve `app` on `listener` until `cancel`, then let open connections finish their
/// in-flight requests (up to `drain`).
pub async fn serve_bounded(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    core: Option<Arc<PickerCore>>,
    cancel: CancellationToken,
    drain: Duration,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(limits.max_header_bytes.max(8192));
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX));
    let builder = Arc::new(builder);
    loop {
        let (stream, peer): (tokio::net::TcpStream, SocketAddr) = tokio::select! {
            () = cancel.cancelled() => break,
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let io = TokioIo::new(stream);
        let permit = slots.clone().try_acquire_owned();
        let Ok(permit) = permit else {
            if let Some(c) = &core {
                c.metrics.error("too_many_connections");
            }
            tracing::debug!(%peer, "connection refused: too many connections");
            let refuse = hyper::service::service_fn(|_req: hyper::Request<Incoming>| async {
                let mut resp = ApiError::unavailable(
                    "too_many_connections",
                    "the picker has too many open connections; retry later",
                )
                .into_response();
                resp.headers_mut().insert(
                    http::header::CONNECTION,
                    http::HeaderValue::from_static("close"),
                );
                Ok::<_, std::convert::Infallible>(resp)
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .keep_alive(false)
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                .serve_connection(io, refuse);
            tokio::spawn(async move {
                let _ = tokio::time::timeout(Duration::from_secs(5), conn).await;
            });
            continue;
        };
        let svc = hyper::service::service_fn({
            let app = app.clone();
            move |req: hyper::Request<Incoming>| app.clone().oneshot(req.map(axum::body::Body::new))
        });
        let conn = builder.serve_connection_with_upgrades(io, svc).into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
            drop(permit);
        });
    }
    drop(listener);
    let _ = tokio::time::timeout(drain, graceful.shutdown()).await;
}
