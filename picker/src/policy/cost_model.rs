//! `CostModel`: estimated time-to-first-token, minimum wins.
//!
//! A request's first token comes after the engine has prefilled the work queued ahead of it and
//! then its own uncached tokens. Prefill runs in chunks of at most `max_batched_tokens` per
//! engine step, and every step also advances the running requests' decode, which costs more as
//! the KV cache fills. So:
//!
//! `ttft ≈ prefill(queued + uncached) + steps × decode_step(kv_usage)` (decode only when
//! something is running), with `steps = ⌈(queued + uncached) / max_batched_tokens⌉`.
//!
//! `queued` is this picker's pending prefill tokens on the endpoint, or the engine's waiting
//! count times an assumed size, whichever is larger. This is exactly the trade-off the router
//! exists for: a long cached prefix shrinks `uncached`, a deep queue grows `queued`.

use super::{Candidate, Policy, RequestFacts};
use crate::config::CostModelCalibration;

/// Prefill time in ms of `tokens` tokens, chunked by the engine's per-step budget.
pub fn prefill_ms(cal: &CostModelCalibration, tokens: f64) -> f64 {
    if tokens <= 0.0 {
        return 0.0;
    }
    let chunk = f64::from(cal.max_batched_tokens.max(1));
    let f = |t: f64| {
        cal.prefill_quadratic_ms * t * t + cal.prefill_linear_ms * t + cal.prefill_constant_ms
    };
    let full = (tokens / chunk).floor();
    let rem = tokens - full * chunk;
    full * f(chunk) + if rem > 0.0 { f(rem) } else { 0.0 }
}

/// Decode step time in ms at KV usage `u` in [0, 1] (floor 1 ms).
pub fn decode_step_ms(cal: &CostModelCalibration, u: f64) -> f64 {
    let u = u.clamp(0.0, 1.0);
    (cal.decode_base_ms + cal.decode_linear_ms * u + cal.decode_quadratic_ms * u * u).max(1.0)
}

/// Estimated TTFT in ms of a request with `uncached` tokens to prefill on an endpoint with
/// the given features.
pub fn estimated_ttft_ms(cal: &CostModelCalibration, f: &super::Features) -> f64 {
    let assumed = f.waiting * f64::from(cal.assumed_waiting_tokens);
    let queued = (f.pending_tokens as f64).max(assumed);
    let work = queued + f64::from(f.uncached_tokens);
    let steps = (work / f64::from(cal.max_batched_tokens.max(1))).ceil();
    let decoding = f.running > 0.0 || f.inflight_requests > f.pending_requests;
    let decode = if decoding {
        steps * decode_step_ms(cal, f.kv_usage)
    } else {
        0.0
    };
    prefill_ms(cal, work) + decode
}

#[derive(Debug, Clone)]
pub struct CostModel {
    cal: CostModelCalibration,
}

impl CostModel {
    pub fn new(cal: CostModelCalibration) -> Self {
        Self { cal }
    }
}

impl Policy for CostModel {
    fn name(&self) -> &'static str {
        "cost-model"
    }

    fn score(&self, _req: &RequestFacts, cands: &[Candidate], scores: &mut [f64]) {
        for (c, s) in cands.iter().zip(scores.iter_mut()) {
            // the greedy TTFT, plus the recomputation's cost to everyone else (locality has a
            // future value: see `CostModelCalibration::recompute_weight`)
            let recompute = prefill_ms(&self.cal, f64::from(c.features.uncached_tokens));
            *s = -(estimated_ttft_ms(&self.cal, &c.features)
                + self.cal.recompute_weight * recompute);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::*;

    #[test]
    fn prefill_follows_the_calibration_and_chunks() {
        let cal = CostModelCalibration::default();
        assert_eq!(prefill_ms(&cal, 0.0), 0.0);
        let one = prefill_ms(&cal, 1000.0);
        assert!((one - (4.21e-7 * 1e6 + 15.2 + 16.5)).abs() < 1e-9);
        // two full chunks cost twice one chunk
        let c = f64::from(cal.max_batched_tokens);
        assert!((prefill_ms(&cal, 2.0 * c) - 2.0 * prefill_ms(&cal, c)).abs() < 1e-9);
    }

    #[test]
    fn long_cached_prefix_on_lightly_loaded_endpoint_wins() {
        let p = CostModel::new(CostModelCalibration::default());
        let r = req(8192);
        let cands = [
            cand(1, feat(8192, 0, 0.0, 0.0)),   // idle, cold
            cand(2, feat(8192, 480, 1.0, 2.0)), // 7680 of 8192 cached, light load
        ];
        assert_eq!(pick(&p, &r, &cands), ep(2));
    }

    #[test]
    fn recompute_weight_keeps_a_request_on_its_prefix_against_a_somewhat_shorter_wait() {
        let r = req(8192);
        // endpoint 1: idle and cold (ttft ≈ 169 ms, all of it recomputation: score ≈ 9 × 169);
        // endpoint 2: 7680 of 8192 tokens cached, behind 12000 queued tokens (ttft ≈ 270 ms,
        // 512 tokens recomputed: score ≈ 270 + 8 × 24)
        let mut warm = feat(8192, 480, 1.0, 2.0);
        warm.pending_tokens = 12_000;
        warm.pending_requests = 1;
        let cands = [cand(1, feat(8192, 0, 0.0, 0.0)), cand(2, warm)];
        let greedy = CostModel::new(CostModelCalibration {
            recompute_weight: 0.0,
            ..CostModelCalibration::default()
        });
        assert_eq!(pick(&greedy, &r, &cands), ep(1), "greedy: the shorter TTFT");
        let valued = CostModel::new(CostModelCalibration::default());
        assert_eq!(
            pick(&valued, &r, &cands),
            ep(2),
            "valued: 8k tokens of work saved"
        );
        // a much deeper queue (12 engine steps of prefill) still loses
        let mut deep = warm;
        deep.pending_tokens = 100_000;
        let cands = [cand(1, feat(8192, 0, 0.0, 0.0)), cand(2, deep)];
        assert_eq!(pick(&valued, &r, &cands), ep(1));
    }

    #[test]
    fn deep_queue_loses_to_cold_idle_endpoint() {
        let p = CostModel::new(CostModelCalibration::default());
        let r = req(2048);
        let mut hot = feat(2048, 120, 12.0, 20.0); // almost all cached, but 12 waiting
        hot.pending_tokens = 40_000;
        let cands = [cand(1, feat(2048, 0, 0.0, 0.0)), cand(2, hot)];
        assert_eq!(pick(&p, &r, &cands), ep(1));
        // and with a short queue the cached endpoint wins again
        let mut warm = feat(2048, 120, 0.0, 2.0);
        warm.pending_tokens = 100;
        let cands = [cand(1, feat(2048, 0, 0.0, 0.0)), cand(2, warm)];
        assert_eq!(pick(&p, &r, &cands), ep(2));
    }
}
