//! Criterion benchmarks of the routing core's hot paths, swept over scale (endpoints 8/64/512,
//! prompts 8k/32k/128k tokens). Results and the machine are recorded in `picker/BENCHMARKS.md`.

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvroute_routing::block_keys::{BlockHasher, ChainRoot};
use kvroute_routing::config::{RoutingConfig, Strategy};
use kvroute_routing::endpoint::{Endpoint, EndpointId, EndpointSet, ModelConfig};
use kvroute_routing::index::{IndexMode, KvIndex, PrefixMatch};
use kvroute_routing::inflight::InflightTracker;
use kvroute_routing::kv_events::ingest::IngestKeys;
use kvroute_routing::kv_events::{EventBatch, KvEvent};
use kvroute_routing::load::{EndpointLoad, LoadTable};
use kvroute_routing::place::{Pool, PoolSettings};
use kvroute_routing::plan::{PlanInput, RequestPlan, Scope};
use kvroute_routing::pool_state::PoolMember;
use kvroute_routing::router::{RouteContext, Router};
use kvroute_routing::tokenize::TokenKind;

const BLOCK: u32 = 16;

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x % 128_000
        })
        .collect()
}

fn endpoint(i: usize) -> EndpointId {
    EndpointId::new(
        IpAddr::V4(Ipv4Addr::new(10, (i >> 8) as u8, i as u8, 1)),
        8000,
        0,
    )
}

/// An index where every endpoint holds a shared 1k-token system prompt plus noise, and one
/// endpoint (in the middle of the set) holds the whole request prompt.
fn populated_index(n_endpoints: usize, prompt: &[u32]) -> KvIndex {
    let h = BlockHasher::new(BLOCK);
    let root = ChainRoot::new("model", None, None);
    let keys = h.keys(root, prompt);
    let shared = 1024 / BLOCK as usize;
    let mut ix = KvIndex::default();
    for i in 0..n_endpoints {
        let slot = ix
            .add_endpoint(endpoint(i), IndexMode::Precise, 1 << 22)
            .expect("slot");
        let mut pairs: Vec<(u64, u64)> = keys[..shared.min(keys.len())]
            .iter()
            .map(|&k| (k ^ i as u64, k))
            .collect();
        if i == n_endpoints / 2 {
            pairs = keys.iter().map(|&k| (k ^ i as u64, k)).collect();
        }
        // 2k unrelated blocks per endpoint
        let noise = h.keys(root, &tokens(1000 + i as u32, 2048 * BLOCK as usize));
        pairs.extend(noise.iter().map(|&k| (k, k)));
        ix.store(slot, &pairs).expect("store");
    }
    ix
}

fn bench_longest_prefix(c: &mut Criterion) {
    let mut g = c.benchmark_group("longest_prefix");
    g.measurement_time(Duration::from_secs(2)).sample_size(20);
    for &n in &[8usize, 64, 512] {
        for &t in &[8 * 1024usize, 32 * 1024, 128 * 1024] {
            let prompt = tokens(7, t);
            let ix = populated_index(n, &prompt);
            let keys = BlockHasher::new(BLOCK).keys(ChainRoot::new("model", None, None), &prompt);
            let mut out: Vec<PrefixMatch> = Vec::with_capacity(n);
            g.throughput(Throughput::Elements(keys.len() as u64));
            g.bench_with_input(
                BenchmarkId::new(format!("{n}ep"), format!("{}k", t / 1024)),
                &keys,
                |b, keys| {
                    b.iter(|| {
                        ix.longest_prefix(black_box(keys), &mut out);
                        black_box(out.len())
                    })
                },
            );
        }
    }
    g.finish();
}

fn bench_hashing(c: &mut Criterion) {
    let mut g = c.benchmark_group("block_key_hashing");
    g.measurement_time(Duration::from_secs(2)).sample_size(20);
    let h = BlockHasher::new(BLOCK);
    let root = ChainRoot::new("model", None, None);
    let mut out = Vec::new();
    for &t in &[8 * 1024usize, 32 * 1024, 128 * 1024] {
        let prompt = tokens(3, t);
        g.throughput(Throughput::Elements(t as u64));
        g.bench_with_input(
            BenchmarkId::from_parameter(format!("{}k", t / 1024)),
            &prompt,
            |b, p| {
                b.iter(|| {
                    out.clear();
                    h.keys_into(root, black_box(p), &mut out);
                    black_box(out.len())
                })
            },
        );
    }
    g.finish();
}

/// The engine's KV events that leave endpoint `i` holding what [`populated_index`] gives it.
fn stored_events(i: usize, n_endpoints: usize, prompt: &[u32]) -> EventBatch {
    let shared = 1024;
    let held = if i == n_endpoints / 2 {
        prompt.len()
    } else {
        shared.min(prompt.len())
    };
    let stored = |seed: u64, token_ids: Vec<u32>| {
        KvEvent::plain_stored(
            (0..token_ids.len() as u64 / u64::from(BLOCK))
                .map(|b| seed ^ (b << 20) ^ i as u64)
                .collect(),
            None,
            token_ids,
            BLOCK,
        )
    };
    EventBatch {
        ts: 0.0,
        events: vec![
            stored(1 << 40, prompt[..held].to_vec()),
            // 2k unrelated blocks per endpoint
            stored(2 << 40, tokens(1000 + i as u32, 2048 * BLOCK as usize)),
        ],
        data_parallel_rank: Some(0),
        skipped_unknown: 0,
    }
}

/// Plan (hash, salt, bounds) + match + features + score + choice + in-flight cap for one
/// request, two ways over the same pool: `router` calls `Router::decide` and the cap by hand
/// (the path before the `Pool` existed), `pool` is `Pool::place` then `Pool::record`, as the
/// service, the offline benchmark and the tests decide now.
fn bench_decision(c: &mut Criterion) {
    let mut g = c.benchmark_group("decision");
    g.measurement_time(Duration::from_secs(3)).sample_size(20);
    g.throughput(Throughput::Elements(1));
    let mc = Arc::new(ModelConfig::new("default", "model"));
    let load = |i: usize| EndpointLoad {
        waiting: (i % 3) as f64,
        running: (i % 5) as f64,
        kv_usage: 0.5,
        kv_capacity_blocks: Some(31_250),
        sampled_at_ms: 0,
        lora: None,
    };
    for &n in &[8usize, 64] {
        let prompt = tokens(11, 8 * 1024);
        let ix = populated_index(n, &prompt);
        let set = EndpointSet::new(
            (0..n)
                .map(|i| Endpoint::new(endpoint(i), mc.clone()))
                .collect(),
        );
        let mut loads = LoadTable::new();
        for i in 0..n {
            loads.update(endpoint(i), load(i));
        }
        let inflight = InflightTracker::new();
        let plan = || {
            RequestPlan::new(PlanInput {
                config: &mc,
                lora: None,
                tokens: black_box(&prompt),
                token_kind: TokenKind::Tokens,
                char_chunk_tokens: BLOCK,
                tenant_salt: None,
                client_salt: None,
                session: None,
                request_bytes: b"{}",
                max_prompt_tokens: usize::MAX,
            })
            .expect("plan")
        };
        for strategy in [Strategy::CostModel, Strategy::Weighted] {
            let routing = RoutingConfig {
                strategy,
                ..RoutingConfig::default()
            };
            let router = Router::new(routing.clone());
            let snap = set.load();
            let cap = kvroute_routing::inflight::DEFAULT_MAX_PER_ENDPOINT;
            g.bench_function(
                BenchmarkId::new(format!("8k_{}_router", strategy.as_str()), format!("{n}ep")),
                |b| {
                    b.iter(|| {
                        let plan = plan();
                        let ctx = RouteContext::at(&snap, &ix, &loads, &inflight, 0);
                        let req = plan.route_request(&mc, Scope::default(), false);
                        black_box(router.decide(&ctx, &req).ok().and_then(|d| {
                            d.within_inflight_cap(&inflight, cap).map(|d| d.endpoint)
                        }))
                    })
                },
            );
            // the service's default calibrates; `_pool_static` has calibration off, as `_router`;
            // `_pool_flow` has flow control on, with the headroom check a request makes before
            // it is placed (the pool not saturated: it goes straight on)
            for (calibrate, flow, suffix) in [
                (true, false, ""),
                (false, false, "_static"),
                (true, true, "_flow"),
            ] {
                let mut routing = routing.clone();
                routing.cost_model.calibrate = calibrate;
                routing.flow_control.enabled = flow;
                routing.saturation.queue_depth = 100;
                let saturation = routing.saturation;
                let pool = Pool::new(PoolSettings::default(), Router::new(routing));
                let members = (0..n)
                    .map(|i| PoolMember {
                        endpoint: Endpoint::new(endpoint(i), mc.clone()),
                        precise: true,
                        kv_capacity_blocks: Some(1 << 20),
                    })
                    .collect();
                pool.apply_view(members, || {}).expect("view");
                let keys = IngestKeys {
                    hasher: BlockHasher::new(BLOCK),
                    model: "model",
                };
                for i in 0..n {
                    pool.state()
                        .apply_batch(&endpoint(i), keys, &stored_events(i, n, &prompt))
                        .expect("precise");
                }
                pool.state()
                    .learn_loads((0..n).map(|i| (endpoint(i), load(i))));
                g.bench_function(
                    BenchmarkId::new(
                        format!("8k_{}_pool{suffix}", strategy.as_str()),
                        format!("{n}ep"),
                    ),
                    |b| {
                        b.iter(|| {
                            let plan = plan();
                            // as the service: the endpoints with room (the headroom check), then
                            // placement among them (`placement: WithRoom`)
                            let room: Option<Vec<EndpointId>> = flow.then(|| {
                                let rooms: Vec<EndpointId> = pool
                                    .rooms("default", &saturation)
                                    .into_iter()
                                    .map(|(e, _)| e)
                                    .collect();
                                assert!(!rooms.is_empty(), "the pool has headroom");
                                rooms
                            });
                            let allow = |e: &Endpoint| {
                                room.as_ref().is_none_or(|r| r.binary_search(&e.id).is_ok())
                            };
                            let scope = Scope {
                                allow: room
                                    .is_some()
                                    .then_some(&allow as &(dyn Fn(&Endpoint) -> bool + Sync)),
                                ..Scope::default()
                            };
                            let req = plan.route_request(&mc, scope, false);
                            let placed = pool.place(&req, 0).ok();
                            if let Some(p) = &placed {
                                pool.record(p, &plan.keys, 0);
                            }
                            black_box(placed.map(|p| p.decision.endpoint))
                        })
                    },
                );
            }
        }
    }
    g.finish();
}

/// Tokenization of a completion prompt and of a chat rendered through its template, with the
/// test tokenizer (a small byte-level BPE; see BENCHMARKS.md for what that means): cold (no
/// piece cache), the same prompt again (warm cache), and the next turn of a conversation
/// (history in the cache, one new message).
fn bench_tokenize(c: &mut Criterion) {
    use kvroute_routing::request::{ApiKind, ParsedRequest, RequestLimits};
    use kvroute_routing::tokenize::{PromptInput, PromptTokenizer, PromptTokenizerOptions};
    let build = |piece_cache_tokens| {
        PromptTokenizer::from_hf_files(
            Some(include_bytes!("../tests/fixtures/tokenizer/tokenizer.json")),
            Some(include_str!(
                "../tests/fixtures/tokenizer/tokenizer_config.json"
            )),
            PromptTokenizerOptions {
                piece_cache_tokens,
                ..PromptTokenizerOptions::default()
            },
        )
        .expect("fixture tokenizer")
    };
    let cold = build(0);
    let warm = build(PromptTokenizerOptions::default().piece_cache_tokens);
    let chat = |tok: &PromptTokenizer, messages: &serde_json::Value| {
        tok.tokenize(PromptInput::Chat {
            messages,
            tools: None,
            add_generation_prompt: true,
            extra: None,
            add_special_tokens: false,
        })
        .map(|t| t.ids.len())
    };
    let mut g = c.benchmark_group("tokenize");
    g.measurement_time(Duration::from_secs(3)).sample_size(10);
    let sentence = "KV-cache aware routing sends requests that share a prompt prefix to the same \
                    server, unless the queue there costs more than the prefill it saves. ";
    for target in [8 * 1024usize, 128 * 1024] {
        // 16 paragraphs of about target/16 tokens each
        let mut paragraphs = Vec::new();
        let mut n = 0;
        for _ in 0..16 {
            let mut p = String::new();
            while cold
                .tokenize(PromptInput::Text(&p))
                .map_or(0, |t| t.ids.len())
                < target / 16
            {
                for _ in 0..16 {
                    p.push_str(sentence);
                    p.push_str(&n.to_string());
                    p.push(' ');
                    n += 1;
                }
            }
            paragraphs.push(p);
        }
        let text = paragraphs.concat();
        let label = format!("{}k", target / 1024);
        let n_tokens = cold
            .tokenize(PromptInput::Text(&text))
            .map_or(0, |t| t.ids.len());
        g.throughput(Throughput::Elements(n_tokens as u64));
        for (name, tok) in [("text_cold", &cold), ("text_repeated", &warm)] {
            g.bench_function(BenchmarkId::new(name, &label), |b| {
                b.iter(|| {
                    black_box(tok.tokenize(PromptInput::Text(black_box(&text))))
                        .map(|t| t.ids.len())
                })
            });
        }
        // a conversation: the paragraphs as alternating turns, then a new question each time
        let mut history: Vec<serde_json::Value> =
            vec![serde_json::json!({"role": "system", "content": "You are a helpful assistant."})];
        for (i, p) in paragraphs.iter().enumerate() {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            history.push(serde_json::json!({"role": role, "content": p}));
        }
        let turn = |i: u64| {
            let mut m = history.clone();
            m.push(serde_json::json!({"role": "user", "content": format!("question {i}: why?")}));
            serde_json::Value::Array(m)
        };
        let fixed = turn(0);
        for (name, tok) in [("chat_cold", &cold), ("chat_repeated", &warm)] {
            g.bench_function(BenchmarkId::new(name, &label), |b| {
                b.iter(|| black_box(chat(tok, black_box(&fixed))))
            });
        }
        let mut i = 0;
        g.bench_function(BenchmarkId::new("chat_next_turn", &label), |b| {
            b.iter_batched(
                || {
                    i += 1;
                    turn(i)
                },
                |m| black_box(chat(&warm, &m)),
                criterion::BatchSize::LargeInput,
            )
        });
        // the same next turn as a whole request body, parsed and tokenized: through chat
        // completions, and through the Responses API (its items mapped to the same chat)
        let body = |i: u64, responses: bool| {
            let m = turn(i);
            let v = if responses {
                let items = m.as_array().map_or(&[][..], Vec::as_slice);
                serde_json::json!({
                    "model": "m",
                    "instructions": items[0]["content"],
                    "input": items[1..].iter().map(|t| if t["role"] == "assistant" {
                        serde_json::json!({"type": "message", "role": "assistant",
                            "content": [{"type": "output_text", "text": t["content"]}]})
                    } else {
                        serde_json::json!({"role": "user", "content": [{"type": "input_text", "text": t["content"]}]})
                    }).collect::<Vec<_>>(),
                })
            } else {
                serde_json::json!({"model": "m", "messages": m})
            };
            bytes::Bytes::from(serde_json::to_vec(&v).expect("json"))
        };
        for (name, kind) in [
            ("chat_request_next_turn", ApiKind::ChatCompletions),
            ("responses_request_next_turn", ApiKind::Responses),
        ] {
            let mut i = 0;
            g.bench_function(BenchmarkId::new(name, &label), |b| {
                b.iter_batched(
                    || {
                        i += 1;
                        body(i, kind == ApiKind::Responses)
                    },
                    |raw| {
                        let req = ParsedRequest::parse(kind, raw, &RequestLimits::default())
                            .expect("a valid body");
                        black_box(warm.tokenize(req.prompt_input().expect("a prompt")))
                            .map(|t| t.ids.len())
                    },
                    criterion::BatchSize::LargeInput,
                )
            });
        }
    }
    g.finish();
}

/// Warm start (issue 52): copying one endpoint's view out of the index and loading it into
/// another picker's, for an engine whose cache is full (31,250 blocks of 16 tokens: 500k
/// tokens, the bench's default engine), stored as chains of 64 blocks.
fn bench_index_copy(c: &mut Criterion) {
    const BLOCKS: usize = 31_250;
    let mut g = c.benchmark_group("index_copy");
    g.measurement_time(Duration::from_secs(3)).sample_size(20);
    g.throughput(Throughput::Elements(BLOCKS as u64));
    let h = BlockHasher::new(BLOCK);
    let root = ChainRoot::new("model", None, None);
    let mut ix = KvIndex::default();
    let slot = ix
        .add_endpoint(endpoint(0), IndexMode::Precise, BLOCKS)
        .expect("slot");
    let mut seed = 0u32;
    while ix.endpoint_blocks(slot) + 64 <= BLOCKS {
        let keys = h.keys(root, &tokens(seed, 64 * BLOCK as usize));
        let pairs: Vec<(u64, u64)> = keys.iter().map(|&k| (k.rotate_left(7), k)).collect();
        ix.store(slot, &pairs).expect("store");
        seed += 1;
    }
    let copy = ix.export_endpoint(slot).expect("precise");
    g.bench_function("export_full_endpoint", |b| {
        b.iter(|| black_box(ix.export_endpoint(slot).map(|e| e.blocks.len())))
    });
    g.bench_function("seed_full_endpoint", |b| {
        b.iter_batched(
            || {
                let mut fresh = KvIndex::default();
                let s = fresh
                    .add_endpoint(endpoint(0), IndexMode::Precise, BLOCKS)
                    .expect("slot");
                (fresh, s)
            },
            |(mut fresh, s)| {
                black_box(
                    fresh
                        .seed_endpoint(s, &copy.blocks, u64::MAX)
                        .expect("seeded"),
                );
                fresh
            },
            criterion::BatchSize::LargeInput,
        )
    });
    g.finish();
}

/// Decoding one engine step's KV events as vLLM publishes them (map events): a 2,048-token
/// prompt stored (128 blocks of 16 tokens, ids below 128k) and the 128 blocks it evicted, each
/// in a `BlockRemoved` of its own; the busy GPU of `kvroute-bench scale`.
fn bench_event_decode(c: &mut Criterion) {
    use kvroute_routing::kv_events::{
        DecodeLimits, EventEncoding, decode_event_batch, encode_event_batch,
    };
    let ids: Vec<u32> = tokens(3, 2048).iter().map(|t| t % 128_000).collect();
    let mut events = vec![KvEvent::plain_stored(
        (0..128).map(|i| 0x5eed_0000 + i).collect(),
        Some(7),
        ids,
        BLOCK,
    )];
    events.extend((0..128u64).map(|i| KvEvent::BlockRemoved {
        block_hashes: vec![0xdead_0000 + i],
        medium: Some("GPU".into()),
        place: Default::default(),
    }));
    let bytes = encode_event_batch(&EventBatch::new(1.0, events), EventEncoding::MapEvents);
    let limits = DecodeLimits::default();
    let mut g = c.benchmark_group("event_decode");
    g.measurement_time(Duration::from_secs(3));
    g.throughput(Throughput::Elements(256));
    g.bench_function("store_128_blocks_evict_128", |b| {
        b.iter(|| black_box(decode_event_batch(black_box(&bytes), &limits).map(|b| b.events.len())))
    });
    g.finish();
}

/// Parsing a vLLM server's `/metrics` page (the fixture: a real vLLM exposition, 30 KB), as
/// the scraper does for every server every interval.
fn bench_metrics_parse(c: &mut Criterion) {
    use kvroute_routing::endpoint::EngineKind;
    use kvroute_routing::engine_metrics::{ParseLimits, parse_engine_metrics};
    let text = include_str!("../tests/fixtures/metrics/vllm.txt");
    let limits = ParseLimits::default();
    let mut g = c.benchmark_group("metrics_parse");
    g.measurement_time(Duration::from_secs(3));
    g.throughput(Throughput::Bytes(text.len() as u64));
    g.bench_function("vllm_page", |b| {
        b.iter(|| {
            black_box(parse_engine_metrics(black_box(text), EngineKind::Vllm, &limits).is_ok())
        })
    });
    g.finish();
}

criterion_group!(
    benches,
    bench_metrics_parse,
    bench_event_decode,
    bench_index_copy,
    bench_longest_prefix,
    bench_hashing,
    bench_decision,
    bench_tokenize
);
criterion_main!(benches);
