//! `KvCost`, after Dynamo's KV router: cost = `overlap_weight × prefill blocks + decode
//! blocks`, where prefill blocks are the request's uncached blocks plus the prefill already
//! queued on the endpoint, and decode blocks are the KV blocks its running requests occupy.
//! With temperature 0 the minimum wins; otherwise candidates are sampled with probability
//! `softmax(-normalized cost / temperature)`, seeded by the request so replicas agree.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::{Candidate, Policy, RequestFacts, best_index};

#[derive(Debug, Clone)]
pub struct KvCost {
    overlap_weight: f64,
    temperature: f64,
}

impl KvCost {
    pub fn new(overlap_weight: f64, temperature: f64) -> Self {
        Self {
            overlap_weight,
            temperature,
        }
    }
}

impl Policy for KvCost {
    fn name(&self) -> &'static str {
        "kv-cost"
    }

    fn score(&self, req: &RequestFacts, cands: &[Candidate], scores: &mut [f64]) {
        let bs = f64::from(req.block_size.max(1));
        for (c, s) in cands.iter().zip(scores.iter_mut()) {
            let f = &c.features;
            let new_blocks = (f64::from(req.prompt_blocks) - f.credited_blocks()).max(0.0);
            let prefill = new_blocks + f.pending_tokens as f64 / bs;
            let decode = match f.kv_capacity_blocks {
                Some(cap) => f.kv_usage.clamp(0.0, 1.0) * cap as f64,
                None => f.inflight_tokens as f64 / bs,
            };
            *s = -(self.overlap_weight * prefill + decode);
        }
    }

    fn choose(&self, req: &RequestFacts, cands: &[Candidate], scores: &[f64]) -> usize {
        if self.temperature <= 0.0 || cands.len() < 2 {
            return best_index(req, cands, scores);
        }
        let (lo, hi) = scores
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &v| {
                (a.min(v), b.max(v))
            });
        let span = if hi - lo > f64::EPSILON { hi - lo } else { 1.0 };
        // scores are negated costs: the best has normalized cost 0
        let weights: Vec<f64> = scores
            .iter()
            .map(|&s| (-((hi - s) / span) / self.temperature).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        let u =
            (xxh3_64_with_seed(b"kv-cost", req.request_hash) >> 11) as f64 / (1u64 << 53) as f64;
        let mut acc = 0.0;
        for (i, w) in weights.iter().enumerate() {
            acc += w / total;
            if u < acc {
                return i;
            }
        }
        cands.len() - 1
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::*;

    #[test]
    fn zero_temperature_takes_the_minimum_cost() {
        let p = KvCost::new(1.0, 0.0);
        let r = req(1600);
        let cands = [
            cand(1, feat(1600, 0, 0.0, 0.0)),
            cand(2, feat(1600, 90, 0.0, 0.0)),
        ];
        assert_eq!(pick(&p, &r, &cands), ep(2));
    }

    #[test]
    fn temperature_spreads_choices_deterministically() {
        let p = KvCost::new(1.0, 1.0);
        let cands = [
            cand(1, feat(1600, 0, 0.0, 0.0)),
            cand(2, feat(1600, 50, 0.0, 0.0)),
        ];
        let mut counts = [0; 2];
        for h in 0..400 {
            let r = RequestFacts {
                request_hash: h,
                ..req(1600)
            };
            let mut s = [0.0; 2];
            p.score(&r, &cands, &mut s);
            let i = p.choose(&r, &cands, &s);
            assert_eq!(i, p.choose(&r, &cands, &s), "same request, same choice");
            counts[i] += 1;
        }
        // softmax(0, -1) ≈ 0.73 / 0.27 in favour of the cheaper endpoint
        assert!(counts[1] > 230 && counts[0] > 60, "{counts:?}");
    }
}
