//! Load-only baselines: `LeastLoad`, `RoundRobin`, `Random`.

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
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

/// Candidates in turn.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicU64,
}

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
        // an explanation shows the turn the next request would take, and takes none
        let pos = if req.advance {
            self.next.fetch_add(1, Ordering::Relaxed)
        } else {
            self.next.load(Ordering::Relaxed)
        } % n;
        for (i, s) in scores.iter_mut().enumerate() {
            *s = -(((i as u64 + n - pos) % n) as f64);
        }
    }
}

/// Uniformly random, from a seeded generator (reproducible runs).
#[derive(Debug)]
pub struct RandomPolicy {
    rng: Mutex<ChaCha8Rng>,
}

impl RandomPolicy {
    pub fn new(seed: u64) -> Self {
        Self {
            rng: Mutex::new(ChaCha8Rng::seed_from_u64(seed)),
        }
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
        let mut shared = self.rng.lock();
        // an explanation draws from a copy: the next request gets the same draws
        let mut copy;
        let rng = if req.advance {
            &mut *shared
        } else {
            copy = shared.clone();
            &mut copy
        };
        for s in scores.iter_mut() {
            *s = rng.random::<f64>();
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

    #[test]
    fn round_robin_cycles() {
        let p = RoundRobin::default();
        let r = req(16);
        let cands: Vec<_> = (1..=3).map(|n| cand(n, Features::default())).collect();
        let got: Vec<_> = (0..6).map(|_| pick(&p, &r, &cands)).collect();
        assert_eq!(got, [ep(1), ep(2), ep(3), ep(1), ep(2), ep(3)]);
    }

    #[test]
    fn random_is_reproducible_from_its_seed_and_covers_all() {
        let r = req(16);
        let cands: Vec<_> = (1..=4).map(|n| cand(n, Features::default())).collect();
        let run = |seed| {
            let p = RandomPolicy::new(seed);
            (0..40).map(|_| pick(&p, &r, &cands)).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        let distinct: std::collections::BTreeSet<_> = run(7).into_iter().collect();
        assert_eq!(distinct.len(), 4);
    }

    /// Explaining a decision (issue 31) shows what the next request would get and uses up
    /// neither round robin's turn nor the random generator's draws.
    #[test]
    fn an_explanation_advances_no_policy_state() {
        let cands: Vec<_> = (1..=3).map(|n| cand(n, Features::default())).collect();
        let forward = req(16);
        let explain = RequestFacts {
            advance: false,
            ..forward
        };
        let rr = RoundRobin::default();
        assert_eq!(pick(&rr, &forward, &cands), ep(1));
        for _ in 0..3 {
            assert_eq!(
                pick(&rr, &explain, &cands),
                ep(2),
                "the next turn, not taken"
            );
        }
        assert_eq!(pick(&rr, &forward, &cands), ep(2));
        let random = RandomPolicy::new(7);
        let reference = RandomPolicy::new(7);
        for _ in 0..10 {
            let shown = pick(&random, &explain, &cands);
            assert_eq!(pick(&random, &explain, &cands), shown);
            assert_eq!(pick(&random, &forward, &cands), shown);
            assert_eq!(
                pick(&reference, &forward, &cands),
                shown,
                "no draw was used up"
            );
        }
    }
}
