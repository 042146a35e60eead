//! Misconfigurations are not silent (issue 13, finding 3): an endpoint whose engine uses
//! another block size than its model config says, or whose KV events never arrive while the
//! engine serves requests, is warned about, exported as
//! `kvroute_picker_endpoint_misconfigured{endpoint,reason}` and shown in `/debug/endpoints`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use serde_json::{Value, json};
use support::*;

async fn debug_endpoints(picker: &kvroute_picker::service::Running) -> Value {
    kvroute_testkit::get_json(
        &client(),
        format!("http://{}/debug/endpoints", picker.addrs.admin),
    )
    .await
}

#[tokio::test]
async fn a_block_size_the_engine_does_not_use_is_reported() {
    let engine = FakeEngine::start("127.0.0.1").await;
    engine.state.block_size.store(32, Ordering::SeqCst);
    let port = engine.addr.port();
    let picker = start_picker(&format!(
        r#"
modelConfigs:
  - name: llama
    model: llama
    port: {port}
    blockSize: 16
endpoints:
  - {{address: 127.0.0.1, modelConfig: llama}}
scrape: {{interval: 50ms, timeout: 200ms}}
"#
    ))
    .await;
    let series = format!(
        "kvroute_picker_endpoint_misconfigured{{endpoint=\"127.0.0.1:{port}#0\",reason=\"block_size_mismatch\"}} 1"
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let text = metrics_text(picker.addrs.metrics).await;
        if text.contains(&series) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no {series} in\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let d = debug_endpoints(&picker).await;
    assert_eq!(
        d["endpoints"][0]["diagnostics"],
        json!({
            "block_size_mismatch": {"configured": 16, "engine": 32, "source": "metrics"},
            "kv_events": "not_configured",
        }),
        "{d}"
    );

    // the engine restarted with the configured size: the finding goes away
    engine.state.block_size.store(16, Ordering::SeqCst);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let text = metrics_text(picker.addrs.metrics).await;
        if !text.contains("block_size_mismatch") {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "still set:\n{text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let d = debug_endpoints(&picker).await;
    assert_eq!(
        d["endpoints"][0]["diagnostics"]["block_size_mismatch"],
        Value::Null,
        "{d}"
    );
    picker.cancel.cancel();
    picker.wait().await;
}

/// Waits until the picker's metrics contain `series` (bounded).
async fn until_metric(picker: &kvroute_picker::service::Running, series: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let text = metrics_text(picker.addrs.metrics).await;
        if text.contains(series) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no {series} in\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The KV-event port nobody publishes on (what a vLLM started with a plain
/// `tcp://host:5557` endpoint looks like: it connects out instead of binding) while the
/// engine has requests queued: reported once the silence outlasts the threshold.
#[tokio::test]
async fn kv_events_that_never_arrive_from_a_busy_engine_are_reported() {
    let engine = FakeEngine::start("127.0.0.1").await;
    engine.state.waiting.store(3, Ordering::SeqCst);
    let port = engine.addr.port();
    let silent = refused_port().await;
    let picker = start_picker(&format!(
        r#"
modelConfigs:
  - name: llama
    model: llama
    port: {port}
    kvEvents: {{port: {silent}}}
endpoints:
  - {{address: 127.0.0.1, modelConfig: llama}}
scrape: {{interval: 50ms, timeout: 200ms}}
"#
    ))
    .await;
    picker
        .state
        .diagnostics
        .lock()
        .set_kv_silence_after(Duration::from_millis(300));
    // the check is armed once a prompt of at least one full block was sent (no tokenizer:
    // 64 characters make a block)
    let resp = client()
        .post(format!("http://{}/v1/completions", picker.addrs.http))
        .json(&json!({"model": "llama", "prompt": "a prompt long enough to fill one block ".repeat(4)}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    until_metric(
        &picker,
        &format!(
            "kvroute_picker_endpoint_misconfigured{{endpoint=\"127.0.0.1:{port}#0\",reason=\"kv_events_never_received\"}} 1"
        ),
    )
    .await;
    let d = debug_endpoints(&picker).await;
    assert_eq!(
        d["endpoints"][0]["diagnostics"]["kv_events"],
        json!("never_received"),
        "{d}"
    );
    picker.cancel.cancel();
    picker.wait().await;
}

/// The engine says nothing of its block size in its metrics, but its `BlockStored` events
/// carry it: reported from there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_size_mismatch_seen_in_kv_events_is_reported() {
    use kvroute_picker::kv_events::{EventBatch, EventEncoding, KvEvent, encode_event_batch};
    use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

    let engine = FakeEngine::start("127.0.0.1").await;
    let mut publisher = PubSocket::new();
    let ep = publisher.bind("tcp://127.0.0.1:0").await.unwrap();
    let kv_port: u16 = ep.to_string().rsplit(':').next().unwrap().parse().unwrap();
    let port = engine.addr.port();
    let picker = start_picker(&format!(
        r#"
modelConfigs:
  - name: llama
    model: llama
    port: {port}
    blockSize: 16
    kvEvents: {{port: {kv_port}}}
endpoints:
  - {{address: 127.0.0.1, modelConfig: llama}}
scrape: {{interval: 50ms, timeout: 200ms}}
"#
    ))
    .await;
    let batch = |seq: u64| {
        let batch = EventBatch {
            ts: 1.0,
            events: vec![KvEvent::plain_stored(
                vec![seq + 1],
                None,
                (0..32).collect(),
                32,
            )],
            data_parallel_rank: None,
            skipped_unknown: 0,
        };
        let mut m = ZmqMessage::from(bytes::Bytes::new());
        m.push_back(bytes::Bytes::copy_from_slice(&seq.to_be_bytes()));
        m.push_back(encode_event_batch(&batch, EventEncoding::MapEvents).into());
        m
    };
    // publish until the subscription has caught one (a PUB drops what comes before)
    let want = format!(
        "kvroute_picker_endpoint_misconfigured{{endpoint=\"127.0.0.1:{port}#0\",reason=\"block_size_mismatch\"}} 1"
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut seq = 0;
    while !metrics_text(picker.addrs.metrics).await.contains(&want) {
        assert!(tokio::time::Instant::now() < deadline, "never reported");
        publisher.send(batch(seq)).await.unwrap();
        seq += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let d = debug_endpoints(&picker).await;
    assert_eq!(
        d["endpoints"][0]["diagnostics"],
        json!({
            "block_size_mismatch": {"configured": 16, "engine": 32, "source": "kv_events"},
            "kv_events": "receiving",
        }),
        "{d}"
    );
    picker.cancel.cancel();
    picker.wait().await;
}
