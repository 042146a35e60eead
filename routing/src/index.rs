//! The KV block index: which endpoint holds which prefix blocks.
//!
//! Blocks are kept in **chain segments**: arrays of `(key, holders)` in the order they were
//! stored, so that a request's blocks, which were stored as runs of one chain, are read one
//! after another instead of being looked up one by one in a large table. Three structures carry
//! the index:
//! - the segments themselves: each block sits at one place, `(segment, offset)`, that never
//!   moves while the block is held (a segment grows at its tail, is cut back from its tail, and
//!   a block that dies in the middle stays as a placeholder until the tail reaches it);
//! - a global table from [`BlockKey`] to the place of every *held* block, so that any key is
//!   found whatever chain it was stored on (keys are position-independent: a key is one block);
//! - per endpoint, a table from the engine's opaque block hash to the block's place, because
//!   `BlockRemoved` events name blocks by engine hash only.
//!
//! A prefix lookup finds block 0 through the global table and then walks the segment it lands
//! in, comparing the request's next key with the segment's next key; only where the request
//! leaves the segment (a branch, or the next event's run) does it go back to the global table.
//!
//! Endpoints whose engine publishes no KV events are indexed *approximately*: the picker records
//! the blocks of the requests it routed there in a per-endpoint LRU bounded by the engine's KV
//! capacity and expiring after a TTL.
//!
//! Memory is bounded: the number of endpoints is capped, and every endpoint has a block budget.
//! An approximate endpoint evicts its least recently used block when full; a precise endpoint
//! that exceeds its budget has lost track of the engine (missed removals), so it is cleared and
//! reported for resynchronisation instead of growing. Both tables are bucketized cuckoo tables
//! of 16-byte slots sized on a non-power-of-two ladder (an endpoint's table stops at its
//! budget), so that a table is never left half empty by a doubling.
//!
//! The holder set of a block is packed into one `u64` (one or two slots inline, more in a side
//! arena) because almost every block lives on one endpoint.

use hashbrown::HashMap;
use hashlink::LinkedHashMap;
use prefetch_index::prefetch_index;
use rustc_hash::FxBuildHasher;
use thiserror::Error;

use crate::block_keys::BlockKey;
use crate::endpoint::EndpointId;

mod residency;
mod seed;
use residency::Residency;
pub use residency::{
    Credit, EventPlace, GroupKind, LOWER_TIER_FACTOR, MAX_GROUPS, MAX_LOWER_TIERS, Namespace,
    NamespaceRefusal, Tier, TierBlocks,
};
pub use seed::{Exported, SeedOutcome};

/// Dense handle of an endpoint inside the index (reused after the endpoint is removed).
pub type Slot = u32;

/// Slots must fit in 31 bits (two are packed into one word).
const MAX_SLOTS: usize = 1 << 20;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum IndexError {
    #[error(
        "tracking {adding} more endpoint(s) beside the {tracked} tracked now would pass index.maxEndpoints ({limit})"
    )]
    TooManyEndpoints {
        limit: usize,
        tracked: usize,
        adding: usize,
    },
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
    /// The most engine hashes one precise endpoint may hold over all its tiers, whatever
    /// tiers its engine reports (`index.maxBlocksPerEndpoint`): lower tiers are room inside
    /// this bound, never a multiple of it.
    pub max_blocks_per_endpoint: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            max_endpoints: 4096,
            max_blocks_per_endpoint: 2 << 20,
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
/// The holder word of a block nobody holds (a placeholder in a segment).
const NOBODY: u64 = u64::MAX;
const LOW31: u64 = (1 << 31) - 1;

/// Holder multisets too big to inline, sorted. A slot may appear more than once when two
/// engine blocks of one endpoint map to the same key; each removal takes one occurrence.
/// Consecutive blocks of a chain with the same holders share one set (reference-counted, copied
/// on write), so that a lookup sees "same holders as the previous block" in the words alone.
#[derive(Debug, Default)]
struct Arena {
    sets: Vec<Vec<Slot>>,
    refs: Vec<u32>,
    free: Vec<u32>,
}

impl Arena {
    fn alloc(&mut self, set: Vec<Slot>) -> u64 {
        let idx = match self.free.pop() {
            Some(i) => {
                self.sets[i as usize] = set;
                self.refs[i as usize] = 1;
                i
            }
            None => {
                self.sets.push(set);
                self.refs.push(1);
                (self.sets.len() - 1) as u32
            }
        };
        TAG_MANY | u64::from(idx)
    }

    fn retain(&mut self, h: u64) {
        self.refs[(h & !TAG_MASK) as usize] += 1;
    }

    fn release(&mut self, h: u64) {
        let idx = (h & !TAG_MASK) as usize;
        self.refs[idx] -= 1;
        if self.refs[idx] == 0 {
            self.sets[idx] = Vec::new();
            self.free.push(idx as u32);
        }
    }

    /// A set of its own for the word `h` (a copy when it is shared).
    fn unique(&mut self, h: u64) -> u64 {
        if self.refs[(h & !TAG_MASK) as usize] == 1 {
            return h;
        }
        let copy = self.set(h).to_vec();
        self.release(h);
        self.alloc(copy)
    }

    fn set(&self, h: u64) -> &[Slot] {
        &self.sets[(h & !TAG_MASK) as usize]
    }

    fn set_mut(&mut self, h: u64) -> &mut Vec<Slot> {
        &mut self.sets[(h & !TAG_MASK) as usize]
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

/// Add `slot` to the holder word `h` (which may be [`NOBODY`]).
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
        TAG_MANY => {
            let h = arena.unique(h);
            let set = arena.set_mut(h);
            let pos = set.partition_point(|&s| s < slot);
            set.insert(pos, slot);
            h
        }
        _ => one(slot),
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
        TAG_MANY => {
            let set = arena.set(h);
            let Ok(pos) = set.binary_search(&slot) else {
                return Some(h);
            };
            if set.len() == 3 {
                let mut rest = set.iter().enumerate().filter(|&(i, _)| i != pos);
                let (x, y) = match (rest.next(), rest.next()) {
                    (Some((_, &x)), Some((_, &y))) => (x, y),
                    _ => return Some(h),
                };
                arena.release(h);
                return Some(two(x, y));
            }
            let h = arena.unique(h);
            arena.set_mut(h).remove(pos);
            Some(h)
        }
        _ => Some(h),
    }
}

/// Whether `slot` holds a block with holder word `h`; the single-holder case is one compare.
#[inline]
fn holds(h: u64, slot: Slot, arena: &Arena) -> bool {
    h == one(slot) || (h & TAG_MASK != TAG_ONE && holds_slow(h, slot, arena))
}

fn holds_slow(h: u64, slot: Slot, arena: &Arena) -> bool {
    match h & TAG_MASK {
        TAG_ONE => h as Slot == slot,
        TAG_TWO => (h & LOW31) as Slot == slot || ((h >> 31) & LOW31) as Slot == slot,
        TAG_MANY => arena.set(h).binary_search(&slot).is_ok(),
        _ => false,
    }
}

/// Marks a match still being extended (never a real block count).
const EXTENDING: u32 = u32::MAX;

/// Append one [`PrefixMatch`] per distinct holder of `h` to `out`, in slot order.
fn push_holders(h: u64, arena: &Arena, out: &mut Vec<PrefixMatch>) {
    let mut push = |slot| {
        if out.last().is_none_or(|m: &PrefixMatch| m.slot != slot) {
            out.push(PrefixMatch {
                slot,
                blocks: EXTENDING,
            });
        }
    };
    match h & TAG_MASK {
        TAG_ONE => push(h as Slot),
        TAG_TWO => {
            push((h & LOW31) as Slot);
            push(((h >> 31) & LOW31) as Slot);
        }
        TAG_MANY => arena.set(h).iter().for_each(|&s| push(s)),
        _ => {}
    }
}

/// Whether two holder words name the same holders (conservative: `false` may be wrong).
#[inline]
fn same_holders(a: u64, b: u64, arena: &Arena) -> bool {
    a == b || (a & TAG_MASK == TAG_MANY && b & TAG_MASK == TAG_MANY && arena.set(a) == arena.set(b))
}

// ---- hash tables -------------------------------------------------------------------------

/// A slot's value when it is empty (never a real place: segment ids stay below `u32::MAX`).
const VACANT: u64 = u64::MAX;
/// Slots per bucket: one 64-byte cache line.
const BUCKET: usize = 4;
/// Tables hold at most 65% of their slots: at 75% the insertions that find both buckets full
/// (and load eight more lines to move an entry) cost a tenth of the ingest rate.
const LOAD_NUM: usize = 13;
const LOAD_DEN: usize = 20;
const MIN_BUCKETS: usize = 2;
/// Displacements an insertion tries before the table grows.
const MAX_KICKS: usize = 64;

#[derive(Debug, Clone, Copy)]
struct Entry {
    key: u64,
    val: u64,
}

const EMPTY_ENTRY: Entry = Entry {
    key: 0,
    val: VACANT,
};

#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
struct Bucket([Entry; BUCKET]);

const EMPTY_BUCKET: Bucket = Bucket([EMPTY_ENTRY; BUCKET]);

impl Bucket {
    #[inline]
    fn position(&self, key: u64) -> Option<usize> {
        self.0.iter().position(|e| e.key == key && e.val != VACANT)
    }

    #[inline]
    fn vacancy(&self) -> Option<usize> {
        self.0.iter().position(|e| e.val == VACANT)
    }
}

/// `u64 → u64` hash table, bucketized cuckoo: a key lives in one of two buckets of four
/// 16-byte slots, each bucket one aligned cache line. A lookup reads exactly those two lines,
/// whose addresses follow from the key alone, so a batch of operations can load its lines
/// first and overlap the misses; a removal clears a slot (no tombstones, no shifting); an
/// insertion into two full buckets moves an entry to its other bucket (rarely more than once
/// below 85% load). Any bucket count works (a bucket is picked by multiply-shift, not by
/// mask), so the table grows by half, and with a `limit` (an endpoint's block budget) it stops
/// growing at the size that holds `limit` entries.
#[derive(Debug, Default)]
struct Table {
    buckets: Vec<Bucket>,
    len: usize,
    limit: usize,
}

/// Buckets needed to hold `n` entries within the load limit.
fn buckets_for(n: usize) -> usize {
    (n * LOAD_DEN).div_ceil(LOAD_NUM * BUCKET).max(MIN_BUCKETS)
}

impl Table {
    fn with_limit(limit: usize) -> Self {
        Self {
            limit,
            ..Self::default()
        }
    }

    fn len(&self) -> usize {
        self.len
    }

    fn heap_bytes(&self) -> usize {
        self.buckets.capacity() * std::mem::size_of::<Bucket>()
    }

    /// The two buckets of `key` (distinct).
    #[inline]
    fn homes(&self, key: u64) -> (usize, usize) {
        // SplitMix64's finaliser; its two halves pick the two buckets.
        let mut h = key ^ 0x6a09_e667_f3bc_c909;
        h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        h ^= h >> 31;
        let n = self.buckets.len() as u128;
        let a = ((u128::from(h) * n) >> 64) as usize;
        let mut b = ((u128::from(h.rotate_left(32)) * n) >> 64) as usize;
        if a == b {
            b = if a + 1 == self.buckets.len() {
                0
            } else {
                a + 1
            };
        }
        (a, b)
    }

    #[inline]
    fn find(&self, key: u64) -> Option<(usize, usize)> {
        if self.len == 0 {
            return None;
        }
        let (a, b) = self.homes(key);
        if let Some(i) = self.buckets[a].position(key) {
            return Some((a, i));
        }
        self.buckets[b].position(key).map(|i| (b, i))
    }

    #[inline]
    fn get(&self, key: u64) -> Option<u64> {
        self.find(key).map(|(b, i)| self.buckets[b].0[i].val)
    }

    /// Ask for `key`'s two buckets ahead of an operation on it, so that the cache misses of a
    /// batch overlap (a prefetch hint: it neither blocks nor faults, unlike a load).
    #[inline]
    fn prefetch(&self, key: u64) {
        if self.buckets.is_empty() {
            return;
        }
        let (a, b) = self.homes(key);
        prefetch_index(&self.buckets, a);
        prefetch_index(&self.buckets, b);
    }

    /// Insert or replace; returns the previous value.
    fn insert(&mut self, key: u64, val: u64) -> Option<u64> {
        debug_assert_ne!(val, VACANT);
        if let Some((b, i)) = self.find(key) {
            return Some(std::mem::replace(&mut self.buckets[b].0[i].val, val));
        }
        self.insert_absent(key, val);
        None
    }

    /// Insert a key known to be absent (skips the lookup).
    fn insert_absent(&mut self, key: u64, val: u64) {
        debug_assert!(self.find(key).is_none());
        if self.len >= self.buckets.len() * BUCKET * LOAD_NUM / LOAD_DEN {
            self.grow(self.len + 1);
        }
        let mut pending = Entry { key, val };
        while let Err(left) = self.insert_new(pending) {
            // Too crowded to place: grow, then place the entry that was left over.
            self.grow(self.len + 1);
            pending = left;
        }
    }

    /// Place an entry whose key is absent; on failure, returns the entry left without a slot
    /// (the table holds all the others).
    fn insert_new(&mut self, e: Entry) -> Result<(), Entry> {
        let (a, b) = self.homes(e.key);
        // The emptier of the two buckets: keeping buckets level makes displacements rare.
        let free = |at: usize| {
            self.buckets[at]
                .0
                .iter()
                .filter(|e| e.val == VACANT)
                .count()
        };
        let at = if free(b) > free(a) { b } else { a };
        if let Some(i) = self.buckets[at].vacancy() {
            self.buckets[at].0[i] = e;
            self.len += 1;
            return Ok(());
        }
        // Both full: move a resident whose other bucket has room. The eight other buckets are
        // loaded together, so this costs one memory round trip, not one per candidate.
        let mut others = [0usize; 2 * BUCKET];
        for (k, other) in others.iter_mut().enumerate() {
            let at = if k < BUCKET { a } else { b };
            let (x, y) = self.homes(self.buckets[at].0[k % BUCKET].key);
            *other = if x == at { y } else { x };
            prefetch_index(&self.buckets, *other);
        }
        for (k, &other) in others.iter().enumerate() {
            if let Some(v) = self.buckets[other].vacancy() {
                let at = if k < BUCKET { a } else { b };
                self.buckets[other].0[v] = self.buckets[at].0[k % BUCKET];
                self.buckets[at].0[k % BUCKET] = e;
                self.len += 1;
                return Ok(());
            }
        }
        // Cuckoo: evict an entry to its other bucket, and so on.
        let mut carry = e;
        let mut at = if e.key & 1 == 0 { a } else { b };
        for kick in 0..MAX_KICKS {
            let victim = (kick + (carry.key >> 7) as usize) % BUCKET;
            std::mem::swap(&mut carry, &mut self.buckets[at].0[victim]);
            let (x, y) = self.homes(carry.key);
            at = if x == at { y } else { x };
            if let Some(i) = self.buckets[at].vacancy() {
                self.buckets[at].0[i] = carry;
                self.len += 1;
                return Ok(());
            }
        }
        Err(carry)
    }

    fn remove(&mut self, key: u64) -> Option<u64> {
        let (b, i) = self.find(key)?;
        let val = self.buckets[b].0[i].val;
        self.buckets[b].0[i] = EMPTY_ENTRY;
        self.len -= 1;
        Some(val)
    }

    /// Make room for `want` entries: grow by half, up to the size the limit calls for.
    fn grow(&mut self, want: usize) {
        let cur = self.buckets.len();
        let mut target = (cur + cur / 2).max(MIN_BUCKETS);
        if self.limit > 0 {
            // Bounded by a budget: double on the way (fewer rebuilds), stop at the budget.
            let full = buckets_for(self.limit);
            if cur < full {
                target = (2 * cur).clamp(MIN_BUCKETS, full);
            }
        }
        self.rebuild(target.max(buckets_for(want)).max(cur + 1));
    }

    fn rebuild(&mut self, n: usize) {
        let mut n = n;
        let old = std::mem::take(&mut self.buckets);
        'retry: loop {
            self.buckets = vec![EMPTY_BUCKET; n];
            self.len = 0;
            // Old entries land at random in the new table: load a batch's buckets first.
            for batch in old.chunks(AHEAD / BUCKET) {
                for e in batch.iter().flat_map(|b| b.0.iter()) {
                    self.prefetch(e.key);
                }
                for e in batch.iter().flat_map(|b| b.0.iter()) {
                    if e.val != VACANT && self.insert_new(*e).is_err() {
                        n += n / 8 + 1;
                        continue 'retry;
                    }
                }
            }
            return;
        }
    }

    fn reserve(&mut self, entries: usize) {
        if buckets_for(entries) > self.buckets.len() {
            self.rebuild(buckets_for(entries));
        }
    }

    /// Remove every entry, returning the values (and the memory).
    fn take_values(&mut self) -> impl Iterator<Item = u64> + use<> {
        self.len = 0;
        std::mem::take(&mut self.buckets)
            .into_iter()
            .flat_map(|b| b.0)
            .filter(|e| e.val != VACANT)
            .map(|e| e.val)
    }
}

// ---- chain segments -----------------------------------------------------------------------

#[derive(Debug, Clone, Copy)]
struct Block {
    key: BlockKey,
    holders: u64,
}

/// A block's place: segment id in the high half, offset in the low half.
type ChainPos = u64;

#[inline]
fn place_of(seg: usize, off: usize) -> ChainPos {
    ((seg as u64) << 32) | off as u64
}

#[inline]
fn split(p: ChainPos) -> (usize, usize) {
    ((p >> 32) as usize, (p & 0xffff_ffff) as usize)
}

/// How [`Chains::batch_places`] finds blocks in an endpoint's engine-hash table: reading it,
/// or taking them out of it.
enum Lookup<'a> {
    Read(&'a Table),
    Take(&'a mut Table),
}

impl Lookup<'_> {
    fn prefetch(&self, engine_hash: u64) {
        match self {
            Lookup::Read(t) => t.prefetch(engine_hash),
            Lookup::Take(t) => t.prefetch(engine_hash),
        }
    }

    fn find(&mut self, engine_hash: u64) -> Option<ChainPos> {
        match self {
            Lookup::Read(t) => t.get(engine_hash),
            Lookup::Take(t) => t.remove(engine_hash),
        }
    }
}

/// Every block of the index, its holders, and the key → place table.
#[derive(Debug, Default)]
struct Chains {
    segs: Vec<Vec<Block>>,
    free_segs: Vec<u32>,
    /// Chain position of every held block, by key.
    by_key: Table,
    arena: Arena,
}

impl Chains {
    #[inline]
    fn block(&self, p: ChainPos) -> &Block {
        let (s, o) = split(p);
        &self.segs[s][o]
    }

    /// The held block right after `p` in its segment, if its key is `key`.
    #[inline]
    fn next_in_segment(&self, p: ChainPos, key: BlockKey) -> Option<ChainPos> {
        let (s, o) = split(p);
        match self.segs[s].get(o + 1) {
            Some(b) if b.key == key && b.holders != NOBODY => Some(place_of(s, o + 1)),
            _ => None,
        }
    }

    /// Chain position of the held block `key`, looking right after `prev` first.
    #[inline]
    fn find(&self, prev: ChainPos, key: BlockKey) -> Option<ChainPos> {
        self.next_in_segment(prev, key)
            .or_else(|| self.by_key.get(key))
    }

    /// Where block `key`, stored right after the block at `prev` (if known), goes: its current
    /// place when held, else a placeholder of it right after `prev`, else the tail of `prev`'s
    /// segment, else a new segment (sized for `run` blocks, the rest of the store).
    /// The places of a batch of at most [`AHEAD`] blocks, by engine hash in their endpoint's
    /// table ([`VACANT`] where it has none), each level's lines asked for before any is read
    /// so that the misses overlap: the table's, then the segments', then the global table's.
    fn batch_places(&self, batch: &[u64], mut table: Lookup<'_>) -> [ChainPos; AHEAD] {
        for &eh in batch {
            table.prefetch(eh);
        }
        let mut places = [VACANT; AHEAD];
        for (p, &eh) in places.iter_mut().zip(batch) {
            *p = table.find(eh).unwrap_or(VACANT);
        }
        for &p in places.iter().filter(|&&p| p != VACANT) {
            let (s, o) = split(p);
            prefetch_index(&self.segs[s], o);
        }
        for &p in places.iter().filter(|&&p| p != VACANT) {
            self.by_key.prefetch(self.block(p).key);
        }
        places
    }

    fn place(&mut self, prev: Option<ChainPos>, key: BlockKey, run: usize) -> ChainPos {
        if let Some(p) = prev
            && let Some(at) = self.next_in_segment(p, key)
        {
            return at;
        }
        if let Some(at) = self.by_key.get(key) {
            return at;
        }
        if let Some(p) = prev {
            let (s, o) = split(p);
            let seg = &mut self.segs[s];
            if o + 1 == seg.len() {
                if seg.len() == seg.capacity() {
                    seg.reserve_exact(run.max(seg.len() / 2).max(4));
                }
                seg.push(Block {
                    key,
                    holders: NOBODY,
                });
                return place_of(s, o + 1);
            }
            if seg.get(o + 1).is_some_and(|b| b.key == key) {
                return place_of(s, o + 1); // its own unheld placeholder
            }
        }
        let mut blocks = Vec::with_capacity(run.max(1));
        blocks.push(Block {
            key,
            holders: NOBODY,
        });
        let s = match self.free_segs.pop() {
            Some(s) => {
                self.segs[s as usize] = blocks;
                s as usize
            }
            None => {
                self.segs.push(blocks);
                self.segs.len() - 1
            }
        };
        place_of(s, 0)
    }

    /// Add `slot` to the holders of the block at `p` (registering its key when it was unheld).
    #[inline]
    fn hold(&mut self, p: ChainPos, slot: Slot) {
        let (s, o) = split(p);
        let b = &mut self.segs[s][o];
        if b.holders == NOBODY {
            b.holders = one(slot);
            self.by_key.insert_absent(b.key, p);
        } else {
            b.holders = holders_add(b.holders, slot, &mut self.arena);
            if b.holders & TAG_MASK == TAG_MANY {
                self.share(s, o);
            }
        }
    }

    /// Let the block at `(s, o)` share its holder set with a neighbour holding the same set.
    fn share(&mut self, s: usize, o: usize) {
        let seg = &mut self.segs[s];
        let h = seg[o].holders;
        for n in [o.wrapping_sub(1), o + 1] {
            let Some(&Block { holders: hn, .. }) = seg.get(n) else {
                continue;
            };
            if hn != h && hn & TAG_MASK == TAG_MANY && self.arena.set(hn) == self.arena.set(h) {
                self.arena.retain(hn);
                self.arena.release(h);
                seg[o].holders = hn;
                return;
            }
        }
    }

    /// Remove one holding of `slot` from the block at `p`; an unheld block leaves the key
    /// table, and unheld blocks at a segment's tail are cut off.
    fn release(&mut self, p: ChainPos, slot: Slot) {
        let (s, o) = split(p);
        let seg = &mut self.segs[s];
        let b = &mut seg[o];
        if let Some(h) = holders_remove(b.holders, slot, &mut self.arena) {
            b.holders = h;
            if h & TAG_MASK == TAG_MANY {
                self.share(s, o);
            }
            return;
        }
        b.holders = NOBODY;
        let key = b.key;
        self.by_key.remove(key);
        if o + 1 == seg.len() {
            while seg.last().is_some_and(|b| b.holders == NOBODY) {
                seg.pop();
            }
            if seg.is_empty() {
                *seg = Vec::new();
                self.free_segs.push(s as u32);
            } else if seg.capacity() > 2 * seg.len() + 8 {
                seg.shrink_to(seg.len() + seg.len() / 4);
            }
        }
    }

    /// How many leading keys of `rest` `slot` holds, continuing the chain after `from`.
    fn follow(&self, slot: Slot, from: ChainPos, rest: &[BlockKey]) -> usize {
        let (mut s, mut o) = split(from);
        let mut n = 0;
        while n < rest.len() {
            let after = &self.segs[s][o + 1..];
            let m = after
                .iter()
                .zip(&rest[n..])
                .take_while(|&(b, &k)| b.key == k && holds(b.holders, slot, &self.arena))
                .count();
            n += m;
            if n == rest.len() {
                break;
            }
            if let Some(b) = after.get(m)
                && b.key == rest[n]
                && b.holders != NOBODY
            {
                break; // the block itself, held by others only
            }
            match self.by_key.get(rest[n]) {
                Some(p) if holds(self.block(p).holders, slot, &self.arena) => {
                    n += 1;
                    (s, o) = split(p);
                }
                _ => break,
            }
        }
        n
    }

    fn heap_bytes(&self) -> usize {
        self.by_key.heap_bytes()
            + self.segs.capacity() * std::mem::size_of::<Vec<Block>>()
            + self
                .segs
                .iter()
                .map(|s| s.capacity() * std::mem::size_of::<Block>())
                .sum::<usize>()
            + self
                .arena
                .sets
                .iter()
                .map(|s| s.capacity() * 4 + 24)
                .sum::<usize>()
    }
}

/// Blocks of an endpoint's budget whose table room is allocated when the endpoint is added
/// (the rest, if its budget is larger, as it fills): 1.6 MB of table at most.
const PRESIZE_BLOCKS: usize = 1 << 16;
/// Keys the global table is presized for at most, whatever the endpoints' budgets (52 MB).
const PRESIZE_KEYS: usize = 1 << 21;

/// Blocks a batch asks the table lines of at once, so that their cache misses overlap.
const AHEAD: usize = 32;
/// How many blocks ahead a store asks for the table lines it will read: enough to cover a
/// memory round trip (8 and 16 measure alike, 4 is slower; `benches/index-compare`).
const DISTANCE: usize = 8;

// ---- per-endpoint state -------------------------------------------------------------------

#[derive(Debug, Clone, Copy)]
struct Touched {
    at_ms: u64,
    place: ChainPos,
}

/// [`EndpointEntry::budget`] of an endpoint with `lower_tiers` tiers below the GPU.
fn tiered_budget(max_blocks: usize, cap: usize, lower_tiers: usize) -> usize {
    max_blocks
        .saturating_mul(1 + LOWER_TIER_FACTOR.saturating_mul(lower_tiers))
        .min(cap.max(max_blocks))
}

#[derive(Debug)]
struct EndpointEntry {
    id: EndpointId,
    mode: IndexMode,
    max_blocks: usize,
    /// The configured bound on all its tiers together ([`IndexConfig::max_blocks_per_endpoint`]).
    cap: usize,
    /// Precise mode: engine block hash → place of the block.
    by_engine_hash: Table,
    /// Approximate mode: our key → last use (ms) and place, least recently used first.
    approx: LinkedHashMap<BlockKey, Touched, FxBuildHasher>,
    /// Precise mode: the engine's KV-cache groups and tiers.
    residency: Residency,
    /// Precise mode: blocks of requests routed here whose `BlockStored` has not arrived yet,
    /// with the time (ms) their provisional credit ends; earliest first.
    provisional: LinkedHashMap<BlockKey, u64, FxBuildHasher>,
    /// Precise mode: engine hashes the engine holds in more than one physical block, with the
    /// number of extra copies. vLLM registers a block a request recomputed while an equal
    /// one was still cached (two requests on one new prefix in a step, or one that waited)
    /// and reports the eviction of each copy: the block leaves the index with its last one.
    /// At most the block budget of hashes is tracked.
    copies: HashMap<u64, u32, FxBuildHasher>,
    /// Precise mode: the engine has stored blocks after ones the index never saw (the picker
    /// subscribed, or restarted, after the engine's replay window): its view has a gap that
    /// no later event fills (a cached prefix the engine keeps hitting is never stored again),
    /// so blocks routed here are credited for as long as an approximate endpoint's, until the
    /// engine's cache is cleared ([`KvIndex::mark_gap`]).
    gap: bool,
    /// Which view of the endpoint this is: a new number when it is added or cleared, so that
    /// work on it that let others at the index in between can tell ([`KvIndex::view`]).
    view: u64,
    /// Precise mode: blocks loaded from a snapshot or a peer ([`KvIndex::seed_endpoint`]) that
    /// the engine's own events have not confirmed yet.
    unconfirmed: Option<seed::Unconfirmed>,
}

impl EndpointEntry {
    /// Precise mode's bound on engine hashes: the block budget, and
    /// [`LOWER_TIER_FACTOR`] times it for each tier below the GPU the engine reports (host
    /// memory and disk tiers are commonly several times the GPU's cache), never more than
    /// the configured per-endpoint bound (`cap`) however many tiers the engine names.
    fn budget(&self) -> usize {
        tiered_budget(self.max_blocks, self.cap, self.residency.lower_tiers())
    }

    fn len(&self) -> usize {
        self.by_engine_hash.len() + self.approx.len()
    }
}

/// The index. A plain struct: the service puts it behind one lock and feeds it from the
/// event and routing paths.
#[derive(Debug)]
pub struct KvIndex {
    config: IndexConfig,
    chains: Chains,
    endpoints: Vec<Option<EndpointEntry>>,
    free_slots: Vec<Slot>,
    slot_of: HashMap<EndpointId, Slot, FxBuildHasher>,
    /// Endpoints whose credit needs more than the primary namespace (hybrid groups, lower
    /// tiers, an unmodelled group kind); 0 keeps [`KvIndex::credit`] on its fast path.
    special: usize,
    /// Provisional blocks over all endpoints (0 also keeps that path fast).
    provisional: usize,
    /// The last view number given ([`EndpointEntry::view`]).
    views: u64,
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
            chains: Chains::default(),
            endpoints: Vec::new(),
            free_slots: Vec::new(),
            slot_of: HashMap::default(),
            special: 0,
            provisional: 0,
            views: 0,
        }
    }

    /// Pre-size the key table for `blocks` distinct blocks (avoids rehash pauses on warm-up).
    pub fn reserve(&mut self, blocks: usize) {
        self.chains.by_key.reserve(blocks);
    }

    /// Track an endpoint (idempotent). Changing an endpoint's mode drops its blocks; changing
    /// its budget applies from the next store.
    pub fn add_endpoint(
        &mut self,
        id: EndpointId,
        mode: IndexMode,
        max_blocks: usize,
    ) -> Result<Slot, IndexError> {
        let max_blocks = max_blocks.max(1);
        if let Some(&slot) = self.slot_of.get(&id) {
            let changed = self.entry(slot).is_some_and(|e| e.mode != mode);
            if changed {
                self.clear_endpoint(slot);
            }
            let mut over = false;
            if let Some(e) = self.endpoints[slot as usize].as_mut() {
                e.mode = mode;
                e.max_blocks = max_blocks;
                if changed {
                    e.residency = Residency::default();
                }
                e.by_engine_hash.limit = e.budget();
                // a smaller budget holds at once: approximate entries go least recently used
                // first; a precise view over it cannot be trimmed (removals are the engine's)
                // and is dropped, to be rebuilt from the events that follow
                while e.approx.len() > max_blocks {
                    if let Some((_, t)) = e.approx.pop_front() {
                        self.chains.release(t.place, slot);
                    }
                }
                over = e.by_engine_hash.len() > e.budget();
            }
            if over {
                self.clear_endpoint(slot);
            }
            if changed {
                self.special = self.count_special();
            }
            return Ok(slot);
        }
        let limit = self.max_endpoints();
        if self.slot_of.len() >= limit {
            return Err(IndexError::TooManyEndpoints {
                limit,
                tracked: self.slot_of.len(),
                adding: 1,
            });
        }
        let mut by_engine_hash = Table::with_limit(max_blocks);
        let presize = max_blocks.min(PRESIZE_BLOCKS);
        if mode == IndexMode::Precise {
            by_engine_hash.reserve(presize);
        }
        // Every block the endpoint may hold can be a distinct key: room in the key table is
        // made now (growing it at least twofold) rather than by many rebuilds while it warms up.
        let want = (self.budgeted_blocks() + presize).min(PRESIZE_KEYS);
        let keys = &mut self.chains.by_key;
        if buckets_for(want) > keys.buckets.len() {
            let doubled = keys.buckets.len() * BUCKET * 2 * LOAD_NUM / LOAD_DEN;
            keys.reserve(want.max(doubled.min(PRESIZE_KEYS)));
        }
        let entry = EndpointEntry {
            id,
            mode,
            max_blocks,
            cap: self.config.max_blocks_per_endpoint,
            by_engine_hash,
            approx: LinkedHashMap::default(),
            residency: Residency::default(),
            provisional: LinkedHashMap::default(),
            copies: HashMap::default(),
            gap: false,
            view: self.next_view(),
            unconfirmed: None,
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
        self.special = self.count_special();
        dropped
    }

    /// The most endpoints tracked at once.
    pub fn max_endpoints(&self) -> usize {
        self.config.max_endpoints.min(MAX_SLOTS)
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
        self.chains.by_key.len()
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

    /// Blocks the tracked endpoints may hold together, as far as presizing goes.
    fn budgeted_blocks(&self) -> usize {
        self.endpoints
            .iter()
            .flatten()
            .map(|e| e.max_blocks.min(PRESIZE_BLOCKS))
            .sum()
    }

    fn entry(&self, slot: Slot) -> Option<&EndpointEntry> {
        self.endpoints.get(slot as usize).and_then(Option::as_ref)
    }

    /// Our key for an engine block hash of a precise endpoint (to continue a chain from a
    /// `BlockStored` event's parent).
    pub fn key_for_engine_hash(&self, slot: Slot, engine_hash: u64) -> Option<BlockKey> {
        let p = self.entry(slot)?.by_engine_hash.get(engine_hash)?;
        Some(self.chains.block(p).key)
    }

    /// Blocks stored on a precise endpoint: `(engine hash, our key)` pairs in chain order. The
    /// caller derives the keys from the event's tokens and its parent (see
    /// [`Self::key_for_engine_hash`]). Storing a block twice is a no-op.
    pub fn store(
        &mut self,
        slot: Slot,
        blocks: &[(u64, BlockKey)],
    ) -> Result<StoreOutcome, IndexError> {
        self.store_after(slot, None, blocks)
    }

    /// Like [`Self::store`], for blocks that continue the endpoint's block with engine hash
    /// `parent` (a `BlockStored` event's parent): they are laid out right after it, so that a
    /// lookup reads parent and children in one pass. An unknown parent is not an error (the
    /// blocks are stored all the same).
    pub fn store_after(
        &mut self,
        slot: Slot,
        parent: Option<u64>,
        blocks: &[(u64, BlockKey)],
    ) -> Result<StoreOutcome, IndexError> {
        let Some(entry) = self
            .endpoints
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
        else {
            return Err(IndexError::UnknownSlot(slot));
        };
        if !entry.provisional.is_empty() {
            // the engine's own word supersedes the picker's guess
            let before = entry.provisional.len();
            for (_, key) in blocks {
                entry.provisional.remove(key);
            }
            self.provisional -= before - entry.provisional.len();
        }
        let chains = &mut self.chains;
        let mut prev = parent.and_then(|p| entry.by_engine_hash.get(p));
        for &(eh, k) in blocks.iter().take(DISTANCE) {
            entry.by_engine_hash.prefetch(eh);
            chains.by_key.prefetch(k);
        }
        for (i, &(engine_hash, key)) in blocks.iter().enumerate() {
            if let Some(&(eh, k)) = blocks.get(i + DISTANCE) {
                entry.by_engine_hash.prefetch(eh);
                chains.by_key.prefetch(k);
            }
            let p = match entry.by_engine_hash.get(engine_hash) {
                Some(old) if chains.block(old).key == key && seed::confirm(entry, key) => {
                    // a seeded block the engine stores again: confirmed, not a second copy
                    prev = Some(old);
                    continue;
                }
                Some(old) if chains.block(old).key == key => {
                    // another physical copy of a block it holds
                    if entry.copies.len() < entry.max_blocks
                        || entry.copies.contains_key(&engine_hash)
                    {
                        let n = entry.copies.entry(engine_hash).or_insert(0);
                        *n = n.saturating_add(1);
                    }
                    prev = Some(old);
                    continue;
                }
                Some(old) => {
                    // The engine reused a hash for different content: move the holder.
                    entry.copies.remove(&engine_hash);
                    chains.release(old, slot);
                    if prev == Some(old) {
                        prev = None; // that block may be gone now
                    }
                    let p = chains.place(prev, key, blocks.len() - i);
                    chains.hold(p, slot);
                    entry.by_engine_hash.insert(engine_hash, p);
                    p
                }
                None => {
                    let p = chains.place(prev, key, blocks.len() - i);
                    chains.hold(p, slot);
                    entry.by_engine_hash.insert_absent(engine_hash, p);
                    p
                }
            };
            prev = Some(p);
        }
        if entry.by_engine_hash.len() > entry.budget() && entry.unconfirmed.is_some() {
            // what the engine said outranks what a snapshot or a peer said it held
            self.drop_unconfirmed(slot);
        }
        if self
            .entry(slot)
            .is_some_and(|e| e.by_engine_hash.len() > e.budget())
        {
            self.clear_endpoint(slot);
            return Ok(StoreOutcome::Overflowed);
        }
        Ok(StoreOutcome::Stored)
    }

    /// Read, changing nothing, the table lines a [`Self::store_after`] of `blocks` on `slot`
    /// will write, so that a writer can bring them into its cache while readers still share
    /// the index and hold it alone only for the writes. Returns how many of the blocks the
    /// endpoint holds already, and how many the index holds.
    pub fn warm_store(&self, slot: Slot, blocks: &[(u64, BlockKey)]) -> (usize, usize) {
        let Some(entry) = self.entry(slot) else {
            return (0, 0);
        };
        let by_key = &self.chains.by_key;
        for &(eh, k) in blocks.iter().take(DISTANCE) {
            entry.by_engine_hash.prefetch(eh);
            by_key.prefetch(k);
        }
        let (mut held, mut known) = (0, 0);
        for (i, &(eh, k)) in blocks.iter().enumerate() {
            if let Some(&(eh, k)) = blocks.get(i + DISTANCE) {
                entry.by_engine_hash.prefetch(eh);
                by_key.prefetch(k);
            }
            held += usize::from(entry.by_engine_hash.get(eh).is_some());
            known += usize::from(by_key.get(k).is_some());
        }
        (held, known)
    }

    /// Like [`Self::warm_store`], for a [`Self::remove`]: the endpoint's table, the blocks'
    /// places in their segments and the global table. Returns how many of the blocks the
    /// endpoint holds.
    pub fn warm_remove(&self, slot: Slot, engine_hashes: &[u64]) -> usize {
        let Some(entry) = self.entry(slot) else {
            return 0;
        };
        let mut held = 0;
        for batch in engine_hashes.chunks(AHEAD) {
            let places = self
                .chains
                .batch_places(batch, Lookup::Read(&entry.by_engine_hash));
            for &p in places.iter().filter(|&&p| p != VACANT) {
                let b = self.chains.block(p);
                held += usize::from(
                    holds(b.holders, slot, &self.chains.arena)
                        && self.chains.by_key.get(b.key) == Some(p),
                );
            }
        }
        held
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
        // an evicted copy of a block held twice leaves the other
        let kept: Vec<u64>;
        let engine_hashes = if entry.copies.is_empty() {
            engine_hashes
        } else {
            kept = engine_hashes
                .iter()
                .copied()
                .filter(|eh| match entry.copies.get_mut(eh) {
                    Some(n) => {
                        *n -= 1;
                        if *n == 0 {
                            entry.copies.remove(eh);
                        }
                        false
                    }
                    None => true,
                })
                .collect();
            &kept
        };
        let mut n = 0;
        // In batches: ask for the batch's table lines first, so that their misses overlap.
        for batch in engine_hashes.chunks(AHEAD) {
            let places = self
                .chains
                .batch_places(batch, Lookup::Take(&mut entry.by_engine_hash));
            for &p in places.iter().filter(|&&p| p != VACANT) {
                if let Some(u) = entry.unconfirmed.as_mut() {
                    u.keys.remove(&self.chains.block(p).key);
                }
                self.chains.release(p, slot);
                n += 1;
            }
        }
        n
    }

    /// Drop every block of an endpoint (`AllBlocksCleared`, resync); returns how many.
    pub fn clear_endpoint(&mut self, slot: Slot) -> usize {
        let view = self.next_view();
        let Some(entry) = self
            .endpoints
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
        else {
            return 0;
        };
        let n = entry.len();
        for p in entry.by_engine_hash.take_values() {
            self.chains.release(p, slot);
        }
        while let Some((_, t)) = entry.approx.pop_front() {
            self.chains.release(t.place, slot);
        }
        entry.approx.shrink_to_fit();
        self.provisional -= entry.provisional.len();
        entry.provisional = LinkedHashMap::default();
        entry.copies = HashMap::default();
        entry.gap = false;
        entry.unconfirmed = None;
        entry.view = view;
        n
    }

    fn next_view(&mut self) -> u64 {
        self.views += 1;
        self.views
    }

    /// Which view of `slot`'s endpoint the index holds: it changes when the endpoint is
    /// cleared, removed or replaced in the slot. Work that lets others at the index between
    /// steps (a large event batch) checks it before going on.
    pub fn view(&self, slot: Slot) -> Option<u64> {
        self.entry(slot).map(|e| e.view)
    }

    /// Precise mode: `slot`'s engine stored blocks whose parents the index never saw (its
    /// view has a gap; see [`EndpointEntry::gap`]); returns whether that is news. Until the
    /// endpoint is cleared, [`KvIndex::has_gap`] says so and the routing record credits it.
    /// The provisional credits it holds already (the requests whose stores revealed the gap
    /// among them: those stores name no key the index can confirm) last `extend_ms` longer.
    pub fn mark_gap(&mut self, slot: Slot, extend_ms: u64) -> bool {
        match self
            .endpoints
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
        {
            Some(e) if e.mode == IndexMode::Precise && !e.gap => {
                e.gap = true;
                // the same shift for all keeps them in expiry order
                for (_, until) in e.provisional.iter_mut() {
                    *until = until.saturating_add(extend_ms);
                }
                true
            }
            _ => false,
        }
    }

    /// Whether `slot`'s view has a gap (see [`KvIndex::mark_gap`]).
    pub fn has_gap(&self, slot: Slot) -> bool {
        self.entry(slot).is_some_and(|e| e.gap)
    }

    /// Precise mode: the blocks `keys` of a request just routed to `slot` count as held there
    /// until `now_ms + ttl_ms` or until the engine's `BlockStored` for them arrives, whichever
    /// is first, so that a burst sharing a new prefix (n-sampling, an agent's fan-out, a new
    /// system prompt) is not spread before any event can arrive. At most the endpoint's block
    /// budget is kept, the oldest dropped first.
    pub fn record_provisional(&mut self, slot: Slot, keys: &[BlockKey], now_ms: u64, ttl_ms: u64) {
        let Some(entry) = self
            .endpoints
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
        else {
            return;
        };
        if entry.mode != IndexMode::Precise || ttl_ms == 0 {
            return;
        }
        let before = entry.provisional.len();
        Self::expire_provisional(entry, now_ms);
        let until = now_ms.saturating_add(ttl_ms);
        let keys = &keys[..keys.len().min(entry.max_blocks)];
        let chains = &self.chains;
        // The prefix the endpoint holds needs no provisional credit. It is found by walking its
        // chain (one table lookup, then the segments in order), not key by key: a long prompt
        // that is mostly cached used to cost a random table read per block here.
        let held = match keys.first().and_then(|&k| chains.by_key.get(k)) {
            Some(p0) if holds(chains.block(p0).holders, slot, &chains.arena) => {
                1 + chains.follow(slot, p0, &keys[1..])
            }
            _ => 0,
        };
        if let Some(u) = entry.unconfirmed.as_mut() {
            // the engine holds what it is sent once it has prefilled it (a seeded block it had
            // evicted is stored again): seeded blocks of a routed prefix need no more proof
            for k in &keys[..held] {
                u.keys.remove(k);
            }
        }
        for batch in keys[held..].chunks(AHEAD) {
            if entry.by_engine_hash.len() > 0 {
                // ask for the batch's table lines first, so that their misses overlap
                for &key in batch {
                    chains.by_key.prefetch(key);
                }
            }
            for &key in batch {
                if entry.by_engine_hash.len() == 0
                    || chains
                        .by_key
                        .get(key)
                        .is_none_or(|p| !holds(chains.block(p).holders, slot, &chains.arena))
                {
                    entry.provisional.insert(key, until);
                }
            }
        }
        while entry.provisional.len() > entry.max_blocks {
            entry.provisional.pop_front();
        }
        self.provisional = self.provisional + entry.provisional.len() - before;
    }

    fn expire_provisional(entry: &mut EndpointEntry, now_ms: u64) -> usize {
        let mut n = 0;
        while entry
            .provisional
            .front()
            .is_some_and(|(_, &until)| until <= now_ms)
        {
            entry.provisional.pop_front();
            n += 1;
        }
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
        let mut prev = None;
        for (i, &key) in keys[..keep].iter().enumerate() {
            let p = match entry.approx.get(&key) {
                Some(t) => t.place,
                None => {
                    let p = self.chains.place(prev, key, keep - i);
                    self.chains.hold(p, slot);
                    entry.approx.insert(
                        key,
                        Touched {
                            at_ms: now_ms,
                            place: p,
                        },
                    );
                    p
                }
            };
            prev = Some(p);
        }
        for key in keys[..keep].iter().rev() {
            if let Some(t) = entry.approx.to_back(key) {
                t.at_ms = now_ms;
            }
        }
        while entry.approx.len() > entry.max_blocks {
            if let Some((_, t)) = entry.approx.pop_front() {
                self.chains.release(t.place, slot);
            }
        }
        Self::expire_entry(entry, &mut self.chains, slot, ttl_ms, now_ms);
    }

    fn expire_entry(
        entry: &mut EndpointEntry,
        chains: &mut Chains,
        slot: Slot,
        ttl_ms: u64,
        now_ms: u64,
    ) -> usize {
        let mut n = 0;
        while let Some((_, t)) = entry.approx.front() {
            if now_ms.saturating_sub(t.at_ms) < ttl_ms {
                break;
            }
            let place = t.place;
            entry.approx.pop_front();
            chains.release(place, slot);
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
                n += Self::expire_entry(entry, &mut self.chains, slot as Slot, ttl_ms, now_ms);
            }
            if let Some(entry) = e.as_mut() {
                self.provisional -= Self::expire_provisional(entry, now_ms);
            }
        }
        n + self.expire_unconfirmed(now_ms)
    }

    /// For each endpoint holding block 0 of `keys`, the length of its longest unbroken run of
    /// leading blocks. Endpoints holding nothing are absent. One pass over `keys` that stops as
    /// soon as no endpoint can extend its run. `out` is cleared first; results are in slot
    /// order.
    pub fn longest_prefix(&self, keys: &[BlockKey], out: &mut Vec<PrefixMatch>) {
        out.clear();
        let Some(&first) = keys.first() else {
            return;
        };
        let Some(p0) = self.chains.by_key.get(first) else {
            return;
        };
        let arena = &self.chains.arena;
        let h0 = self.chains.block(p0).holders;
        // Fast path: a block held by one endpoint, the common case.
        if h0 & TAG_MASK == TAG_ONE {
            let slot = h0 as Slot;
            let n = 1 + self.chains.follow(slot, p0, &keys[1..]);
            out.push(PrefixMatch {
                slot,
                blocks: n as u32,
            });
            return;
        }
        push_holders(h0, arena, out);
        let mut extending = out.len();
        let (mut at, mut h_at) = (p0, h0);
        let mut run = keys.len();
        for (i, &key) in keys.iter().enumerate().skip(1) {
            let Some(p) = self.chains.find(at, key) else {
                run = i;
                break;
            };
            at = p;
            let h = self.chains.block(p).holders;
            if same_holders(h, h_at, arena) {
                continue;
            }
            h_at = h;
            for m in out.iter_mut().filter(|m| m.blocks == EXTENDING) {
                if !holds(h, m.slot, arena) {
                    m.blocks = i as u32;
                    extending -= 1;
                }
            }
            if extending <= 1 {
                if let Some(m) = out.iter_mut().find(|m| m.blocks == EXTENDING) {
                    m.blocks = (i + 1 + self.chains.follow(m.slot, p, &keys[i + 1..])) as u32;
                }
                return;
            }
        }
        for m in out.iter_mut().filter(|m| m.blocks == EXTENDING) {
            m.blocks = run as u32;
        }
    }

    /// Approximate heap bytes used by the index's tables (for metrics and benchmarks).
    pub fn heap_bytes(&self) -> usize {
        let mut bytes = self.chains.heap_bytes();
        for e in self.endpoints.iter().flatten() {
            bytes += e.by_engine_hash.heap_bytes();
            // key, value, two links per node plus the table slot
            bytes += e.approx.capacity() * (8 + 16 + 16 + 8);
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
    fn warming_reads_what_a_step_will_write_and_changes_nothing() {
        let mut ix = KvIndex::default();
        let [a, b] = [1, 2].map(|n| {
            ix.add_endpoint(id(n), IndexMode::Precise, 100)
                .expect("slot")
        });
        stored(&mut ix, a, &[1, 2, 3]);
        let pairs: Vec<_> = [1, 2, 3, 4].iter().map(|&k| (k ^ 0xdead, k)).collect();
        assert_eq!(ix.warm_store(a, &pairs), (3, 3));
        assert_eq!(ix.warm_store(b, &pairs), (0, 3), "b holds none of a's");
        assert_eq!(ix.warm_store(99, &pairs), (0, 0), "an unknown slot");
        assert_eq!(ix.warm_remove(a, &[2 ^ 0xdead, 777]), 1);
        assert_eq!(ix.warm_remove(b, &[2 ^ 0xdead]), 0);
        assert_eq!(matches(&ix, &[1, 2, 3, 4]), vec![(a, 3)]);
        assert_eq!((ix.live_blocks(), ix.endpoint_blocks(b)), (3, 0));
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
        let mut ix = KvIndex::new(IndexConfig {
            max_endpoints: 2,
            ..Default::default()
        });
        ix.add_endpoint(id(1), IndexMode::Precise, 10)
            .expect("slot");
        let b = ix
            .add_endpoint(id(2), IndexMode::Precise, 10)
            .expect("slot");
        assert_eq!(
            ix.add_endpoint(id(3), IndexMode::Precise, 10),
            Err(IndexError::TooManyEndpoints {
                limit: 2,
                tracked: 2,
                adding: 1
            })
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

    #[test]
    fn chains_continue_across_stores_and_branches() {
        let mut ix = KvIndex::default();
        let a = ix
            .add_endpoint(id(1), IndexMode::Precise, 100)
            .expect("slot");
        let b = ix
            .add_endpoint(id(2), IndexMode::Precise, 100)
            .expect("slot");
        stored(&mut ix, a, &[1, 2, 3]);
        // continues a's chain after block 3 (laid out in the same segment)
        let pairs: Vec<_> = [4u64, 5].iter().map(|&k| (k ^ 0xdead, k)).collect();
        assert_eq!(
            ix.store_after(a, Some(3 ^ 0xdead), &pairs),
            Ok(StoreOutcome::Stored)
        );
        // b branches off after block 2, and also holds 1, 2
        let pairs: Vec<_> = [1u64, 2, 7, 8].iter().map(|&k| (k ^ 0xbeef, k)).collect();
        assert_eq!(ix.store(b, &pairs), Ok(StoreOutcome::Stored));
        assert_eq!(matches(&ix, &[1, 2, 3, 4, 5, 6]), vec![(a, 5), (b, 2)]);
        assert_eq!(matches(&ix, &[1, 2, 7, 8, 9]), vec![(a, 2), (b, 4)]);
        assert_eq!(matches(&ix, &[4, 5]), vec![(a, 2)]);
        assert_eq!(ix.key_for_engine_hash(a, 5 ^ 0xdead), Some(5));
        assert_eq!(ix.distinct_blocks(), 7);
        // a hole in the middle of a's chain, then the block comes back
        assert_eq!(ix.remove(a, &[3 ^ 0xdead]), 1);
        assert_eq!(matches(&ix, &[1, 2, 3, 4, 5]), vec![(a, 2), (b, 2)]);
        assert_eq!(matches(&ix, &[4, 5]), vec![(a, 2)]);
        let back = [(3 ^ 0xbeef, 3)];
        assert_eq!(
            ix.store_after(b, Some(2 ^ 0xbeef), &back),
            Ok(StoreOutcome::Stored)
        );
        assert_eq!(matches(&ix, &[1, 2, 3, 4]), vec![(a, 2), (b, 3)]);
        stored(&mut ix, a, &[3]);
        assert_eq!(matches(&ix, &[1, 2, 3, 4, 5]), vec![(a, 5), (b, 3)]);
        ix.remove_endpoint(&id(1));
        ix.remove_endpoint(&id(2));
        assert_eq!(ix.distinct_blocks(), 0);
        assert_eq!(ix.live_blocks(), 0);
    }

    #[test]
    fn engine_hash_reused_within_one_store() {
        let mut ix = KvIndex::default();
        let a = ix
            .add_endpoint(id(1), IndexMode::Precise, 100)
            .expect("slot");
        ix.store(a, &[(100, 1), (100, 2), (101, 3)]).expect("store");
        assert_eq!(matches(&ix, &[1]), vec![]);
        assert_eq!(matches(&ix, &[2, 3]), vec![(a, 2)]);
        assert_eq!(ix.live_blocks(), 2);
        assert_eq!(ix.distinct_blocks(), 2);
    }

    #[test]
    fn tables_shrink_and_grow_under_churn() {
        let mut ix = KvIndex::default();
        let a = ix
            .add_endpoint(id(1), IndexMode::Precise, 1000)
            .expect("slot");
        for round in 0..50u64 {
            let keys: Vec<u64> = (0..200).map(|i| round * 1000 + i).collect();
            stored(&mut ix, a, &keys);
            assert_eq!(matches(&ix, &keys), vec![(a, 200)]);
            let evict: Vec<u64> = keys[100..].iter().rev().map(|k| k ^ 0xdead).collect();
            assert_eq!(ix.remove(a, &evict), 100);
            assert_eq!(matches(&ix, &keys), vec![(a, 100)]);
            let rest: Vec<u64> = keys[..100].iter().map(|k| k ^ 0xdead).collect();
            assert_eq!(ix.remove(a, &rest), 100);
        }
        assert_eq!(ix.distinct_blocks(), 0);
        assert_eq!(ix.endpoint_blocks(a), 0);
    }

    #[test]
    fn provisional_credit_is_bounded_superseded_by_events_and_expires() {
        let mut ix = KvIndex::default();
        let a = ix.add_endpoint(id(1), IndexMode::Precise, 3).expect("slot");
        let b = ix
            .add_endpoint(id(2), IndexMode::Approximate { ttl_ms: 1000 }, 10)
            .expect("slot");
        let credit = |ix: &KvIndex, keys: &[u64], now| {
            let mut out = Vec::new();
            ix.credit(keys, now, &mut Vec::new(), &mut out);
            out.iter()
                .map(|c| (c.slot, c.blocks, c.provisional))
                .collect::<Vec<_>>()
        };
        // four blocks wanted, the budget is three: a prefix's first blocks are kept
        ix.record_provisional(a, &[1, 2, 3, 4], 0, 100);
        assert_eq!(credit(&ix, &[1, 2, 3, 4], 50), vec![(a, 3, 3)]);
        // a later request's blocks push the oldest out
        ix.record_provisional(a, &[5, 6], 10, 100);
        assert_eq!(credit(&ix, &[1, 2, 3], 50), vec![]);
        assert_eq!(credit(&ix, &[5, 6], 50), vec![(a, 2, 2)]);
        // an approximate endpoint learns from record_routed, not from this
        ix.record_provisional(b, &[7, 8], 0, 100);
        assert_eq!(credit(&ix, &[7, 8], 50), vec![]);
        // the engine's events supersede the guess: block 5 is now held, 6 still provisional
        ix.store(a, &[(0xe5, 5)]).expect("stored");
        assert_eq!(credit(&ix, &[5, 6], 50), vec![(a, 2, 1)]);
        // the TTL ends the rest exactly at its end
        assert_eq!(credit(&ix, &[5, 6], 109), vec![(a, 2, 1)]);
        assert_eq!(credit(&ix, &[5, 6], 110), vec![(a, 1, 0)]);
        ix.expire(110);
        assert_eq!(ix.provisional, 0);
        // a clear (resync, staleness) drops provisional credit with the rest
        ix.record_provisional(a, &[7, 8], 200, 100);
        ix.clear_endpoint(a);
        assert_eq!((ix.provisional, credit(&ix, &[7, 8], 210)), (0, vec![]));
    }

    #[test]
    fn provisional_credit_covers_what_the_endpoint_does_not_hold() {
        let mut ix = KvIndex::default();
        let a = ix
            .add_endpoint(id(1), IndexMode::Precise, 1000)
            .expect("slot");
        let b = ix
            .add_endpoint(id(2), IndexMode::Precise, 1000)
            .expect("slot");
        // a holds a 40-block prefix (stored in two runs), and block 50 on its own; b holds
        // blocks 40-44, which a does not
        let run = |r: std::ops::Range<u64>| r.map(|k| (0xe000 + k, k)).collect::<Vec<_>>();
        ix.store(a, &run(0..30)).expect("stored");
        ix.store_after(a, Some(0xe000 + 29), &run(30..40))
            .expect("stored");
        ix.store(a, &run(50..51)).expect("stored");
        ix.store(b, &run(40..45)).expect("stored");
        let keys: Vec<u64> = (0..100).collect();
        ix.record_provisional(a, &keys, 0, 100);
        // every block a does not hold, and only those, is provisional there
        assert_eq!(ix.provisional, 100 - 41);
        let mut out = Vec::new();
        ix.credit(&keys[..50], 10, &mut Vec::new(), &mut out);
        let on_a = out.iter().find(|c| c.slot == a).expect("credited");
        assert_eq!((on_a.blocks, on_a.provisional), (50, 10));
        // a prompt whose first block a does not hold: every block is checked
        ix.record_provisional(a, &[200, 50, 201], 0, 100);
        assert_eq!(ix.provisional, 100 - 41 + 2);
    }
}
