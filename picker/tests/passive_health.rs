//! Passive health (finding 11 of issue 12): an engine that answers 500 to everything while its
//! metrics look healthy is taken out of rotation, its failures are retried on the healthy
//! engine so clients see success, and it is tried again once its ejection time is over.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use kvroute_picker::service::ext_proc::{EndpointPicker, PickInput};
use kvroute_picker::service::gateway::GatewayPicker;
use serde_json::{Value, json};
use support::*;

/// Long enough that a handful of loopback requests fit well inside one ejection.
const EJECTION: &str = "3s";

fn two_engines_yaml(good: u16, bad: u16) -> String {
    format!(
        r#"
modelConfigs:
  - name: llama
    model: llama
    port: {good}
endpoints:
  - {{address: 127.0.0.1, modelConfig: llama}}
  - {{address: 127.0.0.1, modelConfig: llama, port: {bad}}}
routing: {{stalenessThreshold: 1m}}
scrape: {{interval: 50ms, timeout: 200ms}}
limits:
  outlierDetection: {{consecutive5xx: 3, baseEjectionTime: {EJECTION}, maxEjectionTime: 30s}}
"#
    )
}

async fn complete(url: &str, i: usize) -> u16 {
    client()
        .post(url)
        .json(
            &json!({"model": "llama", "prompt": format!("request number {i} with its own words")}),
        )
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

async fn debug_outlier(admin: std::net::SocketAddr, port: u16) -> Value {
    let v: Value =
        kvroute_testkit::get_json(&client(), format!("http://{admin}/debug/endpoints")).await;
    v["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["endpoint"] == format!("127.0.0.1:{port}"))
        .expect("the endpoint is listed")["outlier"]
        .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_failing_fast_is_ejected_retried_around_and_probed_again() {
    let good = FakeEngine::start("127.0.0.1").await;
    let bad = FakeEngine::start("127.0.0.1").await;
    bad.state.fail_status.store(500, Ordering::SeqCst);
    let picker = start_picker(&two_engines_yaml(good.addr.port(), bad.addr.port())).await;
    let url = format!("http://{}/v1/completions", picker.addrs.http);
    let bad_requests = || bad.state.requests.load(Ordering::SeqCst);

    // Every client gets a success: what reached the failing engine was retried on the good
    // one. After three failures in a row the failing engine gets nothing more.
    let mut sent = 0;
    while bad_requests() < 3 {
        assert!(sent < 60, "the failing engine was never chosen");
        assert_eq!(complete(&url, sent).await, 200, "request {sent}");
        sent += 1;
    }
    let outlier = debug_outlier(picker.addrs.admin, bad.addr.port()).await;
    assert!(
        outlier["ejected_until_ms"].is_u64(),
        "ejected after 3 failures: {outlier}"
    );
    for i in 0..10 {
        assert_eq!(complete(&url, 100 + i).await, 200);
    }
    let outlier = debug_outlier(picker.addrs.admin, bad.addr.port()).await;
    assert!(
        outlier["ejected_until_ms"].is_u64(),
        "precondition: still inside the {EJECTION} ejection"
    );
    assert_eq!(bad_requests(), 3, "no traffic while ejected");
    assert!(
        picker.state.metrics.retries.get() >= 3,
        "each failure was retried"
    );
    let metrics = metrics_text(picker.addrs.metrics).await;
    let bad_label = format!("endpoint=\"127.0.0.1:{}#0\"", bad.addr.port());
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("kvroute_picker_outlier_ejections_total")
                && l.contains(&bad_label)
                && l.contains("trigger=\"consecutive_5xx\"")
                && l.ends_with(" 1")),
        "{metrics}"
    );
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("kvroute_picker_outlier_ejected{")
                && l.contains(&bad_label)
                && l.ends_with(" 1")),
        "{metrics}"
    );

    // Once the ejection time is over it is tried again (and its failures still never reach
    // a client); three more failures eject it again, for twice as long.
    let state = picker.state.clone();
    let bad_id = endpoint_on_port(&picker, bad.addr.port());
    eventually(Duration::from_secs(10), || {
        state
            .outlier_status(&bad_id)
            .is_some_and(|s| s.ejected_until_ms.is_none())
    })
    .await;
    let mut i = 200;
    while state
        .outlier_status(&bad_id)
        .is_some_and(|s| s.ejected_until_ms.is_none())
    {
        assert!(i < 300, "the failing engine was not probed again");
        assert_eq!(complete(&url, i).await, 200, "request {i}");
        i += 1;
    }
    assert_eq!(bad_requests(), 6, "probed again after the ejection time");
    let status = state.outlier_status(&bad_id).unwrap();
    assert_eq!(status.ejections, 2, "{status:?}");
    let metrics = metrics_text(picker.addrs.metrics).await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("kvroute_picker_outlier_ejections_total")
                && l.contains(&bad_label)
                && l.ends_with(" 2")),
        "{metrics}"
    );

    // the engine recovers: once back, its successes keep it in rotation
    bad.state.fail_status.store(0, Ordering::SeqCst);
    eventually(Duration::from_secs(15), || {
        state
            .outlier_status(&bad_id)
            .is_some_and(|s| s.ejected_until_ms.is_none())
    })
    .await;
    let before = bad_requests();
    for i in 0..40 {
        assert_eq!(complete(&url, 400 + i).await, 200);
    }
    assert!(
        bad_requests() > before,
        "a recovered engine takes traffic again"
    );
    assert!(state.ejected_endpoints().is_empty());
    let metrics = metrics_text(picker.addrs.metrics).await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("kvroute_picker_outlier_ejected{")
                && l.contains(&bad_label)
                && l.ends_with(" 0")),
        "the gauge follows the return: {metrics}"
    );
    picker.shutdown().await;
}

/// The last target's 5xx reaches the client as the engine sent it (nothing to retry on), and
/// a pool of one is never ejected.
#[tokio::test]
async fn a_single_failing_engine_answers_its_own_error_and_stays() {
    let bad = FakeEngine::start("127.0.0.1").await;
    bad.state.fail_status.store(503, Ordering::SeqCst);
    let yaml = one_engine_pool(
        bad.addr.port(),
        "limits:\n  outlierDetection: {consecutive5xx: 1}\n",
    );
    let picker = start_picker(&yaml).await;
    let url = format!("http://{}/v1/completions", picker.addrs.http);
    for i in 0..4 {
        assert_eq!(complete(&url, i).await, 503);
    }
    assert_eq!(bad.state.requests.load(Ordering::SeqCst), 4);
    assert!(picker.state.ejected_endpoints().is_empty());
    assert_eq!(picker.state.metrics.retries.get(), 0);
    picker.shutdown().await;
}

/// The ext_proc path feeds passive health too: the status the gateway reports on the
/// response head counts against the endpoint that served it.
#[tokio::test]
async fn statuses_reported_over_ext_proc_eject_the_endpoint() {
    let good = FakeEngine::start("127.0.0.1").await;
    let bad = FakeEngine::start("127.0.0.1").await;
    let picker = start_picker(&two_engines_yaml(good.addr.port(), bad.addr.port())).await;
    let gateway = GatewayPicker::new(picker.state.clone());
    let bad_addr = std::net::SocketAddr::new("127.0.0.1".parse().unwrap(), bad.addr.port());
    let pick = |id: u64, subset: Option<Vec<std::net::SocketAddr>>| PickInput {
        request_id: id,
        headers: http::HeaderMap::new(),
        path: "/v1/completions".into(),
        body: bytes::Bytes::from(
            json!({"model": "llama", "prompt": format!("gateway request {id}")}).to_string(),
        ),
        subset,
    };
    for id in 0..3 {
        // the gateway's subset makes the failing engine the chosen one
        gateway
            .pick(pick(id, Some(vec![bad_addr])))
            .await
            .expect("picked");
        gateway.on_response_served(id, bad_addr);
        gateway.on_response_status(id, 500);
        gateway.on_response_complete(id);
    }
    let ejected = picker.state.ejected_endpoints();
    assert_eq!(ejected.len(), 1);
    assert_eq!(ejected[0].port, bad.addr.port());
    // now every pick avoids it
    for id in 10..20 {
        let out = gateway.pick(pick(id, None)).await.expect("picked");
        assert_eq!(out.endpoints, vec![good.addr]);
        gateway.on_response_complete(id);
    }
    picker.shutdown().await;
}

/// One client cannot eject healthy endpoints (finding 4 of issue 35): ten concurrent bodies
/// every engine answers with 500, then ten non-streamed requests slower than
/// `upstreamTimeout`, against four healthy engines. The first fail wherever they are tried
/// (the retry included), the second time out on their own generation: neither is the
/// endpoints' failure, and nobody is ejected. Ordinary requests are then served everywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poisoned_or_slow_requests_eject_no_healthy_endpoint() {
    let mut engines = Vec::new();
    for _ in 0..4 {
        let e = FakeEngine::start("127.0.0.1").await;
        *e.state.poison.lock() = Some("POISON".into());
        *e.state.slow.lock() = Some(("SLOW".into(), 1_500));
        engines.push(e);
    }
    let endpoints: String = engines
        .iter()
        .map(|e| {
            format!(
                "  - {{address: 127.0.0.1, modelConfig: llama, port: {}}}\n",
                e.addr.port()
            )
        })
        .collect();
    let picker = start_picker(&format!(
        r#"
modelConfigs:
  - {{name: llama, model: llama, port: {}}}
endpoints:
{endpoints}routing: {{stalenessThreshold: 1m, strategy: LeastLoad}}
scrape: {{interval: 50ms, timeout: 200ms}}
limits:
  upstreamTimeout: 300ms
  outlierDetection: {{consecutive5xx: 3, consecutiveGatewayFailure: 3, baseEjectionTime: 30s, maxEjectionTime: 60s}}
"#,
        engines[0].addr.port()
    ))
    .await;
    let url = format!("http://{}/v1/completions", picker.addrs.http);
    for marker in ["POISON", "SLOW"] {
        let statuses = futures::future::join_all((0..10).map(|i| {
            let url = url.clone();
            async move {
                client()
                    .post(&url)
                    .json(&json!({"model": "llama", "prompt": format!("{marker} request {i} with its own words")}))
                    .send()
                    .await
                    .unwrap()
                    .status()
                    .as_u16()
            }
        }))
        .await;
        let want = if marker == "POISON" { 500 } else { 504 };
        assert!(
            statuses.iter().all(|&s| s == want),
            "{marker}: {statuses:?}"
        );
    }
    for e in &engines {
        let outlier = debug_outlier(picker.addrs.admin, e.addr.port()).await;
        assert!(
            outlier["ejected_until_ms"].is_null(),
            "127.0.0.1:{} ejected: {outlier}",
            e.addr.port()
        );
    }
    let text = metrics_text(picker.addrs.metrics).await;
    assert!(
        !text.contains("kvroute_picker_outlier_ejections_total{"),
        "{text}"
    );
    picker.shutdown().await;
}
