//! `Decode`: where a split request's decode goes (prefill/decode disaggregation).
//!
//! A decode endpoint receives the request's KV from the prefill endpoint and then generates
//! every output token, so what matters there is not prefill but room and decode speed:
//!
//! `cost ≈ transfer(blocks it lacks) + queue × step(u) + output × step(u')`
//!
//! - the KV transfer pulls only the prompt blocks the decode endpoint does not already hold
//!   (a conversation's earlier turns decoded there are in its own prefix cache), at
//!   `transferLatencyMs + transferMsPerBlock × blocks`;
//! - requests waiting there hold it up about one step each;
//! - the request's own decode runs `expectedOutputTokens` steps at the step time the
//!   engine's KV usage after taking the request gives (the cost model's decode curve: a
//!   fuller cache makes every step of every request slower);
//! - an endpoint without KV room for the prompt plus the expected output would preempt or
//!   queue it: it is chosen only when none has room;
//! - the KV of the requests already placed there that has not landed yet (this picker's
//!   pending prompts: split requests still prefilling elsewhere, requests still waiting) counts
//!   as used, so that a burst of decisions made while their prefills run does not pile onto
//!   the one endpoint that looked emptiest.
//!
//! Lowest cost wins, with the usual deterministic tie-break.

use super::{Candidate, Features, Policy, RequestFacts, decode_step_ms};
use crate::config::{CostModelCalibration, DisaggregationSettings};

/// Added to the cost of an endpoint without KV room for the request: it ranks after every
/// endpoint with room, and among themselves by the rest of the cost.
const NO_ROOM_MS: f64 = 1.0e9;

#[derive(Debug, Clone)]
pub struct Decode {
    cal: CostModelCalibration,
    pd: DisaggregationSettings,
}

impl Decode {
    pub fn new(cal: CostModelCalibration, pd: DisaggregationSettings) -> Self {
        Self { cal, pd }
    }

    /// The cost in ms of decoding `req` on an endpoint with features `f` (see the module
    /// docs).
    pub fn cost_ms(&self, req: &RequestFacts, f: &Features) -> f64 {
        let block = f64::from(req.block_size.max(1));
        let held = f.matched_blocks.min(req.prompt_blocks);
        let missing = req.prompt_blocks - held;
        let transfer = if missing > 0 {
            self.pd.transfer_latency_ms + f64::from(missing) * self.pd.transfer_ms_per_block
        } else {
            0.0
        };
        // blocks it must allocate: the prompt it does not hold and the output
        let needed = (f64::from(req.prompt_tokens) + f64::from(self.pd.expected_output_tokens))
            / block
            - f64::from(held);
        // requests placed here whose KV has not landed yet (their prefill still runs
        // elsewhere, or they wait here): the scrape does not count it, the next step will
        let incoming = f.pending_prompt_tokens as f64 / block;
        let (usage, after, room) = match f.kv_capacity_blocks {
            Some(cap) if cap > 0 => {
                let cap = cap as f64;
                let usage = f.kv_usage + incoming / cap;
                let free = cap * (1.0 - usage.clamp(0.0, 1.0));
                (usage, usage + needed.max(0.0) / cap, free >= needed)
            }
            // capacity not reported: its usage alone says whether there is room
            _ => (f.kv_usage, f.kv_usage, f.kv_usage < 1.0),
        };
        let step_now = decode_step_ms(&self.cal, usage);
        let step_after = decode_step_ms(&self.cal, after);
        let mut cost = transfer
            + f.queue() * step_now
            + f64::from(self.pd.expected_output_tokens.max(1)) * step_after;
        if !room {
            cost += NO_ROOM_MS;
        }
        cost
    }
}

impl Policy for Decode {
    fn name(&self) -> &'static str {
        "Decode"
    }

    fn score(&self, req: &RequestFacts, cands: &[Candidate], scores: &mut [f64]) {
        for (c, s) in cands.iter().zip(scores.iter_mut()) {
            *s = -self.cost_ms(req, &c.features);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::*;

    fn policy() -> Decode {
        Decode::new(
            CostModelCalibration::default(),
            DisaggregationSettings::default(),
        )
    }

    fn with_kv(mut f: Features, usage: f64, capacity: u64) -> Features {
        f.kv_usage = usage;
        f.kv_capacity_blocks = Some(capacity);
        f
    }

    #[test]
    fn the_emptier_cache_decodes_faster() {
        let r = req(4096);
        let c = [
            cand(1, with_kv(feat(4096, 0, 0.0, 8.0), 0.7, 10_000)),
            cand(2, with_kv(feat(4096, 0, 0.0, 8.0), 0.2, 10_000)),
        ];
        assert_eq!(pick(&policy(), &r, &c), ep(2));
    }

    #[test]
    fn an_endpoint_holding_the_conversation_needs_no_transfer() {
        let r = req(64_000);
        // same usage, but endpoint 1 holds the whole prompt already
        let c = [
            cand(1, with_kv(feat(64_000, 4000, 0.0, 4.0), 0.5, 100_000)),
            cand(2, with_kv(feat(64_000, 0, 0.0, 4.0), 0.5, 100_000)),
        ];
        let p = policy();
        assert!(p.cost_ms(&r, &c[0].features) < p.cost_ms(&r, &c[1].features));
        assert_eq!(pick(&p, &r, &c), ep(1));
    }

    #[test]
    fn an_endpoint_without_room_is_chosen_only_when_none_has_room() {
        let r = req(8000);
        // endpoint 1 is nearly empty but too small for the prompt; endpoint 2 is busier
        let small = cand(1, with_kv(feat(8000, 0, 0.0, 0.0), 0.0, 200));
        let busy = cand(2, with_kv(feat(8000, 0, 2.0, 30.0), 0.6, 10_000));
        assert_eq!(pick(&policy(), &r, &[small, busy]), ep(2));
        let full = cand(3, with_kv(feat(8000, 0, 3.0, 0.0), 0.99, 10_000));
        // neither has room: the one whose decode is cheaper (nothing waits on the small one)
        assert_eq!(pick(&policy(), &r, &[small, full]), ep(1));
    }

    #[test]
    fn kv_on_its_way_counts_as_used() {
        let r = req(8000);
        // endpoint 1 looks emptier, but 6000 blocks of prompts placed there have not landed
        let mut incoming = with_kv(feat(8000, 0, 0.0, 4.0), 0.1, 10_000);
        incoming.pending_prompt_tokens = 6000 * 16;
        let c = [
            cand(1, incoming),
            cand(2, with_kv(feat(8000, 0, 0.0, 4.0), 0.3, 10_000)),
        ];
        assert_eq!(pick(&policy(), &r, &c), ep(2));
        // and when they fill it, it has no room left for this one
        let mut full = incoming;
        full.pending_prompt_tokens = 9000 * 16;
        let p = policy();
        assert!(p.cost_ms(&r, &full) >= NO_ROOM_MS);
        assert!(p.cost_ms(&r, &c[1].features) < NO_ROOM_MS);
    }

    #[test]
    fn waiting_requests_hold_up_the_decode() {
        let r = req(1024);
        let c = [
            cand(1, with_kv(feat(1024, 0, 20.0, 4.0), 0.3, 10_000)),
            cand(2, with_kv(feat(1024, 0, 0.0, 4.0), 0.3, 10_000)),
        ];
        assert_eq!(pick(&policy(), &r, &c), ep(2));
    }
}
