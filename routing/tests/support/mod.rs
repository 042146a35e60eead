//! What the event-fixture tests share: the fixtures' block size and a prompt's credit.

#![allow(dead_code)] // each test file uses the helpers it needs

use kvroute_routing::block_keys::{BlockHasher, BlockKey, ChainRoot};
use kvroute_routing::index::{KvIndex, TierBlocks};

/// The block size the fixtures were recorded with.
pub const BS: u32 = 16;

/// The block keys of a prompt of `blocks` blocks of the fixtures' tokens (0, 1, 2, ...) under
/// model `m`.
pub fn keys(blocks: u32) -> Vec<BlockKey> {
    let tokens: Vec<u32> = (0..blocks * BS).collect();
    BlockHasher::new(BS).keys(ChainRoot::new("m", None, None), &tokens)
}

/// (blocks the engine reuses from its own cache, blocks after them in lower tiers) for a
/// prompt of `blocks` blocks of the fixtures' tokens (0, 1, 2, ...) under model `m`.
pub fn credit(ix: &KvIndex, blocks: u32) -> (u32, TierBlocks) {
    let mut out = Vec::new();
    ix.credit(&keys(blocks), 0, &mut Vec::new(), &mut out);
    out.first()
        .map_or((0, TierBlocks::default()), |c| (c.blocks, c.lower))
}
