//! The KV block index: which endpoint holds which prefix blocks.
//!
//! Two maps carry it:
//! - a global map from [`BlockKey`] to the set of endpoint slots holding that block, which
//!   answers "who holds the longest prefix of this request" in one walk over the request's keys;
//! - per endpoint, a map from the engine's opaque block hash to our key, because `BlockRemoved`
//!   events name blocks by engine hash only.
//!
//! Endpoints whose engine publishes no KV events are indexed *approximately*: the picker records
//! the blocks of the requests it routed there in a per-endpoint LRU bounded by the engine's KV
//! capacity and expiring after a TTL.
//!
//! Memory is bounded: the number of endpoints is capped, and every endpoint has a block budget.
//! An approximate endpoint evicts its least recently used block when full; a precise endpoint
//! that exceeds its budget has lost track of the engine (missed removals), so it is cleared and
//! reported for resynchronisation instead of growing.
//!
//! The holder set of a block is packed into one `u64` (one or two slots inline, more in a side
//! arena) because almost every block lives on one endpoint: this keeps a global entry at 16 bytes.

use hashbrown::HashMap;
use hashlink::LinkedHashMap;
use rustc_hash::FxBuildHasher;
use thiserror::Error;

use crate::block_keys::BlockKey;
use crate::endpoint::EndpointId;

/// Dense handle of an endpoint inside the index (reused after the endpoint is removed).
pub type Slot = u32;

/// Slots must fit in 31 bits (two are packed into one word).
const MAX_SLOTS: usize = 1 << 20;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum IndexError {
    #[error("the index already tracks {0} endpoints, its configured maximum")]
    TooManyEndpoints(usize),
    #[error("unknown index slot {0}")]
    UnknownSlot(Slot),
}

/// How an endpoint's blocks are learned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexMode {
    /// From the engine's KV events.
    Precise,
    /// From the picker's own routing decisions; entries expire `ttl_ms` after their last use.
    Approximate { ttl_ms: u64 },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexConfig {
    /// Maximum number of endpoints tracked at once.
    pub max_endpoints: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            max_endpoints: 4096,
        }
    }
}

/// Result of a store: whether the endpoint stayed within its budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreOutcome {
    Stored,
    /// A precise endpoint exceeded its block budget: it has been cleared and must be
    /// resynchronised (replayed) from its engine.
    Overflowed,
}

/// Longest run of leading blocks of a request held by one endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixMatch {
    pub slot: Slot,
    pub blocks: u32,
}

// ---- packed holder sets -------------------------------------------------------------------

const TAG_MASK: u64 = 0b11 << 62;
const TAG_ONE: u64 = 0;
const TAG_TWO: u64 = 1 << 62;
const TAG_MANY: u64 = 2 << 62;
const LOW31: u64 = (1 << 31) - 1;

/// Holder multisets too big to inline, sorted. A slot may appear more than once when two
/// engine blocks of one endpoint map to the same key; each removal takes one occurrence.
#[derive(Debug, Default)]
struct Arena {
    sets: Vec<Vec<Slot>>,
    free: Vec<u32>,
}

impl Arena {
    fn alloc(&mut self, set: Vec<Slot>) -> u64 {
        let idx = match self.free.pop() {
            Some(i) => {
                self.sets[i as usize] = set;
                i
            }
            None => {
                self.sets.push(set);
                (self.sets.len() - 1) as u32
            }
        };
        TAG_MANY | u64::from(idx)
    }

    fn release(&mut self, idx: u32) {
        self.sets[idx as usize] = Vec::new();
        self.free.push(idx);
    }
}

#[inline]
fn one(s: Slot) -> u64 {
    u64::from(s)
}

#[inline]
fn two(a: Slot, b: Slot) -> u64 {
    let (a, b) = if a <= b { (a, b) } else { (b, a) };
    TAG_TWO | u64::from(a) | (u64::from(b) << 31)
}

/// Add `slot` to the holder word `h`.
#[inline]
fn holders_add(h: u64, slot: Slot, arena: &mut Arena) -> u64 {
    match h & TAG_MASK {
        TAG_ONE => two(h as Slot, slot),
        TAG_TWO => {
            let (a, b) = ((h & LOW31) as Slot, ((h >> 31) & LOW31) as Slot);
            let mut v = vec![a, b, slot];
            v.sort_unstable();
            arena.alloc(v)
        }
        _ => {
            let set = &mut arena.sets[(h & !TAG_MASK) as usize];
            let pos = set.partition_point(|&s| s < slot);
            set.insert(pos, slot);
            h
        }
    }
}

/// Remove one occurrence of `slot`; `None` when the set becomes empty, `Some(h)` otherwise
/// (unchanged when `slot` was not a holder).
#[inline]
fn holders_remove(h: u64, slot: Slot, arena: &mut Arena) -> Option<u64> {
    match h & TAG_MASK {
        TAG_ONE => (h as Slot != slot).then_some(h),
        TAG_TWO => {
            let (a, b) = ((h & LOW31) as Slot, ((h >> 31) & LOW31) as Slot);
            Some(if a == slot {
                one(b)
            } else if b == slot {
                one(a)
            } else {
                h
            })
        }
        _ => {
            let idx = (h & !TAG_MASK) as u32;
            let set = &mut arena.sets[idx as usize];
            if let Ok(pos) = set.binary_search(&slot) {
                set.remove(pos);
            }
            if set.len() == 2 {
                let w = two(set[0], set[1]);
                arena.release(idx);
                Some(w)
            } else {
                Some(h)
            }
        }
    }
}

#[inline]
fn holders_contains(h: u64, slot: Slot, arena: &Arena) -> bool {
    match h & TAG_MASK {
        TAG_ONE => h as Slot == slot,
        TAG_TWO => (h & LOW31) as Slot == slot || ((h >> 31) & LOW31) as Slot == slot,
        _ => arena.sets[(h & !TAG_MASK) as usize]
            .binary_search(&slot)
            .is_ok(),
    }
}

/// Write the distinct holders of `h`, sorted, into `out`.
fn holders_into(h: u64, arena: &Arena, out: &mut Vec<Slot>) {
    out.clear();
    match h & TAG_MASK {
        TAG_ONE => out.push(h as Slot),
        TAG_TWO => {
            out.push((h & LOW31) as Slot);
            let b = ((h >> 31) & LOW31) as Slot;
            if out[0] != b {
                out.push(b);
            }
        }
        _ => {
            out.extend_from_slice(&arena.sets[(h & !TAG_MASK) as usize]);
            out.dedup();
        }
    }
}

// ---- per-endpoint state -------------------------------------------------------------------

#[derive(Debug)]
struct EndpointEntry {
    id: EndpointId,
    mode: IndexMode,
    max_blocks: usize,
    /// Precise mode: engine block hash → our key.
    by_engine_hash: HashMap<u64, BlockKey, FxBuildHasher>,
    /// Approximate mode: our key → last use (ms), least recently used first.
    approx: LinkedHashMap<BlockKey, u64, FxBuildHasher>,
}

impl EndpointEntry {
    fn len(&self) -> usize {
        self.by_engine_hash.len() + self.approx.len()
    }
}

/// The index. A plain struct: the service puts it behind one lock and feeds it from the
/// event and routing paths.
#[derive(Debug)]
pub struct KvIndex {
    config: IndexConfig,
    blocks: HashMap<BlockKey, u64, FxBuildHasher>,
    arena: Arena,
    endpoints: Vec<Option<EndpointEntry>>,
    free_slots: Vec<Slot>,
    slot_of: HashMap<EndpointId, Slot, FxBuildHasher>,
}

impl Default for KvIndex {
    fn default() -> Self {
        Self::new(IndexConfig::default())
    }
}

impl KvIndex {
    pub fn new(config: IndexConfig) -> Self {
        Self {
            config,
            blocks: HashMap::default(),
            arena: Arena::default(),
            endpoints: Vec::new(),
            free_slots: Vec::new(),
            slot_of: HashMap::default(),
        }
    }

    /// Pre-size the global map for `blocks` live blocks (avoids rehash pauses on warm-up).
    pub fn reserve(&mut self, blocks: usize) {
        self.blocks.reserve(blocks);
    }

    /// Track an endpoint (idempotent). Changing an endpoint's mode drops its blocks; changing
    /// its budget applies from the next store.
    pub fn add_endpoint(
        &mut self,
        id: EndpointId,
        mode: IndexMode,
        max_blocks: usize,
    ) -> Result<Slot, IndexError> {
        if let Some(&slot) = self.slot_of.get(&id) {
            let changed = self.entry(slot).is_some_and(|e| e.mode != mode);
            if changed {
                self.clear_endpoint(slot);
            }
            if let Some(e) = self.endpoints[slot as usize].as_mut() {
                e.mode = mode;
                e.max_blocks = max_blocks.max(1);
            }
            return Ok(slot);
        }
        let limit = self.config.max_endpoints.min(MAX_SLOTS);
        if self.slot_of.len() >= limit {
            return Err(IndexError::TooManyEndpoints(limit));
        }
        let entry = EndpointEntry {
            id,
            mode,
            max_blocks: max_blocks.max(1),
            by_engine_hash: HashMap::default(),
            approx: LinkedHashMap::default(),
        };
        let slot = match self.free_slots.pop() {
            Some(s) => {
                self.endpoints[s as usize] = Some(entry);
                s
            }
            None => {
                self.endpoints.push(Some(entry));
                (self.endpoints.len() - 1) as Slot
            }
        };
        self.slot_of.insert(id, slot);
        Ok(slot)
    }

    /// Stop tracking an endpoint and drop all its blocks; returns how many were dropped.
    pub fn remove_endpoint(&mut self, id: &EndpointId) -> usize {
        let Some(slot) = self.slot_of.remove(id) else {
            return 0;
        };
        let dropped = self.clear_endpoint(slot);
        self.endpoints[slot as usize] = None;
        self.free_slots.push(slot);
        dropped
    }

    pub fn slot(&self, id: &EndpointId) -> Option<Slot> {
        self.slot_of.get(id).copied()
    }

    pub fn endpoint_id(&self, slot: Slot) -> Option<EndpointId> {
        self.entry(slot).map(|e| e.id)
    }

    pub fn mode(&self, slot: Slot) -> Option<IndexMode> {
        self.entry(slot).map(|e| e.mode)
    }

    /// Blocks currently attributed to an endpoint.
    pub fn endpoint_blocks(&self, slot: Slot) -> usize {
        self.entry(slot).map_or(0, EndpointEntry::len)
    }

    /// Distinct block keys in the index.
    pub fn distinct_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// (endpoint, block) pairs in the index.
    pub fn live_blocks(&self) -> usize {
        self.endpoints
            .iter()
            .flatten()
            .map(EndpointEntry::len)
            .sum()
    }

    pub fn endpoints(&self) -> impl Iterator<Item = (Slot, EndpointId)> + '_ {
        self.endpoints
            .iter()
            .enumerate()
            .filter_map(|(i, e)| e.as_ref().map(|e| (i as Slot, e.id)))
    }

    fn entry(&self, slot: Slot) -> Option<&EndpointEntry> {
        self.endpoints.get(slot as usize).and_then(Option::as_ref)
    }

    /// Our key for an engine block hash of a precise endpoint (to continue a chain from a
    /// `BlockStored` event's parent).
    pub fn key_for_engine_hash(&self, slot: Slot, engine_hash: u64) -> Option<BlockKey> {
        self.entry(slot)
            .and_then(|e| e.by_engine_hash.get(&engine_hash).copied())
    }

    /// Blocks stored on a precise endpoint: `(engine hash, our key)` pairs in chain order. The
    /// caller derives the keys from the event's tokens and its parent (see
    /// [`Self::key_for_engine_hash`]). Storing a block twice is a no-op.
    pub fn store(
        &mut self,
        slot: Slot,
        blocks: &[(u64, BlockKey)],
    ) -> Result<StoreOutcome, IndexError> {
        let Some(entry) = self
            .endpoints
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
        else {
            return Err(IndexError::UnknownSlot(slot));
        };
        for &(engine_hash, key) in blocks {
            match entry.by_engine_hash.insert(engine_hash, key) {
                Some(old) if old == key => continue,
                Some(old) => {
                    // The engine reused a hash for different content: move the holder.
                    Self::drop_holder(&mut self.blocks, &mut self.arena, old, slot);
                }
                None => {}
            }
            match self.blocks.entry(key) {
                hashbrown::hash_map::Entry::Occupied(mut o) => {
                    let h = *o.get();
                    *o.get_mut() = holders_add(h, slot, &mut self.arena);
                }
                hashbrown::hash_map::Entry::Vacant(v) => {
                    v.insert(one(slot));
                }
            }
        }
        if entry.by_engine_hash.len() > entry.max_blocks {
            self.clear_endpoint(slot);
            return Ok(StoreOutcome::Overflowed);
        }
        Ok(StoreOutcome::Stored)
    }

    /// Blocks removed from a precise endpoint, by engine hash; unknown hashes are ignored.
    /// Returns how many were removed.
    pub fn remove(&mut self, slot: Slot, engine_hashes: &[u64]) -> usize {
        let Some(entry) = self
            .endpoints
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
        else {
            return 0;
        };
        let mut n = 0;
        for eh in engine_hashes {
            if let Some(key) = entry.by_engine_hash.remove(eh) {
                Self::drop_holder(&mut self.blocks, &mut self.arena, key, slot);
                n += 1;
            }
        }
        n
    }

    fn drop_holder(
        blocks: &mut HashMap<BlockKey, u64, FxBuildHasher>,
        arena: &mut Arena,
        key: BlockKey,
        slot: Slot,
    ) {
        if let hashbrown::hash_map::Entry::Occupied(mut o) = blocks.entry(key) {
            match holders_remove(*o.get(), slot, arena) {
                Some(h) => *o.get_mut() = h,
                None => {
                    o.remove();
                }
            }
        }
    }

    /// Drop every block of an endpoint (`AllBlocksCleared`, resync); returns how many.
    pub fn clear_endpoint(&mut self, slot: Slot) -> usize {
        let Some(entry) = self
            .endpoints
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
        else {
            return 0;
        };
        let n = entry.len();
        for (_, key) in entry.by_engine_hash.drain() {
            Self::drop_holder(&mut self.blocks, &mut self.arena, key, slot);
        }
        while let Some((key, _)) = entry.approx.pop_front() {
            Self::drop_holder(&mut self.blocks, &mut self.arena, key, slot);
        }
        entry.by_engine_hash.shrink_to(0);
        entry.approx.shrink_to_fit();
        n
    }

    /// Approximate mode: record that the blocks `keys` (a routed request's prefix) are now
    /// cached on `slot`. Earlier blocks are touched last so that the LRU evicts tails first,
    /// as an engine does. Expired and over-budget entries are evicted.
    pub fn record_routed(&mut self, slot: Slot, keys: &[BlockKey], now_ms: u64) {
        let Some(entry) = self
            .endpoints
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
        else {
            return;
        };
        let IndexMode::Approximate { ttl_ms } = entry.mode else {
            return;
        };
        // A request longer than the whole cache keeps only the blocks that fit.
        let keep = keys.len().min(entry.max_blocks);
        for &key in keys[..keep].iter().rev() {
            if entry.approx.remove(&key).is_none() {
                match self.blocks.entry(key) {
                    hashbrown::hash_map::Entry::Occupied(mut o) => {
                        let h = *o.get();
                        *o.get_mut() = holders_add(h, slot, &mut self.arena);
                    }
                    hashbrown::hash_map::Entry::Vacant(v) => {
                        v.insert(one(slot));
                    }
                }
            }
            entry.approx.insert(key, now_ms);
        }
        while entry.approx.len() > entry.max_blocks {
            if let Some((key, _)) = entry.approx.pop_front() {
                Self::drop_holder(&mut self.blocks, &mut self.arena, key, slot);
            }
        }
        Self::expire_entry(
            entry,
            &mut self.blocks,
            &mut self.arena,
            slot,
            ttl_ms,
            now_ms,
        );
    }

    fn expire_entry(
        entry: &mut EndpointEntry,
        blocks: &mut HashMap<BlockKey, u64, FxBuildHasher>,
        arena: &mut Arena,
        slot: Slot,
        ttl_ms: u64,
        now_ms: u64,
    ) -> usize {
        let mut n = 0;
        while let Some((&key, &touched)) = entry.approx.front() {
            if now_ms.saturating_sub(touched) < ttl_ms {
                break;
            }
            entry.approx.pop_front();
            Self::drop_holder(blocks, arena, key, slot);
            n += 1;
        }
        n
    }

    /// Drop approximate entries older than their TTL; returns how many. The service calls this
    /// periodically, so an entry outlives its TTL by at most one sweep interval.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        let mut n = 0;
        for (slot, e) in self.endpoints.iter_mut().enumerate() {
            if let Some(entry) = e.as_mut()
                && let IndexMode::Approximate { ttl_ms } = entry.mode
            {
                n += Self::expire_entry(
                    entry,
                    &mut self.blocks,
                    &mut self.arena,
                    slot as Slot,
                    ttl_ms,
                    now_ms,
                );
            }
        }
        n
    }

    /// For each endpoint holding block 0 of `keys`, the length of its longest unbroken run of
    /// leading blocks. Endpoints holding nothing are absent. One pass over `keys` that stops as
    /// soon as no endpoint can extend its run. `out` is cleared first; results are in slot
    /// order.
    pub fn longest_prefix(&self, keys: &[BlockKey], out: &mut Vec<PrefixMatch>) {
        out.clear();
        let Some(first) = keys.first() else {
            return;
        };
        let Some(&h0) = self.blocks.get(first) else {
            return;
        };
        // Fast path: a block held by one endpoint, the common case.
        if h0 & TAG_MASK == TAG_ONE {
            let slot = h0 as Slot;
            let mut n = 1;
            for k in &keys[1..] {
                match self.blocks.get(k) {
                    Some(&h) if holders_contains(h, slot, &self.arena) => n += 1,
                    _ => break,
                }
            }
            out.push(PrefixMatch { slot, blocks: n });
            return;
        }
        let mut active: Vec<Slot> = Vec::with_capacity(8);
        holders_into(h0, &self.arena, &mut active);
        let mut run = keys.len();
        for (i, k) in keys.iter().enumerate().skip(1) {
            let Some(&h) = self.blocks.get(k) else {
                run = i;
                break;
            };
            active.retain(|&s| {
                let keep = holders_contains(h, s, &self.arena);
                if !keep {
                    out.push(PrefixMatch {
                        slot: s,
                        blocks: i as u32,
                    });
                }
                keep
            });
            if active.is_empty() {
                break;
            }
        }
        out.extend(active.iter().map(|&slot| PrefixMatch {
            slot,
            blocks: run as u32,
        }));
        out.sort_unstable_by_key(|m| m.slot);
    }

    /// Approximate heap bytes used by the index's tables (for metrics and benchmarks).
    pub fn heap_bytes(&self) -> usize {
        let word = std::mem::size_of::<(BlockKey, u64)>() + 1;
        let mut bytes = self.blocks.capacity() * word;
        bytes += self
            .arena
            .sets
            .iter()
            .map(|s| s.capacity() * 4 + 24)
            .sum::<usize>();
        for e in self.endpoints.iter().flatten() {
            bytes += e.by_engine_hash.capacity() * word;
            // key, value, two links per node plus the table slot
            bytes += e.approx.capacity() * (16 + 16 + 8 + 8);
        }
        bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{IpAddr, Ipv4Addr};

    fn id(n: u8) -> EndpointId {
        EndpointId::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, n)), 8000, 0)
    }

    fn matches(ix: &KvIndex, keys: &[u64]) -> Vec<(Slot, u32)> {
        let mut out = Vec::new();
        ix.longest_prefix(keys, &mut out);
        out.iter().map(|m| (m.slot, m.blocks)).collect()
    }

    fn stored(ix: &mut KvIndex, slot: Slot, keys: &[u64]) {
        let pairs: Vec<_> = keys.iter().map(|&k| (k ^ 0xdead, k)).collect();
        assert_eq!(ix.store(slot, &pairs), Ok(StoreOutcome::Stored));
    }

    #[test]
    fn longest_prefix_per_endpoint() {
        let mut ix = KvIndex::default();
        let a = ix
            .add_endpoint(id(1), IndexMode::Precise, 100)
            .expect("slot");
        let b = ix
            .add_endpoint(id(2), IndexMode::Precise, 100)
            .expect("slot");
        let c = ix
            .add_endpoint(id(3), IndexMode::Precise, 100)
            .expect("slot");
        stored(&mut ix, a, &[1, 2, 3, 4]);
        stored(&mut ix, b, &[1, 2]);
        stored(&mut ix, c, &[2, 3, 4]); // no block 0: no prefix
        assert_eq!(matches(&ix, &[1, 2, 3, 4, 5]), vec![(a, 4), (b, 2)]);
        assert_eq!(matches(&ix, &[1, 9, 3]), vec![(a, 1), (b, 1)]);
        assert_eq!(matches(&ix, &[7]), vec![]);
        assert_eq!(matches(&ix, &[]), vec![]);
    }

    #[test]
    fn removal_by_engine_hash_breaks_the_run() {
        let mut ix = KvIndex::default();
        let a = ix
            .add_endpoint(id(1), IndexMode::Precise, 100)
            .expect("slot");
        stored(&mut ix, a, &[1, 2, 3]);
        assert_eq!(ix.remove(a, &[2 ^ 0xdead, 777]), 1);
        assert_eq!(matches(&ix, &[1, 2, 3]), vec![(a, 1)]);
        assert_eq!(ix.live_blocks(), 2);
    }

    #[test]
    fn many_holders_spill_to_the_arena_and_back() {
        let mut ix = KvIndex::default();
        let slots: Vec<_> = (1..=5)
            .map(|n| {
                ix.add_endpoint(id(n), IndexMode::Precise, 100)
                    .expect("slot")
            })
            .collect();
        for &s in &slots {
            stored(&mut ix, s, &[10, 11]);
        }
        assert_eq!(matches(&ix, &[10, 11]).len(), 5);
        for &s in &slots[..4] {
            ix.remove(s, &[11 ^ 0xdead]);
        }
        assert_eq!(
            matches(&ix, &[10, 11]),
            vec![
                (slots[0], 1),
                (slots[1], 1),
                (slots[2], 1),
                (slots[3], 1),
                (slots[4], 2)
            ]
        );
        assert_eq!(ix.remove_endpoint(&id(5)), 2);
        assert_eq!(matches(&ix, &[10, 11]).len(), 4);
        assert_eq!(ix.distinct_blocks(), 1);
    }

    #[test]
    fn overflow_clears_a_precise_endpoint() {
        let mut ix = KvIndex::default();
        let a = ix.add_endpoint(id(1), IndexMode::Precise, 3).expect("slot");
        stored(&mut ix, a, &[1, 2, 3]);
        let out = ix.store(a, &[(99, 4)]);
        assert_eq!(out, Ok(StoreOutcome::Overflowed));
        assert_eq!(ix.endpoint_blocks(a), 0);
        assert_eq!(ix.distinct_blocks(), 0);
    }

    #[test]
    fn approximate_lru_keeps_heads_and_expires() {
        let mut ix = KvIndex::default();
        let a = ix
            .add_endpoint(id(1), IndexMode::Approximate { ttl_ms: 1000 }, 4)
            .expect("slot");
        ix.record_routed(a, &[1, 2, 3], 0);
        ix.record_routed(a, &[1, 2, 5, 6], 10); // 5 blocks wanted, 4 fit: tail 3 evicted
        assert_eq!(ix.endpoint_blocks(a), 4);
        assert_eq!(matches(&ix, &[1, 2, 3]), vec![(a, 2)]);
        assert_eq!(matches(&ix, &[1, 2, 5, 6]), vec![(a, 4)]);
        assert_eq!(ix.expire(500), 0);
        assert_eq!(ix.expire(1010), 4);
        assert_eq!(ix.distinct_blocks(), 0);
    }

    #[test]
    fn endpoint_limit_is_enforced_and_slots_reused() {
        let mut ix = KvIndex::new(IndexConfig { max_endpoints: 2 });
        ix.add_endpoint(id(1), IndexMode::Precise, 10)
            .expect("slot");
        let b = ix
            .add_endpoint(id(2), IndexMode::Precise, 10)
            .expect("slot");
        assert_eq!(
            ix.add_endpoint(id(3), IndexMode::Precise, 10),
            Err(IndexError::TooManyEndpoints(2))
        );
        ix.remove_endpoint(&id(2));
        assert_eq!(ix.add_endpoint(id(3), IndexMode::Precise, 10), Ok(b));
        assert_eq!(ix.endpoint_id(b), Some(id(3)));
    }

    #[test]
    fn same_key_twice_on_one_endpoint_is_counted() {
        let mut ix = KvIndex::default();
        let a = ix
            .add_endpoint(id(1), IndexMode::Precise, 10)
            .expect("slot");
        ix.store(a, &[(100, 1), (200, 1)]).expect("store");
        ix.remove(a, &[100]);
        assert_eq!(
            matches(&ix, &[1]),
            vec![(a, 1)],
            "still held through hash 200"
        );
        ix.remove(a, &[200]);
        assert_eq!(matches(&ix, &[1]), vec![]);
    }

    #[test]
    fn mode_change_drops_blocks() {
        let mut ix = KvIndex::default();
        let a = ix
            .add_endpoint(id(1), IndexMode::Precise, 10)
            .expect("slot");
        stored(&mut ix, a, &[1, 2]);
        let a2 = ix
            .add_endpoint(id(1), IndexMode::Approximate { ttl_ms: 5 }, 10)
            .expect("slot");
        assert_eq!(a, a2);
        assert_eq!(ix.live_blocks(), 0);
    }
}
