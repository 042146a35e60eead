//! Black-box tests of the picker service against fake engines on loopback.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kvroute_picker::endpoint::EndpointState;
use kvroute_picker::service::settings::PickerConfig;
use serde_json::{Value, json};
use support::*;
use tokio_util::sync::CancellationToken;

fn one_engine_yaml(port: u16, extra: &str) -> String {
    one_engine_yaml_with(port, "", extra)
}

/// `model_extra`: more lines of the model config (indented four spaces).
fn one_engine_yaml_with(port: u16, model_extra: &str, extra: &str) -> String {
    one_engine_scraped(port, model_extra, extra)
}

async fn post(url: String, body: Value) -> reqwest::Response {
    client().post(url).json(&body).send().await.unwrap()
}

async fn error_of(resp: reqwest::Response) -> (u16, Value) {
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap())
}

#[tokio::test]
async fn streams_pass_through_byte_for_byte() {
    let engine = FakeEngine::start("127.0.0.1").await;
    let picker = start_picker(&one_engine_yaml(engine.addr.port(), "")).await;
    let resp = post(
        format!("http://{}/v1/completions", picker.addrs.http),
        json!({"model": "llama", "prompt": "hello world", "stream": true}),
    )
    .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    // chunks arrive as the engine sends them (not buffered to the end)
    let mut stream = resp.bytes_stream();
    let mut got = Vec::new();
    let mut pieces = 0;
    use futures::StreamExt;
    while let Some(c) = stream.next().await {
        got.extend_from_slice(&c.unwrap());
        pieces += 1;
    }
    assert_eq!(String::from_utf8(got).unwrap(), sse_chunks().concat());
    assert!(pieces >= 3, "streamed in {pieces} pieces");
    // in-flight accounting went back to zero after completion
    let state = picker.state.clone();
    eventually(Duration::from_secs(2), || {
        state
            .pool
            .state()
            .endpoints()
            .endpoints()
            .iter()
            .all(|e| state.pool.inflight().get(&e.id).requests == 0)
    })
    .await;
    picker.shutdown().await;
}

#[tokio::test]
async fn rank_goes_in_the_header_for_vllm_and_the_body_for_sglang() {
    let engine = FakeEngine::start("127.0.0.1").await;
    for (engine_kind, header) in [("vllm", true), ("sglang", false)] {
        let yaml = format!(
            r#"
modelConfigs:
  - name: llama
    model: llama
    engine: {engine_kind}
    port: {}
    dataParallel: {{size: 2, rankSelection: Header}}
endpoints:
  - {{address: 127.0.0.1, modelConfig: llama}}
"#,
            engine.addr.port()
        );
        let picker = start_picker(&yaml).await;
        let resp = post(
            format!("http://{}/v1/completions", picker.addrs.http),
            json!({"model": "llama", "prompt": "abc"}),
        )
        .await;
        assert_eq!(resp.status(), 200);
        let headers = engine.state.last_headers.lock().clone().unwrap();
        let body = engine.state.last_body.lock().clone().unwrap();
        if header {
            let rank: u32 = headers["x-data-parallel-rank"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
            assert!(rank < 2);
            assert!(body.get("data_parallel_rank").is_none());
        } else {
            assert!(headers.get("x-data-parallel-rank").is_none());
            assert!(body["data_parallel_rank"].as_u64().unwrap() < 2);
        }
        assert_eq!(body["prompt"], "abc", "the rest of the body is untouched");
        picker.shutdown().await;
    }
}

/// Round robin between a working engine and `bad_port`: every one of 6 requests succeeds,
/// those that met `bad_port` through a retry on the next fallback.
async fn round_robin_survives_a_failing_endpoint(bad_port: u16) {
    let engine = FakeEngine::start("127.0.0.1").await;
    let yaml = format!(
        r#"
modelConfigs:
  - name: llama
    model: llama
    port: {}
endpoints:
  - {{address: 127.0.0.1, modelConfig: llama}}
  - {{address: 127.0.0.1, modelConfig: llama, port: {bad_port}}}
routing: {{strategy: RoundRobin, stalenessThreshold: 1m}}
"#,
        engine.addr.port()
    );
    let picker = start_picker(&yaml).await;
    for i in 0..6 {
        let resp = post(
            format!("http://{}/v1/completions", picker.addrs.http),
            json!({"model": "llama", "prompt": format!("request {i}")}),
        )
        .await;
        assert_eq!(resp.status(), 200, "request {i}");
    }
    assert_eq!(engine.state.requests.load(Ordering::SeqCst), 6);
    assert!(
        picker.state.metrics.retries.get() >= 2,
        "round robin hit the failing endpoint"
    );
    picker.shutdown().await;
}

#[tokio::test]
async fn a_refused_connection_is_retried_on_the_next_fallback() {
    round_robin_survives_a_failing_endpoint(refused_port().await).await;
}

/// A session whose request was retried on the next fallback is pinned to the endpoint that
/// served it, not to the one chosen first (issue 31): its next request goes straight there.
#[tokio::test]
async fn a_session_is_pinned_where_the_retry_served_it() {
    let engine = FakeEngine::start("127.0.0.1").await;
    let dead = refused_port().await;
    let picker = start_picker(&format!(
        r#"
modelConfigs:
  - {{name: llama, model: llama, port: {}}}
endpoints:
  - {{address: 127.0.0.1, modelConfig: llama}}
  - {{address: 127.0.0.1, modelConfig: llama, port: {dead}}}
routing: {{strategy: RoundRobin, stalenessThreshold: 1m}}
"#,
        engine.addr.port()
    ))
    .await;
    let url = format!("http://{}/v1/completions", picker.addrs.http);
    let send = |session: String, i: usize| {
        let url = url.clone();
        async move {
            client()
                .post(url)
                .header("x-session-id", session)
                .json(&json!({"model": "llama", "prompt": format!("turn {i}")}))
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    // sessions until one is first sent to the dead endpoint and retried
    let retries = || picker.state.metrics.retries.get();
    let mut retried = None;
    for s in 0..4 {
        let before = retries();
        assert_eq!(send(format!("s-{s}"), 0).await, 200);
        if retries() > before {
            retried = Some(format!("s-{s}"));
            break;
        }
    }
    let session = retried.expect("round robin reached the dead endpoint");
    // its next turns go where it was served: no more retries
    let before = retries();
    for turn in 1..3 {
        assert_eq!(send(session.clone(), turn).await, 200);
    }
    assert_eq!(
        retries(),
        before,
        "the pin is the endpoint that served the session"
    );
    picker.shutdown().await;
}

/// An endpoint that accepts the connection, reads the request and closes without a byte of
/// response (an engine crashing while the request is queued) costs a retry, not an error.
#[tokio::test]
async fn a_connection_closed_before_the_response_is_retried_on_the_next_fallback() {
    let closer = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let closer_port = closer.local_addr().unwrap().port();
    let closes = Arc::new(AtomicUsize::new(0));
    let counted = closes.clone();
    let closer_task = tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = closer.accept().await else {
                return;
            };
            let counted = counted.clone();
            tokio::spawn(async move {
                let mut buf = vec![0_u8; 64 * 1024];
                if let Ok(n) = tokio::io::AsyncReadExt::read(&mut conn, &mut buf).await
                    && buf[..n].starts_with(b"POST")
                {
                    counted.fetch_add(1, Ordering::SeqCst);
                }
                // dropped: closed with no response
            });
        }
    });
    round_robin_survives_a_failing_endpoint(closer_port).await;
    assert!(
        closes.load(Ordering::SeqCst) >= 2,
        "round robin sent requests to the closing endpoint"
    );
    closer_task.abort();
}

/// What does not need a socket (bad JSON, missing fields, unknown models, body limits,
/// unknown paths) is `http::tests::the_listeners_answer_bad_requests_with_openai_errors_without_a_socket`;
/// an engine that hangs past `upstreamTimeout` needs one.
#[tokio::test]
async fn an_engine_that_hangs_is_an_openai_504() {
    let engine = FakeEngine::start("127.0.0.1").await;
    let picker = start_picker(&one_engine_yaml(
        engine.addr.port(),
        "limits: {upstreamTimeout: 300ms}",
    ))
    .await;
    let url = format!("http://{}/v1/completions", picker.addrs.http);
    engine.state.hang.store(true, Ordering::SeqCst);
    let (s, e) = error_of(post(url.clone(), json!({"model": "llama", "prompt": "x"})).await).await;
    assert_eq!(
        (s, e["error"]["code"].as_str()),
        (504, Some("upstream_timeout"))
    );
    assert!(e["error"]["message"].is_string() && e["error"]["type"].is_string());
    engine.state.hang.store(false, Ordering::SeqCst);
    picker.shutdown().await;
}

#[tokio::test]
async fn no_endpoint_is_503_with_retry_after_and_dead_upstreams_are_502() {
    let dead = refused_port().await;
    let yaml = format!(
        r#"
modelConfigs:
  - name: llama
    model: llama
    port: {dead}
  - name: other
    model: other
endpoints:
  - {{address: 127.0.0.1, modelConfig: llama}}
routing: {{stalenessThreshold: 1m}}
"#
    );
    let picker = start_picker(&yaml).await;
    let url = format!("http://{}/v1/completions", picker.addrs.http);
    let resp = post(url.clone(), json!({"model": "other", "prompt": "x"})).await;
    assert_eq!(resp.headers()["retry-after"], "1");
    let (s, e) = error_of(resp).await;
    assert_eq!(
        (s, e["error"]["code"].as_str()),
        (503, Some("no_eligible_endpoint"))
    );
    let (s, e) = error_of(post(url, json!({"model": "llama", "prompt": "x"})).await).await;
    assert_eq!(
        (s, e["error"]["code"].as_str()),
        (502, Some("upstream_failed"))
    );
    picker.shutdown().await;
}

#[tokio::test]
async fn requests_over_the_inflight_bound_are_shed_with_429() {
    let engine = FakeEngine::start("127.0.0.1").await;
    engine.state.hang.store(true, Ordering::SeqCst);
    let picker = start_picker(&one_engine_yaml(
        engine.addr.port(),
        "limits: {maxInflightTotal: 1, upstreamTimeout: 5s}",
    ))
    .await;
    let url = format!("http://{}/v1/completions", picker.addrs.http);
    let first = tokio::spawn(post(url.clone(), json!({"model": "llama", "prompt": "a"})));
    let state = picker.state.clone();
    eventually(Duration::from_secs(2), || {
        state
            .pool
            .state()
            .endpoints()
            .endpoints()
            .iter()
            .any(|e| state.pool.inflight().get(&e.id).requests == 1)
    })
    .await;
    let resp = post(url, json!({"model": "llama", "prompt": "b"})).await;
    assert_eq!(resp.headers()["retry-after"], "1");
    let (s, e) = error_of(resp).await;
    assert_eq!((s, e["error"]["code"].as_str()), (429, Some("overloaded")));
    first.abort();
    picker.shutdown().await;
}

#[tokio::test]
async fn pick_api_explains_and_a_live_reload_changes_the_decision() {
    let a = FakeEngine::start("127.0.0.1").await;
    let b = FakeEngine::start("127.0.0.2").await;
    let dir = std::env::temp_dir().join(format!("kvroute-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("picker.yaml");
    let write = |strategy: &str| {
        let yaml = loopback_listen(&format!(
            r#"
modelConfigs:
  - name: llama
    model: llama
    port: {}
endpoints:
  - {{address: 127.0.0.1, modelConfig: llama}}
  - {{address: 127.0.0.2, modelConfig: llama, port: {}}}
routing: {{strategy: {strategy}}}
scrape: {{interval: 50ms}}
"#,
            a.addr.port(),
            b.addr.port()
        ));
        write_atomically(&path, &yaml);
    };
    write("CostModel");
    let picker = start_picker_file(path.clone()).await;
    let state = picker.state.clone();
    eventually(Duration::from_secs(3), || {
        state.pool.state().endpoints().len() == 2
    })
    .await;
    let pick_url = format!("http://{}/v1/pick", picker.addrs.admin);
    let pick = |body: Value| {
        let url = pick_url.clone();
        async move { post(url, body).await.json::<Value>().await.unwrap() }
    };
    let p = pick(json!({"model": "llama", "prompt": "the same prompt"})).await;
    assert_eq!(p["policy"], "cost-model");
    assert_eq!(p["candidates"].as_array().unwrap().len(), 2);
    assert!(p["candidates"][0]["features"]["uncached_tokens"].is_number());
    assert_eq!(p["fallbacks"].as_array().unwrap().len(), 1);

    // round robin after the reload: an explanation shows the next turn without taking it
    // (issue 31), a forwarded request takes it
    write("RoundRobin");
    eventually(Duration::from_secs(5), || {
        state.router().policy_name() == "round-robin"
    })
    .await;
    let x = pick(json!({"model": "llama", "prompt": "the same prompt"})).await;
    let again = pick(json!({"model": "llama", "prompt": "the same prompt"})).await;
    assert_eq!(x["policy"], "round-robin");
    assert_eq!(x["endpoint"], again["endpoint"], "explaining takes no turn");
    let served = post(
        format!("http://{}/v1/completions", picker.addrs.http),
        json!({"model": "llama", "prompt": "the same prompt"}),
    )
    .await;
    assert_eq!(served.status(), 200);
    let y = pick(json!({"model": "llama", "prompt": "the same prompt"})).await;
    assert_ne!(
        x["endpoint"], y["endpoint"],
        "the forwarded request took the turn"
    );

    // a broken edit is rejected and the running config stays
    std::fs::write(&path, "modelConfigs: [").unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(state.router().policy_name(), "round-robin");
    assert_eq!(state.pool.state().endpoints().len(), 2);
    picker.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_stale_endpoint_is_excluded_then_recovers() {
    let a = FakeEngine::start("127.0.0.1").await;
    let b = FakeEngine::start("127.0.0.2").await;
    let yaml = format!(
        r#"
modelConfigs:
  - name: llama
    model: llama
    port: {}
endpoints:
  - {{address: 127.0.0.1, modelConfig: llama}}
  - {{address: 127.0.0.2, modelConfig: llama, port: {}}}
routing: {{strategy: RoundRobin, stalenessThreshold: 300ms}}
scrape: {{interval: 50ms, timeout: 100ms}}
"#,
        a.addr.port(),
        b.addr.port()
    );
    let picker = start_picker(&yaml).await;
    let state = picker.state.clone();
    eventually(Duration::from_secs(3), || state.is_ready()).await;
    // blocks the picker believes `a` holds (as if routed there)
    let slot_a = {
        let id = state
            .pool
            .state()
            .endpoints()
            .endpoints()
            .iter()
            .find(|e| e.id.address == a.addr.ip())
            .expect("endpoint a is known")
            .id;
        state
            .pool
            .state()
            .record_routed(&id, &[11, 12, 13], state.now_ms());
        let pool = state.pool.state().read();
        let slot = pool.index().slot(&id).expect("endpoint a is indexed");
        assert_eq!(pool.index().endpoint_blocks(slot), 3);
        slot
    };
    a.state.metrics_broken.store(true, Ordering::SeqCst);
    eventually(Duration::from_secs(3), || {
        state
            .pool
            .state()
            .endpoints()
            .endpoints()
            .iter()
            .any(|e| e.state == EndpointState::Stale)
    })
    .await;
    // it may have restarted empty: nothing it held before is credited any more
    eventually(Duration::from_secs(3), || {
        state.pool.state().read().index().endpoint_blocks(slot_a) == 0
    })
    .await;
    let before = a.state.requests.load(Ordering::SeqCst);
    for i in 0..4 {
        let r = post(
            format!("http://{}/v1/completions", picker.addrs.http),
            json!({"model": "llama", "prompt": format!("p{i}")}),
        )
        .await;
        assert_eq!(r.status(), 200);
    }
    assert_eq!(
        a.state.requests.load(Ordering::SeqCst),
        before,
        "stale endpoint got traffic"
    );
    a.state.metrics_broken.store(false, Ordering::SeqCst);
    eventually(Duration::from_secs(3), || {
        state
            .pool
            .state()
            .endpoints()
            .endpoints()
            .iter()
            .all(|e| e.state == EndpointState::Ready)
    })
    .await;
    for i in 0..4 {
        post(
            format!("http://{}/v1/completions", picker.addrs.http),
            json!({"model": "llama", "prompt": format!("q{i}")}),
        )
        .await;
    }
    assert!(
        a.state.requests.load(Ordering::SeqCst) > before,
        "recovered endpoint gets traffic again"
    );
    picker.shutdown().await;
}

#[tokio::test]
async fn models_health_and_metrics() {
    let engine = FakeEngine::start("127.0.0.1").await;
    let picker = start_picker(&one_engine_yaml(engine.addr.port(), "")).await;
    let c = client();
    let models: Value =
        kvroute_testkit::get_json(&c, format!("http://{}/v1/models", picker.addrs.http)).await;
    assert_eq!(models["data"][0]["id"], "llama");
    // a body naming no model is for the pool's one model, as a vLLM server serves its one
    let r = c
        .post(format!("http://{}/v1/completions", picker.addrs.http))
        .json(&json!({"prompt": "no model named"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let state = picker.state.clone();
    eventually(Duration::from_secs(3), || state.is_ready()).await;
    let r = c
        .get(format!("http://{}/readyz", picker.addrs.metrics))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    post(
        format!("http://{}/v1/completions", picker.addrs.http),
        json!({"model": "llama", "prompt": "count me"}),
    )
    .await;
    let text =
        kvroute_testkit::get_text(&c, format!("http://{}/metrics", picker.addrs.metrics)).await;
    assert!(text.contains("kvroute_picker_decisions_total{"), "{text}");
    assert!(
        text.contains("kvroute_picker_decision_seconds_bucket"),
        "{text}"
    );
    // every member has a working-set gauge (nothing is pinned: no session header), and the
    // reuse horizon starts at its default minute
    assert!(
        text.lines()
            .any(|l| l.starts_with("kvroute_picker_working_set_tokens{") && l.ends_with(" 0")),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l == "kvroute_picker_session_reuse_horizon_seconds 60.0"),
        "{text}"
    );
    // pool saturation: max(0 waiting / 5, 0.1 KV usage / 0.8); with 10 waiting, 2
    let saturation = |want: &'static str| {
        let line = format!("kvroute_picker_pool_saturation{{model_config=\"llama\"}} {want}");
        until_metric(picker.addrs.metrics, move |l| l == line)
    };
    saturation("0.125").await;
    engine.state.waiting.store(10, Ordering::SeqCst);
    saturation("2.0").await;
    let dbg: Value =
        kvroute_testkit::get_json(&c, format!("http://{}/debug/endpoints", picker.addrs.admin))
            .await;
    assert_eq!(dbg["endpoints"][0]["state"], "ready");
    assert!(dbg["endpoints"][0]["cached_blocks"].as_u64().is_some());
    picker.shutdown().await;
}

#[tokio::test]
async fn shutdown_drains_an_in_flight_stream() {
    let engine = FakeEngine::start("127.0.0.1").await;
    let picker = start_picker(&one_engine_yaml(engine.addr.port(), "")).await;
    let resp = post(
        format!("http://{}/v1/completions", picker.addrs.http),
        json!({"model": "llama", "prompt": "drain me", "stream": true}),
    )
    .await;
    assert_eq!(resp.status(), 200);
    // shutdown starts while the engine is still streaming (5 chunks, 20 ms apart)
    let stopping = tokio::spawn(picker.shutdown());
    let body = resp.bytes().await.unwrap();
    assert_eq!(
        String::from_utf8(body.to_vec()).unwrap(),
        sse_chunks().concat()
    );
    tokio::time::timeout(Duration::from_secs(10), stopping)
        .await
        .expect("shutdown finished")
        .unwrap();
}

/// A conversation's earlier messages are not encoded again: the second turn's ids for them
/// come from the tokenizer's piece cache, and the prompt is still the tokenizer's exact ids.
/// (On a multi-threaded runtime, as in the binary: bodies this large are tokenized in
/// `block_in_place`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversations_repeated_messages_come_from_the_tokenizer_cache() {
    let engine = FakeEngine::start("127.0.0.1").await;
    let tok = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../routing/tests/fixtures/tokenizer"
    );
    let model = format!(
        "    tokenizer: {{path: {tok}/tokenizer.json, configPath: {tok}/tokenizer_config.json}}\n"
    );
    let yaml = |cache: usize| {
        let limits = format!("limits: {{tokenizerCacheTokens: {cache}}}\n");
        one_engine_yaml_with(engine.addr.port(), &model, &limits)
    };
    let system = "You are a careful assistant for routing questions. ".repeat(800);
    let turn1 = json!([{"role": "system", "content": system}, {"role": "user", "content": "hi"}]);
    let mut turn2 = turn1.clone();
    let more = json!([{"role": "assistant", "content": "hello ".repeat(80)},
                      {"role": "user", "content": "and now?"}]);
    turn2
        .as_array_mut()
        .unwrap()
        .extend(more.as_array().unwrap().iter().cloned());

    let cached_total = |text: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix("kvroute_picker_tokenizer_cached_tokens_total "))
            .map_or(0.0, |v| v.trim().parse().unwrap())
    };
    let mut prompt_tokens = Vec::new();
    for cache in [1 << 20, 0] {
        let picker = start_picker(&yaml(cache)).await;
        let pick = format!("http://{}/v1/pick", picker.addrs.admin);
        let mut tokens = Vec::new();
        for messages in [&turn1, &turn2] {
            let p: Value = post(
                pick.clone(),
                json!({"model": "llama", "messages": messages}),
            )
            .await
            .json()
            .await
            .unwrap();
            tokens.push(p["prompt_tokens"].as_u64().unwrap_or_else(|| panic!("{p}")));
        }
        let cached = cached_total(&metrics_text(picker.addrs.metrics).await);
        if cache > 0 {
            // the system prompt (over 40 KB) was encoded once and reused
            assert!(cached > 8000.0, "cached {cached}");
        } else {
            assert_eq!(cached, 0.0);
        }
        prompt_tokens.push(tokens);
        picker.shutdown().await;
    }
    // With and without the cache the prompts have the same number of tokens.
    assert_eq!(prompt_tokens[0], prompt_tokens[1]);
    assert!(prompt_tokens[0][1] > prompt_tokens[0][0]);
}

/// `start` returns once the first pool view is applied: a request sent right away finds its
/// model. (On a multi-threaded runtime it used to race the view, which takes a few
/// milliseconds with a tokenizer to load, and get a 404.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_request_after_start_finds_its_model() {
    let engine = FakeEngine::start("127.0.0.1").await;
    let tok = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../routing/tests/fixtures/tokenizer"
    );
    let model = format!("    tokenizer: {{path: {tok}/tokenizer.json}}\n");
    for _ in 0..5 {
        let picker = start_picker(&one_engine_yaml_with(engine.addr.port(), &model, "")).await;
        let r = post(
            format!("http://{}/v1/pick", picker.addrs.admin),
            json!({"model": "llama", "prompt": "right away"}),
        )
        .await;
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
        picker.shutdown().await;
    }
}

/// A source that never publishes a view (an API server unreachable at start).
struct SilentSource;

impl kvroute_picker::service::source::EndpointSource for SilentSource {
    fn name(&self) -> &'static str {
        "silent"
    }

    fn run(
        self: Box<Self>,
        tx: tokio::sync::watch::Sender<Option<kvroute_picker::service::declared::DeclaredPool>>,
        cancel: CancellationToken,
    ) -> futures::future::BoxFuture<'static, ()> {
        Box::pin(async move {
            let _open = tx; // connected, but nothing ever arrives
            cancel.cancelled().await
        })
    }
}

/// Without any pool view, `start` gives up waiting after its bound (5 s) and serves: a request is
/// refused with 503 `not_ready` and `retry-after` (the model may exist once the pool loads),
/// not with 404.
#[tokio::test]
async fn before_any_pool_view_requests_get_503_not_ready() {
    let config = PickerConfig::from_yaml(&loopback_listen(&one_engine_yaml(1, ""))).unwrap();
    let picker =
        kvroute_picker::service::start(config, Box::new(SilentSource), CancellationToken::new())
            .await
            .expect("picker starts");
    for url in [
        format!("http://{}/v1/completions", picker.addrs.http),
        format!("http://{}/v1/pick", picker.addrs.admin),
    ] {
        let r = post(url, json!({"model": "llama", "prompt": "early"})).await;
        assert_eq!(r.headers()["retry-after"], "1");
        let (status, body) = error_of(r).await;
        assert_eq!(status, 503, "{body}");
        assert_eq!(body["error"]["code"], "not_ready", "{body}");
    }
    picker.shutdown().await;
}

/// Hardening IV, 8 and 13: the prefill/decode header naming where a prompt's KV is, and an
/// `Expect: 100-continue` the picker answered itself, stay with the picker.
#[tokio::test]
async fn the_pickers_own_headers_are_not_forwarded() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let engine = FakeEngine::start("127.0.0.1").await;
    let picker = start_picker(&one_engine_pool(engine.addr.port(), "")).await;
    let body = r#"{"model":"llama","prompt":"abc"}"#;
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: picker\r\nContent-Type: application/json\r\n\
         Expect: 100-continue\r\nX-Prefiller-Host-Port: 10.9.9.9:8000\r\nX-Kept: k\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    let mut conn = tokio::net::TcpStream::connect(picker.addrs.http)
        .await
        .unwrap();
    conn.write_all(head.as_bytes()).await.unwrap();
    let mut interim = [0u8; 25];
    conn.read_exact(&mut interim).await.unwrap();
    assert_eq!(&interim, b"HTTP/1.1 100 Continue\r\n\r\n");
    conn.write_all(body.as_bytes()).await.unwrap();
    let mut answer = [0u8; 12];
    conn.read_exact(&mut answer).await.unwrap();
    assert_eq!(&answer, b"HTTP/1.1 200");
    let headers = engine.state.last_headers.lock().clone().unwrap();
    assert_eq!(headers["x-kept"], "k");
    for gone in ["expect", "x-prefiller-host-port"] {
        assert!(
            headers.get(gone).is_none(),
            "{gone} was forwarded: {headers:?}"
        );
    }
    picker.shutdown().await;
}

/// Headers a client names in `Connection` are hop-by-hop (RFC 9110 §7.6.1) and stay with the
/// picker, as does `HTTP2-Settings`; the others reach the engine (finding 6 of issue 35).
#[tokio::test]
async fn headers_named_in_connection_are_not_forwarded() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let engine = FakeEngine::start("127.0.0.1").await;
    let picker = start_picker(&one_engine_pool(engine.addr.port(), "")).await;
    let body = r#"{"model":"llama","prompt":"abc"}"#;
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: picker\r\nContent-Type: application/json\r\n\
         Connection: keep-alive, X-Secret-Hop\r\nConnection: x-other-hop\r\nX-Secret-Hop: s\r\n\
         X-Other-Hop: o\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\nX-Kept: k\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut conn = tokio::net::TcpStream::connect(picker.addrs.http)
        .await
        .unwrap();
    conn.write_all(head.as_bytes()).await.unwrap();
    let mut answer = [0u8; 12];
    conn.read_exact(&mut answer).await.unwrap();
    assert_eq!(&answer, b"HTTP/1.1 200");
    let headers = engine.state.last_headers.lock().clone().unwrap();
    assert_eq!(headers["x-kept"], "k");
    for gone in [
        "x-secret-hop",
        "x-other-hop",
        "http2-settings",
        "connection",
    ] {
        assert!(
            headers.get(gone).is_none(),
            "{gone} was forwarded: {headers:?}"
        );
    }
    picker.shutdown().await;
}
