//! Tenancy end to end: real HTTP through the picker to fake engines on loopback.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use serde_json::{Value, json};
use support::*;

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn long_prompt(seed: &str) -> String {
    // many character chunks: enough blocks for prefix credit without a tokenizer
    (0..60).map(|i| format!("{seed} line {i}; ")).collect()
}

async fn send(url: &str, tenant: Option<&str>, body: Value) -> reqwest::Response {
    let mut req = client().post(url).json(&body);
    if let Some(t) = tenant {
        req = req.header("x-tenant", t);
    }
    req.send().await.unwrap()
}

fn salted_yaml(port: u16, secret: &std::path::Path, default_tenant: &str) -> String {
    one_engine_pool(
        port,
        &format!(
            "tenancy:\n  isolation: SaltedCache\n  header: x-tenant\n  saltSecretFile: {}\n{default_tenant}\n",
            secret.display()
        ),
    )
}

#[tokio::test]
async fn a_missing_tenant_header_is_rejected_naming_the_header_or_gets_the_default() {
    let engine = FakeEngine::start("127.0.0.1").await;
    let dir = temp_dir("tenant-header");
    let secret = dir.join("secret");
    std::fs::write(&secret, "a-secret-of-at-least-16-bytes\n").unwrap();

    let picker = start_picker(&salted_yaml(engine.addr.port(), &secret, "")).await;
    let url = format!("http://{}/v1/completions", picker.addrs.http);
    let resp = send(&url, None, json!({"model": "llama", "prompt": "hi"})).await;
    assert_eq!(resp.status(), 400);
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["code"], "missing_tenant");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("x-tenant"),
        "{err}"
    );
    assert_eq!(engine.state.requests.load(Ordering::SeqCst), 0);
    let resp = send(
        &url,
        Some("acme"),
        json!({"model": "llama", "prompt": "hi"}),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let acme_salt = engine.state.last_body.lock().clone().unwrap()["cache_salt"].clone();
    assert!(acme_salt.is_string());
    picker.shutdown().await;

    // with a default tenant, header-less requests are that tenant's
    let picker = start_picker(&salted_yaml(
        engine.addr.port(),
        &secret,
        "  defaultTenant: acme",
    ))
    .await;
    let url = format!("http://{}/v1/completions", picker.addrs.http);
    let resp = send(&url, None, json!({"model": "llama", "prompt": "hi"})).await;
    assert_eq!(resp.status(), 200);
    let body = engine.state.last_body.lock().clone().unwrap();
    assert_eq!(body["cache_salt"], acme_salt, "the default tenant's salt");
    picker.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn salted_cache_gives_prefix_credit_within_a_tenant_only() {
    let engine = FakeEngine::start("127.0.0.1").await;
    let dir = temp_dir("tenant-salted");
    let secret = dir.join("secret");
    std::fs::write(&secret, "0123456789abcdef0123").unwrap();
    let yaml = salted_yaml(engine.addr.port(), &secret, "");
    let picker = start_picker(&yaml).await;
    let url = format!("http://{}/v1/completions", picker.addrs.http);
    let pick_url = format!("http://{}/v1/pick", picker.addrs.admin);
    let prompt = long_prompt("the shared system prompt");
    let body = json!({"model": "llama", "prompt": prompt, "cache_salt": "client-chosen"});

    // tenant a runs the prompt: the approximate index learns it under a's salt
    assert_eq!(send(&url, Some("a"), body.clone()).await.status(), 200);
    let salt_a = engine.state.last_body.lock().clone().unwrap()["cache_salt"].clone();
    assert_ne!(
        salt_a, "client-chosen",
        "the tenant's salt replaces the client's"
    );
    let pick = |tenant: &'static str| {
        let (u, b) = (pick_url.clone(), body.clone());
        async move {
            send(&u, Some(tenant), b)
                .await
                .json::<Value>()
                .await
                .unwrap()
        }
    };
    let same = pick("a").await;
    let other = pick("b").await;
    assert!(same["matched_blocks"].as_u64().unwrap() > 10, "{same}");
    assert_eq!(other["matched_blocks"], 0, "{other}");
    assert_eq!(other["cached_tokens"], 0);
    // the blocks an endpoint holds (a's traffic among them) are not shown to b (finding 6 of
    // issue 35), nor to anyone while tenancy is on
    for explained in [&same, &other] {
        let candidates = explained["candidates"].as_array().unwrap();
        assert!(!candidates.is_empty(), "{explained}");
        for c in candidates {
            assert!(c["features"].is_object(), "{c}");
            assert!(c["features"].get("indexed_blocks").is_none(), "{c}");
        }
    }
    // each tenant's salt travels to the engine; they differ
    assert_eq!(send(&url, Some("b"), body.clone()).await.status(), 200);
    let salt_b = engine.state.last_body.lock().clone().unwrap()["cache_salt"].clone();
    assert_ne!(salt_a, salt_b);

    // another replica (or a restart) with the same secret derives the same salts
    let replica = start_picker(&yaml).await;
    let url2 = format!("http://{}/v1/completions", replica.addrs.http);
    assert_eq!(send(&url2, Some("a"), body.clone()).await.status(), 200);
    let again = engine.state.last_body.lock().clone().unwrap()["cache_salt"].clone();
    assert_eq!(again, salt_a, "same secret, same salt");
    replica.shutdown().await;

    // rotating the secret changes every tenant's salt without a restart
    let tmp = dir.join("secret.tmp");
    std::fs::write(&tmp, "a-brand-new-secret-value").unwrap();
    std::fs::rename(&tmp, &secret).unwrap();
    assert!(picker.state.reload_tenancy_secret().unwrap());
    assert_eq!(send(&url, Some("a"), body.clone()).await.status(), 200);
    let rotated = engine.state.last_body.lock().clone().unwrap()["cache_salt"].clone();
    assert_ne!(rotated, salt_a);
    assert!(!picker.state.reload_tenancy_secret().unwrap(), "unchanged");
    picker.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_client_cache_salt_is_hashed_like_the_engine_does_without_tenancy() {
    let engine = FakeEngine::start("127.0.0.1").await;
    let picker = start_picker(&one_engine_pool(engine.addr.port(), "")).await;
    let url = format!("http://{}/v1/completions", picker.addrs.http);
    let pick_url = format!("http://{}/v1/pick", picker.addrs.admin);
    let prompt = long_prompt("doc");
    let salted = json!({"model": "llama", "prompt": prompt, "cache_salt": "s1"});
    assert_eq!(send(&url, None, salted.clone()).await.status(), 200);
    let body = engine.state.last_body.lock().clone().unwrap();
    assert_eq!(body["cache_salt"], "s1", "forwarded untouched");
    let p = |b: Value| {
        let u = pick_url.clone();
        async move { send(&u, None, b).await.json::<Value>().await.unwrap() }
    };
    assert!(p(salted).await["matched_blocks"].as_u64().unwrap() > 10);
    let unsalted = json!({"model": "llama", "prompt": prompt});
    assert_eq!(p(unsalted).await["matched_blocks"], 0);
    let other = json!({"model": "llama", "prompt": prompt, "cache_salt": "s2"});
    assert_eq!(p(other).await["matched_blocks"], 0);
    picker.shutdown().await;
}

fn dedicated_yaml(a_port: u16, b_port: u16, failure_mode: &str) -> String {
    format!(
        r#"
modelConfigs:
  - name: llama
    model: llama
    port: {a_port}
endpoints:
  - {{address: 127.0.0.1, modelConfig: llama, labels: {{tenant: a}}}}
  - {{address: 127.0.0.2, modelConfig: llama, port: {b_port}, labels: {{tenant: b}}}}
routing: {{strategy: LeastLoad, stalenessThreshold: 300ms, failureMode: {failure_mode}}}
scrape: {{interval: 50ms, timeout: 100ms}}
{DEDICATED_TENANTS}"#
    )
}

#[tokio::test]
async fn dedicated_endpoints_hold_when_the_tenants_endpoint_fails() {
    let b = FakeEngine::start("127.0.0.2").await;
    // tenant a's only endpoint refuses connections
    let dead = refused_port().await;
    let picker = start_picker(&dedicated_yaml(dead, b.addr.port(), "FailOpen")).await;
    let url = format!("http://{}/v1/completions", picker.addrs.http);
    eventually(Duration::from_secs(5), || {
        picker.state.pool.state().endpoints().len() == 2
    })
    .await;
    for i in 0..5 {
        let body = json!({"model": "llama", "prompt": format!("request {i}")});
        let resp = send(&url, Some("a"), body.clone()).await;
        // a's endpoint is down (502) or stale and excluded (503): never b's
        assert!(
            matches!(resp.status().as_u16(), 502 | 503),
            "status {}",
            resp.status()
        );
        assert_eq!(send(&url, Some("b"), body).await.status(), 200);
    }
    assert_eq!(
        b.state.requests.load(Ordering::SeqCst),
        5,
        "only b's own requests reached b"
    );
    // an unknown tenant has no endpoints at all
    let resp = send(
        &url,
        Some("mallory"),
        json!({"model": "llama", "prompt": "x"}),
    )
    .await;
    assert_eq!(resp.status(), 503);
    let resp = send(&url, None, json!({"model": "llama", "prompt": "x"})).await;
    assert_eq!(resp.status(), 400);
    assert_eq!(b.state.requests.load(Ordering::SeqCst), 5);
    picker.shutdown().await;
}

#[tokio::test]
async fn dedicated_endpoints_hold_when_fail_open_routes_to_stale_endpoints() {
    let a = FakeEngine::start("127.0.0.1").await;
    let b = FakeEngine::start("127.0.0.2").await;
    let picker = start_picker(&dedicated_yaml(a.addr.port(), b.addr.port(), "FailOpen")).await;
    let url = format!("http://{}/v1/completions", picker.addrs.http);
    eventually(Duration::from_secs(5), || picker.state.is_ready()).await;
    // a's metrics break: it goes stale, and fail-open still keeps a on a's endpoint
    a.state.metrics_broken.store(true, Ordering::SeqCst);
    let id = endpoint_on_port(&picker, a.addr.port());
    let state = picker.state.clone();
    eventually(Duration::from_secs(5), || {
        state.pool.state().endpoints().get(&id).map(|e| e.state)
            == Some(kvroute_picker::endpoint::EndpointState::Stale)
    })
    .await;
    let pick_url = format!("http://{}/v1/pick", picker.addrs.admin);
    for i in 0..4 {
        let body = json!({"model": "llama", "prompt": format!("r{i}")});
        let p: Value = send(&pick_url, Some("a"), body.clone())
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(p["failed_open"], true, "{p}");
        assert_eq!(p["fallbacks"], json!([]), "no fallback outside the tenant");
        assert_eq!(send(&url, Some("a"), body).await.status(), 200);
    }
    assert_eq!(a.state.requests.load(Ordering::SeqCst), 4);
    assert_eq!(b.state.requests.load(Ordering::SeqCst), 0);
    picker.shutdown().await;
}
