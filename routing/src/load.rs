//! The latest scraped load of each endpoint, with the time it was sampled.

use hashbrown::HashMap;
use serde::Serialize;

use crate::endpoint::{EndpointId, EngineKind};
use crate::engine_metrics::LoadSample;

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

/// Latest sample per endpoint. Bounded by the endpoint set: the service removes entries of
/// endpoints that leave it.
#[derive(Debug, Clone, Default)]
pub struct LoadTable {
    samples: HashMap<EndpointId, EndpointLoad>,
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
