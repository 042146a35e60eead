//! What the e2e tests against simulated engines share: a picker from YAML with a static
//! source, prompts, a loopback client, polling, and the picker's own view of its index.

#![allow(dead_code)] // each test file uses the helpers it needs

use std::time::Duration;

use kvroute_picker::service::settings::PickerConfig;
use kvroute_picker::service::source::{StaticSource, view_from_config};
use kvroute_picker::service::{Running, start as start_picker};
use kvroute_sim::server::{PortSpec, SimConfig, SimHandle, start as start_sim};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// A picker config's `listen` section: every listener on a free loopback port.
pub const LOOPBACK_LISTEN: &str =
    "listen: {http: 127.0.0.1:0, admin: 127.0.0.1:0, metrics: 127.0.0.1:0, extProc: 127.0.0.1:0}";

/// A picker config's model config `llama` (blocks of 16 tokens) with precise KV events.
pub const LLAMA_PRECISE: &str = "modelConfigs:
  - name: llama
    model: llama
    blockSize: 16
    kvEvents: {port: 1}
";

/// A simulated engine for model `llama` on `host` at `speedup`, with KV events and replay on
/// free ports and 4096 blocks of cache.
pub fn sim_config(host: &str, speedup: f64) -> SimConfig {
    let mut cfg = SimConfig {
        host: host.parse().unwrap(),
        model: "llama".into(),
        speedup,
        kv_events: PortSpec::Auto,
        kv_replay: PortSpec::Auto,
        ..SimConfig::default()
    };
    cfg.engine.num_blocks = 4096;
    cfg
}

/// [`sim_config`] at 50x, started.
pub async fn sim(host: &str) -> SimHandle {
    start_sim(sim_config(host, 50.0))
        .await
        .expect("simulator starts")
}

/// One line of a picker config's `endpoints:` list for `engine`'s first rank (model config
/// `llama`, its KV event and replay ports), with `extra` fields appended (`, role: decode`).
pub fn endpoint_entry(engine: &kvroute_sim::server::SimHandle, extra: &str) -> String {
    let a = &engine.addrs()[0];
    format!(
        "  - {{address: {}, modelConfig: llama, port: {}, kvEventsPort: {}, kvReplayPort: {}{extra}}}\n",
        a.http.ip(),
        a.http.port(),
        a.kv_events[0].port(),
        a.replay[0].port()
    )
}

/// A picker running `yaml` (a whole config file) with its endpoints as a static source.
pub async fn static_picker(yaml: &str) -> Running {
    let config = PickerConfig::from_yaml(yaml).expect("valid config");
    let view = view_from_config(&config);
    start_picker(
        config,
        Box::new(StaticSource(view)),
        CancellationToken::new(),
    )
    .await
    .expect("picker starts")
}

/// `n` token ids, different for each `seed`.
pub fn prompt(seed: u32, n: u32) -> Vec<u32> {
    (0..n)
        .map(|i| (seed.wrapping_mul(7919) + i * 13) % 30_000 + 1)
        .collect()
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

/// Wait up to 10 s until `f` holds.
pub async fn eventually<F: FnMut() -> bool>(what: &str, mut f: F) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Blocks the picker's index attributes to the endpoint on `ip`.
pub fn indexed_blocks(p: &Running, ip: &str) -> usize {
    let pool = p.state.pool.state().read();
    let index = pool.index();
    index
        .endpoints()
        .find(|(_, id)| id.address.to_string() == ip)
        .map_or(0, |(slot, _)| index.endpoint_blocks(slot))
}

/// `/v1/pick`'s answer for a completion of `tokens`.
pub async fn pick(p: &Running, tokens: &[u32]) -> Value {
    kvroute_testkit::post_json(
        &client(),
        format!("http://{}/v1/pick", p.addrs.admin),
        &json!({"model": "llama", "prompt": tokens}),
    )
    .await
}

/// A completion of `tokens` (2 output tokens) at `url`, which must answer 200; its body.
pub async fn complete(url: String, tokens: &[u32]) -> Value {
    let r = client()
        .post(url)
        .json(&json!({"model": "llama", "prompt": tokens, "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}
