//! The decision pipeline: candidates → features → policy → choice with ordered fallbacks.
//!
//! The router holds no view of its own: the caller passes the current endpoint snapshot, the
//! KV index, the scraped loads and the in-flight counters, so the same code serves the live
//! picker, the offline simulator and the tests.

use std::net::SocketAddr;
use std::sync::Arc;

use serde::Serialize;
use thiserror::Error;

use crate::block_keys::BlockKey;
use crate::calibration::Calibration;
use crate::config::{FailureMode, RoutingConfig};
use crate::endpoint::{Endpoint, EndpointId, EndpointSnapshot, EndpointState, ModelConfig, Role};
use crate::engine_metrics::{LoraActivity, lora_hash};
use crate::index::{Credit, KvIndex, TierBlocks};
use crate::inflight::InflightTracker;
use crate::load::{LoadTable, RecentAdapters};
use crate::policy::{self, Candidate, Features, Policy, RequestFacts};
use crate::session::SessionTable;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum RouteError {
    #[error("model {0:?} is not served by this pool")]
    UnknownModel(String),
    #[error("no eligible endpoint for model config {0:?}")]
    NoEligibleEndpoint(String),
    #[error("every eligible endpoint for model config {0:?} is stale and the pool fails closed")]
    AllStale(String),
}

impl RouteError {
    /// Stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::UnknownModel(_) => "unknown_model",
            Self::NoEligibleEndpoint(_) => "no_eligible_endpoint",
            Self::AllStale(_) => "all_stale",
        }
    }
}

/// Why the chosen endpoint was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DecisionReason {
    /// The policy's best score.
    Policy,
    /// The request's session is pinned there and it is not overloaded (for a policy that
    /// places by cache: and it scores as well as the policy's choice).
    Session,
}

/// One candidate's view of the decision, for `/v1/pick` and debugging.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CandidateExplain {
    pub endpoint: String,
    pub features: Features,
    /// The policy's score; `None` for candidates the balance guard removed.
    pub score: Option<f64>,
    pub overloaded: bool,
    /// Prompt tokens of the live sessions pinned to the endpoint (its working set, against
    /// `features.kv_capacity_blocks`); filled by the pool (`place::Pool::place`).
    pub working_set_tokens: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Decision {
    pub endpoint: EndpointId,
    /// The next best endpoints, in order, to try if the chosen one fails.
    pub fallbacks: Vec<EndpointId>,
    pub model_config: Arc<str>,
    pub policy: &'static str,
    pub reason: DecisionReason,
    /// Prefix blocks cached on the chosen endpoint, and the prompt's tokens they cover.
    pub matched_blocks: u32,
    pub cached_tokens: u32,
    /// The chosen endpoint's features (what in-flight accounting needs).
    pub features: Features,
    /// Every endpoint was stale and the pool fails open.
    pub failed_open: bool,
    /// The chosen endpoint's score under the policy (lower is better), when the policy scores.
    pub score: Option<f64>,
    /// Per-candidate explanation, when asked for.
    pub candidates: Vec<CandidateExplain>,
    /// The least time to first token the cost model predicts on any candidate (ms): what a
    /// request's TTFT objective is held against. Computed only while flow control is on.
    pub best_ttft_ms: Option<f64>,
}

impl Decision {
    /// The decision with every endpoint that has `cap` requests in flight passed over: the
    /// chosen one when it has room, else the first fallback that does (the chosen one becomes
    /// the first fallback); `None` when none has room and the request must be shed.
    #[must_use]
    pub fn within_inflight_cap(mut self, inflight: &InflightTracker, cap: u64) -> Option<Self> {
        if inflight.get(&self.endpoint).requests < cap {
            return Some(self);
        }
        let pos = self
            .fallbacks
            .iter()
            .position(|f| inflight.get(f).requests < cap)?;
        let next = self.fallbacks.remove(pos);
        self.fallbacks.insert(0, self.endpoint);
        self.endpoint = next;
        Some(self)
    }
}

/// Whether a gateway's candidate subset admits `endpoint`: the one rule every entrance uses.
/// An `ip:port` entry admits exactly that endpoint (a gateway whose cluster lists hosts, as
/// with `override_host`, cannot reach a port it did not name); a bare IP (port 0) admits every
/// port of that address.
pub fn subset_allows(subset: &[SocketAddr], endpoint: SocketAddr) -> bool {
    subset
        .iter()
        .any(|a| a.ip() == endpoint.ip() && (a.port() == 0 || a.port() == endpoint.port()))
}

/// Which part of a request a placement is for, under prefill/decode disaggregation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    /// The whole request: `decode` and `both` endpoints.
    Whole,
    /// A split request's prefill: `prefill` endpoints.
    Prefill,
    /// A split request's decode: `decode` and `both` endpoints.
    Decode,
}

impl Stage {
    /// Whether an endpoint of `role` takes this part.
    pub fn admits(self, role: Role) -> bool {
        match self {
            Self::Whole | Self::Decode => role.decodes(),
            Self::Prefill => role == Role::Prefill,
        }
    }
}

/// One request as the router sees it.
#[derive(Clone, Copy)]
pub struct RouteRequest<'a> {
    pub model_config: &'a ModelConfig,
    /// Block keys of the prompt, hashed for this model config (block size, model, adapter,
    /// salt).
    pub keys: &'a [BlockKey],
    pub prompt_tokens: u32,
    pub session: Option<&'a str>,
    pub tenant: Option<&'a str>,
    /// Candidate subset offered by a gateway (`ip:port`); `None` = every endpoint. Matched
    /// by [`subset_allows`].
    pub subset: Option<&'a [SocketAddr]>,
    /// Extra eligibility (tenant's dedicated endpoints).
    pub allow: Option<&'a (dyn Fn(&Endpoint) -> bool + Sync)>,
    /// Hash identifying the request when it has no full block (short prompts).
    pub fallback_hash: u64,
    /// Which part of the request is placed: the endpoints' roles that may take it.
    pub stage: Stage,
    pub explain: bool,
    /// The LoRA adapter the request names, if any.
    pub lora: Option<&'a str>,
}

/// The feeds the router reads.
#[derive(Clone, Copy)]
pub struct RouteContext<'a> {
    pub endpoints: &'a EndpointSnapshot,
    pub index: &'a KvIndex,
    pub loads: &'a LoadTable,
    pub inflight: &'a InflightTracker,
    pub now_ms: u64,
    /// Endpoints passive health ejected (sorted): skipped unless nothing else is eligible.
    pub ejected: &'a [EndpointId],
    /// The cost model's per-endpoint calibration; `None` (calibration off) leaves every
    /// candidate on the configured one.
    pub calibration: Option<&'a Calibration>,
    /// Where the request's session is pinned, if it has a session and a pin (the pool reads
    /// it before deciding, so no lock is held across the decision).
    pub pinned: Option<EndpointId>,
    /// The live context of the request's own session at its pin, in tokens (it is replaced
    /// by this turn's, so it is not part of what the turn would displace there).
    pub pinned_tokens: u64,
    /// Each endpoint's live working set in tokens (`session::SessionTable::live`), when the
    /// policy prices cache balance; `None`: not read.
    pub working_sets: Option<&'a hashbrown::HashMap<EndpointId, u64>>,
    /// Placements recorded so far (the policies' [`RequestFacts::turn`]).
    pub turn: u64,
}

impl<'a> RouteRequest<'a> {
    /// A whole request (not one step of a disaggregated one) of `prompt_tokens` tokens with
    /// block keys `keys`: no session, tenant, subset, adapter or extra eligibility, no
    /// explanation. Set the rest with struct update syntax.
    pub fn whole(model_config: &'a ModelConfig, keys: &'a [BlockKey], prompt_tokens: u32) -> Self {
        Self {
            model_config,
            keys,
            prompt_tokens,
            session: None,
            tenant: None,
            subset: None,
            allow: None,
            fallback_hash: 0,
            stage: Stage::Whole,
            explain: false,
            lora: None,
        }
    }
}

impl<'a> RouteContext<'a> {
    /// The feeds at `now_ms` with nothing ejected, no calibration, no session pin and no
    /// working sets read. Set the rest with struct update syntax.
    pub fn at(
        endpoints: &'a EndpointSnapshot,
        index: &'a KvIndex,
        loads: &'a LoadTable,
        inflight: &'a InflightTracker,
        now_ms: u64,
    ) -> Self {
        Self {
            endpoints,
            index,
            loads,
            inflight,
            now_ms,
            ejected: &[],
            calibration: None,
            pinned: None,
            pinned_tokens: 0,
            working_sets: None,
            turn: 0,
        }
    }
}

/// The most leading blocks of a `prompt_tokens`-token prompt an engine serves from its cache.
///
/// vLLM never serves a prompt's last token from cache (it must compute that token to get the
/// logits): `max_cache_hit_length = num_tokens - 1`, rounded down to whole blocks. So a fully
/// cached block-aligned prompt of k blocks hits k-1 of them (2,048 tokens in blocks of 32:
/// 2,016 tokens), and a cached prefix is credited only up to this bound.
#[must_use]
pub fn servable_blocks(prompt_tokens: u32, block_size: u32) -> u32 {
    prompt_tokens.saturating_sub(1) / block_size.max(1)
}

/// The routing policy and its configuration: stateless, so that a decision only reads, and a
/// routing edit replaces it without losing anything (session pins and the turn count live in
/// the pool, `place::Pool`).
pub struct Router {
    config: RoutingConfig,
    policy: Box<dyn Policy>,
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router")
            .field("policy", &self.policy.name())
            .field("config", &self.config)
            .finish()
    }
}

impl Router {
    pub fn new(config: RoutingConfig) -> Self {
        Self::with_policy(
            config.clone(),
            policy::build(&config, 0x006b_7672_6f75_7465),
        )
    }

    pub fn with_policy(config: RoutingConfig, policy: Box<dyn Policy>) -> Self {
        Self { config, policy }
    }

    /// The key a session is pinned under: its id within its tenant.
    pub fn session_key(tenant: Option<&str>, session: Option<&str>) -> Option<u64> {
        session.map(|s| SessionTable::key(tenant, s))
    }

    pub fn config(&self) -> &RoutingConfig {
        &self.config
    }

    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    /// The model config serving `model` (base model or LoRA adapter) and the adapter named,
    /// if any. When several configs serve one model, the first by name is used.
    pub fn resolve_model(
        endpoints: &EndpointSnapshot,
        model: &str,
    ) -> Result<(Arc<ModelConfig>, Option<String>), RouteError> {
        let mut best: Option<(Arc<ModelConfig>, Option<String>)> = None;
        for e in endpoints.endpoints() {
            if let Some(lora) = e.model_config.serves(model)
                && best
                    .as_ref()
                    .is_none_or(|(b, _)| e.model_config.name < b.name)
            {
                best = Some((e.model_config.clone(), lora.map(str::to_owned)));
            }
        }
        best.ok_or_else(|| RouteError::UnknownModel(model.to_owned()))
    }

    /// Decide where a request goes: the eligibility filters, each candidate's features, the
    /// balance guard, the policy's ranking (with the session pin), and the explanation. Reads
    /// only: the pool records what was placed and pins the session where it was served.
    pub fn decide(
        &self,
        ctx: &RouteContext<'_>,
        req: &RouteRequest<'_>,
    ) -> Result<Decision, RouteError> {
        let (pool, failed_open) = self.eligible(ctx, req)?;
        let pinned = ctx.pinned;
        let cands = features(ctx, req, &pool, failed_open, pinned);
        let overloaded = self.overloaded(&cands);
        // a pin holds only while its endpoint is not overloaded, for every policy
        let pinned = pinned.filter(|p| {
            cands
                .iter()
                .zip(&overloaded)
                .any(|(c, &o)| c.endpoint == *p && !o)
        });
        let overloaded = if self.policy.uses_balance_guard() {
            overloaded
        } else {
            vec![false; cands.len()]
        };
        let ranked = self.rank(req, ctx.turn, &cands, &overloaded, pinned);
        let winner = ranked.eligible[ranked.chosen];
        let candidates = if req.explain {
            explain(&cands, &overloaded, &ranked.scores)
        } else {
            Vec::new()
        };
        let best_ttft_ms = self.config.flow_control.enabled.then(|| {
            cands
                .iter()
                .map(|c| policy::estimated_ttft_ms(&self.config.cost_model, &c.features))
                .fold(f64::INFINITY, f64::min)
        });
        Ok(Decision {
            endpoint: winner.endpoint,
            fallbacks: ranked.fallbacks,
            model_config: req.model_config.name.clone(),
            policy: self.policy.name(),
            reason: ranked.reason,
            matched_blocks: winner.features.matched_blocks,
            cached_tokens: winner.features.cached_tokens,
            features: winner.features,
            failed_open,
            score: ranked.scores.get(ranked.chosen).copied(),
            candidates,
            best_ttft_ms,
        })
    }

    /// Step 1, the filters: the endpoints of the request's model config that are not draining,
    /// inside the gateway's subset and the tenant's allowance; passively ejected ones only when
    /// nothing else is left; stale ones only when every endpoint is stale and the pool fails
    /// open (then `true`).
    fn eligible<'e>(
        &self,
        ctx: &RouteContext<'e>,
        req: &RouteRequest<'_>,
    ) -> Result<(Vec<&'e Endpoint>, bool), RouteError> {
        let mc = req.model_config;
        let threshold_ms = self.config.staleness_threshold.as_millis() as u64;
        let is_stale = |e: &Endpoint| {
            e.state == EndpointState::Stale || ctx.loads.is_stale(&e.id, ctx.now_ms, threshold_ms)
        };
        let mut fresh: Vec<&Endpoint> = Vec::new();
        let mut stale: Vec<&Endpoint> = Vec::new();
        let mut ejected: Vec<&Endpoint> = Vec::new();
        for e in ctx.endpoints.endpoints() {
            if e.model_config.name != mc.name
                || e.state == EndpointState::Draining
                || !req.stage.admits(e.role)
            {
                continue;
            }
            if let Some(subset) = req.subset
                && !subset_allows(subset, SocketAddr::new(e.id.address, e.id.port))
            {
                continue;
            }
            if let Some(allow) = req.allow
                && !allow(e)
            {
                continue;
            }
            if ctx.ejected.binary_search(&e.id).is_ok() {
                ejected.push(e);
            } else if is_stale(e) {
                stale.push(e);
            } else {
                fresh.push(e);
            }
        }
        // Ejection only steers traffic away while something else can take it: when every
        // eligible endpoint is ejected (a tenant's dedicated one, a gateway's subset), they
        // are candidates as if they were not (Envoy's panic mode).
        if fresh.is_empty() && stale.is_empty() {
            for e in ejected {
                if is_stale(e) {
                    stale.push(e);
                } else {
                    fresh.push(e);
                }
            }
        }
        if !fresh.is_empty() {
            Ok((fresh, false))
        } else if stale.is_empty() {
            Err(RouteError::NoEligibleEndpoint(mc.name.to_string()))
        } else if self.config.failure_mode == FailureMode::FailOpen {
            Ok((stale, true))
        } else {
            Err(RouteError::AllStale(mc.name.to_string()))
        }
    }

    /// Step 3, the balance guard: which candidates carry too much more load than the least
    /// loaded one (more than `balance.absolute` requests above it and `balance.relative` times
    /// it).
    fn overloaded(&self, cands: &[Candidate]) -> Vec<bool> {
        let min_load = cands
            .iter()
            .map(|c| c.features.load())
            .fold(f64::INFINITY, f64::min);
        cands
            .iter()
            .map(|c| {
                let l = c.features.load();
                l - min_load > f64::from(self.config.balance.absolute)
                    && l > self.config.balance.relative * min_load
            })
            .collect()
    }

    /// Step 4, the ranking: the policy scores the candidates the guard kept and chooses; the
    /// session pin holds for the load-only baselines (their `choose` is not even asked: round
    /// robin's turn is not used up), and for a cache-placing policy only where it scores as
    /// well as the policy's own choice (see `Policy::places_by_cache`). The others, best
    /// first, then the guarded ones by load, are the fallbacks.
    fn rank(
        &self,
        req: &RouteRequest<'_>,
        turn: u64,
        cands: &[Candidate],
        overloaded: &[bool],
        pinned: Option<EndpointId>,
    ) -> Ranked {
        let eligible: Vec<Candidate> = cands
            .iter()
            .zip(overloaded)
            .filter(|(_, o)| !**o)
            .map(|(c, _)| *c)
            .collect();
        let facts = RequestFacts {
            prompt_tokens: req.prompt_tokens,
            prompt_blocks: req.keys.len() as u32,
            block_size: req.model_config.block_size.max(1),
            request_hash: req.keys.first().copied().unwrap_or(req.fallback_hash),
            session: Self::session_key(req.tenant, req.session),
            turn,
        };
        let mut scores = vec![0.0; eligible.len()];
        self.policy.score(&facts, &eligible, &mut scores);
        let pin = pinned.and_then(|p| eligible.iter().position(|c| c.endpoint == p));
        let (chosen, reason) = match pin {
            Some(i) if !self.policy.places_by_cache() => (i, DecisionReason::Session),
            _ => {
                let best = self.policy.choose(&facts, &eligible, &scores);
                match pin {
                    Some(i) if scores[i] >= scores[best] => (i, DecisionReason::Session),
                    _ => (best, DecisionReason::Policy),
                }
            }
        };
        let mut order: Vec<usize> = (0..eligible.len()).filter(|&i| i != chosen).collect();
        order.sort_by(|&a, &b| {
            policy::better(&facts, (&eligible[a], scores[a]), (&eligible[b], scores[b]))
        });
        let mut fallbacks: Vec<EndpointId> = order.iter().map(|&i| eligible[i].endpoint).collect();
        let mut guarded: Vec<&Candidate> = cands
            .iter()
            .zip(overloaded)
            .filter(|(_, o)| **o)
            .map(|(c, _)| c)
            .collect();
        guarded.sort_by(|a, b| a.features.load().total_cmp(&b.features.load()));
        fallbacks.extend(guarded.iter().map(|c| c.endpoint));
        Ranked {
            eligible,
            scores,
            chosen,
            reason,
            fallbacks,
        }
    }
}

/// What the ranking step decided: the candidates it ranked (the guard's survivors), their
/// scores, the chosen one's index among them, why, and the fallbacks in order.
struct Ranked {
    eligible: Vec<Candidate>,
    scores: Vec<f64>,
    chosen: usize,
    reason: DecisionReason,
    fallbacks: Vec<EndpointId>,
}

/// Step 2, the features: what each eligible endpoint offers this request — its cached
/// prefix (capped by the engine's last-token rule), its scraped load, this picker's
/// in-flight counts, the session pin and its learned costs, priced against the candidates'
/// pool (see `calibration::pooled`).
fn features(
    ctx: &RouteContext<'_>,
    req: &RouteRequest<'_>,
    pool: &[&Endpoint],
    failed_open: bool,
    pinned: Option<EndpointId>,
) -> Vec<Candidate> {
    let mut credits: Vec<Credit> = Vec::new();
    ctx.index
        .credit(req.keys, ctx.now_ms, &mut Vec::new(), &mut credits);
    let block_size = req.model_config.block_size.max(1);
    let servable = servable_blocks(req.prompt_tokens, block_size);
    let offload = &req.model_config.offload;
    let mut cands: Vec<Candidate> = pool
        .iter()
        .map(|e| {
            let slot = ctx.index.slot(&e.id);
            let credit = slot
                .and_then(|s| credits.binary_search_by_key(&s, |m| m.slot).ok())
                .map(|i| credits[i]);
            let matched = credit.map_or(0, |c| c.blocks).min(servable);
            let offloaded = credit.map_or_else(TierBlocks::default, |c| {
                cap_tiers(c.lower, servable - matched)
            });
            let cached = (matched * block_size).min(req.prompt_tokens);
            let loaded = (offloaded.total() * block_size).min(req.prompt_tokens - cached);
            let load = ctx.loads.get(&e.id).copied().unwrap_or_default();
            let inflight = ctx.inflight.get_with_peers(&e.id);
            Candidate {
                endpoint: e.id,
                features: Features {
                    matched_blocks: matched,
                    provisional_blocks: credit.map_or(0, |c| c.provisional).min(matched),
                    index_gap: slot.is_some_and(|s| ctx.index.has_gap(s)),
                    index_copied: slot.is_some_and(|s| ctx.index.unconfirmed_blocks(s) > 0),
                    cached_tokens: cached,
                    uncached_tokens: req.prompt_tokens - cached - loaded,
                    offloaded,
                    offload_load_ms: offload.load_ms(&offloaded, block_size),
                    offload_credit_blocks: offload.credit_blocks(&offloaded),
                    lora_resident: req.lora.and_then(|name| {
                        Some(lora_resident(
                            name,
                            &load.lora?,
                            ctx.loads.recent_adapters(&e.id),
                        ))
                    }),
                    lora_penalty_ms: lora_penalty_ms(
                        req,
                        load.lora.as_ref(),
                        ctx.loads.recent_adapters(&e.id),
                    ),
                    waiting: load.waiting,
                    running: load.running,
                    kv_usage: load.kv_usage,
                    kv_capacity_blocks: load.kv_capacity_blocks,
                    indexed_blocks: slot.map_or(0, |s| ctx.index.endpoint_blocks(s) as u64),
                    inflight_requests: inflight.requests,
                    inflight_tokens: inflight.tokens,
                    pending_requests: inflight.pending_requests,
                    pending_tokens: inflight.pending_tokens,
                    pending_prompt_tokens: inflight.pending_prompt_tokens,
                    session_affinity: pinned == Some(e.id),
                    working_set_tokens: ctx.working_sets.map_or(0, |w| {
                        let own = if pinned == Some(e.id) {
                            ctx.pinned_tokens
                        } else {
                            0
                        };
                        w.get(&e.id).copied().unwrap_or(0).saturating_sub(own)
                    }),
                    stale: failed_open,
                    learned: ctx.calibration.and_then(|c| c.learned(&e.id)),
                },
            }
        })
        .collect();
    if ctx.calibration.is_some() {
        let own: Vec<_> = cands.iter().map(|c| c.features.learned).collect();
        for (c, l) in cands.iter_mut().zip(crate::calibration::pooled(&own)) {
            c.features.learned = l;
        }
    }
    cands
}

/// Whether adapter `name` is loaded on an endpoint with `activity`: it runs there, or it is
/// among the `max_lora` adapters this picker last routed there (an engine keeps an idle
/// adapter in its slot until another needs the slot; vLLM's metric names only running ones,
/// SGLang's none).
fn lora_resident(name: &str, a: &LoraActivity, recent: Option<&RecentAdapters>) -> bool {
    let slots = a.max_lora.map_or(1, |m| m.max(1) as usize);
    a.runs(name) || recent.is_some_and(|r| r.holds(lora_hash(name), slots))
}

/// What the request's adapter costs on an endpoint with `activity` (vLLM's
/// `lora_requests_info`, SGLang's adapter pool): nothing when it is loaded there
/// ([`lora_resident`]) or when the engine does not report adapters; its load time
/// (`loraLoadMs`) otherwise; and the wait for a slot (`loraSlotWaitMs`) when every one of the
/// engine's `max_lora` slots holds a busy adapter.
fn lora_penalty_ms(
    req: &RouteRequest<'_>,
    activity: Option<&LoraActivity>,
    recent: Option<&RecentAdapters>,
) -> f64 {
    let (Some(name), Some(a)) = (req.lora, activity) else {
        return 0.0;
    };
    if lora_resident(name, a, recent) {
        return 0.0;
    }
    let mc = req.model_config;
    let wait = if a.slots_full() {
        mc.lora_slot_wait_ms
    } else {
        0
    };
    f64::from(mc.lora_load_ms) + f64::from(wait)
}

/// At most `room` of a request's lower-tier blocks: the prompt's last block is never
/// credited (the engine recomputes it), so the slowest tiers' blocks go first.
fn cap_tiers(mut t: TierBlocks, room: u32) -> TierBlocks {
    let mut over = t.total().saturating_sub(room);
    for n in [&mut t.storage, &mut t.remote, &mut t.cpu] {
        let cut = over.min(*n);
        *n -= cut;
        over -= cut;
    }
    t
}

/// Step 5, the explanation: every candidate with its features and score (`None` for the
/// ones the balance guard removed).
fn explain(cands: &[Candidate], overloaded: &[bool], scores: &[f64]) -> Vec<CandidateExplain> {
    let mut ranked = scores.iter();
    cands
        .iter()
        .zip(overloaded)
        .map(|(c, &o)| CandidateExplain {
            endpoint: c.endpoint.to_string(),
            features: c.features,
            score: if o { None } else { ranked.next().copied() },
            overloaded: o,
            working_set_tokens: None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block_keys::{BlockHasher, ChainRoot};
    use crate::config::{Strategy, Weights};
    use crate::endpoint::EndpointSet;
    use crate::index::IndexMode;
    use crate::load::EndpointLoad;
    use std::net::{IpAddr, Ipv4Addr};

    struct World {
        mc: Arc<ModelConfig>,
        set: EndpointSet,
        index: KvIndex,
        loads: LoadTable,
        inflight: InflightTracker,
        calibration: Calibration,
        sessions: parking_lot::Mutex<SessionTable>,
    }

    fn id(n: u8, rank: u32) -> EndpointId {
        EndpointId::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, n)), 8000, rank)
    }

    impl World {
        fn new(ids: &[EndpointId]) -> Self {
            let mc = Arc::new(ModelConfig::new("default", "llama"));
            let set = EndpointSet::new(ids.iter().map(|i| Endpoint::new(*i, mc.clone())).collect());
            let mut index = KvIndex::default();
            let mut loads = LoadTable::new();
            for i in ids {
                index
                    .add_endpoint(*i, IndexMode::Approximate { ttl_ms: 60_000 }, 100_000)
                    .expect("slot");
                loads.update(*i, EndpointLoad::default());
            }
            let mut calibration = Calibration::default();
            calibration.set_pool(ids.iter().copied());
            Self {
                mc,
                set,
                index,
                loads,
                inflight: InflightTracker::new(),
                calibration,
                sessions: parking_lot::Mutex::new(SessionTable::new(1024)),
            }
        }

        fn keys(&self, tokens: &[u32]) -> Vec<BlockKey> {
            BlockHasher::new(16).keys(ChainRoot::new("llama", None, None), tokens)
        }

        /// The feeds at time 0: no pin, no calibration, no ejections.
        fn context<'a>(&'a self, snap: &'a EndpointSnapshot) -> RouteContext<'a> {
            RouteContext::at(snap, &self.index, &self.loads, &self.inflight, 0)
        }

        fn decide(
            &self,
            r: &Router,
            keys: &[BlockKey],
            session: Option<&str>,
        ) -> Result<Decision, RouteError> {
            self.decide_calibrated(r, keys, session, true)
        }

        /// `calibrated: false` routes with no calibration view (calibration off).
        fn decide_calibrated(
            &self,
            r: &Router,
            keys: &[BlockKey],
            session: Option<&str>,
            calibrated: bool,
        ) -> Result<Decision, RouteError> {
            let snap = self.set.load();
            let pinned =
                Router::session_key(None, session).and_then(|k| self.sessions.lock().peek(k));
            let ctx = RouteContext {
                calibration: calibrated.then_some(&self.calibration),
                pinned,
                ..self.context(&snap)
            };
            let req = RouteRequest {
                model_config: &self.mc,
                keys,
                prompt_tokens: keys.len() as u32 * 16,
                session,
                tenant: None,
                subset: None,
                allow: None,
                fallback_hash: 0,
                stage: crate::router::Stage::Whole,
                explain: true,
                lora: None,
            };
            let d = r.decide(&ctx, &req)?;
            // served where it was decided: the session is pinned there
            if let Some(k) = Router::session_key(None, session) {
                self.sessions.lock().served(k, d.endpoint, 0, 0);
            }
            Ok(d)
        }
    }

    fn prompt(seed: u32, n: u32) -> Vec<u32> {
        (0..n)
            .map(|i| seed.wrapping_mul(7919).wrapping_add(i * 31) % 32_000)
            .collect()
    }

    fn router(strategy: Strategy) -> Router {
        Router::new(RoutingConfig {
            strategy,
            ..RoutingConfig::default()
        })
    }

    /// Issue 16: a request naming an adapter goes where the engine runs it; where it runs
    /// nothing, the load time is charged, and where every `max_lora` slot is busy, the wait
    /// for one too.
    #[test]
    fn a_lora_request_prefers_the_engine_running_its_adapter() {
        use crate::endpoint::EngineKind as Kind;
        use crate::engine_metrics::{ParseLimits, parse_engine_metrics};
        let ids: Vec<_> = (1..=3).map(|n| id(n, 0)).collect();
        let mut w = World::new(&ids);
        let activity = |running: &str| {
            let text = format!(
                "vllm:num_requests_waiting 0\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.1\n\
                 vllm:lora_requests_info{{max_lora=\"1\",running_lora_adapters=\"{running}\",waiting_lora_adapters=\"\"}} 1.0\n"
            );
            parse_engine_metrics(&text, Kind::Vllm, &ParseLimits::default())
                .expect("metrics")
                .aggregate()
                .lora
        };
        // 1 runs another adapter in its only slot, 2 runs none, 3 runs "sql"
        for (i, running) in ["other", "", "sql"].iter().enumerate() {
            w.loads.update(
                ids[i],
                EndpointLoad {
                    running: 1.0,
                    lora: activity(running),
                    ..EndpointLoad::default()
                },
            );
        }
        let keys = w.keys(&prompt(3, 256));
        let decide = |w: &World, lora: Option<&str>, allow: &(dyn Fn(&Endpoint) -> bool + Sync)| {
            let snap = w.set.load();
            let ctx = w.context(&snap);
            let req = RouteRequest {
                model_config: &w.mc,
                keys: &keys,
                prompt_tokens: 256,
                session: None,
                tenant: None,
                subset: None,
                allow: Some(allow),
                fallback_hash: 0,
                stage: crate::router::Stage::Whole,
                explain: true,
                lora,
            };
            router(Strategy::CostModel)
                .decide(&ctx, &req)
                .expect("decision")
        };
        let any = |_: &Endpoint| true;
        let d = decide(&w, Some("sql"), &any);
        assert_eq!(d.endpoint, ids[2], "where it runs");
        let f = |d: &Decision, i: usize| {
            d.candidates
                .iter()
                .find(|c| c.endpoint == ids[i].to_string())
                .map(|c| (c.features.lora_resident, c.features.lora_penalty_ms))
        };
        assert_eq!(f(&d, 2), Some((Some(true), 0.0)));
        assert_eq!(f(&d, 1), Some((Some(false), 50.0)), "loadMs");
        assert_eq!(f(&d, 0), Some((Some(false), 2050.0)), "loadMs + slotWaitMs");
        // without 3, the free slot beats the busy one
        let not_3 = |e: &Endpoint| e.id != ids[2];
        assert_eq!(decide(&w, Some("sql"), &not_3).endpoint, ids[1]);
        // a base-model request pays nothing anywhere
        let d = decide(&w, None, &any);
        assert!(
            d.candidates
                .iter()
                .all(|c| c.features.lora_penalty_ms == 0.0 && c.features.lora_resident.is_none())
        );
        // an adapter this picker last sent to 2 is held there idle (vLLM names only running
        // ones): no load; once another adapter took 2's one slot, the load again
        w.loads.record_adapter(ids[1], lora_hash("sql"));
        let d = decide(&w, Some("sql"), &not_3);
        assert_eq!(d.endpoint, ids[1]);
        assert_eq!(f(&d, 1), Some((Some(true), 0.0)));
        w.loads.record_adapter(ids[1], lora_hash("chat"));
        assert_eq!(
            f(&decide(&w, Some("sql"), &not_3), 1),
            Some((Some(false), 50.0))
        );
    }

    /// SGLang reports how full its adapter pool is, not which adapters: the picker's own
    /// record says which ones it holds, and a full pool is not taken for a busy one.
    #[test]
    fn an_sglang_adapter_pool_is_read_with_the_routing_record() {
        use crate::endpoint::EngineKind as Kind;
        use crate::engine_metrics::{ParseLimits, parse_engine_metrics};
        let text = "sglang:num_queue_reqs 0\nsglang:num_running_reqs 1\nsglang:token_usage 0.1\n\
                    sglang:lora_pool_slots_used 2\nsglang:lora_pool_slots_total 2\n";
        let lora = parse_engine_metrics(text, Kind::Sglang, &ParseLimits::default())
            .expect("metrics")
            .aggregate()
            .lora
            .expect("pool gauges");
        assert_eq!((lora.max_lora, lora.slots_used), (Some(2), Some(2)));
        assert!(!lora.names_known() && !lora.slots_full());
        let mut recent = RecentAdapters::default();
        assert!(!lora_resident("sql", &lora, Some(&recent)));
        recent.record(lora_hash("sql"));
        recent.record(lora_hash("chat"));
        assert!(lora_resident("sql", &lora, Some(&recent)), "two slots");
        recent.record(lora_hash("code"));
        assert!(!lora_resident("sql", &lora, Some(&recent)), "pushed out");
        assert!(lora_resident("chat", &lora, Some(&recent)));
    }

    #[test]
    fn cached_prefix_wins_and_explains_itself() {
        let ids: Vec<_> = (1..=4).map(|n| id(n, 0)).collect();
        let mut w = World::new(&ids);
        let keys = w.keys(&prompt(1, 4096));
        let slot = w.index.slot(&ids[2]).expect("slot");
        w.index.record_routed(slot, &keys, 0);
        for s in [
            Strategy::CostModel,
            Strategy::Weighted,
            Strategy::KvCost,
            Strategy::CacheAware,
        ] {
            let d = w.decide(&router(s), &keys, None).expect("decision");
            assert_eq!(d.endpoint, ids[2], "{s:?}");
            // 256 blocks cached, but the last one holds the prompt's last token
            assert_eq!(d.matched_blocks, 255);
            assert_eq!(d.cached_tokens, 255 * 16);
            assert_eq!(d.fallbacks.len(), 3);
            assert_eq!(d.candidates.len(), 4);
            assert!(d.candidates.iter().all(|c| c.score.is_some()));
        }
    }

    /// Issue 13, finding 2: vLLM serves at most `prompt_tokens - 1` tokens from cache, in
    /// whole blocks, so a fully cached block-aligned prompt is credited one block less.
    #[test]
    fn the_last_prompt_token_is_never_credited_as_cached() {
        let ids = [id(1, 0)];
        let mut w = World::new(&ids);
        Arc::make_mut(&mut w.mc).block_size = 32;
        let hasher = BlockHasher::new(32);
        let root = ChainRoot::new("llama", None, None);
        let slot = w.index.slot(&ids[0]).expect("slot");
        let r = router(Strategy::CacheAware);
        let decide = |w: &World, tokens: &[u32]| {
            let keys = hasher.keys(root, tokens);
            let snap = w.set.load();
            let ctx = w.context(&snap);
            let req = RouteRequest::whole(&w.mc, &keys, tokens.len() as u32);
            r.decide(&ctx, &req).expect("decision")
        };
        // 2,048 tokens, every block cached: vLLM hits 2,016
        let aligned = prompt(3, 2048);
        w.index.record_routed(slot, &hasher.keys(root, &aligned), 0);
        let d = decide(&w, &aligned);
        assert_eq!((d.matched_blocks, d.cached_tokens), (63, 2016));
        assert_eq!(d.features.uncached_tokens, 32);
        // one token more: the 64 full blocks are all servable
        let mut longer = aligned.clone();
        longer.push(7);
        let d = decide(&w, &longer);
        assert_eq!((d.matched_blocks, d.cached_tokens), (64, 2048));
        // a prompt shorter than what is cached is capped the same way
        let d = decide(&w, &aligned[..64]);
        assert_eq!((d.matched_blocks, d.cached_tokens), (1, 32));
        assert_eq!(servable_blocks(0, 32), 0);
        assert_eq!(servable_blocks(1, 32), 0);
        assert_eq!(servable_blocks(33, 32), 1);
    }

    #[test]
    fn hot_prefix_cannot_concentrate_all_load() {
        let ids: Vec<_> = (1..=4).map(|n| id(n, 0)).collect();
        let w = World::new(&ids);
        let keys = w.keys(&prompt(2, 2048));
        let mut w = w;
        let mut guards = Vec::new();
        let mut counts = std::collections::BTreeMap::new();
        for strategy in [Strategy::Weighted, Strategy::CostModel, Strategy::KvCost] {
            let r = router(strategy);
            counts.clear();
            guards.clear();
            for _ in 0..100 {
                let d = w.decide(&r, &keys, None).expect("decision");
                let slot = w.index.slot(&d.endpoint).expect("slot");
                w.index.record_routed(slot, &keys, 0);
                // requests never finish during the burst
                guards.push(
                    w.inflight
                        .begin(d.endpoint, 2048, u64::from(2048 - d.cached_tokens)),
                );
                *counts.entry(d.endpoint).or_insert(0) += 1;
            }
            let max = counts.values().max().copied().unwrap_or(0);
            assert!(counts.len() >= 2 && max <= 60, "{strategy:?}: {counts:?}");
        }
    }

    #[test]
    fn sessions_stay_on_their_rank_unless_overloaded() {
        let ids = vec![id(1, 0), id(1, 1), id(2, 0), id(2, 1)];
        let w = World::new(&ids);
        let r = router(Strategy::LeastLoad);
        let first = w
            .decide(&r, &w.keys(&prompt(3, 64)), Some("s-1"))
            .expect("d");
        let mut guards = vec![w.inflight.begin(first.endpoint, 64, 64)];
        // other endpoints are now less loaded, yet the session stays (same rank too)
        for turn in 0..5 {
            let d = w
                .decide(&r, &w.keys(&prompt(100 + turn, 64)), Some("s-1"))
                .expect("d");
            assert_eq!(d.endpoint, first.endpoint);
            assert_eq!(d.reason, DecisionReason::Session);
            guards.push(w.inflight.begin(d.endpoint, 64, 64));
        }
        // load it past the balance thresholds (8 above the minimum and 1.5x): it moves
        for _ in 0..10 {
            guards.push(w.inflight.begin(first.endpoint, 64, 64));
        }
        let moved = w
            .decide(&r, &w.keys(&prompt(3, 64)), Some("s-1"))
            .expect("d");
        assert_eq!(moved.reason, DecisionReason::Policy);
        assert_ne!(moved.endpoint, first.endpoint);
        // and stays on the new endpoint although the old one's load falls back
        guards.truncate(1);
        let d = w
            .decide(&r, &w.keys(&prompt(3, 64)), Some("s-1"))
            .expect("d");
        assert_eq!(d.endpoint, moved.endpoint, "re-pinned to the new endpoint");
        assert_eq!(d.reason, DecisionReason::Session);
    }

    #[test]
    fn a_cache_placing_policy_keeps_a_pin_only_where_it_scores_as_well() {
        let ids: Vec<_> = (1..=2).map(|n| id(n, 0)).collect();
        let mut w = World::new(&ids);
        let r = router(Strategy::CostModel);
        let keys = w.keys(&prompt(5, 256));
        // the tie-break's choice among equal candidates, and the other endpoint
        let hashed = w.decide(&r, &keys, None).expect("d").endpoint;
        let x = ids.iter().copied().find(|i| *i != hashed).expect("two");
        let record = |w: &mut World, e: EndpointId| {
            let slot = w.index.slot(&e).expect("slot");
            w.index.record_routed(slot, &keys, 0);
        };
        // the prefix is cached on x: the session goes there and is pinned
        record(&mut w, x);
        let first = w.decide(&r, &keys, Some("s")).expect("d");
        assert_eq!((first.endpoint, first.reason), (x, DecisionReason::Policy));
        // cached on both, no load: a tie, which the pin breaks (the hash would say `hashed`)
        record(&mut w, hashed);
        assert_eq!(w.decide(&r, &keys, None).expect("d").endpoint, hashed);
        let tied = w.decide(&r, &keys, Some("s")).expect("d");
        assert_eq!((tied.endpoint, tied.reason), (x, DecisionReason::Session));
        // the pinned endpoint gets a queue (below the balance guard's thresholds): the cost
        // model leaves it for the other copy of the blocks
        let _busy: Vec<_> = (0..3).map(|_| w.inflight.begin(x, 4096, 4096)).collect();
        let moved = w.decide(&r, &keys, Some("s")).expect("d");
        assert_eq!(
            (moved.endpoint, moved.reason),
            (hashed, DecisionReason::Policy)
        );
        // a load-only baseline keeps the session where it was pinned in the same state
        let ll = router(Strategy::LeastLoad);
        let pinned = w.decide(&ll, &keys, Some("t")).expect("d");
        let _more: Vec<_> = (0..3)
            .map(|_| w.inflight.begin(pinned.endpoint, 64, 64))
            .collect();
        let kept = w.decide(&ll, &keys, Some("t")).expect("d");
        assert_eq!(kept.endpoint, pinned.endpoint);
        assert_eq!(kept.reason, DecisionReason::Session);
    }

    #[test]
    fn ties_are_deterministic_across_routers() {
        let ids: Vec<_> = (1..=8).map(|n| id(n, 0)).collect();
        let w = World::new(&ids);
        let keys = w.keys(&prompt(9, 512));
        let a = w
            .decide(&router(Strategy::CostModel), &keys, None)
            .expect("d");
        let b = w
            .decide(&router(Strategy::CostModel), &keys, None)
            .expect("d");
        assert_eq!(a.endpoint, b.endpoint);
        assert_eq!(a.fallbacks, b.fallbacks);
    }

    #[test]
    fn stale_endpoints_are_skipped_then_fail_open_or_closed() {
        let ids = vec![id(1, 0), id(2, 0)];
        let w = World::new(&ids);
        w.set.patch(&[crate::endpoint::EndpointPatch::SetState(
            ids[0],
            EndpointState::Stale,
        )]);
        let keys = w.keys(&prompt(4, 64));
        let d = w
            .decide(&router(Strategy::LeastLoad), &keys, None)
            .expect("d");
        assert_eq!(d.endpoint, ids[1]);
        assert_eq!(d.fallbacks, vec![], "stale endpoints are not fallbacks");
        w.set.patch(&[crate::endpoint::EndpointPatch::SetState(
            ids[1],
            EndpointState::Stale,
        )]);
        let d = w
            .decide(&router(Strategy::LeastLoad), &keys, None)
            .expect("d");
        assert!(d.failed_open);
        let closed = Router::new(RoutingConfig {
            failure_mode: FailureMode::FailClose,
            ..RoutingConfig::default()
        });
        assert_eq!(
            w.decide(&closed, &keys, None),
            Err(RouteError::AllStale("default".into()))
        );
    }

    #[test]
    fn subset_and_allow_filters_restrict_candidates() {
        let ids: Vec<_> = (1..=3).map(|n| id(n, 0)).collect();
        let w = World::new(&ids);
        let keys = w.keys(&prompt(5, 64));
        let snap = w.set.load();
        let ctx = w.context(&snap);
        let subset = [SocketAddr::new(ids[1].address, 8000)];
        let base = RouteRequest {
            subset: Some(&subset),
            ..RouteRequest::whole(&w.mc, &keys, 64)
        };
        let r = router(Strategy::Weighted);
        assert_eq!(r.decide(&ctx, &base).expect("d").endpoint, ids[1]);
        let deny_all = |_: &Endpoint| false;
        let req = RouteRequest {
            subset: None,
            allow: Some(&deny_all),
            ..base
        };
        assert_eq!(
            r.decide(&ctx, &req),
            Err(RouteError::NoEligibleEndpoint("default".into()))
        );
    }

    #[test]
    fn ejected_endpoints_are_skipped_unless_nothing_else_is_eligible() {
        let ids: Vec<_> = (1..=3).map(|n| id(n, 0)).collect();
        let w = World::new(&ids);
        let keys = w.keys(&prompt(8, 64));
        let snap = w.set.load();
        let r = router(Strategy::LeastLoad);
        let decide = |ejected: &[EndpointId],
                      allow: Option<&(dyn Fn(&Endpoint) -> bool + Sync)>| {
            let ctx = RouteContext {
                endpoints: &snap,
                index: &w.index,
                loads: &w.loads,
                inflight: &w.inflight,
                now_ms: 0,
                ejected,
                calibration: None,
                pinned: None,
                pinned_tokens: 0,
                working_sets: None,
                turn: 0,
            };
            let req = RouteRequest {
                model_config: &w.mc,
                keys: &keys,
                prompt_tokens: 64,
                session: None,
                tenant: None,
                subset: None,
                allow,
                fallback_hash: 0,
                stage: crate::router::Stage::Whole,
                explain: false,
                lora: None,
            };
            r.decide(&ctx, &req).expect("decision")
        };
        let d = decide(&ids[..2], None);
        assert_eq!(
            (d.endpoint, d.fallbacks),
            (ids[2], vec![]),
            "ejected ones are no fallbacks"
        );
        // a tenant whose only endpoint is ejected is still served there
        let only_first = |e: &Endpoint| e.id == ids[0];
        let d = decide(&ids[..1], Some(&only_first));
        assert_eq!(d.endpoint, ids[0]);
    }

    #[test]
    fn resolve_model_finds_base_and_adapter() {
        let mut mc = ModelConfig::new("b-config", "llama");
        mc.lora_adapters.push("sql".into());
        let mc = Arc::new(mc);
        let snap = EndpointSnapshot::new(vec![Endpoint::new(id(1, 0), mc)]);
        let (c, lora) = Router::resolve_model(&snap, "sql").expect("adapter");
        assert_eq!((&*c.name, lora.as_deref()), ("b-config", Some("sql")));
        assert!(matches!(
            Router::resolve_model(&snap, "gpt"),
            Err(RouteError::UnknownModel(_))
        ));
    }

    /// Issue 14: the cost model prices each endpoint with what was learned about it.
    #[test]
    fn a_calibrated_slow_endpoint_loses_where_the_prior_would_tie() {
        use crate::calibration::TtftBasis;
        let ids: Vec<_> = (1..=2).map(|n| id(n, 0)).collect();
        let mut w = World::new(&ids);
        let r = router(Strategy::CostModel);
        let keys = w.keys(&prompt(11, 2048));
        let d = w.decide(&r, &keys, None).expect("d");
        let scores: Vec<_> = d.candidates.iter().map(|c| c.score).collect();
        assert_eq!(scores[0], scores[1], "uncalibrated: a tie");
        assert!(d.candidates.iter().all(|c| c.features.learned.is_none()));
        // endpoint 1 turns out to take 20x the prior's time to its first token, endpoint 2 the
        // prior's own (an endpoint without observations would be priced like its peers:
        // `calibration::pooled`)
        let cal = r.config().cost_model;
        for tokens in [256.0, 1024.0, 2048.0, 4096.0] {
            for _ in 0..10 {
                let basis = TtftBasis {
                    work_tokens: tokens,
                    decode_ms: 0.0,
                };
                let slow = 20.0 * policy::prefill_ms(&cal, tokens);
                w.calibration.observe_ttft(&ids[0], basis, slow);
                w.calibration
                    .observe_ttft(&ids[1], basis, policy::prefill_ms(&cal, tokens));
            }
        }
        for seed in 0..16 {
            let keys = w.keys(&prompt(100 + seed, 2048));
            let d = w.decide(&r, &keys, None).expect("d");
            assert_eq!(d.endpoint, ids[1], "request {seed}");
            let slow = d
                .candidates
                .iter()
                .find(|c| c.endpoint == ids[0].to_string())
                .expect("explained");
            let learned = slow.features.learned.expect("learned values explained");
            assert!(learned.prefill_ms_per_token > 5.0 * cal.prefill_linear_ms);
            assert!(learned.observations == 40);
        }
        // with calibration off (no view), the tie is back
        let d = w.decide_calibrated(&r, &keys, None, false).expect("d");
        assert_eq!(d.candidates[0].score, d.candidates[1].score);
    }

    #[test]
    fn weighted_session_weight_is_a_soft_preference() {
        let ids: Vec<_> = (1..=2).map(|n| id(n, 0)).collect();
        let w = World::new(&ids);
        let r = Router::new(RoutingConfig {
            strategy: Strategy::Weighted,
            weights: Weights {
                session_affinity: 1.0,
                ..Weights::default()
            },
            ..RoutingConfig::default()
        });
        let d = w.decide(&r, &w.keys(&prompt(6, 64)), Some("s")).expect("d");
        let again = w.decide(&r, &w.keys(&prompt(7, 64)), Some("s")).expect("d");
        assert_eq!(d.endpoint, again.endpoint);
        let c = again
            .candidates
            .iter()
            .find(|c| c.endpoint == d.endpoint.to_string())
            .expect("explained");
        assert!(c.features.session_affinity);
    }
}
