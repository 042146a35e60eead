//! One streaming completion request, timed like a user sees it: time to the first streamed
//! token, the gaps between tokens, and the end of the stream.

use std::time::{Duration, Instant};

use futures::StreamExt as _;
use serde::Serialize;

use crate::stats::RequestRecord;

/// Longest SSE event accepted (a usage chunk is a few hundred bytes).
const MAX_EVENT_BYTES: usize = 1 << 20;
/// Bytes of an error body kept in the error message.
const MAX_ERROR_BODY: usize = 300;

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

#[derive(Serialize)]
struct Body<'a> {
    model: &'a str,
    #[serde(flatten)]
    input: Input<'a>,
    max_tokens: u32,
    /// vLLM's knobs to generate exactly `max_tokens` (the simulator always does).
    min_tokens: u32,
    ignore_eos: bool,
    stream: bool,
    stream_options: StreamOptions,
}

/// What the runner needs to turn wall time into simulated time.
#[derive(Debug, Clone, Copy)]
pub struct SimClock {
    pub start: Instant,
    pub speedup: f64,
}

impl SimClock {
    pub fn ms(&self, t: Instant) -> f64 {
        t.saturating_duration_since(self.start).as_secs_f64() * 1000.0 * self.speedup
    }

    pub fn now_ms(&self) -> f64 {
        self.ms(Instant::now())
    }
}

/// What a request asks about: token ids (`/v1/completions`) or a conversation
/// (`/v1/chat/completions`, see [`super::chat`]).
#[derive(Clone, Copy, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Input<'a> {
    Prompt(&'a [u32]),
    Messages(&'a [super::chat::Message]),
}

/// A request to send.
pub struct Send<'a> {
    pub url: &'a str,
    pub model: &'a str,
    pub input: Input<'a>,
    /// Prompt tokens to record when the engine reports none (the token-id prompt's length).
    pub prompt_tokens: u32,
    pub max_tokens: u32,
    /// Headers to send: the session id, the request's band and tenant.
    pub headers: Vec<(&'a str, String)>,
    /// Simulated release time: latencies count from it, so client lag is not hidden.
    pub release_ms: f64,
    pub timeout: Duration,
}

pub fn failed(s: &Send<'_>, clock: &SimClock, error: String) -> RequestRecord {
    RequestRecord {
        release_ms: s.release_ms,
        prompt_tokens: s.prompt_tokens,
        ttft_ms: None,
        e2e_ms: None,
        tpot_ms: None,
        output_tokens: 0,
        cached_tokens: None,
        end_ms: clock.now_ms(),
        error: Some(error),
    }
}

/// Send one request and stream its response. With [`Input::Messages`], also returns the text
/// the engine streamed (the assistant's reply), when the request succeeded.
pub async fn send(
    client: &reqwest::Client,
    s: Send<'_>,
    clock: SimClock,
) -> (RequestRecord, Option<String>) {
    match tokio::time::timeout(s.timeout, send_inner(client, &s, clock)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => (failed(&s, &clock, e), None),
        Err(_) => (
            failed(
                &s,
                &clock,
                format!("no complete response within {:?}", s.timeout),
            ),
            None,
        ),
    }
}

async fn send_inner(
    client: &reqwest::Client,
    s: &Send<'_>,
    clock: SimClock,
) -> Result<(RequestRecord, Option<String>), String> {
    let chat = matches!(s.input, Input::Messages(_));
    let body = Body {
        model: s.model,
        input: s.input,
        max_tokens: s.max_tokens,
        min_tokens: s.max_tokens,
        ignore_eos: true,
        stream: true,
        stream_options: StreamOptions {
            include_usage: true,
        },
    };
    let body = serde_json::to_vec(&body).map_err(|e| format!("encoding the request: {e}"))?;
    let mut req = client
        .post(s.url)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(body);
    for (h, v) in &s.headers {
        req = req.header(*h, v.as_str());
    }
    let resp = req.send().await.map_err(|e| format!("sending: {e}"))?;
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        let cut: String = text.chars().take(MAX_ERROR_BODY).collect();
        return Err(format!("HTTP {}: {}", status.as_u16(), cut.trim()));
    }
    let mut stream = resp.bytes_stream();
    let mut buf: Vec<u8> = Vec::new();
    let mut first: Option<Instant> = None;
    let mut last: Option<Instant> = None;
    let mut tokens: u32 = 0;
    let mut usage_completion: Option<u32> = None;
    let mut usage_prompt: Option<u32> = None;
    let mut cached: Option<u32> = None;
    let mut reply = String::new();
    let mut done = false;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| format!("reading the stream: {e}"))?;
        let now = Instant::now();
        buf.extend_from_slice(&chunk);
        while let Some(pos) = find_event_end(&buf) {
            let event: Vec<u8> = buf.drain(..pos.0 + pos.1).collect();
            let event = &event[..pos.0];
            for line in event.split(|&b| b == b'\n') {
                let Some(data) = line.strip_prefix(b"data:") else {
                    continue;
                };
                let data = data.trim_ascii();
                if data == b"[DONE]" {
                    done = true;
                    continue;
                }
                let has = |needle: &[u8]| data.windows(needle.len()).any(|w| w == needle);
                if chat || has(b"\"error\"") || has(b"\"usage\"") {
                    let v: serde_json::Value = serde_json::from_slice(data)
                        .map_err(|e| format!("bad stream event: {e}"))?;
                    if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
                        let msg = err
                            .get("message")
                            .and_then(|m| m.as_str())
                            .unwrap_or("error");
                        return Err(format!("error in stream: {msg}"));
                    }
                    if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                        let count = |k: &str| {
                            u.get(k)
                                .and_then(serde_json::Value::as_u64)
                                .map(|x| x as u32)
                        };
                        usage_completion = count("completion_tokens");
                        usage_prompt = count("prompt_tokens");
                        cached = u
                            .get("prompt_tokens_details")
                            .and_then(|d| d.get("cached_tokens"))
                            .and_then(serde_json::Value::as_u64)
                            .map(|x| x as u32);
                    }
                    let has_text = v
                        .get("choices")
                        .and_then(|c| c.as_array())
                        .is_some_and(|c| !c.is_empty());
                    if !has_text {
                        continue;
                    }
                    if chat
                        && reply.len() < super::chat::MAX_REPLY_BYTES
                        && let Some(t) = v
                            .pointer("/choices/0/delta/content")
                            .and_then(serde_json::Value::as_str)
                    {
                        reply.push_str(t);
                    }
                }
                tokens += 1;
                first.get_or_insert(now);
                last = Some(now);
            }
        }
        if buf.len() > MAX_EVENT_BYTES {
            return Err(format!("a stream event exceeds {MAX_EVENT_BYTES} bytes"));
        }
    }
    if !done {
        return Err(format!(
            "the stream ended without [DONE] after {tokens} tokens"
        ));
    }
    let end = Instant::now();
    let Some(first) = first else {
        return Err("the stream carried no token".into());
    };
    let output = usage_completion.unwrap_or(tokens).max(tokens);
    let last = last.unwrap_or(first);
    let tpot = (tokens > 1).then(|| (clock.ms(last) - clock.ms(first)) / f64::from(tokens - 1));
    let record = RequestRecord {
        release_ms: s.release_ms,
        prompt_tokens: usage_prompt.unwrap_or(s.prompt_tokens),
        ttft_ms: Some((clock.ms(first) - s.release_ms).max(0.0)),
        e2e_ms: Some((clock.ms(end) - s.release_ms).max(0.0)),
        tpot_ms: tpot,
        output_tokens: output,
        cached_tokens: cached,
        end_ms: clock.ms(end),
        error: None,
    };
    Ok((record, chat.then_some(reply)))
}

/// End of the first SSE event in `buf`: `(event length, separator length)`.
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|p| (p, 2));
    let crlf = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|p| (p, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}
