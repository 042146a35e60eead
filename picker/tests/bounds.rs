//! Every configurable bound, hit through the real listeners: each answers with a clear
//! OpenAI-style error (or cuts a stream) and the picker keeps serving.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use serde_json::{Value, json};
use support::*;

fn yaml(port: u16, limits: &str) -> String {
    one_engine_pool(port, &format!("limits: {limits}\n"))
}

async fn error_of(resp: reqwest::Response) -> (u16, String) {
    let status = resp.status().as_u16();
    let body: Value = resp.json().await.unwrap();
    (
        status,
        body["error"]["code"].as_str().unwrap_or("").to_owned(),
    )
}

#[tokio::test]
async fn prompt_tokens_and_messages_are_bounded() {
    let engine = FakeEngine::start("127.0.0.1").await;
    let picker = start_picker(&yaml(
        engine.addr.port(),
        "{maxPromptTokens: 8, maxMessages: 2}",
    ))
    .await;
    let base = format!("http://{}", picker.addrs.http);
    let ids: Vec<u32> = (0..20).collect();
    let resp = client()
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": "llama", "prompt": ids}))
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(resp).await, (400, "prompt_too_long".into()));
    // text prompts are bounded after tokenization (character chunks here)
    let resp = client()
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": "llama", "prompt": "x".repeat(10_000)}))
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(resp).await, (400, "prompt_too_long".into()));
    let m = json!({"role": "user", "content": "hi"});
    let resp = client()
        .post(format!("{base}/v1/chat/completions"))
        .json(&json!({"model": "llama", "messages": [m, m, m]}))
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(resp).await, (400, "too_many_messages".into()));
    assert_eq!(engine.state.requests.load(Ordering::SeqCst), 0);
    picker.shutdown().await;
}

#[tokio::test]
async fn oversized_request_heads_get_431() {
    let engine = FakeEngine::start("127.0.0.1").await;
    let picker = start_picker(&yaml(engine.addr.port(), "{maxHeaderBytes: 8192}")).await;
    let url = format!("http://{}/v1/completions", picker.addrs.http);
    let resp = client()
        .post(&url)
        .header("x-big", "y".repeat(16 * 1024))
        .json(&json!({"model": "llama", "prompt": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 431);
    // the listener still serves ordinary requests
    assert_eq!(completion_status(&url, "hi").await, 200);
    picker.shutdown().await;
}

#[tokio::test]
async fn connections_past_the_bound_get_a_503_naming_the_limit() {
    let engine = FakeEngine::start("127.0.0.1").await;
    // a head timeout far longer than the test: a silent refused connection must not wait for it
    let picker = start_picker(&yaml(
        engine.addr.port(),
        "{maxConnections: 1, headerReadTimeout: 60m}",
    ))
    .await;
    let url = format!("http://{}/healthz", picker.addrs.http);
    // the first client keeps its connection open (pooled keep-alive)
    let first = client();
    assert_eq!(first.get(&url).send().await.unwrap().status(), 200);
    let second = client();
    let (status, code) = error_of(second.get(&url).send().await.unwrap()).await;
    assert_eq!((status, code.as_str()), (503, "too_many_connections"));
    // a silent connection past the cap is closed once the refusal's short linger is over,
    // long before headerReadTimeout (finding 6 of issue 35: it used to wait for a head, and
    // 1,100 of them used up the open files)
    {
        use tokio::io::AsyncReadExt;
        let mut silent = tokio::net::TcpStream::connect(picker.addrs.http)
            .await
            .unwrap();
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(30), silent.read_to_end(&mut answer))
            .await
            .expect("closed long before the head timeout")
            .unwrap();
        assert!(answer.is_empty(), "{}", String::from_utf8_lossy(&answer));
    }
    // once the first connection closes, its slot is free again
    drop(first);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let c = client();
        if c.get(&url).send().await.unwrap().status() == 200 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "slot never freed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    picker.shutdown().await;
}

#[tokio::test]
async fn in_flight_per_endpoint_is_shed_with_429() {
    let engine = FakeEngine::start("127.0.0.1").await;
    engine.state.hang.store(true, Ordering::SeqCst);
    let picker = start_picker(&yaml(
        engine.addr.port(),
        "{maxInflightPerEndpoint: 1, upstreamTimeout: 30s}",
    ))
    .await;
    let url = format!("http://{}/v1/completions", picker.addrs.http);
    let hung = tokio::spawn({
        let url = url.clone();
        async move {
            client()
                .post(url)
                .json(&json!({"model": "llama", "prompt": "first"}))
                .send()
                .await
        }
    });
    let state = engine.state.clone();
    eventually(Duration::from_secs(5), || {
        state.requests.load(Ordering::SeqCst) == 1
    })
    .await;
    let resp = client()
        .post(&url)
        .json(&json!({"model": "llama", "prompt": "second"}))
        .send()
        .await
        .unwrap();
    assert!(resp.headers().contains_key("retry-after"));
    assert_eq!(error_of(resp).await, (429, "overloaded".into()));
    assert_eq!(engine.state.requests.load(Ordering::SeqCst), 1);
    hung.abort();
    picker.shutdown().await;
}

#[tokio::test]
async fn a_silent_stream_is_cut_after_the_idle_timeout() {
    let engine = FakeEngine::start("127.0.0.1").await;
    engine.state.stall_after_first.store(true, Ordering::SeqCst);
    let picker = start_picker(&yaml(engine.addr.port(), "{idleTimeout: 200ms}")).await;
    let url = format!("http://{}/v1/completions", picker.addrs.http);
    let resp = client()
        .post(&url)
        .json(&json!({"model": "llama", "prompt": "hi", "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    use futures::StreamExt;
    let first = stream.next().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));
    // then the stream ends abnormally instead of hanging
    let rest = tokio::time::timeout(Duration::from_secs(10), async {
        let mut failed = false;
        while let Some(item) = stream.next().await {
            failed |= item.is_err();
        }
        failed
    })
    .await
    .expect("the picker cut the stream");
    assert!(rest, "the client sees an error, not a clean end");
    engine
        .state
        .stall_after_first
        .store(false, Ordering::SeqCst);
    assert_eq!(completion_status(&url, "hi").await, 200);
    picker.shutdown().await;
}

/// Fault: the engine dies in the middle of a stream. That client gets a truncated stream
/// (an error, never a silent clean end); a concurrent request is unaffected.
#[tokio::test]
async fn an_engine_crash_mid_stream_fails_only_that_stream() {
    let engine = FakeEngine::start("127.0.0.1").await;
    let picker = start_picker(&yaml(engine.addr.port(), "{}")).await;
    let url = format!("http://{}/v1/completions", picker.addrs.http);
    engine.state.crash_after_first.store(true, Ordering::SeqCst);
    let resp = client()
        .post(&url)
        .json(&json!({"model": "llama", "prompt": "hi", "stream": true}))
        .send()
        .await
        .unwrap();
    engine
        .state
        .crash_after_first
        .store(false, Ordering::SeqCst);
    let other = client()
        .post(&url)
        .json(&json!({"model": "llama", "prompt": "other", "stream": true}))
        .send()
        .await
        .unwrap();
    assert!(
        resp.bytes().await.is_err(),
        "the crashed stream is an error"
    );
    let text = other.text().await.unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    let id = picker.state.pool.state().endpoints().endpoints()[0].id;
    let state = picker.state.clone();
    eventually(Duration::from_secs(5), || {
        state.pool.inflight().get(&id).requests == 0
    })
    .await;
    picker.shutdown().await;
}

/// Fault: an engine wedges (accepts, never answers, metrics included). The request caught on
/// it ends with 504 after the upstream timeout; the engine goes stale and traffic moves to
/// the healthy one.
#[tokio::test]
async fn a_hung_engine_times_out_goes_stale_and_traffic_moves() {
    let a = FakeEngine::start("127.0.0.1").await;
    let b = FakeEngine::start("127.0.0.2").await;
    let picker = start_picker(&format!(
        r#"
modelConfigs:
  - name: llama
    model: llama
    port: {}
endpoints:
  - {{address: 127.0.0.1, modelConfig: llama}}
  - {{address: 127.0.0.2, modelConfig: llama, port: {}}}
routing: {{strategy: RoundRobin, stalenessThreshold: 300ms, failureMode: FailClose}}
scrape: {{interval: 50ms, timeout: 100ms}}
limits: {{upstreamTimeout: 500ms}}
"#,
        a.addr.port(),
        b.addr.port()
    ))
    .await;
    let state = picker.state.clone();
    eventually(Duration::from_secs(5), || state.is_ready()).await;
    a.state.hang.store(true, Ordering::SeqCst);
    a.state.metrics_hang.store(true, Ordering::SeqCst);
    let url = format!("http://{}/v1/completions", picker.addrs.http);
    let send = |i: u32| {
        let url = url.clone();
        async move {
            client()
                .post(url)
                .json(&json!({"model": "llama", "prompt": format!("r{i}")}))
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    // round robin sends one of two to the wedged engine: that one times out
    let (x, y) = tokio::join!(send(0), send(1));
    let mut got = [x, y];
    got.sort_unstable();
    assert_eq!(got, [200, 504]);
    // once stale, the wedged engine gets nothing and every request succeeds on b
    let a_id = endpoint_on_port(&picker, a.addr.port());
    eventually(Duration::from_secs(5), || {
        state.pool.state().endpoints().get(&a_id).map(|e| e.state)
            == Some(kvroute_picker::endpoint::EndpointState::Stale)
    })
    .await;
    let before = b.state.requests.load(Ordering::SeqCst);
    for i in 2..8 {
        assert_eq!(send(i).await, 200);
    }
    assert_eq!(b.state.requests.load(Ordering::SeqCst), before + 6);
    assert_eq!(a.state.requests.load(Ordering::SeqCst), 1);
    picker.shutdown().await;
}

/// A client that never finishes its request head (slowloris) is disconnected after
/// `headerReadTimeout`, freeing its connection slot.
#[tokio::test]
async fn a_slow_request_head_is_cut_after_the_header_read_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let engine = FakeEngine::start("127.0.0.1").await;
    let picker = start_picker(&yaml(
        engine.addr.port(),
        "{headerReadTimeout: 200ms, maxConnections: 1}",
    ))
    .await;
    let mut slow = tokio::net::TcpStream::connect(picker.addrs.http)
        .await
        .unwrap();
    slow.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), slow.read_to_end(&mut buf)).await;
    assert!(read.is_ok(), "the picker closed the connection");
    // the slot is free again
    let url = format!("http://{}/healthz", picker.addrs.http);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while client().get(&url).send().await.unwrap().status() != 200 {
        assert!(tokio::time::Instant::now() < deadline, "slot never freed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    picker.shutdown().await;
}
