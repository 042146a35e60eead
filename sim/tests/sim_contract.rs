//! The simulator's contract with routers: vLLM's HTTP API, metrics and KV events.
//!
//! The properties shared with real vLLM live in `contract/mod.rs` and run here against the
//! simulator (fast, in process) and in `e2e/tests/vllm_contract.rs` against a real vLLM engine,
//! so the simulator cannot drift from the engine. The tests below them are simulator-only: they
//! need what one real CPU engine cannot give here (fault injection, a waiting-queue bound, LoRA
//! adapters, data-parallel ranks, the SGLang flavor, other engines' event encodings), and each
//! says why.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod contract;
mod sim_support;

use std::path::PathBuf;
use std::time::Duration;

use contract::{Target, stored};
use kvroute_routing::endpoint::EngineKind;
use kvroute_routing::kv_events::EventEncoding;
use kvroute_sim::server::{EngineAddrs, SimConfig, SimHandle};
use serde_json::{Value, json};
use sim_support::*;

/// The tokenizer files the picker's own tests use.
fn fixture_tokenizer() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../routing/tests/fixtures/tokenizer"
    ))
}

fn target(a: &EngineAddrs) -> Target {
    Target {
        name: "kvroute-sim",
        http: a.http,
        kv_events: a.kv_events[0],
        replay: a.replay[0],
        block_size: BS,
        model: MODEL.to_owned(),
        tokenizer: fixture_tokenizer(),
    }
}

/// A simulator configured by `f`, as an engine under test.
async fn sim(f: impl FnOnce(&mut SimConfig)) -> (SimHandle, Target) {
    let (h, a) = start(f).await;
    (h, target(&a))
}

/// Runs a shared property against a fresh simulator configured by `f`.
macro_rules! shared {
    ($name:ident) => {
        shared!($name, |_| {});
    };
    ($name:ident, $f:expr) => {
        #[tokio::test]
        async fn $name() {
            bounded(async {
                let (_h, t) = sim($f).await;
                contract::$name(&t).await;
            })
            .await;
        }
    };
}

shared!(cached_tokens_and_prefix_counters);
shared!(streaming_completions_and_chat_follow_openai);
shared!(render_endpoints_and_multi_turn_reuse);
shared!(errors_are_openai_json);
shared!(kv_events_rekey_into_the_picker_index);
shared!(a_fully_cached_block_aligned_prompt_hits_all_but_its_last_block);
// A 16-block cache, so that three 6-block prompts overflow it.
shared!(eviction_is_published_and_visible, |c| c.engine.num_blocks =
    16);
shared!(replay_resends_what_was_published);
shared!(a_real_tokenizer_gives_the_routers_ids, |c| c.tokenizer =
    Some(fixture_tokenizer()));

/// The simulator's exact figures for the shared `cached_tokens_and_prefix_counters` (one
/// character per token, the configured capacity).
#[tokio::test]
async fn sim_text_and_capacity() {
    bounded(async {
        let (_h, a) = start(|_| {}).await;
        let (_, v) = complete(a.http, &sim_support::tokens(1, 64), 4).await;
        assert_eq!(v["choices"][0]["text"].as_str().unwrap().chars().count(), 4);
        let m = metrics(a.http, EngineKind::Vllm).await;
        let s = m.for_rank(0).unwrap();
        assert_eq!((s.block_size, s.kv_capacity_blocks), (Some(BS), Some(512)));
    })
    .await;
}

/// vLLM publishes events in its own array layout; the simulator can also speak the map
/// layouts of other engines and versions, which a real vLLM 0.32 never sends: simulator-only.
#[tokio::test]
async fn kv_events_rekey_into_the_picker_index_in_other_encodings() {
    bounded(async {
        for e in [
            EventEncoding::MapEvents,
            EventEncoding::Map,
            EventEncoding::Trtllm,
        ] {
            let (_h, t) = sim(|c| c.kv_encoding = e).await;
            contract::kv_events_rekey_into_the_picker_index(&t).await;
        }
    })
    .await;
}

/// Simulator-only: the simulator does not implement `n > 1` (vLLM does), LoRA adapters need
/// adapter weights the tiny test model has none of, and `X-data-parallel-rank` needs data
/// parallelism, which the CPU build does not run here.
#[tokio::test]
async fn errors_the_real_engine_cannot_show() {
    bounded(async {
        let (_h, a) = start(|c| {
            c.lora_modules = vec!["sql".into()];
        })
        .await;
        let (s, v) = post(a.http, "/v1/completions", &json!({"prompt": "x", "n": 2})).await;
        assert_eq!(s, 400, "{v}");
        assert_eq!(v["error"]["code"], 400);
        let r = client()
            .post(url(a.http, "/v1/completions"))
            .header("X-data-parallel-rank", "3")
            .json(&json!({"prompt": "x"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400);
        // A LoRA adapter is served by name.
        let (s, v) = post(
            a.http,
            "/v1/completions",
            &json!({"model": "sql", "prompt": "x", "max_tokens": 1}),
        )
        .await;
        assert_eq!((s, v["model"].as_str()), (200, Some("sql")));
        let models: Value = kvroute_testkit::get_json(&client(), url(a.http, "/v1/models")).await;
        assert_eq!(models["data"][1]["id"], "sql");
        assert_eq!(models["data"][1]["parent"], MODEL);
    })
    .await;
}

/// Simulator-only: vLLM 0.32 has no bound on its waiting queue to reject against, and holding
/// requests in the queue needs the simulator's `slow` fault.
#[tokio::test]
async fn full_waiting_queue_rejects_with_429() {
    bounded(async {
        let (h, a) = start(|c| {
            c.engine.max_num_seqs = 1;
            c.max_waiting = 1;
            c.speedup = 1.0;
        })
        .await;
        h.inject(
            0,
            serde_json::from_value(json!({"kind": "slow", "factor": 50})).unwrap(),
        )
        .await
        .unwrap();
        let running = tokio::spawn(complete(a.http, &tokens(1, 32), 2));
        tokio::time::sleep(Duration::from_millis(100)).await;
        let waiting = tokio::spawn(complete(a.http, &tokens(2, 32), 2));
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (s, v) = complete(a.http, &tokens(3, 32), 2).await;
        assert_eq!(s, 429, "{v}");
        assert_eq!(v["error"]["type"], "RateLimitError");
        let m = metrics(a.http, EngineKind::Vllm).await;
        assert_eq!((m.aggregate().running, m.aggregate().waiting), (1.0, 1.0));
        h.inject(0, serde_json::from_value(json!({"kind": "clear"})).unwrap())
            .await
            .unwrap();
        // Requests finish once the engine speeds up again (the slow step in flight ends first).
        assert_eq!(running.await.unwrap().0, 200);
        assert_eq!(waiting.await.unwrap().0, 200);
    })
    .await;
}

/// Simulator-only: a gap needs the simulator's `drop_events` fault (the shared
/// `replay_resends_what_was_published` checks the framing and contents against vLLM).
#[tokio::test]
async fn replay_recovers_a_gap() {
    bounded(async {
        let (h, a) = start(|_| {}).await;
        let mut sub = Sub::connect(a.kv_events[0]).await;
        let fault = |v: Value| serde_json::from_value(v).unwrap();
        assert_eq!(complete(a.http, &tokens(1, 40), 1).await.0, 200);
        h.inject(0, fault(json!({"kind": "drop_events"})))
            .await
            .unwrap();
        assert_eq!(complete(a.http, &tokens(2, 40), 1).await.0, 200);
        h.inject(0, fault(json!({"kind": "clear"}))).await.unwrap();
        assert_eq!(complete(a.http, &tokens(3, 40), 1).await.0, 200);
        let live = sub.drain_quiet(Duration::from_millis(300)).await;
        let seqs: Vec<u64> = live.iter().map(|m| m.0).collect();
        assert_eq!(seqs, vec![0, 2], "batch 1 was dropped");

        let mut view = picker_view();
        view.apply(&live[0].1);
        let missing = replay(a.replay[0], 1).await;
        assert_eq!(missing.iter().map(|m| m.0).collect::<Vec<_>>(), vec![1, 2]);
        for (_, b) in &missing {
            view.apply(b);
        }
        for i in 1..=3 {
            assert_eq!(view.matched(&tokens(i, 40)), 2);
        }
        // From 0: everything; far ahead: only the end marker.
        assert_eq!(replay(a.replay[0], 0).await.len(), 3);
        assert!(replay(a.replay[0], 1_000).await.is_empty());

        // Non-replayable drops are gone for good.
        h.inject(
            0,
            fault(json!({"kind": "drop_events", "replayable": false})),
        )
        .await
        .unwrap();
        assert_eq!(complete(a.http, &tokens(4, 40), 1).await.0, 200);
        h.inject(0, fault(json!({"kind": "clear"}))).await.unwrap();
        assert_eq!(complete(a.http, &tokens(5, 40), 1).await.0, 200);
        let seqs: Vec<u64> = replay(a.replay[0], 3).await.iter().map(|m| m.0).collect();
        assert_eq!(seqs, vec![4]);
    })
    .await;
}

/// Simulator-only: data-parallel ranks are not run on vLLM's CPU build here (one core per
/// engine; DP needs a process and a core per rank).
#[tokio::test]
async fn dp_ranks_by_header_body_and_load() {
    bounded(async {
        let (_h, a) = start(|c| c.dp_size = 2).await;
        assert_eq!(a.kv_events.len(), 2);
        let mut sub1 = Sub::connect(a.kv_events[1]).await;
        let p = tokens(1, 64);
        let r = client()
            .post(url(a.http, "/v1/completions"))
            .header("X-data-parallel-rank", "1")
            .json(&json!({"prompt": p, "max_tokens": 1}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let msgs = sub1.drain_quiet(Duration::from_millis(300)).await;
        assert!(!msgs.is_empty());
        assert!(msgs.iter().all(|(_, b)| b.data_parallel_rank == Some(1)));
        // The prefix lives on rank 1 only.
        let with_rank = |k: u32| {
            let p = p.clone();
            async move {
                let r = client()
                    .post(url(a.http, "/v1/completions"))
                    .header("X-data-parallel-rank", k.to_string())
                    .json(&json!({"prompt": p, "max_tokens": 1}))
                    .send()
                    .await
                    .unwrap();
                cached(&r.json::<Value>().await.unwrap())
            }
        };
        assert_eq!(with_rank(0).await, 0);
        assert_eq!(with_rank(1).await, 48);
        // SGLang's body field.
        let (_, v) = post(
            a.http,
            "/v1/completions",
            &json!({"prompt": p, "max_tokens": 1, "data_parallel_rank": 1}),
        )
        .await;
        assert_eq!(cached(&v), 48);
        let m = metrics(a.http, EngineKind::Vllm).await;
        assert_eq!(m.for_rank(0).unwrap().prefix_cache_queries, Some(64.0));
        assert_eq!(m.for_rank(1).unwrap().prefix_cache_queries, Some(192.0));
        // Without a hint, idle ranks tie and the lowest wins.
        let (_, v) = complete(a.http, &tokens(2, 20), 1).await;
        assert_eq!(v["usage"]["prompt_tokens"], 20);
        let m = metrics(a.http, EngineKind::Vllm).await;
        assert_eq!(m.for_rank(0).unwrap().prefix_cache_queries, Some(84.0));
    })
    .await;
}

/// Simulator-only: per-rank ports are a DP feature (see above); the separate-engines half
/// needs two engines.
#[tokio::test]
async fn dp_rank_ports_and_multiple_engines() {
    bounded(async {
        let (h, _) = start(|c| {
            c.dp_size = 2;
            c.dp_rank_ports = true;
            c.engines = 2;
        })
        .await;
        let all = h.addrs();
        assert_eq!(all.len(), 2);
        let json = h.ports_json();
        assert_eq!(json["engines"].as_array().unwrap().len(), 2);
        assert_eq!(
            json["engines"][1]["http_ranks"].as_array().unwrap().len(),
            2
        );
        let a = &all[0];
        assert_ne!(a.http_ranks[0], a.http_ranks[1]);
        let p = tokens(5, 40);
        assert_eq!(complete(a.http_ranks[1], &p, 1).await.0, 200);
        let text = metrics_text(a.http_ranks[1]).await;
        assert!(text.contains("engine=\"1\""));
        assert!(!text.contains("engine=\"0\""));
        assert_eq!(cached(&complete(a.http_ranks[1], &p, 1).await.1), 32);
        assert_eq!(cached(&complete(a.http_ranks[0], &p, 1).await.1), 0);
        // The second engine is a separate server with its own cache and hash seed.
        let b = &all[1];
        let mut sub_a = Sub::connect(a.kv_events[0]).await;
        let mut sub_b = Sub::connect(b.kv_events[0]).await;
        let q = tokens(6, 32);
        complete(a.http_ranks[0], &q, 1).await;
        complete(b.http_ranks[0], &q, 1).await;
        let ha = stored(&sub_a.drain_quiet(Duration::from_millis(300)).await);
        let hb = stored(&sub_b.drain_quiet(Duration::from_millis(300)).await);
        assert_eq!(ha.len(), 2);
        assert_eq!(hb.len(), 2);
        assert!(
            ha.iter().all(|x| !hb.contains(x)),
            "engine hashes are per process"
        );
    })
    .await;
}

/// Simulator-only: the SGLang flavor is checked against SGLang's metric names, not vLLM.
#[tokio::test]
async fn sglang_flavor_metrics() {
    bounded(async {
        let (_h, a) = start(|c| {
            c.flavor = kvroute_sim::server::Flavor::Sglang;
            c.dp_size = 2;
        })
        .await;
        let p = tokens(1, 64);
        complete(a.http, &p, 1).await;
        let (_, v) = post(
            a.http,
            "/v1/completions",
            &json!({"prompt": p, "max_tokens": 1, "data_parallel_rank": 0}),
        )
        .await;
        assert_eq!(cached(&v), 48);
        let m = metrics(a.http, EngineKind::Sglang).await;
        let r0 = m.for_rank(0).unwrap();
        assert_eq!(r0.kv_capacity_tokens(), Some(512 * 16));
        assert_eq!(r0.prefix_cache_hits, Some(48.0));
        assert_eq!(r0.prefix_cache_queries, Some(128.0));
        assert!(
            metrics_text(a.http)
                .await
                .contains("sglang:num_queue_reqs{dp_rank=\"1\"")
        );
    })
    .await;
}

/// Simulator-only: `background_prefill` is the simulator's stand-in for a GPU busy with other
/// traffic, for scale benchmarks.
#[tokio::test]
async fn background_prefill_publishes_a_busy_gpus_events_until_cleared() {
    bounded(async {
        // 32 usable blocks of 16 tokens per rank; 4-block prompts at 4,000 tokens/s fill it
        // within a quarter of a second
        let (_h, a) = start(|c| {
            c.dp_size = 2;
            c.engine.num_blocks = 33;
        })
        .await;
        let mut sub0 = Sub::connect(a.kv_events[0]).await;
        let mut sub1 = Sub::connect(a.kv_events[1]).await;
        let (status, body) = post(
            a.http,
            "/admin/fault",
            &json!({"kind": "background_prefill", "tokens_per_second": 4000, "prompt_tokens": 64, "rank": 1}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        let (status, body) = post(
            a.http,
            "/admin/fault",
            &json!({"kind": "background_prefill", "tokens_per_second": 0}),
        )
        .await;
        assert_eq!(status, 400, "a zero rate is refused: {body}");
        // the stream never goes quiet: read it until twice the cache has been stored (the
        // test's own deadline bounds the wait)
        let (mut stored_blocks, mut removed_blocks) = (0, 0);
        while stored_blocks < 64 {
            let Some((_, b)) = sub1.next(Duration::from_secs(5)).await else {
                panic!("the background load stopped after {stored_blocks} blocks");
            };
            assert_eq!(b.data_parallel_rank, Some(1));
            for e in &b.events {
                match e {
                    kvroute_routing::kv_events::KvEvent::BlockStored {
                        block_hashes,
                        token_ids,
                        ..
                    } => {
                        assert_eq!(token_ids.len(), block_hashes.len() * BS as usize);
                        stored_blocks += block_hashes.len();
                    }
                    kvroute_routing::kv_events::KvEvent::BlockRemoved { block_hashes, .. } => {
                        removed_blocks += block_hashes.len();
                    }
                    _ => {}
                }
            }
        }
        // all but the 32 blocks that fit were evicted again
        assert!(removed_blocks > 0 && removed_blocks <= stored_blocks);
        assert!(stored_blocks - removed_blocks <= 32);
        assert!(
            sub0.drain_quiet(Duration::from_millis(100)).await.is_empty(),
            "rank 0 was not loaded"
        );
        // served-request counters did not move
        let text = metrics_text(a.http).await;
        assert_eq!(
            contract::series(&text, "vllm:prompt_tokens_total", "engine=\"1\",model_name=\"sim-model\""),
            0.0
        );
        // cleared: the stream stops
        let (status, _) = post(a.http, "/admin/fault", &json!({"kind": "clear"})).await;
        assert_eq!(status, 200);
        sub1.drain_quiet(Duration::from_millis(100)).await;
        assert!(
            sub1.next(Duration::from_millis(300)).await.is_none(),
            "nothing published after the clear"
        );
    })
    .await;
}
