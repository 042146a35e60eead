//! The simulator's contract with routers: vLLM's HTTP API, metrics and KV events.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod sim_support;

use std::time::Duration;

use kvroute_picker::endpoint::EngineKind;
use kvroute_picker::kv_events::{EventEncoding, KvEvent};
use serde_json::{Value, json};
use sim_support::*;

#[tokio::test]
async fn cached_tokens_and_prefix_counters() {
    bounded(async {
        let (_h, a) = start(|_| {}).await;
        let p1 = tokens(1, 64);
        let (s, v) = complete(a.http, &p1, 4).await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(cached(&v), 0);
        assert_eq!(v["usage"]["prompt_tokens"], 64);
        assert_eq!(v["usage"]["completion_tokens"], 4);
        assert_eq!(v["choices"][0]["text"].as_str().unwrap().chars().count(), 4);
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(v["object"], "text_completion");

        let mut p2 = p1.clone();
        p2.extend(tokens(2, 20));
        let (_, v) = complete(a.http, &p2, 1).await;
        assert_eq!(cached(&v), 64);
        // The identical prompt recomputes its last block, like vLLM.
        let (_, v) = complete(a.http, &p1, 1).await;
        assert_eq!(cached(&v), 48);

        let m = metrics(a.http, EngineKind::Vllm).await;
        let s = m.for_rank(0).unwrap();
        assert_eq!(s.prefix_cache_queries, Some((64 + 84 + 64) as f64));
        assert_eq!(s.prefix_cache_hits, Some((64 + 48) as f64));
        assert_eq!((s.block_size, s.kv_capacity_blocks), (Some(BS), Some(512)));
        assert_eq!((s.waiting, s.running), (0.0, 0.0));
        let text = metrics_text(a.http).await;
        assert!(
            text.contains("vllm:prompt_tokens_total{engine=\"0\",model_name=\"sim-model\"} 212.0"),
            "{text}"
        );
        assert!(
            text.contains(
                "vllm:generation_tokens_total{engine=\"0\",model_name=\"sim-model\"} 6.0"
            )
        );
        assert!(text.contains(
            "vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"sim-model\"} 3.0"
        ));
    })
    .await;
}

#[tokio::test]
async fn streaming_completions_and_chat_follow_openai() {
    bounded(async {
        let (_h, a) = start(|_| {}).await;
        let body = json!({"model": MODEL, "prompt": "hello there", "max_tokens": 5,
            "stream": true, "stream_options": {"include_usage": true}});
        let r = client()
            .post(url(a.http, "/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert!(
            r.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/event-stream")
        );
        let text = r.text().await.unwrap();
        let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
        assert!(events.iter().all(|e| e.starts_with("data: ")), "{text}");
        assert_eq!(*events.last().unwrap(), "data: [DONE]");
        let chunks: Vec<Value> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(&e[6..]).unwrap())
            .collect();
        assert_eq!(chunks.len(), 6, "5 tokens and the usage chunk");
        for c in &chunks[..4] {
            assert_eq!(c["object"], "text_completion");
            assert_eq!(c["choices"][0]["finish_reason"], Value::Null);
            assert_eq!(c["choices"][0]["text"].as_str().unwrap().chars().count(), 1);
        }
        assert_eq!(chunks[4]["choices"][0]["finish_reason"], "length");
        assert_eq!(chunks[5]["choices"], json!([]));
        assert_eq!(chunks[5]["usage"]["completion_tokens"], 5);
        assert_eq!(
            chunks[5]["usage"]["prompt_tokens"], 11,
            "one id per character"
        );

        // Chat: role first, then content deltas; no usage chunk unless asked.
        let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3, "stream": true});
        let text = client()
            .post(url(a.http, "/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let chunks: Vec<Value> = text
            .split("\n\n")
            .filter(|e| e.starts_with("data: {"))
            .map(|e| serde_json::from_str(&e[6..]).unwrap())
            .collect();
        assert!(text.ends_with("data: [DONE]\n\n"));
        assert_eq!(chunks.len(), 4);
        assert_eq!(chunks[0]["object"], "chat.completion.chunk");
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(chunks[3]["choices"][0]["finish_reason"], "length");
        assert!(chunks.iter().all(|c| c.get("usage").is_none()));

        // Non-streaming chat.
        let (s, v) = post(
            a.http,
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 7}),
        )
        .await;
        assert_eq!(s, 200);
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["choices"][0]["message"]["role"], "assistant");
        assert_eq!(
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .chars()
                .count(),
            7
        );
        assert_eq!(
            v["usage"]["total_tokens"],
            v["usage"]["prompt_tokens"].as_u64().unwrap() + 7
        );
    })
    .await;
}

#[tokio::test]
async fn render_endpoints_and_multi_turn_reuse() {
    bounded(async {
        let (_h, a) = start(|_| {}).await;
        let (s, v) = post(
            a.http,
            "/v1/completions/render",
            &json!({"model": MODEL, "prompt": ["ab", "c"]}),
        )
        .await;
        assert_eq!(s, 200);
        assert_eq!(v.as_array().unwrap().len(), 2);
        assert_eq!(v[0]["token_ids"], json!([97, 98]));
        assert_eq!(v[1]["token_ids"], json!([99]));
        assert!(v[0]["request_id"].is_string());
        let (_, v) = post(
            a.http,
            "/v1/completions/render",
            &json!({"prompt": [5, 6, 7]}),
        )
        .await;
        assert_eq!(
            v,
            json!([{"request_id": v[0]["request_id"], "token_ids": [5, 6, 7]}])
        );

        // A long conversation: turn 2 resends turn 1 and its answer, so the answer's blocks
        // are reused too (output ids are the characters of the output text).
        let system = "You are a simulated assistant. ".repeat(8);
        let mut messages = vec![
            json!({"role": "system", "content": system}),
            json!({"role": "user", "content": "first question"}),
        ];
        let (_, r1) = post(
            a.http,
            "/v1/chat/completions/render",
            &json!({"messages": messages}),
        )
        .await;
        let turn1 = r1["token_ids"].as_array().unwrap().len() as u64;
        let (_, v1) = post(
            a.http,
            "/v1/chat/completions",
            &json!({"messages": messages, "max_tokens": 40}),
        )
        .await;
        assert_eq!(v1["usage"]["prompt_tokens"].as_u64().unwrap(), turn1);
        messages
            .push(json!({"role": "assistant", "content": v1["choices"][0]["message"]["content"]}));
        messages.push(json!({"role": "user", "content": "second question"}));
        let (_, v2) = post(
            a.http,
            "/v1/chat/completions",
            &json!({"messages": messages, "max_tokens": 2}),
        )
        .await;
        let reused = cached(&v2);
        assert!(
            reused > turn1,
            "turn 2 reuses turn 1's prompt and answer: {reused} <= {turn1}"
        );
        assert_eq!(reused % u64::from(BS), 0);
    })
    .await;
}

#[tokio::test]
async fn errors_are_openai_json() {
    bounded(async {
        let (_h, a) = start(|c| {
            c.engine.num_blocks = 8; // 128 tokens
            c.lora_modules = vec!["sql".into()];
        })
        .await;
        let check = |(s, v): (u16, Value), status: u16| {
            assert_eq!(s, status, "{v}");
            assert!(v["error"]["message"].is_string(), "{v}");
            assert_eq!(v["error"]["code"], status);
        };
        let raw = client()
            .post(url(a.http, "/v1/completions"))
            .body("{nope")
            .header("content-type", "application/json")
            .send()
            .await
            .unwrap();
        assert_eq!(raw.status(), 400);
        let v: Value = raw.json().await.unwrap();
        assert_eq!(v["error"]["type"], "BadRequestError");
        check(
            post(
                a.http,
                "/v1/completions",
                &json!({"model": "other", "prompt": "x"}),
            )
            .await,
            404,
        );
        check(
            post(a.http, "/v1/completions", &json!({"model": MODEL})).await,
            400,
        );
        check(
            post(
                a.http,
                "/v1/completions",
                &json!({"prompt": "x", "max_tokens": 0}),
            )
            .await,
            400,
        );
        check(
            post(a.http, "/v1/completions", &json!({"prompt": [1, -2]})).await,
            400,
        );
        check(
            post(a.http, "/v1/completions", &json!({"prompt": "x", "n": 2})).await,
            400,
        );
        check(
            post(
                a.http,
                "/v1/completions",
                &json!({"prompt": tokens(1, 120), "max_tokens": 20}),
            )
            .await,
            400,
        );
        check(
            post(a.http, "/v1/chat/completions", &json!({"messages": "hi"})).await,
            400,
        );
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
        let (_, m) = post(a.http, "/v1/models", &json!({})).await;
        assert_eq!(m, Value::Null, "models is GET only");
        let models: Value = client()
            .get(url(a.http, "/v1/models"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(models["data"][1]["id"], "sql");
        assert_eq!(models["data"][1]["parent"], MODEL);
        assert_eq!(
            client()
                .get(url(a.http, "/health"))
                .send()
                .await
                .unwrap()
                .status(),
            200
        );
    })
    .await;
}

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

async fn events_rekey_into_the_picker_index(encoding: EventEncoding) {
    let (_h, a) = start(|c| c.kv_encoding = encoding).await;
    let mut sub = Sub::connect(a.kv_events[0]).await;
    let system = tokens(100, 48);
    let mut prompts = Vec::new();
    for i in 0..4 {
        let mut p = system.clone();
        p.extend(tokens(i, 40));
        let (s, _) = complete(a.http, &p, 20).await;
        assert_eq!(s, 200);
        prompts.push(p);
    }
    let msgs = sub.drain(Duration::from_millis(300)).await;
    assert!(!msgs.is_empty());
    let seqs: Vec<u64> = msgs.iter().map(|m| m.0).collect();
    assert_eq!(
        seqs,
        (0..msgs.len() as u64).collect::<Vec<_>>(),
        "gapless from 0"
    );
    let mut view = PickerView::new();
    for (_, b) in &msgs {
        assert_eq!(b.data_parallel_rank, Some(0));
        assert!(b.ts > 1.6e9);
        view.apply(b);
    }
    for p in &prompts {
        // 88 prompt tokens + 19 computed output tokens = 107 = 6 full blocks; the prompt has 5.
        assert_eq!(view.matched(p), 5, "{encoding:?}");
    }
    assert_eq!(view.matched(&tokens(9, 64)), 0);
    // A new request sharing the system prompt is predicted exactly.
    let mut q = system.clone();
    q.extend(tokens(77, 30));
    let predicted = view.matched(&q) * BS;
    let (_, v) = complete(a.http, &q, 1).await;
    assert_eq!(cached(&v), u64::from(predicted));
    assert_eq!(predicted, 48);
}

/// The last-token rule, as vLLM applies it: a fully cached block-aligned prompt of k blocks
/// hits k-1 blocks, in the response's `cached_tokens` and in
/// `vllm:prefix_cache_hits_total`; and the picker, crediting `servable_blocks` of what its
/// index holds, predicts exactly that.
#[tokio::test]
async fn a_fully_cached_block_aligned_prompt_hits_all_but_its_last_block() {
    bounded(async {
        let (_h, a) = start(|_| {}).await;
        let mut sub = Sub::connect(a.kv_events[0]).await;
        let p = tokens(21, 8 * BS);
        assert_eq!(complete(a.http, &p, 1).await.0, 200);
        let mut view = PickerView::new();
        for (_, b) in &sub.drain(Duration::from_millis(300)).await {
            view.apply(b);
        }
        // the index holds all 8 blocks of the prompt
        assert_eq!(view.matched(&p), 8);
        let credit = view
            .matched(&p)
            .min(kvroute_picker::router::servable_blocks(8 * BS, BS))
            * BS;
        let before = metrics(a.http, EngineKind::Vllm).await;
        let (_, v) = complete(a.http, &p, 1).await;
        let after = metrics(a.http, EngineKind::Vllm).await;
        assert_eq!(cached(&v), u64::from(7 * BS));
        assert_eq!(u64::from(credit), cached(&v));
        let hits = |m: &kvroute_picker::engine_metrics::EngineMetrics| {
            m.for_rank(0).unwrap().prefix_cache_hits.unwrap()
        };
        assert_eq!(hits(&after) - hits(&before), f64::from(7 * BS));
    })
    .await;
}

#[tokio::test]
async fn kv_events_rekey_into_the_picker_index_in_every_encoding() {
    bounded(async {
        for e in [
            EventEncoding::Array,
            EventEncoding::MapEvents,
            EventEncoding::Map,
        ] {
            events_rekey_into_the_picker_index(e).await;
        }
    })
    .await;
}

#[tokio::test]
async fn eviction_is_published_and_visible() {
    bounded(async {
        // 16 blocks of 16 tokens.
        let (_h, a) = start(|c| c.engine.num_blocks = 16).await;
        let mut sub = Sub::connect(a.kv_events[0]).await;
        let mut view = PickerView::new();
        let ps: Vec<Vec<u32>> = (0..3).map(|i| tokens(i, 96)).collect();
        for p in &ps {
            assert_eq!(complete(a.http, p, 1).await.0, 200);
        }
        let msgs = sub.drain(Duration::from_millis(300)).await;
        let removed: usize = msgs
            .iter()
            .flat_map(|(_, b)| b.events.iter())
            .map(|e| match e {
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                } => {
                    assert_eq!(medium.as_deref(), Some("GPU"));
                    block_hashes.len()
                }
                _ => 0,
            })
            .sum();
        // Three 6-block prompts in 16 blocks: the third evicts two of the first's blocks
        // (its tail first).
        assert_eq!(removed, 2);
        for (_, b) in &msgs {
            view.apply(b);
        }
        assert_eq!(view.matched(&ps[0]), 4);
        assert_eq!(view.matched(&ps[1]), 6);
        let (_, v) = complete(a.http, &ps[0], 1).await;
        assert_eq!(cached(&v), 64);
        let m = metrics(a.http, EngineKind::Vllm).await;
        assert_eq!(m.for_rank(0).unwrap().kv_usage, 0.0);
    })
    .await;
}

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
        let live = sub.drain(Duration::from_millis(300)).await;
        let seqs: Vec<u64> = live.iter().map(|m| m.0).collect();
        assert_eq!(seqs, vec![0, 2], "batch 1 was dropped");

        let mut view = PickerView::new();
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
        let msgs = sub1.drain(Duration::from_millis(300)).await;
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
        let ha = stored(&sub_a.drain(Duration::from_millis(300)).await);
        let hb = stored(&sub_b.drain(Duration::from_millis(300)).await);
        assert_eq!(ha.len(), 2);
        assert_eq!(hb.len(), 2);
        assert!(
            ha.iter().all(|x| !hb.contains(x)),
            "engine hashes are per process"
        );
    })
    .await;
}

fn stored(msgs: &[(u64, kvroute_picker::kv_events::EventBatch)]) -> Vec<u64> {
    msgs.iter()
        .flat_map(|(_, b)| b.events.iter())
        .flat_map(|e| match e {
            KvEvent::BlockStored { block_hashes, .. } => block_hashes.clone(),
            _ => Vec::new(),
        })
        .collect()
}

#[tokio::test]
async fn sglang_flavor_metrics() {
    bounded(async {
        let (_h, a) = start(|c| {
            c.flavor = kvroute_e2e::sim::server::Flavor::Sglang;
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

#[tokio::test]
async fn a_real_tokenizer_gives_the_routers_ids() {
    use kvroute_picker::tokenize::{PromptInput, PromptTokenizer, PromptTokenizerOptions};
    bounded(async {
        let dir = std::path::PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../picker/tests/fixtures/tokenizer"
        ));
        let json = std::fs::read(dir.join("tokenizer.json")).unwrap();
        let config = std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap();
        let router_side = PromptTokenizer::from_hf_files(
            Some(&json),
            Some(&config),
            PromptTokenizerOptions::default(),
        )
        .unwrap();
        let (_h, a) = start(|c| c.tokenizer = Some(dir.clone())).await;

        let text = "The quick brown fox jumps over the lazy dog.";
        let (s, v) = post(a.http, "/v1/completions/render", &json!({"prompt": text})).await;
        assert_eq!(s, 200, "{v}");
        let expect = router_side.tokenize(PromptInput::Text(text)).unwrap().ids;
        assert_eq!(v[0]["token_ids"], json!(expect));

        let messages =
            json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]);
        let (s, v) = post(
            a.http,
            "/v1/chat/completions/render",
            &json!({"messages": messages}),
        )
        .await;
        assert_eq!(s, 200, "{v}");
        let expect = router_side
            .tokenize(PromptInput::Chat {
                messages: &messages,
                tools: None,
                add_generation_prompt: true,
                extra: None,
            })
            .unwrap()
            .ids;
        assert_eq!(v["token_ids"], json!(expect));
        let (_, v) = post(
            a.http,
            "/v1/chat/completions",
            &json!({"messages": messages, "max_tokens": 2}),
        )
        .await;
        assert_eq!(v["usage"]["prompt_tokens"], expect.len());
    })
    .await;
}
