//! A KV event publisher misbehaving under the picker: garbage payloads, skipped sequence
//! numbers and floods past the per-publisher rate. The picker keeps routing, counts the
//! problems, and its view of the endpoint stays bounded.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use bytes::Bytes;
use kvroute_picker::kv_events::{EventBatch, EventEncoding, KvEvent, encode_event_batch};
use kvroute_picker::service::Running;
use serde_json::json;
use support::*;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

fn frames(seq: u64, payload: Vec<u8>) -> ZmqMessage {
    let mut m = ZmqMessage::from(Bytes::new());
    m.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
    m.push_back(Bytes::from(payload));
    m
}

fn stored_batch(seq: u64, blocks: u64) -> Vec<u8> {
    let batch = EventBatch {
        ts: 0.0,
        events: vec![KvEvent::plain_stored(
            (0..blocks).map(|i| seq * 1_000_000 + i + 1).collect(),
            None,
            (0..blocks * 16)
                .map(|t| (seq * 7 + t) as u32 % 30_000)
                .collect(),
            16,
        )],
        data_parallel_rank: None,
        skipped_unknown: 0,
    };
    encode_event_batch(&batch, EventEncoding::MapEvents)
}

fn problems(metrics: &str, kind: &str) -> u64 {
    let kind = format!("kind=\"{kind}\"");
    kvroute_testkit::metric_sum(metrics, "kvroute_picker_kv_event_problems_total", &[&kind]) as u64
}

/// A publisher on 127.0.0.1 and a picker subscribed to it for one engine (`blockSize` 16),
/// with `extra` YAML appended; returns both once the subscriber is connected (valid batches
/// land in the index), and the next sequence number to publish.
async fn subscribed_picker(engine: &FakeEngine, extra: &str) -> (PubSocket, Running, u64) {
    let mut publisher = PubSocket::new();
    let ep = publisher.bind("tcp://127.0.0.1:0").await.unwrap();
    let port: u16 = ep.to_string().rsplit(':').next().unwrap().parse().unwrap();
    let picker = start_picker(&format!(
        r#"
modelConfigs:
  - name: llama
    model: llama
    port: {}
    blockSize: 16
    kvEvents: {{port: 1}}
endpoints:
  - {{address: 127.0.0.1, modelConfig: llama, kvEventsPort: {port}}}
routing: {{stalenessThreshold: 1m}}
{extra}"#,
        engine.addr.port()
    ))
    .await;
    let mut seq = 0u64;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while picker.state.pool.state().live_blocks() == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "subscriber never connected"
        );
        publisher
            .send(frames(seq, stored_batch(seq, 1)))
            .await
            .unwrap();
        seq += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (publisher, picker, seq)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_gaps_and_floods_are_counted_and_routing_continues() {
    let engine = FakeEngine::start("127.0.0.1").await;
    // a capacity of 64 blocks (the engine reports none)
    let (mut publisher, picker, mut seq) = subscribed_picker(
        &engine,
        "index: {preciseSlack: 2, defaultKvCapacityBlocks: 64}\n\
         limits: {maxEventsPerSecond: 50, eventBurst: 200, maxEventPayloadBytes: 65536}\n",
    )
    .await;
    let state = picker.state.clone();
    let metrics_addr = picker.addrs.metrics;

    // garbage payloads, an oversized one, and sequence numbers that jump ahead (no replay
    // socket: each gap is a resync)
    for i in 0..200u64 {
        let payload = match i % 4 {
            0 => vec![0xc1; 64],                     // never-used msgpack marker
            1 => vec![0xdd, 0xff, 0xff, 0xff, 0xff], // array of 4G elements, no data
            2 => vec![0u8; 70_000],                  // over maxEventPayloadBytes
            _ => b"not msgpack at all".to_vec(),
        };
        publisher.send(frames(seq, payload)).await.unwrap();
        seq += if i % 10 == 0 { 1000 } else { 1 };
    }
    // a flood of valid batches well past the budget (the capacity of 64 blocks x slack 2 is
    // also exceeded: the index clears the endpoint rather than grow)
    for _ in 0..400u64 {
        publisher
            .send(frames(seq, stored_batch(seq, 4)))
            .await
            .unwrap();
        seq += 1;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let m = metrics_text(metrics_addr).await;
        if problems(&m, "decode_error") > 0
            && problems(&m, "resync") > 0
            && problems(&m, "rate_limited") > 0
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "problems not counted:\n{}",
            m.lines()
                .filter(|l| l.contains("problems"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // bounded: never more than the endpoint's budget (capacity x slack)
    assert!(state.pool.state().live_blocks() <= 128);
    // and the picker still routes
    let resp = client()
        .post(format!("http://{}/v1/completions", picker.addrs.http))
        .json(&json!({"model": "llama", "prompt": "still here"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    picker.shutdown().await;
}

/// An engine that reports an absurd KV capacity (`num_gpu_blocks="1000000000000"`) and then
/// floods `BlockStored` batches of many blocks each: the capacity is believed only up to
/// `index.maxBlocksPerEndpoint`, so the endpoint's view is cleared at that bound instead of
/// growing with the flood.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_capacity_and_a_block_flood_stay_within_the_per_endpoint_bound() {
    use kvroute_picker::endpoint::EndpointId;
    use std::sync::atomic::Ordering;
    let engine = FakeEngine::start("127.0.0.1").await;
    engine.state.block_size.store(16, Ordering::SeqCst);
    engine
        .state
        .num_gpu_blocks
        .store(1_000_000_000_000, Ordering::SeqCst);
    let (mut publisher, picker, mut seq) = subscribed_picker(
        &engine,
        "index: {preciseSlack: 2, maxBlocksPerEndpoint: 300}\nscrape: {interval: 50ms}\n",
    )
    .await;
    let state = picker.state.clone();
    let id = EndpointId::new("127.0.0.1".parse().unwrap(), engine.addr.port(), 0);
    let learned = || {
        state
            .pool
            .state()
            .read()
            .loads()
            .get(&id)
            .and_then(|l| l.kv_capacity_blocks)
    };
    eventually(Duration::from_secs(10), || {
        learned().is_some_and(|c| c >= 1_000_000_000_000)
    })
    .await;
    let mut most = 0;
    for _ in 0..200u64 {
        publisher
            .send(frames(seq, stored_batch(seq, 64)))
            .await
            .unwrap();
        seq += 1;
        most = most.max(state.pool.state().live_blocks());
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    most = most.max(state.pool.state().live_blocks());
    assert!(most > 0, "batches were ingested");
    assert!(
        most <= 300,
        "{most} blocks held: the engine's capacity was believed past the bound"
    );
    picker.shutdown().await;
}
