//! Helpers shared by the simulator's tests: start an in-process simulator on ephemeral
//! loopback ports, with the simulator's model and block size. The HTTP, KV-event and replay
//! helpers are the contract suite's (`contract/mod.rs`), written once for both targets.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::Duration;

use kvroute_routing::endpoint::EngineKind;
use kvroute_routing::engine_metrics::{EngineMetrics, ParseLimits, parse_engine_metrics};
use kvroute_sim::server::{self, EngineAddrs, PortSpec, SimConfig, SimHandle};
use serde_json::{Value, json};

pub use crate::contract::{PickerView, Sub, cached, client, metrics_text, post, replay, url};

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

/// A completion for token ids, returning (status, body).
pub fn complete(
    addr: SocketAddr,
    tokens: &[u32],
    max_tokens: u32,
) -> impl std::future::Future<Output = (u16, Value)> + Send + 'static {
    let body = json!({"model": MODEL, "prompt": tokens, "max_tokens": max_tokens});
    async move { post(addr, "/v1/completions", &body).await }
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

/// The picker's view of a simulator's events, with the simulator's block size and model.
pub fn picker_view() -> PickerView {
    PickerView::new(BS, MODEL)
}

/// Runs `f` with a deadline so a hung simulator fails the test instead of stalling CI.
pub async fn bounded<F: std::future::Future<Output = ()>>(f: F) {
    tokio::time::timeout(Duration::from_secs(60), f)
        .await
        .expect("test finished within 60 s");
}
