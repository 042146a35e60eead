//! The pool: every per-endpoint table a decision reads, and the two steps of a decision.
//!
//! [`Pool`] owns the endpoint set, the KV index and the scraped loads ([`PoolState`]), this
//! picker's in-flight counts, the session pins, the turn count of the load-only policies, the
//! cost model's calibration and passive health's ejections, with the routing policy
//! ([`Router`]) that reads them. An endpoint that leaves the set leaves every table at once
//! ([`Pool::apply_view`], [`Pool::forget`]).
//!
//! A decision has two steps, so that "where would this request go?" can be asked without
//! changing anything (the pick API, a flow-control gate, a second placement for
//! prefill/decode):
//! - [`Pool::place`] reads everything a decision needs (eligibility, tenancy and the gateway's
//!   subset, the index, loads, the in-flight cap, ejections, calibration, the session's pin)
//!   and changes nothing;
//! - [`Pool::record`] commits a placement that is being sent: the turn advances and, on an
//!   approximate index, the endpoint is credited with the prompt's blocks (so the requests
//!   right behind it find them); [`Pool::served`] pins the request's session to the endpoint
//!   that actually answered it (after the in-flight cap, fallbacks and retries). The two are
//!   apart because they happen at different moments: a request is sent long before it is
//!   known to be served, and the requests sent meanwhile must already see its blocks.
//!
//! The picker service, the offline replay benchmark, the criterion benches and the decision
//! tests all decide through these calls.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::ArcSwap;
use parking_lot::{Mutex, RwLock};

use crate::admission::{Admitted, Gate, Room, Ticket};
use crate::block_keys::BlockKey;
use crate::calibration::{Calibration, TtftBasis};
use crate::config::DisaggregationMode;
use crate::endpoint::EndpointId;
use crate::endpoint::Role;
use crate::index::{IndexConfig, IndexError};
use crate::inflight::{InflightGuard, InflightTracker};
use crate::load::EndpointLoad;
use crate::outlier::{OutlierDetection, OutlierDetector};
use crate::pool_state::{IndexBudget, Membership, PoolMember, PoolState, ScrapeOutcome};
use crate::router::{Decision, RouteContext, RouteError, RouteRequest, Router, Stage};
use crate::session::{SessionNews, SessionTable, SharedTurns};
use crate::waiting::{Action, Arrival, Arrived, GateSettings, Headroom, WaitingRoom};
use serde::Serialize;

/// Sessions a pool remembers by default (least recently served forgotten first).
pub const DEFAULT_SESSION_CAPACITY: usize = 100_000;

/// What a pool is built with: the service's settings of the same names.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolSettings {
    /// `index.maxEndpoints`.
    pub index: IndexConfig,
    /// The per-endpoint index budget (`index.*`).
    pub budget: IndexBudget,
    /// `limits.maxInflightPerEndpoint`: past it an endpoint is passed over, and a request
    /// whose every candidate is full is shed.
    pub max_inflight_per_endpoint: u64,
    /// `limits.outlierDetection`.
    pub outlier_detection: OutlierDetection,
    /// Session pins kept.
    pub session_capacity: usize,
}

impl Default for PoolSettings {
    /// The picker's defaults.
    fn default() -> Self {
        Self {
            index: IndexConfig::default(),
            budget: IndexBudget::default(),
            max_inflight_per_endpoint: crate::inflight::DEFAULT_MAX_PER_ENDPOINT,
            outlier_detection: OutlierDetection::default(),
            session_capacity: DEFAULT_SESSION_CAPACITY,
        }
    }
}

/// Why a request cannot be placed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlaceError {
    #[error(transparent)]
    Route(#[from] RouteError),
    /// The chosen endpoint and every fallback have `cap` requests in flight.
    #[error("every eligible endpoint has {cap} requests in flight")]
    Shed { cap: u64 },
}

impl PlaceError {
    /// Stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Route(e) => e.kind(),
            Self::Shed { .. } => "shed",
        }
    }
}

/// Where a request goes, as [`Pool::place`] decided it.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    /// The endpoint, after the in-flight cap, and the fallbacks in order.
    pub decision: Decision,
    /// The session's pin key, when the request names a session.
    pub session_key: Option<u64>,
    /// The request's prompt tokens (what its session's next turn will reuse).
    pub prompt_tokens: u32,
    /// What the cost model's TTFT estimate for the chosen endpoint rested on, while
    /// calibration is on and the in-flight cap did not move the request: its first token is
    /// measured against it.
    pub ttft_basis: Option<TtftBasis>,
    /// The hash of the request's LoRA adapter ([`crate::engine_metrics::lora_hash`]).
    pub lora: Option<u64>,
}

/// Whether a request is split between a prefill and a decode endpoint, and why
/// ([`Pool::place_split`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum Verdict {
    /// `Auto` split it: this many prompt tokens are not cached on the prefill endpoint.
    Split { uncached_tokens: u32 },
    /// `Always` split it.
    Always { uncached_tokens: u32 },
    /// Whole: disaggregation is off.
    Off,
    /// Whole: the model config has no `prefill` endpoint that can take it.
    NoPrefillEndpoint,
    /// Whole: every prefill endpoint is stale.
    PrefillStale,
    /// Whole: too little of the prompt is uncached on the endpoint it runs whole on to pay
    /// for a KV transfer.
    FewUncached { uncached_tokens: u32, min: u32 },
    /// Whole: the prefill endpoint's queue is the bottleneck.
    PrefillBusy { queue: f64, max: u32 },
    /// Whole: the cost model predicts its first token split (the prefill endpoint's queue,
    /// prefill and the KV transfer) later than `maxTtftRatio` times whole.
    PrefillSlower { split_ms: f64, whole_ms: f64 },
    /// Whole: its API has no KV-transfer step (only completions and chat completions do).
    Unsplittable,
}

impl Verdict {
    /// Whether the request is split.
    pub fn splits(self) -> bool {
        matches!(self, Self::Split { .. } | Self::Always { .. })
    }

    /// Stable label for metrics.
    pub fn kind(self) -> &'static str {
        match self {
            Self::Split { .. } => "split",
            Self::Always { .. } => "always",
            Self::Off => "off",
            Self::NoPrefillEndpoint => "no_prefill_endpoint",
            Self::PrefillStale => "prefill_stale",
            Self::FewUncached { .. } => "few_uncached",
            Self::PrefillBusy { .. } => "prefill_busy",
            Self::PrefillSlower { .. } => "prefill_slower",
            Self::Unsplittable => "unsplittable",
        }
    }
}

/// Where a request goes under prefill/decode disaggregation ([`Pool::place_split`]).
#[derive(Debug, Clone, PartialEq)]
pub struct SplitPlacement {
    /// The endpoint that serves the request's output: its decode when split, else all of it.
    pub placement: Placement,
    /// Where a split request is prefilled.
    pub prefill: Option<Placement>,
    pub verdict: Verdict,
}

/// The routing configuration with the decode policy.
fn decode_router(config: &crate::config::RoutingConfig) -> Router {
    Router::with_policy(
        config.clone(),
        Box::new(crate::policy::Decode::new(
            config.cost_model,
            config.disaggregation,
        )),
    )
}

/// See the module documentation.
pub struct Pool {
    state: PoolState,
    inflight: InflightTracker,
    sessions: Mutex<SessionTable>,
    /// Turns served here, for the peers, kept while `sharing` ([`Pool::share_sessions`]).
    shared: Mutex<SharedTurns>,
    sharing: std::sync::atomic::AtomicBool,
    /// What each peer's session admission said last: tokens reserved, since when (this
    /// replica's clock) its first turn in line waits, and when it said it.
    peer_admission: Mutex<std::collections::HashMap<u64, PeerAdmission>>,
    /// Placements recorded: round robin's turn, the random policy's draw.
    turn: AtomicU64,
    router: ArcSwap<Router>,
    /// The same configuration with the decode policy: where split requests decode.
    decode_router: ArcSwap<Router>,
    calibration: RwLock<Calibration>,
    outliers: Mutex<OutlierDetector>,
    /// Every request waiting for its turn: flow control, session admission, SLO retries.
    waiting: Mutex<WaitingRoom>,
    max_inflight_per_endpoint: u64,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("state", &self.state)
            .field("router", &self.router.load())
            .finish_non_exhaustive()
    }
}

impl Pool {
    /// An empty pool routing with `router`.
    pub fn new(settings: PoolSettings, router: Router) -> Self {
        let prior = router.config().cost_model;
        Self {
            state: PoolState::new(settings.index, settings.budget),
            inflight: InflightTracker::new(),
            sessions: Mutex::new(SessionTable::new(settings.session_capacity)),
            shared: Mutex::new(SharedTurns::default()),
            sharing: std::sync::atomic::AtomicBool::new(false),
            peer_admission: Mutex::new(std::collections::HashMap::new()),
            turn: AtomicU64::new(0),
            decode_router: ArcSwap::from_pointee(decode_router(router.config())),
            router: ArcSwap::from_pointee(router),
            calibration: RwLock::new(Calibration::new(prior)),
            outliers: Mutex::new(OutlierDetector::new(settings.outlier_detection)),
            waiting: Mutex::new(WaitingRoom::new()),
            max_inflight_per_endpoint: settings.max_inflight_per_endpoint,
        }
    }

    /// The endpoint set, the KV index and the loads.
    pub fn state(&self) -> &PoolState {
        &self.state
    }

    /// This picker's in-flight counts.
    pub fn inflight(&self) -> &InflightTracker {
        &self.inflight
    }

    /// Requests model config `model_config` can take before its endpoints are saturated
    /// (`routing.saturation`): per ready endpoint below the KV-cache usage threshold,
    /// `queueDepth` minus its waiting requests (the engine's count, or the requests this picker
    /// and its peers sent that have no first token yet beyond what one engine step prefills,
    /// [`queued_beyond_one_step`], whichever is larger). A stale, draining or never-scraped
    /// endpoint offers none.
    pub fn free_slots(&self, model_config: &str, s: &crate::config::SaturationSettings) -> u64 {
        self.rooms(model_config, s).iter().map(|(_, n)| n).sum()
    }

    /// The endpoints of `model_config` with room ([`Self::free_slots`]), and how much each has,
    /// in id order (so a caller may binary-search them).
    pub fn rooms(
        &self,
        model_config: &str,
        s: &crate::config::SaturationSettings,
    ) -> Vec<(EndpointId, u64)> {
        let step = self.step_tokens();
        let pool = self.state.read();
        pool.endpoints
            .endpoints()
            .iter()
            .filter(|e| {
                e.state == crate::endpoint::EndpointState::Ready
                    && &*e.model_config.name == model_config
            })
            .filter_map(|e| {
                let load = pool.loads().get(&e.id)?;
                if load.kv_usage >= s.kv_cache_usage {
                    return None;
                }
                let waiting = waiting_requests(load, self.inflight.get_with_peers(&e.id), step, s);
                let room = u64::from(s.queue_depth).saturating_sub(waiting);
                (room > 0).then_some((e.id, room))
            })
            .collect()
    }

    /// Tokens one engine step prefills (`costModel.maxBatchedTokens`).
    fn step_tokens(&self) -> u64 {
        u64::from(
            self.router
                .load()
                .config()
                .cost_model
                .max_batched_tokens
                .max(1),
        )
    }

    /// The pool's saturation per model config, what an autoscaler reads
    /// (`kvroute_picker_pool_saturation`): the mean over its serving endpoints of the larger of
    /// waiting requests over `queueDepth` (the engine's count, or the requests this picker and
    /// its peers sent that have no first token yet beyond one engine step,
    /// [`queued_beyond_one_step`], whichever is larger) and KV-cache usage over
    /// its threshold (a stale endpoint counts 1), plus the requests the picker itself holds in
    /// flow control's queue (per model config) over the pool's queue depth: a
    /// picker holding requests back is saturation the engines' counters cannot show. 0 idle;
    /// 1 when every endpoint is at its thresholds.
    pub fn saturation(&self, s: &crate::config::SaturationSettings) -> Vec<(String, f64)> {
        let queued = self.waiting.lock().queued();
        let step = self.step_tokens();
        let pool = self.state.read();
        let mut sums: std::collections::BTreeMap<&str, (f64, u32)> =
            std::collections::BTreeMap::new();
        for e in pool.endpoints.endpoints() {
            if e.state == crate::endpoint::EndpointState::Draining {
                continue;
            }
            let stale = e.state == crate::endpoint::EndpointState::Stale;
            let load = pool.loads().get(&e.id).map(|l| crate::load::EndpointLoad {
                waiting: waiting_requests(l, self.inflight.get_with_peers(&e.id), step, s) as f64,
                ..*l
            });
            let entry = sums.entry(&e.model_config.name).or_default();
            entry.0 += s.of(load.as_ref(), stale);
            entry.1 += 1;
        }
        sums.into_iter()
            .map(|(name, (sum, n))| {
                let held = queued
                    .iter()
                    .find(|(c, _)| c == name)
                    .map_or(0, |(_, q)| *q) as f64;
                let depth = f64::from(s.queue_depth.max(1)) * f64::from(n.max(1));
                (name.to_owned(), sum / f64::from(n.max(1)) + held / depth)
            })
            .collect()
    }

    /// The cost model's per-endpoint calibration.
    pub fn calibration(&self) -> &RwLock<Calibration> {
        &self.calibration
    }

    /// Passive health.
    pub fn outliers(&self) -> &Mutex<OutlierDetector> {
        &self.outliers
    }

    /// The routing policy now.
    pub fn router(&self) -> Arc<Router> {
        self.router.load_full()
    }

    /// Route with `router` from now on. Session pins, the turn count, calibration and
    /// ejections are the pool's and stay: a routing edit changes the policy, not where
    /// sessions live.
    pub fn set_router(&self, router: Router) {
        self.decode_router
            .store(Arc::new(decode_router(router.config())));
        self.router.store(Arc::new(router));
    }

    /// Where session `key` is pinned, if anywhere.
    pub fn pinned(&self, key: u64) -> Option<EndpointId> {
        self.sessions.lock().peek(key)
    }

    /// Placements recorded so far.
    pub fn turn(&self) -> u64 {
        self.turn.load(Ordering::Acquire)
    }

    /// Make the pool `members` ([`PoolState::apply_view`]; `publish` runs before the new set
    /// appears). Departed endpoints are forgotten by every table; passive health and
    /// calibration follow the new set.
    pub fn apply_view(
        &self,
        members: Vec<PoolMember>,
        publish: impl FnOnce(),
    ) -> Result<Membership, IndexError> {
        let membership = self.state.apply_view(members, publish)?;
        for id in &membership.removed {
            self.forget(id);
        }
        let snap = self.state.endpoints();
        self.outliers.lock().set_pool(
            snap.endpoints()
                .iter()
                .map(|e| (e.id, e.model_config.name.clone())),
        );
        self.calibration
            .write()
            .set_pool(snap.endpoints().iter().map(|e| e.id));
        Ok(membership)
    }

    /// One scrape round ([`PoolState::observe_scrape`]) under the routing's
    /// `stalenessThreshold`.
    pub fn observe_scrape(
        &self,
        now_ms: u64,
        samples: impl IntoIterator<Item = (EndpointId, EndpointLoad)>,
    ) -> ScrapeOutcome {
        let threshold = self.router.load().config().staleness_threshold.as_millis() as u64;
        self.state.observe_scrape(now_ms, threshold, samples)
    }

    /// `endpoint` left: its in-flight counts and the sessions pinned to it go (its blocks and
    /// load went with it from the endpoint set, in [`PoolState::apply_view`]).
    pub fn forget(&self, endpoint: &EndpointId) {
        self.inflight.remove(endpoint);
        self.sessions.lock().remove_endpoint(endpoint);
    }

    /// Where `req` would go at `now_ms`: the router's decision over the pool as it is (its
    /// session's pin, ejections, calibration when the cost model calibrates, this turn), then
    /// the in-flight cap. Changes nothing.
    pub fn place(&self, req: &RouteRequest<'_>, now_ms: u64) -> Result<Placement, PlaceError> {
        self.place_with(&self.router.load(), req, now_ms, true)
    }

    /// Where `req` would go at `now_ms` under prefill/decode disaggregation
    /// (`routing.disaggregation`): whole on a `decode` or `both` endpoint ([`Pool::place`]),
    /// or split, its prefill on a `prefill` endpoint chosen by the routing policy (its
    /// prefix cache decides the prefill's cost) and its decode on a `decode` or `both`
    /// endpoint chosen by the decode policy ([`crate::policy::Decode`]). The decider:
    /// `Always` splits whenever a prefill endpoint can take the request; `Auto` only when
    /// the prompt's uncached part on the endpoint it would run whole on reaches
    /// `minUncachedTokens`, the chosen prefill endpoint has fewer than `maxPrefillQueue`
    /// requests waiting, and the cost model predicts its first token split within
    /// `maxTtftRatio` times whole. Changes nothing.
    pub fn place_split(
        &self,
        req: &RouteRequest<'_>,
        now_ms: u64,
    ) -> Result<SplitPlacement, PlaceError> {
        let router = self.router.load();
        let pd = router.config().disaggregation;
        let place_whole = || {
            let whole = RouteRequest {
                stage: Stage::Whole,
                ..*req
            };
            self.place_with(&router, &whole, now_ms, true)
        };
        let whole = |verdict: Verdict| -> Result<SplitPlacement, PlaceError> {
            Ok(SplitPlacement {
                placement: place_whole()?,
                prefill: None,
                verdict,
            })
        };
        if pd.mode == DisaggregationMode::Off {
            return whole(Verdict::Off);
        }
        let has_prefill = self
            .state
            .read()
            .endpoints
            .endpoints()
            .iter()
            .any(|e| e.role == Role::Prefill && e.model_config.name == req.model_config.name);
        if !has_prefill {
            return whole(Verdict::NoPrefillEndpoint);
        }
        // `Auto` decides on where it would run whole and what it would prefill there (a
        // conversation whose earlier turns a decode endpoint holds has little left);
        // `Always` needs that placement only when it cannot split
        let here = match pd.mode {
            DisaggregationMode::Auto => Some(place_whole()?),
            _ => None,
        };
        if let Some(here) = &here {
            let uncached_here = req
                .prompt_tokens
                .saturating_sub(here.decision.cached_tokens);
            if uncached_here < pd.min_uncached_tokens {
                return Ok(SplitPlacement {
                    placement: here.clone(),
                    prefill: None,
                    verdict: Verdict::FewUncached {
                        uncached_tokens: uncached_here,
                        min: pd.min_uncached_tokens,
                    },
                });
            }
        }
        let stay = |verdict: Verdict| match &here {
            Some(here) => Ok(SplitPlacement {
                placement: here.clone(),
                prefill: None,
                verdict,
            }),
            None => whole(verdict),
        };
        let prefill_req = RouteRequest {
            stage: Stage::Prefill,
            ..*req
        };
        // no pin: a session is pinned where it decodes
        let prefill = match self.place_with(&router, &prefill_req, now_ms, false) {
            Ok(p) if !p.decision.failed_open => p,
            Ok(_) => return stay(Verdict::PrefillStale),
            Err(_) => return stay(Verdict::NoPrefillEndpoint),
        };
        let uncached_tokens = req
            .prompt_tokens
            .saturating_sub(prefill.decision.cached_tokens);
        let queue = prefill.decision.features.queue();
        let verdict = match &here {
            None => Verdict::Always { uncached_tokens },
            Some(_) if queue >= f64::from(pd.max_prefill_queue) => {
                return stay(Verdict::PrefillBusy {
                    queue,
                    max: pd.max_prefill_queue,
                });
            }
            Some(here) => {
                // the first token would come much later split than whole: the prefill pool
                // is the bottleneck (the transfer moves every block, the partial last one too)
                let cal = &router.config().cost_model;
                let blocks = f64::from(
                    req.prompt_tokens
                        .div_ceil(req.model_config.block_size.max(1)),
                );
                let split_ms = crate::policy::estimated_ttft_ms(cal, &prefill.decision.features)
                    + pd.transfer_latency_ms
                    + blocks * pd.transfer_ms_per_block;
                let whole_ms = crate::policy::estimated_ttft_ms(cal, &here.decision.features);
                if split_ms > whole_ms * pd.max_ttft_ratio {
                    return stay(Verdict::PrefillSlower {
                        split_ms: split_ms.round(),
                        whole_ms: whole_ms.round(),
                    });
                }
                Verdict::Split { uncached_tokens }
            }
        };
        let decode_req = RouteRequest {
            stage: Stage::Decode,
            ..*req
        };
        let placement = self.place_with(&self.decode_router.load(), &decode_req, now_ms, true)?;
        Ok(SplitPlacement {
            placement,
            prefill: Some(prefill),
            verdict,
        })
    }

    /// [`Pool::place`] with `router`, reading the session's pin or not.
    fn place_with(
        &self,
        router: &Router,
        req: &RouteRequest<'_>,
        now_ms: u64,
        read_pin: bool,
    ) -> Result<Placement, PlaceError> {
        let calibrating = router.config().cost_model.calibrate;
        let ejected = self.outliers.lock().ejected(now_ms);
        let session_key = Router::session_key(req.tenant, req.session);
        // the session's pin and, when the policy prices cache balance, the working sets: read
        // now, so no lock is held across the decision
        let balance = router.config().cost_model.displacement_weight > 0.0;
        let (pin, working_sets) = {
            let sessions = self.sessions.lock();
            (
                session_key
                    .filter(|_| read_pin)
                    .and_then(|k| sessions.pin(k)),
                balance.then(|| sessions.live().clone()),
            )
        };
        let pinned = pin.map(|p| p.endpoint);
        let pinned_tokens = pin.filter(|p| p.live).map_or(0, |p| p.tokens);
        let decision = {
            let pool = self.state.read();
            let calibration = self.calibration.read();
            let ctx = RouteContext {
                endpoints: &pool.endpoints,
                index: pool.index(),
                loads: pool.loads(),
                inflight: &self.inflight,
                now_ms,
                ejected: &ejected,
                calibration: calibrating.then_some(&*calibration),
                pinned,
                pinned_tokens,
                working_sets: working_sets.as_ref(),
                turn: self.turn(),
            };
            router.decide(&ctx, req)?
        };
        let chosen = decision.endpoint;
        let cap = self.max_inflight_per_endpoint;
        let decision = decision
            .within_inflight_cap(&self.inflight, cap)
            .ok_or(PlaceError::Shed { cap })?;
        // only a whole request's first token is the prefill the cost model estimated
        let ttft_basis = (calibrating && decision.endpoint == chosen && req.stage == Stage::Whole)
            .then(|| crate::policy::ttft_basis(&router.config().cost_model, &decision.features));
        let mut decision = decision;
        if req.explain && !decision.candidates.is_empty() {
            let sets: hashbrown::HashMap<String, u64> = self
                .sessions
                .lock()
                .live()
                .iter()
                .map(|(e, t)| (e.to_string(), *t))
                .collect();
            for c in &mut decision.candidates {
                c.working_set_tokens = Some(sets.get(&c.endpoint).copied().unwrap_or(0));
            }
        }
        Ok(Placement {
            session_key,
            prompt_tokens: req.prompt_tokens,
            decision,
            ttft_basis,
            lora: req.lora.map(crate::engine_metrics::lora_hash),
        })
    }

    /// Whether `req`'s turn may go on to placement now, or must wait for room (see
    /// [`crate::admission`]). Changes nothing.
    pub fn gate(&self, req: &RouteRequest<'_>, now_ms: u64) -> Gate {
        if !self.router.load().config().admission.enabled {
            return Gate::Admit(Admitted::Disabled);
        }
        match self.room(req, now_ms) {
            Err(why) => Gate::Admit(why),
            Ok(room) if room.fits() => Gate::Admit(Admitted::Fits),
            Ok(room) => Gate::Hold(room),
        }
    }

    /// The pool's room for `req`'s session, or why it is not asked: no session, a session
    /// with live context, an endpoint without a reported KV capacity.
    pub fn room(&self, req: &RouteRequest<'_>, now_ms: u64) -> Result<Room, Admitted> {
        let reserved = self.waiting.lock().reserved(now_ms);
        self.room_of(
            Router::session_key(req.tenant, req.session),
            req.prompt_tokens,
            reserved,
            now_ms,
        )
    }

    /// The room for a turn of session `key` with `prompt_tokens`, `reserved` tokens being
    /// promised to turns admitted and not yet served ([`Self::room`]).
    fn room_of(
        &self,
        key: Option<u64>,
        prompt_tokens: u32,
        reserved: u64,
        now_ms: u64,
    ) -> Result<Room, Admitted> {
        let key = key.ok_or(Admitted::NoSession)?;
        let (live, mean, returning) = {
            let mut table = self.sessions.lock();
            // the sessions past the horizon leave now, not at the next served turn: a pool
            // that went quiet has room again, however long nothing arrives
            table.expire(now_ms);
            let pin = table.pin(key);
            if pin.is_some_and(|p| p.live) {
                return Err(Admitted::LiveSession);
            }
            (
                table.live().values().sum::<u64>(),
                table.mean_live(),
                pin.is_some(),
            )
        };
        let (capacity, largest) = {
            let pool = self.state.read();
            let (mut total, mut largest) = (0u64, 0u64);
            for e in pool.endpoints.endpoints() {
                let blocks = pool
                    .loads()
                    .get(&e.id)
                    .and_then(|l| l.kv_capacity_blocks)
                    .ok_or(Admitted::CapacityUnknown)?;
                let tokens = blocks.saturating_mul(u64::from(e.model_config.block_size.max(1)));
                total = total.saturating_add(tokens);
                largest = largest.max(tokens);
            }
            (total, largest)
        };
        if capacity == 0 {
            return Err(Admitted::CapacityUnknown);
        }
        let overcommit = self.router.load().config().admission.overcommit;
        let capacity = (capacity as f64 * overcommit) as u64;
        // a session back after its horizon brings its whole context in its prompt; a new one
        // is expected to grow as large as the sessions already in (oversized ones left out);
        // no session is expected to hold more than the largest engine's cache, so a prompt
        // larger than the pool waits for one engine's worth of room, not for `maxWait`
        let mean = if returning { 0 } else { mean };
        Ok(Room {
            live_tokens: live
                .saturating_add(reserved)
                .saturating_add(self.peers_reserved()),
            capacity_tokens: capacity,
            footprint_tokens: mean.max(u64::from(prompt_tokens)).min(largest),
        })
    }

    /// The waiting room ([`WaitingRoom`]): what waits, and what it reserved.
    pub fn waiting(&self) -> &Mutex<WaitingRoom> {
        &self.waiting
    }

    /// `a` arrives at the waiting room at `now_ms` ([`WaitingRoom::arrive`]), under the
    /// routing config's flow control and admission and this pool's headroom.
    pub fn arrive(&self, now_ms: u64, a: Arrival) -> Arrived {
        let router = self.router.load();
        let s = GateSettings::of(router.config());
        let h = PoolHeadroom::new(self, router.config(), now_ms);
        self.waiting.lock().arrive(now_ms, a, &s, &h)
    }

    /// What the waiting room does at `now_ms` ([`WaitingRoom::step`]).
    pub fn step_waiting(&self, now_ms: u64) -> Vec<Action> {
        let router = self.router.load();
        let s = GateSettings::of(router.config());
        let h = PoolHeadroom::new(self, router.config(), now_ms);
        self.waiting.lock().step(now_ms, &s, &h)
    }

    /// When the waiting room must be stepped at the latest: its own deadlines, and while
    /// admission holds turns, the first moment a session's context passes the horizon (the
    /// working sets shrink).
    pub fn next_wake(&self) -> Option<u64> {
        let s = GateSettings::of(self.router.load().config());
        let (wake, holds) = {
            let w = self.waiting.lock();
            (w.next_wake(&s), w.admission_waiting() > 0)
        };
        let expiry = holds
            .then(|| self.sessions.lock().next_expiry_ms())
            .flatten();
        [wake, expiry].into_iter().flatten().min()
    }

    /// `placement` is being sent: the turn advances, an approximate index credits its
    /// endpoint with the prompt's `keys` (a precise one provisionally, until its engine's
    /// events arrive), and its adapter is recorded as routed there.
    pub fn record(&self, placement: &Placement, keys: &[BlockKey], now_ms: u64) {
        self.turn.fetch_add(1, Ordering::AcqRel);
        self.state
            .record_routed(&placement.decision.endpoint, keys, now_ms);
        if let Some(hash) = placement.lora {
            self.state.record_adapter(placement.decision.endpoint, hash);
        }
    }

    /// `endpoint` answered a request with a success at `now_ms`: what the proxy, the ext_proc
    /// picker and the offline bench learn of a served request, in one call. Its session
    /// (`session_key`), if it has one, is pinned there, wherever the in-flight cap, a
    /// fallback or a retry sent it, with the prompt's size (its working set) and the time
    /// (the reuse horizon learns the gap); the footprint session admission reserved for it
    /// (`reservation`), if it waited, goes, its context now counting in the working sets.
    pub fn settle(
        &self,
        session_key: Option<u64>,
        prompt_tokens: u64,
        endpoint: EndpointId,
        reservation: Option<Ticket>,
        now_ms: u64,
    ) {
        if let Some(key) = session_key {
            self.pin(key, endpoint, prompt_tokens, now_ms);
        }
        if let Some(r) = reservation {
            self.waiting.lock().release(r);
        }
    }

    /// Pin session `key` to `endpoint`, served a prompt of `tokens` at `now_ms` (see
    /// [`Pool::settle`]); the peers hear of it ([`Pool::share_sessions`]).
    pub fn pin(&self, key: u64, endpoint: EndpointId, tokens: u64, now_ms: u64) {
        // a session counts for at most what its engine's cache can hold
        let cap = self.capacity_tokens(&endpoint).unwrap_or(u64::MAX);
        self.sessions
            .lock()
            .served_within(key, endpoint, tokens, cap, now_ms);
        if self.sharing.load(Ordering::Relaxed) {
            self.shared
                .lock()
                .push(key, endpoint, tokens.min(cap), now_ms);
        }
    }

    /// This replica has peers: from now on the turns it serves are kept for them
    /// ([`Pool::take_shared`]), so a session live at one replica is live at all (pinned
    /// where its context is, counted by every replica's session admission).
    pub fn share_sessions(&self) {
        self.sharing.store(true, Ordering::Relaxed);
    }

    /// What to tell the peers at `now_ms`: the turns served here since the last call, what
    /// this replica's admission reserved for turns admitted and not yet served, and how long
    /// its first turn in line has waited.
    pub fn take_shared(&self, now_ms: u64) -> SessionNews {
        let turns = self.shared.lock().take(now_ms);
        let w = self.waiting.lock();
        SessionNews {
            turns,
            reserved: w.reserved(now_ms),
            first_waiting_ms: w.first_waiting_since().map(|t| now_ms.saturating_sub(t)),
        }
    }

    /// Peer replica `peer` told at `now_ms` what it served, reserved and holds: each session
    /// is pinned here as it is there (unless this replica served it since); its reservation
    /// counts against the pool's room, and its first turn in line goes before any that came
    /// after it here, until it says otherwise or goes silent ([`Pool::expire_peers`]). At most
    /// [`crate::inflight::MAX_PEERS`] peers.
    pub fn apply_shared(&self, peer: u64, news: &SessionNews, now_ms: u64) {
        // the caps first: the session table is not held while the pool state is read
        let caps: Vec<u64> = news
            .turns
            .iter()
            .map(|t| self.capacity_tokens(&t.endpoint).unwrap_or(u64::MAX))
            .collect();
        {
            let mut table = self.sessions.lock();
            for (t, cap) in news.turns.iter().zip(caps) {
                let at = now_ms.saturating_sub(t.age_ms);
                if table.pin(t.key).is_some_and(|p| p.served_ms >= at) {
                    continue;
                }
                table.served_within(t.key, t.endpoint, t.tokens, cap, at);
            }
        }
        let mut peers = self.peer_admission.lock();
        if peers.contains_key(&peer) || peers.len() < crate::inflight::MAX_PEERS {
            peers.insert(
                peer,
                PeerAdmission {
                    reserved: news.reserved,
                    first_since_ms: news.first_waiting_ms.map(|a| now_ms.saturating_sub(a)),
                    at_ms: now_ms,
                },
            );
        }
    }

    /// Forget what peers silent since `older_than_ms` said.
    pub fn expire_peers(&self, older_than_ms: u64) {
        self.peer_admission
            .lock()
            .retain(|_, p| p.at_ms >= older_than_ms);
    }

    /// What the peers reserved, as they last said.
    fn peers_reserved(&self) -> u64 {
        self.peer_admission
            .lock()
            .values()
            .map(|p| p.reserved)
            .sum()
    }

    /// Since when the earliest first turn in a peer's admission line waits.
    fn first_waiting_elsewhere(&self) -> Option<u64> {
        self.peer_admission
            .lock()
            .values()
            .filter_map(|p| p.first_since_ms)
            .min()
    }

    /// The KV capacity `endpoint`'s engine reports, in tokens.
    fn capacity_tokens(&self, endpoint: &EndpointId) -> Option<u64> {
        let pool = self.state.read();
        let e = pool.endpoints.get(endpoint)?;
        let blocks = pool.loads().get(endpoint)?.kv_capacity_blocks?;
        Some(blocks.saturating_mul(u64::from(e.model_config.block_size.max(1))))
    }

    /// Each endpoint's working set at `now_ms`: the running sums
    /// ([`SessionTable::live`]) with the turns past the horizon taken out first.
    pub fn working_sets(&self, now_ms: u64) -> hashbrown::HashMap<EndpointId, u64> {
        let mut sessions = self.sessions.lock();
        sessions.expire(now_ms);
        sessions.live().clone()
    }

    /// How long a session's context is taken to stay wanted ([`crate::session::ReuseHorizon`]).
    pub fn reuse_horizon_ms(&self) -> u64 {
        self.sessions.lock().horizon_ms()
    }

    /// Count a request of `prompt_tokens` (`uncached_tokens` of them to prefill) sent to
    /// `endpoint` until the guard drops; `has_blocks`: the prompt has a full KV block (see
    /// [`InflightTracker::begin_blocks`]). An endpoint that is no longer a member (it left
    /// after the request was placed) is counted nowhere, so no entry outlives it.
    pub fn begin(
        &self,
        endpoint: EndpointId,
        prompt_tokens: u64,
        uncached_tokens: u64,
        has_blocks: bool,
    ) -> InflightGuard {
        if self.state.endpoints().get(&endpoint).is_none() {
            return InflightTracker::begin_detached(prompt_tokens, uncached_tokens);
        }
        self.inflight
            .begin_blocks(endpoint, prompt_tokens, uncached_tokens, has_blocks)
    }
}

/// What a peer replica's session admission said last.
#[derive(Debug, Clone, Copy)]
struct PeerAdmission {
    reserved: u64,
    first_since_ms: Option<u64>,
    at_ms: u64,
}

/// The pool's headroom as the waiting room reads it, at one moment.
struct PoolHeadroom<'a> {
    pool: &'a Pool,
    saturation: crate::config::SaturationSettings,
    now_ms: u64,
}

impl<'a> PoolHeadroom<'a> {
    fn new(pool: &'a Pool, routing: &crate::config::RoutingConfig, now_ms: u64) -> Self {
        Self {
            pool,
            saturation: routing.saturation,
            now_ms,
        }
    }
}

impl Headroom for PoolHeadroom<'_> {
    fn free(&self, config: &str, sheddable: bool) -> u64 {
        let s = self.saturation;
        self.pool
            .free_slots(config, &if sheddable { s.for_band(-1) } else { s })
    }

    fn room(
        &self,
        session: Option<u64>,
        prompt_tokens: u32,
        reserved: u64,
    ) -> Result<Room, Admitted> {
        self.pool
            .room_of(session, prompt_tokens, reserved, self.now_ms)
    }

    fn first_elsewhere(&self) -> Option<u64> {
        self.pool.first_waiting_elsewhere()
    }
}

/// The waiting requests of an endpoint with `load`, to which the picker and its peers sent the
/// requests `c` (those without a first token yet are its own view of the queue): the engine's
/// count or the picker's, whichever is larger. While the engine is lightly used (no queue of its
/// own, its KV cache under half the saturation threshold) the picker counts only those past one
/// engine step ([`queued_beyond_one_step`]): a burst it prefills together is not a queue.
/// Otherwise all of them: a busy engine's next steps are shared with what it already runs, and
/// counting fewer let overload through to the protected bands (§9c of the benchmarks: the
/// critical band's p90 +14%, the light tenant's +19%, with the exemption at every load).
fn waiting_requests(
    load: &crate::load::EndpointLoad,
    c: crate::inflight::InflightCounts,
    step: u64,
    s: &crate::config::SaturationSettings,
) -> u64 {
    let engine = load.waiting.max(0.0) as u64;
    let picker = if load.waiting > 0.0 || load.kv_usage >= s.kv_cache_usage / 2.0 {
        c.pending_requests
    } else {
        queued_beyond_one_step(c, step)
    };
    engine.max(picker)
}

/// Of the requests sent to an endpoint that have no first token yet (`c`), those its engine
/// cannot be prefilling now: the part of their uncached tokens past one engine step
/// (`step`, `costModel.maxBatchedTokens`), in requests. A burst of short prompts that one
/// step prefills together is not a queue (vLLM schedules them all at once); forty prompts of
/// 8k tokens are.
pub fn queued_beyond_one_step(c: crate::inflight::InflightCounts, step: u64) -> u64 {
    if c.pending_tokens <= step || c.pending_requests == 0 {
        return 0;
    }
    let beyond = c.pending_tokens - step;
    (c.pending_requests.saturating_mul(beyond)).div_ceil(c.pending_tokens)
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};
    use std::sync::Arc;

    use super::*;
    use crate::config::{FailureMode, RoutingConfig, Strategy};
    use crate::endpoint::{Endpoint, EndpointState, ModelConfig};
    use crate::pool_state::StalenessChange;
    use crate::session::SharedTurn;

    fn id(n: u8) -> EndpointId {
        EndpointId::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, n)), 8000, 0)
    }

    fn pool(strategy: Strategy, failure_mode: FailureMode, n: u8) -> (Pool, Arc<ModelConfig>) {
        let routing = RoutingConfig {
            strategy,
            failure_mode,
            ..RoutingConfig::default()
        };
        pool_with(PoolSettings::default(), routing, n, None)
    }

    /// `n` precise endpoints `id(1..=n)` of model config `c`, with `capacity` blocks each.
    fn pool_with(
        settings: PoolSettings,
        routing: RoutingConfig,
        n: u8,
        capacity: Option<u64>,
    ) -> (Pool, Arc<ModelConfig>) {
        let mc = Arc::new(ModelConfig::new("c", "m"));
        let pool = Pool::new(settings, Router::new(routing));
        let members = (1..=n)
            .map(|i| PoolMember {
                endpoint: Endpoint::new(id(i), mc.clone()),
                precise: true,
                kv_capacity_blocks: capacity,
            })
            .collect();
        pool.apply_view(members, || {}).expect("view");
        (pool, mc)
    }

    fn load(waiting: f64, at: u64) -> EndpointLoad {
        EndpointLoad {
            waiting,
            sampled_at_ms: at,
            ..EndpointLoad::default()
        }
    }

    fn request<'a>(mc: &'a ModelConfig, session: Option<&'a str>) -> RouteRequest<'a> {
        RouteRequest {
            session,
            fallback_hash: 1,
            ..RouteRequest::whole(mc, &[], 8)
        }
    }

    fn state_of(pool: &Pool, e: EndpointId) -> EndpointState {
        pool.state().endpoints().get(&e).expect("member").state
    }

    /// The one staleness rule (issue 31), without sockets: an endpoint whose last good sample
    /// (or, never scraped, its first round) is older than `stalenessThreshold` (2 s) is marked
    /// stale at a scrape round, passed over while another is fresh, and recovers with its next
    /// sample; between rounds the router applies the same rule to the samples.
    #[test]
    fn staleness_is_one_rule_applied_at_scrape_rounds_and_between_them() {
        let (pool, mc) = pool(Strategy::LeastLoad, FailureMode::FailClose, 2);
        let (a, b) = (id(1), id(2));
        // b is idle but never answers its scrape; a is busy
        let out = pool.observe_scrape(0, [(a, load(5.0, 0))]);
        assert_eq!(
            (out.stale, out.changes.len()),
            (0, 0),
            "b is fresh from its first round"
        );
        let place = |now| pool.place(&request(&mc, None), now);
        assert_eq!(place(0).expect("placed").decision.endpoint, b, "idle b");
        let out = pool.observe_scrape(2_000, [(a, load(5.0, 2_000))]);
        assert_eq!(out.stale, 0, "exactly the threshold is not past it");
        let out = pool.observe_scrape(2_001, [(a, load(5.0, 2_001))]);
        assert_eq!(out.stale, 1);
        assert_eq!(
            out.changes,
            vec![StalenessChange {
                endpoint: b,
                stale: true,
                dropped: 0
            }]
        );
        assert_eq!(state_of(&pool, b), EndpointState::Stale);
        assert_eq!(
            place(2_001).expect("placed").decision.endpoint,
            a,
            "b passed over"
        );
        // b answers again: recovered at the round, and chosen again
        let out = pool.observe_scrape(2_100, [(a, load(5.0, 2_100)), (b, load(0.0, 2_100))]);
        assert_eq!((out.stale, out.changes.len()), (0, 1));
        assert_eq!(state_of(&pool, b), EndpointState::Ready);
        assert_eq!(place(2_100).expect("placed").decision.endpoint, b);
        // no round for 2 s: the router applies the rule to the samples themselves
        assert_eq!(
            place(4_101).map(|p| p.decision.endpoint),
            Err(PlaceError::Route(RouteError::AllStale("c".into()))),
            "both samples are past the threshold and the pool fails closed"
        );
        assert!(place(4_100).is_ok());
    }

    /// Issue 16: 32 requests sharing one new 8k-token prefix within 20 ms, before any
    /// `BlockStored` can arrive. Precise endpoints credit each routed request's blocks
    /// provisionally, so the burst stays on one endpoint until the balance guard moves it
    /// (and the next endpoint then collects the rest); without that, every request is a cold
    /// placement and the prefix is prefilled over and over.
    #[test]
    fn a_burst_sharing_a_new_prefix_is_kept_together_before_any_event() {
        use crate::block_keys::{BlockHasher, ChainRoot};
        let tokens: Vec<u32> = (0..8192).collect();
        let keys = BlockHasher::new(16).keys(ChainRoot::new("m", None, None), &tokens);
        let burst = |ttl_ms: u64| {
            let mut settings = PoolSettings::default();
            settings.budget.provisional_ttl_ms = ttl_ms;
            let routing = RoutingConfig {
                strategy: Strategy::CostModel,
                ..RoutingConfig::default()
            };
            let (pool, mc) = pool_with(settings, routing, 4, Some(100_000));
            pool.observe_scrape(0, (1..=4).map(|i| (id(i), load(0.0, 0))));
            let mut guards = Vec::new();
            let mut cold = 0;
            let mut placed = Vec::new();
            for i in 0..32u64 {
                let now = i * 20 / 32;
                let req = RouteRequest {
                    keys: &keys,
                    prompt_tokens: 8192,
                    ..request(&mc, None)
                };
                let p = pool.place(&req, now).expect("placed");
                let d = &p.decision;
                cold += u32::from(d.matched_blocks == 0);
                placed.push(d.endpoint);
                pool.record(&p, &keys, now);
                let uncached = 8192 - u64::from(d.cached_tokens);
                guards.push(pool.begin(d.endpoint, 8192, uncached, true));
            }
            // the TTL after the last of them (recorded at 19 ms), and no event: gone
            let later = pool
                .place(
                    &RouteRequest {
                        keys: &keys,
                        prompt_tokens: 8192,
                        ..request(&mc, None)
                    },
                    ttl_ms + 19,
                )
                .expect("placed");
            (cold, placed, later.decision.matched_blocks)
        };
        let (cold, placed, later) = burst(2_000);
        let first = placed[0];
        let on_first = placed.iter().filter(|&&e| e == first).count();
        let used: std::collections::HashSet<_> = placed.iter().collect();
        // one prefill per endpoint the guard opened, never more
        assert_eq!(cold as usize, used.len(), "{placed:?}");
        // the first endpoint takes the burst until it is `balance.absolute` (8) requests
        // ahead of the idle ones
        assert_eq!(on_first, 9, "{placed:?}");
        assert_eq!(later, 0, "a provisional credit never outlives its TTL");
        let (cold, _, _) = burst(0);
        assert_eq!(cold, 32, "without it every request of the burst is cold");
    }

    /// Issue 34, item 3: a picker that subscribes after the engine's replay window gets
    /// `BlockStored` events whose parents it never saw (orphans). The endpoint's view has a gap
    /// no event fills, so the picker's own routing record credits it for the approximate TTL
    /// (not the 2 s provisional one) until the engine's cache is cleared.
    #[test]
    fn a_view_with_a_gap_credits_the_routing_record_until_the_cache_is_cleared() {
        use crate::block_keys::{BlockHasher, ChainRoot};
        use crate::kv_events::ingest::IngestKeys;
        use crate::kv_events::{EventBatch, KvEvent};
        let tokens: Vec<u32> = (0..1024).collect();
        // 64 blocks, the last of which is computed again (one prompt token always is)
        const SERVABLE: u32 = 63;
        let keys = BlockHasher::new(16).keys(ChainRoot::new("m", None, None), &tokens);
        let routing = RoutingConfig {
            strategy: Strategy::CostModel,
            ..RoutingConfig::default()
        };
        let (pool, mc) = pool_with(PoolSettings::default(), routing, 2, Some(100_000));
        let batch = |events| EventBatch {
            ts: 0.0,
            events,
            data_parallel_rank: None,
            skipped_unknown: 0,
        };
        let ingest = IngestKeys {
            hasher: BlockHasher::new(16),
            model: "m",
        };
        let stored = |parent| KvEvent::plain_stored(vec![77], parent, (5000..5016).collect(), 16);
        // where the pool would place the request at `now`, every candidate explained
        let placed = |now: u64| {
            let req = RouteRequest {
                keys: &keys,
                prompt_tokens: 1024,
                explain: true,
                ..request(&mc, None)
            };
            pool.place(&req, now).expect("placed")
        };
        // per candidate: (endpoint, matched blocks, provisional blocks, gap), as /v1/pick shows
        let candidates = |now: u64| -> Vec<(String, u32, u32, bool)> {
            placed(now)
                .decision
                .candidates
                .iter()
                .map(|c| {
                    let f = &c.features;
                    (
                        c.endpoint.clone(),
                        f.matched_blocks,
                        f.provisional_blocks,
                        f.index_gap,
                    )
                })
                .collect()
        };
        let credited = |endpoint: EndpointId, now: u64| {
            let name = endpoint.to_string();
            candidates(now)
                .into_iter()
                .find(|c| c.0 == name)
                .map_or(0, |c| c.1)
        };
        // the request recorded as sent to `endpoint`, wherever the policy would put it
        let route = |endpoint: EndpointId, now: u64| {
            let mut p = placed(now);
            p.decision.endpoint = endpoint;
            pool.record(&p, &keys, now);
        };
        // endpoint 1 without a gap: the routing record lasts the provisional TTL
        route(id(1), 0);
        assert_eq!(
            credited(id(1), 1_000),
            SERVABLE,
            "provisional while the events are due"
        );
        assert_eq!(credited(id(1), 10_000), 0, "the provisional TTL has passed");
        // a request routed to endpoint 2, then an orphan store there (the request's own: the
        // engine extends a context the picker never saw): a gap, and the routing record lasts,
        // the credit given before the gap was known included
        route(id(2), 9_000);
        let s = pool
            .state()
            .apply_batch(&id(2), ingest, &batch(vec![stored(Some(12345))]))
            .expect("tracked");
        assert_eq!(s.orphan_blocks, 1);
        let s = pool
            .state()
            .apply_batch(&id(1), ingest, &batch(vec![stored(None)]))
            .expect("tracked");
        assert_eq!(s.orphan_blocks, 0, "a parentless store is no gap");
        assert_eq!(
            credited(id(2), 12_000),
            SERVABLE,
            "past the provisional TTL"
        );
        route(id(2), 10_000);
        assert_eq!(credited(id(2), 11_000), SERVABLE);
        assert_eq!(
            candidates(11_000),
            vec![
                (id(1).to_string(), 0, 0, false),
                (id(2).to_string(), SERVABLE, SERVABLE, true)
            ],
            "/v1/pick marks the credit that rests on the routing record"
        );
        assert_eq!(
            credited(id(2), 300_000),
            SERVABLE,
            "credited for the approximate TTL, not the provisional one"
        );
        assert_eq!(credited(id(2), 700_000), 0, "but not for ever");
        // the engine's cache is cleared (a restart, `reset_prefix_cache`): the gap is closed
        route(id(2), 700_000);
        pool.state()
            .apply_batch(&id(2), ingest, &batch(vec![KvEvent::AllBlocksCleared]))
            .expect("tracked");
        route(id(2), 700_000);
        assert_eq!(credited(id(2), 701_000), SERVABLE);
        assert_eq!(credited(id(2), 710_000), 0, "the provisional TTL again");
    }

    /// A routing edit replaces the policy only: pins and the turn count are the pool's. An
    /// endpoint that leaves is forgotten by every table.
    #[test]
    fn a_routing_edit_keeps_pins_and_turns_and_a_departure_forgets_them() {
        let (pool, mc) = pool(Strategy::RoundRobin, FailureMode::FailOpen, 3);
        pool.observe_scrape(0, (1..=3).map(|i| (id(i), load(0.0, 0))));
        let first = pool.place(&request(&mc, None), 0).expect("placed");
        pool.record(&first, &[], 0);
        let second = pool.place(&request(&mc, None), 0).expect("placed");
        assert_ne!(
            first.decision.endpoint, second.decision.endpoint,
            "a turn was taken"
        );
        let pinned = pool.place(&request(&mc, Some("s")), 0).expect("placed");
        pool.settle(
            pinned.session_key,
            u64::from(pinned.prompt_tokens),
            id(3),
            None,
            0,
        );
        let key = pinned.session_key.expect("a session");
        pool.set_router(Router::new(RoutingConfig {
            strategy: Strategy::RoundRobin,
            ..RoutingConfig::default()
        }));
        assert_eq!(pool.turn(), 1, "the turn count stays");
        assert_eq!(
            pool.place(&request(&mc, None), 0)
                .expect("placed")
                .decision
                .endpoint,
            second.decision.endpoint,
            "the new policy continues where the old one was"
        );
        assert_eq!(pool.pinned(key), Some(id(3)), "the pin stays");
        let _inflight = pool.begin(id(3), 8, 8, false);
        let members = (1..=2)
            .map(|i| PoolMember {
                endpoint: Endpoint::new(id(i), mc.clone()),
                precise: true,
                kv_capacity_blocks: None,
            })
            .collect();
        let gone = pool.apply_view(members, || {}).expect("view");
        assert_eq!(gone.removed, vec![id(3)]);
        assert_eq!(pool.pinned(key), None, "its pins are forgotten");
        assert_eq!(pool.inflight().get(&id(3)).requests, 0, "and its counts");
    }

    /// Session admission's room: the live context against the reported capacity (times the
    /// overcommit), a new session's footprint at least the mean live context, a returning
    /// one's its prompt; no room asked for requests without a session, live sessions, or
    /// while some endpoint reports no capacity.
    #[test]
    fn admission_room_counts_live_context_against_reported_capacity() {
        let (pool, mc) = pool(Strategy::CostModel, FailureMode::FailOpen, 2);
        let mut routing = RoutingConfig::default();
        routing.admission.enabled = true;
        pool.set_router(Router::new(routing.clone()));
        let new = request(&mc, Some("new"));
        assert_eq!(pool.gate(&new, 0), Gate::Admit(Admitted::CapacityUnknown));
        let capacity = |blocks: u64| {
            (1..=2).map(move |i| {
                (
                    id(i),
                    EndpointLoad {
                        kv_capacity_blocks: Some(blocks),
                        ..load(0.0, 0)
                    },
                )
            })
        };
        // 2 × 100 blocks of 16 tokens
        pool.observe_scrape(0, capacity(100));
        assert_eq!(
            pool.gate(&request(&mc, None), 0),
            Gate::Admit(Admitted::NoSession)
        );
        assert_eq!(pool.gate(&new, 0), Gate::Admit(Admitted::Fits));
        // two live sessions of 1,000 and 1,600 tokens (mean 1,300)
        let key = |s: &str| Router::session_key(None, Some(s)).expect("key");
        pool.pin(key("a"), id(1), 1_000, 0);
        pool.pin(key("b"), id(2), 1_600, 0);
        let room = pool.room(&new, 0).expect("asked");
        assert_eq!(
            room,
            Room {
                live_tokens: 2_600,
                capacity_tokens: 3_200,
                footprint_tokens: 1_300
            }
        );
        assert_eq!(pool.gate(&new, 0), Gate::Hold(room));
        assert_eq!(
            pool.gate(&request(&mc, Some("a")), 0),
            Gate::Admit(Admitted::LiveSession)
        );
        // a session seen before, back after its horizon, brings its prompt
        pool.pin(key("old"), id(1), 500, 1);
        let later = pool.reuse_horizon_ms() + 10;
        pool.pin(key("c"), id(2), 1_500, later);
        let back = pool.room(&request(&mc, Some("old")), later).expect("asked");
        assert_eq!(back.live_tokens, 1_500, "only c's context is still live");
        assert_eq!(back.footprint_tokens, 8, "its prompt");
        let fresh = pool.room(&new, later).expect("asked");
        assert_eq!(fresh.footprint_tokens, 1_500, "the mean live context");
        // overcommit scales the capacity
        routing.admission.overcommit = 1.5;
        pool.set_router(Router::new(routing));
        assert_eq!(pool.room(&new, 0).expect("asked").capacity_tokens, 4_800);
    }

    /// Issue 49: requests one engine step prefills together are not a queue; what is past the
    /// step is, in proportion.
    #[test]
    fn only_what_one_step_cannot_prefill_counts_as_waiting() {
        let c = |requests, tokens| crate::inflight::InflightCounts {
            requests,
            pending_requests: requests,
            pending_tokens: tokens,
            ..Default::default()
        };
        // forty prompts of 200 tokens: one step of 8,192 takes all but one
        assert_eq!(queued_beyond_one_step(c(40, 8_000), 8_192), 0);
        assert_eq!(queued_beyond_one_step(c(40, 8_400), 8_192), 1);
        // forty of 8k: all but one wait
        assert_eq!(queued_beyond_one_step(c(40, 40 * 8_192), 8_192), 39);
        assert_eq!(queued_beyond_one_step(c(0, 0), 8_192), 0);
        // only while the engine is lightly used: a queue of its own, or a KV cache at half the
        // threshold, and every request without a first token counts
        let s = crate::config::SaturationSettings::default();
        let idle = EndpointLoad {
            kv_usage: 0.1,
            ..EndpointLoad::default()
        };
        assert_eq!(waiting_requests(&idle, c(40, 8_000), 8_192, &s), 0);
        let queued = EndpointLoad {
            waiting: 1.0,
            ..idle
        };
        assert_eq!(waiting_requests(&queued, c(40, 8_000), 8_192, &s), 40);
        let full = EndpointLoad {
            kv_usage: s.kv_cache_usage / 2.0,
            ..idle
        };
        assert_eq!(waiting_requests(&full, c(40, 8_000), 8_192, &s), 40);
    }

    /// Two endpoints of 100 blocks of 16 tokens each (reported), session admission on, and
    /// the session key of a name.
    fn admitting_pool() -> (Pool, Arc<ModelConfig>, impl Fn(&str) -> u64) {
        let (pool, mc) = pool(Strategy::CostModel, FailureMode::FailOpen, 2);
        let mut routing = RoutingConfig::default();
        routing.admission.enabled = true;
        pool.set_router(Router::new(routing));
        pool.observe_scrape(
            0,
            (1..=2).map(|i| {
                (
                    id(i),
                    EndpointLoad {
                        kv_capacity_blocks: Some(100),
                        ..load(0.0, 0)
                    },
                )
            }),
        );
        (pool, mc, |s: &str| {
            Router::session_key(None, Some(s)).expect("key")
        })
    }

    /// Hardening IV, 12: the room (and `/v1/pick`'s answer) aged its sessions out only when a
    /// turn was served: a pool that went quiet still answered "hold" long after its sessions
    /// had left.
    #[test]
    fn a_quiet_pool_has_room_again_once_its_sessions_age_out() {
        let (pool, mc, key) = admitting_pool();
        pool.pin(key("a"), id(1), 1_600, 0);
        pool.pin(key("b"), id(2), 1_600, 0);
        let new = request(&mc, Some("new"));
        assert!(matches!(pool.gate(&new, 0), Gate::Hold(_)));
        // nothing is served after that; once the horizon has passed the pool is empty again
        let later = pool.reuse_horizon_ms() + 10;
        assert_eq!(pool.room(&new, later).expect("asked").live_tokens, 0);
        assert_eq!(pool.gate(&new, later), Gate::Admit(Admitted::Fits));
    }

    /// Issue 49, item 3: a session served through one replica was new to the others, so
    /// session admission held its next turn there as a newcomer (4 pickers: p90 TTFT 7.3x one
    /// picker's), and the others' reservations were not counted.
    #[test]
    fn a_session_live_at_one_replica_is_live_at_its_peers() {
        let (a, mc, key) = admitting_pool();
        let (b, _, _) = admitting_pool();
        for p in [&a, &b] {
            p.share_sessions();
        }
        a.pin(key("s"), id(2), 1_200, 100);
        let news = a.take_shared(130);
        assert_eq!(
            news.turns,
            vec![SharedTurn {
                key: key("s"),
                endpoint: id(2),
                tokens: 1_200,
                age_ms: 30
            }]
        );
        assert!(
            a.take_shared(131).turns.is_empty(),
            "each turn is sent once"
        );
        // before b hears of it, s's next turn is a newcomer there
        assert_eq!(
            b.gate(&request(&mc, Some("s")), 140),
            Gate::Admit(Admitted::Fits)
        );
        b.apply_shared(1, &news, 140);
        assert_eq!(b.pinned(key("s")), Some(id(2)));
        assert_eq!(
            b.gate(&request(&mc, Some("s")), 140),
            Gate::Admit(Admitted::LiveSession)
        );
        // its context counts in b's room, and what a reserved for a turn it admitted too
        let room = b.room(&request(&mc, Some("new")), 140).expect("asked");
        assert_eq!(room.live_tokens, 1_200);
        let held = SessionNews {
            reserved: 1_000,
            first_waiting_ms: Some(40),
            ..SessionNews::default()
        };
        b.apply_shared(1, &held, 150);
        assert_eq!(b.first_waiting_elsewhere(), Some(110), "in b's clock");
        let room = b.room(&request(&mc, Some("new")), 150).expect("asked");
        assert_eq!(room.live_tokens, 2_200);
        assert!(!room.fits(), "1,200 + 1,000 + 1,200 > 3,200");
        // a peer that goes silent takes its reservation with it
        b.expire_peers(151);
        assert_eq!(b.first_waiting_elsewhere(), None);
        assert_eq!(
            b.room(&request(&mc, Some("new")), 160)
                .expect("asked")
                .live_tokens,
            1_200
        );
        // an older turn heard late does not move a pin this replica set since
        b.pin(key("s"), id(1), 400, 200);
        let late = SharedTurn {
            key: key("s"),
            endpoint: id(2),
            tokens: 1_200,
            age_ms: 100,
        };
        let news = SessionNews {
            turns: vec![late],
            ..SessionNews::default()
        };
        b.apply_shared(1, &news, 210);
        assert_eq!(b.pinned(key("s")), Some(id(1)));
    }

    /// Hardening IV, 5: one session larger than its engine's cache counted in full and raised
    /// the mean charged to every unseen session (a 10-token prompt was charged 744 tokens),
    /// so every new session waited `maxWait` while it stayed live.
    #[test]
    fn an_oversized_session_counts_for_one_engine_and_not_in_the_mean() {
        let (pool, mc, key) = admitting_pool();
        pool.pin(key("small"), id(1), 400, 0);
        // a turn of 50,000 tokens on an engine that holds 1,600
        pool.pin(key("huge"), id(2), 50_000, 0);
        let new = request(&mc, Some("new"));
        let room = pool.room(&new, 0).expect("asked");
        assert_eq!(
            room,
            Room {
                live_tokens: 2_000,
                capacity_tokens: 3_200,
                footprint_tokens: 400
            },
            "the huge one counts for its engine's cache, the mean is the small one's"
        );
        assert_eq!(pool.gate(&new, 0), Gate::Admit(Admitted::Fits));
        // a first turn larger than the pool is charged one engine's cache, not its prompt
        let mut big = request(&mc, Some("big"));
        big.prompt_tokens = 1_000_000;
        assert_eq!(pool.room(&big, 0).expect("asked").footprint_tokens, 1_600);
    }

    /// A pool of `roles` (endpoint `i + 1` has `roles[i]`), disaggregating in `mode`, every
    /// endpoint scraped idle at 0 with room for 10k blocks, on an approximate index.
    fn pd_pool(mode: DisaggregationMode, roles: &[Role]) -> (Pool, Arc<ModelConfig>) {
        let mc = Arc::new(ModelConfig::new("c", "m"));
        let mut routing = RoutingConfig::default();
        routing.disaggregation.mode = mode;
        let pool = Pool::new(PoolSettings::default(), Router::new(routing));
        let members = roles
            .iter()
            .enumerate()
            .map(|(i, role)| {
                let mut endpoint = Endpoint::new(id(i as u8 + 1), mc.clone());
                endpoint.role = *role;
                PoolMember {
                    endpoint,
                    precise: false,
                    kv_capacity_blocks: Some(10_000),
                }
            })
            .collect();
        pool.apply_view(members, || {}).expect("view");
        pool.observe_scrape(0, (1..=roles.len() as u8).map(|i| (id(i), load(0.0, 0))));
        (pool, mc)
    }

    fn prompt(tokens: u32, seed: u32) -> Vec<BlockKey> {
        use crate::block_keys::{BlockHasher, ChainRoot};
        let ids: Vec<u32> = (0..tokens).map(|t| t.wrapping_mul(31) ^ seed).collect();
        BlockHasher::new(16).keys(ChainRoot::new("m", None, None), &ids)
    }

    fn split<'a>(
        pool: &Pool,
        mc: &'a ModelConfig,
        keys: &'a [BlockKey],
        tokens: u32,
    ) -> SplitPlacement {
        let req = RouteRequest {
            keys,
            prompt_tokens: tokens,
            ..request(mc, Some("s"))
        };
        pool.place_split(&req, 10).expect("placed")
    }

    #[test]
    fn without_prefill_endpoints_nothing_is_split_and_the_placement_is_the_usual_one() {
        let (pool, mc) = pd_pool(DisaggregationMode::Always, &[Role::Both, Role::Both]);
        let keys = prompt(4096, 1);
        let s = split(&pool, &mc, &keys, 4096);
        assert_eq!(s.verdict, Verdict::NoPrefillEndpoint);
        assert!(s.prefill.is_none());
        let req = RouteRequest {
            keys: &keys,
            prompt_tokens: 4096,
            ..request(&mc, Some("s"))
        };
        assert_eq!(s.placement, pool.place(&req, 10).expect("placed"));
    }

    #[test]
    fn a_prefill_endpoint_never_takes_a_whole_request() {
        let (pool, mc) = pd_pool(DisaggregationMode::Off, &[Role::Prefill, Role::Decode]);
        for seed in 0..16 {
            let keys = prompt(256, seed);
            let s = split(&pool, &mc, &keys, 256);
            assert_eq!(s.verdict, Verdict::Off);
            assert_eq!(s.placement.decision.endpoint, id(2));
            assert!(!s.placement.decision.fallbacks.contains(&id(1)));
        }
        // nor through the plain placement
        let keys = prompt(256, 99);
        let req = RouteRequest {
            keys: &keys,
            prompt_tokens: 256,
            ..request(&mc, None)
        };
        assert_eq!(
            pool.place(&req, 10).expect("placed").decision.endpoint,
            id(2)
        );
    }

    #[test]
    fn auto_splits_only_when_enough_of_the_prompt_is_uncached_where_it_would_run_whole() {
        let (pool, mc) = pd_pool(
            DisaggregationMode::Auto,
            &[Role::Prefill, Role::Decode, Role::Decode],
        );
        // 4096 tokens, none cached: split, prefill on 1
        let keys = prompt(4096, 7);
        let s = split(&pool, &mc, &keys, 4096);
        assert_eq!(
            s.verdict,
            Verdict::Split {
                uncached_tokens: 4096
            }
        );
        let prefill = s.prefill.as_ref().expect("split");
        assert_eq!(prefill.decision.endpoint, id(1));
        assert_ne!(s.placement.decision.endpoint, id(1));
        // a decode endpoint holds all but the last 256 tokens (the conversation's earlier
        // turns): under the 512 threshold, it runs whole there
        pool.state()
            .record_routed(&id(3), &keys[..keys.len() - 16], 10);
        let s = split(&pool, &mc, &keys, 4096);
        assert_eq!(
            s.verdict,
            Verdict::FewUncached {
                uncached_tokens: 256,
                min: 512
            }
        );
        assert!(s.prefill.is_none());
        assert_eq!(s.placement.decision.endpoint, id(3));
        // a short prompt is never split
        let short = prompt(300, 8);
        assert!(!split(&pool, &mc, &short, 300).verdict.splits());
    }

    #[test]
    fn a_busy_prefill_endpoint_is_not_split_on_unless_always() {
        let (pool, mc) = pd_pool(DisaggregationMode::Auto, &[Role::Prefill, Role::Decode]);
        pool.observe_scrape(20, [(id(1), load(8.0, 20)), (id(2), load(0.0, 20))]);
        let keys = prompt(4096, 3);
        let s = split(&pool, &mc, &keys, 4096);
        assert_eq!(s.verdict, Verdict::PrefillBusy { queue: 8.0, max: 8 });
        assert_eq!(s.placement.decision.endpoint, id(2));

        let (pool, mc) = pd_pool(DisaggregationMode::Always, &[Role::Prefill, Role::Decode]);
        pool.observe_scrape(20, [(id(1), load(8.0, 20)), (id(2), load(0.0, 20))]);
        let short = prompt(64, 3);
        let s = split(&pool, &mc, &short, 64);
        assert_eq!(
            s.verdict,
            Verdict::Always {
                uncached_tokens: 64
            }
        );
        assert_eq!(s.prefill.expect("split").decision.endpoint, id(1));
    }

    #[test]
    fn prefill_goes_where_the_prefix_is_and_decode_where_the_conversation_is() {
        let (pool, mc) = pd_pool(
            DisaggregationMode::Auto,
            &[Role::Prefill, Role::Prefill, Role::Decode, Role::Decode],
        );
        let keys = prompt(8192, 5);
        // prefill 2 holds all but 512 tokens, decode 4 the first half
        pool.state().record_routed(&id(2), &keys[..480], 10);
        pool.state().record_routed(&id(4), &keys[..256], 10);
        let s = split(&pool, &mc, &keys, 8192);
        assert_eq!(
            s.verdict,
            Verdict::Split {
                uncached_tokens: 512
            }
        );
        assert_eq!(s.prefill.expect("split").decision.endpoint, id(2));
        // the decode endpoint needs no transfer for the half it holds
        assert_eq!(s.placement.decision.endpoint, id(4));
        assert_eq!(s.placement.decision.policy, "Decode");
    }

    #[test]
    fn a_prefill_predicted_far_slower_than_running_whole_is_not_split() {
        let (pool, mc) = pd_pool(
            DisaggregationMode::Auto,
            &[Role::Prefill, Role::Decode, Role::Decode],
        );
        let keys = prompt(8192, 6);
        // decode 3 holds all but 512 tokens; the prefill endpoint nothing: prefilling 8192
        // tokens there and moving their KV takes far longer than 512 tokens on 3
        pool.state().record_routed(&id(3), &keys[..480], 10);
        let s = split(&pool, &mc, &keys, 8192);
        let Verdict::PrefillSlower { split_ms, whole_ms } = s.verdict else {
            panic!("{:?}", s.verdict);
        };
        assert!(split_ms > 2.0 * whole_ms, "{split_ms} vs {whole_ms}");
        assert_eq!(s.placement.decision.endpoint, id(3));
        // with a looser ratio it is split
        let mut routing = pool.router().config().clone();
        routing.disaggregation.max_ttft_ratio = 100.0;
        pool.set_router(Router::new(routing));
        assert!(split(&pool, &mc, &keys, 8192).verdict.splits());
    }

    #[test]
    fn asking_where_a_split_request_goes_changes_nothing() {
        let (pool, mc) = pd_pool(DisaggregationMode::Auto, &[Role::Prefill, Role::Decode]);
        let keys = prompt(4096, 11);
        let a = split(&pool, &mc, &keys, 4096);
        let b = split(&pool, &mc, &keys, 4096);
        assert_eq!(a, b);
        assert_eq!(pool.turn(), 0);
        assert_eq!(
            pool.pinned(Router::session_key(None, Some("s")).expect("key")),
            None
        );
    }
}
