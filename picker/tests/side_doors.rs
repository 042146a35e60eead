//! Every door into the picker passes the same tenant, model and body checks: the proxy, the
//! pick API and the ext_proc listener, on every path and for every body the parsers accept.
//! Each test here reproduces a hole that adversarial testing found (issue 12, findings 1-3).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::atomic::Ordering;

use serde_json::{Value, json};
use support::gateway::{self, Answer};
use support::*;

fn secret_file(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("secret");
    std::fs::write(&p, "a-secret-of-at-least-16-bytes").unwrap();
    p
}

fn salted(port: u16, secret: &std::path::Path) -> String {
    one_engine_pool(
        port,
        &format!(
            "tenancy:\n  isolation: SaltedCache\n  header: x-tenant\n  saltSecretFile: {}\n",
            secret.display()
        ),
    )
}

/// Bodies that the picker's lenient head parse accepts but a JSON tree cannot hold, each with
/// the client's own `cache_salt`. vLLM's request models accept all three.
fn unrewritable_bodies() -> Vec<(&'static str, String)> {
    let nested = format!("{}1{}", "[".repeat(200), "]".repeat(200));
    vec![
        (
            "a number out of range",
            r#"{"model":"llama","prompt":"hi","cache_salt":"attacker-chosen","x":1e400}"#.into(),
        ),
        (
            "a lone surrogate",
            r#"{"model":"llama","prompt":"hi","cache_salt":"attacker-chosen","x":"\ud800"}"#.into(),
        ),
        (
            "200 levels of nesting",
            format!(
                r#"{{"model":"llama","prompt":"hi","cache_salt":"attacker-chosen","x":{nested}}}"#
            ),
        ),
    ]
}

#[tokio::test]
async fn a_body_that_cannot_carry_the_tenant_salt_is_refused_on_every_door() {
    let engine = FakeEngine::start("127.0.0.1").await;
    let secret = secret_file("salt-fail-closed");
    let picker = start_picker(&salted(engine.addr.port(), &secret)).await;
    let proxy = format!("http://{}/v1/completions", picker.addrs.http);
    let pick = format!("http://{}/v1/pick", picker.addrs.admin);
    let ext = gateway::channel(picker.addrs.ext_proc.unwrap()).await;

    for (what, body) in unrewritable_bodies() {
        let resp = client()
            .post(&proxy)
            .header("x-tenant", "a")
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 400, "proxy, {what}");
        let err: Value = resp.json().await.unwrap();
        assert_eq!(err["error"]["code"], "invalid_json", "{what}: {err}");

        let resp = client()
            .post(&pick)
            .header("x-tenant", "a")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 400, "pick API, {what}");

        for path in ["/v1/completions", "/v1/responses"] {
            let answer = gateway::request(&ext, path, &[("x-tenant", "a")], body.as_bytes()).await;
            assert_eq!(answer.refused(), 400, "ext_proc {path}, {what}");
        }
    }
    assert_eq!(
        engine.state.requests.load(Ordering::SeqCst),
        0,
        "nothing reached the engine with the client's salt"
    );

    // the control: the same request without the poison is forwarded with the tenant's salt
    let resp = client()
        .post(&proxy)
        .header("x-tenant", "a")
        .json(&json!({"model": "llama", "prompt": "hi", "cache_salt": "attacker-chosen"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let salt = engine.state.last_body.lock().clone().unwrap()["cache_salt"].clone();
    assert!(salt.is_string() && salt != "attacker-chosen", "{salt}");
    picker.shutdown().await;
}

#[tokio::test]
async fn a_tenant_header_sent_twice_or_malformed_is_refused() {
    let engine = FakeEngine::start("127.0.0.1").await;
    let secret = secret_file("salt-dup-header");
    let picker = start_picker(&salted(engine.addr.port(), &secret)).await;
    let proxy = format!("http://{}/v1/completions", picker.addrs.http);
    let body = json!({"model": "llama", "prompt": "hi"});

    // reqwest appends repeated headers, as Envoy's default header action does
    let resp = client()
        .post(&proxy)
        .header("x-tenant", "attacker-chosen")
        .header("x-tenant", "victim")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["code"], "invalid_tenant", "{err}");
    for bad in ["a,b", "caf\u{e9}"] {
        let resp = client()
            .post(&proxy)
            .header(
                "x-tenant",
                reqwest::header::HeaderValue::from_bytes(bad.as_bytes()).unwrap(),
            )
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 400, "{bad:?}");
    }
    let ext = gateway::channel(picker.addrs.ext_proc.unwrap()).await;
    let answer = gateway::request(
        &ext,
        "/v1/completions",
        &[("x-tenant", "attacker-chosen"), ("x-tenant", "victim")],
        &serde_json::to_vec(&body).unwrap(),
    )
    .await;
    assert_eq!(answer.refused(), 400);
    assert_eq!(engine.state.requests.load(Ordering::SeqCst), 0);
    picker.shutdown().await;
}

/// Tenant a owns 127.0.0.1 and tenant b 127.0.0.2 (model `llama`); model `qwen` is on
/// 127.0.0.3, tenant b's too.
fn dedicated(llama_a: u16, llama_b: u16, qwen: u16) -> String {
    format!(
        r#"
modelConfigs:
  - {{name: llama, model: llama, port: 8000}}
  - {{name: qwen, model: qwen, port: 8000}}
endpoints:
  - {{address: 127.0.0.1, port: {llama_a}, modelConfig: llama, labels: {{tenant: a}}}}
  - {{address: 127.0.0.2, port: {llama_b}, modelConfig: llama, labels: {{tenant: b}}}}
  - {{address: 127.0.0.3, port: {qwen}, modelConfig: qwen, labels: {{tenant: b}}}}
routing: {{stalenessThreshold: 1m}}
{DEDICATED_TENANTS}"#
    )
}

#[tokio::test]
async fn ext_proc_applies_tenant_and_model_on_every_path() {
    let a = FakeEngine::start("127.0.0.1").await;
    let b = FakeEngine::start("127.0.0.2").await;
    let q = FakeEngine::start("127.0.0.3").await;
    let picker = start_picker(&dedicated(a.addr.port(), b.addr.port(), q.addr.port())).await;
    let ext = gateway::channel(picker.addrs.ext_proc.unwrap()).await;
    let llama = br#"{"model":"llama","input":"hi","messages":[{"role":"user","content":"hi"}],"max_tokens":4}"#;
    let qwen = br#"{"model":"qwen","input":"hi","messages":[{"role":"user","content":"hi"}],"max_tokens":4}"#;

    let paths = [
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/embeddings",
        "/v1/completions/",
        "/V1/completions",
        "/v1/completions/render",
    ];
    for path in paths {
        // the completions body needs a prompt; the others are read for `model` only
        let (llama_body, qwen_body): (&[u8], &[u8]) = if path == "/v1/completions" {
            (
                br#"{"model":"llama","prompt":"hi"}"#,
                br#"{"model":"qwen","prompt":"hi"}"#,
            )
        } else {
            (llama, qwen)
        };
        // tenant b's request for llama goes to b's dedicated endpoint, never a's
        let answer = gateway::request(&ext, path, &[("x-tenant", "b")], llama_body).await;
        assert_eq!(answer.destination(), b.addr.to_string(), "{path}");
        let answer = gateway::request(&ext, path, &[("x-tenant", "a")], llama_body).await;
        assert_eq!(answer.destination(), a.addr.to_string(), "{path}");
        // model qwen goes to the qwen engine, for the tenant allowed on it only
        let answer = gateway::request(&ext, path, &[("x-tenant", "b")], qwen_body).await;
        assert_eq!(answer.destination(), q.addr.to_string(), "{path}");
        let answer = gateway::request(&ext, path, &[("x-tenant", "a")], qwen_body).await;
        assert_eq!(answer.refused(), 503, "{path}: a has no qwen endpoint");
        // no tenant header: refused, not routed
        let answer = gateway::request(&ext, path, &[], llama_body).await;
        assert_eq!(answer.refused(), 400, "{path} without a tenant");
        // an unknown model and a body that is not JSON
        let nope = br#"{"model":"nope","prompt":"hi","input":"hi","messages":[{"role":"user","content":"hi"}]}"#;
        let answer = gateway::request(&ext, path, &[("x-tenant", "b")], nope).await;
        assert_eq!(answer.refused(), 404, "{path}: unknown model");
        let answer = gateway::request(&ext, path, &[("x-tenant", "b")], b"model=llama").await;
        assert_eq!(answer.refused(), 400, "{path}: not JSON");
    }

    // a bodyless request names no model: the tenant's own endpoints only
    for _ in 0..4 {
        let answer = gateway::request(&ext, "/v1/models", &[("x-tenant", "a")], b"").await;
        assert_eq!(answer.destination(), a.addr.to_string());
    }
    let answer = gateway::request(&ext, "/v1/models", &[], b"").await;
    assert_eq!(answer.refused(), 400, "no tenant");
    picker.shutdown().await;
}

#[tokio::test]
async fn ext_proc_salts_every_api_and_answers_with_one_endpoint() {
    let engine = FakeEngine::start("127.0.0.1").await;
    let secret = secret_file("salt-every-api");
    let picker = start_picker(&salted(engine.addr.port(), &secret)).await;
    let ext = gateway::channel(picker.addrs.ext_proc.unwrap()).await;

    // the tenant's salt, as the proxy injects it
    let resp = client()
        .post(format!("http://{}/v1/completions", picker.addrs.http))
        .header("x-tenant", "a")
        .json(&json!({"model": "llama", "prompt": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let salt = engine.state.last_body.lock().clone().unwrap()["cache_salt"].clone();

    for path in ["/v1/completions", "/v1/responses", "/v1/messages"] {
        let body = match path {
            "/v1/completions" => {
                json!({"model": "llama", "prompt": "hi", "cache_salt": "attacker-chosen"})
            }
            "/v1/messages" => json!({
                "model": "llama", "max_tokens": 4, "cache_salt": "attacker-chosen",
                "messages": [{"role": "user", "content": "hi"}]
            }),
            _ => json!({"model": "llama", "input": "hi", "cache_salt": "attacker-chosen"}),
        };
        let answer = gateway::request(
            &ext,
            path,
            &[("x-tenant", "a")],
            &serde_json::to_vec(&body).unwrap(),
        )
        .await;
        let Answer::Route {
            destination,
            metadata,
            new_body,
            ..
        } = answer
        else {
            panic!("{path}: {answer:?}");
        };
        assert_eq!(destination, engine.addr.to_string(), "exactly one endpoint");
        assert_eq!(metadata, engine.addr.to_string());
        let forwarded: Value =
            serde_json::from_slice(&new_body.expect("a rewritten body")).unwrap();
        assert_eq!(forwarded["cache_salt"], salt, "{path}");
    }
    picker.shutdown().await;
}

/// Hardening IV, 9: under `SaltedCache` a stored response is its tenant's: another tenant's
/// `GET`, cancel or `previous_response_id` naming it is answered as an unknown response (the
/// engine, which has no tenants, would have served it), while its own tenant still reaches it.
#[tokio::test]
async fn another_tenants_stored_response_does_not_exist() {
    let engine = FakeEngine::start("127.0.0.1").await;
    let secret = secret_file("responses");
    let picker = start_picker(&salted(engine.addr.port(), &secret)).await;
    let http = picker.addrs.http;
    let made = post_json(
        format!("http://{http}/v1/responses"),
        &[("x-tenant", "a")],
        &json!({"model": "llama", "input": "tenant a's question"}),
    )
    .await;
    let id = made["id"].as_str().unwrap().to_owned();
    let before = engine.state.requests.load(Ordering::SeqCst);
    for tenant in ["b", "a"] {
        let get = client()
            .get(format!("http://{http}/v1/responses/{id}"))
            .header("x-tenant", tenant)
            .send()
            .await
            .unwrap();
        let cancel = client()
            .post(format!("http://{http}/v1/responses/{id}/cancel"))
            .header("x-tenant", tenant)
            .send()
            .await
            .unwrap();
        let next = client()
            .post(format!("http://{http}/v1/responses"))
            .header("x-tenant", tenant)
            .json(&json!({"model": "llama", "input": "and then?", "previous_response_id": id}))
            .send()
            .await
            .unwrap();
        let statuses = [
            get.status().as_u16(),
            cancel.status().as_u16(),
            next.status().as_u16(),
        ];
        if tenant == "b" {
            assert_eq!(statuses, [404, 404, 404], "tenant b");
            assert_eq!(
                engine.state.requests.load(Ordering::SeqCst),
                before,
                "nothing of b's reached the engine"
            );
        } else {
            assert_ne!(statuses[0], 404, "tenant a reads its own");
            assert_eq!(statuses[2], 200, "and continues it");
        }
    }
    picker.shutdown().await;
}
