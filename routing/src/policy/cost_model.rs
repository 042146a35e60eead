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
//!
//! The constants are the configured calibration, unless the candidate's features carry values
//! learned for that endpoint ([`crate::calibration`]): then its prefill costs
//! `overheadMs × steps + msPerToken × tokens` in the prior's shape ([`prefill_regressors`])
//! and its decode steps the configured curve times the learned scale.

use super::{Candidate, Features, Policy, RequestFacts};
use crate::calibration::{LearnedCost, TtftBasis};
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

/// Engine steps and linear-token equivalents of prefilling `tokens`: `[steps, tokens']`, with
/// each chunk's quadratic term counted in units of the linear one
/// (`tokens' = Σ chunk + (prefillQuadraticMs / prefillLinearMs) · chunk²`). So the configured
/// prefill time is exactly `prefillConstantMs · steps + prefillLinearMs · tokens'`, and a
/// learned (overhead, ms per token) pair takes the place of those two constants, the
/// quadratic term scaling with the linear one. (With `prefillLinearMs` 0 the quadratic term is
/// not represented.)
pub fn prefill_regressors(cal: &CostModelCalibration, tokens: f64) -> [f64; 2] {
    if tokens.is_nan() || tokens <= 0.0 {
        return [0.0, 0.0];
    }
    let chunk = f64::from(cal.max_batched_tokens.max(1));
    let rho = if cal.prefill_linear_ms > 0.0 {
        cal.prefill_quadratic_ms / cal.prefill_linear_ms
    } else {
        0.0
    };
    let equivalent = |t: f64| t + rho * t * t;
    let full = (tokens / chunk).floor();
    let rem = tokens - full * chunk;
    if rem > 0.0 {
        [full + 1.0, full * equivalent(chunk) + equivalent(rem)]
    } else {
        [full, full * equivalent(chunk)]
    }
}

/// Prefill time in ms of `tokens` tokens with an endpoint's learned constants.
pub fn learned_prefill_ms(cal: &CostModelCalibration, learned: &LearnedCost, tokens: f64) -> f64 {
    let [steps, equivalent] = prefill_regressors(cal, tokens);
    learned.overhead_ms * steps + learned.prefill_ms_per_token * equivalent
}

/// Prefill time with the candidate's learned constants when it has them.
fn candidate_prefill_ms(cal: &CostModelCalibration, f: &Features, tokens: f64) -> f64 {
    match &f.learned {
        Some(l) => learned_prefill_ms(cal, l, tokens),
        None => prefill_ms(cal, tokens),
    }
}

/// Decode step time in ms at KV usage `u` in [0, 1] (floor 1 ms).
pub fn decode_step_ms(cal: &CostModelCalibration, u: f64) -> f64 {
    let u = u.clamp(0.0, 1.0);
    (cal.decode_base_ms + cal.decode_linear_ms * u + cal.decode_quadratic_ms * u * u).max(1.0)
}

/// The work a candidate's TTFT estimate rests on: the prefill tokens up to the request's first
/// token and the decode time the engine's steps spend meanwhile. It is also what the
/// calibration measures an observed TTFT against.
pub fn ttft_basis(cal: &CostModelCalibration, f: &Features) -> TtftBasis {
    let assumed = f.waiting * f64::from(cal.assumed_waiting_tokens);
    let queued = (f.pending_tokens as f64).max(assumed);
    let work = queued + f64::from(f.uncached_tokens);
    let steps = (work / f64::from(cal.max_batched_tokens.max(1))).ceil();
    let decoding = f.running > 0.0 || f.inflight_requests > f.pending_requests;
    let decode_ms = if decoding {
        let scale = f.learned.map_or(1.0, |l| l.decode_scale);
        steps * decode_step_ms(cal, f.kv_usage) * scale
    } else {
        0.0
    };
    TtftBasis {
        work_tokens: work,
        decode_ms,
    }
}

/// Estimated TTFT in ms of a request with `uncached` tokens to prefill on an endpoint with
/// the given features.
pub fn estimated_ttft_ms(cal: &CostModelCalibration, f: &Features) -> f64 {
    let basis = ttft_basis(cal, f);
    // a prefix held in a lower tier is loaded back, not prefilled; an adapter not loaded
    // there is loaded first
    candidate_prefill_ms(cal, f, basis.work_tokens)
        + basis.decode_ms
        + f.offload_load_ms
        + f.lora_penalty_ms
}

/// Tokens of other live sessions' context that placing `req` on the candidate evicts: what
/// its working set and the request's prompt hold beyond the engine's KV capacity, at most the
/// working set itself (0 when the capacity is not reported).
pub fn displaced_tokens(req: &RequestFacts, f: &Features) -> u64 {
    let Some(blocks) = f.kv_capacity_blocks else {
        return 0;
    };
    let capacity = blocks.saturating_mul(u64::from(req.block_size.max(1)));
    (f.working_set_tokens + u64::from(req.prompt_tokens))
        .saturating_sub(capacity)
        .min(f.working_set_tokens)
}

/// The share of a recomputed copy of the request's uncached tokens that evicts cached context
/// on the candidate: what the engine holds (the blocks the index attributes to it, or the KV
/// its running requests use if more, plus the prompts this picker sent there that have not
/// started) and the copy, over the KV capacity the engine reports, rounded up to 64ths; at
/// most 1, and 1 when the capacity is not reported. An engine with room for the copy, one that
/// is new or has served little, loses little to it. In 64ths, so that engines a few blocks
/// apart tie and the request's hash spreads cold requests over them, as without the share.
pub fn evicting_share(req: &RequestFacts, f: &Features) -> f64 {
    let Some(blocks) = f.kv_capacity_blocks.filter(|&b| b > 0) else {
        return 1.0;
    };
    let capacity = blocks.saturating_mul(u64::from(req.block_size.max(1))) as f64;
    let indexed = (f.indexed_blocks * u64::from(req.block_size.max(1))) as f64;
    let held = indexed.max(f.kv_usage.clamp(0.0, 1.0) * capacity) + f.pending_prompt_tokens as f64;
    (((held + f64::from(f.uncached_tokens)) / capacity * 64.0).ceil() / 64.0).clamp(0.0, 1.0)
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

    fn score(&self, req: &RequestFacts, cands: &[Candidate], scores: &mut [f64]) {
        for (c, s) in cands.iter().zip(scores.iter_mut()) {
            // the greedy TTFT, plus the recomputation's cost to everyone else (locality has a
            // future value: see `CostModelCalibration::recompute_weight`): its tokens in the
            // share of the copy that evicts someone's cache there, and in full the engine step
            // any placement that recomputes anything pays (so that it still cancels between
            // candidates whose shares differ)
            let uncached = f64::from(c.features.uncached_tokens);
            let recompute = candidate_prefill_ms(&self.cal, &c.features, uncached);
            let step = step_overhead_ms(&self.cal, &c.features).clamp(0.0, recompute);
            let charge = step + (recompute - step) * evicting_share(req, &c.features);
            let mut cost =
                estimated_ttft_ms(&self.cal, &c.features) + self.cal.recompute_weight * charge;
            if self.cal.displacement_weight > 0.0 {
                // and the other live sessions' context it evicts (cache balance)
                let displaced = displaced_tokens(req, &c.features);
                cost += self.cal.displacement_weight
                    * candidate_prefill_ms(&self.cal, &c.features, displaced as f64);
            }
            *s = -cost;
        }
    }
}

/// The fixed cost of one engine step on the candidate (learned, or the configured constant).
fn step_overhead_ms(cal: &CostModelCalibration, f: &Features) -> f64 {
    f.learned.map_or(cal.prefill_constant_ms, |l| l.overhead_ms)
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
    fn learned_constants_replace_the_configured_ones() {
        let cal = CostModelCalibration::default();
        let as_configured = LearnedCost {
            overhead_ms: cal.prefill_constant_ms,
            prefill_ms_per_token: cal.prefill_linear_ms,
            decode_scale: 1.0,
            decode_step_ms: decode_step_ms(&cal, 0.0),
            observations: 1,
            recent_observations: 1.0,
        };
        // the configured constants in the learned form are the configured model exactly,
        // chunking and quadratic term included
        for tokens in [0.0, 1.0, 1000.0, 8192.0, 20_000.0] {
            let d = learned_prefill_ms(&cal, &as_configured, tokens) - prefill_ms(&cal, tokens);
            assert!(d.abs() < 1e-9, "{tokens}: {d}");
        }
        let p = CostModel::new(cal);
        let r = req(4096);
        let plain = feat(4096, 0, 0.0, 2.0);
        let same = Features {
            learned: Some(as_configured),
            ..plain
        };
        let mut s = [0.0; 2];
        p.score(&r, &[cand(1, plain), cand(2, same)], &mut s);
        assert!((s[0] - s[1]).abs() < 1e-9, "{s:?}");
        // an endpoint learned to be 20x slower per token and 10x per step loses the tie,
        // in its TTFT and in the recomputation's price
        let slow = Features {
            learned: Some(LearnedCost {
                overhead_ms: 10.0 * cal.prefill_constant_ms,
                prefill_ms_per_token: 20.0 * cal.prefill_linear_ms,
                ..as_configured
            }),
            ..plain
        };
        assert_eq!(pick(&p, &r, &[cand(1, slow), cand(2, plain)]), ep(2));
        assert_eq!(pick(&p, &r, &[cand(2, slow), cand(1, plain)]), ep(1));
        assert!(estimated_ttft_ms(&cal, &slow) > 10.0 * estimated_ttft_ms(&cal, &plain) / 2.0);
        // a slow decode step counts where requests are running
        let slow_decode = Features {
            learned: Some(LearnedCost {
                decode_scale: 10.0,
                ..as_configured
            }),
            ..plain
        };
        let basis = ttft_basis(&cal, &slow_decode);
        assert!((basis.decode_ms - 10.0 * ttft_basis(&cal, &plain).decode_ms).abs() < 1e-9);
        assert_eq!(pick(&p, &r, &[cand(1, slow_decode), cand(2, plain)]), ep(2));
    }

    #[test]
    fn a_prefix_in_host_memory_is_loaded_not_prefilled() {
        use crate::endpoint::OffloadCosts;
        use crate::index::TierBlocks;
        let p = CostModel::new(CostModelCalibration::default());
        let r = req(8192);
        let miss = feat(8192, 0, 0.0, 0.0);
        let gpu = feat(8192, 511, 0.0, 0.0);
        // the same 511 blocks held on the CPU tier at the documented defaults
        let lower = TierBlocks {
            cpu: 511,
            ..TierBlocks::default()
        };
        let costs = OffloadCosts::default();
        let cpu = Features {
            offloaded: lower,
            offload_load_ms: costs.load_ms(&lower, 16),
            offload_credit_blocks: costs.credit_blocks(&lower),
            ..gpu
        };
        let cpu = Features {
            matched_blocks: 0,
            cached_tokens: 0,
            ..cpu
        };
        assert_eq!(pick(&p, &r, &[cand(1, miss), cand(2, cpu)]), ep(2));
        assert_eq!(pick(&p, &r, &[cand(2, cpu), cand(1, gpu)]), ep(1));
        // 8176 tokens × 128 KiB at 25 GB/s
        assert!((cpu.offload_load_ms - 8176.0 * 131_072.0 / 25e6).abs() < 1e-6);
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

    #[test]
    fn an_engine_with_room_for_the_copy_is_charged_little_of_its_recomputation() {
        let p = CostModel::new(CostModelCalibration::default());
        // the demo's new session: 8k of its 11k tokens cached on a busy engine whose cache is
        // full and whose queue holds 4k tokens; another engine is idle and cold
        let r = req(11_008);
        let capacity = Some(500_000 / 16);
        let mut warm = feat(11_008, 500, 1.0, 3.0);
        warm.pending_tokens = 4_000;
        warm.pending_requests = 1;
        warm.kv_capacity_blocks = capacity;
        warm.indexed_blocks = 500_000 / 16;
        let cold_full = Features {
            kv_capacity_blocks: capacity,
            indexed_blocks: 500_000 / 16,
            ..feat(11_008, 0, 0.0, 0.0)
        };
        assert_eq!(evicting_share(&r, &cold_full), 1.0);
        // a cold engine whose cache is full evicts with all of its copy: the prefix wins
        assert_eq!(pick(&p, &r, &[cand(1, cold_full), cand(2, warm)]), ep(2));
        // the same engine with an empty cache evicts almost nothing: its 11k tokens are
        // charged at 2/64, the warm engine's 3k in full
        let cold_empty = Features {
            indexed_blocks: 0,
            ..cold_full
        };
        assert_eq!(
            evicting_share(&r, &cold_empty),
            2.0 / 64.0,
            "11k of 500k, in 64ths"
        );
        assert_eq!(pick(&p, &r, &[cand(1, cold_empty), cand(2, warm)]), ep(1));
        // engines a few blocks apart tie, so the request's hash spreads cold requests
        let few = Features {
            indexed_blocks: 32,
            ..cold_empty
        };
        let mut s = [0.0; 3];
        p.score(
            &r,
            &[cand(1, cold_empty), cand(3, few), cand(2, warm)],
            &mut s,
        );
        assert_eq!(s[0], s[1]);
        // and without a reported capacity the whole charge stands
        let unknown = Features {
            kv_capacity_blocks: None,
            ..cold_empty
        };
        assert_eq!(evicting_share(&r, &unknown), 1.0);
        assert_eq!(pick(&p, &r, &[cand(1, unknown), cand(2, warm)]), ep(2));
    }

    #[test]
    fn a_nearly_whole_prefix_on_a_full_engine_beats_an_empty_engine() {
        // real vLLM (e2e `picker_against_two_real_vllm_engines`): one engine holds 448 of a
        // 454-token prompt with its cache full (510 of 512 blocks of 16), the other is empty.
        // The engine step both would pay is charged in full to both: scaled by the share, the
        // warm engine's 6 tokens would cost 8 steps and the empty engine's 454 tokens little.
        let p = CostModel::new(CostModelCalibration::default());
        let r = req(454);
        let warm = Features {
            kv_capacity_blocks: Some(512),
            indexed_blocks: 510,
            ..feat(454, 28, 0.0, 0.0)
        };
        let empty = Features {
            kv_capacity_blocks: Some(512),
            ..feat(454, 0, 0.0, 0.0)
        };
        assert_eq!(pick(&p, &r, &[cand(1, empty), cand(2, warm)]), ep(2));
        assert_eq!(pick(&p, &r, &[cand(2, warm), cand(1, empty)]), ep(2));
    }

    #[test]
    fn cache_balance_charges_the_live_context_a_placement_evicts() {
        let r = req(40_000);
        // two idle cold endpoints of 100k tokens: one holds 90k tokens of other live sessions,
        // the other 20k
        let full = Features {
            kv_capacity_blocks: Some(100_000 / u64::from(r.block_size)),
            working_set_tokens: 90_000,
            ..feat(40_000, 0, 0.0, 0.0)
        };
        let roomy = Features {
            working_set_tokens: 20_000,
            ..full
        };
        assert_eq!(displaced_tokens(&r, &full), 30_000);
        assert_eq!(displaced_tokens(&r, &roomy), 0);
        // never more than the working set, nothing without a reported capacity
        let tiny = Features {
            working_set_tokens: 5_000,
            kv_capacity_blocks: Some(1),
            ..full
        };
        assert_eq!(displaced_tokens(&r, &tiny), 5_000);
        let unknown = Features {
            kv_capacity_blocks: None,
            ..full
        };
        assert_eq!(displaced_tokens(&r, &unknown), 0);
        let cands = [cand(1, full), cand(2, roomy)];
        let mut s = [0.0; 2];
        // off by default: equal scores (the tie-break decides)
        CostModel::new(CostModelCalibration::default()).score(&r, &cands, &mut s);
        assert_eq!(s[0], s[1]);
        // on: the endpoint with room wins, by the displaced context's prefill
        let cal = CostModelCalibration {
            displacement_weight: 2.0,
            ..CostModelCalibration::default()
        };
        let p = CostModel::new(cal);
        p.score(&r, &cands, &mut s);
        assert!(
            (s[1] - s[0] - 2.0 * prefill_ms(&cal, 30_000.0)).abs() < 1e-6,
            "{s:?}"
        );
        assert_eq!(pick(&p, &r, &cands), ep(2));
        assert_eq!(pick(&p, &r, &[cand(2, full), cand(1, roomy)]), ep(1));
    }
}
