//! The three indexes behind one measurement routine each: replay the event stream (timed,
//! single thread), account the memory the build kept, then time the queries one by one.
//!
//! Everything an index needs in its own types (block pairs, hash newtypes, owned events) is
//! prepared before its clock starts; what an index takes by value (Dynamo's events and query
//! vectors) is built before its memory window opens or outside the timed call.

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Instant;

use kvroute_routing::kv_events::ingest::{IndexAccess, Stepped, Steps};

use crate::alloc;
use crate::workload::{EventKind, Workload};

/// Per-query results, normalised: `(worker, matched blocks)` sorted by worker, non-zero only.
pub type Matches = Vec<Vec<(u32, u32)>>;

/// One build-and-query of one index.
pub struct Run {
    pub ingest_secs: f64,
    /// CPU time of the replaying thread (immune to preemption on a shared machine).
    pub ingest_cpu_secs: f64,
    pub alloc_bytes: isize,
    pub rss_bytes: isize,
    /// RSS change once freed heap pages are handed back (`malloc_trim`): what the index keeps.
    pub rss_trimmed_bytes: isize,
    /// Live (worker, block) pairs as the index itself counts them.
    pub live_reported: usize,
    /// Event errors the index returned (must be zero).
    pub errors: usize,
    pub query_ns: Vec<u64>,
    pub matches: Matches,
}

/// The memory window: net allocation, RSS change, and RSS change after trimming, across
/// `build`.
fn measured<T>(build: impl FnOnce() -> T) -> (T, isize, isize, isize) {
    alloc::trim();
    let (a0, r0) = (alloc::allocated(), alloc::rss());
    let built = build();
    let (a1, r1) = (alloc::allocated(), alloc::rss());
    alloc::trim();
    let r2 = alloc::rss();
    (
        built,
        a1 as isize - a0 as isize,
        r1 as isize - r0 as isize,
        r2 as isize - r0 as isize,
    )
}

/// Time every query individually, `passes` times over the set. `prepare(i)` builds, off the
/// clock, whatever query `i` consumes; `query(i, input, &mut out)` runs it and leaves its
/// `(worker, blocks)` result in `out` (only the first pass's results are kept).
fn time_queries<T>(
    w: &Workload,
    passes: usize,
    mut prepare: impl FnMut(usize) -> T,
    mut query: impl FnMut(usize, T, &mut Vec<(u32, u32)>),
) -> (Vec<u64>, Matches) {
    let mut samples = Vec::with_capacity(w.queries.len() * passes);
    let mut matches = Vec::with_capacity(w.queries.len());
    let mut out = Vec::with_capacity(w.workers as usize);
    for pass in 0..passes {
        for (i, _) in w.queries.iter().enumerate() {
            let input = prepare(i);
            out.clear();
            let t = Instant::now();
            query(i, input, &mut out);
            let ns = t.elapsed().as_nanos() as u64;
            samples.push(ns);
            if pass == 0 {
                let mut m = out.clone();
                m.sort_unstable();
                matches.push(m);
            }
        }
    }
    (samples, matches)
}

// ---- kvroute ------------------------------------------------------------------------------

/// Apply one event to kvroute's index as the service does; returns the blocks it refused.
fn kvroute_apply(
    w: &Workload,
    access: &mut impl IndexAccess,
    slot: u32,
    ev: &crate::workload::Event,
    pairs: &[(u64, u64)],
) -> usize {
    // the service's path: stepped, so that a waiting pick gets the index between steps
    let mut steps = Steps::new(access.index(), slot);
    match ev.kind {
        EventKind::Stored { parent } => {
            // The service resolves the parent's key to chain the new blocks' keys.
            let orphan = parent
                .is_some_and(|p| black_box(access.index().key_for_engine_hash(slot, p)).is_none());
            let (_, end) = steps.store(access, parent, &pairs[ev.start..ev.start + ev.len]);
            usize::from(orphan) + usize::from(end != Stepped::Done)
        }
        EventKind::Removed => {
            let (removed, _) = steps.remove(access, w.event_chain(ev), 0, &mut Vec::new());
            ev.len - removed as usize
        }
    }
}

/// kvroute's index with one precise endpoint per worker, and their slots.
fn kvroute_index(w: &Workload) -> (kvroute_routing::index::KvIndex, Vec<u32>) {
    use kvroute_routing::endpoint::EndpointId;
    use kvroute_routing::index::{IndexConfig, IndexMode, KvIndex};
    let mut ix = KvIndex::new(IndexConfig::default());
    let slots = (0..w.workers)
        .map(|i| {
            let id = EndpointId::new(
                IpAddr::V4(Ipv4Addr::new(10, 0, (i >> 8) as u8, i as u8)),
                8000,
                0,
            );
            ix.add_endpoint(id, IndexMode::Precise, w.capacity)
                .expect("endpoint slot")
        })
        .collect();
    (ix, slots)
}

pub fn kvroute(w: &Workload, passes: usize) -> Run {
    use kvroute_routing::index::PrefixMatch;

    // Engine hash and block key are the same u64 here (the chain hash).
    let pairs: Vec<(u64, u64)> = w.ev_chain.iter().map(|&h| (h, h)).collect();
    let mut errors = 0;
    let mut ingest_secs = 0.0;
    let mut ingest_cpu_secs = 0.0;
    let ((ix, slots), alloc_bytes, rss_bytes, rss_trimmed_bytes) = measured(|| {
        let (mut ix, slots) = kvroute_index(w);
        let (t, c) = (Instant::now(), alloc::thread_cpu_secs());
        for ev in &w.events {
            errors += kvroute_apply(w, &mut ix, slots[ev.worker as usize], ev, &pairs);
        }
        ingest_secs = t.elapsed().as_secs_f64();
        ingest_cpu_secs = alloc::thread_cpu_secs() - c;
        (ix, slots)
    });
    let live_reported = ix.live_blocks();
    let worker_of_slot = |s: u32| slots.iter().position(|&x| x == s).unwrap_or(usize::MAX) as u32;
    let mut found: Vec<PrefixMatch> = Vec::with_capacity(w.workers as usize);
    let (query_ns, matches) = time_queries(
        w,
        passes,
        |_| {},
        |i, (), out| {
            let r = &w.requests[w.queries[i]];
            ix.longest_prefix(w.request_chain(r), &mut found);
            out.extend(found.iter().map(|m| (m.slot, m.blocks)));
        },
    );
    let matches = matches
        .into_iter()
        .map(|m| {
            let mut m: Vec<_> = m.into_iter().map(|(s, b)| (worker_of_slot(s), b)).collect();
            m.sort_unstable();
            m
        })
        .collect();
    Run {
        ingest_secs,
        ingest_cpu_secs,
        alloc_bytes,
        rss_bytes,
        rss_trimmed_bytes,
        live_reported,
        errors,
        query_ns,
        matches,
    }
}

/// Ingestion on one thread while another matches queries against the same index, as the
/// service does (events on their task, picks on the request path).
pub struct Mixed {
    pub ingest_secs: f64,
    /// Each query timed alone, lock wait included.
    pub query_ns: Vec<u64>,
    pub errors: usize,
}

/// Run `ingest` on this thread and `query(i)` over the query set, round and round, on a second
/// thread until the ingestion is done.
fn mixed(w: &Workload, ingest: impl FnOnce() -> usize, query: impl Fn(usize) + Sync) -> Mixed {
    use std::sync::atomic::{AtomicBool, Ordering};
    let done = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let reader = scope.spawn(|| {
            let mut samples = Vec::new();
            let mut i = 0;
            while !done.load(Ordering::Relaxed) {
                let t = Instant::now();
                query(i % w.queries.len());
                samples.push(t.elapsed().as_nanos() as u64);
                i += 1;
            }
            samples
        });
        let t = Instant::now();
        let errors = ingest();
        let ingest_secs = t.elapsed().as_secs_f64();
        done.store(true, Ordering::Relaxed);
        Mixed {
            ingest_secs,
            query_ns: reader.join().unwrap_or_default(),
            errors,
        }
    })
}

/// kvroute's index behind the service's lock (`HandoffLock`): a write lock per event, applied
/// in steps as `PoolState::apply_batch` does, a read lock per query.
pub fn kvroute_mixed(w: &Workload) -> Mixed {
    use kvroute_routing::handoff::HandoffLock;
    use kvroute_routing::index::PrefixMatch;

    let pairs: Vec<(u64, u64)> = w.ev_chain.iter().map(|&h| (h, h)).collect();
    let (ix, slots) = kvroute_index(w);
    let ix = HandoffLock::new(ix);
    mixed(
        w,
        || {
            let mut errors = 0;
            for ev in &w.events {
                let mut writing = ix.write();
                errors += kvroute_apply(w, &mut writing, slots[ev.worker as usize], ev, &pairs);
                writing.release();
            }
            errors
        },
        |i| {
            let mut found: Vec<PrefixMatch> = Vec::with_capacity(w.workers as usize);
            let r = &w.requests[w.queries[i]];
            ix.read().longest_prefix(w.request_chain(r), &mut found);
            black_box(&found);
        },
    )
}

/// The floor of any read path that never waits for a writer: the reader matches against a
/// finished copy of its own while the writer ingests into another, so the only thing the two
/// threads share is the machine (caches, memory bandwidth, the VM's scheduling).
pub fn kvroute_apart_mixed(w: &Workload) -> Mixed {
    use kvroute_routing::index::PrefixMatch;

    let pairs: Vec<(u64, u64)> = w.ev_chain.iter().map(|&h| (h, h)).collect();
    let (mut read_ix, read_slots) = kvroute_index(w);
    for ev in &w.events {
        kvroute_apply(w, &mut read_ix, read_slots[ev.worker as usize], ev, &pairs);
    }
    let (mut ix, slots) = kvroute_index(w);
    mixed(
        w,
        || {
            let mut errors = 0;
            for ev in &w.events {
                errors += kvroute_apply(w, &mut ix, slots[ev.worker as usize], ev, &pairs);
            }
            errors
        },
        |i| {
            let mut found: Vec<PrefixMatch> = Vec::with_capacity(w.workers as usize);
            let r = &w.requests[w.queries[i]];
            read_ix.longest_prefix(w.request_chain(r), &mut found);
            black_box(&found);
        },
    )
}

// ---- kv-index (SGLang gateway) ------------------------------------------------------------

/// The event blocks in kv-index's types: stored blocks and sequence hashes.
fn kv_index_events(w: &Workload) -> (Vec<kv_index::StoredBlock>, Vec<kv_index::SequenceHash>) {
    use kv_index::{ContentHash, SequenceHash, StoredBlock};
    let blocks = w
        .ev_chain
        .iter()
        .zip(&w.ev_content)
        .map(|(&h, &c)| StoredBlock {
            seq_hash: SequenceHash(h),
            content_hash: ContentHash(c),
        })
        .collect();
    let seqs = w.ev_chain.iter().map(|&h| SequenceHash(h)).collect();
    (blocks, seqs)
}

/// Apply the workload's events to a `ChainIndex` as the gateway's event thread does; returns
/// the stores it refused.
fn kv_index_replay(
    w: &Workload,
    index: &kv_index::ChainIndex,
    ids: &[u32],
    maps: &mut [kv_index::ChainBlockMap],
    blocks: &[kv_index::StoredBlock],
    seqs: &[kv_index::SequenceHash],
) -> usize {
    let mut errors = 0;
    for ev in &w.events {
        let (id, map) = (ids[ev.worker as usize], &mut maps[ev.worker as usize]);
        match ev.kind {
            EventKind::Stored { parent } => {
                if index
                    .apply_stored(
                        id,
                        &blocks[ev.start..ev.start + ev.len],
                        parent.map(kv_index::SequenceHash),
                        map,
                    )
                    .is_err()
                {
                    errors += 1;
                }
            }
            EventKind::Removed => {
                index.apply_removed(id, &seqs[ev.start..ev.start + ev.len], map);
            }
        }
    }
    errors
}

/// A `ChainIndex` sized for the workers (one coverage word for up to 64, the peer's best
/// case), and their interned ids.
fn kv_index_new(w: &Workload) -> (kv_index::ChainIndex, Vec<u32>) {
    let index = kv_index::ChainIndex::with_max_workers(w.workers as usize);
    let ids = (0..w.workers)
        .map(|i| {
            index
                .intern_worker(&format!("http://10.0.{}.{}:8000", i >> 8, i & 255))
                .expect("worker id")
        })
        .collect();
    (index, ids)
}

pub fn kv_index(w: &Workload, passes: usize) -> Run {
    use kv_index::ChainBlockMap;

    let (blocks, seqs) = kv_index_events(w);
    let mut errors = 0;
    let mut ingest_secs = 0.0;
    let mut ingest_cpu_secs = 0.0;
    let ((index, ids, maps), alloc_bytes, rss_bytes, rss_trimmed_bytes) = measured(|| {
        // Coverage is sized for the fleet at hand (one 64-bit word), the peer's best case.
        let (index, ids) = kv_index_new(w);
        let mut maps: Vec<ChainBlockMap> = (0..w.workers).map(|_| ChainBlockMap::new()).collect();
        let (t, c) = (Instant::now(), alloc::thread_cpu_secs());
        errors += kv_index_replay(w, &index, &ids, &mut maps, &blocks, &seqs);
        ingest_secs = t.elapsed().as_secs_f64();
        ingest_cpu_secs = alloc::thread_cpu_secs() - c;
        (index, ids, maps)
    });
    let live_reported = index.current_size();
    let worker_of_id = |id: u32| ids.iter().position(|&x| x == id).unwrap_or(usize::MAX) as u32;
    let (query_ns, matches) = time_queries(
        w,
        passes,
        |_| {},
        |i, (), out| {
            let r = &w.requests[w.queries[i]];
            index.score_into(
                w.request_content(r),
                |&c| c,
                false,
                |id, score| {
                    out.push((id, score));
                },
            );
        },
    );
    drop(maps);
    let matches = matches
        .into_iter()
        .map(|m| {
            let mut m: Vec<_> = m.into_iter().map(|(id, b)| (worker_of_id(id), b)).collect();
            m.sort_unstable();
            m
        })
        .collect();
    Run {
        ingest_secs,
        ingest_cpu_secs,
        alloc_bytes,
        rss_bytes,
        rss_trimmed_bytes,
        live_reported,
        errors,
        query_ns,
        matches,
    }
}

/// kv-index as the SGLang gateway runs it: a shared `ChainIndex` (no outer lock), the
/// per-worker maps owned by the event thread.
pub fn kv_index_mixed(w: &Workload) -> Mixed {
    use kv_index::ChainBlockMap;

    let (blocks, seqs) = kv_index_events(w);
    let (index, ids) = kv_index_new(w);
    let mut maps: Vec<ChainBlockMap> = (0..w.workers).map(|_| ChainBlockMap::new()).collect();
    mixed(
        w,
        || kv_index_replay(w, &index, &ids, &mut maps, &blocks, &seqs),
        |i| {
            let r = &w.requests[w.queries[i]];
            let mut n = 0;
            index.score_into(
                w.request_content(r),
                |&c| c,
                false,
                |_, score| {
                    n += score;
                },
            );
            black_box(n);
        },
    )
}

// ---- dynamo-kv-router (NVIDIA Dynamo) -----------------------------------------------------

pub fn dynamo(w: &Workload, passes: usize) -> Run {
    use dynamo_kv_router::RadixTree;
    use dynamo_kv_router::protocols::{
        ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData,
        KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
    };

    let mut errors = 0;
    let mut ingest_secs = 0.0;
    let mut ingest_cpu_secs = 0.0;
    // The tree consumes its events: they are built inside the memory window and all freed by
    // the replay, so the window's net delta is the tree alone.
    let (tree, alloc_bytes, rss_bytes, rss_trimmed_bytes) = measured(|| {
        let events: Vec<RouterEvent> = w
            .events
            .iter()
            .enumerate()
            .map(|(i, ev)| {
                let data = match ev.kind {
                    EventKind::Stored { parent } => KvCacheEventData::Stored(KvCacheStoreData {
                        parent_hash: parent.map(ExternalSequenceBlockHash),
                        start_position: None,
                        blocks: w
                            .event_chain(ev)
                            .iter()
                            .zip(w.event_content(ev))
                            .map(|(&h, &c)| KvCacheStoredBlockData {
                                block_hash: ExternalSequenceBlockHash(h),
                                tokens_hash: LocalBlockHash(c),
                                mm_extra_info: None,
                            })
                            .collect(),
                    }),
                    EventKind::Removed => KvCacheEventData::Removed(KvCacheRemoveData {
                        block_hashes: w
                            .event_chain(ev)
                            .iter()
                            .map(|&h| ExternalSequenceBlockHash(h))
                            .collect(),
                    }),
                };
                RouterEvent::new(
                    u64::from(ev.worker),
                    KvCacheEvent {
                        event_id: i as u64,
                        data,
                        dp_rank: 0,
                    },
                )
            })
            .collect();
        let mut tree = RadixTree::new();
        let (t, c) = (Instant::now(), alloc::thread_cpu_secs());
        for ev in events {
            if tree.apply_event(ev).is_err() {
                errors += 1;
            }
        }
        ingest_secs = t.elapsed().as_secs_f64();
        ingest_cpu_secs = alloc::thread_cpu_secs() - c;
        tree
    });
    let live_reported = tree.current_size();
    let (query_ns, matches) = time_queries(
        w,
        passes,
        |i| {
            // find_matches takes its sequence by value: build it outside the clock.
            let r = &w.requests[w.queries[i]];
            w.request_content(r)
                .iter()
                .map(|&c| LocalBlockHash(c))
                .collect::<Vec<_>>()
        },
        |_, seq, out| {
            let scores = tree.find_matches(seq, false);
            out.extend(
                scores
                    .scores
                    .iter()
                    .map(|(wk, &s)| (wk.worker_id as u32, s)),
            );
            // The result's drop is part of the call's cost: it cannot be kept.
            drop(scores);
        },
    );
    Run {
        ingest_secs,
        ingest_cpu_secs,
        alloc_bytes,
        rss_bytes,
        rss_trimmed_bytes,
        live_reported,
        errors,
        query_ns,
        matches,
    }
}
