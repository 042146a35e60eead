//! A long KV-event batch applied through the pool's lock while another thread reads the index,
//! as the service's event feed and picks do: the batch lands whole, and a reader only ever sees
//! the state between two steps (a prefix of the event, a multiple of
//! [`ingest::STEP_BLOCKS`] blocks long), never a half-applied step.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use kvroute_routing::block_keys::{BlockHasher, ChainRoot};
use kvroute_routing::endpoint::{Endpoint, EndpointId, ModelConfig};
use kvroute_routing::index::{IndexConfig, PrefixMatch};
use kvroute_routing::kv_events::ingest::{IngestKeys, STEP_BLOCKS};
use kvroute_routing::kv_events::{EventBatch, KvEvent};
use kvroute_routing::pool_state::{ClearCause, IndexBudget, PoolMember, PoolState};

const BLOCK: usize = 4;
const BLOCKS: usize = 20 * STEP_BLOCKS + 7;
const ROUNDS: usize = 20;

fn batch(events: Vec<KvEvent>) -> EventBatch {
    EventBatch::new(0.0, events)
}

#[test]
fn a_long_batch_lands_whole_and_readers_see_it_step_by_step() {
    let id = EndpointId::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 8000, 0);
    let budget = IndexBudget {
        default_kv_capacity_blocks: 4 * BLOCKS as u64,
        max_blocks_per_endpoint: 4 * BLOCKS as u64,
        ..IndexBudget::default()
    };
    let pool = PoolState::new(IndexConfig::default(), budget);
    pool.apply_view(
        vec![PoolMember {
            endpoint: Endpoint::new(id, Arc::new(ModelConfig::new("c", "m"))),
            precise: true,
            kv_capacity_blocks: None,
        }],
        || {},
    )
    .expect("view");
    let hasher = BlockHasher::new(BLOCK as u32);
    let keys = IngestKeys { hasher, model: "m" };
    let tokens: Vec<u32> = (0..(BLOCKS * BLOCK) as u32).collect();
    let request = hasher.keys(ChainRoot::new("m", None, None), &tokens);
    let matched = |pool: &PoolState| {
        let mut out: Vec<PrefixMatch> = Vec::new();
        pool.read().index().longest_prefix(&request, &mut out);
        out.first().map_or(0, |m| m.blocks as usize)
    };
    let stored = KvEvent::plain_stored(
        (1..=BLOCKS as u64).collect(),
        None,
        tokens.clone(),
        BLOCK as u32,
    );
    // the removal of everything from block 100 on, in engine order (the tail first)
    let removed = KvEvent::BlockRemoved {
        block_hashes: (100..=BLOCKS as u64).rev().collect(),
        medium: None,
        place: Default::default(),
    };

    let done = AtomicBool::new(false);
    let reading = AtomicBool::new(false);
    let seen = std::thread::scope(|s| {
        let reader = s.spawn(|| {
            let mut seen = Vec::new();
            while !done.load(Ordering::Acquire) {
                seen.push(matched(&pool));
                reading.store(true, Ordering::Release);
            }
            seen
        });
        while !reading.load(Ordering::Acquire) {
            std::hint::spin_loop();
        }
        for _ in 0..ROUNDS {
            let st = pool
                .apply_batch(&id, keys, &batch(vec![stored.clone()]))
                .expect("precise");
            assert_eq!((st.stored_blocks, st.interrupted), (BLOCKS as u64, false));
            assert_eq!(matched(&pool), BLOCKS);
            let st = pool
                .apply_batch(&id, keys, &batch(vec![removed.clone()]))
                .expect("precise");
            assert_eq!(st.removed_blocks, (BLOCKS - 99) as u64);
            assert_eq!(matched(&pool), 99);
            pool.clear(&id, ClearCause::Resync);
        }
        done.store(true, Ordering::Release);
        reader.join().expect("reader")
    });
    // whatever the reader caught: a store step's end, or, while the tail was removed (from the
    // last block back), the cut the removal had reached, which leaves a prefix too
    let removal_cuts = |n: usize| n == 99 || (n > 99 && (BLOCKS - n).is_multiple_of(STEP_BLOCKS));
    for &n in &seen {
        assert!(
            n.is_multiple_of(STEP_BLOCKS) || n == BLOCKS || removal_cuts(n),
            "a reader saw {n} blocks: inside a step"
        );
    }
}
