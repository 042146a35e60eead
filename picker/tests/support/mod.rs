//! Test support: a small fake engine (vLLM-shaped HTTP + /metrics) on 127.0.0.1:0, and a
//! picker started in-process from a config.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

pub mod gateway;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use kvroute_picker::service::settings::PickerConfig;
use kvroute_picker::service::source::StaticSource;
use kvroute_picker::service::{Running, start};
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;

/// What a fake engine saw and how it behaves.
#[derive(Default)]
pub struct EngineState {
    pub requests: AtomicU64,
    pub last_headers: Mutex<Option<HeaderMap>>,
    pub last_body: Mutex<Option<serde_json::Value>>,
    /// `/metrics` answers 500 while set.
    pub metrics_broken: AtomicBool,
    /// Completions never answer while set.
    pub hang: AtomicBool,
    /// `/metrics` never answers while set (with `hang`: a wedged engine).
    pub metrics_hang: AtomicBool,
    /// Streams send their first chunk, then go silent forever while set.
    pub stall_after_first: AtomicBool,
    /// Streams send their first chunk, then the engine drops the connection while set (a
    /// crash mid-stream).
    pub crash_after_first: AtomicBool,
    pub waiting: AtomicU64,
    /// `vllm:cache_config_info{block_size=...}` reported while non-zero.
    pub block_size: AtomicU64,
    /// `num_gpu_blocks` of each engine core in `vllm:cache_config_info` (512 while zero).
    pub num_gpu_blocks: AtomicU64,
    /// Completions answer this status (with an error body) at once while non-zero: an engine
    /// that fails fast while its metrics look healthy.
    pub fail_status: AtomicU16,
    /// A body containing this text is answered with 500 at once (a request the engine cannot
    /// serve, on an engine that is healthy).
    pub poison: Mutex<Option<String>>,
    /// A body containing this text is answered only after `slow_ms` (a long generation).
    pub slow: Mutex<Option<(String, u64)>>,
    /// Milliseconds a stream waits before its first chunk (its prefill), beyond the usual 20.
    pub first_chunk_delay_ms: AtomicU64,
    /// More exposition lines `/metrics` serves (histograms, say).
    pub extra_metrics: Mutex<String>,
    /// The path of every POST it was sent, in order.
    pub paths: Mutex<Vec<String>>,
    /// The ids of the Responses it answered (`resp_<port>_<n>`); `GET /v1/responses/{id}`
    /// finds only these.
    pub responses: Mutex<Vec<String>>,
    /// Its own address, which names its Responses.
    pub addr: Mutex<Option<SocketAddr>>,
}

pub struct FakeEngine {
    pub addr: SocketAddr,
    pub state: Arc<EngineState>,
    cancel: CancellationToken,
}

impl Drop for FakeEngine {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// The SSE chunks the fake engine streams, exactly.
pub fn sse_chunks() -> Vec<String> {
    (0..5)
        .map(|i| {
            format!(
                "data: {{\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"choices\":[{{\"index\":0,\"text\":\"tok{i} \"}}]}}\n\n"
            )
        })
        .chain(std::iter::once("data: [DONE]\n\n".to_string()))
        .collect()
}

/// A Responses answer (a JSON object, or an SSE stream opening with `response.created`) with a
/// fresh id.
fn responses_answer(s: &EngineState, stream: bool, model: &str) -> Response {
    let id = {
        let mut ids = s.responses.lock();
        let port = s.addr.lock().map_or(0, |a| a.port());
        let id = format!("resp_{port}_{}", ids.len());
        ids.push(id.clone());
        id
    };
    if stream {
        let created = format!(
            "event: response.created\ndata: {{\"response\":{{\"id\":\"{id}\",\"object\":\"response\",\"model\":\"{model}\",\"status\":\"in_progress\"}},\"sequence_number\":0,\"type\":\"response.created\"}}\n\n"
        );
        let done = "event: response.completed\ndata: {\"type\":\"response.completed\"}\n\n";
        return Response::builder()
            .header("content-type", "text/event-stream")
            .body(Body::from(created + done))
            .unwrap();
    }
    axum::Json(serde_json::json!({
        "id": id, "object": "response", "status": "completed", "model": model,
        "output": [{"id": "msg_1", "type": "message", "role": "assistant",
                    "content": [{"type": "output_text", "text": "hello"}]}]
    }))
    .into_response()
}

/// `GET /v1/responses/{id}`: the Responses this engine answered, 404 for any other.
async fn stored_response(
    State(s): State<Arc<EngineState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    if s.responses.lock().contains(&id) {
        axum::Json(serde_json::json!({"id": id, "object": "response"})).into_response()
    } else {
        let body = serde_json::json!({"error": {"message": format!("Response with id '{id}' not found."), "code": 404}});
        (StatusCode::NOT_FOUND, axum::Json(body)).into_response()
    }
}

async fn completion(
    State(s): State<Arc<EngineState>>,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    s.requests.fetch_add(1, Ordering::SeqCst);
    s.paths.lock().push(uri.path().to_owned());
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
    *s.last_headers.lock() = Some(headers);
    *s.last_body.lock() = Some(v.clone());
    if s.hang.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_secs(3600)).await;
    }
    let text = String::from_utf8_lossy(&body);
    if s.poison
        .lock()
        .as_ref()
        .is_some_and(|p| text.contains(p.as_str()))
    {
        let body =
            serde_json::json!({"error": {"message": "cannot serve this request", "code": 500}});
        return (StatusCode::INTERNAL_SERVER_ERROR, axum::Json(body)).into_response();
    }
    let slow = s.slow.lock().clone();
    if let Some((_, ms)) = slow.filter(|(p, _)| text.contains(p.as_str())) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let fail = s.fail_status.load(Ordering::SeqCst);
    if fail != 0 {
        let status = StatusCode::from_u16(fail).unwrap();
        let body = serde_json::json!({"error": {"message": "engine failure", "code": fail}});
        return (status, axum::Json(body)).into_response();
    }
    if uri.path() == "/v1/responses" {
        let stream = v.get("stream").and_then(serde_json::Value::as_bool) == Some(true);
        let model = v["model"].as_str().unwrap_or_default();
        return responses_answer(&s, stream, model);
    }
    if v.get("stream").and_then(serde_json::Value::as_bool) == Some(true) {
        let stall = s.stall_after_first.load(Ordering::SeqCst);
        let crash = s.crash_after_first.load(Ordering::SeqCst);
        let prefill = Duration::from_millis(s.first_chunk_delay_ms.load(Ordering::SeqCst));
        let stream = futures::stream::iter(sse_chunks().into_iter().enumerate()).then(
            move |(i, c)| async move {
                if i == 0 {
                    tokio::time::sleep(prefill).await;
                }
                if i == 1 && stall {
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                }
                if i == 1 && crash {
                    return Err(std::io::Error::other("engine crashed"));
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
                Ok::<_, std::io::Error>(Bytes::from(c))
            },
        );
        return Response::builder()
            .header("content-type", "text/event-stream")
            .body(Body::from_stream(stream))
            .unwrap();
    }
    axum::Json(serde_json::json!({
        "id": "cmpl-1", "object": "text_completion", "model": v["model"],
        "choices": [{"index": 0, "text": "hello", "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    }))
    .into_response()
}

use futures::StreamExt;

async fn metrics(State(s): State<Arc<EngineState>>) -> Response {
    if s.metrics_broken.load(Ordering::SeqCst) {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    }
    if s.metrics_hang.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_secs(3600)).await;
    }
    let w = s.waiting.load(Ordering::SeqCst);
    let bs = s.block_size.load(Ordering::SeqCst);
    let blocks = match s.num_gpu_blocks.load(Ordering::SeqCst) {
        0 => 512,
        n => n,
    };
    let cache_config = if bs == 0 {
        String::new()
    } else {
        format!(
            "# TYPE vllm:cache_config_info gauge\n\
             vllm:cache_config_info{{block_size=\"{bs}\",engine=\"0\",num_gpu_blocks=\"{blocks}\"}} 1.0\n\
             vllm:cache_config_info{{block_size=\"{bs}\",engine=\"1\",num_gpu_blocks=\"{blocks}\"}} 1.0\n"
        )
    };
    let extra = s.extra_metrics.lock().clone();
    let text = extra
        + &cache_config
        + &format!(
            "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{model_name=\"m\",engine=\"0\"}} {w}\n\
         # TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name=\"m\",engine=\"0\"}} 0\n\
         # TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{model_name=\"m\",engine=\"0\"}} 0.1\n\
         vllm:num_requests_waiting{{model_name=\"m\",engine=\"1\"}} {w}\n\
         vllm:num_requests_running{{model_name=\"m\",engine=\"1\"}} 0\n\
         vllm:kv_cache_usage_perc{{model_name=\"m\",engine=\"1\"}} 0.1\n"
        );
    text.into_response()
}

impl FakeEngine {
    pub async fn start(ip: &str) -> Self {
        let state = Arc::new(EngineState::default());
        let mut app = Router::new();
        for path in kvroute_picker::service::http::FORWARDED_PATHS {
            app = app.route(path, post(completion));
        }
        let app = app
            .route("/v1/responses/{id}", get(stored_response))
            .route("/metrics", get(metrics))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind(format!("{ip}:0"))
            .await
            .unwrap();
        let addr = listener.local_addr().unwrap();
        *state.addr.lock() = Some(addr);
        let cancel = CancellationToken::new();
        let c = cancel.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move { c.cancelled().await })
                .await;
        });
        Self {
            addr,
            state,
            cancel,
        }
    }
}

/// A port on 127.0.0.1 that refuses connections.
pub async fn refused_port() -> u16 {
    // Bound and never listening: connections are refused, and no later bind (a fake engine
    // started after this, say) can be given the same port, as it could once a listener that
    // took it was dropped. The socket is kept for the rest of the test process.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let port = socket.local_addr().unwrap().port();
    std::mem::forget(socket);
    port
}

/// Listeners on port 0 of loopback.
pub fn loopback_listen(yaml: &str) -> String {
    format!(
        "listen:\n  http: 127.0.0.1:0\n  admin: 127.0.0.1:0\n  metrics: 127.0.0.1:0\n  extProc: 127.0.0.1:0\n{yaml}"
    )
}

/// Model config `llama` (model `llama`, with `model_extra`: more lines of it, indented four
/// spaces) on `port` and one endpoint on 127.0.0.1; `rest` adds sections.
fn one_engine(port: u16, model_extra: &str, rest: &str) -> String {
    format!(
        r#"
modelConfigs:
  - name: llama
    model: llama
    port: {port}
{model_extra}endpoints:
  - {{address: 127.0.0.1, modelConfig: llama}}
{rest}"#
    )
}

/// The pool most tests start from: [`one_engine`] with a one-minute staleness threshold;
/// `rest` adds sections.
pub fn one_engine_pool(port: u16, rest: &str) -> String {
    one_engine(
        port,
        "",
        &format!("routing: {{stalenessThreshold: 1m}}\n{rest}"),
    )
}

/// [`one_engine`] scraped every 50 ms; `rest` adds sections.
pub fn one_engine_scraped(port: u16, model_extra: &str, rest: &str) -> String {
    one_engine(
        port,
        model_extra,
        &format!("scrape: {{interval: 50ms, timeout: 200ms}}\n{rest}"),
    )
}

/// A `tenancy` section: dedicated endpoints by the `x-tenant` header, tenant `a` on the pods
/// labelled `tenant: a`, tenant `b` on those labelled `tenant: b`.
pub const DEDICATED_TENANTS: &str = "tenancy:
  isolation: DedicatedEndpoints
  header: x-tenant
  tenants:
    - {name: a, podSelector: {tenant: a}}
    - {name: b, podSelector: {tenant: b}}
";

/// The status of a completion of `prompt` (model `llama`) posted to `url`.
pub async fn completion_status(url: &str, prompt: &str) -> u16 {
    client()
        .post(url)
        .json(&serde_json::json!({"model": "llama", "prompt": prompt}))
        .send()
        .await
        .expect("the picker answers")
        .status()
        .as_u16()
}

/// The id of the picker's endpoint on `port`.
pub fn endpoint_on_port(picker: &Running, port: u16) -> kvroute_picker::endpoint::EndpointId {
    let pool = picker.state.pool.state();
    let endpoints = pool.endpoints();
    endpoints
        .endpoints()
        .iter()
        .find(|e| e.id.port == port)
        .expect("an endpoint on that port")
        .id
}

/// Start a picker from YAML (listen section added) with a static source.
pub async fn start_picker(yaml: &str) -> Running {
    let config = PickerConfig::from_yaml(&loopback_listen(yaml)).expect("valid config");
    let view = kvroute_picker::service::source::view_from_config(&config);
    let source = Box::new(StaticSource(view));
    start(config, source, CancellationToken::new())
        .await
        .expect("picker starts")
}

/// Start a picker that watches `path` (for reload tests).
pub async fn start_picker_file(path: std::path::PathBuf) -> Running {
    let config = PickerConfig::load(&path).expect("valid config");
    let source = Box::new(kvroute_picker::service::source::FileSource::new(
        path,
        Duration::from_millis(50),
    ));
    start(config, source, CancellationToken::new())
        .await
        .expect("picker starts")
}

/// Wait until `f` holds, polling; panics after `timeout`.
pub async fn eventually<F: FnMut() -> bool>(timeout: Duration, mut f: F) {
    let deadline = tokio::time::Instant::now() + timeout;
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "condition not met within {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

/// POST `body` as JSON to `url` with `headers`; the answer's JSON.
pub async fn post_json(
    url: String,
    headers: &[(&str, &str)],
    body: &serde_json::Value,
) -> serde_json::Value {
    kvroute_testkit::post_json_with(&client(), url, headers, body).await
}

/// The Prometheus text a picker's metrics listener serves.
pub async fn metrics_text(addr: SocketAddr) -> String {
    kvroute_testkit::get_text(&client(), format!("http://{addr}/metrics")).await
}

/// Waits until the exposition at `metrics` (the picker's metrics listener) satisfies `check`
/// for one of its lines; panics with the exposition after 5 s.
pub async fn until_metric(metrics: std::net::SocketAddr, check: impl Fn(&str) -> bool) {
    let c = client();
    let url = format!("http://{metrics}/metrics");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let text = kvroute_testkit::get_text(&c, url.clone()).await;
        if text.lines().any(&check) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not found in {text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Replaces the file at `path` with `contents` through a rename, so a watcher never reads it
/// half-written.
pub fn write_atomically(path: &std::path::Path, contents: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, contents).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}
