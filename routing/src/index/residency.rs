//! Where an endpoint's blocks live: its engine's KV-cache groups (a hybrid model has one per
//! layer kind) and storage tiers (GPU, CPU, storage, a remote or secondary tier), learned from
//! vLLM 0.32's `BlockStored` fields, and the credit a request gets under the engine's own
//! prefix-cache rule (`docs/cache-state.md`).
//!
//! Every (group, tier) pair is a namespace of the index: its blocks are stored under the
//! picker's chain key XOR a salt of the pair, and its engine hashes under the engine hash XOR
//! the same salt, so a removal from one group or tier leaves the others, and a hash the engine
//! uses in every group (vLLM's hashes are unique per group only) names one block per group.
//! The salt of the endpoint's *primary* namespace (its first full-attention group at the
//! pool's block size, on the GPU) is 0: a single-group engine's blocks are keyed exactly as
//! before, and [`KvIndex::longest_prefix`] over plain request keys reads the primary group.

use serde::Serialize;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::{KvIndex, PrefixMatch, Slot};
use crate::block_keys::BlockKey;

/// Most KV-cache groups tracked per endpoint; an engine reporting more gives no credit.
pub const MAX_GROUPS: usize = 32;
/// Most tiers below the GPU tracked per endpoint; blocks of further tiers are not stored.
pub const MAX_LOWER_TIERS: usize = 4;
/// Each tier below the GPU may hold this many times an endpoint's block budget before the
/// endpoint is taken to be out of sync (SGLang's HiCache defaults to twice the GPU's cache;
/// vLLM's CPU offloading is sized in bytes, often several times it).
pub const LOWER_TIER_FACTOR: usize = 16;

/// The storage tier classes the cost model prices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// The engine's own prefix cache on the accelerator: a hit costs nothing to load.
    Gpu,
    /// Host memory (vLLM's `medium: "CPU"`, SGLang HiCache's `"CPU_TIER1"`/`"CPU_TIER2"`).
    Cpu,
    /// A remote or shared tier (`locality: "REMOTE"`, or a secondary tier's `ownership` on an
    /// accelerator medium).
    Remote,
    /// Local disk or object storage (vLLM's `"STORAGE"` and any medium not named here).
    Storage,
}

impl Tier {
    /// The class of a tier as an event names it.
    pub fn classify(medium: Option<&str>, locality: Option<&str>, ownership: Option<&str>) -> Self {
        let is = |v: Option<&str>, name: &str| v.is_some_and(|v| v.eq_ignore_ascii_case(name));
        if is(locality, "REMOTE") {
            return Self::Remote;
        }
        let Some(m) = medium else {
            return Self::gpu_or_owned(ownership);
        };
        let m = m.to_ascii_uppercase();
        if m == "GPU" || m == "HBM" {
            Self::gpu_or_owned(ownership)
        } else if ["CPU", "HOST", "DRAM"].iter().any(|p| m.starts_with(p)) {
            // vLLM's "CPU"; SGLang's HiCache "CPU_TIER1", "CPU_TIER2"
            Self::Cpu
        } else {
            Self::Storage
        }
    }

    fn gpu_or_owned(ownership: Option<&str>) -> Self {
        if ownership.is_some() {
            Self::Remote
        } else {
            Self::Gpu
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Gpu => "gpu",
            Self::Cpu => "cpu",
            Self::Remote => "remote",
            Self::Storage => "storage",
        }
    }
}

/// What a hit in a KV-cache group needs (vLLM's `single_type_kv_cache_manager.py`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum GroupKind {
    /// Full attention (also MLA and sink attention): every block of the prefix.
    Full,
    /// Sliding window of `window` tokens: the blocks inside the window that ends at the
    /// prefix boundary.
    SlidingWindow { window: u32 },
    /// Mamba / linear-attention state: the state block at the prefix boundary.
    Mamba,
    /// A kind the picker does not model (chunked local, cross or encoder-only attention,
    /// `unknown`, a new name): the endpoint gets no credit.
    Unmodelled,
}

impl GroupKind {
    /// Where the `hashes` blocks of a store whose tokens span `span` group blocks of
    /// `block_tokens` tokens sit: their first index in the span, or `None` when that cannot be
    /// known. vLLM leaves out of a store the blocks it does not cache (`cache_full_blocks`
    /// skips null and masked blocks) but sends the whole span's tokens: a Mamba group in
    /// align mode keeps one state, at the span's end; a sliding-window group keeps the tail
    /// its window needs. Any other gap has no position the picker could trust.
    pub fn placed_from(self, hashes: usize, span: usize, block_tokens: u32) -> Option<usize> {
        if hashes == span {
            return Some(0);
        }
        let tail = match self {
            Self::Mamba => hashes == 1,
            Self::SlidingWindow { window } => {
                hashes as u32 <= (window.saturating_sub(1)).div_ceil(block_tokens.max(1))
            }
            Self::Full | Self::Unmodelled => false,
        };
        (tail && hashes < span).then(|| span - hashes)
    }

    /// The kind of a group from `kv_cache_spec_kind` and `kv_cache_spec_sliding_window`;
    /// no kind at all (engines before 0.32, SGLang) is full attention.
    pub fn from_event(kind: Option<&str>, window: Option<u32>) -> Self {
        match kind {
            None | Some("full_attention" | "mla_attention" | "sink_full_attention") => Self::Full,
            Some("sliding_window" | "sliding_window_mla") => match window {
                Some(w) if w > 0 => Self::SlidingWindow { window: w },
                _ => Self::Unmodelled,
            },
            Some("mamba") => Self::Mamba,
            Some(_) => Self::Unmodelled,
        }
    }
}

/// One KV-cache group of an endpoint, as learned from its first `BlockStored`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Group {
    idx: u32,
    kind: GroupKind,
    /// The group's block size in pool blocks (vLLM lets a group's block be a multiple of the
    /// hash block size).
    mult: u32,
}

/// A tier below the primary one that the endpoint reported blocks in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LowerTier {
    tier: Tier,
    /// Hash of its medium, locality and owner: part of its namespaces' salts.
    id: u64,
}

/// An endpoint's groups and tiers. Kept across [`KvIndex::clear_endpoint`] (they are the
/// engine's configuration, not its cache contents); dropped with the endpoint.
#[derive(Debug, Clone, Default)]
pub(super) struct Residency {
    groups: Vec<Group>,
    primary: Option<u32>,
    lower: Vec<LowerTier>,
    /// A group kind the picker does not model, or more groups than it tracks: no credit.
    unmodelled: bool,
    /// The pool's block size in tokens (a sliding window is in tokens).
    pool_block_size: u32,
}

impl Residency {
    /// Whether credit needs more than the primary namespace's longest prefix.
    pub(super) fn is_special(&self) -> bool {
        self.unmodelled
            || !self.lower.is_empty()
            || self.groups.iter().any(|g| Some(g.idx) != self.primary)
    }

    /// Tiers below the GPU seen so far.
    pub(super) fn lower_tiers(&self) -> usize {
        self.lower.len()
    }

    fn group(&self, idx: u32) -> Option<&Group> {
        self.groups.iter().find(|g| g.idx == idx)
    }

    /// The salt of group `group` in the tier with id `tier_id` (0: the primary GPU tier).
    fn salt(&self, group: u32, tier_id: u64) -> u64 {
        if tier_id == 0 && self.primary == Some(group) {
            return 0;
        }
        let mut bytes = [0u8; 12];
        bytes[..4].copy_from_slice(&group.to_le_bytes());
        bytes[4..].copy_from_slice(&tier_id.to_le_bytes());
        // never 0: that is the primary namespace's
        xxh3_64_with_seed(&bytes, 0x6b76_726f_7574_6573).max(1)
    }
}

/// The id of a tier as named by an event: 0 for the GPU prefix cache itself.
fn tier_id(medium: Option<&str>, locality: Option<&str>, ownership: Option<&str>) -> u64 {
    if Tier::classify(medium, locality, ownership) == Tier::Gpu {
        return 0;
    }
    let mut bytes = Vec::with_capacity(48);
    for part in [medium, locality, ownership] {
        let part = part.unwrap_or("");
        bytes.extend_from_slice(&(part.len() as u32).to_le_bytes());
        bytes.extend(part.bytes().map(|b| b.to_ascii_uppercase()));
    }
    xxh3_64_with_seed(&bytes, 0x7469_6572).max(1)
}

/// Where an event's blocks go in the index: the namespace salt and the group's block size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Namespace {
    /// XORed into the chain key and the engine hash of every block.
    pub salt: u64,
    /// The group's block size in pool blocks.
    pub mult: u32,
    /// The same group's other tiers, and the primary group on the GPU: where a parent hash
    /// missing from this namespace is looked for (a block offloaded to the CPU continues a
    /// chain whose parent may be on the GPU only, or in another tier).
    pub fallbacks: Vec<u64>,
    /// The tier class (a lower tier's orphans do not mean the GPU stream lost events).
    pub tier: Tier,
    /// The group's kind (a sparse group's store may name fewer blocks than its tokens span).
    pub kind: GroupKind,
}

/// Why a `BlockStored` was not given a namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NamespaceRefusal {
    /// The group's kind is not modelled (the endpoint now gets no credit).
    Unmodelled,
    /// The group's block size is not a multiple of the pool's.
    BlockSize,
    /// More tiers below the GPU than [`MAX_LOWER_TIERS`].
    TooManyTiers,
}

/// An event's group and tier fields, borrowed.
#[derive(Debug, Clone, Copy, Default)]
pub struct EventPlace<'a> {
    pub group_idx: Option<u32>,
    pub spec_kind: Option<&'a str>,
    pub sliding_window: Option<u32>,
    pub medium: Option<&'a str>,
    pub locality: Option<&'a str>,
    pub ownership: Option<&'a str>,
}

/// Blocks of a request's prefix held in each tier below the GPU, right after its GPU hit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TierBlocks {
    pub cpu: u32,
    pub remote: u32,
    pub storage: u32,
}

impl TierBlocks {
    pub fn total(&self) -> u32 {
        self.cpu + self.remote + self.storage
    }

    fn add(&mut self, tier: Tier) {
        match tier {
            Tier::Gpu => {}
            Tier::Cpu => self.cpu += 1,
            Tier::Remote => self.remote += 1,
            Tier::Storage => self.storage += 1,
        }
    }
}

/// What an endpoint offers a request: the prefix its engine would reuse from its own cache
/// (hybrid rule applied), and the blocks after it that a lower tier can load back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Credit {
    pub slot: Slot,
    /// Leading blocks (pool block size) the engine reuses without loading.
    pub blocks: u32,
    /// How many of `blocks` are provisional: routed there, their events not in yet.
    pub provisional: u32,
    /// The blocks that follow, by the tier they would be loaded from.
    pub lower: TierBlocks,
}

impl KvIndex {
    /// The namespace a `BlockStored` of `place` goes to on `slot`, learning the group's kind
    /// and the tier on first sight. `block_size` is the event's, `pool_block_size` the pool's.
    pub fn namespace_for_store(
        &mut self,
        slot: Slot,
        place: EventPlace<'_>,
        block_size: u32,
        pool_block_size: u32,
    ) -> Result<Namespace, NamespaceRefusal> {
        let special = |ix: &Self| ix.entry(slot).is_some_and(|e| e.residency.is_special());
        let was = special(self);
        let ns = self.learn_namespace(slot, place, block_size, pool_block_size);
        // on the ingest path: adjust the count rather than recount every endpoint
        match (was, special(self)) {
            (false, true) => self.special += 1,
            (true, false) => self.special -= 1,
            _ => {}
        }
        ns
    }

    fn learn_namespace(
        &mut self,
        slot: Slot,
        place: EventPlace<'_>,
        block_size: u32,
        pool_block_size: u32,
    ) -> Result<Namespace, NamespaceRefusal> {
        let Some(entry) = self
            .endpoints
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
        else {
            return Err(NamespaceRefusal::Unmodelled);
        };
        let pool = pool_block_size.max(1);
        if block_size == 0 || !block_size.is_multiple_of(pool) {
            return Err(NamespaceRefusal::BlockSize);
        }
        let mult = block_size / pool;
        let r = &mut entry.residency;
        r.pool_block_size = pool;
        let idx = place.group_idx.unwrap_or(0);
        let kind = GroupKind::from_event(place.spec_kind, place.sliding_window);
        if kind == GroupKind::Full && mult != 1 {
            // a full-attention group at another block size is a misconfigured pool (as
            // before groups existed); other kinds may use a multiple of the pool's block
            return Err(NamespaceRefusal::BlockSize);
        }
        let group = match r.group(idx) {
            Some(g) => *g,
            None => {
                if r.groups.len() >= MAX_GROUPS {
                    r.unmodelled = true;
                    return Err(NamespaceRefusal::Unmodelled);
                }
                let g = Group { idx, kind, mult };
                r.groups.push(g);
                if r.primary.is_none() && kind == GroupKind::Full {
                    r.primary = Some(idx);
                }
                g
            }
        };
        if group.kind == GroupKind::Unmodelled {
            r.unmodelled = true;
            return Err(NamespaceRefusal::Unmodelled);
        }
        if group.mult != mult {
            return Err(NamespaceRefusal::BlockSize);
        }
        let tier = Tier::classify(place.medium, place.locality, place.ownership);
        let id = tier_id(place.medium, place.locality, place.ownership);
        if id != 0 && !r.lower.iter().any(|t| t.id == id) {
            if r.lower.len() >= MAX_LOWER_TIERS {
                return Err(NamespaceRefusal::TooManyTiers);
            }
            r.lower.push(LowerTier {
                tier: if tier == Tier::Gpu {
                    Tier::Remote
                } else {
                    tier
                },
                id,
            });
            r.lower.sort_by_key(|t| (t.tier, t.id));
            entry.by_engine_hash.limit =
                super::tiered_budget(entry.max_blocks, entry.cap, r.lower.len());
        }
        let salt = r.salt(idx, id);
        let mut fallbacks: Vec<u64> = std::iter::once(0)
            .chain(r.lower.iter().map(|t| t.id))
            .map(|t| r.salt(idx, t))
            .filter(|&s| s != salt)
            .collect();
        if let Some(p) = r.primary.filter(|&p| p != idx) {
            fallbacks.push(r.salt(p, 0));
        }
        Ok(Namespace {
            salt,
            mult,
            fallbacks,
            tier: if id == 0 {
                Tier::Gpu
            } else {
                tier.max(Tier::Cpu)
            },
            kind: group.kind,
        })
    }

    /// The salt a `BlockRemoved` of `place` addresses on `slot` (`None`: no such group or tier
    /// was ever stored there, so nothing can be removed).
    pub fn salt_for_removal(&self, slot: Slot, place: EventPlace<'_>) -> Option<u64> {
        let r = &self.entry(slot)?.residency;
        let idx = place.group_idx.unwrap_or(0);
        r.group(idx)?;
        let id = tier_id(place.medium, place.locality, place.ownership);
        if id != 0 && !r.lower.iter().any(|t| t.id == id) {
            return None;
        }
        Some(r.salt(idx, id))
    }

    /// The salts of every tier of group `group` on `slot` into `out` (nothing when the group
    /// was never stored there): a removal that names no tier addresses them all.
    pub fn group_salts(&self, slot: Slot, group: u32, out: &mut Vec<u64>) {
        out.clear();
        let Some(r) = self.entry(slot).map(|e| &e.residency) else {
            return;
        };
        if r.group(group).is_none() {
            return;
        }
        out.push(r.salt(group, 0));
        out.extend(r.lower.iter().map(|t| r.salt(group, t.id)));
    }

    /// The plain chain key of the block with engine hash `engine_hash` in the namespace
    /// `ns`, or in its fallbacks.
    pub fn chain_key_in(&self, slot: Slot, engine_hash: u64, ns: &Namespace) -> Option<BlockKey> {
        std::iter::once(ns.salt)
            .chain(ns.fallbacks.iter().copied())
            .find_map(|salt| {
                self.key_for_engine_hash(slot, engine_hash ^ salt)
                    .map(|k| k ^ salt)
            })
    }

    pub(super) fn count_special(&self) -> usize {
        self.endpoints
            .iter()
            .flatten()
            .filter(|e| e.residency.is_special())
            .count()
    }

    /// Whether `slot` holds the block with chain key `key` in the namespace `salt`.
    fn holds_key(&self, slot: Slot, key: BlockKey) -> bool {
        self.chains
            .by_key
            .get(key)
            .is_some_and(|p| super::holds(self.chains.block(p).holders, slot, &self.chains.arena))
    }

    /// What each endpoint offers the request with block keys `keys` at `now_ms`: for a
    /// single-group engine its longest held prefix ([`Self::longest_prefix`]), extended by
    /// the blocks provisionally credited to it ([`Self::record_provisional`]); for a hybrid
    /// one the prefix every group would hit under vLLM's rule; for an engine with lower
    /// tiers, the blocks right after that which a lower tier holds. Endpoints offering
    /// nothing are absent; results are in slot order. `scratch` is reused between calls.
    pub fn credit(
        &self,
        keys: &[BlockKey],
        now_ms: u64,
        scratch: &mut Vec<PrefixMatch>,
        out: &mut Vec<Credit>,
    ) {
        out.clear();
        self.longest_prefix(keys, scratch);
        if self.special == 0 && self.provisional == 0 {
            out.extend(scratch.iter().map(|m| Credit {
                slot: m.slot,
                blocks: m.blocks,
                provisional: 0,
                lower: TierBlocks::default(),
            }));
            return;
        }
        let mut plain = scratch.iter().peekable();
        for (slot, entry) in self.endpoints.iter().enumerate() {
            let slot = slot as Slot;
            let run = match plain.peek() {
                Some(m) if m.slot == slot => plain.next().map_or(0, |m| m.blocks),
                _ => 0,
            };
            let Some(entry) = entry else { continue };
            let r = &entry.residency;
            if r.unmodelled {
                continue;
            }
            let hybrid = r.groups.iter().any(|g| Some(g.idx) != r.primary);
            let (blocks, provisional) = if hybrid {
                (self.hybrid_hit(slot, r, keys, run), 0)
            } else {
                let mut n = run as usize;
                if !entry.provisional.is_empty() {
                    while keys
                        .get(n)
                        .and_then(|k| entry.provisional.get(k))
                        .is_some_and(|&until| until > now_ms)
                    {
                        n += 1;
                    }
                }
                (n as u32, n as u32 - run)
            };
            let lower = if !hybrid && !r.lower.is_empty() {
                self.lower_tier_run(slot, r, keys, blocks)
            } else {
                TierBlocks::default()
            };
            if blocks > 0 || lower.total() > 0 {
                out.push(Credit {
                    slot,
                    blocks,
                    provisional,
                    lower,
                });
            }
        }
    }

    /// The prefix (in pool blocks) vLLM's hybrid coordinator would hit on `slot`: the fixed
    /// point where every group accepts the candidate length (`find_longest_cache_hit` in
    /// `kv_cache_coordinator.py`), aligned to the largest group block.
    fn hybrid_hit(&self, slot: Slot, r: &Residency, keys: &[BlockKey], primary_run: u32) -> u32 {
        let align = r.groups.iter().fold(1u32, |a, g| lcm(a, g.mult.max(1)));
        let mut hit = (keys.len() as u32) / align * align;
        loop {
            let before = hit;
            for g in &r.groups {
                let salt = r.salt(g.idx, 0);
                let m = g.mult;
                // group block j ends at pool block (j+1)·m − 1
                let held = |j: u32| self.holds_key(slot, keys[((j + 1) * m - 1) as usize] ^ salt);
                let max_blocks = hit / m;
                let h = match g.kind {
                    GroupKind::Full if Some(g.idx) == r.primary => primary_run.min(hit),
                    GroupKind::Full => (0..max_blocks).take_while(|&j| held(j)).count() as u32 * m,
                    GroupKind::SlidingWindow { window } => {
                        let need = (window - 1).div_ceil(m * r.pool_block_size.max(1));
                        sliding_hit(max_blocks, need, held) * m
                    }
                    GroupKind::Mamba => (0..max_blocks)
                        .rev()
                        .find(|&j| held(j))
                        .map_or(0, |j| (j + 1) * m),
                    GroupKind::Unmodelled => 0,
                };
                hit = hit.min(h) / align * align;
            }
            if hit == before || hit == 0 {
                return hit;
            }
        }
    }

    /// Blocks from `from` on that a tier below the GPU holds, each counted in the cheapest
    /// tier holding it, up to the first block none holds.
    fn lower_tier_run(
        &self,
        slot: Slot,
        r: &Residency,
        keys: &[BlockKey],
        from: u32,
    ) -> TierBlocks {
        let mut out = TierBlocks::default();
        let Some(primary) = r.primary else { return out };
        let salts: Vec<(Tier, u64)> = r
            .lower
            .iter()
            .map(|t| (t.tier, r.salt(primary, t.id)))
            .collect();
        for &key in keys.iter().skip(from as usize) {
            match salts
                .iter()
                .find(|(_, salt)| self.holds_key(slot, key ^ salt))
            {
                Some((tier, _)) => out.add(*tier),
                None => break,
            }
        }
        out
    }
}

/// vLLM's sliding-window finder over group blocks `0..max_blocks`: scanning from the right,
/// the first run of `need` held blocks ends the hit; without one, the held run at the start
/// (which needs no earlier context) is the hit.
fn sliding_hit(max_blocks: u32, need: u32, held: impl Fn(u32) -> bool) -> u32 {
    let mut run = 0;
    for i in (0..max_blocks).rev() {
        if held(i) {
            run += 1;
            if run >= need {
                return i + run;
            }
        } else {
            run = 0;
        }
    }
    run
}

fn lcm(a: u32, b: u32) -> u32 {
    let (mut x, mut y) = (a, b);
    while y != 0 {
        (x, y) = (y, x % y);
    }
    (a / x).saturating_mul(b)
}
