//! Hit-rate references for a replayed request sequence.
//!
//! * **Ceiling**: one worker with an infinite cache. A request hits the longest run of its
//!   leading blocks that some earlier prompt held as full blocks. No router can do better.
//! * **Ideal with capacity**: one pooled LRU cache as large as all engines together — what a
//!   router that placed every prefix perfectly could keep (an estimate: LRU is not optimal,
//!   and real engines cannot pool). Shown to tell capacity misses from routing misses.
//!
//! Both count like the engines: hits never cover a prompt's last token (it is recomputed for
//! its logits) and are whole engine blocks.

use hashlink::LinkedHashMap;
use rustc_hash::{FxBuildHasher, FxHashSet};

/// Accumulates both references over requests in release order.
pub struct Ceilings {
    block_tokens: u32,
    engine_block: u32,
    seen: FxHashSet<u64>,
    lru: LinkedHashMap<u64, (), FxBuildHasher>,
    /// Capacity of the pooled cache in hash-id blocks (0 = not computed).
    lru_blocks: usize,
    prompt_tokens: u64,
    ceiling_hits: u64,
    ideal_hits: u64,
}

impl Ceilings {
    /// `capacity_tokens`: the KV capacity of all engines together (0 disables the ideal).
    pub fn new(block_tokens: u32, engine_block: u32, capacity_tokens: u64) -> Self {
        let block_tokens = block_tokens.max(1);
        Self {
            block_tokens,
            engine_block: engine_block.max(1),
            seen: FxHashSet::default(),
            lru: LinkedHashMap::default(),
            lru_blocks: (capacity_tokens / u64::from(block_tokens)) as usize,
            prompt_tokens: 0,
            ceiling_hits: 0,
            ideal_hits: 0,
        }
    }

    fn hit_tokens(&self, blocks: usize, input_len: u32) -> u64 {
        let raw = (blocks as u64 * u64::from(self.block_tokens))
            .min(u64::from(input_len.saturating_sub(1)));
        raw / u64::from(self.engine_block) * u64::from(self.engine_block)
    }

    /// Account one request (in the order the requests were sent).
    pub fn observe(&mut self, hash_ids: &[u64], input_len: u32) {
        self.prompt_tokens += u64::from(input_len);
        let full = (input_len / self.block_tokens) as usize;
        let full = full.min(hash_ids.len());
        let matched = hash_ids
            .iter()
            .take_while(|h| self.seen.contains(h))
            .count();
        self.ceiling_hits += self.hit_tokens(matched, input_len);
        self.seen.extend(hash_ids[..full].iter().copied());
        if self.lru_blocks > 0 {
            let matched = hash_ids
                .iter()
                .take_while(|h| self.lru.contains_key(*h))
                .count();
            self.ideal_hits += self.hit_tokens(matched, input_len);
            for &h in &hash_ids[..full] {
                // move to the most recently used end
                self.lru.remove(&h);
                self.lru.insert(h, ());
            }
            while self.lru.len() > self.lru_blocks {
                self.lru.pop_front();
            }
        }
    }

    /// Infinite-cache single-worker hit rate.
    pub fn ceiling(&self) -> f64 {
        ratio(self.ceiling_hits, self.prompt_tokens)
    }

    /// Pooled-LRU hit rate with the configured capacity, if computed.
    pub fn ideal(&self) -> Option<f64> {
        (self.lru_blocks > 0).then(|| ratio(self.ideal_hits, self.prompt_tokens))
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}
