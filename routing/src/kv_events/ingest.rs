//! Applying decoded KV events to the index.
//!
//! A `BlockStored` event names its blocks by engine hash and carries their token ids; the
//! picker re-hashes the tokens with its own chained function, continuing from the key of the
//! event's parent block (looked up by the parent's engine hash on the same endpoint) or from
//! the chain root when the event starts a prefix. Requests are hashed with the same function
//! and root, so a stored block and a request prefix meet on the same key.

use serde::Serialize;

use crate::block_keys::{BlockHasher, BlockKey, ChainRoot};
use crate::index::{EventPlace, KvIndex, NamespaceRefusal, Slot, StoreOutcome, Tier};
use crate::kv_events::{BlockPlace, EventBatch, ExtraKey, KvEvent};

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
    /// The block size of the last event whose `block_size` differs from the model
    /// configuration's: the engine's own, reported as a misconfiguration.
    pub foreign_block_size: Option<u32>,
    /// Blocks stored under keys no request can match, because the engine folded inputs the
    /// picker does not hash (multimodal or prompt-embedding extra keys) into them.
    pub opaque_blocks: u64,
    /// The endpoint exceeded its block budget and was cleared: resynchronise it.
    pub overflowed: bool,
    /// Blocks of a KV-cache group whose kind the picker does not model (the endpoint gets no
    /// credit while it reports one).
    pub unmodelled_blocks: u64,
    /// Blocks of a storage tier beyond the ones tracked per endpoint.
    pub untracked_tier_blocks: u64,
    /// Blocks a lower tier stored after a parent the picker does not know (skipped, with no
    /// resync: the GPU's stream is complete).
    pub lower_tier_orphans: u64,
    /// vLLM offloading placeholders (no tokens, block size 0): nothing to key them by.
    pub placeholder_blocks: u64,
    /// Blocks of a sparse group's store whose place in its token span cannot be known
    /// (skipped: never false credit).
    pub unplaced_blocks: u64,
    /// Blocks moved between tiers (TensorRT-LLM's offload and onboard).
    pub moved_blocks: u64,
    /// Moves of blocks the picker did not hold in the tier they left (skipped: the block's
    /// tokens are not in the move, so it cannot be keyed).
    pub unknown_moved_blocks: u64,
    /// The endpoint was cleared, removed or replaced while the batch let picks in between
    /// its steps: the rest of the batch was not applied (it belonged to the view dropped).
    pub interrupted: bool,
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

/// What a `BlockStored` event's extra keys mean for the picker's chain.
///
/// vLLM folds into a block's hash `[lora_name] + multimodal hashes + [cache_salt] +
/// prompt-embedding hashes`, with the salt on the first block of a prefix only. The picker
/// models the adapter and the salt (in the chain root, exactly as requests are hashed); a
/// block with any other extra key cannot be matched by a request hashed from its tokens alone.
#[derive(Debug, Default, PartialEq, Eq)]
struct ExtraKeyMeaning<'a> {
    salt: Option<&'a str>,
    /// Index of the first block whose extra keys the picker does not model.
    opaque_from: Option<usize>,
}

impl<'a> ExtraKeyMeaning<'a> {
    fn of(
        extra: &'a [Option<Vec<ExtraKey>>],
        lora_name: Option<&str>,
        lora_id: Option<i64>,
        starts_prefix: bool,
    ) -> Self {
        let mut view = Self::default();
        for (i, block) in extra.iter().enumerate() {
            let Some(items) = block else { continue };
            let mut lora_seen = false;
            let rest: Vec<&ExtraKey> = items
                .iter()
                .filter(|k| {
                    let is_lora = match k {
                        ExtraKey::Str(s) => Some(s.as_str()) == lora_name,
                        ExtraKey::Int(v) => Some(*v) == lora_id,
                        ExtraKey::Other(_) => false,
                    };
                    // drop the adapter once; a second equal string is something else
                    let drop = is_lora && !lora_seen;
                    lora_seen |= drop;
                    !drop
                })
                .collect();
            match (i, starts_prefix, rest.as_slice()) {
                (_, _, []) => {}
                (0, true, [ExtraKey::Str(salt)]) => view.salt = Some(salt.as_str()),
                _ => {
                    view.opaque_from = Some(i);
                    break;
                }
            }
        }
        view
    }
}

/// An event's group and tier fields, as the index takes them.
fn event_place<'a>(medium: Option<&'a str>, place: &'a BlockPlace) -> EventPlace<'a> {
    EventPlace {
        group_idx: place.group_idx,
        spec_kind: place.spec_kind.as_deref(),
        sliding_window: place.sliding_window,
        medium,
        locality: place.locality.as_deref(),
        ownership: place.ownership.as_deref(),
    }
}

/// A key derived from `parent` that no request chain produces.
fn opaque_key(parent: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(b"kvroute:opaque-extra-keys", parent)
}

/// The most blocks a batch applies at a time, holding the index alone (an agent's 1M-token
/// context is stored in one event of ~15,000 blocks, which would otherwise hold every pick for
/// a millisecond or more; `benches/index-compare --mixed`). Each step's lines are read first
/// with the picks in ([`IndexAccess::warm`]), so a step holds the index alone for about a
/// microsecond; 32 blocks keeps a match's p99 within 2× of its time alone, where 64 and 128
/// gave 2.3× and 3.2× (`picker/BENCHMARKS.md` §1c).
pub const STEP_BLOCKS: usize = 32;

/// Where a batch is applied: the index, and how picks get at it while a batch is applied.
pub trait IndexAccess {
    fn index(&mut self) -> &mut KvIndex;
    /// Let a pick waiting for the index in, if there is one.
    fn yield_now(&mut self) {}
    /// Run `f`, which needs no index, with the index free for others.
    fn unlocked<R>(&mut self, f: impl FnOnce() -> R) -> R {
        f()
    }
    /// Run `f`, which only reads the index, while readers may share it (before a step, to
    /// bring the step's lines into this core's cache; `f` returns how many of the step's
    /// blocks it found held); nothing when nobody else reads.
    fn warm(&mut self, _f: impl FnOnce(&KvIndex) -> usize) {}
}

/// An index nobody else reads: no steps.
impl IndexAccess for KvIndex {
    fn index(&mut self) -> &mut KvIndex {
        self
    }
}

/// How a stepped store or removal ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stepped {
    Done,
    /// The endpoint went over its block budget and was cleared.
    Overflowed,
    /// The endpoint's view changed while others had the index: the rest was not applied.
    Interrupted,
    /// The index no longer tracks the slot.
    Refused,
}

/// A batch's progress on one endpoint: counts the blocks applied since the last step and
/// yields every [`STEP_BLOCKS`]; after a yield, the endpoint's view must be the one the batch
/// began on.
pub struct Steps {
    slot: Slot,
    view: Option<u64>,
    since: usize,
}

impl Steps {
    pub fn new(index: &KvIndex, slot: Slot) -> Self {
        Self {
            slot,
            view: index.view(slot),
            since: 0,
        }
    }

    /// `blocks` more were applied; false when the view changed while others had the index.
    fn advance(&mut self, access: &mut impl IndexAccess, blocks: usize) -> bool {
        self.since += blocks;
        if self.since < STEP_BLOCKS {
            return true;
        }
        self.since = 0;
        access.yield_now();
        self.same_view(access)
    }

    fn same_view(&self, access: &mut impl IndexAccess) -> bool {
        access.index().view(self.slot) == self.view
    }

    /// The batch itself changed the view (it cleared the endpoint).
    fn rebase(&mut self, index: &KvIndex) {
        self.view = index.view(self.slot);
    }

    /// Store `(engine hash, key)` pairs in chain order after the block with engine hash
    /// `parent`, a step at a time (each step continues the last one's last block); returns
    /// how many were stored and how it ended.
    pub fn store(
        &mut self,
        access: &mut impl IndexAccess,
        mut parent: Option<u64>,
        pairs: &[(u64, BlockKey)],
    ) -> (u64, Stepped) {
        let mut done = 0;
        for step in pairs.chunks(STEP_BLOCKS) {
            let slot = self.slot;
            access.warm(|ix| ix.warm_store(slot, step).0);
            match access.index().store_after(self.slot, parent, step) {
                Ok(StoreOutcome::Stored) => {}
                Ok(StoreOutcome::Overflowed) => return (done, Stepped::Overflowed),
                Err(_) => return (done, Stepped::Refused),
            }
            parent = step.last().map(|&(h, _)| h);
            done += step.len() as u64;
            if !self.advance(access, step.len()) {
                return (done, Stepped::Interrupted);
            }
        }
        (done, Stepped::Done)
    }

    /// Remove blocks by engine hash (each XORed with `salt`, its namespace's; `scratch` holds
    /// the salted hashes), a step at a time; returns how many were removed and how it ended.
    pub fn remove(
        &mut self,
        access: &mut impl IndexAccess,
        engine_hashes: &[u64],
        salt: u64,
        scratch: &mut Vec<u64>,
    ) -> (u64, Stepped) {
        let mut removed = 0;
        for step in engine_hashes.chunks(STEP_BLOCKS) {
            let slot = self.slot;
            let step: &[u64] = if salt == 0 {
                step
            } else {
                scratch.clear();
                scratch.extend(step.iter().map(|h| h ^ salt));
                scratch
            };
            access.warm(|ix| ix.warm_remove(slot, step));
            removed += access.index().remove(self.slot, step) as u64;
            if !self.advance(access, step.len()) {
                return (removed, Stepped::Interrupted);
            }
        }
        (removed, Stepped::Done)
    }
}

/// How many of `events` from the first on are removals from the same place as one just read.
fn removal_run(events: &[KvEvent], medium: &Option<String>, place: &BlockPlace) -> usize {
    events
        .iter()
        .take_while(|e| {
            matches!(e, KvEvent::BlockRemoved { medium: m, place: p, .. } if m == medium && p == place)
        })
        .count()
}

/// Apply every event of `batch` to `slot`'s blocks. Never fails: bad events are counted and
/// skipped so one malformed event cannot stall the stream. Large batches are applied in steps
/// of [`STEP_BLOCKS`] blocks, each read first with the picks in ([`IndexAccess`]); if the
/// endpoint is cleared or removed meanwhile, the rest of the batch is void
/// ([`IngestStats::interrupted`]).
pub fn apply_batch(
    access: &mut impl IndexAccess,
    slot: Slot,
    keys: IngestKeys<'_>,
    batch: &EventBatch,
) -> IngestStats {
    let mut stats = IngestStats::default();
    let mut steps = Steps::new(access.index(), slot);
    let mut chain = Vec::new();
    let mut pairs = Vec::new();
    let mut salted = Vec::new();
    let mut salts = Vec::new();
    let mut merged = Vec::new();
    let mut next = 0;
    while let Some(event) = batch.events.get(next) {
        next += 1;
        match event {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_name,
                lora_id,
                extra_keys,
                cache_salt,
                medium,
                place,
            } => {
                let n = block_hashes.len() as u64;
                let bs = keys.hasher.block_size();
                if *block_size == 0 && token_ids.is_empty() {
                    // vLLM's offloading connector announces a chunk it kept no payload for
                    stats.placeholder_blocks += n;
                    continue;
                }
                let ns = match access.index().namespace_for_store(
                    slot,
                    event_place(medium.as_deref(), place),
                    *block_size,
                    bs as u32,
                ) {
                    Ok(ns) => ns,
                    Err(NamespaceRefusal::BlockSize) => {
                        stats.malformed_blocks += n;
                        stats.foreign_block_size = Some(*block_size);
                        continue;
                    }
                    Err(NamespaceRefusal::Unmodelled) => {
                        stats.unmodelled_blocks += n;
                        continue;
                    }
                    Err(NamespaceRefusal::TooManyTiers) => {
                        stats.untracked_tier_blocks += n;
                        continue;
                    }
                };
                let group_block = *block_size as usize;
                let span = token_ids.len() / group_block;
                if token_ids.len() % group_block != 0 || block_hashes.len() > span {
                    stats.malformed_blocks += n;
                    continue;
                }
                // a sparse group's store names only the blocks it caches
                let Some(first_held) = ns.kind.placed_from(block_hashes.len(), span, *block_size)
                else {
                    stats.unplaced_blocks += n;
                    continue;
                };
                let extra = ExtraKeyMeaning::of(
                    extra_keys,
                    lora_name.as_deref(),
                    *lora_id,
                    parent_block_hash.is_none(),
                );
                let salt = extra.salt.or(cache_salt.as_deref());
                let parent = match parent_block_hash {
                    None => ChainRoot::new(keys.model, lora_name.as_deref(), salt).value(),
                    Some(ph) => match access.index().chain_key_in(slot, *ph, &ns) {
                        Some(k) => k,
                        None if ns.tier == Tier::Gpu => {
                            stats.orphan_blocks += n;
                            continue;
                        }
                        None => {
                            // a lower tier's chunk whose parent the picker never saw: the GPU
                            // stream lost nothing
                            stats.lower_tier_orphans += n;
                            continue;
                        }
                    },
                };
                chain.clear();
                let hash = |chain: &mut Vec<u64>| match extra.opaque_from {
                    None => keys.hasher.continue_into(parent, token_ids, chain),
                    Some(first) => {
                        // blocks from `first` on depend on inputs the picker does not hash
                        // (images, embeddings): key them apart so no request matches them
                        let split = (first * group_block).min(token_ids.len());
                        keys.hasher
                            .continue_into(parent, &token_ids[..split], chain);
                        let last = chain.last().copied().unwrap_or(parent);
                        keys.hasher
                            .continue_into(opaque_key(last), &token_ids[split..], chain);
                    }
                };
                if token_ids.len() / bs > STEP_BLOCKS {
                    // the keys depend on the parent's, read above, and the tokens alone:
                    // a long event is hashed with the index free
                    access.unlocked(|| hash(&mut chain));
                    if !steps.same_view(access) {
                        stats.interrupted = true;
                        return stats;
                    }
                } else {
                    hash(&mut chain);
                }
                if let Some(first) = extra.opaque_from {
                    stats.opaque_blocks += n - first as u64;
                }
                // a group block of `mult` pool blocks is keyed by the chain at its last one
                let mult = ns.mult as usize;
                pairs.clear();
                pairs.extend(
                    block_hashes
                        .iter()
                        .zip(chain.iter().skip(mult - 1).step_by(mult).skip(first_held))
                        .map(|(&h, &k)| (h ^ ns.salt, k ^ ns.salt)),
                );
                let parent_hash = parent_block_hash.map(|p| p ^ ns.salt);
                let (stored, end) = steps.store(access, parent_hash, &pairs);
                match end {
                    Stepped::Done => stats.stored_blocks += n,
                    Stepped::Overflowed => {
                        stats.overflowed = true;
                        // everything after this point belongs to a view we just dropped
                        return stats;
                    }
                    Stepped::Interrupted => {
                        stats.stored_blocks += stored;
                        stats.interrupted = true;
                        return stats;
                    }
                    Stepped::Refused => return stats,
                }
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
                place,
            } => {
                // an engine reports each evicted block in an event of its own (vLLM's block
                // pool): a run of them is removed as one, so the index works through the
                // run's table lines together instead of one block's at a time
                let run = removal_run(&batch.events[next..], medium, place);
                let block_hashes = if run == 0 {
                    block_hashes
                } else {
                    merged.clear();
                    merged.extend_from_slice(block_hashes);
                    for e in &batch.events[next..next + run] {
                        if let KvEvent::BlockRemoved { block_hashes, .. } = e {
                            merged.extend_from_slice(block_hashes);
                        }
                    }
                    next += run;
                    &merged
                };
                salts.clear();
                if place.any_tier {
                    access
                        .index()
                        .group_salts(slot, place.group_idx.unwrap_or(0), &mut salts);
                } else {
                    salts.extend(
                        access
                            .index()
                            .salt_for_removal(slot, event_place(medium.as_deref(), place)),
                    );
                }
                for &salt in &salts {
                    let (removed, end) = steps.remove(access, block_hashes, salt, &mut salted);
                    stats.removed_blocks += removed;
                    if end == Stepped::Interrupted {
                        stats.interrupted = true;
                        return stats;
                    }
                }
            }
            KvEvent::BlockMoved {
                block_hashes,
                from_medium,
                to_medium,
                place,
            } => {
                let n = block_hashes.len() as u64;
                let Some(from) = access
                    .index()
                    .salt_for_removal(slot, event_place(from_medium.as_deref(), place))
                else {
                    stats.unknown_moved_blocks += n;
                    continue;
                };
                let bs = keys.hasher.block_size() as u32;
                let to = match access.index().namespace_for_store(
                    slot,
                    event_place(to_medium.as_deref(), place),
                    bs,
                    bs,
                ) {
                    Ok(ns) => ns,
                    Err(NamespaceRefusal::TooManyTiers) => {
                        stats.untracked_tier_blocks += n;
                        continue;
                    }
                    Err(_) => {
                        stats.unmodelled_blocks += n;
                        continue;
                    }
                };
                pairs.clear();
                salted.clear();
                for &h in block_hashes {
                    match access.index().key_for_engine_hash(slot, h ^ from) {
                        Some(key) => {
                            salted.push(h ^ from);
                            pairs.push((h ^ to.salt, key ^ from ^ to.salt));
                        }
                        None => stats.unknown_moved_blocks += 1,
                    }
                }
                access.index().remove(slot, &salted);
                match access.index().store_after(slot, None, &pairs) {
                    Ok(StoreOutcome::Stored) => stats.moved_blocks += pairs.len() as u64,
                    Ok(StoreOutcome::Overflowed) => {
                        stats.overflowed = true;
                        return stats;
                    }
                    Err(_) => return stats,
                }
                if !steps.advance(access, pairs.len()) {
                    stats.interrupted = true;
                    return stats;
                }
            }
            KvEvent::AllBlocksCleared => {
                access.index().clear_endpoint(slot);
                steps.rebase(access.index());
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
    use crate::kv_events::BlockPlace;
    use std::net::{IpAddr, Ipv4Addr};

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>) -> KvEvent {
        KvEvent::plain_stored(hashes.to_vec(), parent, tokens, 4)
    }

    fn batch(events: Vec<KvEvent>) -> EventBatch {
        EventBatch::new(0.0, events)
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
                place: Default::default(),
            }]),
        );
        assert_eq!(s.removed_blocks, 1);
        assert_eq!(matched(&ix, &prompt), 2);
        apply_batch(&mut ix, slot, keys, &batch(vec![KvEvent::AllBlocksCleared]));
        assert_eq!(matched(&ix, &prompt), 0);
    }

    #[test]
    fn a_run_of_one_block_removals_is_applied_as_one_and_never_across_a_store() {
        let prompt: Vec<u32> = (0..16).collect();
        let rm = |h: u64| KvEvent::BlockRemoved {
            block_hashes: vec![h],
            medium: None,
            place: Default::default(),
        };
        let events = vec![
            rm(0xa4),
            rm(0xa3),
            // stored again between two runs: the second run must not undo it
            stored(&[0xa3], Some(0xa2), prompt[8..12].to_vec()),
            rm(0xa2),
            rm(0xa9),
        ];
        let (mut one, slot, keys) = setup();
        let (mut each, _, _) = setup();
        let full = batch(vec![stored(
            &[0xa1, 0xa2, 0xa3, 0xa4],
            None,
            prompt.clone(),
        )]);
        apply_batch(&mut one, slot, keys, &full);
        apply_batch(&mut each, slot, keys, &full);
        let s = apply_batch(&mut one, slot, keys, &batch(events.clone()));
        let mut removed = 0;
        for e in events {
            removed += apply_batch(&mut each, slot, keys, &batch(vec![e])).removed_blocks;
        }
        assert_eq!(s.removed_blocks, removed);
        assert_eq!(s.removed_blocks, 3, "0xa4, 0xa3, 0xa2; 0xa9 was never held");
        // block 1 is left, and block 3 is stored again under a parent that is gone
        assert_eq!(matched(&one, &prompt), 1);
        assert_eq!(one.endpoint_blocks(slot), each.endpoint_blocks(slot));
        assert_eq!(one.endpoint_blocks(slot), 2);
        assert_eq!(
            removal_run(&[rm(1), rm(2)], &None, &BlockPlace::default()),
            2
        );
        assert_eq!(
            removal_run(
                &[rm(1), stored(&[5], None, vec![0; 4]), rm(2)],
                &None,
                &BlockPlace::default()
            ),
            1
        );
        assert_eq!(
            removal_run(&[rm(1)], &Some("CPU".into()), &BlockPlace::default()),
            0
        );
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
                // 8 tokens a block where the pool says 4
                KvEvent::plain_stored(vec![4], None, (0..8).collect(), 8),
            ]),
        );
        assert_eq!(s.orphan_blocks, 2);
        assert_eq!(s.malformed_blocks, 2);
        // the engine's own block size, for the misconfiguration report; a short token list
        // alone is not one
        assert_eq!(s.foreign_block_size, Some(8));
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

    fn matched_with(ix: &KvIndex, salt: Option<&str>, tokens: &[u32]) -> u32 {
        let k = BlockHasher::new(4).keys(ChainRoot::new("m", None, salt), tokens);
        let mut out: Vec<PrefixMatch> = Vec::new();
        ix.longest_prefix(&k, &mut out);
        out.first().map_or(0, |m| m.blocks)
    }

    fn with_extra(mut ev: KvEvent, keys: Vec<Option<Vec<ExtraKey>>>) -> KvEvent {
        if let KvEvent::BlockStored { extra_keys, .. } = &mut ev {
            *extra_keys = keys;
        }
        ev
    }

    #[test]
    fn a_salted_prefix_credits_only_requests_with_that_salt() {
        let (mut ix, slot, keys) = setup();
        let prompt: Vec<u32> = (0..16).collect();
        // vLLM: the salt is an extra key of the prefix's first block only
        let first = with_extra(
            stored(&[1, 2], None, prompt[..8].to_vec()),
            vec![Some(vec![ExtraKey::Str("salt-a".into())]), None],
        );
        let rest = stored(&[3, 4], Some(2), prompt[8..].to_vec());
        let s = apply_batch(&mut ix, slot, keys, &batch(vec![first, rest]));
        assert_eq!((s.stored_blocks, s.opaque_blocks), (4, 0));
        assert_eq!(matched_with(&ix, Some("salt-a"), &prompt), 4);
        assert_eq!(matched_with(&ix, Some("salt-b"), &prompt), 0);
        assert_eq!(matched_with(&ix, None, &prompt), 0);
    }

    #[test]
    fn sglang_metadata_salt_and_lora_extra_keys_are_modelled() {
        let (mut ix, slot, keys) = setup();
        let prompt: Vec<u32> = (0..8).collect();
        let mut ev = stored(&[1, 2], None, prompt.clone());
        if let KvEvent::BlockStored { cache_salt, .. } = &mut ev {
            *cache_salt = Some("t1".into());
        }
        apply_batch(&mut ix, slot, keys, &batch(vec![ev]));
        assert_eq!(matched_with(&ix, Some("t1"), &prompt), 2);
        // adapter on every block, salt on the first: both fold into the root
        let (mut ix, slot, keys) = setup();
        let mut ev = with_extra(
            stored(&[1, 2], None, prompt.clone()),
            vec![
                Some(vec![
                    ExtraKey::Str("sql".into()),
                    ExtraKey::Str("t1".into()),
                ]),
                Some(vec![ExtraKey::Str("sql".into())]),
            ],
        );
        if let KvEvent::BlockStored { lora_name, .. } = &mut ev {
            *lora_name = Some("sql".into());
        }
        apply_batch(&mut ix, slot, keys, &batch(vec![ev]));
        let k = BlockHasher::new(4).keys(ChainRoot::new("m", Some("sql"), Some("t1")), &prompt);
        let mut out = Vec::new();
        ix.longest_prefix(&k, &mut out);
        assert_eq!(out.first().map(|m| m.blocks), Some(2));
    }

    #[test]
    fn blocks_with_unmodelled_extra_keys_never_match() {
        let (mut ix, slot, keys) = setup();
        let prompt: Vec<u32> = (0..16).collect();
        // an image hash on block 2: blocks 0-1 match, 2-3 do not
        let ev = with_extra(
            stored(&[1, 2, 3, 4], None, prompt.clone()),
            vec![
                None,
                None,
                Some(vec![ExtraKey::Str("mm-hash".into()), ExtraKey::Int(0)]),
                None,
            ],
        );
        let s = apply_batch(&mut ix, slot, keys, &batch(vec![ev]));
        assert_eq!((s.stored_blocks, s.opaque_blocks), (4, 2));
        assert_eq!(matched(&ix, &prompt), 2);
        // a continuation of an opaque block stays opaque, and removal still works
        let s = apply_batch(
            &mut ix,
            slot,
            keys,
            &batch(vec![stored(&[5], Some(4), (16..20).collect())]),
        );
        assert_eq!(s.orphan_blocks, 0);
        let mut longer = prompt.clone();
        longer.extend(16..20);
        assert_eq!(matched(&ix, &longer), 2);
    }

    fn placed(mut ev: KvEvent, m: Option<&str>, p: BlockPlace) -> KvEvent {
        match &mut ev {
            KvEvent::BlockStored { medium, place, .. }
            | KvEvent::BlockRemoved { medium, place, .. } => {
                *medium = m.map(str::to_owned);
                *place = p;
            }
            KvEvent::BlockMoved { .. } | KvEvent::AllBlocksCleared => {}
        }
        ev
    }

    fn group(idx: u32, kind: &str, window: Option<u32>) -> BlockPlace {
        BlockPlace {
            group_idx: Some(idx),
            spec_kind: Some(kind.into()),
            sliding_window: window,
            ..BlockPlace::default()
        }
    }

    fn removed(hashes: &[u64], m: Option<&str>, p: BlockPlace) -> KvEvent {
        placed(
            KvEvent::BlockRemoved {
                block_hashes: hashes.to_vec(),
                medium: None,
                place: BlockPlace::default(),
            },
            m,
            p,
        )
    }

    /// What the index credits `slot` for a request of `tokens`: (blocks, lower tiers).
    fn credit(ix: &KvIndex, tokens: &[u32]) -> (u32, crate::index::TierBlocks) {
        let k = BlockHasher::new(4).keys(ChainRoot::new("m", None, None), tokens);
        let mut out = Vec::new();
        ix.credit(&k, 0, &mut Vec::new(), &mut out);
        out.first()
            .map_or((0, Default::default()), |c| (c.blocks, c.lower))
    }

    /// Eight blocks of 4 tokens stored in one event of `place` (engine hashes 1..=8).
    fn eight(m: Option<&str>, p: BlockPlace) -> KvEvent {
        placed(
            stored(&[1, 2, 3, 4, 5, 6, 7, 8], None, (0..32).collect()),
            m,
            p,
        )
    }

    #[test]
    fn a_sliding_window_group_needs_the_window_before_the_boundary() {
        let (mut ix, slot, keys) = setup();
        let prompt: Vec<u32> = (0..32).collect();
        // full attention (group 0) and an 8-token window (group 1), as vLLM 0.32 reports
        // them: the same engine hashes in both groups
        let full = group(0, "full_attention", None);
        let swa = group(1, "sliding_window", Some(8));
        let s = apply_batch(
            &mut ix,
            slot,
            keys,
            &batch(vec![
                eight(Some("GPU"), full.clone()),
                eight(Some("GPU"), swa.clone()),
            ]),
        );
        assert_eq!(s.stored_blocks, 16);
        // the window group frees the blocks it slid past
        let gone = BlockPlace {
            group_idx: Some(1),
            ..BlockPlace::default()
        };
        apply_batch(
            &mut ix,
            slot,
            keys,
            &batch(vec![removed(
                &[1, 2, 3, 4, 5, 6],
                Some("GPU"),
                gone.clone(),
            )]),
        );
        // cdiv(8 − 1, 4) = 2 blocks before the boundary: 7 and 8 are held
        assert_eq!(credit(&ix, &prompt).0, 8);
        // a 7-block request needs blocks 6 and 7 of the window group: 6 is gone
        assert_eq!(credit(&ix, &prompt[..28]).0, 0);
        // the full-attention group still holds everything: a removal addresses one group
        assert_eq!(matched(&ix, &prompt), 8);
        apply_batch(
            &mut ix,
            slot,
            keys,
            &batch(vec![removed(&[8], Some("GPU"), gone)]),
        );
        assert_eq!(credit(&ix, &prompt).0, 0, "no window anywhere: no credit");
    }

    #[test]
    fn a_mamba_group_hits_at_its_last_held_state() {
        let (mut ix, slot, keys) = setup();
        let prompt: Vec<u32> = (0..32).collect();
        let mamba = group(1, "mamba", None);
        apply_batch(
            &mut ix,
            slot,
            keys,
            &batch(vec![
                eight(None, group(0, "full_attention", None)),
                eight(None, mamba.clone()),
            ]),
        );
        assert_eq!(credit(&ix, &prompt).0, 8);
        // only the state after block 4 is kept
        let gone = BlockPlace {
            group_idx: Some(1),
            ..BlockPlace::default()
        };
        apply_batch(
            &mut ix,
            slot,
            keys,
            &batch(vec![removed(&[1, 2, 3, 5, 6, 7, 8], None, gone)]),
        );
        assert_eq!(credit(&ix, &prompt).0, 4);
        assert_eq!(
            credit(&ix, &prompt[..12]).0,
            0,
            "no state at or before block 3"
        );
    }

    #[test]
    fn a_group_kind_the_picker_does_not_model_gives_no_credit() {
        let (mut ix, slot, keys) = setup();
        let prompt: Vec<u32> = (0..32).collect();
        let s = apply_batch(
            &mut ix,
            slot,
            keys,
            &batch(vec![
                eight(None, group(0, "full_attention", None)),
                eight(None, group(1, "chunked_local_attention", None)),
            ]),
        );
        assert_eq!((s.stored_blocks, s.unmodelled_blocks), (8, 8));
        assert_eq!(matched(&ix, &prompt), 8, "group 0 is indexed");
        assert_eq!(credit(&ix, &prompt), (0, Default::default()));
    }

    #[test]
    fn offload_tiers_are_kept_apart_and_credited_after_the_gpu_hit() {
        let (mut ix, slot, keys) = setup();
        let prompt: Vec<u32> = (0..32).collect();
        let gpu = BlockPlace {
            group_idx: Some(0),
            ..BlockPlace::default()
        };
        let cpu = BlockPlace {
            locality: Some("LOCAL".into()),
            ..gpu.clone()
        };
        apply_batch(
            &mut ix,
            slot,
            keys,
            &batch(vec![
                eight(Some("GPU"), gpu.clone()),
                eight(Some("CPU"), cpu.clone()),
            ]),
        );
        let (blocks, lower) = credit(&ix, &prompt);
        assert_eq!(
            (blocks, lower.total()),
            (8, 0),
            "the GPU copy is the one used"
        );
        // the GPU evicts its tail; the CPU copy stays
        apply_batch(
            &mut ix,
            slot,
            keys,
            &batch(vec![removed(&[5, 6, 7, 8], Some("GPU"), gpu.clone())]),
        );
        let (blocks, lower) = credit(&ix, &prompt);
        assert_eq!((blocks, lower.cpu), (4, 4));
        // the CPU drops block 7; a storage tier holds 7 and 8
        let storage = BlockPlace {
            group_idx: Some(0),
            ..BlockPlace::default()
        };
        let s = apply_batch(
            &mut ix,
            slot,
            keys,
            &batch(vec![
                removed(&[7], Some("CPU"), cpu),
                placed(
                    stored(&[7, 8], Some(6), (24..32).collect()),
                    Some("STORAGE"),
                    storage,
                ),
            ]),
        );
        assert_eq!(
            (s.orphan_blocks, s.lower_tier_orphans),
            (0, 0),
            "parent 6 is on the CPU"
        );
        let (blocks, lower) = credit(&ix, &prompt);
        assert_eq!(
            (blocks, lower.cpu, lower.storage),
            (4, 3, 1),
            "block 8 is on the CPU too"
        );
        // the GPU view is untouched by the lower tiers
        assert_eq!(matched(&ix, &prompt), 4);
    }

    #[test]
    fn offload_placeholders_and_lower_tier_orphans_need_no_resync() {
        let (mut ix, slot, keys) = setup();
        let cpu = BlockPlace {
            group_idx: Some(0),
            ..BlockPlace::default()
        };
        let placeholder = placed(
            KvEvent::plain_stored(vec![9], None, Vec::new(), 0),
            Some("CPU"),
            cpu.clone(),
        );
        let orphan = placed(stored(&[11], Some(10), (0..4).collect()), Some("CPU"), cpu);
        let s = apply_batch(&mut ix, slot, keys, &batch(vec![placeholder, orphan]));
        assert_eq!((s.placeholder_blocks, s.lower_tier_orphans), (1, 1));
        assert_eq!((s.malformed_blocks, s.foreign_block_size), (0, None));
        assert!(!s.needs_resync());
    }

    /// What others do to the index while a batch lets them at it.
    type Meddle = Box<dyn FnMut(&mut KvIndex)>;

    /// An index others get at between steps: `on_yield` is what they do there, and
    /// `on_unlocked` what they do while a long event is hashed.
    struct Shared {
        ix: KvIndex,
        yields: usize,
        /// What each warm-up before a step found held.
        warms: Vec<usize>,
        on_yield: Meddle,
        on_unlocked: Meddle,
    }

    impl IndexAccess for Shared {
        fn index(&mut self) -> &mut KvIndex {
            &mut self.ix
        }
        fn yield_now(&mut self) {
            self.yields += 1;
            (self.on_yield)(&mut self.ix);
        }
        fn warm(&mut self, f: impl FnOnce(&KvIndex) -> usize) {
            self.warms.push(f(&self.ix));
        }
        fn unlocked<R>(&mut self, f: impl FnOnce() -> R) -> R {
            let r = f();
            (self.on_unlocked)(&mut self.ix);
            r
        }
    }

    fn shared(
        on_yield: impl FnMut(&mut KvIndex) + 'static,
        on_unlocked: impl FnMut(&mut KvIndex) + 'static,
    ) -> (Shared, Slot, IngestKeys<'static>) {
        let (ix, slot, keys) = setup();
        let s = Shared {
            ix,
            yields: 0,
            warms: Vec::new(),
            on_yield: Box::new(on_yield),
            on_unlocked: Box::new(on_unlocked),
        };
        (s, slot, keys)
    }

    /// One event of `blocks` blocks of 4 tokens from the root, engine hashes from `first`.
    fn long_store(blocks: usize, first: u64) -> (KvEvent, Vec<u32>) {
        let tokens: Vec<u32> = (0..blocks as u32 * 4).collect();
        let hashes = (first..first + blocks as u64).collect::<Vec<_>>();
        (stored(&hashes, None, tokens.clone()), tokens)
    }

    #[test]
    fn a_long_event_is_stored_in_steps_as_if_whole() {
        let blocks = 3 * STEP_BLOCKS + 5;
        let (ev, tokens) = long_store(blocks, 1);
        let (mut whole, slot, keys) = setup();
        let s = apply_batch(&mut whole, slot, keys, &batch(vec![ev.clone()]));
        assert_eq!(s.stored_blocks, blocks as u64);
        let (mut stepped, slot, keys) = shared(|_| {}, |_| {});
        let t = apply_batch(&mut stepped, slot, keys, &batch(vec![ev]));
        assert_eq!(t, s);
        assert_eq!(stepped.yields, 3, "a yield after each full step");
        assert_eq!(stepped.warms, vec![0; 4], "a warm-up before each step");
        assert_eq!(matched(&stepped.ix, &tokens), blocks as u32);
        assert_eq!(stepped.ix.endpoint_blocks(slot), blocks);
        // and removed in steps, the run cut where the removal starts
        let cut = blocks as u64 / 2;
        let gone: Vec<u64> = (cut..=blocks as u64).collect();
        let r = apply_batch(
            &mut stepped,
            slot,
            keys,
            &batch(vec![KvEvent::BlockRemoved {
                block_hashes: gone.clone(),
                medium: None,
                place: Default::default(),
            }]),
        );
        assert_eq!(
            (r.removed_blocks, r.interrupted),
            (gone.len() as u64, false)
        );
        let removal_warms = &stepped.warms[4..];
        assert_eq!(
            removal_warms.iter().sum::<usize>(),
            gone.len(),
            "each removal step read its blocks first"
        );
        assert_eq!(removal_warms.len(), gone.len().div_ceil(STEP_BLOCKS));
        assert_eq!(matched(&stepped.ix, &tokens), cut as u32 - 1);
    }

    #[test]
    fn a_clear_between_steps_voids_the_rest_of_the_batch() {
        let id = EndpointId::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 8000, 0);
        let other = EndpointId::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 8001, 0);
        // the endpoint goes (its view dropped) and another takes its slot meanwhile
        let (mut a, slot, keys) = shared(
            move |ix| {
                ix.remove_endpoint(&id);
                ix.add_endpoint(other, IndexMode::Precise, 1000)
                    .expect("slot");
            },
            |_| {},
        );
        let (ev, tokens) = long_store(2 * STEP_BLOCKS, 1);
        let (next, _) = long_store(4, 10_000);
        let s = apply_batch(&mut a, slot, keys, &batch(vec![ev, next]));
        assert!(s.interrupted);
        assert_eq!(s.stored_blocks, STEP_BLOCKS as u64, "the first step only");
        assert_eq!(a.ix.slot(&other), Some(slot));
        assert_eq!(
            a.ix.endpoint_blocks(slot),
            0,
            "nothing lands on the newcomer"
        );
        assert_eq!(matched(&a.ix, &tokens), 0);

        // a clear while a long event is hashed: nothing of it is stored
        let (mut b, slot, keys) = shared(
            |_| {},
            |ix| {
                ix.clear_endpoint(0);
            },
        );
        let (ev, tokens) = long_store(STEP_BLOCKS + 1, 1);
        let s = apply_batch(&mut b, slot, keys, &batch(vec![ev]));
        assert!(s.interrupted);
        assert_eq!((s.stored_blocks, b.ix.endpoint_blocks(slot)), (0, 0));
        assert_eq!(matched(&b.ix, &tokens), 0);

        // the batch's own clear is no interruption
        let (mut c, slot, keys) = shared(|_| {}, |_| {});
        let (ev, tokens) = long_store(2 * STEP_BLOCKS + 1, 1);
        let s = apply_batch(
            &mut c,
            slot,
            keys,
            &batch(vec![long_store(3, 50_000).0, KvEvent::AllBlocksCleared, ev]),
        );
        assert!(!s.interrupted);
        assert_eq!(matched(&c.ix, &tokens), 2 * STEP_BLOCKS as u32 + 1);
    }
}
