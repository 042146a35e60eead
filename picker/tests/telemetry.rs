//! OpenTelemetry against an in-process OTLP/gRPC receiver: off, the client's `traceparent`
//! reaches the engine as it came and nothing is exported; on, each request's spans (request,
//! parse, tokenize, decide with its attributes, forward) are exported under the client's
//! trace, and the engine (and, through ext_proc, the gateway) is sent the picker's context.
//!
//! A collector that refuses is counted in `kvroute_picker_trace_export_failures_total`.
//!
//! One test in its own binary: it installs the process's global `tracing` subscriber.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kvroute_picker::service::telemetry;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use parking_lot::Mutex;
use serde_json::json;
use support::gateway;
use support::*;
use tracing_subscriber::layer::SubscriberExt as _;

#[derive(Default, Clone)]
struct Receiver(Arc<Mutex<Vec<Span>>>, Arc<std::sync::atomic::AtomicBool>);

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        if self.1.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(tonic::Status::invalid_argument("the collector refuses"));
        }
        let spans = request
            .into_inner()
            .resource_spans
            .into_iter()
            .flat_map(|r| r.scope_spans)
            .flat_map(|s| s.spans);
        self.0.lock().extend(spans);
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn attrs(s: &Span) -> BTreeMap<String, String> {
    s.attributes
        .iter()
        .map(|kv| {
            let v = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(AnyValue::StringValue(s)) => s.clone(),
                Some(AnyValue::IntValue(i)) => i.to_string(),
                Some(AnyValue::BoolValue(b)) => b.to_string(),
                Some(AnyValue::DoubleValue(d)) => d.to_string(),
                other => format!("{other:?}"),
            };
            (kv.key.clone(), v)
        })
        .collect()
}

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_spans_are_exported_under_the_callers_trace() {
    let engine = FakeEngine::start("127.0.0.1").await;
    let picker = start_picker(&one_engine_pool(engine.addr.port(), "")).await;
    let url = format!("http://{}/v1/completions", picker.addrs.http);
    let traceparent = format!("00-{TRACE}-{CLIENT_SPAN}-01");
    let send = || async {
        let r = client()
            .post(&url)
            .header("traceparent", &traceparent)
            .json(&json!({"model": "llama", "prompt": "a traced request"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    };
    let engine_traceparent = || {
        engine
            .state
            .last_headers
            .lock()
            .as_ref()
            .and_then(|h| h.get("traceparent")?.to_str().ok().map(str::to_owned))
            .unwrap_or_default()
    };

    // off: passed through untouched
    assert!(!telemetry::enabled());
    send().await;
    assert_eq!(engine_traceparent(), traceparent);

    // on
    let receiver = Receiver::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let otlp = listener.local_addr().unwrap();
    let server = TraceServiceServer::new(receiver.clone());
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(server)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await
    });
    let (layer, exporter) = telemetry::with_endpoint(&format!("http://{otlp}"), "kvroute-test")
        .expect("an OTLP exporter");
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer))
        .expect("the test's subscriber");
    send().await;
    let sent = engine_traceparent();
    let parts: Vec<&str> = sent.split('-').collect();
    assert_eq!(parts.len(), 4, "{sent}");
    assert_eq!(parts[1], TRACE, "the engine joins the caller's trace");
    assert_ne!(parts[2], CLIENT_SPAN, "under the picker's span");

    // through ext_proc the gateway is given the picker's context to forward
    let ext = gateway::channel(picker.addrs.ext_proc.unwrap()).await;
    let answer = gateway::request(
        &ext,
        "/v1/completions",
        &[("traceparent", &traceparent)],
        br#"{"model":"llama","prompt":"through the gateway"}"#,
    )
    .await;
    let gateway::Answer::Route { headers, .. } = answer else {
        panic!("{answer:?}");
    };
    let set = headers
        .get("traceparent")
        .expect("a traceparent to forward");
    assert!(
        set.starts_with(&format!("00-{TRACE}-")) && !set.contains(CLIENT_SPAN),
        "{set}"
    );

    let flushing = exporter.clone();
    tokio::task::spawn_blocking(move || flushing.flush())
        .await
        .unwrap();
    let spans = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let spans = receiver.0.lock().clone();
            if spans.iter().filter(|s| s.name == "forward").count() >= 1
                && spans.iter().filter(|s| s.name == "kvroute.request").count() >= 2
            {
                return spans;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the spans reach the receiver");
    assert!(spans.iter().all(|s| hex(&s.trace_id) == TRACE), "one trace");
    let by_name = |n: &str| -> Vec<&Span> { spans.iter().filter(|s| s.name == n).collect() };
    let request = by_name("kvroute.request")[0];
    assert_eq!(hex(&request.parent_span_id), CLIENT_SPAN);
    assert_eq!(attrs(request)["model"], "llama");
    for child in ["parse", "tokenize", "decide", "forward"] {
        let s = by_name(child);
        assert!(
            !s.is_empty(),
            "a {child} span in {:?}",
            spans.iter().map(|s| &s.name).collect::<Vec<_>>()
        );
    }
    let decide = attrs(by_name("decide")[0]);
    assert_eq!(decide["endpoint"], engine.addr.to_string(), "{decide:?}");
    for key in [
        "candidates",
        "rank",
        "cached_tokens",
        "policy",
        "failed_open",
        "prompt_tokens",
    ] {
        assert!(decide.contains_key(key), "decide has {key}: {decide:?}");
    }
    let forward = by_name("forward")[0];
    assert_eq!(
        hex(&forward.span_id),
        parts[2],
        "the engine's parent is the forward span"
    );
    assert_eq!(hex(&forward.parent_span_id), hex(&request.span_id));
    assert_eq!(attrs(forward)["http.status_code"], "200");

    // Hardening IV, 13: a collector that refuses is counted (and logged), not silent
    let failures = || async {
        kvroute_testkit::metric_sum(
            &metrics_text(picker.addrs.metrics).await,
            "kvroute_picker_trace_export_failures_total",
            &[],
        )
    };
    assert_eq!(failures().await, 0.0);
    receiver.1.store(true, std::sync::atomic::Ordering::SeqCst);
    send().await;
    let flushing = exporter.clone();
    tokio::task::spawn_blocking(move || flushing.flush())
        .await
        .unwrap();
    assert!(failures().await >= 1.0);
    exporter.shutdown();
    picker.shutdown().await;
}
