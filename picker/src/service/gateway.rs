//! The picker core as a Gateway API Inference Extension endpoint picker (over ext_proc).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use axum::http::StatusCode;
use parking_lot::Mutex;

use super::errors::ApiError;
use super::ext_proc::{EndpointPicker, PickInput, PickOutput, PickRejection};
use super::model_rewrite::ResponseModelRewrite;
use super::request::{ApiKind, ParsedRequest};
use super::responses::ResponseWatch;
use super::state::{Admission, PickerState, Purpose};
use super::telemetry;
use crate::calibration::TtftBasis;
use crate::endpoint::EndpointId;
use crate::inflight::InflightGuard;
use crate::outlier::Outcome;
use tracing::Instrument as _;

struct Pending {
    guard: InflightGuard,
    /// A split request's count on its prefill endpoint.
    _prefill_guard: Option<InflightGuard>,
    _admission: Admission,
    /// The chosen endpoint, then the fallbacks, in the order the gateway tries them.
    targets: Vec<EndpointId>,
    /// The one the gateway reported as serving, once it did.
    served: Option<EndpointId>,
    /// The response's status, once the gateway reported it.
    status: Option<u16>,
    /// When the pick was answered, and what the chosen endpoint's TTFT estimate rested on
    /// (set for streamed requests while calibration is on).
    picked: Instant,
    basis: Option<TtftBasis>,
    /// Whether the response streams (its head comes before the generation).
    stream: bool,
    /// Set when the gateway fell back from the chosen endpoint: charged to it once the
    /// fallback's status shows the request itself was not failing.
    primary_failed: bool,
    /// The request's session, pinned to the endpoint that serves it with a success, and its
    /// prompt tokens (the session's working set there).
    session_key: Option<u64>,
    prompt_tokens: u32,
    /// Session admission's ticket, when the pick waited for room.
    admission_ticket: Option<crate::admission::Ticket>,
    /// A Responses request's watch for its response's id, while the body may still show it.
    watch: Option<ResponseWatch>,
    /// The model a rewrite rule served, written back to the one the client named.
    rewrite: Option<ResponseModelRewrite>,
}

/// Adapts [`PickerState`] to the ext_proc protocol. The gateway forwards the request itself, so
/// in-flight accounting runs from the pick to the end of the response stream.
pub struct GatewayPicker {
    picker: Arc<PickerState>,
    pending: Mutex<HashMap<u64, Pending>>,
}

impl GatewayPicker {
    pub fn new(picker: Arc<PickerState>) -> Self {
        Self {
            picker,
            pending: Mutex::new(HashMap::new()),
        }
    }

    pub fn pending(&self) -> usize {
        self.pending.lock().len()
    }

    /// [`EndpointPicker::pick`] within the request's span.
    async fn pick_traced(&self, input: PickInput) -> Result<PickOutput, PickRejection> {
        let picker = &self.picker;
        let refuse = |e: ApiError| {
            picker.metrics.error(e.code);
            rejection(e)
        };
        let admission = picker.admit().ok_or_else(|| {
            PickRejection::Shed("the picker has too many requests in flight".into())
        })?;
        let kind = ApiKind::from_path(&input.path);
        if kind == ApiKind::Other && input.body.is_empty() {
            let id = picker
                .pick_bodyless(&input.path, &input.headers, input.subset.as_deref())
                .map_err(refuse)?;
            return Ok(PickOutput {
                endpoints: vec![SocketAddr::new(id.address, id.port)],
                ..PickOutput::default()
            });
        }
        let parsed = {
            let _span = tracing::info_span!(target: telemetry::TARGET, "parse").entered();
            ParsedRequest::parse(kind, input.body.clone(), &picker.limits.request())
                .map_err(|e| refuse(e.into()))?
        };
        tracing::Span::current().record("model", parsed.model.as_deref().unwrap_or_default());
        let routed = picker
            .decide(
                &parsed,
                &input.headers,
                input.subset.as_deref(),
                Purpose::Forward,
            )
            .await
            .map_err(refuse)?;
        let d = &routed.placement.decision;
        let mut endpoints: Vec<SocketAddr> = Vec::with_capacity(1 + d.fallbacks.len());
        for id in routed.targets() {
            let a = SocketAddr::new(id.address, id.port);
            // ranks sharing a port collapse into one address; the rank header goes with the
            // first, the chosen one
            if !endpoints.contains(&a) {
                endpoints.push(a);
            }
        }
        let guard = picker.begin(&routed, d.endpoint);
        if !parsed.stream {
            picker.prefill_clock(&guard, &routed);
        }
        // a split request: the decode endpoint's sidecar runs the prefill step on this one
        let prefill = routed.prefill.as_ref().map(|p| p.decision.endpoint);
        let prefill_guard = prefill.map(|p| picker.begin(&routed, p));
        self.pending.lock().insert(
            input.request_id,
            Pending {
                guard,
                _prefill_guard: prefill_guard,
                _admission: admission,
                targets: routed.targets().collect(),
                served: None,
                status: None,
                picked: Instant::now(),
                basis: routed.placement.ttft_basis.filter(|_| parsed.stream),
                stream: parsed.stream,
                primary_failed: false,
                session_key: routed.session_key(),
                prompt_tokens: routed.placement.prompt_tokens,
                admission_ticket: routed.admission_ticket,
                watch: picker.watch_response(&routed, d.endpoint),
                rewrite: routed
                    .rewrite
                    .as_ref()
                    .map(|r| ResponseModelRewrite::new(&r.target, &r.asked)),
            },
        );
        Ok(PickOutput {
            endpoints,
            // traced, the engine's parent is this request's span
            set_headers: routed
                .upstream
                .headers
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.clone()))
                .chain(prefill.map(|p| {
                    (
                        super::ext_proc::PREFILLER_HOST_PORT_HEADER.to_owned(),
                        p.host_port(),
                    )
                }))
                .chain(
                    telemetry::context_headers(&tracing::Span::current())
                        .into_iter()
                        .map(|(k, v)| (k.to_owned(), v)),
                )
                .collect(),
            new_body: (routed.upstream.body != parsed.raw).then(|| routed.upstream.body.clone()),
            decision: vec![
                ("endpoint", d.endpoint.host_port()),
                ("rank", d.endpoint.rank.to_string()),
                ("model_config", d.model_config.to_string()),
                ("policy", d.policy.to_owned()),
                ("reason", format!("{:?}", d.reason).to_lowercase()),
                (
                    "score",
                    d.score.map_or_else(String::new, |s| format!("{s:.3}")),
                ),
                ("candidates", (1 + d.fallbacks.len()).to_string()),
                ("prompt_tokens", routed.plan.prompt_tokens.to_string()),
                ("cached_tokens", d.cached_tokens.to_string()),
                ("failed_open", d.failed_open.to_string()),
                ("disaggregation", routed.verdict.kind().to_owned()),
                (
                    "prefill_endpoint",
                    prefill.map_or_else(String::new, |p| p.host_port()),
                ),
            ],
        })
    }
}

fn rejection(e: ApiError) -> PickRejection {
    match e.status {
        StatusCode::NOT_FOUND => PickRejection::UnknownModel(e.message),
        StatusCode::TOO_MANY_REQUESTS if e.code != "overloaded" => {
            PickRejection::ShedBecause(e.code, e.message)
        }
        StatusCode::TOO_MANY_REQUESTS => PickRejection::Shed(e.message),
        StatusCode::SERVICE_UNAVAILABLE => PickRejection::NoEndpoint(e.message),
        _ => PickRejection::BadRequest(e.message),
    }
}

impl EndpointPicker for GatewayPicker {
    /// Every path passes the same model and tenant checks as the proxy's: completions and chat
    /// are routed by prefix; any other body is read for its `model` and routed by load among
    /// that model's endpoints the tenant may use (a body that is not a JSON object naming a
    /// model is a 400); a bodyless request (`GET /v1/models`) names no model and goes to the
    /// least-loaded endpoint the tenant may use.
    async fn pick(&self, input: PickInput) -> Result<PickOutput, PickRejection> {
        let kind = ApiKind::from_path(&input.path);
        let span = telemetry::request_span(
            super::http::header_pairs(&input.headers),
            kind.name(),
            input.path.split('?').next().unwrap_or_default(),
        );
        self.pick_traced(input).instrument(span).await
    }

    fn on_response_served(&self, request_id: u64, endpoint: SocketAddr) {
        // response headers are back: the engine has produced its first output
        let mut pending = self.pending.lock();
        let Some(p) = pending.get_mut(&request_id) else {
            return;
        };
        p.guard.first_token();
        let at = |id: &EndpointId| SocketAddr::new(id.address, id.port) == endpoint;
        p.served = p.targets.iter().copied().find(at);
        if let (Some(w), Some(served)) = (p.watch.as_mut(), p.served) {
            w.endpoint = served;
        }
        // the gateway moves on to a fallback only when the chosen endpoint failed
        if !at(&p.targets[0]) {
            p.primary_failed = true;
            self.picker.metrics.gateway_fallbacks.inc();
        }
    }

    fn on_response_status(&self, request_id: u64, status: u16) {
        let (endpoint, primary, stream, session, tokens, ticket) = {
            let mut pending = self.pending.lock();
            let Some(p) = pending.get_mut(&request_id) else {
                return;
            };
            p.status = Some(status);
            if !(200..300).contains(&status) {
                p.watch = None;
            }
            let primary = std::mem::take(&mut p.primary_failed).then_some(p.targets[0]);
            (
                p.served.unwrap_or(p.targets[0]),
                primary,
                p.stream,
                p.session_key,
                p.prompt_tokens,
                p.admission_ticket,
            )
        };
        if (200..300).contains(&status) {
            self.picker.settle(session, tokens, endpoint, ticket);
        }
        let outcome = Outcome::from_status(status);
        if primary.is_some() && outcome != Outcome::Success {
            // failed on the chosen endpoint and on the fallback: the request's own failure
            self.picker.metrics.error("failed_on_every_target");
            return;
        }
        if let Some(primary) = primary {
            self.picker.record_outcome(primary, Outcome::GatewayError);
        }
        // a non-streamed response's head waits for its whole generation: its timeout (504
        // from the gateway) says as much about the request as about the engine
        if status == 504 && !stream {
            return;
        }
        self.picker.record_outcome(endpoint, outcome);
    }

    fn on_first_response_body(&self, request_id: u64) {
        // the first body chunk of a streamed response is its first token (its headers come
        // before the engine has produced anything)
        let observed = {
            let mut pending = self.pending.lock();
            let Some(p) = pending.get_mut(&request_id) else {
                return;
            };
            let primary = p.targets[0];
            let ok = p.status.is_none_or(|s| (200..300).contains(&s));
            match p.basis.take() {
                Some(basis) if ok && p.served.is_none_or(|s| s == primary) => {
                    Some((primary, basis, p.picked.elapsed()))
                }
                _ => None,
            }
        };
        if let Some((endpoint, basis, ttft)) = observed {
            self.picker.observe_ttft(endpoint, basis, ttft);
        }
    }

    fn on_response_chunk(&self, request_id: u64, chunk: &[u8]) -> bool {
        let mut pending = self.pending.lock();
        let Some(w) = pending.get_mut(&request_id).and_then(|p| p.watch.as_mut()) else {
            return false;
        };
        let more = self.picker.response_chunk(w, chunk);
        if !more && let Some(p) = pending.get_mut(&request_id) {
            p.watch = None;
        }
        more
    }

    fn rewrites_response(&self, request_id: u64) -> bool {
        self.pending
            .lock()
            .get(&request_id)
            .is_some_and(|p| p.rewrite.is_some())
    }

    fn rewrite_response_chunk(&self, request_id: u64, chunk: Vec<u8>, end: bool) -> Vec<u8> {
        let mut pending = self.pending.lock();
        let Some(rw) = pending
            .get_mut(&request_id)
            .and_then(|p| p.rewrite.as_mut())
        else {
            return chunk;
        };
        let mut out = rw.chunk(&chunk).to_vec();
        if end {
            out.extend_from_slice(&rw.finish());
        }
        out
    }

    fn on_body_timeout(&self) {
        self.picker.metrics.error("body_timeout");
    }

    fn on_stream_refused(&self, why: &'static str) {
        self.picker.metrics.error(why);
    }

    fn on_response_complete(&self, request_id: u64) {
        let pending = self.pending.lock().remove(&request_id);
        // fell back, and no status came to settle whose failure it was: the chosen endpoint's
        if let Some(p) = pending.filter(|p| p.primary_failed) {
            self.picker
                .record_outcome(p.targets[0], Outcome::GatewayError);
        }
    }
}
