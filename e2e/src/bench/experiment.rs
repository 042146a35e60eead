//! Experimental routing policies, evaluated offline before they are proposed for the picker.
//!
//! Selected with `--policies cost-model-future` (weight from `--future-weight`). Not part of
//! the picker: a policy that wins here is then implemented in `kvroute_picker::policy`.

use kvroute_picker::config::CostModelCalibration;
use kvroute_picker::policy::{Candidate, Policy, RequestFacts, estimated_ttft_ms, prefill_ms};

/// The cost model plus the value of locality: a candidate's score is its estimated TTFT plus
/// `weight ×` the prefill time of the tokens it would recompute. The greedy TTFT estimate
/// counts a recomputation once, as this request's latency; but the recomputation also takes
/// engine time from every request queued behind it and puts a second copy of the prefix in
/// the cache, evicting other prefixes. Charging the work itself makes the router keep
/// sessions where their prefix lives unless the queue there is worth more than the work.
#[derive(Debug, Clone)]
pub struct FutureCost {
    pub cal: CostModelCalibration,
    pub weight: f64,
}

impl Policy for FutureCost {
    fn name(&self) -> &'static str {
        "cost-model-future"
    }

    fn score(&self, _req: &RequestFacts, cands: &[Candidate], scores: &mut [f64]) {
        for (c, s) in cands.iter().zip(scores.iter_mut()) {
            let own = prefill_ms(&self.cal, f64::from(c.features.uncached_tokens));
            *s = -(estimated_ttft_ms(&self.cal, &c.features) + self.weight * own);
        }
    }
}
