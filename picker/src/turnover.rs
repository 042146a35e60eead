//! Cache turnover: how long an idle block survives in each endpoint's cache, and how long
//! requests take to come back for the blocks they leave behind.
//!
//! An engine's prefix cache is an LRU over the blocks no running request holds: every block a
//! request allocates takes the place of the least recently used idle block once the empty ones
//! are gone. So an idle block survives about `idle capacity / write rate` — the endpoint's
//! *retention* — and placing more new work on an endpoint shortens it. Whether that costs
//! anything depends on what it evicts: the LRU victim has been idle for one retention, and it
//! is still wanted only if requests come back for blocks later than that. The picker sees both
//! sides:
//! - the **write rate** of each endpoint: the uncached prompt tokens it routed there, decayed
//!   over a window (the blocks the engine must allocate for them);
//! - the **reuse gaps**: every request marks the last block of its prompt and of its cached
//!   prefix with the time; a later request whose prompt contains a marked block (the deepest
//!   one counts) came back for it after the time between the two, whether or not the block
//!   was still cached. The recent gaps, sorted, give the share of reuses that come back later
//!   than a given retention ([`Turnover::reused_after`]).
//!
//! The cost model prices the cached blocks a placement would evict by that share
//! (`policy::cost_model`): a cache that turns over faster than sessions return has its
//! victims still in use, one whose victims are long dead evicts for free. The state is pure,
//! bounded, and updated by the router at each decision with the caller's clock.

use std::collections::VecDeque;

use hashlink::LruCache;
use rustc_hash::FxBuildHasher;

use crate::block_keys::BlockKey;
use crate::endpoint::EndpointId;

/// Bounds and windows of the estimator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TurnoverConfig {
    /// Time constant of the write-rate decay.
    pub window_ms: u64,
    /// Endpoints tracked (least recently routed to forgotten first).
    pub max_endpoints: usize,
    /// Block keys whose last use is remembered, for reuse gaps.
    pub max_keys: usize,
    /// Recent reuse gaps kept.
    pub max_gaps: usize,
}

impl Default for TurnoverConfig {
    fn default() -> Self {
        Self {
            window_ms: 30_000,
            max_endpoints: 4096,
            max_keys: 65_536,
            max_gaps: 256,
        }
    }
}

/// An exponentially decayed count of tokens written: `total` as of `at_ms`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Decayed {
    total: f64,
    at_ms: u64,
}

impl Decayed {
    fn at(&self, now_ms: u64, window_ms: f64) -> f64 {
        let dt = now_ms.saturating_sub(self.at_ms) as f64;
        self.total * (-dt / window_ms).exp()
    }
}

#[derive(Debug)]
pub struct Turnover {
    config: TurnoverConfig,
    written: LruCache<EndpointId, Decayed, FxBuildHasher>,
    /// Block key → when a request last ended its cached prefix or its prompt there.
    marks: LruCache<BlockKey, u64, FxBuildHasher>,
    gaps: VecDeque<u64>,
    /// `gaps`, sorted.
    sorted: Vec<u64>,
}

impl Default for Turnover {
    fn default() -> Self {
        Self::new(TurnoverConfig::default())
    }
}

impl Turnover {
    pub fn new(config: TurnoverConfig) -> Self {
        Self {
            written: LruCache::with_hasher(config.max_endpoints.max(1), FxBuildHasher),
            marks: LruCache::with_hasher(config.max_keys.max(1), FxBuildHasher),
            gaps: VecDeque::with_capacity(config.max_gaps),
            sorted: Vec::with_capacity(config.max_gaps),
            config,
        }
    }

    fn window(&self) -> f64 {
        self.config.window_ms.max(1) as f64
    }

    /// Uncached tokens per millisecond routed to `endpoint` lately.
    pub fn write_rate(&self, endpoint: &EndpointId, now_ms: u64) -> f64 {
        self.written
            .peek(endpoint)
            .map_or(0.0, |d| d.at(now_ms, self.window()) / self.window())
    }

    /// How long an idle block survives on `endpoint` with `idle_tokens` of cache for idle
    /// blocks at its current write rate, in ms; `None` when nothing is written there.
    pub fn retention_ms(
        &self,
        endpoint: &EndpointId,
        idle_tokens: f64,
        now_ms: u64,
    ) -> Option<f64> {
        let rate = self.write_rate(endpoint, now_ms);
        (rate > 0.0).then(|| idle_tokens.max(0.0) / rate)
    }

    /// The share of recent reuses that came back more than `ms` after the block's last use
    /// (0 before any reuse was seen).
    pub fn reused_after(&self, ms: f64) -> f64 {
        if self.sorted.is_empty() {
            return 0.0;
        }
        let beyond = self.sorted.len() - self.sorted.partition_point(|&g| (g as f64) <= ms);
        beyond as f64 / self.sorted.len() as f64
    }

    /// Recent reuse gaps, oldest first (ms).
    pub fn gaps(&self) -> impl ExactSizeIterator<Item = u64> + '_ {
        self.gaps.iter().copied()
    }

    /// A request with block keys `keys`, `matched` of them cached there, was sent to
    /// `endpoint` with `uncached_tokens` to prefill, at `now_ms`.
    pub fn record(
        &mut self,
        endpoint: EndpointId,
        keys: &[BlockKey],
        matched: u32,
        uncached_tokens: u32,
        now_ms: u64,
    ) {
        let window = self.window();
        let mut d = self.written.get(&endpoint).copied().unwrap_or_default();
        d = Decayed {
            total: d.at(now_ms, window) + f64::from(uncached_tokens),
            at_ms: now_ms.max(d.at_ms),
        };
        self.written.insert(endpoint, d);

        // the deepest marked block of the prompt, wherever it is cached (measuring only the
        // reuses that hit would see only the blocks that survived: short gaps)
        let gap = keys
            .iter()
            .rev()
            .find_map(|k| self.marks.peek(k).copied())
            .map(|t| now_ms.saturating_sub(t));
        if let Some(g) = gap {
            self.push_gap(g);
        }
        let matched = (matched as usize).min(keys.len());
        if matched > 0 {
            self.marks.insert(keys[matched - 1], now_ms);
        }
        if let Some(&last) = keys.last() {
            self.marks.insert(last, now_ms);
        }
    }

    fn push_gap(&mut self, gap: u64) {
        let cap = self.config.max_gaps.max(1);
        if self.gaps.len() == cap
            && let Some(old) = self.gaps.pop_front()
            && let Ok(i) = self.sorted.binary_search(&old)
        {
            self.sorted.remove(i);
        }
        self.gaps.push_back(gap);
        let i = self.sorted.partition_point(|&g| g < gap);
        self.sorted.insert(i, gap);
    }

    /// Endpoints and keys remembered (for bounds checks).
    pub fn len(&self) -> (usize, usize) {
        (self.written.len(), self.marks.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{IpAddr, Ipv4Addr};

    fn ep(n: u8) -> EndpointId {
        EndpointId::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, n)), 8000, 0)
    }

    #[test]
    fn write_rate_decays_over_the_window() {
        let mut t = Turnover::default();
        t.record(ep(1), &[1, 2, 3], 0, 3000, 0);
        // 3000 tokens over a 30 s window: 0.1 tokens per ms right after
        assert!((t.write_rate(&ep(1), 0) - 0.1).abs() < 1e-12);
        // one window later, e^-1 of it
        let later = t.write_rate(&ep(1), 30_000);
        assert!((later - 0.1 / std::f64::consts::E).abs() < 1e-12, "{later}");
        assert_eq!(t.write_rate(&ep(2), 0), 0.0);
        // retention: 6000 idle tokens at 0.1 per ms last 60 s; nothing written: unknown
        assert!((t.retention_ms(&ep(1), 6000.0, 0).expect("written") - 60_000.0).abs() < 1e-6);
        assert_eq!(t.retention_ms(&ep(2), 6000.0, 0), None);
    }

    #[test]
    fn a_session_turn_measures_the_gap_since_its_previous_turn() {
        let mut t = Turnover::default();
        // turn 1: blocks 10..20, nothing cached
        let turn1: Vec<u64> = (10..20).collect();
        t.record(ep(1), &turn1, 0, 320, 1_000);
        assert_eq!(t.gaps().len(), 0);
        // turn 2, 2.5 s later, carries turn 1's blocks and 5 more: cached or not, it came back
        // for turn 1's last block
        let turn2: Vec<u64> = (10..25).collect();
        t.record(ep(1), &turn2, 10, 160, 3_500);
        assert_eq!(t.gaps().collect::<Vec<_>>(), vec![2_500]);
        // turn 3 on another endpoint where nothing is cached: measured all the same
        let turn3: Vec<u64> = (10..30).collect();
        t.record(ep(2), &turn3, 0, 640, 7_500);
        assert_eq!(t.gaps().collect::<Vec<_>>(), vec![2_500, 4_000]);
        // a shared prefix is marked where a request's cached prefix ended
        let other: Vec<u64> = [10, 11, 12, 99].into();
        t.record(ep(2), &other, 3, 32, 8_000);
        let third: Vec<u64> = [10, 11, 12, 98].into();
        t.record(ep(1), &third, 3, 32, 8_100);
        assert_eq!(t.gaps().last(), Some(100));
        // unrelated blocks: nothing measured
        t.record(ep(1), &[500, 501], 0, 64, 9_000);
        assert_eq!(t.gaps().len(), 3);
    }

    #[test]
    fn reused_after_is_the_share_of_longer_gaps() {
        let mut t = Turnover::new(TurnoverConfig {
            max_gaps: 4,
            ..TurnoverConfig::default()
        });
        assert_eq!(t.reused_after(0.0), 0.0);
        for g in [1_000, 2_000, 3_000, 4_000] {
            t.push_gap(g);
        }
        assert_eq!(t.reused_after(500.0), 1.0);
        assert_eq!(t.reused_after(2_000.0), 0.5);
        assert_eq!(t.reused_after(10_000.0), 0.0);
        // the oldest gap leaves when a new one comes
        t.push_gap(10_000);
        assert_eq!(
            t.gaps().collect::<Vec<_>>(),
            vec![2_000, 3_000, 4_000, 10_000]
        );
        assert_eq!(t.reused_after(2_000.0), 0.75);
    }

    #[test]
    fn memory_is_bounded() {
        let mut t = Turnover::new(TurnoverConfig {
            max_endpoints: 3,
            max_keys: 50,
            max_gaps: 8,
            ..TurnoverConfig::default()
        });
        for i in 0..1_000u64 {
            let keys: Vec<u64> = (i * 10..i * 10 + 10).collect();
            t.record(ep((i % 7) as u8), &keys, 5, 160, i);
            let again: Vec<u64> = (i * 10..i * 10 + 6).collect();
            t.record(ep((i % 5) as u8), &again, 6, 0, i + 1);
        }
        let (endpoints, keys) = t.len();
        assert!(endpoints <= 3 && keys <= 50, "{endpoints} {keys}");
        assert_eq!(t.gaps().len(), 8);
        assert_eq!(t.sorted.len(), 8);
    }
}
