//! `CacheAware`, after SGLang's router: if load is imbalanced (the most loaded candidate
//! exceeds the least loaded by more than `absolute` and by more than `relative` times), go to
//! the least loaded; otherwise take the best prefix match when it covers at least the match
//! threshold of the prompt; otherwise the candidate with the fewest cached blocks (the most
//! room to cache this new prefix).

use super::{Candidate, Policy, RequestFacts};
use crate::config::{Balance, CacheAwareSettings};

#[derive(Debug, Clone)]
pub struct CacheAware {
    balance: Balance,
    settings: CacheAwareSettings,
}

impl CacheAware {
    pub fn new(balance: Balance, settings: CacheAwareSettings) -> Self {
        Self { balance, settings }
    }
}

impl Policy for CacheAware {
    fn name(&self) -> &'static str {
        "cache-aware"
    }

    fn uses_balance_guard(&self) -> bool {
        false // it applies its own, SGLang's way
    }

    fn score(&self, req: &RequestFacts, cands: &[Candidate], scores: &mut [f64]) {
        let loads = cands.iter().map(|c| c.features.load());
        let (lo, hi) = loads.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
            (a.min(v), b.max(v))
        });
        let imbalanced =
            hi - lo > f64::from(self.balance.absolute) && hi > self.balance.relative * lo;
        let ratio = |c: &Candidate| {
            if req.prompt_blocks == 0 {
                0.0
            } else {
                c.features.credited_blocks() / f64::from(req.prompt_blocks)
            }
        };
        let best_ratio = cands.iter().map(ratio).fold(0.0, f64::max);
        for (c, s) in cands.iter().zip(scores.iter_mut()) {
            // load breaks ties in every branch; it stays below 1 so it never overrides one
            let load_tiebreak = 1.0 / (2.0 + c.features.load());
            *s = if imbalanced {
                -c.features.load()
            } else if best_ratio >= self.settings.match_threshold && best_ratio > 0.0 {
                ratio(c) * 1e6 + load_tiebreak
            } else {
                -(c.features.indexed_blocks as f64) + load_tiebreak
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::*;

    fn policy() -> CacheAware {
        CacheAware::new(
            Balance {
                absolute: 4,
                relative: 1.5,
            },
            CacheAwareSettings {
                match_threshold: 0.5,
            },
        )
    }

    #[test]
    fn good_match_wins_when_balanced() {
        let r = req(1600);
        let cands = [
            cand(1, feat(1600, 0, 0.0, 0.0)),
            cand(2, feat(1600, 60, 2.0, 0.0)),
        ];
        assert_eq!(pick(&policy(), &r, &cands), ep(2));
    }

    #[test]
    fn weak_match_goes_to_emptiest_cache() {
        let r = req(1600);
        let mut a = feat(1600, 10, 0.0, 0.0);
        a.indexed_blocks = 5000;
        let mut b = feat(1600, 0, 0.0, 0.0);
        b.indexed_blocks = 10;
        assert_eq!(pick(&policy(), &r, &[cand(1, a), cand(2, b)]), ep(2));
    }

    #[test]
    fn imbalance_overrides_the_match() {
        let r = req(1600);
        let cands = [
            cand(1, feat(1600, 100, 10.0, 0.0)),
            cand(2, feat(1600, 0, 1.0, 0.0)),
        ];
        assert_eq!(pick(&policy(), &r, &cands), ep(2));
    }
}
