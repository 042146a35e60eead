//! Block keys: the picker's own chained 64-bit hash over each full block of token ids.
//!
//! Engines' block hashes are opaque (vLLM's depend on `PYTHONHASHSEED` and the hash algorithm,
//! SGLang's are a different SHA-256 chain), so the picker hashes token ids itself, with one
//! function for both request prompts and the `token_ids` carried by `BlockStored` events. The
//! chain makes a key identify the whole prefix up to and including its block, so equal keys mean
//! equal prefixes, exactly like the engines' prefix caches.
//!
//! Extra keys (model, LoRA adapter, tenant/cache salt) are folded into the chain's root, i.e.
//! only the first block carries them; every later block inherits them through the chain. This is
//! how vLLM treats `cache_salt`.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// The picker's key for one KV block (a whole prefix up to that block).
pub type BlockKey = u64;

/// The root of a chain: identifies the model, adapter and salt every block key descends from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ChainRoot(u64);

impl ChainRoot {
    /// Root for `model`, an optional LoRA adapter and an optional tenant/cache salt. Fields are
    /// length-prefixed so that `("ab", "c")` and `("a", "bc")` give different roots.
    pub fn new(model: &str, lora: Option<&str>, salt: Option<&str>) -> Self {
        let mut buf = Vec::with_capacity(model.len() + 32);
        for part in [Some(model), lora, salt] {
            match part {
                Some(p) => {
                    buf.push(1);
                    buf.extend_from_slice(&(p.len() as u64).to_le_bytes());
                    buf.extend_from_slice(p.as_bytes());
                }
                None => buf.push(0),
            }
        }
        Self(xxh3_64(&buf))
    }

    pub fn value(self) -> u64 {
        self.0
    }
}

/// Hashes token ids into block keys for one model configuration's block size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHasher {
    block_size: usize,
}

/// Largest supported block size, in tokens; engines use 1–256.
pub const MAX_BLOCK_SIZE: usize = 4096;

impl BlockHasher {
    /// `block_size` must be in `1..=MAX_BLOCK_SIZE`; out-of-range values are clamped so that a
    /// bad config cannot make hashing panic or allocate without bound (configs are validated
    /// before they get here).
    pub fn new(block_size: u32) -> Self {
        Self {
            block_size: (block_size as usize).clamp(1, MAX_BLOCK_SIZE),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Number of full blocks in `n_tokens` tokens; a trailing partial block is never cached.
    pub fn full_blocks(&self, n_tokens: usize) -> usize {
        n_tokens / self.block_size
    }

    /// Key of the block that follows `parent` (or starts the chain at `root`).
    #[inline]
    pub fn next_key(&self, parent: u64, block_tokens: &[u32], scratch: &mut Vec<u8>) -> BlockKey {
        // sized once, then filled in place: a straight copy on little-endian machines
        scratch.resize(block_tokens.len() * 4, 0);
        for (bytes, t) in scratch.chunks_exact_mut(4).zip(block_tokens) {
            bytes.copy_from_slice(&t.to_le_bytes());
        }
        xxh3_64_with_seed(scratch, parent)
    }

    /// Keys of every full block of `tokens`, chained from `root`, appended to `out`.
    pub fn keys_into(&self, root: ChainRoot, tokens: &[u32], out: &mut Vec<BlockKey>) {
        self.continue_into(root.0, tokens, out);
    }

    /// Like [`Self::keys_into`] but continuing a chain from an existing parent key (used for
    /// `BlockStored` events whose first block has a parent).
    pub fn continue_into(&self, parent: u64, tokens: &[u32], out: &mut Vec<BlockKey>) {
        let mut scratch = Vec::with_capacity(self.block_size * 4);
        let mut prev = parent;
        out.reserve(self.full_blocks(tokens.len()));
        for block in tokens.chunks_exact(self.block_size) {
            prev = self.next_key(prev, block, &mut scratch);
            out.push(prev);
        }
    }

    pub fn keys(&self, root: ChainRoot, tokens: &[u32]) -> Vec<BlockKey> {
        let mut out = Vec::new();
        self.keys_into(root, tokens, &mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(n: u32) -> Vec<u32> {
        (0..n)
            .map(|i| i.wrapping_mul(2_654_435_761) % 50_000)
            .collect()
    }

    #[test]
    fn only_full_blocks_are_keyed() {
        let h = BlockHasher::new(16);
        let root = ChainRoot::new("m", None, None);
        assert_eq!(h.keys(root, &toks(15)).len(), 0);
        assert_eq!(h.keys(root, &toks(16)).len(), 1);
        assert_eq!(h.keys(root, &toks(47)).len(), 2);
    }

    #[test]
    fn shared_prefix_shares_leading_keys_only() {
        let h = BlockHasher::new(4);
        let root = ChainRoot::new("m", None, None);
        let a = toks(16);
        let mut b = a.clone();
        b[9] += 1; // inside block 2
        let (ka, kb) = (h.keys(root, &a), h.keys(root, &b));
        assert_eq!(ka[..2], kb[..2]);
        assert_ne!(ka[2], kb[2]);
        // chained: every later block differs too, even though its own tokens are equal
        assert_ne!(ka[3], kb[3]);
    }

    #[test]
    fn extra_keys_change_every_block() {
        let h = BlockHasher::new(4);
        let t = toks(12);
        let base = h.keys(ChainRoot::new("m", None, None), &t);
        for root in [
            ChainRoot::new("m2", None, None),
            ChainRoot::new("m", Some("lora-a"), None),
            ChainRoot::new("m", None, Some("tenant-a")),
        ] {
            let k = h.keys(root, &t);
            assert!(k.iter().zip(&base).all(|(x, y)| x != y));
        }
    }

    #[test]
    fn roots_are_unambiguous() {
        assert_ne!(
            ChainRoot::new("ab", Some("c"), None),
            ChainRoot::new("a", Some("bc"), None)
        );
        assert_ne!(
            ChainRoot::new("m", Some("x"), None),
            ChainRoot::new("m", None, Some("x"))
        );
    }

    #[test]
    fn continuing_a_chain_equals_hashing_the_whole_prompt() {
        let h = BlockHasher::new(8);
        let root = ChainRoot::new("m", None, None);
        let t = toks(64);
        let whole = h.keys(root, &t);
        let mut split = h.keys(root, &t[..24]);
        let parent = *split.last().expect("3 blocks");
        h.continue_into(parent, &t[24..], &mut split);
        assert_eq!(whole, split);
    }

    #[test]
    fn bad_block_size_is_clamped_not_a_panic() {
        assert_eq!(BlockHasher::new(0).block_size(), 1);
        assert_eq!(BlockHasher::new(u32::MAX).block_size(), MAX_BLOCK_SIZE);
    }
}
