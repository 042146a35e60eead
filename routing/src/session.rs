//! Session affinity: which endpoint (and rank) a session's blocks live on.

use std::collections::VecDeque;

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
    /// Counted in its endpoint's live working set (served within the reuse horizon).
    pub live: bool,
    /// Its turn's prompt was larger than its endpoint's KV capacity: `tokens` is that
    /// capacity, and the session is left out of the mean ([`SessionTable::mean_live`]).
    pub oversized: bool,
}

/// A turn one picker replica served, as it tells the pool's other replicas (`peers`): a
/// session live at one replica is live at all of them, so session admission counts it and a
/// next turn that reaches another replica is pinned where its context is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedTurn {
    /// The session's key ([`SessionTable::key`]).
    pub key: u64,
    pub endpoint: EndpointId,
    /// Its prompt's tokens (at most its engine's cache).
    pub tokens: u64,
    /// How long before it was sent the turn was served, ms.
    pub age_ms: u64,
}

/// What one replica tells the others of its sessions at each exchange.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SessionNews {
    /// The turns it served since its last exchange.
    pub turns: Vec<SharedTurn>,
    /// Tokens its session admission reserved for turns admitted and not yet served.
    pub reserved: u64,
    /// How long the first turn in its admission line has waited, ms, when one waits.
    pub first_waiting_ms: Option<u64>,
}

/// Served turns waiting to be sent to the peers, oldest first; at most
/// [`SharedTurns::MAX`] (the oldest dropped beyond: a peer then learns the session at its next
/// turn).
#[derive(Debug, Default)]
pub struct SharedTurns {
    turns: VecDeque<(u64, EndpointId, u64, u64)>,
}

impl SharedTurns {
    pub const MAX: usize = 4_096;

    /// Session `key` was served on `endpoint` with `tokens` at `now_ms`.
    pub fn push(&mut self, key: u64, endpoint: EndpointId, tokens: u64, now_ms: u64) {
        if self.turns.len() >= Self::MAX {
            self.turns.pop_front();
        }
        self.turns.push_back((key, endpoint, tokens, now_ms));
    }

    /// The turns collected since the last call, aged at `now_ms`.
    pub fn take(&mut self, now_ms: u64) -> Vec<SharedTurn> {
        self.turns
            .drain(..)
            .map(|(key, endpoint, tokens, at)| SharedTurn {
                key,
                endpoint,
                tokens,
                age_ms: now_ms.saturating_sub(at),
            })
            .collect()
    }
}

/// A bounded LRU from session to endpoint. Keys are hashes of `(tenant, session)` so that two
/// tenants using the same session id never share an entry, and so that memory per entry does
/// not depend on what clients send. It also learns how long a session's context stays wanted
/// ([`ReuseHorizon`], from the gaps between a session's turns), which makes each endpoint's
/// working set ([`SessionTable::live`]): the prompt tokens of the sessions pinned there whose
/// last turn is within the horizon, what its cache must hold for their next turns to hit.
///
/// The working sets are kept as running sums, so a decision reads them without a pass over the
/// table: a served turn adds its tokens to its endpoint's sum (and takes its session's previous
/// turn out of its sum), and [`SessionTable::expire`] takes out the turns that passed the
/// horizon, oldest first, from a queue of served turns. A horizon that grows does not bring
/// back turns already expired; one that shrinks expires more at the next call.
#[derive(Debug)]
pub struct SessionTable {
    map: LruCache<u64, SessionPin, FxBuildHasher>,
    horizon: ReuseHorizon,
    /// A fixed horizon in place of the learned one (`None`: learned).
    fixed_horizon_ms: Option<u64>,
    /// Live prompt tokens per endpoint.
    live: hashbrown::HashMap<EndpointId, u64>,
    /// Sessions counted in `live`.
    live_sessions: usize,
    /// Of those, the oversized ones and their tokens.
    oversized_sessions: usize,
    oversized_tokens: u64,
    /// Served turns, oldest first: `(served_ms, key)`; at most four per remembered session.
    turns: VecDeque<(u64, u64)>,
}

impl SessionTable {
    /// `capacity` sessions at most (least recently used forgotten first); at least 1.
    pub fn new(capacity: usize) -> Self {
        Self {
            map: LruCache::with_hasher(capacity.max(1), FxBuildHasher),
            horizon: ReuseHorizon::default(),
            fixed_horizon_ms: None,
            live: hashbrown::HashMap::new(),
            live_sessions: 0,
            oversized_sessions: 0,
            oversized_tokens: 0,
            turns: VecDeque::new(),
        }
    }

    /// The same with the reuse horizon fixed at `horizon_ms` instead of learned.
    pub fn with_horizon(capacity: usize, horizon_ms: Option<u64>) -> Self {
        Self {
            fixed_horizon_ms: horizon_ms,
            ..Self::new(capacity)
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

    /// The endpoint `key` is pinned to, without touching its place in the LRU order.
    pub fn peek(&self, key: u64) -> Option<EndpointId> {
        self.map.peek(&key).map(|p| p.endpoint)
    }

    /// Insert `pin` under `key`, taking the pin it replaces, or the one the LRU bound
    /// forgets, out of the live sums.
    fn insert(&mut self, key: u64, pin: SessionPin) {
        if !self.map.contains_key(&key)
            && self.map.len() >= self.map.capacity()
            && let Some((_, old)) = self.map.remove_lru()
        {
            self.unlive(&old);
        }
        if pin.live {
            *self.live.entry(pin.endpoint).or_insert(0) += pin.tokens;
            self.live_sessions += 1;
            if pin.oversized {
                self.oversized_sessions += 1;
                self.oversized_tokens += pin.tokens;
            }
        }
        if let Some(old) = self.map.insert(key, pin) {
            self.unlive(&old);
        }
    }

    fn unlive(&mut self, pin: &SessionPin) {
        if pin.live {
            self.live_sub(pin);
        }
    }

    /// `endpoint` served a turn of session `key` with a prompt of `tokens` at `now_ms`: the
    /// session is pinned there, and the gap since its previous turn teaches the horizon.
    pub fn served(&mut self, key: u64, endpoint: EndpointId, tokens: u64, now_ms: u64) {
        self.served_within(key, endpoint, tokens, u64::MAX, now_ms);
    }

    /// [`SessionTable::served`] on an endpoint whose KV cache holds `cap` tokens: a session
    /// counts for at most that (its engine cannot keep more of it), and one that reaches it is
    /// oversized, left out of the mean a new session is expected to grow to.
    pub fn served_within(
        &mut self,
        key: u64,
        endpoint: EndpointId,
        tokens: u64,
        cap: u64,
        now_ms: u64,
    ) {
        let oversized = tokens > cap;
        let tokens = tokens.min(cap);
        if let Some(prev) = self.map.peek(&key)
            && prev.served_ms > 0
            && now_ms >= prev.served_ms
        {
            self.horizon.observe(now_ms - prev.served_ms);
        }
        self.insert(
            key,
            SessionPin {
                endpoint,
                tokens,
                served_ms: now_ms,
                live: tokens > 0,
                oversized,
            },
        );
        if tokens > 0 {
            // superseded turns stay queued until they age out; at the bound they are dropped
            // (what remains is one turn per live pin, at most the table's capacity)
            if self.turns.len() >= 4 * self.map.capacity() {
                let map = &self.map;
                self.turns.retain(|(served, k)| {
                    map.peek(k)
                        .is_some_and(|p| p.live && p.served_ms == *served)
                });
            }
            self.turns.push_back((now_ms, key));
        }
        self.expire(now_ms);
    }

    /// Take the turns served more than the horizon before `now_ms` out of the live sums.
    pub fn expire(&mut self, now_ms: u64) {
        let horizon = self.horizon_ms();
        while let Some(&(served, _)) = self.turns.front() {
            if now_ms.saturating_sub(served) <= horizon {
                break;
            }
            self.expire_front();
        }
    }

    fn expire_front(&mut self) {
        let Some((served, key)) = self.turns.pop_front() else {
            return;
        };
        if let Some(pin) = self.map.peek_mut(&key)
            && pin.live
            && pin.served_ms == served
        {
            pin.live = false;
            let pin = *pin;
            self.live_sub(&pin);
        }
    }

    fn live_sub(&mut self, pin: &SessionPin) {
        self.live_sessions = self.live_sessions.saturating_sub(1);
        if pin.oversized {
            self.oversized_sessions = self.oversized_sessions.saturating_sub(1);
            self.oversized_tokens = self.oversized_tokens.saturating_sub(pin.tokens);
        }
        if let Some(sum) = self.live.get_mut(&pin.endpoint) {
            *sum = sum.saturating_sub(pin.tokens);
            if *sum == 0 {
                self.live.remove(&pin.endpoint);
            }
        }
    }

    /// The live working set of each endpoint as of the last [`SessionTable::served`] or
    /// [`SessionTable::expire`].
    pub fn live(&self) -> &hashbrown::HashMap<EndpointId, u64> {
        &self.live
    }

    /// Sessions with live context.
    pub fn live_sessions(&self) -> usize {
        self.live_sessions
    }

    /// The mean live context of a session, the oversized ones left out (one session larger
    /// than its engine's cache must not make every new session look as large); 0 without
    /// such sessions.
    pub fn mean_live(&self) -> u64 {
        let sessions = self.live_sessions.saturating_sub(self.oversized_sessions);
        if sessions == 0 {
            return 0;
        }
        let total: u64 = self.live.values().sum();
        total.saturating_sub(self.oversized_tokens) / sessions as u64
    }

    /// When the oldest live turn passes the horizon (the working sets shrink then), if any
    /// turn is queued.
    pub fn next_expiry_ms(&self) -> Option<u64> {
        self.turns
            .front()
            .map(|(served, _)| served.saturating_add(self.horizon_ms()).saturating_add(1))
    }

    /// The pin of session `key`, without touching its place in the LRU order.
    pub fn pin(&self, key: u64) -> Option<SessionPin> {
        self.map.peek(&key).copied()
    }

    /// The horizon past which a session's context is taken to be no longer wanted.
    pub fn horizon_ms(&self) -> u64 {
        self.fixed_horizon_ms
            .unwrap_or_else(|| self.horizon.horizon_ms())
    }

    /// Each endpoint's working set at `now_ms` counted in one pass over the table: the
    /// reference the running sums ([`SessionTable::live`]) are tested against.
    #[cfg(test)]
    fn working_sets(&self, now_ms: u64) -> hashbrown::HashMap<EndpointId, u64> {
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
            if let Some(old) = self.map.remove(&k) {
                self.unlive(&old);
            }
        }
        debug_assert!(!self.live.contains_key(endpoint), "its pins left its sum");
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
        t.served(a, e(1), 0, 0);
        t.served(b, e(2), 0, 0);
        t.served(c, e(3), 0, 0);
        assert_eq!(t.len(), 2);
        assert_eq!(t.peek(a), None, "least recently used evicted");
        assert_eq!(t.peek(b), Some(e(2)));
        t.remove_endpoint(&e(2));
        assert_eq!(t.peek(b), None);
        assert_eq!(t.peek(c), Some(e(3)));
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

    proptest::proptest! {
        /// The running sums against a pass over the table (the reference), through turns,
        /// unsized pins, the LRU bound, departing endpoints and time passing the horizon.
        #[test]
        fn live_sums_match_the_reference(
            ops in proptest::collection::vec((0u8..4, 0u64..12, 0u8..4, 0u64..5_000, 0u64..3_000), 1..300),
        ) {
            let e = |n| EndpointId::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, n)), 1, 0);
            let mut t = SessionTable::with_horizon(6, Some(5_000));
            let mut now = 0;
            for (op, session, endpoint, tokens, dt) in ops {
                now += dt;
                match op {
                    0 | 1 => t.served(session, e(endpoint), tokens, now),
                    2 => t.served(session, e(endpoint), 0, now),
                    _ => t.remove_endpoint(&e(endpoint)),
                }
                t.expire(now);
                let reference = t.working_sets(now);
                let live: hashbrown::HashMap<EndpointId, u64> =
                    t.live().iter().map(|(k, v)| (*k, *v)).collect();
                proptest::prop_assert_eq!(&live, &reference);
                let sessions = t.map.iter().filter(|(_, p)| p.tokens > 0 && now - p.served_ms <= 5_000).count();
                proptest::prop_assert_eq!(t.live_sessions(), sessions);
                proptest::prop_assert!(t.turns.len() <= 4 * 6);
            }
        }
    }
}
