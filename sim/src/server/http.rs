//! The OpenAI-compatible HTTP surface of one engine, shaped like vLLM's: completions and chat
//! completions (JSON or server-sent events), the render endpoints, models, health, metrics,
//! and `/admin/fault`.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value as Json, json};
use tokio::sync::mpsc;

use super::fault::{Fault, FaultSpec};
use super::kv_transfer::{self, KvTransfer};
use super::metrics::{Exposition, RankMetrics};
use super::rank::{Delta, RankState, Rejected};
use super::{EngineSlot, KvLoadFailure, Runtime, apply_fault, schedule_fault};
use crate::engine::{self, FinishedRequest, RequestId};
use kvroute_routing::tokenize::PromptInput;

#[derive(Clone)]
pub(crate) struct AppState {
    rt: Arc<Runtime>,
    slot: Arc<EngineSlot>,
    /// In rank-port mode, the one rank this listener serves.
    fixed_rank: Option<u32>,
}

pub(crate) fn router(rt: Arc<Runtime>, slot: Arc<EngineSlot>, fixed_rank: Option<u32>) -> Router {
    let limit = rt.cfg.max_body_bytes;
    let state = AppState {
        rt,
        slot,
        fixed_rank,
    };
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions/render", post(render_completions))
        .route("/v1/chat/completions/render", post(render_chat))
        .route("/v1/models", get(models))
        .route("/kv_event_sources", get(kv_event_sources))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/admin/fault", post(admin_fault))
        .layer(middleware::from_fn_with_state(state.clone(), hang_guard))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

// ---- errors ---------------------------------------------------------------------------------

/// An OpenAI-style error: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug)]
pub(crate) struct ApiError {
    status: StatusCode,
    message: String,
    /// Set for a body that fails vLLM's request schema (pydantic validation): vLLM answers
    /// those with type `"Bad Request"` and the failing field's location as `param`
    /// (`body.messages`, `body.prompt.1`), and everything else with `"BadRequestError"`.
    schema_param: Option<String>,
}

impl ApiError {
    fn bad(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// A body that does not match the request schema, at `param` (as vLLM's validation
    /// handler reports it).
    fn schema(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            schema_param: Some(param.into()),
            ..Self::bad(message)
        }
    }

    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            schema_param: None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = match self.status {
            StatusCode::BAD_REQUEST if self.schema_param.is_some() => "Bad Request",
            StatusCode::BAD_REQUEST => "BadRequestError",
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::TOO_MANY_REQUESTS => "RateLimitError",
            StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
            _ => "InternalServerError",
        };
        let body = json!({"error": {
            "message": self.message,
            "type": kind,
            "param": self.schema_param,
            "code": self.status.as_u16(),
        }});
        (self.status, axum::Json(body)).into_response()
    }
}

// ---- middleware -----------------------------------------------------------------------------

/// The `hang` fault: requests are accepted and then never answered (until `clear`), except the
/// admin endpoint that clears it.
async fn hang_guard(State(s): State<AppState>, req: Request, next: Next) -> Response {
    if !req.uri().path().starts_with("/admin/") {
        let mut rx = s.rt.hang.subscribe();
        if *rx.borrow_and_update() {
            let _ = rx.wait_for(|h| !*h).await;
        }
    }
    next.run(req).await
}

// ---- request parsing ------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

/// A parsed generation request.
struct GenRequest {
    external_id: String,
    model: String,
    lora: Option<String>,
    prompt: Vec<u32>,
    max_tokens: u32,
    stream: bool,
    include_usage: bool,
    cache_salt: Option<String>,
    body_rank: Option<u32>,
    /// What its `kv_transfer_params` ask (with a KV connector).
    kv: KvTransfer,
    /// The `kv_transfer_params` its answer carries (a prefill step's).
    kv_answer: Option<Json>,
}

fn parse_body(body: &Bytes) -> Result<serde_json::Map<String, Json>, ApiError> {
    match serde_json::from_slice::<Json>(body) {
        Ok(Json::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::schema(
            "body",
            "the request body must be a JSON object",
        )),
        Err(e) => Err(ApiError::schema("body", format!("invalid JSON body: {e}"))),
    }
}

/// The served model and LoRA adapter a request names (the base model when absent).
fn resolve_model(
    rt: &Runtime,
    body: &serde_json::Map<String, Json>,
) -> Result<(String, Option<String>), ApiError> {
    match body.get("model") {
        None | Some(Json::Null) => Ok((rt.cfg.model.clone(), None)),
        Some(Json::String(m)) if *m == rt.cfg.model => Ok((m.clone(), None)),
        Some(Json::String(m)) if rt.cfg.lora_modules.contains(m) => {
            Ok((m.clone(), Some(m.clone())))
        }
        Some(Json::String(m)) => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("The model `{m}` does not exist."),
        )),
        Some(_) => Err(ApiError::schema("body.model", "`model` must be a string")),
    }
}

fn token_array(items: &[Json]) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| {
                    ApiError::schema(
                        format!("body.prompt.{i}"),
                        "token ids must be integers within 0..=4294967295",
                    )
                })
        })
        .collect()
}

/// Token-id input, validated by the tokenizer (vocabulary, length).
fn token_ids(rt: &Runtime, items: &[Json]) -> Result<Vec<u32>, ApiError> {
    let ids = token_array(items)?;
    rt.tokenizer
        .tokenize(PromptInput::TokenIds(&ids))
        .map(|t| t.ids)
        .map_err(|e| ApiError::bad(e.to_string()))
}

/// Every prompt of a completions request: a string, a list of strings, a list of token ids,
/// or a list of token-id lists.
fn parse_prompts(rt: &Runtime, prompt: Option<&Json>) -> Result<Vec<Vec<u32>>, ApiError> {
    let text = |s: &str| {
        rt.tokenizer
            .tokenize(PromptInput::Text(s))
            .map(|t| t.ids)
            .map_err(|e| ApiError::bad(e.to_string()))
    };
    match prompt {
        None | Some(Json::Null) => Err(ApiError::bad("`prompt` is required")),
        Some(Json::String(s)) => Ok(vec![text(s)?]),
        Some(Json::Array(items)) if items.is_empty() => {
            Err(ApiError::bad("`prompt` must not be empty"))
        }
        Some(Json::Array(items)) => match &items[0] {
            Json::String(_) => items
                .iter()
                .map(|v| match v {
                    Json::String(s) => text(s),
                    _ => Err(ApiError::bad("`prompt` mixes strings and other values")),
                })
                .collect(),
            Json::Number(_) => Ok(vec![token_ids(rt, items)?]),
            Json::Array(_) => items
                .iter()
                .map(|v| match v {
                    Json::Array(ids) => token_ids(rt, ids),
                    _ => Err(ApiError::bad("`prompt` mixes token lists and other values")),
                })
                .collect(),
            _ => Err(ApiError::bad(
                "`prompt` must be a string, a list of strings or token ids",
            )),
        },
        Some(_) => Err(ApiError::bad(
            "`prompt` must be a string, a list of strings or token ids",
        )),
    }
}

fn chat_prompt(rt: &Runtime, body: &serde_json::Map<String, Json>) -> Result<Vec<u32>, ApiError> {
    let messages = body
        .get("messages")
        .ok_or_else(|| ApiError::bad("`messages` is required"))?;
    if !messages.is_array() {
        return Err(ApiError::schema(
            "body.messages",
            "`messages` must be a list",
        ));
    }
    let add_generation_prompt = match body.get("add_generation_prompt") {
        None | Some(Json::Null) => true,
        Some(Json::Bool(b)) => *b,
        Some(_) => return Err(ApiError::bad("`add_generation_prompt` must be a boolean")),
    };
    rt.tokenizer
        .tokenize(PromptInput::Chat {
            messages,
            tools: body.get("tools"),
            add_generation_prompt,
            extra: body.get("chat_template_kwargs").filter(|v| !v.is_null()),
            add_special_tokens: false,
        })
        .map(|t| t.ids)
        .map_err(|e| ApiError::bad(e.to_string()))
}

fn opt_u32(body: &serde_json::Map<String, Json>, key: &str) -> Result<Option<u32>, ApiError> {
    match body.get(key) {
        None | Some(Json::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| ApiError::bad(format!("`{key}` must be a non-negative integer"))),
    }
}

fn opt_bool(body: &serde_json::Map<String, Json>, key: &str) -> Result<bool, ApiError> {
    match body.get(key) {
        None | Some(Json::Null) => Ok(false),
        Some(Json::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::bad(format!("`{key}` must be a boolean"))),
    }
}

fn request_id(rt: &Runtime, headers: &HeaderMap, kind: Kind) -> String {
    if let Some(v) = headers.get("x-request-id").and_then(|v| v.to_str().ok())
        && !v.is_empty()
        && v.len() <= 256
    {
        return v.to_owned();
    }
    let n = rt.next_id.load(Ordering::Relaxed);
    let prefix = match kind {
        Kind::Completion => "cmpl",
        Kind::Chat => "chatcmpl",
    };
    format!("{prefix}-e{}-{n:08x}", rt.index)
}

fn parse_gen(
    rt: &Runtime,
    headers: &HeaderMap,
    body: &Bytes,
    kind: Kind,
) -> Result<GenRequest, ApiError> {
    let body = parse_body(body)?;
    let (model, lora) = resolve_model(rt, &body)?;
    let prompt = match kind {
        Kind::Completion => parse_prompts(rt, body.get("prompt"))?.swap_remove(0),
        Kind::Chat => chat_prompt(rt, &body)?,
    };
    if prompt.is_empty() {
        return Err(ApiError::bad("the prompt is empty"));
    }
    let max_tokens = match kind {
        Kind::Chat => opt_u32(&body, "max_completion_tokens")?.or(opt_u32(&body, "max_tokens")?),
        Kind::Completion => opt_u32(&body, "max_tokens")?,
    }
    .unwrap_or(rt.cfg.default_max_tokens);
    if max_tokens == 0 {
        return Err(ApiError::bad("`max_tokens` must be at least 1"));
    }
    // Like vLLM 0.32: a prompt that leaves no room in the context is rejected; otherwise
    // `max_tokens` is shortened to what the context leaves (the request ends with "length").
    let max_len = rt.cfg.engine.effective_max_model_len();
    let prompt_len = prompt.len() as u64;
    if prompt_len >= max_len {
        return Err(ApiError::bad(format!(
            "This model's maximum context length is {max_len} tokens. However, your request \
             has {prompt_len} input tokens."
        )));
    }
    let max_tokens = max_tokens.min(u32::try_from(max_len - prompt_len).unwrap_or(u32::MAX));
    if let Some(n) = opt_u32(&body, "n")?
        && n != 1
    {
        return Err(ApiError::bad("only n = 1 is supported"));
    }
    let stream = opt_bool(&body, "stream")?;
    let include_usage = match body.get("stream_options") {
        None | Some(Json::Null) => false,
        Some(Json::Object(o)) => matches!(o.get("include_usage"), Some(Json::Bool(true))),
        Some(_) => return Err(ApiError::bad("`stream_options` must be an object")),
    };
    let cache_salt = match body.get("cache_salt") {
        None | Some(Json::Null) => None,
        Some(Json::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(_) => return Err(ApiError::bad("`cache_salt` must be a non-empty string")),
    };
    Ok(GenRequest {
        external_id: request_id(rt, headers, kind),
        model,
        lora,
        prompt,
        max_tokens,
        stream,
        include_usage,
        cache_salt,
        body_rank: opt_u32(&body, "data_parallel_rank")?,
        kv: if rt.cfg.kv_transfer.is_some() {
            kv_transfer::parse(body.get("kv_transfer_params")).map_err(ApiError::bad)?
        } else {
            KvTransfer::None
        },
        kv_answer: None,
    })
}

// ---- rank selection -------------------------------------------------------------------------

impl AppState {
    /// The rank for a request: this listener's in rank-port mode, else the
    /// `X-data-parallel-rank` header, else SGLang's body field, else vLLM's least
    /// `4 * waiting + running` (lowest index on ties).
    fn pick_rank(
        &self,
        headers: &HeaderMap,
        body_rank: Option<u32>,
    ) -> Result<Arc<RankState>, ApiError> {
        let ranks = &self.rt.ranks;
        let chosen = if let Some(k) = self.fixed_rank {
            Some(k)
        } else if let Some(v) = headers.get("x-data-parallel-rank") {
            let k = v
                .to_str()
                .ok()
                .and_then(|s| s.trim().parse::<u32>().ok())
                .ok_or_else(|| {
                    ApiError::bad("X-data-parallel-rank must be a non-negative integer")
                })?;
            Some(k)
        } else {
            body_rank
        };
        match chosen {
            Some(k) => ranks.get(k as usize).cloned().ok_or_else(|| {
                ApiError::bad(format!(
                    "data parallel rank {k} does not exist (dp size {})",
                    ranks.len()
                ))
            }),
            None => ranks
                .iter()
                .min_by_key(|r| r.load_score())
                .cloned()
                .ok_or_else(|| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no ranks")),
        }
    }
}

// ---- generation -----------------------------------------------------------------------------

/// Aborts the request in the engine when the response is dropped before it finished (the
/// client went away), freeing its KV blocks as vLLM does.
struct AbortGuard {
    rank: Arc<RankState>,
    id: RequestId,
    done: bool,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if !self.done {
            self.rank.abort(self.id);
        }
    }
}

fn unix_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn usage(f: &FinishedRequest) -> Json {
    json!({
        "prompt_tokens": f.prompt_tokens,
        "total_tokens": f.prompt_tokens + f.output_tokens,
        "completion_tokens": f.output_tokens,
        "prompt_tokens_details": {"cached_tokens": f.cached_tokens},
    })
}

fn token_text(t: u32) -> String {
    char::from_u32(t).map_or_else(String::new, String::from)
}

async fn completions(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    generate(s, headers, body, Kind::Completion).await
}

async fn chat_completions(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    generate(s, headers, body, Kind::Chat).await
}

async fn generate(s: AppState, headers: HeaderMap, body: Bytes, kind: Kind) -> Response {
    let req = match parse_gen(&s.rt, &headers, &body, kind) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let rank = match s.pick_rank(&headers, req.body_rank) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let mut req = req;
    let block_size = s.rt.cfg.engine.block_size.max(1);
    let remote_blocks = match &req.kv {
        KvTransfer::None => 0,
        KvTransfer::RemoteDecode => {
            let http = s
                .slot
                .http_addr()
                .unwrap_or_else(|| std::net::SocketAddr::new(s.rt.cfg.host, s.rt.cfg.port));
            req.kv_answer = Some(kv_transfer::answer(
                &rank,
                &req.external_id,
                (&http.ip().to_string(), http.port()),
                req.prompt.len() as u32,
                block_size,
            ));
            0
        }
        KvTransfer::RemotePrefill { engine_id, blocks } => match kv_transfer::peer(engine_id) {
            Some(peer) => {
                let held =
                    peer.cached_prefix(&req.prompt, req.cache_salt.as_deref(), req.lora.as_deref())
                        / block_size;
                // the prefix cache never shows a prompt's partial last block, but the
                // remote engine keeps the request's blocks for the pull, that one included
                let prompt = req.prompt.len() as u32;
                let held = if held >= prompt.saturating_sub(1) / block_size {
                    prompt.div_ceil(block_size)
                } else {
                    held
                };
                held.min(*blocks)
            }
            None if s.rt.cfg.kv_transfer == Some(KvLoadFailure::Fail) => {
                return ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("KV transfer failed: remote engine {engine_id} is not reachable"),
                )
                .into_response();
            }
            None => {
                tracing::warn!(%engine_id, "remote engine not reachable: recomputing the prompt");
                0
            }
        },
    };
    let id = s.rt.next_id.fetch_add(1, Ordering::Relaxed);
    let arrival = s.rt.clock.now_ms();
    let submitted = rank.submit(
        engine::Request {
            id,
            token_ids: req.prompt.clone(),
            max_tokens: req.max_tokens,
            cache_salt: req.cache_salt.clone(),
            lora: req.lora.clone(),
            remote_blocks,
        },
        arrival,
    );
    let rx = match submitted {
        Ok(rx) => rx,
        Err(Rejected::QueueFull(n)) => {
            return ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!("the engine already has {n} waiting requests"),
            )
            .into_response();
        }
        Err(Rejected::Invalid(e)) => return ApiError::bad(e.to_string()).into_response(),
    };
    tracing::debug!(
        id,
        rank = rank.rank,
        prompt = req.prompt.len(),
        "request queued"
    );
    let guard = AbortGuard {
        rank,
        id,
        done: false,
    };
    if req.stream {
        stream_response(req, kind, rx, guard)
    } else {
        collect_response(req, kind, rx, guard).await
    }
}

async fn collect_response(
    req: GenRequest,
    kind: Kind,
    mut rx: mpsc::UnboundedReceiver<Delta>,
    mut guard: AbortGuard,
) -> Response {
    let mut text = String::new();
    loop {
        match rx.recv().await {
            Some(Delta::Token(t)) => text.push_str(&token_text(t)),
            Some(Delta::Last(t, f)) => {
                guard.done = true;
                text.push_str(&token_text(t));
                let created = unix_secs();
                let body = match kind {
                    Kind::Completion => json!({
                        "id": req.external_id,
                        "object": "text_completion",
                        "created": created,
                        "model": req.model,
                        "choices": [{
                            "index": 0,
                            "text": text,
                            "logprobs": null,
                            "finish_reason": "length",
                            "stop_reason": null,
                            "prompt_logprobs": null,
                        }],
                        "usage": usage(&f),
                    }),
                    Kind::Chat => json!({
                        "id": req.external_id,
                        "object": "chat.completion",
                        "created": created,
                        "model": req.model,
                        "choices": [{
                            "index": 0,
                            "message": {"role": "assistant", "content": text, "tool_calls": []},
                            "logprobs": null,
                            "finish_reason": "length",
                            "stop_reason": null,
                        }],
                        "usage": usage(&f),
                    }),
                };
                let mut body = body;
                if let (Some(params), Some(o)) = (req.kv_answer.clone(), body.as_object_mut()) {
                    o.insert("kv_transfer_params".into(), params);
                }
                return axum::Json(body).into_response();
            }
            Some(Delta::Aborted(why)) => {
                guard.done = true;
                return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, why).into_response();
            }
            None => {
                guard.done = true;
                return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the engine stopped")
                    .into_response();
            }
        }
    }
}

/// Streaming state: the SSE body is produced lazily from the output channel.
struct Sse {
    req: GenRequest,
    kind: Kind,
    rx: mpsc::UnboundedReceiver<Delta>,
    guard: AbortGuard,
    created: u64,
    sent_role: bool,
    /// Final frames still to send (usage, `[DONE]`).
    tail: Vec<Bytes>,
    finished: bool,
}

fn sse(v: &Json) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

impl Sse {
    fn chunk(&self, choice: Json) -> Json {
        let object = match self.kind {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion.chunk",
        };
        json!({
            "id": self.req.external_id,
            "object": object,
            "created": self.created,
            "model": self.req.model,
            "choices": [choice],
        })
    }

    fn token_chunk(&mut self, t: u32, finish: bool) -> Bytes {
        let text = token_text(t);
        let reason = if finish { json!("length") } else { Json::Null };
        let choice = match self.kind {
            Kind::Completion => json!({
                "index": 0, "text": text, "logprobs": null,
                "finish_reason": reason, "stop_reason": null,
            }),
            Kind::Chat => json!({
                "index": 0, "delta": {"content": text}, "logprobs": null,
                "finish_reason": reason, "stop_reason": null,
            }),
        };
        let mut out = Vec::new();
        if self.kind == Kind::Chat && !self.sent_role {
            self.sent_role = true;
            let role = self.chunk(json!({
                "index": 0, "delta": {"role": "assistant", "content": ""},
                "logprobs": null, "finish_reason": null,
            }));
            out.extend_from_slice(&sse(&role));
        }
        out.extend_from_slice(&sse(&self.chunk(choice)));
        Bytes::from(out)
    }

    async fn next(&mut self) -> Option<Bytes> {
        if !self.tail.is_empty() {
            return Some(self.tail.remove(0));
        }
        if self.finished {
            return None;
        }
        match self.rx.recv().await {
            Some(Delta::Token(t)) => Some(self.token_chunk(t, false)),
            Some(Delta::Last(t, f)) => {
                self.guard.done = true;
                self.finished = true;
                let first = self.token_chunk(t, true);
                if self.req.include_usage {
                    let object = match self.kind {
                        Kind::Completion => "text_completion",
                        Kind::Chat => "chat.completion.chunk",
                    };
                    self.tail.push(sse(&json!({
                        "id": self.req.external_id,
                        "object": object,
                        "created": self.created,
                        "model": self.req.model,
                        "choices": [],
                        "usage": usage(&f),
                    })));
                }
                self.tail.push(Bytes::from_static(b"data: [DONE]\n\n"));
                Some(first)
            }
            Some(Delta::Aborted(why)) => {
                self.guard.done = true;
                self.finished = true;
                let err = json!({"error": {"message": why, "type": "ServiceUnavailableError", "param": null, "code": 503}});
                self.tail.push(Bytes::from_static(b"data: [DONE]\n\n"));
                Some(sse(&err))
            }
            None => {
                // The engine went away (crash): end the body abruptly.
                self.guard.done = true;
                self.finished = true;
                None
            }
        }
    }
}

fn stream_response(
    req: GenRequest,
    kind: Kind,
    rx: mpsc::UnboundedReceiver<Delta>,
    guard: AbortGuard,
) -> Response {
    let state = Sse {
        req,
        kind,
        rx,
        guard,
        created: unix_secs(),
        sent_role: false,
        tail: Vec::new(),
        finished: false,
    };
    let body = futures::stream::unfold(state, |mut st| async move {
        st.next().await.map(|b| (Ok::<_, Infallible>(b), st))
    });
    let mut resp = Response::new(Body::from_stream(body));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

// ---- render ---------------------------------------------------------------------------------

async fn render_completions(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let result = (|| {
        let map = parse_body(&body)?;
        resolve_model(&s.rt, &map)?;
        let prompts = parse_prompts(&s.rt, map.get("prompt"))?;
        let base = request_id(&s.rt, &headers, Kind::Completion);
        let single = prompts.len() == 1;
        Ok::<_, ApiError>(Json::Array(
            prompts
                .into_iter()
                .enumerate()
                .map(|(i, ids)| {
                    let rid = if single {
                        base.clone()
                    } else {
                        format!("{base}-{i}")
                    };
                    json!({"request_id": rid, "token_ids": ids})
                })
                .collect(),
        ))
    })();
    match result {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn render_chat(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let result = (|| {
        let map = parse_body(&body)?;
        resolve_model(&s.rt, &map)?;
        let ids = chat_prompt(&s.rt, &map)?;
        Ok::<_, ApiError>(json!({
            "request_id": request_id(&s.rt, &headers, Kind::Chat),
            "token_ids": ids,
        }))
    })();
    match result {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

// ---- the rest -------------------------------------------------------------------------------

async fn models(State(s): State<AppState>) -> Response {
    let cfg = &s.rt.cfg;
    let max_len = cfg.engine.effective_max_model_len();
    let created = unix_secs();
    let mut data = vec![json!({
        "id": cfg.model, "object": "model", "created": created, "owned_by": "vllm",
        "root": cfg.model, "parent": null, "max_model_len": max_len,
    })];
    for l in &cfg.lora_modules {
        data.push(json!({
            "id": l, "object": "model", "created": created, "owned_by": "vllm",
            "root": l, "parent": cfg.model, "max_model_len": max_len,
        }));
    }
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

/// vLLM 0.32's `GET /kv_event_sources`: each rank's resolved `KVEventsConfig`, keyed by
/// data-parallel rank (a bound address, never the `*` it was configured with when the port
/// was 0). Absent before 0.32, and in SGLang.
async fn kv_event_sources(State(s): State<AppState>) -> Response {
    let cfg = &s.rt.cfg;
    if !cfg.kv_event_sources || cfg.flavor != super::metrics::Flavor::Vllm {
        return StatusCode::NOT_FOUND.into_response();
    }
    let Some(addrs) = s.slot.addrs.lock().clone() else {
        return axum::Json(json!({})).into_response();
    };
    let mut out = serde_json::Map::new();
    for (rank, pub_addr) in addrs.kv_events.iter().enumerate() {
        if s.fixed_rank.is_some_and(|k| k as usize != rank) {
            continue;
        }
        out.insert(
            rank.to_string(),
            json!({
                "enable_kv_cache_events": true,
                "publisher": "zmq",
                "endpoint": format!("tcp://{pub_addr}"),
                "replay_endpoint": addrs.replay.get(rank).map(|a| format!("tcp://{a}")),
                "buffer_steps": cfg.replay_buffer,
                "hwm": 100_000,
                "max_queue_size": 100_000,
                "topic": cfg.kv_topic,
            }),
        );
    }
    axum::Json(Json::Object(out)).into_response()
}

async fn health() -> StatusCode {
    StatusCode::OK
}

async fn metrics(State(s): State<AppState>) -> Response {
    let ranks: Vec<RankMetrics> =
        s.rt.ranks
            .iter()
            .filter(|r| s.fixed_rank.is_none_or(|k| k == r.rank))
            .map(|r| {
                let g = r.inner.lock();
                RankMetrics {
                    rank: r.rank,
                    stats: g.engine.stats(),
                    lora: g.engine.lora_state(),
                    ttft: g.ttft.clone(),
                    e2e: g.e2e.clone(),
                }
            })
            .collect();
    let text = Exposition {
        flavor: s.rt.cfg.flavor,
        now_unix_s: kvroute_routing::kv_events::unix_now(),
        model: &s.rt.cfg.model,
        prefix_caching: s.rt.cfg.engine.enable_prefix_caching,
        dp_size: s.rt.cfg.dp_size,
        ranks: &ranks,
    }
    .render();
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        text,
    )
        .into_response()
}

/// `POST /admin/fault` with a [`FaultSpec`]; applies to this engine (its `engine` field is
/// ignored). A crash is delayed a little so that this response still goes out.
async fn admin_fault(State(s): State<AppState>, body: Bytes) -> Response {
    let mut spec: FaultSpec = match serde_json::from_slice(&body) {
        Ok(f) => f,
        Err(e) => return ApiError::bad(format!("invalid fault: {e}")).into_response(),
    };
    if let Err(e) = spec.validate() {
        return ApiError::bad(e).into_response();
    }
    if matches!(spec.fault, Fault::Crash { .. }) && spec.after_ms.is_none() {
        spec.after_ms = Some(50);
    }
    if spec.rank.is_some_and(|k| k >= s.rt.cfg.dp_size) {
        return ApiError::bad("no such rank").into_response();
    }
    if spec.after_ms.is_none() {
        // Applied before answering, so the caller can rely on it once it has the response.
        apply_fault(&s.slot, &spec).await;
    } else {
        schedule_fault(s.slot.clone(), spec.clone());
    }
    axum::Json(json!({"ok": true, "fault": spec})).into_response()
}
