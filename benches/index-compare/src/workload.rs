//! The shared workload: a Mooncake trace turned into 64-token blocks, routed to workers, run
//! through a per-worker LRU, and flattened into one precomputed event stream plus a query set.
//!
//! Every index sees the same events and the same queries; only the hash fields each one needs
//! are picked from the per-block pair `(content, chain)`:
//! - `content`: a position-independent "tokens hash" of the block (Dynamo's `LocalBlockHash`,
//!   kv-index's `ContentHash`), derived from the trace block id and the sub-block number;
//! - `chain`: the prefix hash (parent chain ⊕ content), used as the engine's block hash by all
//!   three and as kvroute's own block key.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;

use hashlink::LinkedHashMap;
use serde::Deserialize;

/// Tokens per trace block (Mooncake's hash_ids granularity).
pub const TRACE_BLOCK_TOKENS: u64 = 512;
/// Tokens per index block.
pub const BLOCK_TOKENS: u64 = 64;
/// Index blocks per trace block.
pub const SUB_BLOCKS: u64 = TRACE_BLOCK_TOKENS / BLOCK_TOKENS;

const CONTENT_SEED: u64 = 0x6b76_726f_7574_6531;
const CHAIN_ROOT: u64 = 0x243f_6a88_85a3_08d3;

/// SplitMix64's finaliser: a cheap bijective 64-bit mixer.
#[inline]
pub fn mix64(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Content hash of sub-block `j` of trace block `trace_id`.
#[inline]
pub fn content_hash(trace_id: u64, j: u64) -> u64 {
    mix64(
        trace_id
            .wrapping_mul(SUB_BLOCKS)
            .wrapping_add(j)
            .wrapping_add(CONTENT_SEED),
    )
}

/// Chain hash of a block whose parent's chain hash is `parent` (`None` for block 0).
#[inline]
pub fn chain_hash(parent: Option<u64>, content: u64) -> u64 {
    mix64(parent.unwrap_or(CHAIN_ROOT).rotate_left(23) ^ content)
}

#[derive(Deserialize)]
pub struct TraceRecord {
    input_length: u64,
    hash_ids: Vec<u64>,
    /// The worker it goes to (synthetic sessions); by default a hash of its first blocks.
    #[serde(skip)]
    worker: Option<u32>,
}

/// Agentic sessions whose contexts grow to `context_tokens`: every session starts with the
/// same 2,048-token system prompt and each turn resends the whole transcript with 8k–24k new
/// tokens (tool output, the model's reply, the next instruction). Sessions take turns in a
/// fixed pseudo-random order and stick to worker `session % workers`.
pub fn synthetic_sessions(context_tokens: u64, sessions: u32, workers: u32) -> Vec<TraceRecord> {
    const SYSTEM_BLOCKS: u64 = 4;
    let mut rng = 0x5eed_u64;
    let mut next = move || {
        rng = mix64(rng.wrapping_add(0x9e37_79b9_7f4a_7c15));
        rng
    };
    let mut next_id = SYSTEM_BLOCKS;
    let mut ids: Vec<Vec<u64>> = (0..sessions)
        .map(|_| (0..SYSTEM_BLOCKS).collect())
        .collect();
    let mut records = Vec::new();
    let cap_blocks = context_tokens.div_ceil(TRACE_BLOCK_TOKENS);
    loop {
        let open: Vec<u32> = (0..sessions)
            .filter(|&s| (ids[s as usize].len() as u64) < cap_blocks)
            .collect();
        if open.is_empty() {
            return records;
        }
        let s = open[(next() % open.len() as u64) as usize];
        let context = &mut ids[s as usize];
        let grow = (16 + next() % 33).min(cap_blocks - context.len() as u64);
        for _ in 0..grow {
            context.push(next_id);
            next_id += 1;
        }
        records.push(TraceRecord {
            input_length: context.len() as u64 * TRACE_BLOCK_TOKENS,
            hash_ids: context.clone(),
            worker: Some(s % workers),
        });
    }
}

/// One request: its worker and its blocks (a range of the flat block arrays).
#[derive(Debug, Clone, Copy)]
pub struct Request {
    pub worker: u32,
    pub start: usize,
    pub len: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// Blocks `start..start+len` of the event arrays, stored after `parent` (a chain hash).
    Stored { parent: Option<u64> },
    /// Chain hashes `start..start+len` of the event arrays, evicted.
    Removed,
}

#[derive(Debug, Clone, Copy)]
pub struct Event {
    pub worker: u32,
    pub kind: EventKind,
    pub start: usize,
    pub len: usize,
}

/// The whole precomputed workload.
pub struct Workload {
    pub workers: u32,
    pub capacity: usize,
    /// Per request block, flat.
    pub req_content: Vec<u64>,
    pub req_chain: Vec<u64>,
    pub requests: Vec<Request>,
    /// Per event block, flat (for removals `ev_content` holds the block's content hash too).
    pub ev_content: Vec<u64>,
    pub ev_chain: Vec<u64>,
    pub events: Vec<Event>,
    /// Indexes into `requests` of the queries timed after ingestion.
    pub queries: Vec<usize>,
    pub stored_blocks: usize,
    pub removed_blocks: usize,
    /// (worker, block) pairs alive once every event is applied.
    pub live_pairs: usize,
    /// Distinct blocks alive once every event is applied.
    pub distinct_live: usize,
}

impl Workload {
    pub fn request_content(&self, r: &Request) -> &[u64] {
        &self.req_content[r.start..r.start + r.len]
    }

    pub fn request_chain(&self, r: &Request) -> &[u64] {
        &self.req_chain[r.start..r.start + r.len]
    }

    pub fn event_chain(&self, e: &Event) -> &[u64] {
        &self.ev_chain[e.start..e.start + e.len]
    }

    pub fn event_content(&self, e: &Event) -> &[u64] {
        &self.ev_content[e.start..e.start + e.len]
    }
}

/// Worker of a request: a hash of its first two trace blocks.
fn route(hash_ids: &[u64], workers: u32) -> u32 {
    let mut h = CHAIN_ROOT;
    for &id in hash_ids.iter().take(2) {
        h = mix64(h ^ id);
    }
    (h % u64::from(workers)) as u32
}

/// The records of a Mooncake-format trace file.
pub fn read_trace(trace: &Path) -> std::io::Result<Vec<TraceRecord>> {
    let reader = BufReader::new(File::open(trace)?);
    let mut records = Vec::new();
    for line in reader.lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        records.push(serde_json::from_str(&line).map_err(std::io::Error::other)?);
    }
    Ok(records)
}

pub fn load(records: &[TraceRecord], workers: u32, capacity: usize, n_queries: usize) -> Workload {
    let mut req_content = Vec::new();
    let mut req_chain = Vec::new();
    let mut requests = Vec::new();
    for rec in records {
        // Only full 64-token blocks are cached; a request longer than a worker's whole cache
        // keeps the blocks that fit.
        let n = (rec.input_length / BLOCK_TOKENS)
            .min(rec.hash_ids.len() as u64 * SUB_BLOCKS)
            .min(capacity as u64) as usize;
        let start = req_chain.len();
        let mut parent = None;
        for b in 0..n as u64 {
            let content = content_hash(rec.hash_ids[(b / SUB_BLOCKS) as usize], b % SUB_BLOCKS);
            let chain = chain_hash(parent, content);
            req_content.push(content);
            req_chain.push(chain);
            parent = Some(chain);
        }
        requests.push(Request {
            worker: rec.worker.unwrap_or_else(|| route(&rec.hash_ids, workers)),
            start,
            len: n,
        });
    }

    // Replay the requests through one LRU per worker and record the engine events.
    let mut lrus: Vec<LinkedHashMap<u64, u64>> = (0..workers)
        .map(|_| LinkedHashMap::with_capacity(capacity + 1))
        .collect();
    let mut ev_content = Vec::new();
    let mut ev_chain = Vec::new();
    let mut events = Vec::new();
    let (mut stored_blocks, mut removed_blocks) = (0, 0);
    let mut evicted: Vec<(u64, u64)> = Vec::new();
    for r in &requests {
        let lru = &mut lrus[r.worker as usize];
        let chain = &req_chain[r.start..r.start + r.len];
        let content = &req_content[r.start..r.start + r.len];
        // Held blocks of a chain always form a prefix (a parent is touched after its children,
        // so it is evicted after them): the new blocks are one run at the tail.
        let first_new = chain
            .iter()
            .position(|h| !lru.contains_key(h))
            .unwrap_or(chain.len());
        debug_assert!(chain[first_new..].iter().all(|h| !lru.contains_key(h)));
        for i in (0..chain.len()).rev() {
            if lru.to_back(&chain[i]).is_none() {
                lru.insert(chain[i], content[i]);
            }
        }
        evicted.clear();
        while lru.len() > capacity {
            if let Some(kv) = lru.pop_front() {
                evicted.push(kv);
            }
        }
        if !evicted.is_empty() {
            let start = ev_chain.len();
            for &(h, c) in &evicted {
                ev_chain.push(h);
                ev_content.push(c);
            }
            events.push(Event {
                worker: r.worker,
                kind: EventKind::Removed,
                start,
                len: evicted.len(),
            });
            removed_blocks += evicted.len();
        }
        if first_new < chain.len() {
            let start = ev_chain.len();
            ev_chain.extend_from_slice(&chain[first_new..]);
            ev_content.extend_from_slice(&content[first_new..]);
            let parent = first_new.checked_sub(1).map(|p| chain[p]);
            events.push(Event {
                worker: r.worker,
                kind: EventKind::Stored { parent },
                start,
                len: chain.len() - first_new,
            });
            stored_blocks += chain.len() - first_new;
        }
    }
    let live_pairs = lrus.iter().map(LinkedHashMap::len).sum();
    let mut distinct: HashMap<u64, ()> = HashMap::with_capacity(live_pairs);
    for lru in &lrus {
        for (&h, _) in lru.iter() {
            distinct.insert(h, ());
        }
    }

    // The queries: the last `n_queries` requests with at least one block, i.e. requests whose
    // prefixes the index has just seen stored.
    let queries: Vec<usize> = (0..requests.len())
        .rev()
        .filter(|&i| requests[i].len > 0)
        .take(n_queries)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();

    Workload {
        workers,
        capacity,
        req_content,
        req_chain,
        requests,
        ev_content,
        ev_chain,
        events,
        queries,
        stored_blocks,
        removed_blocks,
        live_pairs,
        distinct_live: distinct.len(),
    }
}
