//! The latest scraped load of each endpoint, with the time it was sampled.

use hashbrown::HashMap;
use serde::Serialize;

use crate::endpoint::EndpointId;

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
}

/// Latest sample per endpoint. Bounded by the endpoint set: the service removes entries of
/// endpoints that leave it.
#[derive(Debug, Clone, Default)]
pub struct LoadView {
    samples: HashMap<EndpointId, EndpointLoad>,
}

impl LoadView {
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
            .is_some_and(|l| now_ms.saturating_sub(l.sampled_at_ms) > threshold_ms)
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }
}
