//! The paged KV block pool: reference counts, the cached-hash map and the eviction queue.
//!
//! Mirrors vLLM v1's `BlockPool`: a block whose reference count drops to zero goes to the tail
//! of the free queue but keeps its hash, so it can still be hit; allocation takes blocks from
//! the head and only then evicts the hash it held. The free queue is therefore the LRU order of
//! cached blocks, and a block is only ever evicted when its space is needed.

use rustc_hash::FxHashMap;

/// Index of a physical block.
pub(crate) type BlockId = u32;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Block {
    ref_cnt: u32,
    /// Engine hash while the block is registered in the cached map.
    hash: Option<u64>,
    prev: u32,
    next: u32,
    in_free: bool,
}

/// Blocks registered under one hash. Two physical blocks can carry the same hash when a
/// request recomputes a block that is still cached (vLLM keeps both, and reports both).
#[derive(Debug, Clone)]
enum Holders {
    One(BlockId),
    Many(Vec<BlockId>),
}

/// The pool. All operations are O(1) per block.
#[derive(Debug, Clone)]
pub(crate) struct BlockPool {
    blocks: Vec<Block>,
    head: u32,
    tail: u32,
    free_len: usize,
    cached: FxHashMap<u64, Holders>,
}

impl BlockPool {
    pub(crate) fn new(num_blocks: u32) -> Self {
        let mut pool = Self {
            blocks: Vec::new(),
            head: NIL,
            tail: NIL,
            free_len: 0,
            cached: FxHashMap::default(),
        };
        pool.reset(num_blocks);
        pool
    }

    /// Forget everything: all blocks free, no hash cached, free queue in block order.
    pub(crate) fn reset(&mut self, num_blocks: u32) {
        self.blocks.clear();
        self.blocks.resize(
            num_blocks as usize,
            Block {
                ref_cnt: 0,
                hash: None,
                prev: NIL,
                next: NIL,
                in_free: false,
            },
        );
        self.head = NIL;
        self.tail = NIL;
        self.free_len = 0;
        self.cached.clear();
        for id in 0..num_blocks {
            self.push_back(id);
        }
    }

    pub(crate) fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks that can be allocated now: unreferenced ones, cached or not.
    pub(crate) fn num_free(&self) -> usize {
        self.free_len
    }

    /// Blocks referenced by at least one request.
    pub(crate) fn num_used(&self) -> usize {
        self.blocks.len() - self.free_len
    }

    /// Distinct hashes currently held.
    pub(crate) fn num_cached_hashes(&self) -> usize {
        self.cached.len()
    }

    pub(crate) fn ref_cnt(&self, id: BlockId) -> u32 {
        self.blocks[id as usize].ref_cnt
    }

    /// A block holding `hash`, if any (the first registered, like vLLM).
    pub(crate) fn lookup(&self, hash: u64) -> Option<BlockId> {
        match self.cached.get(&hash)? {
            Holders::One(id) => Some(*id),
            Holders::Many(ids) => ids.first().copied(),
        }
    }

    /// Take a reference on a cached block found by [`Self::lookup`], pulling it out of the free
    /// queue if nobody referenced it.
    pub(crate) fn touch(&mut self, id: BlockId) {
        if self.blocks[id as usize].in_free {
            self.unlink(id);
        }
        self.blocks[id as usize].ref_cnt += 1;
    }

    /// Pop one block for a new allocation. If it held a hash, that hash is unregistered and
    /// returned: the caller reports it as evicted. `None` when nothing is free.
    pub(crate) fn pop_free(&mut self) -> Option<(BlockId, Option<u64>)> {
        let id = self.head;
        if id == NIL {
            return None;
        }
        self.unlink(id);
        let evicted = self.blocks[id as usize].hash.take();
        if let Some(h) = evicted {
            self.unregister(h, id);
        }
        self.blocks[id as usize].ref_cnt = 1;
        Some((id, evicted))
    }

    /// Drop one reference; a block nobody references joins the tail of the eviction queue
    /// (keeping its hash).
    pub(crate) fn release(&mut self, id: BlockId) {
        let b = &mut self.blocks[id as usize];
        debug_assert!(
            b.ref_cnt > 0,
            "block {id} released more often than referenced"
        );
        b.ref_cnt = b.ref_cnt.saturating_sub(1);
        if b.ref_cnt == 0 && !b.in_free {
            self.push_back(id);
        }
    }

    /// Register a just-filled block under its hash.
    pub(crate) fn register(&mut self, id: BlockId, hash: u64) {
        debug_assert!(self.blocks[id as usize].hash.is_none());
        self.blocks[id as usize].hash = Some(hash);
        self.cached
            .entry(hash)
            .and_modify(|h| match h {
                Holders::One(first) => *h = Holders::Many(vec![*first, id]),
                Holders::Many(v) => v.push(id),
            })
            .or_insert(Holders::One(id));
    }

    fn unregister(&mut self, hash: u64, id: BlockId) {
        let remove = match self.cached.get_mut(&hash) {
            Some(Holders::One(b)) => *b == id,
            Some(Holders::Many(v)) => {
                v.retain(|&b| b != id);
                if v.len() == 1 {
                    let only = v[0];
                    self.cached.insert(hash, Holders::One(only));
                    false
                } else {
                    v.is_empty()
                }
            }
            None => false,
        };
        if remove {
            self.cached.remove(&hash);
        }
    }

    /// Hashes of the free (evictable) cached blocks in eviction order, for tests.
    #[cfg(test)]
    pub(crate) fn eviction_order(&self) -> Vec<u64> {
        let mut out = Vec::new();
        let mut cur = self.head;
        while cur != NIL {
            if let Some(h) = self.blocks[cur as usize].hash {
                out.push(h);
            }
            cur = self.blocks[cur as usize].next;
        }
        out
    }

    fn push_back(&mut self, id: BlockId) {
        let b = &mut self.blocks[id as usize];
        b.prev = self.tail;
        b.next = NIL;
        b.in_free = true;
        if self.tail == NIL {
            self.head = id;
        } else {
            self.blocks[self.tail as usize].next = id;
        }
        self.tail = id;
        self.free_len += 1;
    }

    fn unlink(&mut self, id: BlockId) {
        let (prev, next) = {
            let b = &self.blocks[id as usize];
            (b.prev, b.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let b = &mut self.blocks[id as usize];
        b.prev = NIL;
        b.next = NIL;
        b.in_free = false;
        self.free_len -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_reuse_and_eviction() {
        let mut p = BlockPool::new(3);
        let (a, _) = p.pop_free().unwrap_or((NIL, None));
        let (b, _) = p.pop_free().unwrap_or((NIL, None));
        p.register(a, 10);
        p.register(b, 11);
        assert_eq!(p.num_free(), 1);
        p.release(b);
        p.release(a);
        // b was freed first, so it is evicted before a (after the never-used block 2).
        assert_eq!(p.eviction_order(), vec![11, 10]);
        assert_eq!(p.lookup(10), Some(a));
        p.touch(a);
        assert_eq!(p.num_free(), 2);
        assert_eq!(p.pop_free(), Some((2, None)));
        assert_eq!(p.pop_free(), Some((b, Some(11))));
        assert_eq!(p.lookup(11), None);
        assert_eq!(p.pop_free(), None);
    }

    #[test]
    fn duplicate_hashes_are_kept_per_block() {
        let mut p = BlockPool::new(2);
        let (a, _) = p.pop_free().unwrap_or((NIL, None));
        let (b, _) = p.pop_free().unwrap_or((NIL, None));
        p.register(a, 7);
        p.register(b, 7);
        assert_eq!(p.num_cached_hashes(), 1);
        p.release(a);
        p.release(b);
        assert_eq!(p.pop_free(), Some((a, Some(7))));
        assert_eq!(p.lookup(7), Some(b));
        assert_eq!(p.pop_free(), Some((b, Some(7))));
        assert_eq!(p.lookup(7), None);
        assert_eq!(p.num_cached_hashes(), 0);
    }
}
