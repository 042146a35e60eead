use super::*;

use kvroute_routing::block_keys::{BlockHasher, ChainRoot};
use kvroute_routing::endpoint::EndpointId;
use kvroute_routing::index::{IndexMode, KvIndex};
use kvroute_routing::kv_events::EventBatch;
use kvroute_routing::kv_events::ingest::{IngestKeys, apply_batch};

fn cfg(num_blocks: u32) -> EngineConfig {
    EngineConfig {
        block_size: 4,
        num_blocks,
        max_num_seqs: 16,
        max_num_batched_tokens: 1024,
        hash_seed: 42,
        ..EngineConfig::default()
    }
}

fn req(id: RequestId, tokens: Vec<u32>, max_tokens: u32) -> Request {
    Request {
        remote_blocks: 0,
        id,
        token_ids: tokens,
        max_tokens,
        cache_salt: None,
        lora: None,
    }
}

/// A precise index with one endpoint, keyed as the engines of these tests (block size 4,
/// model `m`).
fn precise_index() -> (KvIndex, kvroute_routing::index::Slot, IngestKeys<'static>) {
    let mut index = KvIndex::default();
    let slot = index
        .add_endpoint(
            EndpointId::new(std::net::Ipv4Addr::LOCALHOST.into(), 8000, 0),
            IndexMode::Precise,
            1000,
        )
        .unwrap();
    let keys = IngestKeys {
        hasher: BlockHasher::new(4),
        model: "m",
    };
    (index, slot, keys)
}

fn toks(start: u32, n: u32) -> Vec<u32> {
    (start..start + n).collect()
}

/// Steps until idle; returns every outcome.
fn run(rank: &mut Rank) -> Vec<StepOutcome> {
    let mut out = Vec::new();
    for _ in 0..100_000 {
        match rank.next_step() {
            Some(o) => out.push(o),
            None => return out,
        }
    }
    panic!("engine did not go idle");
}

fn events(outcomes: &[StepOutcome]) -> Vec<KvEvent> {
    outcomes.iter().flat_map(|o| o.kv_events.clone()).collect()
}

fn finished(outcomes: &[StepOutcome]) -> Vec<FinishedRequest> {
    outcomes.iter().flat_map(|o| o.finished.clone()).collect()
}

fn stored_hashes(ev: &[KvEvent]) -> Vec<u64> {
    ev.iter()
        .flat_map(|e| match e {
            KvEvent::BlockStored { block_hashes, .. } => block_hashes.clone(),
            _ => Vec::new(),
        })
        .collect()
}

fn removed_hashes(ev: &[KvEvent]) -> Vec<u64> {
    ev.iter()
        .flat_map(|e| match e {
            KvEvent::BlockRemoved { block_hashes, .. } => block_hashes.clone(),
            _ => Vec::new(),
        })
        .collect()
}

#[test]
fn prefix_is_reused_and_reported() {
    let mut r = Rank::new(cfg(64));
    r.submit(req(1, toks(0, 16), 2)).unwrap();
    let o1 = run(&mut r);
    let f = finished(&o1);
    assert_eq!(f.len(), 1);
    assert_eq!(
        (f[0].prompt_tokens, f[0].cached_tokens, f[0].output_tokens),
        (16, 0, 2)
    );
    // Prompt (4 blocks) stored in the prefill step; the output never fills a fifth block.
    let ev = events(&o1);
    assert_eq!(stored_hashes(&ev).len(), 4);
    match &ev[0] {
        KvEvent::BlockStored {
            parent_block_hash,
            token_ids,
            block_size,
            medium,
            lora_name,
            ..
        } => {
            assert_eq!(*parent_block_hash, None);
            assert_eq!(*token_ids, toks(0, 16));
            assert_eq!(*block_size, 4);
            assert_eq!(medium.as_deref(), Some("GPU"));
            assert_eq!(*lora_name, None);
        }
        other => panic!("unexpected {other:?}"),
    }

    // A longer prompt with the same 16-token prefix hits all 4 blocks and stores the rest
    // with the 4th block as parent.
    let mut p2 = toks(0, 16);
    p2.extend(toks(100, 8));
    r.submit(req(2, p2, 1)).unwrap();
    let o2 = run(&mut r);
    assert_eq!(finished(&o2)[0].cached_tokens, 16);
    let first4 = stored_hashes(&ev);
    match &o2[0].kv_events[..] {
        [
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                ..
            },
        ] => {
            assert_eq!(block_hashes.len(), 2);
            assert_eq!(*parent_block_hash, Some(first4[3]));
            assert_eq!(*token_ids, toks(100, 8));
        }
        other => panic!("unexpected {other:?}"),
    }
    // Exactly the same prompt: the last token is recomputed, so the hit stops one block
    // short and the recomputed block is registered again under the same hash.
    r.submit(req(3, toks(0, 16), 1)).unwrap();
    let o3 = run(&mut r);
    assert_eq!(finished(&o3)[0].cached_tokens, 12);
    assert_eq!(stored_hashes(&events(&o3)), vec![first4[3]]);
    let s = r.stats();
    assert_eq!(s.prefix_cache_queries, 16 + 24 + 16);
    assert_eq!(s.prefix_cache_hits, 16 + 12);
    assert_eq!(s.prompt_tokens, 16 + 24 + 16);
    assert_eq!(s.generation_tokens, 2 + 1 + 1);
    assert_eq!(r.probe_prefix(&toks(0, 17), None, None), 16);
    assert_eq!(r.probe_prefix(&toks(1, 17), None, None), 0);
}

#[test]
fn output_blocks_are_cached_too() {
    let mut r = Rank::new(cfg(64));
    r.submit(req(1, toks(0, 6), 7)).unwrap();
    let o = run(&mut r);
    // 6 prompt + 6 computed output tokens = 12 tokens = 3 full blocks; the 7th output token
    // is never computed.
    let ev = events(&o);
    assert_eq!(stored_hashes(&ev).len(), 3);
    let out_tokens: Vec<u32> = o
        .iter()
        .flat_map(|s| s.tokens.iter().map(|t| t.1))
        .collect();
    assert_eq!(out_tokens.len(), 7);
    // A follow-up turn carrying the prompt and the output hits all three blocks.
    let mut next = toks(0, 6);
    next.extend(&out_tokens);
    next.extend(toks(500, 3));
    assert_eq!(r.probe_prefix(&next, None, None), 12);
    // Output tokens are printable pseudo-text.
    assert!(
        out_tokens
            .iter()
            .all(|&t| t == u32::from(b' ') || (u32::from(b'a')..=u32::from(b'z')).contains(&t))
    );
}

#[test]
fn salt_and_lora_isolate_blocks() {
    let mut r = Rank::new(cfg(64));
    let mut a = req(1, toks(0, 16), 1);
    a.cache_salt = Some("tenant-a".into());
    r.submit(a).unwrap();
    run(&mut r);
    let prompt = toks(0, 17);
    assert_eq!(r.probe_prefix(&prompt, Some("tenant-a"), None), 16);
    assert_eq!(r.probe_prefix(&prompt, Some("tenant-b"), None), 0);
    assert_eq!(r.probe_prefix(&prompt, None, None), 0);
    assert_eq!(r.probe_prefix(&prompt, Some("tenant-a"), Some("sql")), 0);

    let mut b = req(2, toks(0, 16), 1);
    b.lora = Some("sql".into());
    r.submit(b).unwrap();
    let o = run(&mut r);
    assert_eq!(finished(&o)[0].cached_tokens, 0);
    match &o[0].kv_events[0] {
        KvEvent::BlockStored {
            lora_name, lora_id, ..
        } => {
            assert_eq!(lora_name.as_deref(), Some("sql"));
            assert_eq!(*lora_id, Some(1));
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(r.probe_prefix(&prompt, None, Some("sql")), 16);
}

#[test]
fn eviction_is_lru_and_only_when_needed() {
    // 8 usable blocks of 4 tokens (and vLLM's null block).
    let mut r = Rank::new(cfg(9));
    r.submit(req(1, toks(0, 12), 1)).unwrap(); // blocks a0 a1 a2
    run(&mut r);
    r.submit(req(2, toks(100, 12), 1)).unwrap(); // blocks b0 b1 b2
    let ob = run(&mut r);
    let hb = stored_hashes(&events(&ob));
    assert_eq!(removed_hashes(&events(&ob)), Vec::<u64>::new());
    // Touch A again so that B becomes the least recently used prefix.
    r.submit(req(3, toks(0, 13), 1)).unwrap();
    let oa = run(&mut r);
    assert_eq!(finished(&oa)[0].cached_tokens, 12);
    assert_eq!(removed_hashes(&events(&oa)), Vec::<u64>::new());
    assert_eq!(r.stats().cached_blocks, 6);
    // A new 12-token prompt needs 3 blocks; one is free and uncached, so 2 cached blocks are
    // evicted: B's (the least recently used prefix), tail first.
    r.submit(req(4, toks(200, 12), 1)).unwrap();
    let oc = run(&mut r);
    assert_eq!(removed_hashes(&events(&oc)), vec![hb[2], hb[1]]);
    assert_eq!(r.probe_prefix(&toks(100, 13), None, None), 4);
    assert_eq!(r.probe_prefix(&toks(0, 13), None, None), 12);
    // Removals come before the stores of the step that needed the space.
    let kinds: Vec<bool> = oc[0]
        .kv_events
        .iter()
        .map(|e| matches!(e, KvEvent::BlockRemoved { .. }))
        .collect();
    assert_eq!(kinds, vec![true, true, false]);
}

#[test]
fn chunked_prefill_respects_the_token_budget() {
    let mut c = cfg(256);
    c.max_num_batched_tokens = 32;
    let mut r = Rank::new(c);
    r.submit(req(1, toks(0, 100), 3)).unwrap();
    let o = run(&mut r);
    let prefill: Vec<u32> = o.iter().map(|s| s.prefill_tokens).collect();
    assert_eq!(prefill, vec![32, 32, 32, 4, 0, 0]);
    assert!(o[..3].iter().all(|s| s.tokens.is_empty()));
    assert_eq!(o[3].first_tokens, vec![1]);
    // Each chunk stores the blocks it fills: 8, 8, 8, then 1 (100 = 25 blocks).
    let per_step: Vec<usize> = o
        .iter()
        .map(|s| stored_hashes(&s.kv_events).len())
        .collect();
    assert_eq!(&per_step[..4], &[8, 8, 8, 1]);
    let m = StepTimeModel::default();
    assert!((o[0].duration_ms - m.prefill_ms(32, 0.0)).abs() < 1e-9);
    assert!((o[3].duration_ms - m.prefill_ms(4, 0.0) - m.decode_ms(0.0)).abs() > 1.0);
    assert!((o[3].duration_ms - m.prefill_ms(4, 0.0)).abs() < 1e-9);
    // A decode shares the step with the next request's prefill chunk.
    r.submit(req(2, toks(1000, 8), 2)).unwrap();
    r.submit(req(3, toks(2000, 64), 1)).unwrap();
    let o = run(&mut r);
    assert_eq!((o[0].prefill_tokens, o[0].decode_requests), (32, 0));
    assert_eq!((o[1].prefill_tokens, o[1].decode_requests), (31, 1));
    // KV in use: request 2 holds 3 blocks (9 tokens), request 3 holds 14 (24 + 31 tokens).
    let u = 17.0 / 255.0; // of the usable blocks: all but the null block
    let expect = m.prefill_ms(31, 0.0) + m.decode_ms(u);
    assert!(
        (o[1].duration_ms - expect).abs() < 1e-9,
        "{} vs {expect}",
        o[1].duration_ms
    );
}

#[test]
fn step_time_model_matches_the_fit() {
    let m = StepTimeModel::default();
    assert!((m.prefill_ms(1000, 0.0) - (4.21e-7 * 1e6 + 15.2 + 16.5)).abs() < 1e-9);
    assert_eq!(m.prefill_ms(0, 0.0), 0.0);
    assert!((m.decode_ms(0.0) - 5.7).abs() < 1e-12);
    assert!((m.decode_ms(0.5) - (5.7 + 27.0 - 25.7 * 0.25)).abs() < 1e-12);
    assert!((m.decode_ms(7.0) - m.decode_ms(1.0)).abs() < 1e-12);
    let floored = StepTimeModel {
        decode_a: -100.0,
        ..m
    };
    assert_eq!(floored.decode_ms(0.0), 1.0);
    // Slowdown multiplies; the clock advances by the durations.
    let mut r = Rank::new(cfg(64));
    r.set_slowdown(3.0);
    r.advance_to(1000.0);
    r.submit(req(1, toks(0, 8), 2)).unwrap();
    let o = run(&mut r);
    assert!((o[0].duration_ms - 3.0 * m.prefill_ms(8, 0.0)).abs() < 1e-9);
    let total: f64 = o.iter().map(|s| s.duration_ms).sum();
    assert!((r.now_ms() - 1000.0 - total).abs() < 1e-9);
    let f = &finished(&o)[0];
    assert!((f.first_token_ms - 1000.0 - o[0].duration_ms).abs() < 1e-9);
    assert!((f.finish_ms - r.now_ms()).abs() < 1e-9);
    assert_eq!(f.arrival_ms, 1000.0);
}

#[test]
fn context_term_charges_attention_over_earlier_tokens() {
    let m = StepTimeModel {
        prefill_context: 2.0 * 4.21e-7,
        ..StepTimeModel::default()
    };
    let mut c = cfg(256);
    c.max_num_batched_tokens = 50;
    c.step_time = m;
    let mut r = Rank::new(c);
    r.submit(req(1, toks(0, 100), 1)).unwrap();
    let o = run(&mut r);
    let quad: f64 = o
        .iter()
        .map(|s| s.duration_ms - 16.5 - 1.52e-2 * 50.0)
        .sum();
    // 50² + (50² + 2·50·50) = 100²: chunking no longer hides attention cost.
    assert!((quad - 4.21e-7 * 100.0 * 100.0).abs() < 1e-9, "{quad}");
}

#[test]
fn out_of_space_preempts_the_newest_request() {
    // 6 blocks of 4 tokens = 24 token slots.
    let mut c = cfg(6);
    c.max_num_batched_tokens = 64;
    let mut r = Rank::new(c);
    r.submit(req(1, toks(0, 8), 8)).unwrap(); // needs up to 15 tokens = 4 blocks
    r.submit(req(2, toks(100, 8), 8)).unwrap(); // needs 4 blocks as well
    let o = run(&mut r);
    let preempted: Vec<RequestId> = o.iter().flat_map(|s| s.preempted.clone()).collect();
    assert!(!preempted.is_empty());
    assert!(preempted.iter().all(|&id| id == 2), "{preempted:?}");
    let f = finished(&o);
    assert_eq!(f.len(), 2);
    assert_eq!(f[0].id, 1);
    assert_eq!(f[1].preemptions as usize, preempted.len());
    assert_eq!(r.stats().preemptions as usize, preempted.len());
    assert!(f.iter().all(|f| f.output_tokens == 8));
    // The victim's recomputation is prefill work of its own.
    let prefill_steps = o.iter().filter(|s| s.prefill_tokens > 0).count();
    assert!(prefill_steps >= 2, "{prefill_steps}");
    assert_eq!(r.kv_usage(), 0.0);
}

#[test]
fn running_batch_is_capped_by_max_num_seqs() {
    let mut c = cfg(256);
    c.max_num_seqs = 2;
    let mut r = Rank::new(c);
    for id in 0..5 {
        r.submit(req(id, toks(id as u32 * 100, 8), 4)).unwrap();
    }
    let first = r.next_step().unwrap();
    assert_eq!(first.tokens.len(), 2);
    assert_eq!((r.num_running(), r.num_waiting()), (2, 3));
    let o = run(&mut r);
    assert_eq!(finished(&o).len(), 5);
    assert!(o.iter().all(|s| s.tokens.len() <= 2));
}

#[test]
fn abort_and_reset_release_everything() {
    let mut r = Rank::new(cfg(64));
    r.submit(req(1, toks(0, 16), 100)).unwrap();
    r.submit(req(2, toks(50, 16), 100)).unwrap();
    r.next_step().unwrap();
    assert!(r.kv_usage() > 0.0);
    assert_eq!(r.cached_tokens(1), Some(0));
    assert!(r.abort(1));
    assert!(!r.abort(1));
    assert!(r.contains(2));
    let (aborted, ev) = r.reset(false);
    assert_eq!(aborted, vec![2]);
    assert_eq!(ev, vec![KvEvent::AllBlocksCleared]);
    assert_eq!(r.kv_usage(), 0.0);
    assert_eq!(r.stats().cached_blocks, 0);
    assert_eq!(r.probe_prefix(&toks(0, 17), None, None), 0);
    assert!(r.next_step().is_none());
    assert_eq!(r.stats().aborted_requests, 2);
    r.reset(true);
    assert_eq!(r.stats().aborted_requests, 0);
}

#[test]
fn submit_validates() {
    let mut r = Rank::new(cfg(5)); // 16 tokens of KV and the null block
    assert_eq!(r.submit(req(1, vec![], 1)), Err(SubmitError::EmptyPrompt));
    assert_eq!(
        r.submit(req(1, toks(0, 4), 0)),
        Err(SubmitError::ZeroMaxTokens)
    );
    assert!(matches!(
        r.submit(req(1, toks(0, 12), 5)),
        Err(SubmitError::TooLong {
            max_model_len: 16,
            ..
        })
    ));
    r.submit(req(1, toks(0, 12), 4)).unwrap();
    assert_eq!(
        r.submit(req(1, toks(0, 4), 1)),
        Err(SubmitError::DuplicateId(1))
    );
    assert_eq!(finished(&run(&mut r)).len(), 1);
}

#[test]
fn deterministic_for_a_seed_and_opaque_across_seeds() {
    let go = |seed: u64| {
        let mut c = cfg(32);
        c.hash_seed = seed;
        let mut r = Rank::new(c);
        for id in 0..6u64 {
            let mut p = toks(0, 8);
            p.extend(toks(1000 * id as u32, 9));
            r.submit(req(id, p, 5)).unwrap();
        }
        run(&mut r)
    };
    assert_eq!(go(7), go(7));
    let (a, b) = (
        stored_hashes(&events(&go(7))),
        stored_hashes(&events(&go(8))),
    );
    assert_eq!(a.len(), b.len());
    assert!(a.iter().zip(&b).all(|(x, y)| x != y));
    // Engine hashes are not the picker's keys.
    let keys = BlockHasher::new(4).keys(ChainRoot::new("m", None, None), &toks(0, 8));
    assert!(!a.contains(&keys[0]));
}

#[test]
fn events_rekeyed_by_the_picker_match_request_keys() {
    let mut r = Rank::new(cfg(12));
    let (mut index, slot, keys) = precise_index();
    let matched = |index: &KvIndex, prompt: &[u32]| {
        let k = BlockHasher::new(4).keys(ChainRoot::new("m", None, None), prompt);
        let mut out = Vec::new();
        index.longest_prefix(&k, &mut out);
        out.first().map_or(0, |m| m.blocks)
    };
    let mut prompts = Vec::new();
    for id in 0..8u64 {
        // Shared 8-token system prompt, then a distinct tail; cache holds 12 blocks, so later
        // requests evict earlier tails.
        let mut p = toks(0, 8);
        p.extend(toks(100 * (id as u32 + 1), 10));
        r.submit(req(id, p.clone(), 3)).unwrap();
        prompts.push(p);
        for o in run(&mut r) {
            let batch = EventBatch {
                ts: 0.0,
                events: o.kv_events,
                data_parallel_rank: Some(0),
                skipped_unknown: 0,
            };
            let s = apply_batch(&mut index, slot, keys, &batch);
            assert!(!s.needs_resync(), "{s:?}");
        }
        // The picker's view equals the engine's own: for every prompt seen so far, the
        // matched prefix is what the engine would hit (plus the uncapped last block).
        for p in &prompts {
            let mut probe = p.clone();
            probe.push(9_999_999);
            let engine_blocks = r.probe_prefix(&probe, None, None) / 4;
            assert_eq!(matched(&index, p), engine_blocks, "after request {id}");
        }
    }
    assert!(r.stats().cached_blocks <= 12);
}

/// Issue 16: vLLM's CPU offloading, modelled: every computed block is written through to the
/// CPU tier and published there; a prompt evicted from the GPU is loaded back past its GPU
/// hit instead of prefilled, and only the loading request waits for it.
#[test]
fn a_cpu_tier_loads_back_what_the_gpu_evicted() {
    let mut r = Rank::new(EngineConfig {
        cpu_offload_blocks: 16,
        cpu_load_ms_per_block: 10.0,
        ..cfg(9) // 8 usable GPU blocks
    });
    let is_cpu = |e: &KvEvent| match e {
        KvEvent::BlockStored { medium, .. } | KvEvent::BlockRemoved { medium, .. } => {
            medium.as_deref() == Some("CPU")
        }
        KvEvent::BlockMoved { .. } | KvEvent::AllBlocksCleared => false,
    };
    r.submit(req(1, toks(0, 16), 1)).unwrap();
    let ev = events(&run(&mut r));
    // the same 4 blocks on the GPU and, written through, on the CPU
    let (cpu, gpu): (Vec<KvEvent>, Vec<KvEvent>) = ev.into_iter().partition(is_cpu);
    assert_eq!(stored_hashes(&cpu), stored_hashes(&gpu));
    assert_eq!(stored_hashes(&cpu).len(), 4);
    // a longer prompt evicts the first from the GPU
    r.submit(req(2, toks(100, 24), 1)).unwrap();
    let ev = events(&run(&mut r));
    let (_, gpu): (Vec<KvEvent>, Vec<KvEvent>) = ev.into_iter().partition(is_cpu);
    assert!(
        !removed_hashes(&gpu).is_empty(),
        "the GPU evicted the first prompt"
    );
    // the first prompt again: what the GPU lost is loaded from the CPU
    let before = r.stats();
    let t0 = r.now_ms();
    r.submit(req(3, toks(0, 16), 1)).unwrap();
    let o = run(&mut r);
    let f = finished(&o);
    let loaded = r.stats().offload_hit_tokens - before.offload_hit_tokens;
    assert!(loaded > 0);
    // GPU hit + loaded = the 3 blocks before the last token's
    assert_eq!(u64::from(f[0].cached_tokens) + loaded, 12);
    // it waited for the load (10 ms a block) before it computed its last block
    let load_ms = (loaded / 4) as f64 * 10.0;
    assert!(f[0].first_token_ms - t0 >= load_ms, "{:?} after {t0}", f[0]);
    // a tier over its capacity drops its least recently used blocks, and says so
    let mut small = Rank::new(EngineConfig {
        cpu_offload_blocks: 2,
        ..cfg(9)
    });
    small.submit(req(1, toks(0, 16), 1)).unwrap();
    let ev = events(&run(&mut small));
    let (cpu, _): (Vec<KvEvent>, Vec<KvEvent>) = ev.into_iter().partition(is_cpu);
    assert_eq!(removed_hashes(&cpu), stored_hashes(&cpu)[..2]);
}

#[test]
fn adapters_take_gpu_slots_and_wait_for_a_busy_one() {
    let mut r = Rank::new(EngineConfig {
        max_loras: 1,
        lora_load_ms: 20.0,
        ..cfg(64)
    });
    let with = |id, lora: &str| Request {
        lora: Some(lora.into()),
        ..req(id, toks(100 * id as u32, 8), 4)
    };
    // `sql` takes the one slot; `chat` cannot run while `sql` does
    r.submit(with(1, "sql")).unwrap();
    r.submit(with(2, "chat")).unwrap();
    let first = r.next_step().unwrap();
    assert!(first.tokens.is_empty(), "the adapter is still loading");
    let state = r.lora_state();
    assert_eq!(state.running, vec![Arc::<str>::from("sql")]);
    assert_eq!(state.waiting, vec![Arc::<str>::from("chat")]);
    assert_eq!((state.max_loras, state.slots_used), (Some(1), 1));
    let done = finished(&run(&mut r));
    let at = |id| done.iter().find(|f| f.id == id).unwrap();
    // `sql` waited for its weights; `chat` started only after `sql` finished and then
    // waited for its own
    assert!(at(1).first_token_ms >= 20.0);
    assert!(at(2).first_token_ms >= at(1).finish_ms + 20.0);
    // `chat` now holds the slot: a second `chat` finds it, a second `sql` loads again
    r.submit(with(3, "chat")).unwrap();
    run(&mut r);
    r.submit(with(4, "sql")).unwrap();
    run(&mut r);
    let s = r.stats();
    assert_eq!((s.lora_requests, s.lora_resident, s.lora_loads), (4, 1, 3));
}

#[test]
fn without_a_slot_model_adapters_never_wait() {
    let mut r = Rank::new(cfg(64));
    r.submit(Request {
        lora: Some("sql".into()),
        ..req(1, toks(0, 8), 2)
    })
    .unwrap();
    let done = finished(&run(&mut r));
    assert!(done[0].first_token_ms < 20.0);
    assert_eq!(r.lora_state().max_loras, None);
    assert_eq!(r.stats().lora_requests, 0);
}

/// A request waiting for its adapter computes its prompt later, after another request may have
/// cached the same blocks: the engine then holds (and reports) two copies of them, and the
/// eviction of one must not take the block out of the picker's view.
#[test]
fn adapter_waits_keep_the_event_stream_complete() {
    let mut r = Rank::new(EngineConfig {
        max_loras: 1,
        lora_load_ms: 5.0,
        ..cfg(24)
    });
    let (mut index, slot, keys) = precise_index();
    for id in 0..40u64 {
        let mut p = toks(0, 8);
        p.extend(toks(100 * (id as u32 % 7 + 1), 10));
        r.submit(Request {
            lora: Some(format!("a{}", id % 3)),
            ..req(id, p, 3)
        })
        .unwrap();
        if id % 4 == 3 {
            for o in run(&mut r) {
                let batch = EventBatch {
                    ts: 0.0,
                    events: o.kv_events,
                    data_parallel_rank: Some(0),
                    skipped_unknown: 0,
                };
                let s = apply_batch(&mut index, slot, keys, &batch);
                assert!(!s.needs_resync(), "request {id}: {s:?}");
            }
        }
    }
}

/// Issue 19: a disaggregated decode pulls the prompt's KV instead of prefilling it, as a real
/// vLLM 0.32 engine with the NixlConnector does: all of it, partial last block included, but
/// the blocks its own cache holds; the pull costs its latency plus a time per block, and the
/// first step after it is a decode step.
#[test]
fn remote_kv_is_pulled_not_prefilled_and_local_blocks_are_not_pulled() {
    let c = EngineConfig {
        kv_transfer_latency_ms: 3.0,
        kv_transfer_ms_per_block: 0.05,
        ..cfg(256)
    };
    let prompt = toks(0, 401);
    // whole prompt computed here: the baseline
    let mut local = Rank::new(c.clone());
    local.submit(req(1, prompt.clone(), 2)).unwrap();
    let local_first = run(&mut local)
        .iter()
        .flat_map(|o| o.finished.clone())
        .next()
        .unwrap()
        .first_token_ms;

    // 100 full blocks (all but the last token) come from a remote engine
    let mut split = Rank::new(c.clone());
    split
        .submit(Request {
            remote_blocks: 100,
            ..req(1, prompt.clone(), 2)
        })
        .unwrap();
    let outcomes = run(&mut split);
    let first = outcomes
        .iter()
        .flat_map(|o| o.finished.clone())
        .next()
        .unwrap()
        .first_token_ms;
    let prefilled: u32 = outcomes.iter().map(|o| o.prefill_tokens).sum();
    assert_eq!(
        prefilled, 0,
        "nothing is prefilled: the last token is a decode step"
    );
    assert_eq!(
        split.stats().remote_kv_tokens,
        401,
        "the whole prompt, as vLLM counts it"
    );
    assert!(
        first >= 3.0 + 100.0 * 0.05,
        "the pull takes its time: {first}"
    );
    // one decode step after the pull, where the local engine prefilled 401 tokens
    assert!(
        first - 8.0 <= c.step_time.decode_ms(1.0) + 1e-9,
        "{first} vs {local_first}"
    );

    // a rank that holds the first 60 blocks pulls only the other 40
    let mut warm = Rank::new(c.clone());
    warm.submit(req(1, toks(0, 241), 1)).unwrap();
    run(&mut warm);
    warm.submit(Request {
        remote_blocks: 100,
        ..req(2, prompt, 2)
    })
    .unwrap();
    run(&mut warm);
    assert_eq!(warm.stats().remote_kv_tokens, 161);
}

#[test]
fn synthetic_prefill_stores_then_evicts_like_a_full_gpu() {
    // 9 blocks of 4 tokens, one of them the null block: 8 usable
    let mut r = Rank::new(cfg(9));
    let first = r.prefill_synthetic(1, 16);
    let stored: Vec<_> = first
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                ..
            } => Some((block_hashes.len(), *parent_block_hash, token_ids.len())),
            _ => None,
        })
        .collect();
    assert_eq!(stored, vec![(4, None, 16)]);
    assert_eq!(
        first.len(),
        1,
        "nothing evicted from an empty cache: {first:?}"
    );
    // the prompt stays cached after it is released (all but the block holding the last token)
    let tokens = synthetic_tokens(1, 16);
    assert_eq!(r.probe_prefix(&tokens, None, None), 12);
    // the same prompt again hits its first 3 blocks and computes only the last one
    let again = r.prefill_synthetic(1, 16);
    assert!(
        matches!(&again[..], [KvEvent::BlockStored { block_hashes, parent_block_hash: Some(_), .. }] if block_hashes.len() == 1),
        "{again:?}"
    );
    // two more prompts overflow the 8 usable blocks: the oldest blocks are evicted one by one
    r.prefill_synthetic(2, 16);
    let third = r.prefill_synthetic(3, 16);
    let removed = third
        .iter()
        .filter(
            |e| matches!(e, KvEvent::BlockRemoved { block_hashes, .. } if block_hashes.len() == 1),
        )
        .count();
    assert_eq!(removed, 4, "{third:?}");
    assert_eq!(r.probe_prefix(&tokens, None, None), 0);
    // served-request counters are untouched, and nothing is left running
    let expected = EngineStats {
        cached_blocks: 8,
        ..Rank::new(cfg(9)).stats()
    };
    assert_eq!(r.stats(), expected);
    assert!(!r.has_work());
}
