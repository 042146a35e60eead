//! HTTP listeners: the OpenAI-compatible proxy, the admin API (`/v1/pick`, `/debug/*`) and
//! metrics/health.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, HeaderName, StatusCode, Uri, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use futures::StreamExt;
use http_body_util::BodyExt;
use serde_json::{Value, json};

use super::errors::ApiError;
use super::model_rewrite::ResponseModelRewrite;
use super::request::{ApiKind, ParsedRequest};
use super::responses::ResponseWatch;
use super::state::{PickerState, Purpose};
use super::telemetry;
use crate::calibration::TtftBasis;
use crate::endpoint::EndpointId;
use crate::inflight::InflightGuard;
use crate::outlier::Outcome;
use tracing::Instrument as _;

/// State shared by the HTTP handlers.
#[derive(Clone, Debug)]
pub struct AppState {
    pub picker: Arc<PickerState>,
    /// Bearer token of the admin listener, when set.
    pub admin_token: Option<Arc<str>>,
}

/// Hop-by-hop headers are never forwarded (RFC 9110 §7.6.1).
fn hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "http2-settings"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
            | "proxy-authorization"
            | "proxy-authenticate"
            | "host"
            | "content-length"
    )
}

/// The header names `headers`' `Connection` headers nominate as hop-by-hop (RFC 9110
/// §7.6.1); none (and no allocation) for a message without one.
fn nominated(headers: &HeaderMap) -> Vec<&str> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .collect()
}

/// Headers a client may send that are the picker's to act on, never the engine's:
/// `expect` (the picker's own HTTP server answered `100 Continue` already; the engine would
/// get a body it never asked for after a header it may honour) and the prefill/decode
/// header naming where a prompt's KV is (only the picker's own split sets it, on the
/// gateway's path; a client's would point a decode engine at a host of its choice).
fn picker_only(name: &HeaderName) -> bool {
    name == header::EXPECT
        || name
            .as_str()
            .eq_ignore_ascii_case(super::ext_proc::PREFILLER_HOST_PORT_HEADER)
}

/// Whether `name` may be forwarded to the next hop: not hop-by-hop, not the picker's own,
/// and not `nominated`.
fn forwardable(nominated: &[&str], name: &HeaderName) -> bool {
    !hop_by_hop(name)
        && !picker_only(name)
        && !nominated
            .iter()
            .any(|n| n.eq_ignore_ascii_case(name.as_str()))
}

/// The POST paths the proxy forwards, each routed by the request's model: by prefix where the
/// body carries a prompt the engine prefills ([`ApiKind`]), by load among the model's
/// endpoints for the rest.
pub const FORWARDED_PATHS: [&str; 12] = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/embeddings",
    "/v1/completions/render",
    "/v1/chat/completions/render",
    "/v1/responses/render",
    "/v1/messages/render",
    "/v1/messages/count_tokens",
    "/tokenize",
    "/detokenize",
];

/// The inference listener: the OpenAI and Anthropic APIs an engine serves, and health.
pub fn inference_app(state: AppState) -> Router {
    let mut app = Router::new();
    for path in FORWARDED_PATHS {
        app = app.route(path, post(forward));
    }
    app.route("/v1/responses/{id}", get(stored_response))
        .route("/v1/responses/{id}/cancel", post(stored_response))
        .route("/v1/models", get(models))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .fallback(not_found)
        .layer(DefaultBodyLimit::disable())
        .layer(middleware::from_fn(super::errors::speak_the_request_api))
        .with_state(state)
}

/// The admin listener: decisions without forwarding, and the picker's view.
pub fn admin_app(state: AppState) -> Router {
    Router::new()
        .route("/v1/pick", post(pick))
        .route("/debug/endpoints", get(debug_endpoints))
        .route("/healthz", get(healthz))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(state.clone(), require_token))
        .layer(DefaultBodyLimit::disable())
        .with_state(state)
}

/// The metrics listener.
pub fn metrics_app(state: AppState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route(super::warm_start::COPY_PATH, get(index_copy))
        .fallback(not_found)
        .with_state(state)
}

async fn require_token(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(token) = &state.admin_token {
        let ok = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|t| constant_time_eq(t.as_bytes(), token.as_bytes()));
        if !ok {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn not_found(method: axum::http::Method, uri: Uri) -> ApiError {
    ApiError::not_found(&format!("{method} {}", uri.path()))
}

async fn healthz() -> &'static str {
    "ok"
}

async fn readyz(State(state): State<AppState>) -> Response {
    if state.picker.is_ready() {
        "ready".into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: waiting for endpoints and first metrics",
        )
            .into_response()
    }
}

async fn metrics(State(state): State<AppState>) -> Response {
    state.picker.refresh_outlier_gauges();
    state.picker.refresh_calibration_gauges();
    state.picker.refresh_working_set_gauges();
    let failures = super::telemetry::export_failures();
    let counted = state.picker.metrics.trace_export_failures.get();
    if failures > counted {
        state
            .picker
            .metrics
            .trace_export_failures
            .inc_by(failures - counted);
    }
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.picker.metrics.encode(),
    )
        .into_response()
}

/// Reads a request body within its bounds: at most `maxBodyBytes`, within `bodyReadTimeout`,
/// and while it is read its bytes count against `bodyBufferBytes`, shared by every body being
/// read. Bodies in flight are then bounded in memory without holding an in-flight admission
/// slot (which a stalled body must never get), and a stalled body holds only what it sent.
async fn read_body(picker: &PickerState, body: Body) -> Result<Bytes, ApiError> {
    let limit = picker.limits.max_body_bytes;
    let timeout = picker.limits.body_read_timeout;
    let read = async {
        let mut body = body;
        let mut chunks: Vec<Bytes> = Vec::new();
        let mut len = 0usize;
        let mut held: Option<tokio::sync::SemaphorePermit<'_>> = None;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| {
                ApiError::bad_request(
                    "body_read_failed",
                    format!("could not read the request body: {e}"),
                )
            })?;
            let Ok(data) = frame.into_data() else {
                continue; // trailers carry nothing the picker reads
            };
            len += data.len();
            if len > limit {
                return Err(ApiError::too_large(limit));
            }
            let permit = u32::try_from(data.len())
                .ok()
                .and_then(|n| picker.body_buffer.try_acquire_many(n).ok())
                .ok_or_else(|| {
                    ApiError::shed("the picker's request-body buffer is full; retry later")
                })?;
            match &mut held {
                Some(h) => h.merge(permit),
                None => held = Some(permit),
            }
            chunks.push(data);
        }
        Ok(match chunks.len() {
            0 => Bytes::new(),
            1 => chunks.swap_remove(0),
            _ => Bytes::from(chunks.concat()),
        })
    };
    tokio::time::timeout(timeout, read)
        .await
        .unwrap_or(Err(ApiError::body_timeout(timeout)))
}

async fn forward(
    State(state): State<AppState>,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let kind = ApiKind::from_path(uri.path());
    proxy(state, kind, uri, headers, body).await
}

/// `GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`: to the endpoint storing the
/// response when the picker knows it, else the least-loaded one (which answers 404 if it does
/// not hold it).
async fn stored_response(
    State(state): State<AppState>,
    method: axum::http::Method,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let picker = &state.picker;
    let result = async {
        let admission = picker
            .admit()
            .ok_or_else(|| ApiError::shed("the picker has too many requests in flight"))?;
        let ep = picker.pick_bodyless(uri.path(), &headers, None)?;
        let target = format!(
            "http://{}{}",
            ep.host_port(),
            uri.path_and_query().map_or(uri.path(), |p| p.as_str())
        );
        let mut req = picker.http.request(method, target);
        let hop_by_hop_here = nominated(&headers);
        for (name, value) in &headers {
            if forwardable(&hop_by_hop_here, name) {
                req = req.header(name, value);
            }
        }
        let resp = match tokio::time::timeout(picker.limits.upstream_timeout, req.send()).await {
            Err(_) => {
                return Err(ApiError::gateway_timeout(format!(
                    "endpoint {ep} sent no response within {:?}",
                    picker.limits.upstream_timeout
                )));
            }
            Ok(Err(e)) => return Err(ApiError::bad_gateway(format!("endpoint {ep} failed: {e}"))),
            Ok(Ok(resp)) => resp,
        };
        let timing = Timing {
            endpoint: ep,
            sent: Instant::now(),
            basis: None,
            generates: false,
        };
        let guard = picker.pool.begin(ep, 0, 0, false);
        Ok(stream_back(
            picker.clone(),
            resp,
            guard,
            timing,
            admission,
            Relayed::default(),
        ))
    }
    .await;
    result.unwrap_or_else(|e: ApiError| {
        picker.metrics.error(e.code);
        e.into_response()
    })
}

async fn models(State(state): State<AppState>) -> Response {
    axum::Json(super::models::list(&state.picker).await).into_response()
}

async fn proxy(
    state: AppState,
    kind: ApiKind,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let picker = &state.picker;
    match proxy_inner(picker, kind, &uri, headers, body).await {
        Ok(r) => r,
        Err(e) => {
            picker.metrics.error(e.code);
            e.into_response()
        }
    }
}

async fn proxy_inner(
    picker: &Arc<PickerState>,
    kind: ApiKind,
    uri: &Uri,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let span = telemetry::request_span(header_pairs(&headers), kind.name(), uri.path());
    proxy_traced(picker, kind, uri, headers, body)
        .instrument(span)
        .await
}

/// A request's headers as name/value pairs (values that are not text left out).
pub fn header_pairs(headers: &HeaderMap) -> impl Iterator<Item = (&str, &str)> {
    headers
        .iter()
        .filter_map(|(k, v)| Some((k.as_str(), v.to_str().ok()?)))
}

async fn proxy_traced(
    picker: &Arc<PickerState>,
    kind: ApiKind,
    uri: &Uri,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let raw = read_body(picker, body).await?;
    // admitted only once the body is in: a client that stalls its body holds no slot
    let admission = picker
        .admit()
        .ok_or_else(|| ApiError::shed("the picker has too many requests in flight"))?;
    let parsed = {
        let _span = tracing::info_span!(target: telemetry::TARGET, "parse").entered();
        ParsedRequest::parse(kind, raw, &picker.limits.request())?
    };
    tracing::Span::current().record("model", parsed.model.as_deref().unwrap_or_default());
    let mut routed = picker
        .decide(&parsed, &headers, None, Purpose::Forward)
        .await?;
    let hop_by_hop_here = nominated(&headers);
    // a split request: its prefill first, then its decode with the KV's whereabouts
    let mut kv_params = None;
    let mut split_id = None;
    // a split request's decode endpoint counts it from now: the KV it will pull is on its
    // way there, and the next decisions must see it (or they all pick the same emptiest one)
    let mut reserved = routed
        .prefill
        .as_ref()
        .map(|_| picker.begin(&routed, routed.placement.decision.endpoint));
    if routed.prefill.is_some() {
        let id = super::disagg::request_id(&headers);
        let mut passed: Vec<(HeaderName, axum::http::HeaderValue)> = headers
            .iter()
            .filter(|(name, _)| {
                forwardable(&hop_by_hop_here, name)
                    && !name.as_str().eq_ignore_ascii_case("x-data-parallel-rank")
                    && !name
                        .as_str()
                        .eq_ignore_ascii_case(super::disagg::REQUEST_ID_HEADER)
            })
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect();
        if let Ok(v) = axum::http::HeaderValue::from_str(&id) {
            passed.push((HeaderName::from_static(super::disagg::REQUEST_ID_HEADER), v));
        }
        let path = uri.path_and_query().map_or(uri.path(), |p| p.as_str());
        let prefill =
            tracing::info_span!(target: telemetry::TARGET, "prefill", otel.kind = "client");
        match picker
            .prefill_step(&routed, &parsed, path, &passed)
            .instrument(prefill)
            .await?
        {
            super::disagg::Prefilled::Params(p) => kv_params = Some(p),
            // whole on the decode endpoint, which prefills it itself
            super::disagg::Prefilled::Failed => {
                routed.prefill = None;
                // counted again below, with the prefill it now does itself
                reserved = None;
            }
            super::disagg::Prefilled::Refused(resp) => return Ok(resp),
        }
        split_id = Some(id);
    }
    let d = &routed.placement.decision;
    // the chosen endpoint, then one retry on the next fallback if it fails before responding
    let targets: Vec<EndpointId> = routed.targets().take(2).collect();
    let mut last_err = ApiError::bad_gateway("no upstream attempted");
    // a 5xx answer waits for the retry before it counts against its endpoint: a request that
    // fails everywhere it is tried is failing by itself (outlier module docs)
    let mut unsettled: Option<(EndpointId, Outcome)> = None;
    for (attempt, &ep) in targets.iter().enumerate() {
        let mut upstream = if ep == d.endpoint {
            routed.upstream.clone()
        } else {
            routed.upstream_for(&parsed, ep)?
        };
        if let Some(p) = &kv_params {
            upstream.body = super::disagg::decode_body(&upstream.body, p)?;
        }
        let guard = match reserved.take() {
            Some(g) if ep == d.endpoint => g,
            _ => picker.begin(&routed, ep),
        };
        if !parsed.stream {
            picker.prefill_clock(&guard, &routed);
        }
        let mut req = picker
            .http
            .post(format!(
                "http://{}{}",
                ep.host_port(),
                uri.path_and_query().map_or(uri.path(), |p| p.as_str())
            ))
            .body(upstream.body);
        let forward = tracing::info_span!(
            target: telemetry::TARGET,
            "forward",
            otel.kind = "client",
            endpoint = %ep,
            attempt,
            fallback = attempt > 0,
            http.status_code = tracing::field::Empty,
        );
        // traced, the engine's parent is the forward span, not the client's
        let context = telemetry::context_headers(&forward);
        // the picker's own: the rank, a split request's shared id, the trace context
        let replaced = |name: &HeaderName| {
            let name = name.as_str();
            name.eq_ignore_ascii_case("x-data-parallel-rank")
                || (split_id.is_some()
                    && name.eq_ignore_ascii_case(super::disagg::REQUEST_ID_HEADER))
                || context.iter().any(|(k, _)| name.eq_ignore_ascii_case(k))
        };
        for (name, value) in &headers {
            if forwardable(&hop_by_hop_here, name) && !replaced(name) {
                req = req.header(name, value);
            }
        }
        if let Some(id) = &split_id {
            req = req.header(super::disagg::REQUEST_ID_HEADER, id.as_str());
        }
        for (name, value) in upstream.headers.into_iter().chain(context) {
            req = req.header(name, value);
        }
        let sent = Instant::now();
        let result = tokio::time::timeout(picker.limits.upstream_timeout, req.send())
            .instrument(forward.clone())
            .await;
        if let Ok(Ok(r)) = &result {
            forward.record("http.status_code", r.status().as_u16());
        }
        let answered_5xx = matches!(&result, Ok(Ok(r)) if r.status().is_server_error());
        match (unsettled.take(), outcome_of(&result, parsed.stream)) {
            (Some(_), _) if answered_5xx => {
                picker.metrics.error("failed_on_every_target");
                tracing::debug!(endpoint = %ep, "the request failed on every endpoint it was tried on: charged to none");
            }
            (Some((first, failure)), outcome) => {
                picker.record_outcome(first, failure);
                if let Some(outcome) = outcome {
                    picker.record_outcome(ep, outcome);
                }
            }
            (None, Some(outcome)) if answered_5xx && attempt + 1 < targets.len() => {
                unsettled = Some((ep, outcome));
            }
            (None, Some(outcome)) => picker.record_outcome(ep, outcome),
            (None, None) => {}
        }
        match result {
            Err(_) => {
                return Err(ApiError::gateway_timeout(format!(
                    "endpoint {ep} sent no response within {:?}",
                    picker.limits.upstream_timeout
                )));
            }
            Ok(Err(e)) if e.is_timeout() => {
                return Err(ApiError::gateway_timeout(format!(
                    "endpoint {ep} timed out: {e}"
                )));
            }
            Ok(Err(e)) if e.is_builder() => {
                return Err(ApiError::bad_gateway(format!("endpoint {ep} failed: {e}")));
            }
            // refused, reset or closed before the response head: the client has seen nothing
            // yet, so the request can go to the next fallback (an engine that crashed while
            // it was queued or prefilling)
            Ok(Err(e)) => {
                last_err =
                    ApiError::bad_gateway(format!("endpoint {ep} failed before responding: {e}"));
                if attempt + 1 < targets.len() {
                    picker.metrics.retries.inc();
                    tracing::warn!(endpoint = %ep, error = %e, "endpoint failed before responding, retrying on the next fallback");
                }
            }
            // A 5xx head with nothing relayed yet: the client has seen nothing of it, so the
            // request goes to the next fallback. That is safe because the picker holds the
            // whole body, and a completion that failed without output had no effect a client
            // could observe (an engine keeps nothing from it but KV cache), so sending it again
            // cannot duplicate anything. The last target's 5xx goes to the client as it came.
            Ok(Ok(resp)) if resp.status().is_server_error() && attempt + 1 < targets.len() => {
                picker.metrics.retries.inc();
                tracing::warn!(endpoint = %ep, status = resp.status().as_u16(), "endpoint answered a 5xx, retrying on the next fallback");
                last_err =
                    ApiError::bad_gateway(format!("endpoint {ep} answered {}", resp.status()));
            }
            Ok(Ok(resp)) => {
                if resp.status().is_success() {
                    picker.served(&routed, ep);
                }
                // only a streamed response's first chunk is its first token, and only the
                // chosen endpoint's was estimated
                let basis = routed
                    .placement
                    .ttft_basis
                    .filter(|_| parsed.stream && ep == d.endpoint);
                let timing = Timing {
                    endpoint: ep,
                    sent,
                    basis,
                    generates: kind != ApiKind::Other,
                };
                let watch = resp
                    .status()
                    .is_success()
                    .then(|| picker.watch_response(&routed, ep))
                    .flatten();
                let rewrite = routed
                    .rewrite
                    .as_ref()
                    .map(|r| ResponseModelRewrite::new(&r.target, &r.asked));
                return Ok(stream_back(
                    picker.clone(),
                    resp,
                    guard,
                    timing,
                    admission,
                    Relayed { watch, rewrite },
                ));
            }
        }
    }
    Err(last_err)
}

/// What an attempt tells passive health; `None` for the picker's own failures and for a
/// non-streamed request's timeout (its response head waits for the whole generation, so the
/// time says as much about the request as about the engine).
fn outcome_of(
    result: &Result<reqwest::Result<reqwest::Response>, tokio::time::error::Elapsed>,
    stream: bool,
) -> Option<Outcome> {
    match result {
        Err(_) => stream.then_some(Outcome::GatewayError),
        Ok(Err(e)) if e.is_builder() => None,
        Ok(Err(_)) => Some(Outcome::GatewayError),
        Ok(Ok(resp)) => Some(Outcome::from_status(resp.status().as_u16())),
    }
}

/// What the relay does with a response body besides passing it on.
#[derive(Default)]
struct Relayed {
    /// A Responses body's watch for the response id.
    watch: Option<ResponseWatch>,
    /// The model a rewrite rule served, written back to the one the client named.
    rewrite: Option<ResponseModelRewrite>,
}

/// When and where a request was forwarded, and what its TTFT estimate rested on.
struct Timing {
    endpoint: EndpointId,
    sent: Instant,
    /// Set when the first chunk is a TTFT the calibration learns from.
    basis: Option<TtftBasis>,
    /// Whether the first chunk is a first token (not for a stored response fetched back).
    generates: bool,
}

/// Relay the engine's response chunk by chunk, never buffering it. The in-flight guard (and
/// the admission slot) live as long as the stream: the first chunk marks the first token,
/// the end (or the client going away, which drops the stream and so the upstream connection)
/// marks completion.
fn stream_back(
    picker: Arc<PickerState>,
    resp: reqwest::Response,
    guard: InflightGuard,
    mut timing: Timing,
    admission: super::state::Admission,
    relayed: Relayed,
) -> Response {
    let status = resp.status();
    if !status.is_success() {
        timing.basis = None;
    }
    let mut builder = Response::builder().status(status.as_u16());
    let hop_by_hop_there = nominated(resp.headers());
    // a body whose model is written back may change length: it goes chunked
    let rewrites = relayed.rewrite.is_some();
    for (name, value) in resp.headers() {
        if forwardable(&hop_by_hop_there, name) || (name == header::CONTENT_LENGTH && !rewrites) {
            builder = builder.header(name, value);
        }
    }
    let idle = picker.limits.idle_timeout;
    struct Relay {
        upstream: futures::stream::BoxStream<'static, reqwest::Result<Bytes>>,
        guard: InflightGuard,
        first: bool,
        picker: Arc<PickerState>,
        timing: Timing,
        _admission: super::state::Admission,
        /// A Responses body's head, read until the response's id shows; the model rewrite.
        relayed: Relayed,
        ended: bool,
    }
    let relay = Relay {
        upstream: resp.bytes_stream().boxed(),
        guard,
        first: true,
        picker,
        timing,
        _admission: admission,
        relayed,
        ended: false,
    };
    let stream = futures::stream::unfold(relay, move |mut r| async move {
        if r.ended {
            return None;
        }
        match tokio::time::timeout(idle, r.upstream.next()).await {
            Ok(Some(Ok(chunk))) => {
                if std::mem::take(&mut r.first) {
                    r.guard.first_token();
                    let ttft = r.timing.sent.elapsed();
                    if r.timing.generates {
                        r.picker
                            .metrics
                            .upstream_ttft_seconds
                            .observe(ttft.as_secs_f64());
                    }
                    if let Some(basis) = r.timing.basis.take() {
                        r.picker.observe_ttft(r.timing.endpoint, basis, ttft);
                    }
                }
                if let Some(w) = r.relayed.watch.as_mut()
                    && !r.picker.response_chunk(w, &chunk)
                {
                    r.relayed.watch = None;
                }
                let chunk = match r.relayed.rewrite.as_mut() {
                    Some(rw) => rw.chunk(&chunk),
                    None => chunk,
                };
                Some((Ok::<Bytes, std::io::Error>(chunk), r))
            }
            Ok(Some(Err(e))) => {
                r.picker.metrics.error("upstream_stream_error");
                Some((Err(std::io::Error::other(e)), r))
            }
            Ok(None) => {
                // what the model rewrite held back
                let rest = r.relayed.rewrite.as_mut().map(ResponseModelRewrite::finish);
                r.ended = true;
                rest.filter(|b| !b.is_empty()).map(|b| (Ok(b), r))
            }
            Err(_) => {
                r.picker.metrics.error("upstream_idle_timeout");
                Some((
                    Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "upstream idle timeout",
                    )),
                    r,
                ))
            }
        }
    })
    // stop after the first error: the client sees the stream end abnormally
    .scan(false, |failed, item| {
        let out = if *failed { None } else { Some(item) };
        if out.as_ref().is_some_and(Result::is_err) {
            *failed = true;
        }
        futures::future::ready(out)
    });
    builder
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| ApiError::bad_gateway("invalid upstream response").into_response())
}

/// `POST /v1/pick?path=/v1/responses`: the API the body is for.
#[derive(serde::Deserialize)]
struct PickQuery {
    path: Option<String>,
}

async fn pick(
    State(state): State<AppState>,
    axum::extract::Query(query): axum::extract::Query<PickQuery>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let picker = &state.picker;
    let result: Result<Value, ApiError> = async {
        let raw = read_body(picker, body).await?;
        // the API `?path=` names; else a chat when the body has `messages` (checked without
        // building a JSON tree), a completion otherwise
        #[derive(serde::Deserialize)]
        struct Probe {
            #[serde(default)]
            messages: Option<serde::de::IgnoredAny>,
        }
        let kind = match query.path.as_deref() {
            Some(path) => match ApiKind::from_path(path) {
                ApiKind::Other => {
                    return Err(ApiError::bad_request(
                        "invalid_field",
                        format!(
                            "`path` {path:?} is not an API the picker reads a prompt from: /v1/completions, /v1/chat/completions, /v1/responses, /v1/messages or /v1/embeddings"
                        ),
                    ));
                }
                kind => kind,
            },
            None => match serde_json::from_slice::<Probe>(&raw) {
                Ok(Probe { messages: Some(_) }) => ApiKind::ChatCompletions,
                _ => ApiKind::Completions,
            },
        };
        let parsed = ParsedRequest::parse(kind, raw, &picker.limits.request())?;
        let routed = picker
            .decide(&parsed, &headers, None, Purpose::Explain)
            .await?;
        let d = &routed.placement.decision;
        let mut candidates = serde_json::to_value(&d.candidates).unwrap_or_default();
        let mut prefill_candidates = routed
            .prefill
            .as_ref()
            .map(|p| serde_json::to_value(&p.decision.candidates).unwrap_or_default());
        let mut admission = serde_json::to_value(routed.admission).unwrap_or_default();
        if picker.tenancy().spec.isolation != crate::pool::Isolation::None {
            // the pool's live context counts every tenant's sessions
            if let Some(room) = admission.get_mut("hold") {
                *room = Value::Null;
            }
            // how many blocks an endpoint holds counts every tenant's traffic: a tenant
            // explaining its own request must not learn where the others' went
            for c in candidates
                .as_array_mut()
                .into_iter()
                .chain(prefill_candidates.as_mut().and_then(Value::as_array_mut))
                .flatten()
            {
                if let Some(f) = c.get_mut("features").and_then(Value::as_object_mut) {
                    f.remove("indexed_blocks");
                }
            }
        }
        Ok(json!({
            "endpoint": d.endpoint.host_port(),
            "rank": d.endpoint.rank,
            "fallbacks": d.fallbacks.iter().map(|f| json!({"endpoint": f.host_port(), "rank": f.rank})).collect::<Vec<_>>(),
            "model_config": &*d.model_config,
            "policy": d.policy,
            "reason": d.reason,
            "prompt_tokens": routed.plan.prompt_tokens,
            "prompt_blocks": routed.plan.keys.len(),
            "matched_blocks": d.matched_blocks,
            "cached_tokens": d.cached_tokens,
            "failed_open": d.failed_open,
            "unread_prompt": parsed.unread,
            "tenant": routed.tenant,
            "headers": routed.upstream.headers.iter().map(|(k, v)| (k.to_string(), Value::from(v.clone()))).collect::<serde_json::Map<_, _>>(),
            "candidates": candidates,
            "admission": admission,
            "disaggregation": routed.verdict,
            "prefill": routed.prefill.as_ref().map(|p| {
                let d = &p.decision;
                json!({
                    "endpoint": d.endpoint.host_port(),
                    "rank": d.endpoint.rank,
                    "fallbacks": d.fallbacks.iter().map(|f| json!({"endpoint": f.host_port(), "rank": f.rank})).collect::<Vec<_>>(),
                    "policy": d.policy,
                    "matched_blocks": d.matched_blocks,
                    "cached_tokens": d.cached_tokens,
                    "candidates": prefill_candidates,
                })
            }),
        }))
    }
    .await;
    match result {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => {
            picker.metrics.error(e.code);
            e.into_response()
        }
    }
}

/// A peer replica's request for this picker's KV index ([`super::warm_start`]).
async fn index_copy(State(state): State<AppState>, headers: HeaderMap) -> Response {
    let auth = headers
        .get(super::warm_start::AUTH_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let picker = state.picker.clone();
    let served = tokio::task::spawn_blocking(move || {
        super::warm_start::serve_copy(&picker, auth.as_deref())
    })
    .await
    .unwrap_or_else(|e| Err((500, e.to_string())));
    match served {
        Ok(bytes) => ([(header::CONTENT_TYPE, "application/octet-stream")], bytes).into_response(),
        Err((status, message)) => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            (status, axum::Json(json!({"error": {"message": message}}))).into_response()
        }
    }
}

async fn debug_endpoints(State(state): State<AppState>) -> Response {
    let picker = &state.picker;
    // (never under the pool's lock: loading a copy takes them the other way round)
    let warm = picker.warm.lock().clone();
    let pool = picker.pool.state().read();
    let (snap, index, loads) = (&pool.endpoints, pool.index(), pool.loads());
    let list: Vec<Value> = snap
        .endpoints()
        .iter()
        .map(|e| {
            let slot = index.slot(&e.id);
            json!({
                "endpoint": e.id.host_port(),
                "rank": e.id.rank,
                "model_config": &*e.model_config.name,
                "state": e.state,
                "labels": e.labels,
                "load": loads.get(&e.id),
                "inflight": picker.pool.inflight().get(&e.id),
                "peer_inflight": picker.pool.inflight().peers_total(&e.id),
                "cached_blocks": slot.map_or(0, |s| index.endpoint_blocks(s)),
                "unconfirmed_blocks": slot.map_or(0, |s| index.unconfirmed_blocks(s)),
                "view_gap": slot.is_some_and(|s| index.has_gap(s)),
                "index_mode": slot.and_then(|s| index.mode(s)).map(|m| format!("{m:?}")),
                "diagnostics": picker.diagnostics.lock().get(&e.id),
                "outlier": picker.outlier_status(&e.id),
                "calibration": picker.pool.calibration().read().status(&e.id),
            })
        })
        .collect();
    axum::Json(json!({
        "version": snap.version(),
        "now_ms": picker.now_ms(),
        "routing": *picker.routing(),
        "warm_start": warm,
        "endpoints": list,
    }))
    .into_response()
}

/// How long in-flight streams get to finish after shutdown starts.
pub const DRAIN_DEADLINE: Duration = Duration::from_secs(30);

/// The listeners' answers driven without a socket (`tower::ServiceExt::oneshot` on the axum
/// apps): what does not depend on a connection is tested here, as rows of one table.
#[cfg(test)]
mod tests {
    use axum::http::{Method, Request as HttpRequest};
    use tower::ServiceExt as _;

    use super::*;
    use crate::service::settings::Limits;
    use crate::service::state::test_support::picker;

    fn state() -> AppState {
        let limits = Limits {
            max_body_bytes: 2048,
            ..Limits::default()
        };
        AppState {
            picker: Arc::new(picker(limits)),
            admin_token: Some(Arc::from("admin-token")),
        }
    }

    /// One request to `app`: its status and its JSON body (`null` when it has none).
    async fn call(
        app: Router,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> (u16, Value) {
        let mut req = HttpRequest::builder().method(method).uri(path);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = app
            .oneshot(req.body(Body::from(body.to_owned())).expect("a request"))
            .await
            .expect("answered");
        let status = resp.status().as_u16();
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .expect("a body");
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    #[tokio::test]
    async fn the_listeners_answer_bad_requests_with_openai_errors_without_a_socket() {
        let s = state();
        let token = ("authorization", "Bearer admin-token");
        let json = ("content-type", "application/json");
        let completion = r#"{"model":"m","prompt":"hello"}"#;
        // (which app, method, path, headers, body, status, the error's code, a word of its
        // message)
        let admin = || admin_app(s.clone());
        let inference = || inference_app(s.clone());
        let big = format!(r#"{{"model":"m","prompt":"{}"}}"#, "x".repeat(4096));
        type App<'a> = &'a dyn Fn() -> Router;
        type Row<'a> = (
            App<'a>,
            Method,
            &'a str,
            Vec<(&'a str, &'a str)>,
            &'a str,
            u16,
            &'a str,
            &'a str,
        );
        #[rustfmt::skip]
        let rows: Vec<Row<'_>> = vec![
            (&admin, Method::POST, "/v1/pick", vec![], completion, 401, "unauthorized", ""),
            (&admin, Method::POST, "/v1/pick", vec![("authorization", "Bearer nope")], completion, 401, "unauthorized", ""),
            (&admin, Method::POST, "/v1/pick", vec![token], "not json", 400, "invalid_json", ""),
            (&admin, Method::POST, "/v1/pick", vec![token], r#"{"model":"nope","prompt":"x"}"#, 404, "model_not_found", "nope"),
            (&admin, Method::POST, "/v1/pick?path=/v1/nope", vec![token], completion, 400, "invalid_field", "/v1/nope"),
            (&admin, Method::GET, "/v1/nope", vec![token], "", 404, "not_found", ""),
            (&inference, Method::POST, "/v1/completions", vec![json], "{not json", 400, "invalid_json", ""),
            (&inference, Method::POST, "/v1/completions", vec![json], r#"{"model":"m"}"#, 400, "missing_field", "prompt"),
            (&inference, Method::POST, "/v1/completions", vec![json], r#"{"model":"nope","prompt":"x"}"#, 404, "model_not_found", "nope"),
            (&inference, Method::POST, "/v1/completions", vec![json], &big, 413, "body_too_large", ""),
            (&inference, Method::POST, "/v1/completions", vec![json], r#"{"model":"m","prompt":"x","kv_transfer_params":{"do_remote_prefill":true}}"#, 400, "invalid_field", "kv_transfer_params"),
            (&inference, Method::POST, "/v1/chat/completions", vec![json], "[1,2]", 400, "invalid_json", ""),
            (&inference, Method::POST, "/v1/chat/completions", vec![json], r#"{"model":"m","messages":[]}"#, 400, "", ""),
            // the pick API is not on the proxy's listener
            (&inference, Method::POST, "/v1/pick", vec![json], completion, 404, "not_found", ""),
            (&inference, Method::GET, "/v2/anything", vec![], "", 404, "not_found", ""),
        ];
        for (app, method, path, headers, body, status, code, word) in rows {
            let (got, err) = call(app(), method.clone(), path, &headers, body).await;
            let what = format!("{method} {path} {}: {err}", &body[..body.len().min(80)]);
            assert_eq!(got, status, "{what}");
            if !code.is_empty() {
                assert_eq!(err["error"]["code"], code, "{what}");
            }
            let message = err["error"]["message"].as_str().unwrap_or_default();
            assert!(!message.is_empty() && message.contains(word), "{what}");
            assert!(err["error"]["type"].is_string(), "{what}");
        }
        // a body naming no model is for the pool's one model
        let (status, pick) = call(
            admin(),
            Method::POST,
            "/v1/pick",
            &[token],
            r#"{"prompt":"x"}"#,
        )
        .await;
        assert_eq!(
            (status, &pick["model_config"]),
            (200, &json!("a")),
            "{pick}"
        );
        // and the pick API's answer itself: an endpoint of the pool, and admission off
        let (status, pick) = call(admin(), Method::POST, "/v1/pick", &[token], completion).await;
        assert_eq!(status, 200, "{pick}");
        let endpoint = pick["endpoint"].as_str().expect("an endpoint");
        assert!(
            ["127.0.0.2:8000", "127.0.0.3:8000"]
                .iter()
                .any(|e| endpoint.starts_with(e)),
            "{pick}"
        );
        assert_eq!(
            pick["admission"],
            serde_json::json!({"admit": "disabled"}),
            "{pick}"
        );
    }
}
