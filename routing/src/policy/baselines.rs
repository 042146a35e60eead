//! Load-only baselines: `LeastLoad`, `RoundRobin`, `Random`.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{Candidate, Policy, RequestFacts};

/// The endpoint with the fewest requests; ties to the fewest in-flight prompt tokens.
#[derive(Debug, Clone, Copy, Default)]
pub struct LeastLoad;

impl Policy for LeastLoad {
    fn name(&self) -> &'static str {
        "least-load"
    }

    fn uses_balance_guard(&self) -> bool {
        false
    }

    fn places_by_cache(&self) -> bool {
        false
    }

    fn score(&self, _req: &RequestFacts, cands: &[Candidate], scores: &mut [f64]) {
        for (c, s) in cands.iter().zip(scores.iter_mut()) {
            // tokens break ties between equal request counts without outweighing a request
            let tokens = c.features.inflight_tokens as f64;
            *s = -(c.features.load() + tokens / (tokens + 1e9));
        }
    }
}

/// Candidates in turn: the pool's turn count modulo the candidates.
#[derive(Debug, Clone, Copy, Default)]
pub struct RoundRobin;

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round-robin"
    }

    fn uses_balance_guard(&self) -> bool {
        false
    }

    fn places_by_cache(&self) -> bool {
        false
    }

    fn score(&self, req: &RequestFacts, cands: &[Candidate], scores: &mut [f64]) {
        let n = cands.len() as u64;
        if n == 0 {
            return;
        }
        let pos = req.turn % n;
        for (i, s) in scores.iter_mut().enumerate() {
            *s = -(((i as u64 + n - pos) % n) as f64);
        }
    }
}

/// Uniformly random, from a seeded generator (reproducible runs): turn `t` draws from stream
/// `t` of the seed's ChaCha8 generator.
#[derive(Debug, Clone, Copy)]
pub struct RandomPolicy {
    seed: u64,
}

impl RandomPolicy {
    pub fn new(seed: u64) -> Self {
        Self { seed }
    }
}

impl Policy for RandomPolicy {
    fn name(&self) -> &'static str {
        "random"
    }

    fn uses_balance_guard(&self) -> bool {
        false
    }

    fn places_by_cache(&self) -> bool {
        false
    }

    fn score(&self, req: &RequestFacts, _cands: &[Candidate], scores: &mut [f64]) {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        rng.set_stream(req.turn);
        for s in scores.iter_mut() {
            *s = rng.random::<f64>();
        }
    }
}

/// Consistent hashing of the session: the endpoint with the highest rendezvous hash of (the
/// session key, or the request's hash without one, and the endpoint).
#[derive(Debug, Clone, Copy, Default)]
pub struct SessionHash;

impl Policy for SessionHash {
    fn name(&self) -> &'static str {
        "session-hash"
    }

    fn uses_balance_guard(&self) -> bool {
        false
    }

    fn places_by_cache(&self) -> bool {
        false
    }

    fn score(&self, req: &RequestFacts, cands: &[Candidate], scores: &mut [f64]) {
        let key = req.session.unwrap_or(req.request_hash);
        for (c, s) in cands.iter().zip(scores.iter_mut()) {
            // 53 bits: exact in an f64, so the order is the hash's
            *s = (super::rendezvous(key, &c.endpoint) >> 11) as f64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::Features;
    use super::super::test_support::*;
    use super::*;

    #[test]
    fn least_load_ignores_the_cache() {
        let r = req(1600);
        let cands = [
            cand(1, feat(1600, 100, 3.0, 0.0)),
            cand(2, feat(1600, 0, 1.0, 0.0)),
        ];
        assert_eq!(pick(&LeastLoad, &r, &cands), ep(2));
    }

    #[test]
    fn least_load_sees_inflight_before_the_next_scrape() {
        let r = req(16);
        let busy = Features {
            inflight_requests: 4,
            ..Features::default()
        };
        let cands = [cand(1, busy), cand(2, Features::default())];
        assert_eq!(pick(&LeastLoad, &r, &cands), ep(2));
    }

    /// The request facts of the `turn`-th placement.
    fn turn(turn: u64) -> RequestFacts {
        RequestFacts { turn, ..req(16) }
    }

    #[test]
    fn round_robin_cycles() {
        let cands: Vec<_> = (1..=3).map(|n| cand(n, Features::default())).collect();
        let got: Vec<_> = (0..6)
            .map(|t| pick(&RoundRobin, &turn(t), &cands))
            .collect();
        assert_eq!(got, [ep(1), ep(2), ep(3), ep(1), ep(2), ep(3)]);
    }

    #[test]
    fn random_is_reproducible_from_its_seed_and_covers_all() {
        let cands: Vec<_> = (1..=4).map(|n| cand(n, Features::default())).collect();
        let run = |seed| {
            let p = RandomPolicy::new(seed);
            (0..40)
                .map(|t| pick(&p, &turn(t), &cands))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8), "the seed matters");
        let distinct: std::collections::BTreeSet<_> = run(7).into_iter().collect();
        assert_eq!(distinct.len(), 4);
        // a turn asked twice gets the same draw: asking changes nothing
        let p = RandomPolicy::new(7);
        assert_eq!(pick(&p, &turn(5), &cands), pick(&p, &turn(5), &cands));
    }

    #[test]
    fn session_hash_keeps_a_session_on_one_endpoint_and_moves_only_a_departed_ones() {
        let all: Vec<_> = (1..=4).map(|n| cand(n, Features::default())).collect();
        let session = |s: u64| RequestFacts {
            session: Some(s),
            ..req(16)
        };
        let placed: Vec<crate::endpoint::EndpointId> = (0..64)
            .map(|s| pick(&SessionHash, &session(s), &all))
            .collect();
        // every turn of a session lands where its first did, whatever the request
        for s in 0..64 {
            let other_turn = RequestFacts {
                request_hash: s * 7 + 1,
                ..session(s)
            };
            assert_eq!(pick(&SessionHash, &other_turn, &all), placed[s as usize]);
        }
        let used: std::collections::BTreeSet<_> = placed.iter().collect();
        assert_eq!(used.len(), 4, "sessions spread over every endpoint");
        // endpoint 2 leaves: only its sessions move
        let three: Vec<_> = all
            .iter()
            .copied()
            .filter(|c| c.endpoint != ep(2))
            .collect();
        for s in 0..64 {
            let now = pick(&SessionHash, &session(s), &three);
            if placed[s as usize] != ep(2) {
                assert_eq!(now, placed[s as usize], "session {s} moved");
            }
        }
    }
}
