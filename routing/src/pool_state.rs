//! One owner of a pool's routing state: the endpoint set, the KV index and the scraped loads,
//! behind one lock, changed only through the intents below.
//!
//! Every writer of the picker (the pool source, the metrics scraper, the KV-event feeds, the
//! routing path recording an approximate decision) says what happened, not which structures
//! to touch: a pool view was applied, a batch arrived, an endpoint must be resynchronised, its
//! engine reported its capacity, it went stale or recovered, a request was routed, time
//! passed. The rules that tie the structures together live here once: an endpoint's index
//! budget ([`IndexBudget`]), why its cached blocks are forgotten ([`ClearCause`]), and that
//! an endpoint leaving the set takes its blocks and its load with it. Free of I/O, so that it
//! is tested against a reference model (`tests/pool_state_model.rs`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::RwLockReadGuard;

use crate::block_keys::BlockKey;
use crate::endpoint::{
    Endpoint, EndpointId, EndpointPatch, EndpointSet, EndpointSnapshot, EndpointState,
};
use crate::handoff::HandoffLock;
use crate::index::{Exported, IndexConfig, IndexError, IndexMode, KvIndex, SeedOutcome};
use crate::kv_events::EventBatch;
use crate::kv_events::ingest::{IngestKeys, IngestStats, apply_batch};
use crate::kv_events::resequence::ResyncReason;
use crate::load::{EndpointLoad, LoadTable};

/// How many blocks the index keeps per endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexBudget {
    /// Blocks assumed for an endpoint whose engine reports no capacity and whose model config
    /// names none.
    pub default_kv_capacity_blocks: u64,
    /// A precise endpoint may hold this many times its capacity before it is taken to be out
    /// of sync (removals were missed) and cleared.
    pub precise_slack: u64,
    /// Approximate entries expire after this long without use.
    pub approximate_ttl_ms: u64,
    /// A precise endpoint is credited with the blocks of a request routed to it for this long,
    /// or until its engine's events for them arrive (0: never).
    pub provisional_ttl_ms: u64,
    /// The most blocks one endpoint's entry may hold, whatever its engine reports (slack
    /// included): an engine's metrics are not trusted to size the picker's memory.
    pub max_blocks_per_endpoint: u64,
}

impl Default for IndexBudget {
    /// The picker's defaults (`index.*`).
    fn default() -> Self {
        Self {
            default_kv_capacity_blocks: 32_768,
            precise_slack: 2,
            approximate_ttl_ms: 600_000,
            provisional_ttl_ms: 2_000,
            max_blocks_per_endpoint: 2 << 20,
        }
    }
}

impl IndexBudget {
    /// The index mode and block budget of an endpoint. Its capacity is, in this order, what
    /// its engine reported (`learned`), what its model config says (`configured`), the
    /// default; a precise endpoint may hold `precise_slack` times that; no endpoint more than
    /// `max_blocks_per_endpoint`. A budget smaller than what the entry holds takes effect at
    /// once ([`KvIndex::add_endpoint`]).
    pub fn for_endpoint(
        &self,
        precise: bool,
        learned: Option<u64>,
        configured: Option<u64>,
    ) -> (IndexMode, usize) {
        let cap = learned
            .or(configured)
            .unwrap_or(self.default_kv_capacity_blocks);
        let (mode, blocks) = if precise {
            (
                IndexMode::Precise,
                cap.saturating_mul(self.precise_slack.max(1)),
            )
        } else {
            (
                IndexMode::Approximate {
                    ttl_ms: self.approximate_ttl_ms,
                },
                cap,
            )
        };
        let blocks = blocks.min(self.max_blocks_per_endpoint.max(1));
        (mode, usize::try_from(blocks).unwrap_or(usize::MAX))
    }
}

/// Why an endpoint's cached blocks are forgotten. (A precise endpoint over its block budget
/// is cleared by the index itself, reported as [`IngestStats::overflowed`]; one leaving the
/// pool is removed, blocks and all, by [`PoolState::apply_view`].)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClearCause {
    /// No good metrics scrape within the staleness threshold, on an approximate endpoint:
    /// the engine may have restarted empty, and no event feed would tell. (A precise
    /// endpoint's view is its feed's: a restart shows as a sequence back at 0 or a failed
    /// replay, a loss as a gap, and [`PoolState::resync`] acts on those. A picker paused for
    /// seconds, or an engine slow to answer `/metrics` under a long prefill, does not forget
    /// what the engine holds.)
    Stale,
    /// The KV-event feed lost continuity (a gap, a restart, a failed replay).
    Resync,
    /// The publisher went over its event rate limit: its batches are being dropped.
    RateLimited,
    /// A new subscription starts from an empty view of its endpoint.
    Subscribed,
}

impl ClearCause {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stale => "stale",
            Self::Resync => "resync",
            Self::RateLimited => "rate_limited",
            Self::Subscribed => "subscribed",
        }
    }
}

/// An endpoint of a pool view, with what its index entry depends on.
#[derive(Debug, Clone)]
pub struct PoolMember {
    /// The endpoint as the view declares it: [`EndpointState::Draining`] when it is not
    /// serving, else `Ready` (a stale endpoint stays stale across views).
    pub endpoint: Endpoint,
    /// Its blocks are learned from its engine's KV events (else from routing decisions).
    pub precise: bool,
    /// The capacity its model config declares.
    pub kv_capacity_blocks: Option<u64>,
}

/// What applying a pool view changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Membership {
    /// Endpoints the index did not track before.
    pub added: Vec<EndpointId>,
    /// Endpoints that left the set (their blocks and load are gone).
    pub removed: Vec<EndpointId>,
}

/// A staleness change of one endpoint, made by [`PoolState::set_stale`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StalenessChange {
    pub endpoint: EndpointId,
    pub stale: bool,
    /// Cached blocks forgotten (going stale clears the endpoint).
    pub dropped: usize,
}

struct Inner {
    index: KvIndex,
    loads: LoadTable,
    /// The model config's capacity and mode of each member, for re-budgeting when its engine
    /// reports another capacity.
    members: hashbrown::HashMap<EndpointId, (bool, Option<u64>)>,
    /// When each member was first in a scrape round: one never scraped successfully is fresh
    /// from then until the staleness threshold has passed.
    first_seen: hashbrown::HashMap<EndpointId, u64>,
    /// `(sequence number, timestamp bits)` of the last batch applied to each precise
    /// endpoint's view in order ([`PoolState::apply_numbered_batch`]); absent once anything
    /// broke that order (a clear, a dropped batch).
    positions: hashbrown::HashMap<EndpointId, Position>,
    /// Endpoints seeded from a copy ([`PoolState::seed_endpoint`]) whose subscription has not
    /// started yet, with the position the copy was taken at when it can be continued.
    seeds: hashbrown::HashMap<EndpointId, Option<Position>>,
}

/// Where a view stands in its engine's event stream: the last batch applied, as
/// `(sequence number, timestamp bits)` (the timestamp tells the publisher process apart).
pub type Position = (u64, u64);

/// What [`PoolState::resync`] did to an endpoint's view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resynced {
    /// Its blocks were dropped (this many), to be rebuilt from the events that follow.
    Cleared(usize),
    /// Its blocks were kept, and its view marked as having a gap.
    Kept,
}

impl AsMut<KvIndex> for Inner {
    fn as_mut(&mut self) -> &mut KvIndex {
        &mut self.index
    }
}

impl AsRef<KvIndex> for Inner {
    fn as_ref(&self) -> &KvIndex {
        &self.index
    }
}

/// What one scrape round changed ([`PoolState::observe_scrape`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScrapeOutcome {
    /// Endpoints that went stale or recovered.
    pub changes: Vec<StalenessChange>,
    /// Endpoints stale now.
    pub stale: usize,
    /// Approximate index entries past their TTL, dropped.
    pub expired: usize,
}

/// A consistent read of the pool: the endpoint set, the index and the loads as of one moment.
pub struct PoolRead<'a> {
    guard: RwLockReadGuard<'a, Inner>,
    pub endpoints: Arc<EndpointSnapshot>,
}

impl PoolRead<'_> {
    pub fn index(&self) -> &KvIndex {
        &self.guard.index
    }

    pub fn loads(&self) -> &LoadTable {
        &self.guard.loads
    }
}

/// See the module documentation.
pub struct PoolState {
    /// Readers take snapshots without the lock; it is only replaced under the write lock, so
    /// the set and the index never disagree about who is a member for longer than a read.
    endpoints: EndpointSet,
    inner: HandoffLock<Inner>,
    budget: IndexBudget,
    /// Bumped whenever the endpoint set (membership or a state) changes or a view is applied;
    /// the service wakes its loops on it ([`PoolState::version`]).
    changes: AtomicU64,
}

impl std::fmt::Debug for PoolState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolState")
            .field("endpoints", &self.endpoints.load().len())
            .field("budget", &self.budget)
            .finish_non_exhaustive()
    }
}

impl PoolState {
    pub fn new(mut index: IndexConfig, budget: IndexBudget) -> Self {
        // one owner of the per-endpoint bound: the budget's
        index.max_blocks_per_endpoint =
            usize::try_from(budget.max_blocks_per_endpoint.max(1)).unwrap_or(usize::MAX);
        Self {
            endpoints: EndpointSet::default(),
            inner: HandoffLock::new(Inner {
                index: KvIndex::new(index),
                loads: LoadTable::new(),
                members: hashbrown::HashMap::new(),
                first_seen: hashbrown::HashMap::new(),
                positions: hashbrown::HashMap::new(),
                seeds: hashbrown::HashMap::new(),
            }),
            budget,
            changes: AtomicU64::new(0),
        }
    }

    /// The endpoint set now.
    pub fn endpoints(&self) -> Arc<EndpointSnapshot> {
        self.endpoints.load()
    }

    /// Counts the changes of the endpoint set and the applied views: it moves on every one.
    pub fn version(&self) -> u64 {
        self.changes.load(Ordering::Acquire)
    }

    /// The endpoint set, the index and the loads as of one moment (routing, diagnostics).
    pub fn read(&self) -> PoolRead<'_> {
        let guard = self.inner.read();
        PoolRead {
            endpoints: self.endpoints.load(),
            guard,
        }
    }

    /// Make the pool `members`. Refused whole, with nothing changed, when the index cannot
    /// track that many endpoints. Otherwise every member gets its index entry (a new one, or
    /// its mode and budget brought up to date), `publish` runs (to put in place what the new
    /// members refer to, such as their model configs, before they appear), then the set is
    /// replaced, keeping the staleness the scraper determined, and departed endpoints lose
    /// their blocks and load.
    pub fn apply_view(
        &self,
        members: Vec<PoolMember>,
        publish: impl FnOnce(),
    ) -> Result<Membership, IndexError> {
        let mut inner = self.inner.write();
        let inner = &mut *inner;
        let new = members
            .iter()
            .filter(|m| inner.index.slot(&m.endpoint.id).is_none())
            .count();
        let limit = inner.index.max_endpoints();
        let tracked = inner.index.endpoints().count();
        if tracked + new > limit {
            return Err(IndexError::TooManyEndpoints {
                limit,
                tracked,
                adding: new,
            });
        }
        let current = self.endpoints.load();
        let mut added = Vec::new();
        let mut endpoints = Vec::with_capacity(members.len());
        inner.members.clear();
        for m in members {
            let id = m.endpoint.id;
            let learned = inner.loads.get(&id).and_then(|l| l.kv_capacity_blocks);
            let (mode, blocks) = self
                .budget
                .for_endpoint(m.precise, learned, m.kv_capacity_blocks);
            if inner.index.slot(&id).is_none() {
                added.push(id);
            }
            inner.index.add_endpoint(id, mode, blocks)?;
            inner.members.insert(id, (m.precise, m.kv_capacity_blocks));
            let mut e = m.endpoint;
            if e.state == EndpointState::Ready
                && current
                    .get(&id)
                    .is_some_and(|c| c.state == EndpointState::Stale)
            {
                e.state = EndpointState::Stale;
            }
            endpoints.push(e);
        }
        publish();
        let removed = self.endpoints.replace(endpoints);
        for id in &removed {
            inner.index.remove_endpoint(id);
            inner.loads.remove(id);
            inner.first_seen.remove(id);
            inner.positions.remove(id);
            inner.seeds.remove(id);
        }
        self.changes.fetch_add(1, Ordering::AcqRel);
        Ok(Membership { added, removed })
    }

    /// Apply a KV-event batch of `endpoint`; `None` when the index does not track it or
    /// tracks it approximately (its blocks are learned from routing, not from events).
    pub fn apply_batch(
        &self,
        endpoint: &EndpointId,
        keys: IngestKeys<'_>,
        batch: &EventBatch,
    ) -> Option<IngestStats> {
        self.apply_numbered_batch(endpoint, keys, batch, None)
    }

    /// [`PoolState::apply_batch`] for batch number `seq` of the endpoint's stream, delivered
    /// in order: the view's position becomes that batch's, so that a copy of the view
    /// ([`PoolState::export_endpoint`]) says where it stands. `None` forgets the position.
    pub fn apply_numbered_batch(
        &self,
        endpoint: &EndpointId,
        keys: IngestKeys<'_>,
        batch: &EventBatch,
        seq: Option<u64>,
    ) -> Option<IngestStats> {
        let mut inner = self.inner.write();
        let slot = inner.index.slot(endpoint)?;
        if inner.index.mode(slot) != Some(IndexMode::Precise) {
            return None;
        }
        // a large batch shares the lock with the picks while it reads each step's lines
        let stats = apply_batch(&mut inner, slot, keys, batch);
        if stats.interrupted {
            inner.positions.remove(endpoint);
            return Some(stats);
        }
        match seq {
            Some(seq) if !stats.overflowed => {
                inner.positions.insert(*endpoint, (seq, batch.ts.to_bits()));
            }
            _ => {
                inner.positions.remove(endpoint);
            }
        }
        if stats.orphan_blocks > 0 && inner.index.mark_gap(slot, self.gap_extend_ms()) {
            tracing::info!(
                %endpoint,
                "the engine stores blocks after ones this picker never saw (its replay window \
                 had passed): crediting the requests routed there until its cache is cleared"
            );
        }
        // Hand the lock to the picks waiting for it, if any, rather than to the next batch:
        // with a backlog of events a plain unlock lets this thread take it straight back
        // (`benches/index-compare --mixed`).
        inner.release();
        Some(stats)
    }

    /// The event stream of `endpoint` could not be kept whole (`reason`): what its view
    /// becomes. Offline replays call this too, so that they lose events as the service does.
    ///
    /// A restart (or a reconnect that cannot tell) clears it: the engine's cache is new. Lost
    /// batches of an engine that goes on publishing do not: most of what the view holds is
    /// still cached, and dropping it would place every session's next turn blind (live, half
    /// the batches lost for 30 s cleared the views again and again and the agentic sessions'
    /// hit rate fell from 97% to 13%; `bench/BENCHMARKS.md` §11d). The view is kept and marked
    /// as having a gap, so the requests routed there are credited as when its stores name
    /// parents it never saw ([`KvIndex::mark_gap`]), until its cache is cleared. Blocks whose
    /// removal was lost stay credited until then, or until the view outgrows the endpoint's
    /// block budget, which clears it.
    ///
    /// A view seeded from a copy whose continuity the replay could not show
    /// ([`ResyncReason::ContinuityLost`] without a restart: the buffer moved on, or there is
    /// no replay) keeps its unconfirmed blocks the same way: the engine's events settle them
    /// ([`KvIndex::seed_endpoint`]).
    pub fn resync(&self, endpoint: &EndpointId, reason: &ResyncReason) -> Resynced {
        let mut inner = self.inner.write();
        let slot = inner.index.slot(endpoint);
        let unproven_seed = matches!(
            reason,
            ResyncReason::ContinuityLost {
                restarted: false,
                ..
            }
        ) && slot.is_some_and(|s| inner.index.unconfirmed_blocks(s) > 0);
        if !reason.cache_survived() && !unproven_seed {
            let dropped = inner.clear(endpoint);
            return Resynced::Cleared(cleared(endpoint, ClearCause::Resync, dropped));
        }
        inner.positions.remove(endpoint);
        if let Some(slot) = slot {
            inner.index.mark_gap(slot, self.gap_extend_ms());
        }
        Resynced::Kept
    }

    /// How much longer the provisional credits an endpoint holds last once its view has a gap.
    fn gap_extend_ms(&self) -> u64 {
        self.budget
            .approximate_ttl_ms
            .saturating_sub(self.budget.provisional_ttl_ms)
    }

    /// Forget `endpoint`'s cached blocks; returns how many were dropped.
    pub fn clear(&self, endpoint: &EndpointId, cause: ClearCause) -> usize {
        let dropped = self.inner.write().clear(endpoint);
        cleared(endpoint, cause, dropped)
    }

    /// A batch of `endpoint` was not applied (a rate limit dropped it): its view no longer
    /// continues the engine's stream exactly.
    pub fn forget_position(&self, endpoint: &EndpointId) {
        self.inner.write().positions.remove(endpoint);
    }

    /// A copy of `endpoint`'s blocks with the position its view stands at (see
    /// [`KvIndex::export_endpoint`]); `None` when it cannot be copied.
    pub fn export_endpoint(&self, endpoint: &EndpointId) -> Option<(Exported, Option<Position>)> {
        let inner = self.inner.read();
        let slot = inner.index.slot(endpoint)?;
        let exported = inner.index.export_endpoint(slot)?;
        let position = inner.positions.get(endpoint).copied();
        Some((exported, position))
    }

    /// Load a copy of `endpoint`'s blocks, taken at `position` when known, as unconfirmed
    /// blocks kept until `until_ms` ([`KvIndex::seed_endpoint`]); `None` when the endpoint is
    /// not a member. The subscription that starts next for it keeps the seed
    /// ([`PoolState::take_seed`]).
    pub fn seed_endpoint(
        &self,
        endpoint: &EndpointId,
        blocks: &[(u64, BlockKey)],
        until_ms: u64,
        position: Option<Position>,
    ) -> Option<SeedOutcome> {
        let mut inner = self.inner.write();
        let slot = inner.index.slot(endpoint)?;
        let outcome = inner.index.seed_endpoint(slot, blocks, until_ms).ok()?;
        if matches!(outcome, SeedOutcome::Seeded { blocks } if blocks > 0) {
            inner.seeds.insert(*endpoint, position);
        }
        Some(outcome)
    }

    /// Whether `endpoint` holds a seed its subscription has not started from yet, and the
    /// position to continue it from, if any; the seed is handed over (asked once).
    pub fn take_seed(&self, endpoint: &EndpointId) -> Option<Option<Position>> {
        let mut inner = self.inner.write();
        let seed = inner.seeds.remove(endpoint)?;
        let slot = inner.index.slot(endpoint)?;
        (inner.index.unconfirmed_blocks(slot) > 0).then_some(seed)
    }

    /// The engine's stream was shown to continue `endpoint`'s view: its seeded blocks are all
    /// confirmed. Returns how many were still unconfirmed.
    pub fn confirm_seed(&self, endpoint: &EndpointId) -> usize {
        let mut inner = self.inner.write();
        match inner.index.slot(endpoint) {
            Some(slot) => inner.index.confirm_seed(slot),
            None => 0,
        }
    }

    /// What the scraper read: each member's load (a sample of an endpoint that is no longer a
    /// member is dropped). A capacity its engine reports for the first time, differently, or
    /// no longer, re-budgets its index entry ([`IndexBudget::for_endpoint`]).
    pub fn learn_loads(&self, samples: impl IntoIterator<Item = (EndpointId, EndpointLoad)>) {
        let mut inner = self.inner.write();
        let inner = &mut *inner;
        for (id, load) in samples {
            let Some(&(precise, configured)) = inner.members.get(&id) else {
                continue;
            };
            let before = inner.loads.get(&id).and_then(|l| l.kv_capacity_blocks);
            let learned = load.kv_capacity_blocks;
            inner.loads.update(id, load);
            if learned != before {
                let (mode, blocks) = self.budget.for_endpoint(precise, learned, configured);
                // a member always has its entry: this only updates it
                let _ = inner.index.add_endpoint(id, mode, blocks);
            }
        }
    }

    /// One scrape round at `now_ms`: `samples` are the endpoints whose metrics were scraped
    /// and parsed ([`PoolState::learn_loads`]). Then the one staleness rule: an endpoint is
    /// stale when its last good sample (or, never scraped, its first round) is more than
    /// `threshold_ms` old ([`crate::load::stale_since`], which the router applies between
    /// rounds too); it is marked so ([`PoolState::set_stale`]), or recovered. Last,
    /// approximate entries past their TTL expire.
    pub fn observe_scrape(
        &self,
        now_ms: u64,
        threshold_ms: u64,
        samples: impl IntoIterator<Item = (EndpointId, EndpointLoad)>,
    ) -> ScrapeOutcome {
        self.learn_loads(samples);
        let marks: Vec<(EndpointId, bool)> = {
            let mut inner = self.inner.write();
            let inner = &mut *inner;
            self.endpoints
                .load()
                .endpoints()
                .iter()
                .map(|e| {
                    let seen = *inner.first_seen.entry(e.id).or_insert(now_ms);
                    let fresh_since = inner.loads.get(&e.id).map_or(seen, |l| l.sampled_at_ms);
                    (
                        e.id,
                        crate::load::stale_since(fresh_since, now_ms, threshold_ms),
                    )
                })
                .collect()
        };
        let stale = marks.iter().filter(|(_, s)| *s).count();
        let changes = self.set_stale(&marks);
        ScrapeOutcome {
            changes,
            stale,
            expired: self.expire(now_ms),
        }
    }

    /// Mark endpoints stale or recovered (`(endpoint, stale)`); only `Ready` ↔ `Stale`
    /// changes (a draining endpoint stays draining). An approximate endpoint that goes stale
    /// is cleared ([`ClearCause::Stale`]); a precise one keeps its view, which its event feed
    /// confirms or clears. Returns the changes made.
    pub fn set_stale(&self, marks: &[(EndpointId, bool)]) -> Vec<StalenessChange> {
        let mut inner = self.inner.write();
        let snapshot = self.endpoints.load();
        let mut patches = Vec::new();
        let mut changes = Vec::new();
        for &(id, stale) in marks {
            let Some(e) = snapshot.get(&id) else { continue };
            let next = match (e.state, stale) {
                (EndpointState::Ready, true) => EndpointState::Stale,
                (EndpointState::Stale, false) => EndpointState::Ready,
                _ => continue,
            };
            patches.push(EndpointPatch::SetState(id, next));
            let approximate = inner
                .index
                .slot(&id)
                .and_then(|slot| inner.index.mode(slot))
                .is_some_and(|m| matches!(m, IndexMode::Approximate { .. }));
            let dropped = if stale && approximate {
                inner.clear(&id)
            } else {
                0
            };
            changes.push(StalenessChange {
                endpoint: id,
                stale,
                dropped,
            });
        }
        if !patches.is_empty() {
            self.endpoints.patch(&patches);
            self.changes.fetch_add(1, Ordering::AcqRel);
        }
        changes
    }

    /// `keys` were routed to `endpoint`: an approximate index learns that they live there; a
    /// precise one credits them provisionally for `index.provisionalTtl`, until the engine's
    /// own events say so ([`KvIndex::record_provisional`]).
    ///
    /// A precise endpoint whose view has a gap ([`KvIndex::mark_gap`]: this picker came after
    /// the engine's replay window) is credited for `index.approximateTtl` instead: the
    /// engine's events cannot tell the picker about the prefixes it held before, so the
    /// picker's own routing record stands in for them.
    pub fn record_routed(&self, endpoint: &EndpointId, keys: &[BlockKey], now_ms: u64) {
        let provisional_ttl_ms = self.budget.provisional_ttl_ms;
        if keys.is_empty() {
            return;
        }
        let learns = |inner: &Inner| {
            inner.index.slot(endpoint).is_some_and(|slot| {
                matches!(inner.index.mode(slot), Some(IndexMode::Approximate { .. }))
                    || inner.index.has_gap(slot)
            })
        };
        if provisional_ttl_ms == 0 && !learns(&self.inner.read()) {
            // only an approximate endpoint or one with a gap learns then: a precise one costs
            // a read lock
            return;
        }
        let mut inner = self.inner.write();
        if let Some(slot) = inner.index.slot(endpoint) {
            match inner.index.mode(slot) {
                Some(IndexMode::Approximate { .. }) => {
                    inner.index.record_routed(slot, keys, now_ms);
                }
                Some(IndexMode::Precise) => {
                    let ttl_ms = if inner.index.has_gap(slot) {
                        self.budget.approximate_ttl_ms
                    } else {
                        provisional_ttl_ms
                    };
                    if ttl_ms > 0 {
                        inner.index.record_provisional(slot, keys, now_ms, ttl_ms);
                    }
                }
                _ => {}
            }
        }
    }

    /// A request for adapter `hash` was routed to `endpoint` (see
    /// [`crate::load::RecentAdapters`]).
    pub fn record_adapter(&self, endpoint: EndpointId, hash: u64) {
        self.inner.write().loads.record_adapter(endpoint, hash);
    }

    /// Approximate entries past their TTL go; returns how many.
    pub fn expire(&self, now_ms: u64) -> usize {
        self.inner.write().index.expire(now_ms)
    }

    /// Blocks held, over every endpoint.
    pub fn live_blocks(&self) -> usize {
        self.inner.read().index.live_blocks()
    }
}

/// Logs that `dropped` blocks of `endpoint` were forgotten for `cause`; returns `dropped`.
fn cleared(endpoint: &EndpointId, cause: ClearCause, dropped: usize) -> usize {
    if dropped > 0 {
        tracing::debug!(%endpoint, cause = cause.as_str(), dropped, "cleared the endpoint's cached blocks");
    }
    dropped
}

impl Inner {
    fn clear(&mut self, endpoint: &EndpointId) -> usize {
        self.positions.remove(endpoint);
        match self.index.slot(endpoint) {
            Some(slot) => self.index.clear_endpoint(slot),
            None => 0,
        }
    }
}
