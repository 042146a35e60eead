//! Every inference path is routed by model on both listeners (the proxy and ext_proc), and an
//! OpenAI Responses conversation stays on the endpoint storing it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::BTreeMap;
use std::net::SocketAddr;

use kvroute_picker::service::http::FORWARDED_PATHS;
use kvroute_testkit::get_json;
use serde_json::{Value, json};
use support::gateway;
use support::*;

/// Two models, two engines each.
fn two_models(engines: &[FakeEngine]) -> String {
    let [a, b, c, d] = engines else {
        panic!("four engines")
    };
    format!(
        r#"
modelConfigs:
  - {{name: llama, model: llama}}
  - {{name: qwen, model: qwen}}
endpoints:
  - {{address: 127.0.0.1, port: {}, modelConfig: llama}}
  - {{address: 127.0.0.2, port: {}, modelConfig: llama}}
  - {{address: 127.0.0.3, port: {}, modelConfig: qwen}}
  - {{address: 127.0.0.4, port: {}, modelConfig: qwen}}
routing: {{stalenessThreshold: 1m}}
"#,
        a.addr.port(),
        b.addr.port(),
        c.addr.port(),
        d.addr.port()
    )
}

async fn four_engines() -> Vec<FakeEngine> {
    let mut engines = Vec::new();
    for ip in ["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"] {
        engines.push(FakeEngine::start(ip).await);
    }
    engines
}

/// A body every API reads what it needs from: completions its `prompt`, chat and Messages
/// their `messages`, Responses and embeddings their `input`, the rest their `model`.
fn body(model: &str, text: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "model": model,
        "prompt": text,
        "input": text,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 4,
        "tokens": [1, 2, 3],
    }))
    .unwrap()
}

/// How many requests each path brought to `engines`.
fn paths_seen(engines: &[&FakeEngine]) -> BTreeMap<String, usize> {
    let mut seen = BTreeMap::new();
    for e in engines {
        for p in e.state.paths.lock().iter() {
            *seen.entry(p.clone()).or_insert(0) += 1;
        }
    }
    seen
}

#[tokio::test]
async fn the_proxy_routes_every_path_by_model() {
    let engines = four_engines().await;
    let picker = start_picker(&two_models(&engines)).await;
    let http = picker.addrs.http;
    const EACH: usize = 3;
    for path in FORWARDED_PATHS {
        for model in ["llama", "qwen"] {
            for i in 0..EACH {
                let resp = client()
                    .post(format!("http://{http}{path}"))
                    .header("content-type", "application/json")
                    .body(body(model, &format!("request {i} for {model} on {path}")))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(
                    resp.status(),
                    200,
                    "{path} {model}: {}",
                    resp.text().await.unwrap()
                );
            }
        }
    }
    // every request reached an engine of its own model, under the path it was sent to
    let want: BTreeMap<String, usize> = FORWARDED_PATHS
        .iter()
        .map(|p| ((*p).to_owned(), EACH))
        .collect();
    assert_eq!(
        paths_seen(&[&engines[0], &engines[1]]),
        want,
        "llama's engines"
    );
    assert_eq!(
        paths_seen(&[&engines[2], &engines[3]]),
        want,
        "qwen's engines"
    );

    // the pool's models, and a documented answer for a path no engine API has
    let models = get_json(&client(), format!("http://{http}/v1/models")).await;
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, ["llama", "qwen"]);
    let resp = client()
        .post(format!("http://{http}/v1/images/generations"))
        .json(&json!({"model": "llama"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["code"], "not_found", "{err}");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("POST /v1/images/generations"),
        "{err}"
    );
    // a Messages request without `messages` is the client's error, named
    let resp = client()
        .post(format!("http://{http}/v1/messages"))
        .json(&json!({"model": "llama", "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let err: Value = resp.json().await.unwrap();
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("`messages`"),
        "{err}"
    );
    // in Anthropic's envelope, as the engine's own errors on that path are
    assert_eq!(err["type"], "error", "{err}");
    assert_eq!(err["error"]["type"], "invalid_request_error", "{err}");
    assert_eq!(
        err["error"].as_object().unwrap().len(),
        2,
        "type and message only: {err}"
    );
    picker.shutdown().await;
}

#[tokio::test]
async fn the_pickers_own_errors_take_the_envelope_of_the_requests_api() {
    let engines = four_engines().await;
    let picker = start_picker(&two_models(&engines)).await;
    let http = picker.addrs.http;
    let ask = |path: &'static str, body: Value| async move {
        let resp = client()
            .post(format!("http://{http}{path}"))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        (status, resp.json::<Value>().await.unwrap())
    };
    let unknown = json!({"model": "gpt-9", "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}], "prompt": "hi"});
    // Anthropic's on the Messages paths: its own type names, no OpenAI keys
    for path in ["/v1/messages", "/v1/messages/count_tokens"] {
        let (status, err) = ask(path, unknown.clone()).await;
        assert_eq!(status, 404, "{path}: {err}");
        assert_eq!(
            err,
            json!({"type": "error", "error": {"type": "not_found_error",
                "message": "the model `gpt-9` does not exist in this pool"}}),
            "{path}"
        );
    }
    // OpenAI's everywhere else, with the keys OpenAI and vLLM send
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let (status, err) = ask(path, unknown.clone()).await;
        assert_eq!(status, 404, "{path}: {err}");
        assert_eq!(
            err,
            json!({"error": {"message": "the model `gpt-9` does not exist in this pool",
                "type": "invalid_request_error", "param": null, "code": "model_not_found"}}),
            "{path}"
        );
    }
    // a body naming no model, in a pool of two: which ones there are, in the user's terms
    let (status, err) = ask(
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(status, 400, "{err}");
    assert_eq!(
        err["error"]["message"],
        "missing required field `model`: this pool serves `llama`, `qwen`"
    );
    // an answer relayed from an engine is left as the engine sent it
    let (status, answer) = ask(
        "/v1/messages",
        json!({"model": "llama", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert!(answer.get("error").is_none(), "{answer}");

    // ext_proc's immediate responses speak the same way
    let ext = gateway::channel(picker.addrs.ext_proc.unwrap()).await;
    let bytes = serde_json::to_vec(&unknown).unwrap();
    for (path, want_type) in [
        ("/v1/messages", "not_found_error"),
        ("/v1/chat/completions", "invalid_request_error"),
    ] {
        let d = gateway::exchange(&ext, path, &[], &bytes, None, None).await;
        let gateway::Answer::Immediate { status, body } = d else {
            panic!("{path}: routed")
        };
        assert_eq!(status, 404, "{path}");
        assert_eq!(body["error"]["type"], want_type, "{path}: {body}");
        assert_eq!(body.get("type").is_some(), path == "/v1/messages", "{body}");
    }
    picker.shutdown().await;
}

#[tokio::test]
async fn ext_proc_routes_every_path_by_model_with_and_without_a_subset() {
    let engines = four_engines().await;
    let picker = start_picker(&two_models(&engines)).await;
    let ext = gateway::channel(picker.addrs.ext_proc.unwrap()).await;
    let addr = |i: usize| engines[i].addr.to_string();
    let all: Vec<String> = (0..4).map(addr).collect();
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    // a subset naming one llama endpoint and both qwen ones
    let mixed = [all[1], all[2], all[3]];
    let paths = FORWARDED_PATHS
        .iter()
        .copied()
        .chain(["/v1/completions/", "/V1/chat"]);
    for path in paths {
        for i in 0..3 {
            let llama = body("llama", &format!("{i} {path}"));
            let qwen = body("qwen", &format!("{i} {path}"));
            for subset in [None, Some(&all[..])] {
                let d = gateway::exchange(&ext, path, &[], &llama, subset, None).await;
                assert!(
                    [addr(0), addr(1)].contains(&d.destination().to_owned()),
                    "{path} llama ({subset:?}) went to {}",
                    d.destination()
                );
                let d = gateway::exchange(&ext, path, &[], &qwen, subset, None).await;
                assert!(
                    [addr(2), addr(3)].contains(&d.destination().to_owned()),
                    "{path} qwen ({subset:?}) went to {}",
                    d.destination()
                );
            }
            let d = gateway::exchange(&ext, path, &[], &llama, Some(&mixed), None).await;
            assert_eq!(
                d.destination(),
                addr(1),
                "{path}: the subset's only llama endpoint"
            );
            // the decision is published beside the destination
            if let gateway::Answer::Route { decision, .. } = &d {
                assert_eq!(
                    decision.get("endpoint").map(String::as_str),
                    Some(addr(1).as_str())
                );
                assert_eq!(
                    decision.get("model_config").map(String::as_str),
                    Some("llama")
                );
                assert!(
                    decision.contains_key("policy") && decision.contains_key("score"),
                    "{decision:?}"
                );
            }
            // a subset without any of the model's endpoints: none is eligible
            let d = gateway::exchange(&ext, path, &[], &llama, Some(&all[2..]), None).await;
            assert_eq!(d.refused(), 503, "{path}");
        }
    }
    picker.shutdown().await;
}

/// The engine a Responses id names (`resp_<port>_<n>` from the fake engine).
fn holder(engines: &[FakeEngine], id: &str) -> SocketAddr {
    let port: u16 = id.split('_').nth(1).unwrap().parse().unwrap();
    engines
        .iter()
        .map(|e| e.addr)
        .find(|a| a.port() == port)
        .unwrap()
}

async fn respond(http: SocketAddr, body: Value) -> String {
    let stream = body["stream"].as_bool() == Some(true);
    let resp = client()
        .post(format!("http://{http}/v1/responses"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let text = resp.text().await.unwrap();
    let json = if stream {
        let data = text
            .lines()
            .find_map(|l| l.strip_prefix("data: "))
            .unwrap()
            .to_owned();
        serde_json::from_str::<Value>(&data).unwrap()["response"].clone()
    } else {
        serde_json::from_str::<Value>(&text).unwrap()
    };
    json["id"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn a_responses_conversation_stays_on_the_endpoint_storing_it() {
    let engines = four_engines().await;
    let yaml = format!(
        r#"
modelConfigs:
  - {{name: llama, model: llama}}
endpoints:
{}
routing: {{stalenessThreshold: 1m}}
"#,
        engines
            .iter()
            .map(|e| format!(
                "  - {{address: {}, port: {}, modelConfig: llama}}",
                e.addr.ip(),
                e.addr.port()
            ))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let picker = start_picker(&yaml).await;
    let http = picker.addrs.http;
    for stream in [false, true] {
        let first = respond(
            http,
            json!({"model": "llama", "input": format!("first question, stream {stream}"), "stream": stream}),
        )
        .await;
        let home = holder(&engines, &first);
        let mut previous = first.clone();
        for turn in 0..6 {
            // other conversations in between spread over the pool
            for other in 0..4 {
                respond(
                    http,
                    json!({"model": "llama", "input": format!("another conversation {turn} {other} {stream}")}),
                )
                .await;
            }
            let next = respond(
                http,
                json!({"model": "llama", "previous_response_id": previous, "input": format!("turn {turn}"), "stream": stream}),
            )
            .await;
            assert_eq!(
                holder(&engines, &next),
                home,
                "turn {turn} (stream {stream})"
            );
            previous = next;
        }
        // the stored response is fetched from the engine holding it
        let got = get_json(&client(), format!("http://{http}/v1/responses/{first}")).await;
        assert_eq!(got["id"], first.as_str());
    }
    let others: std::collections::BTreeSet<SocketAddr> = engines
        .iter()
        .filter(|e| !e.state.responses.lock().is_empty())
        .map(|e| e.addr)
        .collect();
    assert!(others.len() > 1, "new conversations spread: {others:?}");
    picker.shutdown().await;
}

#[tokio::test]
async fn ext_proc_learns_response_ids_from_the_response_body() {
    let engines = four_engines().await;
    let picker = start_picker(&two_models(&engines)).await;
    let ext = gateway::channel(picker.addrs.ext_proc.unwrap()).await;
    let first = br#"{"model":"llama","input":"hello there"}"#;
    let answer = gateway::exchange(
        &ext,
        "/v1/responses",
        &[],
        first,
        None,
        Some((200, br#"{"id":"resp_gw_0","object":"response"}"#)),
    )
    .await;
    let home = answer.destination().to_owned();
    let mut previous = "resp_gw_0".to_owned();
    for turn in 1..6 {
        let id = format!("resp_gw_{turn}");
        let streamed = format!(
            "event: response.created\ndata: {{\"response\":{{\"id\":\"{id}\"}},\"type\":\"response.created\"}}\n\n"
        );
        let body = json!({"model": "llama", "previous_response_id": previous, "input": format!("turn {turn}"), "stream": true});
        let answer = gateway::exchange(
            &ext,
            "/v1/responses",
            &[],
            &serde_json::to_vec(&body).unwrap(),
            None,
            Some((200, streamed.as_bytes())),
        )
        .await;
        assert_eq!(answer.destination(), home, "turn {turn}");
        previous = id;
    }
    // bodyless: the stored response and its cancel go to the holder
    for path in ["/v1/responses/resp_gw_0", "/v1/responses/resp_gw_3/cancel"] {
        let answer = gateway::request(&ext, path, &[], b"").await;
        assert_eq!(answer.destination(), home, "{path}");
    }
    picker.shutdown().await;
}

#[tokio::test]
async fn a_rewrite_rule_splits_a_model_by_weight_and_answers_in_its_name() {
    let engines = four_engines().await;
    let yaml = two_models(&engines).replace(
        "routing: {stalenessThreshold: 1m}",
        "routing:\n  stalenessThreshold: 1m\n  modelRewrites:\n    - {model: chat, targets: [{model: llama, weight: 90}, {model: qwen, weight: 10}]}",
    );
    let picker = start_picker(&yaml).await;
    let http = picker.addrs.http;
    let chat =
        |text: String| json!({"model": "chat", "messages": [{"role": "user", "content": text}]});

    // 200 requests without a session: split about 9:1, each answered as `chat`
    const N: usize = 200;
    for i in 0..N {
        let v = post_json(
            format!("http://{http}/v1/chat/completions"),
            &[],
            &chat(format!("question number {i}")),
        )
        .await;
        assert_eq!(v["model"], "chat", "{v}");
    }
    let count = |e: &[&FakeEngine]| paths_seen(e).values().sum::<usize>();
    let (to_llama, to_qwen) = (
        count(&[&engines[0], &engines[1]]),
        count(&[&engines[2], &engines[3]]),
    );
    assert_eq!(to_llama + to_qwen, N);
    assert!(
        (N / 20..=N / 5).contains(&to_qwen),
        "a 10% canary got {to_qwen} of {N}"
    );
    // the engine was sent the target's name
    let sent = engines[2].state.last_body.lock().clone().unwrap();
    assert_eq!(sent["model"], "qwen", "{sent}");

    // a session keeps its target, turn after turn
    for s in 0..20 {
        let before = count(&[&engines[2], &engines[3]]);
        let mut to_qwen = 0;
        for turn in 0..3 {
            client()
                .post(format!("http://{http}/v1/chat/completions"))
                .header("x-session-id", format!("session-{s}"))
                .json(&chat(format!("session {s} turn {turn}")))
                .send()
                .await
                .unwrap();
            to_qwen = count(&[&engines[2], &engines[3]]) - before;
        }
        assert!(
            to_qwen == 0 || to_qwen == 3,
            "session {s}: {to_qwen} of 3 turns to qwen"
        );
    }

    // a streamed Responses answer is written back too, across its events
    let text = kvroute_testkit::post_text(
        &client(),
        format!("http://{http}/v1/responses"),
        &json!({"model": "chat", "input": "hi", "stream": true}),
    )
    .await;
    assert!(text.contains(r#""model":"chat""#), "{text}");
    assert!(!text.contains(r#""model":"llama""#) && !text.contains(r#""model":"qwen""#));

    let page = metrics_text(picker.addrs.metrics).await;
    assert!(
        page.lines().any(|l| l.starts_with(
            r#"kvroute_picker_model_rewrites_total{from="chat",to="qwen"}"#
        )),
        "{page}"
    );

    // through ext_proc the engine is sent the target's name as well
    let ext = gateway::channel(picker.addrs.ext_proc.unwrap()).await;
    let answer = gateway::request(
        &ext,
        "/v1/chat/completions",
        &[],
        &serde_json::to_vec(&chat("via the gateway".into())).unwrap(),
    )
    .await;
    let gateway::Answer::Route {
        destination,
        new_body,
        ..
    } = answer
    else {
        panic!("{answer:?}");
    };
    let body: Value = serde_json::from_slice(&new_body.expect("a rewritten body")).unwrap();
    let llama = [engines[0].addr.to_string(), engines[1].addr.to_string()];
    assert_eq!(
        body["model"],
        if llama.contains(&destination) {
            "llama"
        } else {
            "qwen"
        }
    );
    picker.shutdown().await;
}
