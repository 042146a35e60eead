//! Routing policies behind one small trait.
//!
//! The router filters endpoints (model config, state, tenant, candidate subset), computes each
//! candidate's [`Features`], and asks the policy for one score per candidate (higher is better).
//! The policy then chooses; the default choice is the best score with a deterministic
//! tie-break, and the remaining candidates, best first, are the ordered fallbacks.

mod baselines;
mod cache_aware;
mod cost_model;
mod decode;
mod kv_cost;
mod weighted;

use serde::Serialize;
use xxhash_rust::xxh3::xxh3_64_with_seed;

pub use baselines::{LeastLoad, RandomPolicy, RoundRobin, SessionHash};
pub use cache_aware::CacheAware;
pub use cost_model::{
    CostModel, decode_step_ms, estimated_ttft_ms, learned_prefill_ms, prefill_ms,
    prefill_regressors, ttft_basis,
};
pub use decode::Decode;
pub use kv_cost::KvCost;
pub use weighted::Weighted;

use crate::calibration::LearnedCost;
use crate::config::{RoutingConfig, Strategy};
use crate::endpoint::EndpointId;
use crate::index::TierBlocks;

/// What the policy knows about the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestFacts {
    pub prompt_tokens: u32,
    /// Full blocks in the prompt.
    pub prompt_blocks: u32,
    pub block_size: u32,
    /// A hash of the request (its first block key, or of its text): tie-breaks and sampling
    /// derive from it so every replica decides alike for the same request.
    pub request_hash: u64,
    /// The request's session key (its id within its tenant), when it names one.
    pub session: Option<u64>,
    /// How many placements the pool has recorded before this one: round robin's turn and the
    /// random policy's draw derive from it, so a policy holds no state of its own and asking
    /// where a request would go changes nothing.
    pub turn: u64,
}

/// What the router measured about one candidate for this request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Features {
    /// Longest run of the prompt's leading blocks cached on the endpoint (for a hybrid
    /// engine: the prefix every KV-cache group would hit).
    pub matched_blocks: u32,
    /// How many of `matched_blocks` are provisional: recently routed here, the engine's
    /// events for them not arrived yet (`index.provisionalTtl`), or, on an endpoint whose view
    /// has a gap (`index_gap`), routed here within `index.approximateTtl`.
    pub provisional_blocks: u32,
    /// The endpoint's engine stored blocks after ones this picker never saw (it came after
    /// the engine's replay window): its credit rests partly on the picker's routing record
    /// until the engine's cache is cleared.
    pub index_gap: bool,
    /// Blocks of the endpoint's view came from a copy (a peer picker's index or this
    /// picker's snapshot, at start) that the engine's events have not confirmed yet: its
    /// `matched_blocks` may count some the engine evicted meanwhile.
    pub index_copied: bool,
    pub cached_tokens: u32,
    /// Tokens to prefill: neither cached nor loadable from a lower tier.
    pub uncached_tokens: u32,
    /// Blocks right after the cached prefix that a tier below the GPU holds, by tier.
    pub offloaded: TierBlocks,
    /// Milliseconds to load `offloaded` back into the GPU (the model config's `kvOffload`).
    pub offload_load_ms: f64,
    /// `offloaded` in GPU-block equivalents (the tiers' credit weights).
    pub offload_credit_blocks: f64,
    /// Whether the request's LoRA adapter is running on the endpoint (`None`: no adapter,
    /// or the engine does not report them).
    pub lora_resident: Option<bool>,
    /// What loading the adapter (and waiting for a slot) costs there, ms.
    pub lora_penalty_ms: f64,
    /// Scraped from the engine.
    pub waiting: f64,
    pub running: f64,
    pub kv_usage: f64,
    pub kv_capacity_blocks: Option<u64>,
    /// Blocks the index attributes to the endpoint.
    pub indexed_blocks: u64,
    /// This picker's own in-flight counts.
    pub inflight_requests: u64,
    pub inflight_tokens: u64,
    pub pending_requests: u64,
    pub pending_tokens: u64,
    /// The whole prompts of this picker's requests there still waiting for their first
    /// token: KV about to be allocated that the scraped usage does not show yet.
    pub pending_prompt_tokens: u64,
    /// The endpoint served this request's session before.
    pub session_affinity: bool,
    /// Prompt tokens of the other live sessions pinned to the endpoint: the context its cache
    /// must keep for their next turns (this request's own session not counted).
    pub working_set_tokens: u64,
    /// Its metrics are older than the staleness threshold (only routed to when failing open).
    pub stale: bool,
    /// The cost model's constants learned for this endpoint, when calibration is on and has
    /// data for it (`None`: the configured calibration applies).
    pub learned: Option<LearnedCost>,
}

impl Features {
    /// Requests on the endpoint: the scrape and this picker's in-flight count, whichever is
    /// larger (the scrape sees other pickers' requests, the counter sees requests sent since
    /// the scrape).
    pub fn load(&self) -> f64 {
        (self.waiting + self.running).max(self.inflight_requests as f64)
    }

    /// Matched blocks plus the lower tiers' blocks at their credit weights: the prefix credit
    /// of the weighted, cache-aware and KV-cost policies.
    pub fn credited_blocks(&self) -> f64 {
        f64::from(self.matched_blocks) + self.offload_credit_blocks
    }

    /// Requests waiting for prefill.
    pub fn queue(&self) -> f64 {
        self.waiting.max(self.pending_requests as f64)
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub endpoint: EndpointId,
    pub features: Features,
}

/// A routing policy. Implementations are cheap to call and hold no mutable state: what changes
/// from request to request (round robin's turn, the random draw) comes in [`RequestFacts`].
pub trait Policy: Send + Sync {
    fn name(&self) -> &'static str;

    /// Whether the router's balance guard (never choose an overloaded endpoint) applies.
    /// Cache-aware policies want it; load-only ones do not need it.
    fn uses_balance_guard(&self) -> bool {
        true
    }

    /// Whether the policy places requests by where their prefix is cached (the KV index).
    /// Such a policy already sends a session's next turn to the endpoint holding its blocks
    /// and weighs that against the queue there, so a session pin only breaks its ties (an
    /// unconditional pin would keep the session on a busy endpoint it should leave, and
    /// measured on real vLLM it cost hit rate and balance: `bench/BENCHMARKS.md` §7). For the
    /// load-only baselines the pin is the session's stickiness: it holds unless the endpoint
    /// is overloaded.
    fn places_by_cache(&self) -> bool {
        true
    }

    /// One score per candidate, higher is better, written into `scores` (same length).
    fn score(&self, req: &RequestFacts, cands: &[Candidate], scores: &mut [f64]);

    /// Index of the chosen candidate. The default takes the best score; ties go to the
    /// candidate with the highest rendezvous hash of (request, endpoint), which spreads ties
    /// across endpoints yet gives every replica the same answer.
    fn choose(&self, req: &RequestFacts, cands: &[Candidate], scores: &[f64]) -> usize {
        best_index(req, cands, scores)
    }
}

/// Rendezvous hash of a request and an endpoint.
pub fn tie_break(req: &RequestFacts, e: &EndpointId) -> u64 {
    rendezvous(req.request_hash, e)
}

/// Rendezvous hash of `key` and an endpoint: every key ranks the endpoints its own way, the
/// same in every replica, and an endpoint leaving moves only the keys it ranked first.
pub fn rendezvous(key: u64, e: &EndpointId) -> u64 {
    let mut buf = [0u8; 22];
    match e.address {
        std::net::IpAddr::V4(a) => buf[..4].copy_from_slice(&a.octets()),
        std::net::IpAddr::V6(a) => buf[..16].copy_from_slice(&a.octets()),
    }
    buf[16..18].copy_from_slice(&e.port.to_le_bytes());
    buf[18..22].copy_from_slice(&e.rank.to_le_bytes());
    xxh3_64_with_seed(&buf, key)
}

/// Compare two candidates: better score first, then the tie-break.
pub fn better(
    req: &RequestFacts,
    a: (&Candidate, f64),
    b: (&Candidate, f64),
) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1)
        .then_with(|| tie_break(req, &b.0.endpoint).cmp(&tie_break(req, &a.0.endpoint)))
        .then_with(|| a.0.endpoint.cmp(&b.0.endpoint))
}

pub fn best_index(req: &RequestFacts, cands: &[Candidate], scores: &[f64]) -> usize {
    let mut best = 0;
    for i in 1..cands.len().min(scores.len()) {
        if better(req, (&cands[i], scores[i]), (&cands[best], scores[best])).is_lt() {
            best = i;
        }
    }
    best
}

/// Min-max normalize `v` to [0, 1] with lower raw values scoring higher (all equal → 1).
pub(crate) fn lower_is_better(v: f64, min: f64, max: f64) -> f64 {
    if max - min <= f64::EPSILON {
        1.0
    } else {
        (max - v) / (max - min)
    }
}

/// Build the policy a routing config asks for. `seed` drives the random baseline.
pub fn build(config: &RoutingConfig, seed: u64) -> Box<dyn Policy> {
    match config.strategy {
        Strategy::CostModel => Box::new(CostModel::new(config.cost_model)),
        Strategy::Weighted => Box::new(Weighted::new(config.weights)),
        Strategy::LeastLoad => Box::new(LeastLoad),
        Strategy::RoundRobin => Box::new(RoundRobin),
        Strategy::Random => Box::new(RandomPolicy::new(seed)),
        Strategy::CacheAware => Box::new(CacheAware::new(config.balance, config.cache_aware)),
        Strategy::KvCost => Box::new(KvCost::new(config.overlap_weight, config.temperature)),
        Strategy::SessionHash => Box::new(SessionHash),
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    use super::*;
    use std::net::{IpAddr, Ipv4Addr};

    pub fn ep(n: u8) -> EndpointId {
        EndpointId::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, n)), 8000, 0)
    }

    pub fn req(prompt_tokens: u32) -> RequestFacts {
        RequestFacts {
            prompt_tokens,
            prompt_blocks: prompt_tokens / 16,
            block_size: 16,
            request_hash: 42,
            session: None,
            turn: 0,
        }
    }

    pub fn cand(n: u8, f: Features) -> Candidate {
        Candidate {
            endpoint: ep(n),
            features: f,
        }
    }

    /// Features of a candidate for a `prompt`-token request with `matched` cached blocks.
    pub fn feat(prompt: u32, matched: u32, waiting: f64, running: f64) -> Features {
        Features {
            matched_blocks: matched,
            cached_tokens: matched * 16,
            uncached_tokens: prompt - matched * 16,
            waiting,
            running,
            ..Features::default()
        }
    }

    pub fn pick(p: &dyn Policy, r: &RequestFacts, c: &[Candidate]) -> EndpointId {
        let mut s = vec![0.0; c.len()];
        p.score(r, c, &mut s);
        c[p.choose(r, c, &s)].endpoint
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::*;
    use super::*;

    #[test]
    fn ties_break_deterministically_and_spread_over_requests() {
        let cands: Vec<_> = (1..=8).map(|n| cand(n, Features::default())).collect();
        let scores = vec![1.0; 8];
        let mut winners = std::collections::BTreeSet::new();
        for h in 0..64 {
            let r = RequestFacts {
                request_hash: h,
                ..req(0)
            };
            let a = best_index(&r, &cands, &scores);
            let mut reversed = cands.clone();
            reversed.reverse();
            let b = best_index(&r, &reversed, &scores);
            assert_eq!(cands[a].endpoint, reversed[b].endpoint, "order-independent");
            winners.insert(a);
        }
        assert!(
            winners.len() >= 6,
            "ties spread across endpoints: {winners:?}"
        );
    }

    #[test]
    fn every_strategy_builds_and_names_itself() {
        for s in [
            Strategy::CostModel,
            Strategy::Weighted,
            Strategy::LeastLoad,
            Strategy::RoundRobin,
            Strategy::Random,
            Strategy::CacheAware,
            Strategy::KvCost,
        ] {
            let cfg = RoutingConfig {
                strategy: s,
                ..RoutingConfig::default()
            };
            assert_eq!(build(&cfg, 1).name(), s.as_str());
        }
    }
}
