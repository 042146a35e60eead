//! The contract kvroute-sim keeps with vLLM, written once against an [`Target`] (an engine under
//! test: its HTTP address, KV-event and replay sockets, block size, model and tokenizer) and run
//! by two entry points: `sim_contract.rs` (here) against the simulator, and
//! `e2e/tests/vllm_contract.rs` (which includes this file by path; it starts the engine with
//! kvroute-e2e's harness) against one real vLLM engine. Where the two legitimately differ the
//! property states what both must satisfy (the text an engine makes of its tokens, when events
//! arrive, how large the cache is); everything else is exact.
//!
//! On the real engine every property runs against the same process, one after the other, so
//! each uses its own prompts (its own token seeds) and reads counters as deltas.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use kvroute_routing::block_keys::{BlockHasher, ChainRoot};
use kvroute_routing::endpoint::{EndpointId, EngineKind};
use kvroute_routing::engine_metrics::{EngineMetrics, ParseLimits, parse_engine_metrics};
use kvroute_routing::index::{IndexMode, KvIndex, Slot};
use kvroute_routing::kv_events::ingest::{IngestKeys, apply_batch};
use kvroute_routing::kv_events::{
    DecodeLimits, EventBatch, KvEvent, decode_message, decode_replay_message, is_replay_end,
    seq_frame,
};
use kvroute_routing::tokenize::{PromptInput, PromptTokenizer, PromptTokenizerOptions};
use serde_json::{Value, json};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// An engine under test.
#[derive(Debug, Clone)]
pub struct Target {
    /// `"kvroute-sim"` or `"vLLM"`, for messages.
    pub name: &'static str,
    pub http: SocketAddr,
    pub kv_events: SocketAddr,
    pub replay: SocketAddr,
    /// Tokens per KV block.
    pub block_size: u32,
    /// The served model name.
    pub model: String,
    /// Folder with the `tokenizer.json` and `tokenizer_config.json` the engine tokenizes with.
    pub tokenizer: PathBuf,
}

impl Target {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.http)
    }

    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        post(self.http, path, body).await
    }

    /// A completion for token ids, returning (status, body). `ignore_eos`: a random-weight
    /// model may otherwise stop early.
    pub async fn complete(&self, tokens: &[u32], max_tokens: u32) -> (u16, Value) {
        let body = json!({"model": self.model, "prompt": tokens, "max_tokens": max_tokens,
            "ignore_eos": true});
        self.post("/v1/completions", &body).await
    }

    pub async fn metrics_text(&self) -> String {
        metrics_text(self.http).await
    }

    pub async fn metrics(&self) -> EngineMetrics {
        let text = self.metrics_text().await;
        parse_engine_metrics(&text, EngineKind::Vllm, &ParseLimits::default())
            .expect("metrics parse")
    }

    /// The engine's own token ids for a text prompt (`/v1/completions/render`).
    pub async fn render(&self, prompt: &str) -> Vec<u32> {
        let (s, v) = self
            .post(
                "/v1/completions/render",
                &json!({"model": self.model, "prompt": prompt}),
            )
            .await;
        assert_eq!(s, 200, "{v}");
        ids(&v[0]["token_ids"])
    }

    pub async fn render_chat(&self, messages: &Value) -> Vec<u32> {
        let (s, v) = self
            .post(
                "/v1/chat/completions/render",
                &json!({"model": self.model, "messages": messages}),
            )
            .await;
        assert_eq!(s, 200, "{v}");
        ids(&v["token_ids"])
    }

    /// `max_model_len` as `/v1/models` reports it.
    pub async fn max_model_len(&self) -> u32 {
        let models = get_json(self.http, "/v1/models").await;
        u32::try_from(models["data"][0]["max_model_len"].as_u64().unwrap()).unwrap()
    }

    pub fn view(&self) -> PickerView {
        PickerView::new(self.block_size, &self.model)
    }

    pub async fn subscribe(&self) -> Sub {
        Sub::connect(self.kv_events).await
    }

    pub async fn replay(&self, start: u64) -> Vec<(u64, EventBatch)> {
        replay(self.replay, start).await
    }

    fn tokenizer(&self) -> PromptTokenizer {
        let json = std::fs::read(self.tokenizer.join("tokenizer.json")).unwrap();
        let config = std::fs::read_to_string(self.tokenizer.join("tokenizer_config.json")).unwrap();
        PromptTokenizer::from_hf_files(
            Some(&json),
            Some(&config),
            PromptTokenizerOptions::default(),
        )
        .unwrap()
    }
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap_or_else(|| panic!("token ids: {v}"))
        .iter()
        .map(|x| u32::try_from(x.as_u64().unwrap()).unwrap())
        .collect()
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

pub fn url(addr: SocketAddr, path: &str) -> String {
    format!("http://{addr}{path}")
}

pub async fn post(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let r = client()
        .post(url(addr, path))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let v = r.json::<Value>().await.unwrap_or(Value::Null);
    (status, v)
}

pub async fn get_json(addr: SocketAddr, path: &str) -> Value {
    kvroute_testkit::get_json(&client(), url(addr, path)).await
}

pub fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("usage.prompt_tokens_details.cached_tokens in {v}"))
}

pub async fn metrics_text(addr: SocketAddr) -> String {
    kvroute_testkit::get_text(&client(), url(addr, "/metrics")).await
}

/// The value of the series `name{labels}` exactly as written (vLLM writes `engine` then
/// `model_name`).
pub fn series(text: &str, name: &str, labels: &str) -> f64 {
    let head = format!("{name}{{{labels}}} ");
    let line = text
        .lines()
        .find(|l| l.starts_with(&head))
        .unwrap_or_else(|| panic!("no series {head}in\n{text}"));
    line[head.len()..].trim().parse().unwrap()
}

/// Pseudo-random token ids, distinct per `seed`, in `100..4000` (inside the tiny test model's
/// 4,096-token vocabulary and clear of its special tokens).
pub fn tokens(seed: u32, n: u32) -> Vec<u32> {
    (0..n)
        .map(|i| {
            100 + (seed.wrapping_mul(2_654_435_761) ^ i.wrapping_mul(40_503)).wrapping_add(i)
                % 3_900
        })
        .collect()
}

/// A KV event subscriber.
pub struct Sub {
    socket: SubSocket,
}

impl Sub {
    pub async fn connect(addr: SocketAddr) -> Self {
        let mut socket = SubSocket::new();
        socket.connect(&format!("tcp://{addr}")).await.unwrap();
        socket.subscribe("").await.unwrap();
        // Let the publisher register the subscription (PUB drops messages until then).
        tokio::time::sleep(Duration::from_millis(500)).await;
        Self { socket }
    }

    /// Next message as (seq, batch), or `None` after `wait` without one.
    pub async fn next(&mut self, wait: Duration) -> Option<(u64, EventBatch)> {
        let msg = tokio::time::timeout(wait, self.socket.recv())
            .await
            .ok()?
            .ok()?;
        let frames: Vec<Bytes> = msg.into_vec();
        assert_eq!(frames.len(), 3, "PUB frames are topic, sequence, payload");
        let refs: Vec<&[u8]> = frames.iter().map(|f| f.as_ref()).collect();
        let (_, seq, batch) = decode_message(&refs, &DecodeLimits::default()).expect("decodes");
        Some((seq, batch))
    }

    /// Every message published for work that has finished: the events of a step are published
    /// after its responses may have gone out, on vLLM by a separate publisher thread, so this
    /// reads until nothing has arrived for a second.
    pub async fn drain(&mut self) -> Vec<(u64, EventBatch)> {
        self.drain_quiet(Duration::from_secs(1)).await
    }

    /// Every message until none arrives for `quiet` (the simulator publishes at once).
    pub async fn drain_quiet(&mut self, quiet: Duration) -> Vec<(u64, EventBatch)> {
        let mut out = Vec::new();
        while let Some(m) = self.next(quiet).await {
            out.push(m);
        }
        out
    }
}

/// Replays from `start` over a DEALER socket: every (seq, batch) up to the end marker, with
/// vLLM 0.32's framing asserted.
pub async fn replay(addr: SocketAddr, start: u64) -> Vec<(u64, EventBatch)> {
    let mut d = DealerSocket::new();
    d.connect(&format!("tcp://{addr}")).await.unwrap();
    let req = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&seq_frame(start)),
    ])
    .unwrap();
    d.send(req).await.unwrap();
    let mut out = Vec::new();
    loop {
        let msg = tokio::time::timeout(Duration::from_secs(5), d.recv())
            .await
            .expect("replay answers")
            .unwrap();
        let frames: Vec<Bytes> = msg.into_vec();
        let refs: Vec<&[u8]> = frames.iter().map(|f| f.as_ref()).collect();
        if is_replay_end(&refs) {
            assert_eq!(
                refs.len(),
                4,
                "vLLM 0.32's end marker is (\"\", \"\", -1, \"\")"
            );
            assert!(refs[0].is_empty() && refs[1].is_empty() && refs[3].is_empty());
            return out;
        }
        // like vLLM 0.32: ("", topic, seq, payload) to a DEALER
        assert_eq!(
            refs.len(),
            4,
            "a DEALER gets the empty delimiter, the topic, the number and the payload"
        );
        assert!(refs[0].is_empty(), "the empty delimiter comes first");
        let (_, seq, batch) =
            decode_replay_message(&refs, &DecodeLimits::default()).expect("decodes");
        out.push((seq, batch));
    }
}

/// The picker's view of one endpoint, fed by events.
pub struct PickerView {
    pub index: KvIndex,
    pub slot: Slot,
    block_size: u32,
    model: String,
}

impl PickerView {
    pub fn new(block_size: u32, model: &str) -> Self {
        let mut index = KvIndex::default();
        let slot = index
            .add_endpoint(
                EndpointId::new(std::net::Ipv4Addr::LOCALHOST.into(), 1, 0),
                IndexMode::Precise,
                1 << 20,
            )
            .unwrap();
        Self {
            index,
            slot,
            block_size,
            model: model.to_owned(),
        }
    }

    pub fn apply(&mut self, batch: &EventBatch) {
        let keys = IngestKeys {
            hasher: BlockHasher::new(self.block_size),
            model: &self.model,
        };
        let s = apply_batch(&mut self.index, self.slot, keys, batch);
        assert!(!s.needs_resync(), "{s:?}");
    }

    /// Leading blocks of `tokens` this endpoint holds, by the picker's own keys.
    pub fn matched(&self, tokens: &[u32]) -> u32 {
        let k =
            BlockHasher::new(self.block_size).keys(ChainRoot::new(&self.model, None, None), tokens);
        let mut out = Vec::new();
        self.index.longest_prefix(&k, &mut out);
        out.first().map_or(0, |m| m.blocks)
    }
}

pub fn stored(msgs: &[(u64, EventBatch)]) -> Vec<u64> {
    msgs.iter()
        .flat_map(|(_, b)| b.events.iter())
        .flat_map(|e| match e {
            KvEvent::BlockStored { block_hashes, .. } => block_hashes.clone(),
            _ => Vec::new(),
        })
        .collect()
}

fn rank0(m: &EngineMetrics) -> &kvroute_routing::engine_metrics::LoadSample {
    m.for_rank(0).expect("rank 0's sample")
}

// ---------------------------------------------------------------------------------------------
// The properties. Each takes the engine under test; the seeds of their prompts are disjoint.

/// `usage` (`prompt_tokens`, `completion_tokens`, `prompt_tokens_details.cached_tokens`),
/// the prefix-cache counters and the token counters, and the metrics' cache config: an
/// extension of a cached prompt hits every block of it, the identical prompt recomputes its
/// last block, and `vllm:prefix_cache_{queries,hits}_total` move by exactly the request's
/// prompt and cached tokens.
pub async fn cached_tokens_and_prefix_counters(t: &Target) {
    let bs = t.block_size;
    let labels = format!("engine=\"0\",model_name=\"{}\"", t.model);
    let text0 = t.metrics_text().await;
    let m0 = t.metrics().await;
    let p1 = tokens(1, 4 * bs);
    let (s, v) = t.complete(&p1, 4).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(cached(&v), 0);
    assert_eq!(v["usage"]["prompt_tokens"], 4 * bs);
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert_eq!(v["usage"]["total_tokens"], 4 * bs + 4);
    assert!(v["choices"][0]["text"].is_string(), "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["choices"][0]["index"], 0);
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], t.model.as_str());
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"), "{v}");

    let mut p2 = p1.clone();
    p2.extend(tokens(2, bs + 4));
    let (_, v) = t.complete(&p2, 1).await;
    assert_eq!(cached(&v), u64::from(4 * bs));
    // The identical prompt recomputes its last block (the last-token rule).
    let (_, v) = t.complete(&p1, 1).await;
    assert_eq!(cached(&v), u64::from(3 * bs));

    let m = t.metrics().await;
    let (s0, s) = (rank0(&m0), rank0(&m));
    let queries = f64::from(4 * bs + 5 * bs + 4 + 4 * bs);
    assert_eq!(
        s.prefix_cache_queries.unwrap() - s0.prefix_cache_queries.unwrap(),
        queries
    );
    assert_eq!(
        s.prefix_cache_hits.unwrap() - s0.prefix_cache_hits.unwrap(),
        f64::from(4 * bs + 3 * bs)
    );
    assert_eq!(s.block_size, Some(bs));
    assert!(s.kv_capacity_blocks.unwrap() > 0);
    assert_eq!((s.waiting, s.running), (0.0, 0.0));
    let text = t.metrics_text().await;
    let delta = |name: &str| series(&text, name, &labels) - series(&text0, name, &labels);
    assert_eq!(delta("vllm:prompt_tokens_total"), queries);
    assert_eq!(delta("vllm:generation_tokens_total"), 6.0);
    assert_eq!(delta("vllm:time_to_first_token_seconds_count"), 3.0);
}

/// Streamed completions and chat are OpenAI server-sent events: one chunk per token, the
/// finish reason on the last, the usage chunk (empty `choices`) only when asked, `[DONE]` last.
pub async fn streaming_completions_and_chat_follow_openai(t: &Target) {
    let prompt = "hello there, streaming";
    let prompt_ids = t.render(prompt).await;
    let body = json!({"model": t.model, "prompt": prompt, "max_tokens": 5, "ignore_eos": true,
        "stream": true, "stream_options": {"include_usage": true}});
    let r = client()
        .post(t.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let text = r.text().await.unwrap();
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert!(events.iter().all(|e| e.starts_with("data: ")), "{text}");
    assert_eq!(*events.last().unwrap(), "data: [DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(&e[6..]).unwrap())
        .collect();
    // one chunk per token, except that a token whose text is an incomplete UTF-8 sequence
    // (a byte-fallback token of a random-weight model) is held back and sent with the next
    let n = chunks.len() - 1;
    assert!(
        (1..=5).contains(&n),
        "at most 5 token chunks and the usage chunk:\n{text}"
    );
    for c in &chunks[..n - 1] {
        assert_eq!(c["object"], "text_completion");
        assert_eq!(c["choices"][0]["finish_reason"], Value::Null, "{c}");
        assert!(c["choices"][0]["text"].is_string(), "{c}");
    }
    assert_eq!(chunks[n - 1]["choices"][0]["finish_reason"], "length");
    let usage = &chunks[n];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 5);
    assert_eq!(
        usage["usage"]["prompt_tokens"],
        prompt_ids.len(),
        "the prompt as the engine renders it"
    );

    // Chat: role first, then content deltas; no usage chunk unless asked.
    let body = json!({"model": t.model, "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3, "ignore_eos": true, "stream": true});
    let text = kvroute_testkit::post_text(&client(), t.url("/v1/chat/completions"), &body).await;
    let chunks: Vec<Value> = text
        .split("\n\n")
        .filter(|e| e.starts_with("data: {"))
        .map(|e| serde_json::from_str(&e[6..]).unwrap())
        .collect();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    // the role, then at most one chunk per token (see above)
    assert!(
        (2..=4).contains(&chunks.len()),
        "the role and 3 tokens:\n{text}"
    );
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(
        chunks[chunks.len() - 1]["choices"][0]["finish_reason"],
        "length"
    );
    assert!(
        chunks.iter().all(|c| c.get("usage").is_none()),
        "no usage unless asked:\n{text}"
    );

    // Non-streaming chat.
    let (s, v) = t
        .post(
            "/v1/chat/completions",
            &json!({"model": t.model, "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 7, "ignore_eos": true}),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 7);
    assert_eq!(
        v["usage"]["total_tokens"],
        v["usage"]["prompt_tokens"].as_u64().unwrap() + 7
    );
}

/// The render endpoints' shapes (a list for completions, one entry per prompt; one object for
/// chat; a token-id prompt renders to itself), `prompt_tokens` equal to the rendered length,
/// and a second chat turn reusing the first turn's cached prompt.
pub async fn render_endpoints_and_multi_turn_reuse(t: &Target) {
    let (s, v) = t
        .post(
            "/v1/completions/render",
            &json!({"model": t.model, "prompt": ["ab", "c"]}),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v.as_array().unwrap().len(), 2, "{v}");
    assert!(!ids(&v[0]["token_ids"]).is_empty());
    assert!(!ids(&v[1]["token_ids"]).is_empty());
    assert!(v[0]["request_id"].is_string());
    assert_ne!(v[0]["request_id"], v[1]["request_id"]);
    let (_, v) = t
        .post(
            "/v1/completions/render",
            &json!({"model": t.model, "prompt": [105, 106, 107]}),
        )
        .await;
    assert_eq!(v.as_array().unwrap().len(), 1, "{v}");
    assert_eq!(v[0]["token_ids"], json!([105, 106, 107]));
    assert!(v[0]["request_id"].is_string());

    // A long conversation: turn 2 resends turn 1 and its answer, so turn 1's cached prompt is
    // reused (and, where the answer's text renders back to the answer's ids, more).
    let system = "You are a simulated assistant. ".repeat(8);
    let mut messages = vec![
        json!({"role": "system", "content": system}),
        json!({"role": "user", "content": "first question"}),
    ];
    let r1 = t.render_chat(&json!(messages)).await;
    let (_, v1) = t
        .post(
            "/v1/chat/completions",
            &json!({"model": t.model, "messages": messages, "max_tokens": 40, "ignore_eos": true}),
        )
        .await;
    assert_eq!(v1["usage"]["prompt_tokens"], r1.len(), "{v1}");
    messages.push(json!({"role": "assistant", "content": v1["choices"][0]["message"]["content"]}));
    messages.push(json!({"role": "user", "content": "second question"}));
    let r2 = t.render_chat(&json!(messages)).await;
    let (_, v2) = t
        .post(
            "/v1/chat/completions",
            &json!({"model": t.model, "messages": messages, "max_tokens": 2, "ignore_eos": true}),
        )
        .await;
    assert_eq!(v2["usage"]["prompt_tokens"], r2.len(), "{v2}");
    let shared = r1.iter().zip(&r2).take_while(|(a, b)| a == b).count() as u32;
    let reused = cached(&v2);
    let bs = u64::from(t.block_size);
    assert_eq!(reused % bs, 0);
    assert!(
        reused >= u64::from(shared / t.block_size) * bs,
        "turn 2 reuses the {shared} tokens it shares with turn 1: {reused}"
    );
}

/// Error bodies are OpenAI JSON, `{"error": {"message", "type", "param", "code"}}`, with the
/// status vLLM gives; `/v1/models` and `/health`.
pub async fn errors_are_openai_json(t: &Target) {
    let m = &t.model;
    let max_len = t.max_model_len().await;
    // (case, path, body, status, type): every case is sent and checked, and the failure lists
    // every mismatch with the body the engine gave.
    let cases: Vec<(&str, &str, Option<Value>, u16, &str)> = vec![
        ("invalid JSON", "/v1/completions", None, 400, "Bad Request"),
        (
            "unknown model",
            "/v1/completions",
            Some(json!({"model": "other", "prompt": "x"})),
            404,
            "NotFoundError",
        ),
        (
            "no prompt",
            "/v1/completions",
            Some(json!({"model": m})),
            400,
            "BadRequestError",
        ),
        (
            "max_tokens 0",
            "/v1/completions",
            Some(json!({"model": m, "prompt": "x", "max_tokens": 0})),
            400,
            "BadRequestError",
        ),
        // A body that fails the request schema: vLLM's validation handler, `"Bad Request"`.
        (
            "negative token id",
            "/v1/completions",
            Some(json!({"model": m, "prompt": [1, -2]})),
            400,
            "Bad Request",
        ),
        (
            "messages not a list",
            "/v1/chat/completions",
            Some(json!({"model": m, "messages": "hi"})),
            400,
            "Bad Request",
        ),
        (
            "a prompt longer than the context",
            "/v1/completions",
            Some(json!({"model": m, "prompt": tokens(3, max_len + 1), "max_tokens": 1})),
            400,
            "BadRequestError",
        ),
    ];
    let mut wrong = Vec::new();
    for (case, path, body, status, kind) in cases {
        let req = client().post(t.url(path));
        let req = match &body {
            Some(b) => req.json(b),
            None => req.body("{nope").header("content-type", "application/json"),
        };
        let r = req.send().await.unwrap();
        let s = r.status().as_u16();
        let v: Value = r.json().await.unwrap_or(Value::Null);
        let ok = s == status
            && v["error"]["message"].is_string()
            && v["error"]["code"] == status
            && v["error"]["type"] == kind
            && v["error"].get("param").is_some();
        if !ok {
            wrong.push(format!("{case}: want {status} {kind:?}, got {s} {v}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    // vLLM names the failing field of a schema error.
    let (_, v) = t
        .post(
            "/v1/chat/completions",
            &json!({"model": m, "messages": "hi"}),
        )
        .await;
    assert_eq!(v["error"]["param"], "body.messages", "{v}");
    let (_, v) = t
        .post("/v1/completions", &json!({"model": m, "prompt": [1, -2]}))
        .await;
    assert_eq!(v["error"]["param"], "body.prompt.1", "{v}");
    // A prompt that fits but leaves less room than `max_tokens` asks for is not an error: the
    // output is shortened to the context.
    let (s, v) = t
        .post(
            "/v1/completions",
            &json!({"model": m, "prompt": tokens(4, max_len - 8), "max_tokens": 20,
                "ignore_eos": true}),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 8, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let r = client()
        .post(t.url("/v1/models"))
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405, "models is GET only");
    let models = get_json(t.http, "/v1/models").await;
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], m.as_str());
    assert_eq!(models["data"][0]["object"], "model");
    assert!(models["data"][0]["max_model_len"].as_u64().unwrap() > 0);
    assert_eq!(
        client()
            .get(t.url("/health"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
}

/// KV events (PUB: topic, gapless sequence, msgpack batch with rank 0 and a wall-clock
/// timestamp) re-key into the picker's index so that its prediction of a new request's hit is
/// exact: only full blocks are stored, prompt and computed output alike.
pub async fn kv_events_rekey_into_the_picker_index(t: &Target) {
    let bs = t.block_size;
    let mut sub = t.subscribe().await;
    let system = tokens(100, 3 * bs);
    let mut prompts = Vec::new();
    for i in 0..4 {
        let mut p = system.clone();
        p.extend(tokens(110 + i, 2 * bs + bs / 2));
        let (s, _) = t.complete(&p, bs + 4).await;
        assert_eq!(s, 200);
        prompts.push(p);
    }
    let msgs = sub.drain().await;
    assert!(!msgs.is_empty());
    let seqs: Vec<u64> = msgs.iter().map(|m| m.0).collect();
    assert_eq!(
        seqs,
        (seqs[0]..seqs[0] + msgs.len() as u64).collect::<Vec<_>>(),
        "gapless"
    );
    let mut view = t.view();
    for (_, b) in &msgs {
        assert_eq!(b.data_parallel_rank, Some(0));
        assert!(b.ts > 1.6e9);
        for e in &b.events {
            if let KvEvent::BlockStored {
                block_size,
                token_ids,
                block_hashes,
                medium,
                ..
            } = e
            {
                assert_eq!(*block_size, bs);
                assert_eq!(token_ids.len(), block_hashes.len() * bs as usize);
                assert_eq!(medium.as_deref(), Some("GPU"));
            }
        }
        view.apply(b);
    }
    for p in &prompts {
        // 5.5 blocks of prompt + bs+3 computed output tokens = 6.5+ blocks: 6 full blocks are
        // stored; the prompt has 5 of them.
        assert_eq!(view.matched(p), 5, "{p:?}");
    }
    assert_eq!(view.matched(&tokens(190, 2 * bs)), 0);
    // A new request sharing the system prompt is predicted exactly.
    let mut q = system.clone();
    q.extend(tokens(177, 2 * bs));
    let predicted = view.matched(&q) * bs;
    let (_, v) = t.complete(&q, 1).await;
    assert_eq!(cached(&v), u64::from(predicted));
    assert_eq!(predicted, 3 * bs);
}

/// The last-token rule, as vLLM applies it: a fully cached block-aligned prompt of k blocks
/// hits k-1 blocks, in the response's `cached_tokens` and in `vllm:prefix_cache_hits_total`;
/// and the picker, crediting `servable_blocks` of what its index holds, predicts exactly that.
pub async fn a_fully_cached_block_aligned_prompt_hits_all_but_its_last_block(t: &Target) {
    let bs = t.block_size;
    let mut sub = t.subscribe().await;
    let p = tokens(21, 8 * bs);
    assert_eq!(t.complete(&p, 1).await.0, 200);
    let mut view = t.view();
    for (_, b) in &sub.drain().await {
        view.apply(b);
    }
    // the index holds all 8 blocks of the prompt
    assert_eq!(view.matched(&p), 8);
    let credit = view
        .matched(&p)
        .min(kvroute_routing::router::servable_blocks(8 * bs, bs))
        * bs;
    let before = t.metrics().await;
    let (_, v) = t.complete(&p, 1).await;
    let after = t.metrics().await;
    assert_eq!(cached(&v), u64::from(7 * bs));
    assert_eq!(u64::from(credit), cached(&v));
    let hits = |m: &EngineMetrics| rank0(m).prefix_cache_hits.unwrap();
    assert_eq!(hits(&after) - hits(&before), f64::from(7 * bs));
    // One more token and every block is a hit.
    let mut q = p.clone();
    q.push(150);
    assert_eq!(cached(&t.complete(&q, 1).await.1), u64::from(8 * bs));
}

/// Eviction: once the cache is full, the least recently used blocks (a prompt's tail first)
/// are removed and published as `BlockRemoved` on `"GPU"`, and the picker's view after the
/// events predicts the engine's hit exactly. Sizes come from the engine's own
/// `vllm:cache_config_info`, so on a shared engine this must run first (a cold cache).
pub async fn eviction_is_published_and_visible(t: &Target) {
    let bs = t.block_size;
    let capacity = u32::try_from(rank0(&t.metrics().await).kv_capacity_blocks.unwrap()).unwrap();
    // Three prompts of 3/8 of the cache each: the third evicts part of the first.
    let k = (capacity * 3).div_ceil(8);
    assert!(k * bs < t.max_model_len().await, "a prompt fits the model");
    let mut sub = t.subscribe().await;
    let ps: Vec<Vec<u32>> = (0..3).map(|i| tokens(30 + i, k * bs)).collect();
    for p in &ps {
        assert_eq!(t.complete(p, 1).await.0, 200);
    }
    let msgs = sub.drain().await;
    let removed: usize = msgs
        .iter()
        .flat_map(|(_, b)| b.events.iter())
        .map(|e| match e {
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
                place,
            } => {
                assert_eq!(medium.as_deref(), Some("GPU"));
                // vLLM 0.32 names the group a removal addresses
                assert_eq!(place.group_idx, Some(0));
                block_hashes.len()
            }
            _ => 0,
        })
        .sum();
    let mut view = t.view();
    for (_, b) in &msgs {
        view.apply(b);
    }
    let evicted = k - view.matched(&ps[0]);
    assert_eq!(
        removed as u32, evicted,
        "every removal is one of the first prompt's blocks"
    );
    // vLLM counts its null block (block 0, never cached) in `num_gpu_blocks`.
    assert_eq!(
        evicted,
        3 * k - (capacity - 1),
        "exactly what did not fit in the {capacity} blocks but the null block"
    );
    assert_eq!(view.matched(&ps[1]), k);
    assert_eq!(view.matched(&ps[2]), k);
    let (_, v) = t.complete(&ps[0], 1).await;
    assert_eq!(cached(&v), u64::from(view.matched(&ps[0]) * bs));
    let m = t.metrics().await;
    assert_eq!(
        rank0(&m).kv_usage,
        0.0,
        "an idle engine's cached blocks are free"
    );
}

/// Replay: a DEALER asking from a sequence gets every buffered batch from there (four frames
/// each) and the end marker; the replayed batches are the published ones, byte for byte as
/// decoded; a start past the newest gets only the end marker.
pub async fn replay_resends_what_was_published(t: &Target) {
    let bs = t.block_size;
    let mut sub = t.subscribe().await;
    for i in 0..3 {
        assert_eq!(t.complete(&tokens(40 + i, 2 * bs + 8), 1).await.0, 200);
    }
    let live = sub.drain().await;
    assert!(live.len() >= 3, "{} batches", live.len());
    let first = live[0].0;
    let newest = live.last().unwrap().0;
    let replayed = t.replay(first).await;
    assert_eq!(replayed, live, "a replay resends the published batches");
    let mut view = t.view();
    for (_, b) in &replayed {
        view.apply(b);
    }
    for i in 0..3 {
        assert_eq!(view.matched(&tokens(40 + i, 2 * bs + 8)), 2);
    }
    let from_middle = t.replay(live[1].0).await;
    assert_eq!(from_middle, live[1..]);
    // From 0: everything published so far (the buffer holds 10,000 steps).
    let all = t.replay(0).await;
    assert_eq!(
        all.iter().map(|m| m.0).collect::<Vec<_>>(),
        (0..=newest).collect::<Vec<_>>()
    );
    assert!(t.replay(newest + 1_000).await.is_empty());
}

/// The engine's token ids, from the render endpoints and in `usage.prompt_tokens`, are the
/// ones the picker's tokenizer computes from the engine's tokenizer files.
pub async fn a_real_tokenizer_gives_the_routers_ids(t: &Target) {
    let router_side = t.tokenizer();
    for text in [
        "The quick brown fox jumps over the lazy dog.",
        "  spaces,\ttabs\nand 12345 numbers — and ünïcödé",
    ] {
        let expect = router_side.tokenize(PromptInput::Text(text)).unwrap().ids;
        assert_eq!(t.render(text).await, expect, "{text:?}");
    }
    let text = "The quick brown fox jumps over the lazy dog.";
    let messages =
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]);
    let expect = router_side
        .tokenize(PromptInput::Chat {
            messages: &messages,
            tools: None,
            add_generation_prompt: true,
            extra: None,
            add_special_tokens: false,
        })
        .unwrap()
        .ids;
    assert_eq!(t.render_chat(&messages).await, expect);
    let (_, v) = t
        .post(
            "/v1/chat/completions",
            &json!({"model": t.model, "messages": messages, "max_tokens": 2, "ignore_eos": true}),
        )
        .await;
    assert_eq!(v["usage"]["prompt_tokens"], expect.len());
}
