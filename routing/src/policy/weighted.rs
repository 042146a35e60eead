//! `Weighted`: normalized scorers times weights, the highest sum wins (the Gateway API
//! Inference Extension's scheduling profile: prefix 3, queue 2, KV utilization 2 by default).

use super::{Candidate, Policy, RequestFacts, lower_is_better};
use crate::config::Weights;

#[derive(Debug, Clone)]
pub struct Weighted {
    w: Weights,
}

impl Weighted {
    pub fn new(w: Weights) -> Self {
        Self { w }
    }
}

fn min_max(it: impl Iterator<Item = f64>) -> (f64, f64) {
    it.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    })
}

impl Policy for Weighted {
    fn name(&self) -> &'static str {
        "weighted"
    }

    fn score(&self, req: &RequestFacts, cands: &[Candidate], scores: &mut [f64]) {
        let (qmin, qmax) = min_max(cands.iter().map(|c| c.features.queue()));
        let (imin, imax) = min_max(cands.iter().map(|c| c.features.inflight_requests as f64));
        let total = self.w.prefix_cache
            + self.w.queue
            + self.w.kv_utilization
            + self.w.inflight
            + self.w.session_affinity;
        let total = if total > 0.0 { total } else { 1.0 };
        for (c, s) in cands.iter().zip(scores.iter_mut()) {
            let f = &c.features;
            let prefix = if req.prompt_blocks == 0 {
                0.0
            } else {
                f.credited_blocks() / f64::from(req.prompt_blocks)
            };
            let queue = lower_is_better(f.queue(), qmin, qmax);
            let kv = 1.0 - f.kv_usage.clamp(0.0, 1.0);
            let inflight = lower_is_better(f.inflight_requests as f64, imin, imax);
            let session = if f.session_affinity { 1.0 } else { 0.0 };
            *s = (self.w.prefix_cache * prefix
                + self.w.queue * queue
                + self.w.kv_utilization * kv
                + self.w.inflight * inflight
                + self.w.session_affinity * session)
                / total;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::*;

    #[test]
    fn prefix_outweighs_a_slightly_longer_queue() {
        let p = Weighted::new(Weights::default());
        let r = req(4096);
        let cands = [
            cand(1, feat(4096, 0, 0.0, 1.0)),
            cand(2, feat(4096, 250, 1.0, 1.0)),
        ];
        assert_eq!(pick(&p, &r, &cands), ep(2));
    }

    #[test]
    fn scores_are_normalized_to_unit_range() {
        let p = Weighted::new(Weights::default());
        let r = req(1600);
        let mut a = feat(1600, 100, 0.0, 0.0);
        a.kv_usage = 0.0;
        let mut b = feat(1600, 0, 9.0, 0.0);
        b.kv_usage = 1.0;
        let cands = [cand(1, a), cand(2, b)];
        let mut s = [0.0; 2];
        p.score(&r, &cands, &mut s);
        assert!((s[0] - 1.0).abs() < 1e-12 && s[1].abs() < 1e-12, "{s:?}");
    }

    #[test]
    fn queue_weight_alone_picks_the_shortest_queue() {
        let w = Weights {
            prefix_cache: 0.0,
            queue: 1.0,
            kv_utilization: 0.0,
            inflight: 0.0,
            session_affinity: 0.0,
        };
        let p = Weighted::new(w);
        let r = req(1600);
        let cands = [
            cand(1, feat(1600, 100, 5.0, 0.0)),
            cand(2, feat(1600, 0, 1.0, 0.0)),
        ];
        assert_eq!(pick(&p, &r, &cands), ep(2));
    }
}
