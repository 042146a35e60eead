//! The picker's own count of what it sent to each endpoint and is not finished yet.
//!
//! Scraped metrics are up to one scrape interval old; these counters change at the moment a
//! request is sent, gets its first token and completes, so a burst of requests does not all see
//! the same idle endpoint. Each picker replica counts only its own requests (see the service
//! docs on active-active replicas).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use hashbrown::HashMap;
use parking_lot::RwLock;
use serde::Serialize;

use crate::endpoint::EndpointId;

/// Requests one picker keeps in flight on one endpoint unless `limits.maxInflightPerEndpoint`
/// says otherwise.
pub const DEFAULT_MAX_PER_ENDPOINT: u64 = 2048;

#[derive(Debug, Default)]
struct Counters {
    requests: AtomicU64,
    tokens: AtomicU64,
    /// Requests (and their uncached prompt tokens) still waiting for their first token: the
    /// prefill work queued ahead of a new request.
    pending_requests: AtomicU64,
    pending_tokens: AtomicU64,
    /// The whole prompts of the requests still waiting for their first token: KV about to be
    /// allocated there that its scraped usage does not show yet (a split request's decode
    /// endpoint receives its prompt's KV while nothing is prefilled there).
    pending_prompt_tokens: AtomicU64,
    /// A request with at least one full KV block was sent (only then must an engine with
    /// prefix caching publish a `BlockStored`).
    full_block_sent: AtomicBool,
}

/// A point-in-time copy of one endpoint's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct InflightCounts {
    pub requests: u64,
    pub tokens: u64,
    pub pending_requests: u64,
    pub pending_tokens: u64,
    pub pending_prompt_tokens: u64,
}

/// Per-endpoint in-flight counters; one entry per endpoint in the set (bounded by it).
#[derive(Debug, Default)]
pub struct InflightTracker {
    by_endpoint: RwLock<HashMap<EndpointId, Arc<Counters>>>,
}

impl InflightTracker {
    pub fn new() -> Self {
        Self::default()
    }

    fn counters(&self, id: EndpointId) -> Arc<Counters> {
        if let Some(c) = self.by_endpoint.read().get(&id) {
            return c.clone();
        }
        self.by_endpoint.write().entry(id).or_default().clone()
    }

    /// A request was sent: `prompt_tokens` in total, `uncached_tokens` of them to prefill.
    /// The returned guard tracks it until it is dropped (completion, error or disconnect).
    pub fn begin(&self, id: EndpointId, prompt_tokens: u64, uncached_tokens: u64) -> InflightGuard {
        self.begin_blocks(id, prompt_tokens, uncached_tokens, false)
    }

    /// [`InflightTracker::begin`] for a prompt that has at least one full KV block when
    /// `full_block` (see [`InflightTracker::full_block_sent`]).
    pub fn begin_blocks(
        &self,
        id: EndpointId,
        prompt_tokens: u64,
        uncached_tokens: u64,
        full_block: bool,
    ) -> InflightGuard {
        let c = self.counters(id);
        if full_block && !c.full_block_sent.load(Ordering::Relaxed) {
            c.full_block_sent.store(true, Ordering::Relaxed);
        }
        InflightGuard::start(c, prompt_tokens, uncached_tokens)
    }

    /// A request counted nowhere: for an endpoint that is no longer tracked (it left between
    /// its placement and its sending), so that no entry outlives the endpoint.
    pub fn begin_detached(prompt_tokens: u64, uncached_tokens: u64) -> InflightGuard {
        InflightGuard::start(Arc::default(), prompt_tokens, uncached_tokens)
    }

    /// Whether a request with a full block was begun on `id` ([`InflightTracker::begin_blocks`]).
    pub fn full_block_sent(&self, id: &EndpointId) -> bool {
        self.by_endpoint
            .read()
            .get(id)
            .is_some_and(|c| c.full_block_sent.load(Ordering::Relaxed))
    }

    pub fn get(&self, id: &EndpointId) -> InflightCounts {
        self.by_endpoint
            .read()
            .get(id)
            .map_or_else(InflightCounts::default, |c| InflightCounts {
                requests: c.requests.load(Ordering::Relaxed),
                tokens: c.tokens.load(Ordering::Relaxed),
                pending_requests: c.pending_requests.load(Ordering::Relaxed),
                pending_tokens: c.pending_tokens.load(Ordering::Relaxed),
                pending_prompt_tokens: c.pending_prompt_tokens.load(Ordering::Relaxed),
            })
    }

    /// Forget an endpoint that left the set (its outstanding guards still decrement safely).
    pub fn remove(&self, id: &EndpointId) {
        self.by_endpoint.write().remove(id);
    }
}

/// Tracks one in-flight request; dropping it marks the request finished.
#[derive(Debug)]
pub struct InflightGuard {
    counters: Arc<Counters>,
    prompt_tokens: u64,
    uncached_tokens: u64,
    pending: bool,
}

impl InflightGuard {
    /// Count one request on `counters` until the guard drops.
    fn start(counters: Arc<Counters>, prompt_tokens: u64, uncached_tokens: u64) -> Self {
        counters.requests.fetch_add(1, Ordering::Relaxed);
        counters.tokens.fetch_add(prompt_tokens, Ordering::Relaxed);
        counters.pending_requests.fetch_add(1, Ordering::Relaxed);
        counters
            .pending_tokens
            .fetch_add(uncached_tokens, Ordering::Relaxed);
        counters
            .pending_prompt_tokens
            .fetch_add(prompt_tokens, Ordering::Relaxed);
        Self {
            counters,
            prompt_tokens,
            uncached_tokens,
            pending: true,
        }
    }

    /// The first token arrived: the request's prefill is no longer queued work.
    pub fn first_token(&mut self) {
        if std::mem::take(&mut self.pending) {
            self.counters
                .pending_requests
                .fetch_sub(1, Ordering::Relaxed);
            self.counters
                .pending_tokens
                .fetch_sub(self.uncached_tokens, Ordering::Relaxed);
            self.counters
                .pending_prompt_tokens
                .fetch_sub(self.prompt_tokens, Ordering::Relaxed);
        }
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.first_token();
        self.counters.requests.fetch_sub(1, Ordering::Relaxed);
        self.counters
            .tokens
            .fetch_sub(self.prompt_tokens, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{IpAddr, Ipv4Addr};

    #[test]
    fn send_first_token_and_completion_are_accounted() {
        let t = InflightTracker::new();
        let id = EndpointId::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 1, 0);
        let mut a = t.begin(id, 1000, 600);
        let b = t.begin(id, 10, 10);
        assert_eq!(
            t.get(&id),
            InflightCounts {
                requests: 2,
                tokens: 1010,
                pending_requests: 2,
                pending_tokens: 610,
                pending_prompt_tokens: 1010,
            }
        );
        a.first_token();
        a.first_token(); // idempotent
        assert_eq!(t.get(&id).pending_tokens, 10);
        assert_eq!(t.get(&id).pending_prompt_tokens, 10);
        assert_eq!(t.get(&id).requests, 2);
        drop(a);
        drop(b); // finished without a first token (error / disconnect)
        assert_eq!(t.get(&id), InflightCounts::default());
    }

    #[test]
    fn removed_endpoint_guards_do_not_underflow_new_counters() {
        let t = InflightTracker::new();
        let id = EndpointId::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 1, 0);
        let g = t.begin(id, 5, 5);
        t.remove(&id);
        let h = t.begin(id, 7, 7);
        drop(g);
        assert_eq!(t.get(&id).requests, 1);
        drop(h);
        assert_eq!(t.get(&id).requests, 0);
    }
}
