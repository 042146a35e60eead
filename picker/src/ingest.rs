//! Applying decoded KV events to the index.
//!
//! A `BlockStored` event names its blocks by engine hash and carries their token ids; the
//! picker re-hashes the tokens with its own chained function, continuing from the key of the
//! event's parent block (looked up by the parent's engine hash on the same endpoint) or from
//! the chain root when the event starts a prefix. Requests are hashed with the same function
//! and root, so a stored block and a request prefix meet on the same key.

use serde::Serialize;

use crate::block_keys::{BlockHasher, ChainRoot};
use crate::index::{KvIndex, Slot, StoreOutcome};
use crate::kv_events::{EventBatch, KvEvent};

/// What applying one batch did; counters feed the picker's metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct IngestStats {
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    pub cleared: u64,
    /// Blocks skipped because their parent is unknown to the index (a missed event): they
    /// cannot be keyed, and the gap should be repaired by a replay or resync.
    pub orphan_blocks: u64,
    /// Blocks skipped because the event's block size or token count does not fit the model
    /// configuration (a misconfigured pool).
    pub malformed_blocks: u64,
    /// The endpoint exceeded its block budget and was cleared: resynchronise it.
    pub overflowed: bool,
}

impl IngestStats {
    /// Whether the endpoint's view is now known to be incomplete.
    pub fn needs_resync(&self) -> bool {
        self.overflowed || self.orphan_blocks > 0
    }
}

/// How to key an endpoint's events.
#[derive(Debug, Clone, Copy)]
pub struct IngestKeys<'a> {
    pub hasher: BlockHasher,
    /// The served model name (the chain root's first component).
    pub model: &'a str,
}

/// Apply every event of `batch` to `slot`'s blocks. Never fails: bad events are counted and
/// skipped so one malformed event cannot stall the stream.
pub fn apply_batch(
    index: &mut KvIndex,
    slot: Slot,
    keys: IngestKeys<'_>,
    batch: &EventBatch,
) -> IngestStats {
    let mut stats = IngestStats::default();
    let mut chain = Vec::new();
    let mut pairs = Vec::new();
    for event in &batch.events {
        match event {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_name,
                ..
            } => {
                let n = block_hashes.len() as u64;
                let bs = keys.hasher.block_size();
                if *block_size as usize != bs || token_ids.len() != block_hashes.len() * bs {
                    stats.malformed_blocks += n;
                    continue;
                }
                let parent = match parent_block_hash {
                    None => ChainRoot::new(keys.model, lora_name.as_deref(), None).value(),
                    Some(ph) => match index.key_for_engine_hash(slot, *ph) {
                        Some(k) => k,
                        None => {
                            stats.orphan_blocks += n;
                            continue;
                        }
                    },
                };
                chain.clear();
                keys.hasher.continue_into(parent, token_ids, &mut chain);
                pairs.clear();
                pairs.extend(block_hashes.iter().copied().zip(chain.iter().copied()));
                match index.store_after(slot, *parent_block_hash, &pairs) {
                    Ok(StoreOutcome::Stored) => stats.stored_blocks += n,
                    Ok(StoreOutcome::Overflowed) => {
                        stats.overflowed = true;
                        // everything after this point belongs to a view we just dropped
                        return stats;
                    }
                    Err(_) => return stats,
                }
            }
            KvEvent::BlockRemoved { block_hashes, .. } => {
                stats.removed_blocks += index.remove(slot, block_hashes) as u64;
            }
            KvEvent::AllBlocksCleared => {
                index.clear_endpoint(slot);
                stats.cleared += 1;
            }
        }
    }
    stats
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::EndpointId;
    use crate::index::{IndexMode, PrefixMatch};
    use std::net::{IpAddr, Ipv4Addr};

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent,
            token_ids: tokens,
            block_size: 4,
            lora_id: None,
            medium: None,
            lora_name: None,
        }
    }

    fn batch(events: Vec<KvEvent>) -> EventBatch {
        EventBatch {
            ts: 0.0,
            events,
            data_parallel_rank: None,
            skipped_unknown: 0,
        }
    }

    fn setup() -> (KvIndex, Slot, IngestKeys<'static>) {
        let mut ix = KvIndex::default();
        let id = EndpointId::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 8000, 0);
        let slot = ix.add_endpoint(id, IndexMode::Precise, 1000).expect("slot");
        let keys = IngestKeys {
            hasher: BlockHasher::new(4),
            model: "m",
        };
        (ix, slot, keys)
    }

    fn matched(ix: &KvIndex, tokens: &[u32]) -> u32 {
        let k = BlockHasher::new(4).keys(ChainRoot::new("m", None, None), tokens);
        let mut out: Vec<PrefixMatch> = Vec::new();
        ix.longest_prefix(&k, &mut out);
        out.first().map_or(0, |m| m.blocks)
    }

    #[test]
    fn events_with_parents_key_like_requests() {
        let (mut ix, slot, keys) = setup();
        let prompt: Vec<u32> = (0..16).collect();
        // the engine stores the prompt in two events, the second continuing from the first
        let s = apply_batch(
            &mut ix,
            slot,
            keys,
            &batch(vec![
                stored(&[0xa1, 0xa2], None, prompt[..8].to_vec()),
                stored(&[0xa3, 0xa4], Some(0xa2), prompt[8..].to_vec()),
            ]),
        );
        assert_eq!(s.stored_blocks, 4);
        assert_eq!(matched(&ix, &prompt), 4);
        // removing block 3 (engine hash 0xa3) cuts the run at 2
        let s = apply_batch(
            &mut ix,
            slot,
            keys,
            &batch(vec![KvEvent::BlockRemoved {
                block_hashes: vec![0xa3],
                medium: None,
            }]),
        );
        assert_eq!(s.removed_blocks, 1);
        assert_eq!(matched(&ix, &prompt), 2);
        apply_batch(&mut ix, slot, keys, &batch(vec![KvEvent::AllBlocksCleared]));
        assert_eq!(matched(&ix, &prompt), 0);
    }

    #[test]
    fn orphans_and_malformed_blocks_are_counted_not_applied() {
        let (mut ix, slot, keys) = setup();
        let s = apply_batch(
            &mut ix,
            slot,
            keys,
            &batch(vec![
                stored(&[1, 2], Some(0xdead), (0..8).collect()),
                stored(&[3], None, (0..3).collect()), // 3 tokens for a 4-token block
                KvEvent::BlockStored {
                    block_hashes: vec![4],
                    parent_block_hash: None,
                    token_ids: (0..8).collect(),
                    block_size: 8, // pool says 4
                    lora_id: None,
                    medium: None,
                    lora_name: None,
                },
            ]),
        );
        assert_eq!(s.orphan_blocks, 2);
        assert_eq!(s.malformed_blocks, 2);
        assert!(s.needs_resync());
        assert_eq!(ix.live_blocks(), 0);
    }

    #[test]
    fn lora_blocks_do_not_match_base_model_requests() {
        let (mut ix, slot, keys) = setup();
        let prompt: Vec<u32> = (0..8).collect();
        let mut ev = stored(&[7, 8], None, prompt.clone());
        if let KvEvent::BlockStored { lora_name, .. } = &mut ev {
            *lora_name = Some("sql".into());
        }
        apply_batch(&mut ix, slot, keys, &batch(vec![ev]));
        assert_eq!(matched(&ix, &prompt), 0);
        let k = BlockHasher::new(4).keys(ChainRoot::new("m", Some("sql"), None), &prompt);
        let mut out = Vec::new();
        ix.longest_prefix(&k, &mut out);
        assert_eq!(out.first().map(|m| m.blocks), Some(2));
    }

    #[test]
    fn overflow_is_reported_for_resync() {
        let mut ix = KvIndex::default();
        let id = EndpointId::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 8000, 0);
        let slot = ix.add_endpoint(id, IndexMode::Precise, 2).expect("slot");
        let keys = IngestKeys {
            hasher: BlockHasher::new(4),
            model: "m",
        };
        let s = apply_batch(
            &mut ix,
            slot,
            keys,
            &batch(vec![stored(&[1, 2, 3], None, (0..12).collect())]),
        );
        assert!(s.overflowed && s.needs_resync());
        assert_eq!(ix.live_blocks(), 0);
    }
}
