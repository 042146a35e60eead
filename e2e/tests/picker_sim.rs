//! The picker service against simulated engines on loopback: KV events published over ZMQ by
//! an engine move the picker's decision to it; a forced sequence gap is repaired by replay;
//! the Envoy ext_proc listener answers with the endpoint holding the prefix, honours the
//! subset hint, and returns 503 when nothing is eligible.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use kvroute_picker::service::Running;
use kvroute_sim::server::{SimConfig, SimHandle, start as start_sim};
use serde_json::{Value, json};

/// A picker routing between the given engines, with precise KV events.
async fn picker(engines: &[&SimHandle], strategy: &str) -> Running {
    picker_with(engines, strategy, "").await
}

async fn picker_with(engines: &[&SimHandle], strategy: &str, model_extra: &str) -> Running {
    let endpoints: String = engines.iter().map(|e| endpoint_entry(e, "")).collect();
    let yaml = format!(
        r#"
{LOOPBACK_LISTEN}
{LLAMA_PRECISE}{model_extra}
endpoints:
{endpoints}
routing: {{strategy: {strategy}, stalenessThreshold: 5s}}
scrape: {{interval: 50ms}}
"#
    );
    static_picker(&yaml).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_move_the_decision_to_the_engine_that_cached_the_prefix() {
    let a = sim("127.0.0.1").await;
    let b = sim("127.0.0.2").await;
    let p = picker(&[&a, &b], "CostModel").await;
    let tokens = prompt(1, 2048);

    // nothing is cached yet: remember where a cold pick goes, then warm the OTHER engine
    // directly (bypassing the picker), so only its KV events can tell the picker
    let cold = pick(&p, &tokens).await;
    assert_eq!(cold["matched_blocks"], 0);
    let cold_ip = cold["endpoint"]
        .as_str()
        .unwrap()
        .split(':')
        .next()
        .unwrap()
        .to_owned();
    let (warm, warm_ip) = if cold_ip == "127.0.0.1" {
        (&b, "127.0.0.2")
    } else {
        (&a, "127.0.0.1")
    };
    complete(
        format!("http://{}/v1/completions", warm.addrs()[0].http),
        &tokens,
    )
    .await;
    eventually("the warm engine's blocks in the index", || {
        indexed_blocks(&p, warm_ip) >= 127
    })
    .await;

    let hot = pick(&p, &tokens).await;
    assert_eq!(
        hot["endpoint"].as_str().unwrap().split(':').next(),
        Some(warm_ip)
    );
    assert!(hot["matched_blocks"].as_u64().unwrap() >= 127, "{hot}");
    // and through the proxy the engine reports the prefix as cached
    let out = complete(format!("http://{}/v1/completions", p.addrs.http), &tokens).await;
    let cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= 2000, "engine reused the prefix: {out}");
    p.shutdown().await;
    a.shutdown();
    b.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_sequence_gap_is_repaired_by_replay() {
    let a = sim("127.0.0.3").await;
    let p = picker(&[&a], "CostModel").await;
    let engine_url = format!("http://{}/v1/completions", a.addrs()[0].http);
    // prime the subscription
    complete(engine_url.clone(), &prompt(7, 64)).await;
    eventually("first blocks", || indexed_blocks(&p, "127.0.0.3") >= 4).await;

    // drop every event batch (but keep them replayable) while a new prefix gets cached
    let drop: kvroute_sim::server::fault::FaultSpec =
        serde_json::from_value(json!({"kind": "drop_events", "fraction": 1.0, "replayable": true}))
            .unwrap();
    a.inject(0, drop).await.unwrap();
    let hidden = prompt(8, 512);
    complete(engine_url.clone(), &hidden).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = pick(&p, &hidden).await;
    assert_eq!(
        before["matched_blocks"], 0,
        "the dropped batches were not seen"
    );

    // events flow again: the next batch reveals the gap, the replay fills it
    let clear: kvroute_sim::server::fault::FaultSpec =
        serde_json::from_value(json!({"kind": "clear"})).unwrap();
    a.inject(0, clear).await.unwrap();
    complete(engine_url, &prompt(9, 64)).await;
    let state = Arc::clone(&p.state);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let r = pick(&p, &hidden).await;
        if r["matched_blocks"].as_u64().unwrap_or(0) >= 31 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "replay never filled the gap: {r}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let metrics = state.metrics.encode();
    assert!(
        !metrics.contains("kind=\"resync\""),
        "repaired by replay, not by a resync: {metrics}"
    );
    p.shutdown().await;
    a.shutdown();
}

/// Batches lost for good (not in the engine's replay buffer) while the engine goes on: the
/// replay comes back short and the endpoint resyncs, but what the picker knew is kept (the
/// engine did not restart, its cache did not go away) and the view is marked as having a gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_batches_no_replay_holds_keep_the_view_and_mark_its_gap() {
    let a = sim("127.0.0.4").await;
    let p = picker(&[&a], "CostModel").await;
    let engine_url = format!("http://{}/v1/completions", a.addrs()[0].http);
    let known = prompt(40, 512);
    complete(engine_url.clone(), &known).await;
    eventually("the known prefix indexed", || {
        indexed_blocks(&p, "127.0.0.4") >= 31
    })
    .await;

    let drop: kvroute_sim::server::fault::FaultSpec = serde_json::from_value(
        json!({"kind": "drop_events", "fraction": 1.0, "replayable": false}),
    )
    .unwrap();
    a.inject(0, drop).await.unwrap();
    complete(engine_url.clone(), &prompt(41, 512)).await;
    let clear: kvroute_sim::server::fault::FaultSpec =
        serde_json::from_value(json!({"kind": "clear"})).unwrap();
    a.inject(0, clear).await.unwrap();
    // the next batch shows the gap; the replay does not hold it
    complete(engine_url, &prompt(42, 64)).await;
    eventually("the resync", || problems(&p, "resync") > 0).await;

    let r = pick(&p, &known).await;
    assert!(
        r["matched_blocks"].as_u64().unwrap() >= 31,
        "the prefix known before the loss is still credited: {r}"
    );
    assert_eq!(r["candidates"][0]["features"]["index_gap"], true, "{r}");
    p.shutdown().await;
    a.shutdown();
}

/// Issue 34, item 3: a picker that starts after the engine's replay window has passed gets
/// `BlockStored` events for the blocks the engine adds to a context it cached before (their
/// parents are blocks the picker never saw). It marks the gap and credits the requests it
/// routes there from its own record for the approximate TTL, past the 2 s provisional one,
/// and `/v1/pick` says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_picker_that_came_after_the_replay_window_credits_its_routing_record() {
    let cfg = SimConfig {
        // the publisher keeps one batch for replay
        replay_buffer: 1,
        ..sim_config("127.0.0.9", 50.0)
    };
    let a = start_sim(cfg).await.expect("simulator starts");
    let engine_url = format!("http://{}/v1/completions", a.addrs()[0].http);
    // a context cached before any picker runs, then pushed out of the replay buffer
    let context = prompt(30, 512);
    complete(engine_url.clone(), &context).await;
    complete(engine_url, &prompt(31, 64)).await;

    let p = picker(&[&a], "CostModel").await;
    let proxy_url = format!("http://{}/v1/completions", p.addrs.http);
    let mut turn = context.clone();
    turn.extend(prompt(32, 256));
    let out = complete(proxy_url, &turn).await;
    let cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= 500, "the engine had the context: {out}");
    eventually("the orphan stores are seen", || {
        problems(&p, "orphan_blocks") > 0
    })
    .await;
    // past `index.provisionalTtl` (2 s): without the gap rule the credit would be gone
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let r = pick(&p, &turn).await;
    assert!(
        r["matched_blocks"].as_u64().unwrap() >= 47,
        "the routed turn is credited: {r}"
    );
    let candidate = &r["candidates"][0]["features"];
    assert_eq!(candidate["index_gap"], true, "{r}");
    assert!(
        candidate["provisional_blocks"].as_u64().unwrap() >= 16,
        "{r}"
    );
    p.shutdown().await;
    a.shutdown();
}

/// A counter of `kvroute_picker_kv_event_problems_total` by kind, from the picker's registry.
fn problems(p: &Running, kind: &str) -> u64 {
    let kind = format!("kind=\"{kind}\"");
    kvroute_testkit::metric_sum(
        &p.state.metrics.encode(),
        "kvroute_picker_kv_event_problems_total",
        &[&kind],
    ) as u64
}

/// A simulated engine whose publisher floods garbage (random bytes, damaged payloads, jumps
/// in the sequence numbers both ways, bad frames) between its real batches: every request
/// through the picker still succeeds, the index never holds more blocks for the engine than
/// it has, nothing in the flood makes the picker resynchronize (drop what it knew), and
/// batches after the flood are applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_flooding_garbage_is_survived_and_the_view_is_rebuilt() {
    let a = sim("127.0.0.8").await;
    let p = picker(&[&a], "CostModel").await;
    let engine_url = format!("http://{}/v1/completions", a.addrs()[0].http);
    let proxy_url = format!("http://{}/v1/completions", p.addrs.http);
    complete(engine_url.clone(), &prompt(20, 256)).await;
    eventually("first blocks", || indexed_blocks(&p, "127.0.0.8") >= 16).await;

    let flood: kvroute_sim::server::fault::FaultSpec = serde_json::from_value(
        json!({"kind": "garbage_events", "per_second": 20_000, "max_bytes": 4096}),
    )
    .unwrap();
    a.inject(0, flood).await.unwrap();
    for i in 0..40 {
        // real traffic keeps producing real batches among the garbage
        complete(proxy_url.clone(), &prompt(100 + i, 160)).await;
        assert!(indexed_blocks(&p, "127.0.0.8") <= 4096);
    }
    eventually("decode errors counted", || problems(&p, "decode_error") > 0).await;
    // nothing in the flood made the picker drop what it knew
    assert_eq!(problems(&p, "resync"), 0);
    let warm = pick(&p, &prompt(20, 256)).await;
    // 16 blocks cached; the last holds the prompt's last token, which vLLM never serves
    assert!(warm["matched_blocks"].as_u64().unwrap() >= 15, "{warm}");

    let clear: kvroute_sim::server::fault::FaultSpec =
        serde_json::from_value(json!({"kind": "clear"})).unwrap();
    a.inject(0, clear).await.unwrap();
    // a prefix cached after the flood is credited again
    let after = prompt(21, 512);
    complete(engine_url, &after).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let r = pick(&p, &after).await;
        if r["matched_blocks"].as_u64().unwrap_or(0) >= 31 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the view was not rebuilt after the flood: {r}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(indexed_blocks(&p, "127.0.0.8") <= 4096);
    p.shutdown().await;
    a.shutdown();
}

#[path = "ext_proc_support/mod.rs"]
mod envoy;
#[path = "sim_support/mod.rs"]
mod sim_support;
use sim_support::{
    LLAMA_PRECISE, LOOPBACK_LISTEN, client, complete, endpoint_entry, eventually, indexed_blocks,
    pick, prompt, sim, sim_config, static_picker,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ext_proc_routes_to_the_cached_engine_honours_the_subset_and_rejects_with_503() {
    let a = sim("127.0.0.4").await;
    let b = sim("127.0.0.5").await;
    let p = picker(&[&a, &b], "CostModel").await;
    let ext = p.addrs.ext_proc.expect("ext_proc listener");
    let tokens = prompt(21, 1024);
    complete(
        format!("http://{}/v1/completions", b.addrs()[0].http),
        &tokens,
    )
    .await;
    eventually("b's blocks", || indexed_blocks(&p, "127.0.0.5") >= 63).await;
    let body = serde_json::to_vec(&json!({"model": "llama", "prompt": tokens})).unwrap();
    let b_addr = b.addrs()[0].http.to_string();
    let a_addr = a.addrs()[0].http.to_string();

    match envoy::route(ext, &body, None).await {
        envoy::Answer::Route {
            destination,
            metadata,
            headers,
            removed,
        } => {
            // no prefill endpoint in this pool: a client's own prefiller header never
            // reaches a routing sidecar
            assert!(
                !headers.contains_key("x-prefiller-host-port"),
                "{headers:?}"
            );
            assert_eq!(removed, ["x-prefiller-host-port"]);
            // one endpoint in the header, the ordered list in the metadata
            assert_eq!(destination, b_addr, "the cached engine");
            assert_eq!(
                metadata,
                format!("{b_addr},{a_addr}"),
                "cached engine first, then the fallback"
            );
        }
        other => panic!("expected a route, got {other:?}"),
    }
    // the gateway offers only `a`: the picker stays inside the subset
    match envoy::route(ext, &body, Some(std::slice::from_ref(&a_addr))).await {
        envoy::Answer::Route { destination, .. } => assert_eq!(destination, a_addr),
        other => panic!("expected a route, got {other:?}"),
    }
    // a subset with no pool endpoint in it: 503 with an OpenAI-style body
    match envoy::route(ext, &body, Some(&["10.9.9.9:1".to_string()])).await {
        envoy::Answer::Immediate { status, body } => {
            assert_eq!(status, 503);
            let v: Value = serde_json::from_str(&body).unwrap();
            assert!(v["error"]["message"].is_string(), "{body}");
        }
        other => panic!("expected 503, got {other:?}"),
    }
    // unknown model: 404
    let bad = serde_json::to_vec(&json!({"model": "nope", "prompt": "x"})).unwrap();
    match envoy::route(ext, &bad, None).await {
        envoy::Answer::Immediate { status, .. } => assert_eq!(status, 404),
        other => panic!("expected 404, got {other:?}"),
    }
    p.shutdown().await;
    a.shutdown();
    b.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_render_gives_the_picker_the_engines_own_tokens() {
    let a = sim("127.0.0.6").await;
    let b = sim("127.0.0.7").await;
    // no local tokenizer: without the render hop the picker would hash character chunks,
    // which can never match the engine's token blocks
    let p = picker_with(
        &[&a, &b],
        "CostModel",
        "    tokenizer: {useEngineRender: true}",
    )
    .await;
    let messages = json!([
        {"role": "system", "content": "You are a careful assistant. ".repeat(40)},
        {"role": "user", "content": "Summarize the plan."}
    ]);
    let r = client()
        .post(format!("http://{}/v1/chat/completions", b.addrs()[0].http))
        .json(&json!({"model": "llama", "messages": messages, "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    eventually("b's blocks", || indexed_blocks(&p, "127.0.0.7") >= 40).await;
    let picked: Value = kvroute_testkit::post_json(
        &client(),
        format!("http://{}/v1/pick", p.addrs.admin),
        &json!({"model": "llama", "messages": messages}),
    )
    .await;
    assert_eq!(
        picked["endpoint"].as_str().unwrap().split(':').next(),
        Some("127.0.0.7"),
        "{picked}"
    );
    assert!(picked["matched_blocks"].as_u64().unwrap() >= 40, "{picked}");
    p.shutdown().await;
    a.shutdown();
    b.shutdown();
}
