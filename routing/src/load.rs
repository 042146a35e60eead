//! The latest scraped load of each endpoint, with the time it was sampled.

use hashbrown::HashMap;
use serde::Serialize;

use crate::endpoint::{EndpointId, EngineKind};
use crate::engine_metrics::{LoadSample, MAX_ACTIVE_LORAS};

/// What an engine's `/metrics` said about one endpoint (rank), normalized across engines.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct EndpointLoad {
    pub waiting: f64,
    pub running: f64,
    /// KV-cache utilization in [0, 1].
    pub kv_usage: f64,
    /// KV capacity in blocks when the engine reports it.
    pub kv_capacity_blocks: Option<u64>,
    /// When the sample was taken (monotonic milliseconds of the caller's clock).
    pub sampled_at_ms: u64,
    /// The LoRA adapters it has in use, when it reports them.
    pub lora: Option<crate::engine_metrics::LoraActivity>,
}

impl EndpointLoad {
    /// Normalize a parsed scrape for an endpoint whose engine uses `block_size`-token blocks.
    /// SGLang reports its capacity in tokens (page size 1), converted here to blocks.
    pub fn from_sample(
        s: &LoadSample,
        engine: EngineKind,
        block_size: u32,
        sampled_at_ms: u64,
    ) -> Self {
        let kv_capacity_blocks = match (engine, s.block_size) {
            (EngineKind::Sglang, _) | (_, Some(1)) => s
                .kv_capacity_tokens()
                .map(|t| t / u64::from(block_size.max(1))),
            _ => s.kv_capacity_blocks,
        };
        Self {
            waiting: s.waiting,
            running: s.running,
            kv_usage: s.kv_usage,
            kv_capacity_blocks,
            sampled_at_ms,
            lora: s.lora,
        }
    }
}

/// The adapters this picker sent to an endpoint, most recent first (distinct, at most
/// [`MAX_ACTIVE_LORAS`]): vLLM keeps the least recently used idle adapter in a GPU slot until
/// another needs it, and its metrics name only adapters with running requests, so the
/// adapters an engine holds idle are the ones last routed there.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecentAdapters {
    hashes: [u64; MAX_ACTIVE_LORAS],
    len: u8,
}

impl RecentAdapters {
    /// Adapter `hash` was just routed here.
    pub fn record(&mut self, hash: u64) {
        let len = usize::from(self.len);
        let at = self.hashes[..len]
            .iter()
            .position(|&h| h == hash)
            .unwrap_or(len.min(MAX_ACTIVE_LORAS - 1));
        self.hashes.copy_within(0..at, 1);
        self.hashes[0] = hash;
        self.len = self.len.max((at + 1) as u8);
    }

    /// Whether `hash` is among the `slots` adapters last routed here.
    pub fn holds(&self, hash: u64, slots: usize) -> bool {
        self.hashes[..usize::from(self.len).min(slots)].contains(&hash)
    }
}

/// Latest sample per endpoint, and the adapters routed to it. Bounded by the endpoint set:
/// the service removes entries of endpoints that leave it.
#[derive(Debug, Clone, Default)]
pub struct LoadTable {
    samples: HashMap<EndpointId, EndpointLoad>,
    adapters: HashMap<EndpointId, RecentAdapters>,
}

impl LoadTable {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn update(&mut self, id: EndpointId, load: EndpointLoad) {
        self.samples.insert(id, load);
    }

    pub fn remove(&mut self, id: &EndpointId) {
        self.samples.remove(id);
        self.adapters.remove(id);
    }

    /// A request for adapter `hash` ([`crate::engine_metrics::lora_hash`]) was routed to `id`.
    pub fn record_adapter(&mut self, id: EndpointId, hash: u64) {
        self.adapters.entry(id).or_default().record(hash);
    }

    /// The adapters routed to `id`, most recent first.
    pub fn recent_adapters(&self, id: &EndpointId) -> Option<&RecentAdapters> {
        self.adapters.get(id)
    }

    pub fn get(&self, id: &EndpointId) -> Option<&EndpointLoad> {
        self.samples.get(id)
    }

    /// Whether the endpoint's last sample is older than `threshold_ms` at `now_ms`. An
    /// endpoint never sampled is not stale here (it may have no metrics at all); the scraper
    /// marks endpoints whose scrapes fail through their [`EndpointState`](crate::endpoint::EndpointState).
    pub fn is_stale(&self, id: &EndpointId, now_ms: u64, threshold_ms: u64) -> bool {
        self.samples
            .get(id)
            .is_some_and(|l| stale_since(l.sampled_at_ms, now_ms, threshold_ms))
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }
}

/// The staleness rule: an endpoint whose metrics are fresh since `fresh_since_ms` (its last
/// good sample) is stale at `now_ms` once more than `threshold_ms` have passed
/// (`routing.stalenessThreshold`). The pool marks endpoints by it at every scrape round
/// (`PoolState::observe_scrape`) and the router applies it to the samples between rounds.
pub fn stale_since(fresh_since_ms: u64, now_ms: u64, threshold_ms: u64) -> bool {
    now_ms.saturating_sub(fresh_since_ms) > threshold_ms
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine_metrics::{ParseLimits, parse_engine_metrics};
    use std::net::{IpAddr, Ipv4Addr};

    #[test]
    fn recent_adapters_keep_the_last_distinct_ones_first() {
        let mut r = RecentAdapters::default();
        for h in [1, 2, 3, 2] {
            r.record(h);
        }
        // most recent first: 2, 3, 1
        assert!(r.holds(2, 1) && !r.holds(3, 1));
        assert!(r.holds(3, 2) && !r.holds(1, 2));
        assert!(r.holds(1, 3));
        for h in 10..10 + MAX_ACTIVE_LORAS as u64 {
            r.record(h);
        }
        // bounded: the oldest fell out
        assert!(!r.holds(1, usize::MAX) && !r.holds(2, usize::MAX));
        assert!(r.holds(10, MAX_ACTIVE_LORAS));
        let mut t = LoadTable::new();
        let id = EndpointId::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 8000, 0);
        t.record_adapter(id, 7);
        assert!(t.recent_adapters(&id).is_some_and(|r| r.holds(7, 1)));
        t.remove(&id);
        assert!(t.recent_adapters(&id).is_none(), "gone with the endpoint");
    }

    #[test]
    fn scrapes_normalize_and_age() {
        let m = parse_engine_metrics(
            include_str!("../tests/fixtures/metrics/vllm.txt"),
            EngineKind::Vllm,
            &ParseLimits::default(),
        )
        .expect("fixture parses");
        let s = m.for_rank(1).expect("rank 1");
        let l = EndpointLoad::from_sample(s, EngineKind::Vllm, 16, 1000);
        assert_eq!((l.waiting, l.running), (s.waiting, s.running));
        assert_eq!(l.kv_capacity_blocks, s.kv_capacity_blocks);
        let id = EndpointId::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 8000, 1);
        let mut v = LoadTable::new();
        assert!(!v.is_stale(&id, 10_000, 2000), "never sampled is not stale");
        v.update(id, l);
        assert!(!v.is_stale(&id, 3000, 2000));
        assert!(v.is_stale(&id, 3001, 2000));
    }

    #[test]
    fn sglang_capacity_in_tokens_becomes_blocks() {
        let s = LoadSample {
            block_size: Some(1),
            kv_capacity_blocks: Some(160_000),
            ..LoadSample::default()
        };
        let l = EndpointLoad::from_sample(&s, EngineKind::Sglang, 16, 0);
        assert_eq!(l.kv_capacity_blocks, Some(10_000));
    }
}
