//! Helpers shared by the simulator's contract tests: start an in-process simulator on
//! ephemeral loopback ports, talk HTTP to it, and subscribe to its KV events.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use kvroute_e2e::sim::server::{self, EngineAddrs, PortSpec, SimConfig, SimHandle};
use kvroute_picker::block_keys::{BlockHasher, ChainRoot};
use kvroute_picker::endpoint::{EndpointId, EngineKind};
use kvroute_picker::engine_metrics::{EngineMetrics, ParseLimits, parse_engine_metrics};
use kvroute_picker::index::{IndexMode, KvIndex, Slot};
use kvroute_picker::ingest::{IngestKeys, apply_batch};
use kvroute_picker::kv_events::{
    DecodeLimits, EventBatch, decode_message, decode_replay_message, is_replay_end, seq_frame,
};
use serde_json::{Value, json};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

pub const MODEL: &str = "sim-model";
pub const BS: u32 = 16;

/// A simulator with KV events and replay on ephemeral ports, running 200x real time.
pub fn config() -> SimConfig {
    let mut c = SimConfig {
        speedup: 200.0,
        seed: 7,
        kv_events: PortSpec::Auto,
        kv_replay: PortSpec::Auto,
        ..SimConfig::default()
    };
    c.engine.block_size = BS;
    c.engine.num_blocks = 512;
    c
}

pub async fn start(f: impl FnOnce(&mut SimConfig)) -> (SimHandle, EngineAddrs) {
    let mut c = config();
    f(&mut c);
    let h = server::start(c).await.expect("simulator starts");
    let a = h.addrs().remove(0);
    (h, a)
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
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

/// A completion for token ids, returning (status, body).
pub fn complete(
    addr: SocketAddr,
    tokens: &[u32],
    max_tokens: u32,
) -> impl std::future::Future<Output = (u16, Value)> + Send + 'static {
    let body = json!({"model": MODEL, "prompt": tokens, "max_tokens": max_tokens});
    async move { post(addr, "/v1/completions", &body).await }
}

pub fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("usage.prompt_tokens_details.cached_tokens")
}

pub async fn metrics_text(addr: SocketAddr) -> String {
    client()
        .get(url(addr, "/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

pub async fn metrics(addr: SocketAddr, kind: EngineKind) -> EngineMetrics {
    let text = metrics_text(addr).await;
    parse_engine_metrics(&text, kind, &ParseLimits::default()).expect("metrics parse")
}

/// Pseudo-random token ids, distinct per `seed`.
pub fn tokens(seed: u32, n: u32) -> Vec<u32> {
    (0..n)
        .map(|i| {
            (seed.wrapping_mul(2_654_435_761) ^ i.wrapping_mul(40_503)).wrapping_add(i) % 100_000
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
        tokio::time::sleep(Duration::from_millis(300)).await;
        Self { socket }
    }

    /// Next message as (seq, batch), or `None` after `wait` without one.
    pub async fn next(&mut self, wait: Duration) -> Option<(u64, EventBatch)> {
        let msg = tokio::time::timeout(wait, self.socket.recv())
            .await
            .ok()?
            .ok()?;
        let frames: Vec<Bytes> = msg.into_vec();
        let refs: Vec<&[u8]> = frames.iter().map(|f| f.as_ref()).collect();
        let (_, seq, batch) = decode_message(&refs, &DecodeLimits::default()).expect("decodes");
        Some((seq, batch))
    }

    /// Every message until none arrives for `quiet`.
    pub async fn drain(&mut self, quiet: Duration) -> Vec<(u64, EventBatch)> {
        let mut out = Vec::new();
        while let Some(m) = self.next(quiet).await {
            out.push(m);
        }
        out
    }
}

/// Replays from `start` over a DEALER socket: every (seq, batch) up to the end marker.
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
}

impl PickerView {
    pub fn new() -> Self {
        let mut index = KvIndex::default();
        let slot = index
            .add_endpoint(
                EndpointId::new(std::net::Ipv4Addr::LOCALHOST.into(), 1, 0),
                IndexMode::Precise,
                1 << 20,
            )
            .unwrap();
        Self { index, slot }
    }

    pub fn apply(&mut self, batch: &EventBatch) {
        let keys = IngestKeys {
            hasher: BlockHasher::new(BS),
            model: MODEL,
        };
        let s = apply_batch(&mut self.index, self.slot, keys, batch);
        assert!(!s.needs_resync(), "{s:?}");
    }

    /// Leading blocks of `tokens` this endpoint holds, by the picker's own keys.
    pub fn matched(&self, tokens: &[u32]) -> u32 {
        let k = BlockHasher::new(BS).keys(ChainRoot::new(MODEL, None, None), tokens);
        let mut out = Vec::new();
        self.index.longest_prefix(&k, &mut out);
        out.first().map_or(0, |m| m.blocks)
    }
}

/// Runs `f` with a deadline so a hung simulator fails the test instead of stalling CI.
pub async fn bounded<F: std::future::Future<Output = ()>>(f: F) {
    tokio::time::timeout(Duration::from_secs(60), f)
        .await
        .expect("test finished within 60 s");
}
