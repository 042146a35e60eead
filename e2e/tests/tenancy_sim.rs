//! Salted tenancy end to end with precise KV events: the picker salts a tenant's request,
//! the simulated engine (vLLM-like) folds the salt into the first block and reports it in the
//! event's extra keys, and the picker's index credits the prefix to that tenant only.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use serde_json::{Value, json};

#[path = "sim_support/mod.rs"]
mod sim_support;
use sim_support::{LLAMA_PRECISE, client, sim, static_picker};

async fn post(url: String, tenant: &str, body: Value) -> Value {
    kvroute_testkit::post_json_with(&client(), url, &[("x-tenant", tenant)], &body).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn salted_events_credit_only_the_tenant_that_cached_the_prefix() {
    let sim = sim("127.0.0.1").await;
    let dir = std::env::temp_dir().join(format!("kvroute-tenancy-sim-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let secret = dir.join("secret");
    std::fs::write(&secret, "sixteen-bytes-or-more-secret").unwrap();
    let a = &sim.addrs()[0];
    let yaml = format!(
        r#"
listen: {{http: 127.0.0.1:0, admin: 127.0.0.1:0, metrics: 127.0.0.1:0, extProc: null}}
{LLAMA_PRECISE}endpoints:
  - {{address: {}, modelConfig: llama, port: {}, kvEventsPort: {}, kvReplayPort: {}}}
routing: {{stalenessThreshold: 5s}}
scrape: {{interval: 50ms}}
tenancy:
  isolation: SaltedCache
  header: x-tenant
  saltSecretFile: {}
"#,
        a.http.ip(),
        a.http.port(),
        a.kv_events[0].port(),
        a.replay[0].port(),
        secret.display()
    );
    let p = static_picker(&yaml).await;
    let tokens: Vec<u32> = (0..2048).map(|i| (i * 13) % 30_000 + 1).collect();
    let body = json!({"model": "llama", "prompt": tokens, "max_tokens": 2});
    let proxy = format!("http://{}/v1/completions", p.addrs.http);
    let pick = format!("http://{}/v1/pick", p.addrs.admin);

    // tenant a runs the prompt through the picker: the engine caches it under a's salt
    post(proxy.clone(), "a", body.clone()).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let got = post(pick.clone(), "a", body.clone()).await;
        if got["matched_blocks"].as_u64().unwrap() >= 127 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the salted blocks never reached tenant a's index view: {got}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    // tenant b, same prompt: no credit in the picker, and no reuse in the engine either
    let b = post(pick.clone(), "b", body.clone()).await;
    assert_eq!(b["matched_blocks"], 0, "{b}");
    let out_b = post(proxy.clone(), "b", body.clone()).await;
    let cached = |v: &Value| {
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0)
    };
    assert_eq!(cached(&out_b), 0, "{out_b}");
    let out_a = post(proxy, "a", body).await;
    assert!(cached(&out_a) >= 2000, "{out_a}");
    p.shutdown().await;
    sim.shutdown();
    let _ = std::fs::remove_dir_all(dir);
}
