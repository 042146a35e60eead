//! Hybrid KV-cache groups and offload tiers from payloads built with vLLM 0.32's own event
//! classes (`tests/fixtures/vllm-0.32/gen_cache_state.py`): decoded, applied to the index,
//! and credited under the engine's own prefix-cache rule (`docs/cache-state.md`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::{IpAddr, Ipv4Addr};

use kvroute_routing::block_keys::BlockHasher;
use kvroute_routing::endpoint::EndpointId;
use kvroute_routing::index::{IndexMode, KvIndex, Slot, TierBlocks};
use kvroute_routing::kv_events::ingest::{IngestKeys, IngestStats, apply_batch};
use kvroute_routing::kv_events::{BlockPlace, DecodeLimits, KvEvent, decode_event_batch};

mod support;
use support::{BS, credit, keys};

macro_rules! fixture {
    ($name:literal) => {
        include_bytes!(concat!("fixtures/vllm-0.32/events/", $name, ".bin")).as_slice()
    };
}

fn ingest(payload: &[u8]) -> (KvIndex, Slot, IngestStats) {
    let mut ix = KvIndex::default();
    let id = EndpointId::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 8000, 0);
    let slot = ix.add_endpoint(id, IndexMode::Precise, 1000).unwrap();
    let batch = decode_event_batch(payload, &DecodeLimits::default()).unwrap();
    let keys = IngestKeys {
        hasher: BlockHasher::new(BS),
        model: "m",
    };
    let stats = apply_batch(&mut ix, slot, keys, &batch);
    (ix, slot, stats)
}

fn plain_run(ix: &KvIndex, blocks: u32) -> u32 {
    let mut out = Vec::new();
    ix.longest_prefix(&keys(blocks), &mut out);
    out.first().map_or(0, |m| m.blocks)
}

#[test]
fn vllm_0_32_names_group_kind_window_tier_and_session() {
    let b = decode_event_batch(fixture!("hybrid_swa"), &DecodeLimits::default()).unwrap();
    let KvEvent::BlockStored { place, .. } = &b.events[1] else {
        panic!("{:?}", b.events[1]);
    };
    assert_eq!(
        *place,
        BlockPlace {
            group_idx: Some(1),
            spec_kind: Some("sliding_window".into()),
            sliding_window: Some(32),
            session_id: Some("agent-7".into()),
            ..BlockPlace::default()
        }
    );
    let b = decode_event_batch(fixture!("offload_cpu"), &DecodeLimits::default()).unwrap();
    let KvEvent::BlockRemoved { medium, place, .. } = &b.events[3] else {
        panic!("{:?}", b.events[3]);
    };
    assert_eq!(medium.as_deref(), Some("CPU"));
    assert_eq!(
        (place.group_idx, place.locality.as_deref()),
        (Some(0), Some("LOCAL"))
    );
    let KvEvent::BlockStored { place, .. } = &b.events[4] else {
        panic!("{:?}", b.events[4]);
    };
    assert_eq!(place.ownership.as_deref(), Some("kvcr"));
}

#[test]
fn a_sliding_window_hybrid_is_credited_only_where_the_window_is_held() {
    let (ix, _, s) = ingest(fixture!("hybrid_swa"));
    assert_eq!((s.stored_blocks, s.removed_blocks), (16, 6));
    // a 32-token window needs cdiv(31, 16) = 2 blocks before the boundary: 6 and 7 are held
    assert_eq!(credit(&ix, 8).0, 8);
    // at 7 blocks it needs blocks 5 and 6: 5 was freed, so the engine recomputes everything
    assert_eq!(credit(&ix, 7).0, 0);
    // the full-attention group keeps its eight blocks: the removals named group 1
    assert_eq!(plain_run(&ix, 8), 8);
}

#[test]
fn a_mamba_hybrid_is_credited_at_its_last_state_boundary() {
    let (ix, _, s) = ingest(fixture!("hybrid_mamba"));
    assert_eq!(
        (s.stored_blocks, s.removed_blocks, s.malformed_blocks),
        (12, 2, 0)
    );
    // states at 32 and 96 tokens: an 8-block prompt reuses 96 tokens (6 blocks)
    assert_eq!(credit(&ix, 8).0, 6);
    // a 5-block prompt: hits are aligned to the 32-token state block; the state at 32
    assert_eq!(credit(&ix, 5).0, 2);
    assert_eq!(credit(&ix, 1).0, 0);
}

#[test]
fn sparse_stores_are_placed_where_vllm_caches_them() {
    let (ix, _, s) = ingest(fixture!("hybrid_sparse_stores"));
    // Mamba keeps one state per chunk (blocks 3 and 7), the window group each chunk's 2-block
    // tail (2, 3, 6, 7); three states of a four-block chunk have no knowable place
    assert_eq!(
        (s.stored_blocks, s.unplaced_blocks, s.malformed_blocks),
        (8 + 2 + 4, 3, 0)
    );
    assert_eq!(credit(&ix, 8).0, 8);
    // 7 blocks: the last state at or before them is after block 3
    assert_eq!(credit(&ix, 7).0, 4);
    assert_eq!(credit(&ix, 3).0, 0);
}

#[test]
fn an_unmodelled_group_kind_gives_no_credit() {
    let (ix, _, s) = ingest(fixture!("hybrid_unmodelled"));
    assert_eq!((s.stored_blocks, s.unmodelled_blocks), (8, 8));
    assert_eq!(credit(&ix, 8), (0, TierBlocks::default()));
}

#[test]
fn offloaded_blocks_are_credited_by_tier_after_the_gpu_hit() {
    let (ix, _, s) = ingest(fixture!("offload_cpu"));
    assert_eq!(s.placeholder_blocks, 1);
    assert!(!s.needs_resync());
    let (gpu, lower) = credit(&ix, 8);
    // GPU 0-3; then 4 and 5 from the CPU, 6 only in the storage tier, 7 on the CPU
    assert_eq!(gpu, 4);
    assert_eq!(
        lower,
        TierBlocks {
            cpu: 3,
            remote: 0,
            storage: 1
        }
    );
    // the GPU view itself is what the engine's events left on the GPU
    assert_eq!(plain_run(&ix, 8), 4);
}

/// An engine naming every tier it likes gets no more room than `index.maxBlocksPerEndpoint`
/// over all of them together (Hardening IV, 1: each named tier used to multiply the bound, a
/// publisher naming CPU, DISK and REMOTE got 49× it).
#[test]
fn lower_tiers_are_room_inside_the_configured_bound_not_a_multiple_of_it() {
    use kvroute_routing::index::IndexConfig;
    use kvroute_routing::kv_events::EventBatch;
    const CAP: usize = 300;
    let mut ix = KvIndex::new(IndexConfig {
        max_blocks_per_endpoint: CAP,
        ..IndexConfig::default()
    });
    let id = EndpointId::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 8000, 0);
    // the capacity an engine reports is clamped to the bound already: ask for all of it
    let slot = ix.add_endpoint(id, IndexMode::Precise, CAP).unwrap();
    let keys = IngestKeys {
        hasher: BlockHasher::new(BS),
        model: "m",
    };
    let tiers: [(Option<&str>, Option<&str>); 4] = [
        (Some("GPU"), None),
        (Some("CPU"), None),
        (Some("DISK"), None),
        (Some("CPU"), Some("REMOTE")),
    ];
    let mut overflowed = 0;
    let mut most = 0;
    for round in 0..40u64 {
        for (t, (medium, locality)) in tiers.iter().enumerate() {
            // 64 new blocks a batch, in each tier in turn: far more than the bound in all
            let first = (round * 4 + t as u64) * 64;
            let hashes: Vec<u64> = (first..first + 64).map(|h| h + 1).collect();
            let tokens: Vec<u32> = (0..64 * BS).map(|i| i + first as u32 * BS).collect();
            let mut ev = KvEvent::plain_stored(hashes, None, tokens, BS);
            if let KvEvent::BlockStored {
                medium: m, place, ..
            } = &mut ev
            {
                *m = medium.map(str::to_owned);
                place.locality = locality.map(str::to_owned);
            }
            let s = apply_batch(&mut ix, slot, keys, &EventBatch::new(0.0, vec![ev]));
            overflowed += u32::from(s.overflowed);
            most = most.max(ix.endpoint_blocks(slot));
        }
    }
    assert!(most <= CAP, "{most} blocks held, bound {CAP}");
    assert!(overflowed > 0, "a flood past the bound clears the view");
}

/// Below the configured bound, lower tiers keep their room (`LOWER_TIER_FACTOR` times the
/// GPU budget each): an offloading engine is not cleared for holding more on the CPU than on
/// the GPU.
#[test]
fn an_offload_tier_larger_than_the_gpu_cache_stays_within_its_room() {
    let mut ix = KvIndex::default();
    let id = EndpointId::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 8000, 0);
    let slot = ix.add_endpoint(id, IndexMode::Precise, 100).unwrap();
    let keys = IngestKeys {
        hasher: BlockHasher::new(BS),
        model: "m",
    };
    let hashes: Vec<u64> = (1..=400).collect();
    let tokens: Vec<u32> = (0..400 * BS).collect();
    let mut ev = KvEvent::plain_stored(hashes, None, tokens, BS);
    if let KvEvent::BlockStored { medium, .. } = &mut ev {
        *medium = Some("CPU".into());
    }
    let s = apply_batch(
        &mut ix,
        slot,
        keys,
        &kvroute_routing::kv_events::EventBatch::new(0.0, vec![ev]),
    );
    assert!(!s.overflowed);
    assert_eq!(ix.endpoint_blocks(slot), 400);
}
