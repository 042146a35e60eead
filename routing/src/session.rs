//! Session affinity: which endpoint (and rank) a session's blocks live on.

use hashlink::LruCache;
use rustc_hash::FxBuildHasher;
use xxhash_rust::xxh3::xxh3_64;

use crate::endpoint::EndpointId;

/// Where one session lives: the endpoint that served it last, the prompt tokens of that turn
/// (the context its next turn will reuse) and when it was served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionPin {
    pub endpoint: EndpointId,
    pub tokens: u64,
    pub served_ms: u64,
}

/// A bounded LRU from session to endpoint. Keys are hashes of `(tenant, session)` so that two
/// tenants using the same session id never share an entry, and so that memory per entry does
/// not depend on what clients send. It also learns how long a session's context stays wanted
/// ([`ReuseHorizon`], from the gaps between a session's turns), which makes each endpoint's
/// working set ([`SessionTable::working_sets`]).
#[derive(Debug)]
pub struct SessionTable {
    map: LruCache<u64, SessionPin, FxBuildHasher>,
    horizon: ReuseHorizon,
}

impl SessionTable {
    /// `capacity` sessions at most (least recently used forgotten first); at least 1.
    pub fn new(capacity: usize) -> Self {
        Self {
            map: LruCache::with_hasher(capacity.max(1), FxBuildHasher),
            horizon: ReuseHorizon::default(),
        }
    }

    pub fn key(tenant: Option<&str>, session: &str) -> u64 {
        let t = tenant.unwrap_or("");
        let mut buf = Vec::with_capacity(t.len() + session.len() + 9);
        buf.extend_from_slice(&(t.len() as u64).to_le_bytes());
        buf.extend_from_slice(t.as_bytes());
        buf.push(0);
        buf.extend_from_slice(session.as_bytes());
        xxh3_64(&buf)
    }

    pub fn get(&mut self, key: u64) -> Option<EndpointId> {
        self.map.get(&key).map(|p| p.endpoint)
    }

    /// The endpoint `key` is pinned to, without touching its place in the LRU order.
    pub fn peek(&self, key: u64) -> Option<EndpointId> {
        self.map.peek(&key).map(|p| p.endpoint)
    }

    /// Pin `key` to `endpoint`, no size or time known (a working set counts it as empty).
    pub fn set(&mut self, key: u64, endpoint: EndpointId) {
        self.map.insert(
            key,
            SessionPin {
                endpoint,
                tokens: 0,
                served_ms: 0,
            },
        );
    }

    /// `endpoint` served a turn of session `key` with a prompt of `tokens` at `now_ms`: the
    /// session is pinned there, and the gap since its previous turn teaches the horizon.
    pub fn served(&mut self, key: u64, endpoint: EndpointId, tokens: u64, now_ms: u64) {
        if let Some(prev) = self.map.peek(&key)
            && prev.served_ms > 0
            && now_ms >= prev.served_ms
        {
            self.horizon.observe(now_ms - prev.served_ms);
        }
        self.map.insert(
            key,
            SessionPin {
                endpoint,
                tokens,
                served_ms: now_ms,
            },
        );
    }

    /// The horizon past which a session's context is taken to be no longer wanted.
    pub fn horizon_ms(&self) -> u64 {
        self.horizon.horizon_ms()
    }

    /// Each endpoint's working set at `now_ms`: the prompt tokens of the sessions pinned there
    /// whose last turn is within the horizon (what its cache must hold for their next turns to
    /// hit). One pass over the table: for explanations and gauges, not every decision.
    pub fn working_sets(&self, now_ms: u64) -> hashbrown::HashMap<EndpointId, u64> {
        let horizon = self.horizon_ms();
        let mut out = hashbrown::HashMap::new();
        for (_, p) in self.map.iter() {
            if p.tokens > 0 && now_ms.saturating_sub(p.served_ms) <= horizon {
                *out.entry(p.endpoint).or_insert(0) += p.tokens;
            }
        }
        out
    }

    /// Forget every session pinned to an endpoint that left the set.
    pub fn remove_endpoint(&mut self, endpoint: &EndpointId) {
        let stale: Vec<u64> = self
            .map
            .iter()
            .filter(|(_, p)| p.endpoint == *endpoint)
            .map(|(k, _)| *k)
            .collect();
        for k in stale {
            self.map.remove(&k);
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// How long a session's context stays wanted: the 90th percentile of the gaps between a
/// session's consecutive turns, from a histogram of power-of-two buckets (1 ms to about 12
/// days) whose counts halve every [`ReuseHorizon::HALF_LIFE`] observations, so it follows a
/// workload that changes. Until [`ReuseHorizon::MIN_OBSERVATIONS`] gaps are seen it is
/// [`ReuseHorizon::DEFAULT_MS`].
#[derive(Debug, Clone)]
pub struct ReuseHorizon {
    buckets: [f64; 31],
    total: f64,
    since_halving: u32,
    seen: u64,
}

impl Default for ReuseHorizon {
    fn default() -> Self {
        Self {
            buckets: [0.0; 31],
            total: 0.0,
            since_halving: 0,
            seen: 0,
        }
    }
}

impl ReuseHorizon {
    /// Before enough gaps are seen: agent tool calls and chat turns mostly come back within a
    /// minute.
    pub const DEFAULT_MS: u64 = 60_000;
    pub const MIN_OBSERVATIONS: u64 = 16;
    pub const HALF_LIFE: u32 = 4096;

    /// One gap between two turns of a session.
    pub fn observe(&mut self, gap_ms: u64) {
        let b = (64 - gap_ms.max(1).leading_zeros() as usize - 1).min(self.buckets.len() - 1);
        self.buckets[b] += 1.0;
        self.total += 1.0;
        self.seen += 1;
        self.since_halving += 1;
        if self.since_halving >= Self::HALF_LIFE {
            self.since_halving = 0;
            self.buckets.iter_mut().for_each(|c| *c /= 2.0);
            self.total /= 2.0;
        }
    }

    /// The upper bound of the bucket holding the 90th percentile of the gaps.
    pub fn horizon_ms(&self) -> u64 {
        if self.seen < Self::MIN_OBSERVATIONS {
            return Self::DEFAULT_MS;
        }
        let want = 0.9 * self.total;
        let mut acc = 0.0;
        for (b, &c) in self.buckets.iter().enumerate() {
            acc += c;
            if acc >= want {
                return (2u64 << b) - 1;
            }
        }
        (2u64 << (self.buckets.len() - 1)) - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{IpAddr, Ipv4Addr};

    #[test]
    fn bounded_and_tenant_scoped() {
        let e = |n| EndpointId::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, n)), 1, 0);
        let mut t = SessionTable::new(2);
        let (a, b, c) = (
            SessionTable::key(None, "s1"),
            SessionTable::key(Some("t"), "s1"),
            SessionTable::key(None, "s3"),
        );
        assert_ne!(a, b);
        t.set(a, e(1));
        t.set(b, e(2));
        t.set(c, e(3));
        assert_eq!(t.len(), 2);
        assert_eq!(t.get(a), None, "least recently used evicted");
        assert_eq!(t.get(b), Some(e(2)));
        t.remove_endpoint(&e(2));
        assert_eq!(t.get(b), None);
        assert_eq!(t.get(c), Some(e(3)));
    }

    #[test]
    fn the_horizon_is_the_90th_percentile_of_the_gaps_and_follows_the_workload() {
        let mut h = ReuseHorizon::default();
        assert_eq!(h.horizon_ms(), ReuseHorizon::DEFAULT_MS, "nothing seen yet");
        // 90 gaps of about 2 s and 10 of about 40 s: the 90th percentile is in 2 s's bucket
        for _ in 0..90 {
            h.observe(2_000);
        }
        for _ in 0..10 {
            h.observe(40_000);
        }
        assert_eq!(h.horizon_ms(), 2_047, "[1024, 2048) ms");
        // the workload changes to 40 s gaps: the old ones fade
        for _ in 0..(3 * ReuseHorizon::HALF_LIFE) {
            h.observe(40_000);
        }
        assert_eq!(h.horizon_ms(), 65_535, "[32768, 65536) ms");
    }

    #[test]
    fn working_sets_count_the_live_sessions_of_each_endpoint() {
        let e = |n| EndpointId::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, n)), 1, 0);
        let mut t = SessionTable::new(16);
        let k = |s: &str| SessionTable::key(None, s);
        t.served(k("a"), e(1), 1_000, 1_000);
        t.served(k("b"), e(1), 3_000, 2_000);
        t.served(k("c"), e(2), 5_000, 3_000);
        // the default horizon (60 s): all live
        let ws = t.working_sets(10_000);
        assert_eq!((ws.get(&e(1)), ws.get(&e(2))), (Some(&4_000), Some(&5_000)));
        // a's next turn moves it to e2 with a longer context
        t.served(k("a"), e(2), 1_500, 20_000);
        let ws = t.working_sets(20_000);
        assert_eq!((ws.get(&e(1)), ws.get(&e(2))), (Some(&3_000), Some(&6_500)));
        // past the horizon since its last turn, a session is no longer in a working set
        let ws = t.working_sets(63_001);
        assert_eq!((ws.get(&e(1)), ws.get(&e(2))), (None, Some(&1_500)));
        // an endpoint that leaves takes its sessions with it
        t.remove_endpoint(&e(2));
        assert!(t.working_sets(20_000).get(&e(2)).is_none());
    }
}
