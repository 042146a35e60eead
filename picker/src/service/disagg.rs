//! Prefill/decode disaggregation in the proxy: vLLM's two-step flow with a KV connector
//! (NIXL-style `kv_transfer_params`).
//!
//! 1. The prefill step: the request, with `kv_transfer_params: {do_remote_decode: true}`,
//!    one output token and no stream, goes to the prefill endpoint the picker chose; its
//!    answer's `kv_transfer_params` say where the prompt's KV is (engine id, block ids, host,
//!    port, and whatever else the connector puts there: they are passed on untouched).
//! 2. The decode step: the client's request with those `kv_transfer_params` goes to the decode
//!    endpoint, which pulls the KV instead of prefilling; its answer (streamed or not) is the
//!    client's.
//!
//! Failures: a prefill endpoint that does not answer, answers a 5xx, times out or answers
//! without `kv_transfer_params` is charged to passive health and the prefill is tried once
//! more on the next prefill endpoint; when that fails too the request runs whole on its
//! decode endpoint (it prefills itself). A 4xx is the request's own fault: it goes to the
//! client as it came. The decode step is the proxy's ordinary forward, with its retry on the
//! next fallback before the first byte. A client that goes away drops whichever step is in
//! flight, and with it the connection to the engine, which aborts the request.

use std::time::Duration;

use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::{Map, Value, json};

use super::errors::ApiError;
use super::metrics::KindLabels;
use super::request::ParsedRequest;
use super::state::{PickerState, Routed};
use crate::endpoint::EndpointId;
use crate::outlier::Outcome;

/// The header carrying the request id both steps share (the engines log and correlate by it).
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// Largest prefill answer read (one token's completion; more is not a prefill answer).
const MAX_PREFILL_ANSWER: usize = 4 << 20;

/// What the prefill step came to.
pub enum Prefilled {
    /// The decode step's `kv_transfer_params`.
    Params(Value),
    /// Every prefill attempt failed: the request runs whole on its decode endpoint.
    Failed,
    /// The prefill endpoint refused the request itself (a 4xx): the client's answer.
    Refused(Response),
}

/// `body` (an engine body: a JSON object) as the prefill step sends it: `do_remote_decode`,
/// one output token, not streamed, no minimum of output tokens.
///
/// # Errors
/// A body that is not a JSON object.
pub fn prefill_body(body: &[u8]) -> Result<Bytes, ApiError> {
    let mut o = object(body)?;
    o.insert(
        "kv_transfer_params".into(),
        json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        }),
    );
    o.insert("stream".into(), Value::Bool(false));
    o.remove("stream_options");
    o.remove("min_tokens");
    o.insert("max_tokens".into(), json!(1));
    if o.contains_key("max_completion_tokens") {
        o.insert("max_completion_tokens".into(), json!(1));
    }
    serialize(&o)
}

/// `body` as the decode step sends it: the client's request with the prefill's
/// `kv_transfer_params`.
///
/// # Errors
/// A body that is not a JSON object.
pub fn decode_body(body: &[u8], params: &Value) -> Result<Bytes, ApiError> {
    let mut o = object(body)?;
    o.insert("kv_transfer_params".into(), params.clone());
    serialize(&o)
}

fn object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice(body) {
        Ok(Value::Object(o)) => Ok(o),
        _ => Err(ApiError::bad_request(
            "invalid_request",
            "a split request's body must be a JSON object",
        )),
    }
}

fn serialize(o: &Map<String, Value>) -> Result<Bytes, ApiError> {
    serde_json::to_vec(o)
        .map(Bytes::from)
        .map_err(|e| ApiError::bad_gateway(format!("cannot encode the request: {e}")))
}

/// The `kv_transfer_params` object of a prefill answer.
pub fn answer_params(answer: &[u8]) -> Option<Value> {
    let v: Value = serde_json::from_slice(answer).ok()?;
    v.get("kv_transfer_params")
        .filter(|p| p.is_object())
        .cloned()
}

impl PickerState {
    /// Run the prefill step of `routed` (split: [`Routed::prefill`] is set) on its prefill
    /// endpoint, then once more on the next one if that fails. `headers` are the client's
    /// headers the engine may see, already filtered, with the shared request id.
    pub async fn prefill_step(
        &self,
        routed: &Routed,
        req: &ParsedRequest,
        path: &str,
        headers: &[(axum::http::HeaderName, axum::http::HeaderValue)],
    ) -> Result<Prefilled, ApiError> {
        let Some(prefill) = &routed.prefill else {
            return Ok(Prefilled::Failed);
        };
        let targets: Vec<EndpointId> = std::iter::once(prefill.decision.endpoint)
            .chain(prefill.decision.fallbacks.iter().copied())
            .take(2)
            .collect();
        for (attempt, &ep) in targets.iter().enumerate() {
            let upstream = routed.upstream_for(req, ep)?;
            let body = prefill_body(&upstream.body)?;
            let _guard = self.begin(routed, ep);
            let mut r = self
                .http
                .post(format!("http://{}{path}", ep.host_port()))
                .body(body);
            for (name, value) in headers {
                r = r.header(name, value);
            }
            for (name, value) in upstream.headers {
                r = r.header(name, value);
            }
            let outcome = self.prefill_once(r, ep).await;
            let why = match outcome {
                Ok(Attempt::Params(p)) => {
                    self.record_outcome(ep, Outcome::Success);
                    return Ok(Prefilled::Params(p));
                }
                Ok(Attempt::Refused(resp)) => {
                    self.record_outcome(ep, Outcome::Success);
                    return Ok(Prefilled::Refused(resp));
                }
                Ok(Attempt::NoParams) => {
                    // it answered, but not as a KV producer: a configuration problem there
                    self.record_outcome(ep, Outcome::ServerError);
                    "answered without kv_transfer_params (is its KV connector on?)".to_owned()
                }
                Err((outcome, why)) => {
                    self.record_outcome(ep, outcome);
                    why
                }
            };
            let next = if attempt + 1 < targets.len() {
                "retried"
            } else {
                "aggregated"
            };
            self.metrics
                .prefill_failures
                .get_or_create(&KindLabels {
                    kind: next.to_owned(),
                })
                .inc();
            tracing::warn!(endpoint = %ep, next, "prefill step failed: {why}");
        }
        Ok(Prefilled::Failed)
    }

    /// One prefill attempt on `ep`.
    async fn prefill_once(
        &self,
        r: reqwest::RequestBuilder,
        ep: EndpointId,
    ) -> Result<Attempt, (Outcome, String)> {
        let timeout: Duration = self.limits.upstream_timeout;
        let resp = match tokio::time::timeout(timeout, r.send()).await {
            Err(_) => {
                return Err((
                    Outcome::GatewayError,
                    format!("no answer within {timeout:?}"),
                ));
            }
            Ok(Err(e)) => return Err((Outcome::GatewayError, format!("{e}"))),
            Ok(Ok(resp)) => resp,
        };
        let status = resp.status();
        if status.is_server_error() || status.as_u16() == 429 {
            return Err((
                Outcome::from_status(status.as_u16()),
                format!("answered {status}"),
            ));
        }
        let body = read_bounded(resp, MAX_PREFILL_ANSWER, timeout, "the prefill answer")
            .await
            .map_err(|e| (Outcome::GatewayError, format!("{ep}: {e}")))?;
        if !status.is_success() {
            let mut out = (
                axum::http::StatusCode::from_u16(status.as_u16())
                    .unwrap_or(axum::http::StatusCode::BAD_GATEWAY),
                body,
            )
                .into_response();
            out.headers_mut().insert(
                axum::http::header::CONTENT_TYPE,
                axum::http::HeaderValue::from_static("application/json"),
            );
            return Ok(Attempt::Refused(out));
        }
        Ok(answer_params(&body).map_or(Attempt::NoParams, Attempt::Params))
    }
}

enum Attempt {
    Params(Value),
    NoParams,
    Refused(Response),
}

/// An engine's response body of at most `limit` bytes, read within `timeout`; the error names
/// `what` was read.
pub(super) async fn read_bounded(
    resp: reqwest::Response,
    limit: usize,
    timeout: Duration,
    what: &str,
) -> Result<Bytes, String> {
    use futures::StreamExt as _;
    let read = async {
        let mut out = Vec::new();
        let mut stream = resp.bytes_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| e.to_string())?;
            if out.len() + chunk.len() > limit {
                return Err(format!("{what} exceeds {limit} bytes"));
            }
            out.extend_from_slice(&chunk);
        }
        Ok(Bytes::from(out))
    };
    tokio::time::timeout(timeout, read)
        .await
        .unwrap_or_else(|_| Err(format!("{what} took over {timeout:?}")))
}

/// The request id both steps carry: the client's, else a new one.
pub fn request_id(headers: &HeaderMap) -> String {
    headers
        .get(REQUEST_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 256)
        .map_or_else(
            || format!("kvroute-{:032x}", rand::random::<u128>()),
            str::to_owned,
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_body_asks_for_one_token_unstreamed_with_remote_decode() {
        let body = br#"{"model":"m","messages":[],"stream":true,"stream_options":{"include_usage":true},"max_completion_tokens":300,"max_tokens":300,"min_tokens":5}"#;
        let v: Value = serde_json::from_slice(&prefill_body(body).expect("object")).expect("json");
        assert_eq!(v["stream"], json!(false));
        assert_eq!(v["max_tokens"], json!(1));
        assert_eq!(v["max_completion_tokens"], json!(1));
        assert!(v.get("stream_options").is_none());
        assert!(v.get("min_tokens").is_none());
        assert_eq!(v["kv_transfer_params"]["do_remote_decode"], json!(true));
        assert_eq!(v["kv_transfer_params"]["do_remote_prefill"], json!(false));
        assert_eq!(v["model"], json!("m"));
    }

    #[test]
    fn the_decode_body_is_the_request_with_the_prefills_parameters() {
        let body = br#"{"model":"m","prompt":"hi","stream":true,"max_tokens":300}"#;
        let params = json!({"do_remote_prefill": true, "remote_engine_id": "e", "remote_block_ids": [1, 2], "extra": {"x": 1}});
        let v: Value =
            serde_json::from_slice(&decode_body(body, &params).expect("object")).expect("json");
        assert_eq!(v["kv_transfer_params"], params);
        assert_eq!(v["stream"], json!(true));
        assert_eq!(v["max_tokens"], json!(300));
        assert!(decode_body(b"[1]", &params).is_err());
    }

    #[test]
    fn only_an_object_is_taken_as_the_answers_parameters() {
        assert_eq!(
            answer_params(br#"{"choices":[],"kv_transfer_params":{"remote_engine_id":"e"}}"#),
            Some(json!({"remote_engine_id": "e"}))
        );
        assert_eq!(answer_params(br#"{"kv_transfer_params":null}"#), None);
        assert_eq!(answer_params(br#"{"choices":[]}"#), None);
        assert_eq!(answer_params(b"not json"), None);
    }
}
