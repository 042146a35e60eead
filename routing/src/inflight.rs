//! The picker's own count of what it sent to each endpoint and is not finished yet, and what
//! its peer replicas say of theirs.
//!
//! Scraped metrics are up to one scrape interval old; these counters change at the moment a
//! request is sent, gets its first token and completes, so a burst of requests does not all see
//! the same idle endpoint. Each picker replica counts its own requests; the other replicas'
//! arrive through the in-flight exchange (`peers` in the service docs) and are added when a
//! request is placed ([`InflightTracker::get_with_peers`]).

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

impl InflightCounts {
    fn add(&mut self, o: &Self) {
        self.requests = self.requests.saturating_add(o.requests);
        self.tokens = self.tokens.saturating_add(o.tokens);
        self.pending_requests = self.pending_requests.saturating_add(o.pending_requests);
        self.pending_tokens = self.pending_tokens.saturating_add(o.pending_tokens);
        self.pending_prompt_tokens = self
            .pending_prompt_tokens
            .saturating_add(o.pending_prompt_tokens);
    }

    fn sub(&mut self, o: &Self) {
        self.requests = self.requests.saturating_sub(o.requests);
        self.tokens = self.tokens.saturating_sub(o.tokens);
        self.pending_requests = self.pending_requests.saturating_sub(o.pending_requests);
        self.pending_tokens = self.pending_tokens.saturating_sub(o.pending_tokens);
        self.pending_prompt_tokens = self
            .pending_prompt_tokens
            .saturating_sub(o.pending_prompt_tokens);
    }

    fn is_zero(&self) -> bool {
        *self == Self::default()
    }
}

/// How often a replica publishes its in-flight counts to its peers unless `peers.intervalMs`
/// says otherwise.
pub const DEFAULT_PEER_INTERVAL_MS: f64 = 20.0;

/// How long a peer's entry counts without a refresh: ten publications, at least 500 ms (a
/// lost datagram or two does not drop a peer; a replica that stopped is forgotten soon).
pub fn peer_ttl_ms(interval_ms: u64) -> u64 {
    interval_ms.saturating_mul(10).max(500)
}

/// Picker replicas whose counts are kept at most.
pub const MAX_PEERS: usize = 64;
/// Endpoints kept per peer at most.
pub const MAX_PEER_ENTRIES: usize = 16_384;

/// The most one peer's entry for one endpoint may claim: a replica keeps at most
/// `limits.maxInflightPerEndpoint` requests in flight on an endpoint, each of at most
/// `limits.maxPromptTokens` prompt tokens (what it may also generate is not bounded by the
/// picker, so token counts get twice the prompt bound). A peer cannot push an endpoint out of
/// placement by claiming more than a real replica could hold there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerBound {
    pub requests: u64,
    pub tokens_per_request: u64,
}

impl PeerBound {
    pub fn clamp(self, c: InflightCounts) -> InflightCounts {
        let tokens = self.requests.saturating_mul(self.tokens_per_request);
        InflightCounts {
            requests: c.requests.min(self.requests),
            tokens: c.tokens.min(tokens.saturating_mul(2)),
            pending_requests: c.pending_requests.min(self.requests),
            pending_tokens: c.pending_tokens.min(tokens),
            pending_prompt_tokens: c.pending_prompt_tokens.min(tokens),
        }
    }
}

impl Default for PeerBound {
    fn default() -> Self {
        Self {
            requests: DEFAULT_MAX_PER_ENDPOINT,
            tokens_per_request: 1 << 20,
        }
    }
}

/// What one peer replica last published for one endpoint, and when it arrived.
#[derive(Debug, Clone, Copy)]
struct PeerEntry {
    counts: InflightCounts,
    at_ms: u64,
}

/// Other picker replicas' in-flight counts as they published them, and their sum per endpoint.
#[derive(Debug, Default)]
struct Peers {
    by_peer: HashMap<u64, HashMap<EndpointId, PeerEntry>>,
    totals: HashMap<EndpointId, InflightCounts>,
}

impl Peers {
    fn set(&mut self, peer: u64, id: EndpointId, counts: InflightCounts, now_ms: u64) -> bool {
        if !self.by_peer.contains_key(&peer) && self.by_peer.len() >= MAX_PEERS {
            // a replica that (re)starts displaces the one heard from least recently, so ids
            // that went silent cannot lock a live replica out until they expire
            let stalest = self
                .by_peer
                .iter()
                .map(|(&p, e)| (e.values().map(|v| v.at_ms).max().unwrap_or(0), p))
                .min();
            match stalest {
                Some((at, old)) if at < now_ms => self.remove_peer(old),
                _ => return false,
            }
        }
        let entries = self.by_peer.entry(peer).or_default();
        if !entries.contains_key(&id) && entries.len() >= MAX_PEER_ENTRIES {
            return false;
        }
        let old = entries.insert(
            id,
            PeerEntry {
                counts,
                at_ms: now_ms,
            },
        );
        let total = self.totals.entry(id).or_default();
        if let Some(old) = old {
            total.sub(&old.counts);
        }
        total.add(&counts);
        if total.is_zero() {
            self.totals.remove(&id);
        }
        true
    }

    fn remove_peer(&mut self, peer: u64) {
        for (id, e) in self.by_peer.remove(&peer).unwrap_or_default() {
            if let Some(t) = self.totals.get_mut(&id) {
                t.sub(&e.counts);
                if t.is_zero() {
                    self.totals.remove(&id);
                }
            }
        }
    }

    fn expire(&mut self, older_than_ms: u64) {
        let totals = &mut self.totals;
        self.by_peer.retain(|_, entries| {
            entries.retain(|id, e| {
                let keep = e.at_ms >= older_than_ms;
                if !keep && let Some(t) = totals.get_mut(id) {
                    t.sub(&e.counts);
                    if t.is_zero() {
                        totals.remove(id);
                    }
                }
                keep
            });
            !entries.is_empty()
        });
    }

    fn remove_endpoint(&mut self, id: &EndpointId) {
        for entries in self.by_peer.values_mut() {
            entries.remove(id);
        }
        self.by_peer.retain(|_, e| !e.is_empty());
        self.totals.remove(id);
    }
}

/// Per-endpoint in-flight counters; one entry per endpoint in the set (bounded by it).
///
/// Besides this replica's own counts it keeps what other replicas of the same pool published
/// of theirs (`peers`, [`InflightTracker::apply_peer`]): a request another replica sent a
/// moment ago is queued work here too, and the scrape shows it only as a count, not its size.
#[derive(Debug, Default)]
pub struct InflightTracker {
    by_endpoint: RwLock<HashMap<EndpointId, Arc<Counters>>>,
    peers: RwLock<Peers>,
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

    /// This replica's counts and the fresh ones its peers published, summed: the requests
    /// in flight on `id` that placement prices.
    pub fn get_with_peers(&self, id: &EndpointId) -> InflightCounts {
        let mut c = self.get(id);
        if let Some(p) = self.peers.read().totals.get(id) {
            c.add(p);
        }
        c
    }

    /// What the peers published for `id`, summed.
    pub fn peers_total(&self, id: &EndpointId) -> InflightCounts {
        self.peers
            .read()
            .totals
            .get(id)
            .copied()
            .unwrap_or_default()
    }

    /// This replica's counts of every endpoint it tracks: what it publishes to its peers
    /// (zeros included, so that a peer's view of a drained endpoint goes back to zero).
    pub fn own_counts(&self) -> Vec<(EndpointId, InflightCounts)> {
        let ids: Vec<EndpointId> = self.by_endpoint.read().keys().copied().collect();
        ids.into_iter().map(|id| (id, self.get(&id))).collect()
    }

    /// A peer replica `peer` published `counts` (arrived at `now_ms`): each entry replaces
    /// that peer's previous one for its endpoint. Beyond [`MAX_PEERS`] peers or
    /// [`MAX_PEER_ENTRIES`] entries per peer, new ones are dropped. Returns the entries taken.
    pub fn apply_peer(
        &self,
        peer: u64,
        counts: &[(EndpointId, InflightCounts)],
        now_ms: u64,
        bound: PeerBound,
    ) -> usize {
        let mut peers = self.peers.write();
        counts
            .iter()
            .filter(|&&(id, c)| peers.set(peer, id, bound.clamp(c), now_ms))
            .count()
    }

    /// Forget peers' entries that were not refreshed since `older_than_ms` (a replica that
    /// stopped, or a lost feed).
    pub fn expire_peers(&self, older_than_ms: u64) {
        self.peers.write().expire(older_than_ms);
    }

    /// Peer replicas with fresh entries.
    pub fn peer_count(&self) -> usize {
        self.peers.read().by_peer.len()
    }

    /// Forget an endpoint that left the set (its outstanding guards still decrement safely).
    pub fn remove(&self, id: &EndpointId) {
        self.by_endpoint.write().remove(id);
        self.peers.write().remove_endpoint(id);
    }
}

/// Tracks one in-flight request; dropping it marks the request finished.
#[derive(Debug)]
pub struct InflightGuard {
    /// Its counters, its sizes and whether its prefill is still pending, shared with the
    /// marks it hands out.
    mark: PrefillMark,
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
            mark: PrefillMark {
                counters,
                prompt_tokens,
                uncached_tokens,
                pending: Arc::new(AtomicBool::new(true)),
            },
        }
    }

    /// The first token arrived: the request's prefill is no longer queued work.
    pub fn first_token(&mut self) {
        self.mark.prefill_done();
    }

    /// A handle that ends the request's prefill from elsewhere: for a request whose answer
    /// comes whole (not streamed), its first token is never seen, so its owner marks the
    /// prefill done when it predicts it to be (the guard's end marks it at the latest).
    pub fn prefill_mark(&self) -> PrefillMark {
        self.mark.clone()
    }
}

/// Marks one request's prefill done ([`InflightGuard::prefill_mark`]); only the first mark
/// (of the handle or the guard) counts.
#[derive(Debug, Clone)]
pub struct PrefillMark {
    counters: Arc<Counters>,
    prompt_tokens: u64,
    uncached_tokens: u64,
    pending: Arc<AtomicBool>,
}

impl PrefillMark {
    pub fn prefill_done(&self) {
        if self.pending.swap(false, Ordering::AcqRel) {
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
        let m = &self.mark;
        m.prefill_done();
        m.counters.requests.fetch_sub(1, Ordering::Relaxed);
        m.counters
            .tokens
            .fetch_sub(m.prompt_tokens, Ordering::Relaxed);
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
    fn peers_counts_add_to_the_own_until_they_expire_or_the_endpoint_leaves() {
        let t = InflightTracker::new();
        let a = EndpointId::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 1, 0);
        let b = EndpointId::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 2, 0);
        let _g = t.begin(a, 100, 60);
        let two = |pending_tokens| InflightCounts {
            requests: 2,
            tokens: 2_000,
            pending_requests: 2,
            pending_tokens,
            pending_prompt_tokens: 2_000,
        };
        // two peers; the second one's b is an endpoint this replica never sent to
        assert_eq!(
            t.apply_peer(7, &[(a, two(1_500))], 1_000, PeerBound::default()),
            1
        );
        assert_eq!(
            t.apply_peer(
                9,
                &[(a, two(500)), (b, two(800))],
                1_010,
                PeerBound::default()
            ),
            2
        );
        assert_eq!(t.get(&a).pending_tokens, 60, "get is this replica's own");
        assert_eq!(t.get_with_peers(&a).pending_tokens, 60 + 1_500 + 500);
        assert_eq!(t.get_with_peers(&a).requests, 5);
        assert_eq!(t.get_with_peers(&b).pending_tokens, 800);
        // a newer entry replaces the peer's previous one, it does not add to it
        t.apply_peer(
            7,
            &[(a, InflightCounts::default())],
            1_020,
            PeerBound::default(),
        );
        assert_eq!(t.peers_total(&a).pending_tokens, 500);
        assert_eq!(t.peer_count(), 2);
        // peer 9 goes silent: its entries expire
        t.apply_peer(7, &[(a, two(100))], 1_500, PeerBound::default());
        t.expire_peers(1_200);
        assert_eq!(t.peers_total(&a).pending_tokens, 100);
        assert_eq!(t.peers_total(&b), InflightCounts::default());
        assert_eq!(t.peer_count(), 1);
        // an endpoint that leaves takes its peers' entries with it
        t.remove(&a);
        assert_eq!(t.get_with_peers(&a), InflightCounts::default());
        assert_eq!(t.peer_count(), 0);
    }

    #[test]
    fn peers_and_their_entries_are_bounded() {
        let t = InflightTracker::new();
        let one = InflightCounts {
            requests: 1,
            ..InflightCounts::default()
        };
        let id = |port| EndpointId::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port, 0);
        for p in 0..(MAX_PEERS as u64 + 5) {
            t.apply_peer(p, &[(id(1), one)], 0, PeerBound::default());
        }
        assert_eq!(t.peer_count(), MAX_PEERS);
        assert_eq!(t.get_with_peers(&id(1)).requests, MAX_PEERS as u64);
        // a replica that starts later displaces the stalest id instead of being refused (64
        // ids that went silent, or were made up, cannot lock it out)
        let fresh = InflightCounts {
            requests: 100,
            ..InflightCounts::default()
        };
        assert_eq!(
            t.apply_peer(1_000, &[(id(1), fresh)], 5, PeerBound::default()),
            1
        );
        assert_eq!(t.peer_count(), MAX_PEERS);
        assert_eq!(
            t.get_with_peers(&id(1)).requests,
            MAX_PEERS as u64 - 1 + 100
        );
        let many: Vec<_> = (0..=MAX_PEER_ENTRIES as u16)
            .map(|p| (id(p), one))
            .collect();
        assert_eq!(
            t.apply_peer(1, &many, 0, PeerBound::default()),
            MAX_PEER_ENTRIES
        );
    }

    #[test]
    fn a_peer_claims_no_more_than_a_replica_could_hold() {
        let t = InflightTracker::new();
        let a = EndpointId::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 1, 0);
        let huge = InflightCounts {
            requests: 1_000_000_000_000_000,
            tokens: u64::MAX,
            pending_requests: 1_000_000_000_000_000,
            pending_tokens: u64::MAX,
            pending_prompt_tokens: u64::MAX,
        };
        let bound = PeerBound {
            requests: 2048,
            tokens_per_request: 1000,
        };
        t.apply_peer(7, &[(a, huge)], 0, bound);
        let got = t.get_with_peers(&a);
        assert_eq!(got.requests, 2048);
        assert_eq!(got.pending_requests, 2048);
        assert_eq!(got.pending_tokens, 2_048_000);
        assert_eq!(got.tokens, 4_096_000);
    }

    #[test]
    fn a_prefill_mark_ends_the_prefill_once() {
        let t = InflightTracker::new();
        let id = EndpointId::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 1, 0);
        let mut g = t.begin(id, 100, 60);
        let mark = g.prefill_mark();
        assert_eq!(t.get(&id).pending_requests, 1);
        mark.prefill_done();
        let got = t.get(&id);
        assert_eq!(
            (got.requests, got.pending_requests, got.pending_tokens),
            (1, 0, 0)
        );
        // the guard's own mark, and a second from the handle, count nothing more
        g.first_token();
        mark.prefill_done();
        assert_eq!(t.get(&id).pending_prompt_tokens, 0);
        drop(g);
        mark.prefill_done();
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
