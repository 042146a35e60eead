//! Warm start: an endpoint's blocks copied out of the index ([`KvIndex::export_endpoint`]) and
//! loaded into another picker's index ([`KvIndex::seed_endpoint`]), from a snapshot file or a
//! peer replica.
//!
//! Seeded blocks are *unconfirmed*: the engine may have evicted some of them while the copy
//! travelled (or while the picker was down), and no event will say so if the removal came
//! before the new picker subscribed. They count for routing as any block does, and the
//! engine's own events settle them one by one: a `BlockStored` naming a seeded hash confirms
//! it (and is not taken for a second copy), a `BlockRemoved` removes it, and a request routed
//! there confirms the seeded blocks of its prefix (once the engine has prefilled it, it holds
//! them, whether it had them or stores them again). When the subscriber
//! proves that its stream continues the seed's exactly (the engine's replay still holds the
//! seed's last batch with the same timestamp), the whole seed is confirmed at once
//! ([`KvIndex::confirm_seed`]). Whatever is still unconfirmed when the seed's time is up is
//! dropped ([`KvIndex::expire`]); so is all of it when the endpoint outgrows its block budget
//! (before what the engine itself reported is touched) or is cleared.

use hashbrown::HashSet;
use rustc_hash::FxBuildHasher;

use super::{EndpointEntry, IndexError, IndexMode, KvIndex, Slot, split};
use crate::block_keys::BlockKey;

/// An endpoint's seeded blocks not yet confirmed by the engine, and when they are dropped.
#[derive(Debug, Clone)]
pub(super) struct Unconfirmed {
    /// Their chain keys (a routed request names blocks by key, a removal by engine hash,
    /// which finds the key).
    pub(super) keys: HashSet<BlockKey, FxBuildHasher>,
    until_ms: u64,
}

/// If `key` is an unconfirmed seeded block of `entry`, confirm it and say so.
pub(super) fn confirm(entry: &mut EndpointEntry, key: BlockKey) -> bool {
    entry
        .unconfirmed
        .as_mut()
        .is_some_and(|u| u.keys.remove(&key))
}

/// What [`KvIndex::export_endpoint`] copied.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Exported {
    /// `(engine hash, chain key)` of every block, in the order the index lays them out (the
    /// chains' order, so that loading them rebuilds chains a lookup reads in one pass).
    pub blocks: Vec<(u64, BlockKey)>,
    /// The view has a gap or unconfirmed blocks of its own: it cannot be continued exactly.
    pub unproven: bool,
}

/// What [`KvIndex::seed_endpoint`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeedOutcome {
    /// The blocks were loaded, unconfirmed.
    Seeded {
        /// How many.
        blocks: usize,
    },
    /// The endpoint already holds blocks the engine reported: they are not overridden.
    NotEmpty,
    /// Only an endpoint fed by KV events (precise mode) is seeded.
    NotPrecise,
}

impl KvIndex {
    /// A copy of a precise endpoint's blocks in the primary namespace, or `None` when it
    /// cannot be copied faithfully: an approximate endpoint, or one whose engine reports
    /// hybrid groups or lower tiers (their namespaces are its own; a new picker learns them
    /// from events).
    pub fn export_endpoint(&self, slot: Slot) -> Option<Exported> {
        let e = self.entry(slot)?;
        if e.mode != IndexMode::Precise || e.residency.is_special() {
            return None;
        }
        let mut placed: Vec<(u64, u64)> = Vec::with_capacity(e.by_engine_hash.len());
        for b in &e.by_engine_hash.buckets {
            for s in &b.0 {
                if s.val != super::VACANT {
                    placed.push((s.val, s.key));
                }
            }
        }
        placed.sort_unstable();
        let blocks = placed
            .into_iter()
            .map(|(p, eh)| {
                let (seg, off) = split(p);
                (eh, self.chains.segs[seg][off].key)
            })
            .collect();
        Some(Exported {
            blocks,
            unproven: e.gap || e.unconfirmed.is_some(),
        })
    }

    /// Load `blocks` (`(engine hash, chain key)` in chain order, as exported) into the empty
    /// precise endpoint at `slot` as unconfirmed blocks, kept until `until_ms` unless the
    /// engine's events confirm them first (see the module docs). At most the endpoint's block
    /// budget is loaded, the first blocks first.
    pub fn seed_endpoint(
        &mut self,
        slot: Slot,
        blocks: &[(u64, BlockKey)],
        until_ms: u64,
    ) -> Result<SeedOutcome, IndexError> {
        let Some(e) = self.entry(slot) else {
            return Err(IndexError::UnknownSlot(slot));
        };
        if e.mode != IndexMode::Precise {
            return Ok(SeedOutcome::NotPrecise);
        }
        if e.len() > 0 || e.unconfirmed.is_some() {
            return Ok(SeedOutcome::NotEmpty);
        }
        let blocks = &blocks[..blocks.len().min(e.budget())];
        self.store_after(slot, None, blocks)?;
        let Some(e) = self
            .endpoints
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
        else {
            return Err(IndexError::UnknownSlot(slot));
        };
        // a hash named twice is one block, and nothing of it is a second physical copy
        e.copies.clear();
        let keys: HashSet<BlockKey, FxBuildHasher> = blocks.iter().map(|&(_, k)| k).collect();
        let n = keys.len();
        if n > 0 {
            e.unconfirmed = Some(Unconfirmed { keys, until_ms });
        }
        Ok(SeedOutcome::Seeded { blocks: n })
    }

    /// The engine's stream was shown to continue the seed exactly: every seeded block of
    /// `slot` is confirmed. Returns how many were still unconfirmed.
    pub fn confirm_seed(&mut self, slot: Slot) -> usize {
        self.endpoints
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
            .and_then(|e| e.unconfirmed.take())
            .map_or(0, |u| u.keys.len())
    }

    /// Seeded blocks of `slot` not confirmed yet.
    pub fn unconfirmed_blocks(&self, slot: Slot) -> usize {
        self.entry(slot)
            .and_then(|e| e.unconfirmed.as_ref())
            .map_or(0, |u| u.keys.len())
    }

    /// Drop `slot`'s unconfirmed seeded blocks; returns how many.
    pub(super) fn drop_unconfirmed(&mut self, slot: Slot) -> usize {
        let Some(e) = self
            .endpoints
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
        else {
            return 0;
        };
        let Some(u) = e.unconfirmed.take() else {
            return 0;
        };
        let mut hashes = Vec::with_capacity(u.keys.len());
        for b in &e.by_engine_hash.buckets {
            for s in &b.0 {
                if s.val != super::VACANT && u.keys.contains(&self.chains.block(s.val).key) {
                    hashes.push(s.key);
                }
            }
        }
        self.remove(slot, &hashes)
    }

    /// Drop the unconfirmed seeded blocks whose time is up at `now_ms`; returns how many.
    pub(super) fn expire_unconfirmed(&mut self, now_ms: u64) -> usize {
        let due: Vec<Slot> = self
            .endpoints
            .iter()
            .enumerate()
            .filter(|(_, e)| {
                e.as_ref()
                    .and_then(|e| e.unconfirmed.as_ref())
                    .is_some_and(|u| u.until_ms <= now_ms)
            })
            .map(|(i, _)| i as Slot)
            .collect();
        due.into_iter().map(|s| self.drop_unconfirmed(s)).sum()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::endpoint::EndpointId;
    use crate::index::{IndexConfig, PrefixMatch};

    fn ep(n: u8) -> EndpointId {
        EndpointId::new(std::net::IpAddr::from([10, 0, 0, n]), 8000, 0)
    }

    fn longest(index: &KvIndex, keys: &[BlockKey]) -> Vec<(Slot, usize)> {
        let mut out: Vec<PrefixMatch> = Vec::new();
        index.longest_prefix(keys, &mut out);
        out.iter().map(|m| (m.slot, m.blocks as usize)).collect()
    }

    /// Two chains on one endpoint, one shared with another endpoint.
    fn warm() -> (KvIndex, Slot, Slot) {
        let mut index = KvIndex::new(IndexConfig::default());
        let a = index.add_endpoint(ep(1), IndexMode::Precise, 1000).unwrap();
        let b = index.add_endpoint(ep(2), IndexMode::Precise, 1000).unwrap();
        let chain1: Vec<(u64, BlockKey)> = (0..8).map(|i| (100 + i, 1000 + i)).collect();
        let chain2: Vec<(u64, BlockKey)> = (0..4).map(|i| (200 + i, 2000 + i)).collect();
        index.store(a, &chain1).unwrap();
        index.store(a, &chain2).unwrap();
        index.store(b, &chain1[..3]).unwrap();
        (index, a, b)
    }

    /// A fresh index whose endpoint 1 (budget `budget`) is seeded, until 5,000 ms, with
    /// [`warm`]'s endpoint `a` (12 blocks); the copy too.
    fn reseeded(budget: usize) -> (KvIndex, Slot, Exported) {
        let (index, a, _) = warm();
        let ea = index.export_endpoint(a).unwrap();
        let mut fresh = KvIndex::new(IndexConfig::default());
        let fa = fresh
            .add_endpoint(ep(1), IndexMode::Precise, budget)
            .unwrap();
        assert_eq!(
            fresh.seed_endpoint(fa, &ea.blocks, 5_000).unwrap(),
            SeedOutcome::Seeded {
                blocks: budget.min(12)
            }
        );
        (fresh, fa, ea)
    }

    #[test]
    fn an_export_loaded_elsewhere_answers_the_same_lookups() {
        let (index, a, b) = warm();
        let ea = index.export_endpoint(a).unwrap();
        let eb = index.export_endpoint(b).unwrap();
        assert_eq!(ea.blocks.len(), 12);
        assert!(!ea.unproven);
        let mut fresh = KvIndex::new(IndexConfig::default());
        let fb = fresh.add_endpoint(ep(2), IndexMode::Precise, 1000).unwrap();
        let fa = fresh.add_endpoint(ep(1), IndexMode::Precise, 1000).unwrap();
        assert_eq!(
            fresh.seed_endpoint(fa, &ea.blocks, 5_000).unwrap(),
            SeedOutcome::Seeded { blocks: 12 }
        );
        fresh.seed_endpoint(fb, &eb.blocks, 5_000).unwrap();
        let keys1: Vec<BlockKey> = (0..8).map(|i| 1000 + i).collect();
        let keys2: Vec<BlockKey> = (0..4).map(|i| 2000 + i).collect();
        let mut got = longest(&fresh, &keys1);
        got.sort_unstable();
        let mut want = vec![(fa, 8), (fb, 3)];
        want.sort_unstable();
        assert_eq!(got, want);
        assert_eq!(longest(&fresh, &keys2), vec![(fa, 4)]);
        // and the copy of the copy is unproven: it holds unconfirmed blocks
        assert!(fresh.export_endpoint(fa).unwrap().unproven);
    }

    #[test]
    fn events_confirm_or_remove_seeded_blocks_and_the_rest_expires() {
        let (mut fresh, fa, _) = reseeded(1000);
        // the engine stores block 100 again (after the seed was taken): confirmed, no copy
        fresh.store(fa, &[(100, 1000)]).unwrap();
        assert_eq!(fresh.unconfirmed_blocks(fa), 11);
        // ... and evicts 203: gone
        assert_eq!(fresh.remove(fa, &[203]), 1);
        assert_eq!(fresh.unconfirmed_blocks(fa), 10);
        // block 100's one removal removes it (it was not counted as a second copy)
        assert_eq!(fresh.remove(fa, &[100]), 1);
        fresh.store(fa, &[(100, 1000)]).unwrap();
        // nothing happens before the seed's time
        assert_eq!(fresh.expire(4_999), 0);
        assert_eq!(fresh.endpoint_blocks(fa), 11);
        // then the ten blocks nobody confirmed go; the one the engine stored stays
        assert_eq!(fresh.expire(5_000), 10);
        assert_eq!(fresh.endpoint_blocks(fa), 1);
        assert_eq!(fresh.unconfirmed_blocks(fa), 0);
        assert_eq!(longest(&fresh, &[1000, 1001]), vec![(fa, 1)]);
    }

    #[test]
    fn a_request_routed_to_a_seeded_prefix_confirms_it() {
        let (mut fresh, fa, _) = reseeded(1000);
        // a request for the first five blocks of chain 1 and two new ones
        let keys: Vec<BlockKey> = (0..5).map(|i| 1000 + i).chain([9000, 9001]).collect();
        fresh.record_provisional(fa, &keys, 100, 1_000);
        assert_eq!(fresh.unconfirmed_blocks(fa), 7);
        assert_eq!(fresh.expire(5_000), 7);
        assert_eq!(longest(&fresh, &keys), vec![(fa, 5)]);
    }

    #[test]
    fn a_proven_seed_is_confirmed_whole_and_a_cleared_one_is_gone() {
        let (mut fresh, fa, ea) = reseeded(1000);
        assert_eq!(fresh.confirm_seed(fa), 12);
        assert_eq!(fresh.expire(10_000), 0);
        assert_eq!(fresh.endpoint_blocks(fa), 12);
        // a second seed does not override what is there
        assert_eq!(
            fresh.seed_endpoint(fa, &ea.blocks, 5_000).unwrap(),
            SeedOutcome::NotEmpty
        );
        fresh.clear_endpoint(fa);
        fresh.seed_endpoint(fa, &ea.blocks, 5_000).unwrap();
        fresh.clear_endpoint(fa);
        assert_eq!(fresh.unconfirmed_blocks(fa), 0);
        assert_eq!(fresh.expire(10_000), 0);
    }

    #[test]
    fn a_seed_larger_than_the_budget_is_cut_and_yields_to_the_engines_blocks() {
        let (mut fresh, fa, ea) = reseeded(10);
        assert_eq!(fresh.endpoint_blocks(fa), 10, "cut to the budget");
        // the engine stores a new chain: over the budget, the seed goes, the chain stays
        let new: Vec<(u64, BlockKey)> = (0..3).map(|i| (300 + i, 3000 + i)).collect();
        assert_eq!(
            fresh.store(fa, &new).unwrap(),
            super::super::StoreOutcome::Stored
        );
        assert_eq!(fresh.endpoint_blocks(fa), 3);
        assert_eq!(longest(&fresh, &[3000, 3001, 3002]), vec![(fa, 3)]);
        // an approximate endpoint is not seeded
        let x = fresh
            .add_endpoint(ep(9), IndexMode::Approximate { ttl_ms: 1000 }, 10)
            .unwrap();
        assert_eq!(
            fresh.seed_endpoint(x, &ea.blocks, 5_000).unwrap(),
            SeedOutcome::NotPrecise
        );
        assert!(fresh.export_endpoint(x).is_none());
    }
}
