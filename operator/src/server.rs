//! `/metrics`, `/healthz`, `/readyz`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::metrics::Metrics;

/// What the endpoints report.
#[derive(Debug, Clone)]
pub struct Health {
    pub metrics: Arc<Metrics>,
    /// Leader with synced caches, or a standby ready to take over.
    pub ready: Arc<AtomicBool>,
}

pub fn app(state: Health) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(state)
}

async fn metrics(State(s): State<Health>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.encode(),
    )
        .into_response()
}

async fn readyz(State(s): State<Health>) -> Response {
    if s.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ready").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "caches not synced").into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use http::Request;
    use tower::ServiceExt;

    #[tokio::test]
    async fn endpoints_answer() {
        let ready = Arc::new(AtomicBool::new(false));
        let metrics = Arc::new(Metrics::default());
        metrics.set_leader(true);
        let app = app(Health {
            metrics,
            ready: ready.clone(),
        });
        let get = |path: &str| {
            Request::builder()
                .uri(path)
                .body(Body::empty())
                .expect("request")
        };
        let r = app.clone().oneshot(get("/readyz")).await.expect("readyz");
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        ready.store(true, Ordering::Relaxed);
        let r = app.clone().oneshot(get("/readyz")).await.expect("readyz");
        assert_eq!(r.status(), StatusCode::OK);
        let r = app.clone().oneshot(get("/healthz")).await.expect("healthz");
        assert_eq!(r.status(), StatusCode::OK);
        let r = app.oneshot(get("/metrics")).await.expect("metrics");
        let body = axum::body::to_bytes(r.into_body(), 1 << 20)
            .await
            .expect("body");
        let text = String::from_utf8_lossy(&body);
        assert!(text.contains("kvroute_operator_leader 1"), "{text}");
        assert!(text.contains("kvroute_operator_reconciles_total"), "{text}");
    }
}
