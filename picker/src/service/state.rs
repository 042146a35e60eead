//! The picker's shared state and the request → decision path used by the HTTP proxy, the
//! pick API and ext_proc alike.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::HeaderMap;
use serde_json::Value;
use tokio::sync::Semaphore;

use super::declared::{DeclaredPool, KvPorts, ModelEntry, PoolChange};
use super::diagnostics::{Diagnostics, Finding};
use super::errors::ApiError;
use super::metrics::{DecisionLabels, EndpointLabels, KindLabels, Metrics, MisconfigLabels};
use super::request::{ApiKind, ParsedRequest, engine_body};
use super::responses::{Known, ResponseOwner, ResponseWatch, Responses, conversation_named_after};
use super::settings::{IndexSettings, Limits};
use super::telemetry;
use super::tenancy::Tenancy;
use tracing::Instrument as _;

use super::flow::{NoTurn, Waiters};
use crate::admission::{Admitted, Gate, Ticket};
use crate::config::{FailureMode, FlowPlacement, RoutingConfig, UnattainableSlo};
use crate::endpoint::{
    Endpoint, EndpointId, EndpointState, EngineKind, ModelConfig, RankSelection,
};
use crate::error::PickerError;
use crate::waiting::{Arrival, Pass, Refusal, Slo, slo_verdict};

use crate::inflight::InflightGuard;
use crate::place::{PlaceError, Placement, Pool, SplitPlacement, Verdict};
use crate::plan::{PlanInput, RequestPlan, Scope};
use crate::pool::Isolation;
use crate::pool_state::{Membership, PoolMember};
use crate::router::{RouteError, RouteRequest, Router, subset_allows};
use crate::tokenize::{PromptInput, TokenKind, TokenizeError};

/// Request bodies from this size on are tokenized in `block_in_place` (about 8k tokens of text),
/// a few at a time (`PickerState::tokenize_slots`).
const BLOCKING_TOKENIZE_BYTES: usize = 32 * 1024;

/// Headers the picker sets on the request it forwards (name, value).
pub type UpstreamHeaders = Vec<(&'static str, String)>;

/// A routed request.
#[derive(Debug)]
pub struct Routed {
    /// Where it goes ([`Pool::place`]), committed by [`PickerState::decide`] for a forwarded
    /// request and by [`PickerState::served`] once an endpoint answered it.
    pub placement: Placement,
    pub entry: Arc<ModelEntry>,
    /// What the router was given: keys, salt, session, prompt size.
    pub plan: RequestPlan,
    pub tenant: Option<String>,
    pub lora: Option<String>,
    /// The request for the chosen endpoint, built when it was decided (a body that cannot
    /// carry what the engine must see is refused then, before anything is recorded).
    pub upstream: Upstream,
    /// Session admission: what the gate says of this request (the pick API shows it), and the
    /// ticket it was admitted with after waiting (its reservation goes once it is served).
    pub admission: Gate,
    pub admission_ticket: Option<Ticket>,
    /// The API the request came in on.
    pub api: ApiKind,
    /// The model a rewrite rule sent the request to, and the one it named.
    pub rewrite: Option<ModelRewritten>,
    /// Where a split request is prefilled (`placement` is then its decode).
    pub prefill: Option<Placement>,
    /// Whether it is split, and why ([`Pool::place_split`]).
    pub verdict: Verdict,
}

/// A request a `routing.modelRewrites` rule sent to another model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelRewritten {
    /// The model the client named (the response says this one).
    pub asked: String,
    /// The model the engine is sent.
    pub target: String,
}

/// What the picker forwards to one endpoint beyond the client's request: extra headers and
/// the body ([`engine_body`]).
#[derive(Debug, Clone)]
pub struct Upstream {
    pub headers: UpstreamHeaders,
    pub body: Bytes,
}

/// What the caller of [`PickerState::decide`] does with the decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// The request is forwarded (by the proxy, or by the gateway): the decision is recorded
    /// (metrics; the approximate index learns the prompt's blocks).
    Forward,
    /// The pick API: explained per candidate, recorded nowhere.
    Explain,
}

impl Routed {
    /// The key the request's session is pinned under, when it has a session.
    pub fn session_key(&self) -> Option<u64> {
        self.placement.session_key
    }

    /// The chosen endpoint, then the fallbacks, in the order to try them.
    pub fn targets(&self) -> impl Iterator<Item = EndpointId> + '_ {
        std::iter::once(self.placement.decision.endpoint)
            .chain(self.placement.decision.fallbacks.iter().copied())
    }

    /// Prompt tokens `endpoint` must prefill: the uncached rest on the chosen endpoint (what
    /// the router credited), the whole prompt on a fallback; none on the decode endpoint of a
    /// split request (its KV is pulled), the uncached rest on its prefill endpoint.
    pub fn uncached_on(&self, endpoint: EndpointId) -> u32 {
        if let Some(prefill) = &self.prefill {
            return if endpoint == prefill.decision.endpoint {
                self.plan
                    .prompt_tokens
                    .saturating_sub(prefill.decision.cached_tokens)
            } else if prefill.decision.fallbacks.contains(&endpoint) {
                self.plan.prompt_tokens
            } else {
                0
            };
        }
        if endpoint == self.placement.decision.endpoint {
            self.plan
                .prompt_tokens
                .saturating_sub(self.placement.decision.cached_tokens)
        } else {
            self.plan.prompt_tokens
        }
    }

    /// The request to send to `endpoint` (a fallback; the chosen one's is [`Routed::upstream`]).
    pub fn upstream_for(
        &self,
        req: &ParsedRequest,
        endpoint: EndpointId,
    ) -> Result<Upstream, ApiError> {
        upstream_request(
            &self.entry.config,
            &self.plan,
            req,
            endpoint,
            self.rewrite.as_ref(),
        )
    }
}

/// The request to send to `endpoint`: the data-parallel rank (a header, or SGLang's body
/// field) and the tenant's salt, which every forwarded body must carry.
fn upstream_request(
    mc: &ModelConfig,
    plan: &RequestPlan,
    req: &ParsedRequest,
    endpoint: EndpointId,
    rewrite: Option<&ModelRewritten>,
) -> Result<Upstream, ApiError> {
    let mut headers = Vec::new();
    let mut body_rank = None;
    if mc.dp_size > 1 && mc.rank_selection == RankSelection::Header {
        match mc.engine {
            EngineKind::Sglang => body_rank = Some(endpoint.rank),
            _ => headers.push(("x-data-parallel-rank", endpoint.rank.to_string())),
        }
    }
    let tenant_salt = plan.salt.as_deref().filter(|_| plan.tenant_salted);
    Ok(Upstream {
        headers,
        body: engine_body(
            req,
            tenant_salt,
            body_rank,
            rewrite.map(|r| r.target.as_str()),
        )?,
    })
}

/// The routing configuration of the router in force ([`PickerState::routing`]).
#[derive(Debug, Clone)]
pub struct Routing(Arc<Router>);

impl std::ops::Deref for Routing {
    type Target = RoutingConfig;

    fn deref(&self) -> &RoutingConfig {
        self.0.config()
    }
}

/// The shared state of one picker.
pub struct PickerState {
    /// Every per-endpoint table a decision reads (the endpoint set, index, loads, in-flight
    /// counts, session pins, calibration, ejections) and the routing policy.
    pub pool: Pool,
    /// The pool's [`PoolState::version`], sent on every change (the KV-event manager and
    /// readiness wake on it).
    pool_changes: tokio::sync::watch::Sender<u64>,
    catalog: ArcSwap<BTreeMap<String, Arc<ModelEntry>>>,
    tenancy: ArcSwap<Tenancy>,
    pub limits: Limits,
    pub metrics: Metrics,
    pub http: reqwest::Client,
    start: Instant,
    inflight_total: AtomicUsize,
    /// Set once the scraper has been over the endpoints once (readiness waits on it).
    pub first_metrics: tokio::sync::watch::Sender<bool>,
    /// Whether a pool view has been applied: before that, an unknown model means "not loaded
    /// yet" (503), not "no such model" (404), and `start` waits on it.
    pub pool_loaded: tokio::sync::watch::Sender<bool>,
    render_slots: Semaphore,
    /// Long prompts encoded at once (in `block_in_place`): one per CPU the process may run on.
    /// Each adds a thread, and past the CPUs more threads only share them thinner: the
    /// KV-event thread's share with them, so that under a flood of long prompts the index
    /// fell seconds behind (`picker/BENCHMARKS.md` §4), and every prompt's encoding with the
    /// others', where a queue finishes the first ones first.
    tokenize_slots: Semaphore,
    /// Bytes of request bodies being read (`bodyBufferBytes`), apart from admission.
    pub body_buffer: Semaphore,
    /// Misconfigurations seen per endpoint (block size, KV events that never arrive).
    pub diagnostics: parking_lot::Mutex<Diagnostics>,
    /// Recent Responses and the endpoints storing them.
    pub responses: Responses,
    /// The requests waiting at the pool's gate ([`super::flow`]).
    pub waiters: Waiters,
    /// This replica's random id (its index copies carry it, so that it skips its own).
    pub replica: u64,
    /// Where the index it started with came from ([`super::warm_start`]).
    pub warm: parking_lot::Mutex<super::warm_start::WarmStatus>,
    /// The KV event publishers the engines list ([`super::feeds::sources`]).
    pub event_sources: super::feeds::sources::EventSources,
}

impl std::fmt::Debug for PickerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PickerState")
            .field("pool", &self.pool)
            .finish()
    }
}

impl PickerState {
    pub fn new(limits: Limits, index_settings: IndexSettings) -> Result<Self, PickerError> {
        let http = reqwest::Client::builder()
            .connect_timeout(limits.connect_timeout)
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(1024)
            .tcp_nodelay(true)
            .build()
            .map_err(PickerError::HttpClient)?;
        Ok(Self {
            pool: Pool::new(
                index_settings.pool_settings(&limits),
                Router::new(RoutingConfig::default()),
            ),
            pool_changes: tokio::sync::watch::Sender::new(0),
            catalog: ArcSwap::from_pointee(BTreeMap::new()),
            tenancy: ArcSwap::from_pointee(Tenancy::default()),
            render_slots: Semaphore::new(limits.max_render_concurrency),
            tokenize_slots: Semaphore::new(
                std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
            ),
            body_buffer: Semaphore::new(limits.body_buffer_bytes.min(Semaphore::MAX_PERMITS)),
            limits,
            metrics: Metrics::new(),
            http,
            start: Instant::now(),
            inflight_total: AtomicUsize::new(0),
            first_metrics: tokio::sync::watch::Sender::new(false),
            pool_loaded: tokio::sync::watch::Sender::new(false),
            diagnostics: parking_lot::Mutex::new(Diagnostics::default()),
            responses: Responses::default(),
            waiters: Waiters::default(),
            replica: rand::random(),
            warm: parking_lot::Mutex::default(),
            event_sources: Default::default(),
        })
    }

    /// Counts a rejected pool view or secret reload by its error.
    pub fn count_rejection(&self, error: &PickerError) {
        self.metrics
            .config_rejections
            .get_or_create(&super::metrics::ErrorLabels {
                error: error.metric_label().to_owned(),
            })
            .inc();
    }

    /// Reports what [`Diagnostics`] found: a warning (once, since a finding is raised once)
    /// and the `endpoint_misconfigured` gauge.
    pub fn report(&self, finding: Option<Finding>) {
        let Some(finding) = finding else { return };
        match finding {
            Finding::Raised {
                endpoint,
                reason,
                message,
            } => {
                tracing::warn!(%endpoint, reason, "endpoint misconfigured: {message}");
                self.metrics
                    .endpoint_misconfigured
                    .get_or_create(&MisconfigLabels {
                        endpoint: endpoint.to_string(),
                        reason: reason.to_owned(),
                    })
                    .set(1);
            }
            Finding::Cleared { endpoint, reason } => {
                tracing::info!(%endpoint, reason, "endpoint misconfiguration resolved");
                self.metrics
                    .endpoint_misconfigured
                    .remove(&MisconfigLabels {
                        endpoint: endpoint.to_string(),
                        reason: reason.to_owned(),
                    });
            }
        }
    }

    /// Milliseconds since this picker started (the clock of loads and the index).
    pub fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// The routing configuration in force: the router's own, so one request reads the
    /// policy, flow control and admission of one edit together (they had two owners, stored
    /// one after the other).
    pub fn routing(&self) -> Routing {
        Routing(self.pool.router())
    }

    pub fn router(&self) -> Arc<Router> {
        self.pool.router()
    }

    pub fn catalog(&self) -> Arc<BTreeMap<String, Arc<ModelEntry>>> {
        self.catalog.load_full()
    }

    pub fn model_entry(&self, name: &str) -> Option<Arc<ModelEntry>> {
        self.catalog.load().get(name).cloned()
    }

    /// The model a request that names none is for, as a vLLM server serves its one model: the
    /// pool's base model when it serves exactly one (its LoRA adapters are named to be used);
    /// else a 400 listing them.
    fn the_one_model(&self) -> Result<String, ApiError> {
        let catalog = self.catalog.load();
        let mut models: Vec<&str> = catalog.values().map(|e| e.spec.model.as_str()).collect();
        models.sort_unstable();
        models.dedup();
        match models.as_slice() {
            [one] => Ok((*one).to_owned()),
            [] => Err(self.no_such_model("")),
            many => Err(ApiError::bad_request(
                "missing_field",
                format!(
                    "missing required field `model`: this pool serves {}",
                    many.iter()
                        .map(|m| format!("`{m}`"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )),
        }
    }

    /// The error for a model the pool does not serve: 404, or 503 `not_ready` while no pool
    /// view has been applied yet (the model may well be there once it is).
    fn no_such_model(&self, model: &str) -> ApiError {
        if *self.pool_loaded.borrow() {
            ApiError::unknown_model(model)
        } else {
            ApiError::unavailable(
                "not_ready",
                "the picker has not loaded its pool yet; retry shortly",
            )
        }
    }

    /// Apply what a source reports. Invalid views are rejected whole and the previous one
    /// stays in force, so a bad edit never drops traffic.
    pub fn apply_pool(&self, view: &DeclaredPool) -> Result<PoolChange, PickerError> {
        let routing_changed = *self.routing() != view.routing;
        view.routing.validate()?;
        view.routing
            .check_rewrite_targets(&view.model_configs)
            .map_err(PickerError::Invalid)?;
        view.tenancy.validate()?;
        let tenancy = Tenancy::new(view.tenancy.clone())?;
        // rebuild the catalog only for model configs that changed (tokenizers are costly)
        let old = self.catalog.load_full();
        let mut catalog = BTreeMap::new();
        for (i, spec) in view.model_configs.iter().enumerate() {
            spec.validate(i)?;
            let entry = match old.get(&spec.name) {
                Some(e) if e.spec == *spec => e.clone(),
                _ => Arc::new(ModelEntry::build(spec, &self.limits)?),
            };
            catalog.insert(spec.name.clone(), entry);
        }
        super::source::check_view_endpoints_unique(&view.endpoints)?;
        let mut members = Vec::with_capacity(view.endpoints.len());
        for ev in &view.endpoints {
            let Some(entry) = catalog.get(&ev.model_config) else {
                return Err(PickerError::UnknownModelConfig {
                    endpoint: ev.id.to_string(),
                    config: ev.model_config.clone(),
                });
            };
            let mut e = Endpoint::new(ev.id, entry.config.clone());
            // the operator lists no pod whose role label does not parse; a config file's
            // was refused when it was read
            e.role = crate::endpoint::Role::from_labels(&ev.labels).map_err(|message| {
                PickerError::Invalid(format!("endpoint {}: {message}", ev.id))
            })?;
            e.labels = ev.labels.clone();
            if !ev.serving {
                e.state = EndpointState::Draining;
            }
            e.kv_ports = ev.kv_ports;
            members.push(PoolMember {
                endpoint: e,
                precise: entry.precise(),
                kv_capacity_blocks: entry.spec.kv_capacity_blocks,
            });
        }
        // what the new endpoints refer to is in place before they appear
        let Membership { added, removed } = self.pool.apply_view(members, || {
            self.catalog.store(Arc::new(catalog));
            self.tenancy.store(Arc::new(tenancy));
            if routing_changed {
                // the new policy; pins, turns, calibration and ejections are the pool's
                self.pool.set_router(Router::new(view.routing.clone()));
            }
        })?;
        self.pool_changed();
        self.sync_outlier_pool(&removed);
        self.sync_calibration(&removed);
        self.metrics
            .endpoints
            .set(self.pool.state().endpoints().len() as i64);
        self.pool_loaded
            .send_if_modified(|loaded| !std::mem::replace(loaded, true));
        Ok(PoolChange {
            added,
            removed,
            routing_changed,
        })
    }

    /// Wake the loops waiting on the pool when it changed ([`PickerState::watch_pool`]).
    pub fn pool_changed(&self) {
        let version = self.pool.state().version();
        self.pool_changes
            .send_if_modified(|seen| std::mem::replace(seen, version) != version);
    }

    /// Wakes on every change of the endpoint set and on every applied view.
    pub fn watch_pool(&self) -> tokio::sync::watch::Receiver<u64> {
        self.pool_changes.subscribe()
    }

    /// Re-read the tenancy salt secret; `true` when it changed and the new salts apply.
    /// Requests routed after this carry salts under the new secret (so the engines start
    /// cold for every tenant, as they should after a rotation).
    pub fn reload_tenancy_secret(&self) -> Result<bool, PickerError> {
        let current = self.tenancy.load_full();
        match current.reloaded()? {
            Some(next) => {
                self.tenancy.store(Arc::new(next));
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// The tenancy in force.
    pub fn tenancy(&self) -> Arc<Tenancy> {
        self.tenancy.load_full()
    }

    /// Ready: endpoints are known and every scraped endpoint has reported once.
    pub fn is_ready(&self) -> bool {
        !self.pool.state().endpoints().is_empty() && *self.first_metrics.borrow()
    }

    /// An endpoint for a request that names no model (a bodyless request through the gateway,
    /// such as `GET /v1/models`): for `GET /v1/responses/{id}` and `POST
    /// /v1/responses/{id}/cancel` the endpoint storing that response when it is known and
    /// eligible (Ready or Stale: stale metrics do not move a stored response), a 404 when it
    /// is another tenant's, else the least-loaded Ready endpoint of any model config that the
    /// tenant may use, within the gateway's subset (a Stale one under `FailOpen` when none
    /// is Ready).
    pub fn pick_bodyless(
        &self,
        path: &str,
        headers: &HeaderMap,
        subset: Option<&[SocketAddr]>,
    ) -> Result<EndpointId, ApiError> {
        let tenancy = self.tenancy.load_full();
        let tenant = tenancy.tenant_of(headers)?;
        let ejected = self.ejected_endpoints();
        let snapshot = self.pool.state().endpoints();
        let allowed = |e: &Endpoint| {
            subset.is_none_or(|s| subset_allows(s, SocketAddr::new(e.id.address, e.id.port)))
                && tenancy.allows(tenant.as_deref(), e)
        };
        if let Some(id) = stored_response_id(path) {
            match self.responses.lookup(id, tenant.as_deref()) {
                Known::Here(owner) => {
                    if let Some(e) = snapshot
                        .get(&owner.endpoint)
                        .filter(|e| e.state != EndpointState::Draining && allowed(e))
                    {
                        return Ok(e.id);
                    }
                }
                Known::OtherTenant => return Err(ApiError::unknown_response(id)),
                Known::Unknown => {}
            }
        }
        let fail_open = self.routing().failure_mode == FailureMode::FailOpen;
        let least_loaded = |state: EndpointState| {
            snapshot
                .endpoints()
                .iter()
                .filter(|e| e.state == state && allowed(e))
                // an endpoint passive health ejected only when nothing else is eligible
                .min_by_key(|e| {
                    let ejected = ejected.binary_search(&e.id).is_ok();
                    (ejected, self.pool.inflight().get(&e.id).requests, e.id)
                })
                .map(|e| e.id)
        };
        least_loaded(EndpointState::Ready)
            .or_else(|| {
                fail_open
                    .then(|| least_loaded(EndpointState::Stale))
                    .flatten()
            })
            .ok_or_else(|| {
                ApiError::unavailable(
                    "no_eligible_endpoint",
                    "no serving endpoint is eligible for this request",
                )
            })
    }

    /// The one front door for decisions, shared by the proxy, the pick API and the ext_proc
    /// picker: tenant and model checks, tokenizing, the request plan, the router (within the
    /// gateway's `subset`, matched by [`subset_allows`]), the in-flight cap, the upstream
    /// request for the chosen endpoint, and, for a request that is forwarded, the record of
    /// the decision.
    pub async fn decide(
        &self,
        req: &ParsedRequest,
        headers: &HeaderMap,
        subset: Option<&[SocketAddr]>,
        purpose: Purpose,
    ) -> Result<Routed, ApiError> {
        let routed = self.route(req, headers, subset, purpose).await?;
        if purpose == Purpose::Forward {
            self.record_routed(&routed);
        }
        Ok(routed)
    }

    /// Tokenize, hash, wait for the request's turn (forwarded requests only: the pick API's
    /// are explained per candidate and never held, the gate's answer is shown instead) and
    /// decide; a TTFT objective no endpoint is predicted to meet sends it back through the
    /// gate or answers it now ([`slo_verdict`]).
    async fn route(
        &self,
        req: &ParsedRequest,
        headers: &HeaderMap,
        subset: Option<&[SocketAddr]>,
        purpose: Purpose,
    ) -> Result<Routed, ApiError> {
        let mut started = Instant::now();
        let snapshot = self.pool.state().endpoints();
        let routing = self.routing();
        let tenancy = self.tenancy.load_full();
        let (tenant, session) = self.caller(req, headers, &routing, &tenancy)?;
        let target = self.target(req, &snapshot, &routing, session.as_deref())?;
        let salt = tenancy.salt(tenant.as_deref());
        let plan = self.plan(req, &target, &snapshot, salt, session).await?;
        let mut ask = (purpose == Purpose::Forward)
            .then(|| self.ask(req, headers, &routing, tenant.as_deref(), &target, &plan));
        let dedicated = tenancy.spec.isolation == Isolation::DedicatedEndpoints;
        let (split, admission, admission_ticket) = loop {
            let pass = match &ask {
                Some(ask) => Some(self.wait_turn(ask, &routing).await?),
                None => None,
            };
            if pass.is_some_and(|p| p.waited()) || ask.as_ref().is_some_and(|a| a.retried) {
                // the decision's time does not include the wait
                started = Instant::now();
            }
            let rooms = ask.as_ref().and_then(|a| self.flow_rooms(&routing, a));
            let allow_fn = |e: &Endpoint| {
                (!dedicated || tenancy.allows(tenant.as_deref(), e))
                    && rooms
                        .as_ref()
                        .is_none_or(|r| r.binary_search(&e.id).is_ok())
            };
            let scope = Scope {
                tenant: tenant.as_deref(),
                subset,
                allow: (dedicated || rooms.is_some())
                    .then_some(&allow_fn as &(dyn Fn(&Endpoint) -> bool + Sync)),
            };
            let route_request = plan.route_request(&target.config, scope, ask.is_none());
            let admission = pass.map_or_else(
                || self.pool.gate(&route_request, self.now_ms()),
                |p| Gate::Admit(p.admitted),
            );
            let split = self.place(&route_request, req.kind)?;
            let reservation = pass.and_then(|p| p.reservation);
            if let Some(ask) = ask.as_mut()
                && self.slo_retry(ask, &routing, &split, reservation)?
            {
                continue;
            }
            break (split, admission, reservation);
        };
        self.metrics
            .decision_seconds
            .observe(started.elapsed().as_secs_f64());
        let upstream = upstream_request(
            &target.entry.config,
            &plan,
            req,
            split.placement.decision.endpoint,
            target.rewrite.as_ref(),
        )?;
        Ok(Routed {
            placement: split.placement,
            entry: target.entry,
            plan,
            tenant,
            lora: target.lora,
            upstream,
            admission,
            admission_ticket,
            api: req.kind,
            rewrite: target.rewrite,
            prefill: split.prefill,
            verdict: split.verdict,
        })
    }

    /// Who sends a request: its tenant, and the session it belongs to ([`Self::conversation`]).
    /// Another tenant's stored response does not exist for it (its engine would continue it:
    /// vLLM has no tenants).
    fn caller(
        &self,
        req: &ParsedRequest,
        headers: &HeaderMap,
        routing: &RoutingConfig,
        tenancy: &Tenancy,
    ) -> Result<(Option<String>, Option<String>), ApiError> {
        let tenant = tenancy.tenant_of(headers)?;
        if let Some(previous) = req.previous_response_id.as_deref()
            && self.responses.lookup(previous, tenant.as_deref()) == Known::OtherTenant
        {
            return Err(ApiError::unknown_response(previous));
        }
        let session = self.conversation(req, headers, routing, tenant.as_deref());
        Ok((tenant, session))
    }

    /// The session a request belongs to: the session header's; for a Responses request, its
    /// `session_id`, else the conversation of its `previous_response_id`. Requests that
    /// generate nothing (renders, tokenize, ...) have none: they must not pin or wait.
    fn conversation(
        &self,
        req: &ParsedRequest,
        headers: &HeaderMap,
        routing: &RoutingConfig,
        tenant: Option<&str>,
    ) -> Option<String> {
        if req.kind == ApiKind::Other {
            return None;
        }
        headers
            .get(routing.session_header.as_str())
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .or_else(|| req.session_id.clone())
            .or_else(|| {
                req.previous_response_id
                    .as_deref()
                    .map(|p| self.responses.conversation_of(p, tenant))
            })
    }

    /// A watch for the id of the response `endpoint` gives a Responses request (`None` for
    /// other APIs), read by [`Self::response_chunk`] as the body is relayed.
    pub fn watch_response(&self, routed: &Routed, endpoint: EndpointId) -> Option<ResponseWatch> {
        (routed.api == ApiKind::Responses).then(|| {
            ResponseWatch::new(
                routed.plan.session.clone(),
                routed.tenant.clone(),
                endpoint,
                routed.plan.prompt_tokens,
            )
        })
    }

    /// A chunk of a successful Responses body: once the response's id shows, it is recorded
    /// with its conversation and endpoint, and a conversation's first response pins the
    /// conversation (named after it) there. Returns whether to keep reading chunks.
    pub fn response_chunk(&self, watch: &mut ResponseWatch, chunk: &[u8]) -> bool {
        let Some(id) = watch.feed(chunk) else {
            return !watch.exhausted();
        };
        let conversation = match &watch.conversation {
            Some(c) => c.clone(),
            None => {
                let c = conversation_named_after(&id);
                if let Some(key) = Router::session_key(watch.tenant.as_deref(), Some(&c)) {
                    self.pool.pin(
                        key,
                        watch.endpoint,
                        u64::from(watch.prompt_tokens),
                        self.now_ms(),
                    );
                }
                c
            }
        };
        self.responses.record(
            &id,
            ResponseOwner {
                conversation: conversation.into(),
                endpoint: watch.endpoint,
                tenant: watch.tenant.as_deref().map(Arc::from),
            },
        );
        false
    }
}

/// The output a request asks for at most (`max_tokens`, `max_completion_tokens` or
/// `max_output_tokens`; 0 when it names none): read only for a request that must wait.
fn expected_output_tokens(raw: &[u8]) -> u64 {
    #[derive(serde::Deserialize)]
    struct Max {
        max_tokens: Option<u64>,
        max_completion_tokens: Option<u64>,
        max_output_tokens: Option<u64>,
    }
    serde_json::from_slice::<Max>(raw)
        .ok()
        .and_then(|m| {
            m.max_completion_tokens
                .or(m.max_tokens)
                .or(m.max_output_tokens)
        })
        .unwrap_or(0)
        .min(1 << 24)
}

/// Where a request goes: its model config and entry, its adapter, and the rewrite rule that
/// sent it there.
struct Target {
    config: Arc<ModelConfig>,
    lora: Option<String>,
    entry: Arc<ModelEntry>,
    rewrite: Option<ModelRewritten>,
}

/// A forwarded request as the waiting room sees it.
struct Ask {
    arrival: Arrival,
    /// Its TTFT objective, ms.
    slo_ms: Option<u32>,
    /// It came back through the gate (its objective was not met the first time).
    retried: bool,
}

impl PickerState {
    /// The model config a request is served by (after `routing.modelRewrites`: a session
    /// keeps its target, anything else goes by its body's hash, hashed only when the model
    /// has a rule).
    fn target(
        &self,
        req: &ParsedRequest,
        snapshot: &crate::endpoint::EndpointSnapshot,
        routing: &RoutingConfig,
        session: Option<&str>,
    ) -> Result<Target, ApiError> {
        let named = match &req.model {
            Some(m) => m.clone(),
            None => self.the_one_model()?,
        };
        let rewrite = routing
            .model_rewrites
            .iter()
            .any(|r| r.model == named)
            .then(|| {
                let key = session.map_or(&req.raw[..], str::as_bytes);
                routing.rewrite_model(&named, xxhash_rust::xxh3::xxh3_64(key))
            })
            .flatten()
            .filter(|t| *t != named)
            .map(|t| ModelRewritten {
                asked: named.clone(),
                target: t.to_owned(),
            });
        let model = rewrite
            .as_ref()
            .map_or(named.as_str(), |r| r.target.as_str());
        let (config, lora) = Router::resolve_model(snapshot, model).map_err(|_| {
            // a configured model without endpoints is "no endpoint", not "unknown model"
            if self
                .catalog
                .load()
                .values()
                .any(|e| e.config.serves(model).is_some())
            {
                ApiError::unavailable(
                    "no_eligible_endpoint",
                    format!("no endpoint is serving `{model}` right now"),
                )
            } else {
                self.no_such_model(model)
            }
        })?;
        let entry = self
            .model_entry(&config.name)
            .ok_or_else(|| self.no_such_model(model))?;
        if let Some(r) = &rewrite {
            self.metrics.model_rewritten(&r.asked, &r.target);
        }
        Ok(Target {
            config,
            lora,
            entry,
            rewrite,
        })
    }

    /// The request's prompt read and hashed. Another API's prompt is not read (nor one whose
    /// rendering is not reproduced): it is routed by model, tenant and load alone.
    async fn plan(
        &self,
        req: &ParsedRequest,
        target: &Target,
        snapshot: &crate::endpoint::EndpointSnapshot,
        tenant_salt: Option<String>,
        session: Option<String>,
    ) -> Result<RequestPlan, ApiError> {
        let (ids, kind) = if req.kind == ApiKind::Other || req.unread.is_some() {
            if let Some(why) = req.unread {
                self.metrics.unread_prompt(why);
            }
            (Vec::new(), TokenKind::Tokens)
        } else {
            let span = tracing::info_span!(
                target: telemetry::TARGET,
                "tokenize",
                tokens = tracing::field::Empty,
            );
            let out = self
                .tokens(&target.entry, req, snapshot)
                .instrument(span.clone())
                .await?;
            span.record("tokens", out.0.len());
            out
        };
        RequestPlan::new(PlanInput {
            config: &target.config,
            lora: target.lora.as_deref(),
            tokens: &ids,
            token_kind: kind,
            char_chunk_tokens: target.entry.tokenizer.char_chunk_tokens() as u32,
            tenant_salt,
            client_salt: req.cache_salt.as_deref(),
            session: session.as_deref(),
            request_bytes: &req.raw,
            max_prompt_tokens: self.limits.max_prompt_tokens,
        })
        .map_err(|e| ApiError::bad_request("prompt_too_long", e.to_string()))
    }

    /// What the waiting room reads of a forwarded request: its band (a raw priority only
    /// from the header the operator trusts, none by default; else its objective's), its flow
    /// (the tenant, else the fairness header), its TTFT objective (flow control on) and so
    /// its deadline, its session and its cost.
    fn ask(
        &self,
        req: &ParsedRequest,
        headers: &HeaderMap,
        routing: &RoutingConfig,
        tenant: Option<&str>,
        target: &Target,
        plan: &RequestPlan,
    ) -> Ask {
        let fc = &routing.flow_control;
        let header = |n: &str| headers.get(n).and_then(|v| v.to_str().ok());
        let slo_ms = if fc.enabled {
            fc.ttft_slo_ms(header(&fc.ttft_slo_header), header(&fc.objective_header))
        } else {
            None
        };
        let raw = fc.priority_header.as_deref().and_then(header);
        let band = fc.priority(raw, header(&fc.objective_header));
        let flow = tenant
            .or_else(|| header(&fc.fairness_header))
            .map_or(0, |f| xxhash_rust::xxh3::xxh3_64(f.as_bytes()));
        // the body is read again only when flow control weighs it
        let output = if fc.enabled {
            expected_output_tokens(&req.raw)
        } else {
            0
        };
        Ask {
            arrival: Arrival {
                id: 0,
                config: target.config.name.to_string(),
                band,
                flow,
                tokens: u64::from(plan.prompt_tokens) + output,
                bytes: req.raw.len() as u64,
                deadline_ms: slo_ms.map(|v| self.now_ms() + u64::from(v)),
                session: Router::session_key(tenant, plan.session.as_deref()),
                prompt_tokens: plan.prompt_tokens,
                not_before_ms: None,
            },
            slo_ms,
            retried: false,
        }
    }

    /// Waits for the request's turn at the pool's gate ([`Waiters::turn`]); an answer
    /// without service is a 429 with the gate's reason.
    async fn wait_turn(&self, ask: &Ask, routing: &RoutingConfig) -> Result<Pass, ApiError> {
        if !routing.flow_control.enabled && !routing.admission.enabled && !ask.retried {
            return Ok(Pass::straight(Admitted::Disabled));
        }
        let band = ask.arrival.band;
        let pass = match self
            .waiters
            .turn(&self.pool, self.now_ms(), ask.arrival.clone())
            .await
        {
            Ok(pass) => pass,
            Err(NoTurn::Refused(r)) => {
                self.metrics.flow_shed(r.code(), band);
                return Err(ApiError::shed_because(r.code(), r.message()));
            }
            Err(NoTurn::ShuttingDown) => {
                return Err(ApiError::unavailable(
                    "shutting_down",
                    "the picker is shutting down",
                ));
            }
        };
        if let Some(ms) = pass.flow_wait_ms {
            self.metrics.flow_dispatched.inc();
            self.metrics.flow_wait_seconds.observe(ms as f64 / 1000.0);
        }
        if pass.admitted != Admitted::Disabled {
            self.metrics.admitted(pass.admitted);
        }
        if let Some(ms) = pass.admission_wait_ms {
            self.metrics
                .admission_wait_seconds
                .observe(ms as f64 / 1000.0);
        }
        Ok(pass)
    }

    /// Flow control places on an endpoint with room for the band, when one has: with
    /// `placement: WithRoom`, the endpoints with room for the request's band
    /// (in id order), when any has.
    fn flow_rooms(&self, routing: &RoutingConfig, ask: &Ask) -> Option<Vec<EndpointId>> {
        let fc = &routing.flow_control;
        if !fc.enabled || fc.placement != FlowPlacement::WithRoom {
            return None;
        }
        let rooms = self.rooms(&ask.arrival.config, routing, ask.arrival.band);
        (!rooms.is_empty()).then_some(rooms)
    }

    /// Places `req` ([`Pool::place_split`] for the APIs that can be split, else
    /// [`Pool::place`]), in a `decide` span.
    fn place(&self, req: &RouteRequest<'_>, api: ApiKind) -> Result<SplitPlacement, ApiError> {
        let decide = tracing::info_span!(
            target: telemetry::TARGET,
            "decide",
            model_config = &*req.model_config.name,
            candidates = tracing::field::Empty,
            endpoint = tracing::field::Empty,
            rank = tracing::field::Empty,
            prompt_tokens = req.prompt_tokens,
            cached_tokens = tracing::field::Empty,
            policy = tracing::field::Empty,
            reason = tracing::field::Empty,
            failed_open = tracing::field::Empty,
        );
        let placed = {
            let _entered = decide.enter();
            if matches!(api, ApiKind::Completions | ApiKind::ChatCompletions) {
                self.pool.place_split(req, self.now_ms())
            } else {
                self.pool
                    .place(req, self.now_ms())
                    .map(|placement| SplitPlacement {
                        placement,
                        prefill: None,
                        verdict: Verdict::Unsplittable,
                    })
            }
        };
        // the attributes are built only for a span that is recorded
        if let Ok(p) = &placed
            && !decide.is_disabled()
        {
            let d = &p.placement.decision;
            decide.record("candidates", 1 + d.fallbacks.len());
            decide.record("endpoint", d.endpoint.host_port().as_str());
            decide.record("rank", d.endpoint.rank);
            decide.record("cached_tokens", d.cached_tokens);
            decide.record("policy", d.policy);
            decide.record("reason", format!("{:?}", d.reason).to_lowercase().as_str());
            decide.record("failed_open", d.failed_open);
        }
        placed.map_err(|e| {
            self.metrics.error(e.kind());
            match e {
                PlaceError::Route(RouteError::UnknownModel(m)) => self.no_such_model(&m),
                PlaceError::Route(e @ RouteError::NoEligibleEndpoint(_)) => {
                    ApiError::unavailable("no_eligible_endpoint", e.to_string())
                }
                PlaceError::Route(e @ RouteError::AllStale(_)) => {
                    ApiError::unavailable("all_endpoints_stale", e.to_string())
                }
                PlaceError::Shed { .. } => ApiError::shed(e.to_string()),
            }
        })
    }

    /// A TTFT objective no endpoint is predicted to meet ([`slo_verdict`]; a split request:
    /// its prefill's prediction): `true` when the request goes back through the gate (what
    /// admission reserved for it is given back), a 429 `slo_unattainable` when it cannot
    /// wait, `false` when it is met or has none.
    fn slo_retry(
        &self,
        ask: &mut Ask,
        routing: &RoutingConfig,
        split: &SplitPlacement,
        reservation: Option<Ticket>,
    ) -> Result<bool, ApiError> {
        let (Some(deadline), Some(slo)) = (ask.arrival.deadline_ms, ask.slo_ms) else {
            return Ok(false);
        };
        let first = split.prefill.as_ref().unwrap_or(&split.placement);
        let Some(best) = first.decision.best_ttft_ms else {
            return Ok(false);
        };
        let queue = routing.flow_control.unattainable_slo == UnattainableSlo::Queue;
        match slo_verdict(deadline, self.now_ms(), best, queue) {
            Slo::Met => Ok(false),
            Slo::Retry { at_ms } => {
                if let Some(r) = reservation {
                    self.pool.waiting().lock().release(r);
                }
                ask.arrival.not_before_ms = Some(at_ms);
                ask.retried = true;
                Ok(true)
            }
            Slo::Refuse { left_ms } => {
                self.metrics
                    .flow_shed(Refusal::SloUnattainable.code(), ask.arrival.band);
                Err(ApiError::shed_because(
                    Refusal::SloUnattainable.code(),
                    format!(
                        "no endpoint is predicted to give the first token within the {slo} ms objective ({left_ms} ms of it left; the best: {best:.0} ms)"
                    ),
                ))
            }
        }
    }

    /// The endpoints of `config` with room for priority `band`, in id order.
    fn rooms(&self, config: &str, routing: &RoutingConfig, band: i32) -> Vec<EndpointId> {
        self.pool
            .rooms(config, &routing.saturation.for_band(band))
            .into_iter()
            .map(|(e, _)| e)
            .collect()
    }

    /// Token ids of a request: from the engine's render endpoint when configured (exact
    /// parity with its chat template), else the local tokenizer.
    async fn tokens(
        &self,
        entry: &ModelEntry,
        req: &ParsedRequest,
        snapshot: &crate::endpoint::EndpointSnapshot,
    ) -> Result<(Vec<u32>, TokenKind), ApiError> {
        if entry
            .spec
            .tokenizer
            .as_ref()
            .is_some_and(|t| t.use_engine_render)
        {
            if let Some(ids) = self.render_on_engine(entry, req, snapshot).await {
                return Ok((ids, TokenKind::Tokens));
            }
            self.metrics.error("render_fallback");
        }
        let tok = entry.tokenizer.clone();
        let mut input = req.prompt_input().ok_or_else(|| {
            ApiError::bad_request(
                "missing_field",
                "missing required field `prompt` or `messages`",
            )
        })?;
        // a Messages request's inline system messages, where vLLM merges them
        let merged = req.merged_messages(&tok);
        if let (PromptInput::Chat { messages, .. }, Some(m)) = (&mut input, &merged) {
            *messages = m;
        }
        if let PromptInput::TokenIds(_) = input {
            let out = tok.tokenize(input).map_err(tokenize_error)?;
            // token ids are the engine's own tokens whatever the tokenizer setup
            return Ok((out.ids, TokenKind::Tokens));
        }
        // Encoding what the piece cache does not hold costs about 1 µs per token: a long prompt
        // keeps the tokenizer busy for milliseconds. On the multi-threaded runtime the worker
        // first hands its other tasks to another thread, so they do not wait behind it.
        let tokenize = || tok.tokenize(input);
        let out = if req.raw.len() >= BLOCKING_TOKENIZE_BYTES
            && tokio::runtime::Handle::try_current()
                .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
        {
            // the semaphore is never closed
            let _slot = self.tokenize_slots.acquire().await.map_err(|_| {
                ApiError::unavailable("shutting_down", "the picker is shutting down")
            })?;
            tokio::task::block_in_place(tokenize)
        } else {
            tokenize()
        }
        .map_err(tokenize_error)?;
        self.metrics
            .piece_cache_tokens
            .inc_by(out.cached_tokens as u64);
        Ok((out.ids, out.kind))
    }

    async fn render_on_engine(
        &self,
        entry: &ModelEntry,
        req: &ParsedRequest,
        snapshot: &crate::endpoint::EndpointSnapshot,
    ) -> Option<Vec<u32>> {
        let target = snapshot
            .endpoints()
            .iter()
            .filter(|e| e.model_config.name == entry.config.name && e.state == EndpointState::Ready)
            .min_by_key(|e| self.pool.inflight().get(&e.id).requests)?;
        let _slot = self.render_slots.try_acquire().ok()?;
        let url = format!(
            "http://{}{}",
            target.id.host_port(),
            req.kind.render_path()?
        );
        let call = self
            .http
            .post(url)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(req.raw.clone())
            .send();
        let resp = tokio::time::timeout(self.limits.render_timeout, call)
            .await
            .ok()?
            .ok()?;
        if !resp.status().is_success() {
            return None;
        }
        let bytes = tokio::time::timeout(self.limits.render_timeout, resp.bytes())
            .await
            .ok()?
            .ok()?;
        let v: Value = serde_json::from_slice(&bytes).ok()?;
        // completions render returns a list, chat render one object
        let first = match &v {
            Value::Array(items) => items.first()?,
            other => other,
        };
        let ids = first.get("token_ids")?.as_array()?;
        ids.iter()
            .map(|t| t.as_u64().and_then(|x| u32::try_from(x).ok()))
            .collect()
    }

    /// Bookkeeping once a decision is final: metrics, and the pool records the placement
    /// ([`Pool::record`]: the turn, and an approximate index learns the prompt's blocks).
    fn record_routed(&self, routed: &Routed) {
        let d = &routed.placement.decision;
        let endpoint = d.endpoint.to_string();
        self.metrics
            .decisions
            .get_or_create(&DecisionLabels {
                policy: d.policy.to_string(),
                endpoint: endpoint.clone(),
                reason: format!("{:?}", d.reason).to_lowercase(),
            })
            .inc();
        self.metrics
            .prompt_tokens
            .inc_by(u64::from(routed.plan.prompt_tokens));
        self.metrics
            .predicted_hit_tokens
            .inc_by(u64::from(d.cached_tokens));
        self.metrics
            .prefill_tokens
            .get_or_create(&EndpointLabels { endpoint })
            .inc_by(u64::from(
                routed.plan.prompt_tokens.saturating_sub(d.cached_tokens),
            ));
        self.metrics
            .disaggregation
            .get_or_create(&KindLabels {
                kind: routed.verdict.kind().to_owned(),
            })
            .inc();
        let now = self.now_ms();
        if let Some(prefill) = &routed.prefill {
            self.pool.record(prefill, &routed.plan.keys, now);
        }
        self.pool.record(&routed.placement, &routed.plan.keys, now);
    }

    /// In-flight accounting for `routed` sent to `endpoint`, until the guard drops.
    /// `endpoint` served `routed` (answered with a success): [`Pool::settle`] (its session is
    /// pinned there, admission's reservation for it goes), and the gate looks at its room
    /// again.
    pub fn served(&self, routed: &Routed, endpoint: EndpointId) {
        self.settle(
            routed.placement.session_key,
            routed.placement.prompt_tokens,
            endpoint,
            routed.admission_ticket,
        );
    }

    /// [`Pool::settle`] for a request answered by `endpoint`, told to the gate's task.
    pub fn settle(
        &self,
        session_key: Option<u64>,
        prompt_tokens: u32,
        endpoint: EndpointId,
        reservation: Option<Ticket>,
    ) {
        self.pool.settle(
            session_key,
            u64::from(prompt_tokens),
            endpoint,
            reservation,
            self.now_ms(),
        );
        if session_key.is_some() && self.routing().admission.enabled {
            self.waiters.poke();
        }
    }

    pub fn begin(&self, routed: &Routed, endpoint: EndpointId) -> InflightGuard {
        self.pool.begin(
            endpoint,
            u64::from(routed.plan.prompt_tokens),
            u64::from(routed.uncached_on(endpoint)),
            !routed.plan.keys.is_empty(),
        )
    }

    /// A request whose answer comes whole (not streamed) shows no first token: its prefill
    /// is taken to be over once the time the cost model predicts for its own prefill on the
    /// chosen endpoint has passed (the engine's own waiting count, which headroom also reads,
    /// still shows it if it is queued longer). Without this it counted as waiting at its
    /// endpoint until its whole answer arrived, and flow control held requests back from
    /// engines that had room (issue 49).
    pub fn prefill_clock(&self, guard: &InflightGuard, routed: &Routed) {
        let cal = &self.routing().cost_model;
        // its own prefill (and the decode step it shares), not the queue ahead: the requests
        // ahead are counted by their own clocks, and an engine prefills them together
        let mut own = routed.placement.decision.features;
        own.pending_tokens = 0;
        own.waiting = 0.0;
        let ms = crate::policy::estimated_ttft_ms(cal, &own);
        // no later than a request may wait for its answer: the task never outlives it by more
        let wait = Duration::from_secs_f64((ms / 1000.0).clamp(0.0, 600.0))
            .min(self.limits.upstream_timeout);
        let mark = guard.prefill_mark();
        tokio::spawn(async move {
            tokio::time::sleep(wait).await;
            mark.prefill_done();
        });
    }

    /// Count a request against the global in-flight bound; `None` when it is full.
    pub fn admit(self: &Arc<Self>) -> Option<Admission> {
        let n = self.inflight_total.fetch_add(1, Ordering::AcqRel);
        if n >= self.limits.max_inflight_total {
            self.inflight_total.fetch_sub(1, Ordering::AcqRel);
            self.metrics.error("shed");
            return None;
        }
        Some(Admission {
            picker: self.clone(),
        })
    }

    /// KV event ports of an endpoint that overrides its model config's.
    pub fn kv_ports_of(&self, id: &EndpointId) -> Option<KvPorts> {
        self.pool.state().endpoints().get(id)?.kv_ports
    }

    pub fn labels_of(&self, id: &EndpointId) -> BTreeMap<String, String> {
        self.pool
            .state()
            .endpoints()
            .get(id)
            .map(|e| e.labels.clone())
            .unwrap_or_default()
    }
}

/// Holds one slot of the global in-flight bound.
#[derive(Debug)]
pub struct Admission {
    picker: Arc<PickerState>,
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.picker.inflight_total.fetch_sub(1, Ordering::AcqRel);
    }
}

fn tokenize_error(e: TokenizeError) -> ApiError {
    if let TokenizeError::Busy { .. } = e {
        return ApiError::shed(e.to_string());
    }
    let code = match &e {
        TokenizeError::InputLimit { .. } => "prompt_too_long",
        TokenizeError::TemplateLimit { .. } => "template_limit",
        TokenizeError::TokenOutOfVocab { .. } => "invalid_token_id",
        TokenizeError::InvalidChat(_) | TokenizeError::TemplateRaised(_) => "invalid_messages",
        _ => "tokenization_failed",
    };
    ApiError::bad_request(code, e.to_string())
}

/// The response id of `GET /v1/responses/{id}` or `POST /v1/responses/{id}/cancel`.
pub fn stored_response_id(path: &str) -> Option<&str> {
    let rest = path.split('?').next()?.strip_prefix("/v1/responses/")?;
    let id = rest.strip_suffix("/cancel").unwrap_or(rest);
    (!id.is_empty() && !id.contains('/')).then_some(id)
}

/// A picker serving model `m` on two endpoints (127.0.0.2 and 127.0.0.3, port 8000), for the
/// service's tests without sockets.
#[cfg(test)]
pub(crate) mod test_support {
    use super::*;
    use crate::service::settings::PickerConfig;
    use crate::service::source::view_from_config;

    pub const POOL: &str = r#"
modelConfigs:
  - {name: a, model: m, port: 8000}
endpoints:
  - {address: 127.0.0.2, modelConfig: a}
  - {address: 127.0.0.3, modelConfig: a}
"#;

    pub fn picker(limits: Limits) -> PickerState {
        let picker = PickerState::new(limits, IndexSettings::default()).expect("picker");
        let config = PickerConfig::from_yaml(POOL).expect("valid");
        picker
            .apply_pool(&view_from_config(&config))
            .expect("applied");
        picker
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::{POOL, picker};
    use super::*;
    use crate::service::settings::PickerConfig;
    use crate::service::source::view_from_config;

    fn completion(text: &str) -> ParsedRequest {
        let body = serde_json::json!({"model": "m", "prompt": text}).to_string();
        ParsedRequest::parse(ApiKind::Completions, Bytes::from(body), &Default::default())
            .expect("valid")
    }

    fn addr(ip: &str, port: u16) -> SocketAddr {
        SocketAddr::new(ip.parse().expect("ip"), port)
    }

    #[tokio::test]
    async fn a_forwarded_decision_is_recorded_and_an_explained_one_is_not() {
        let picker = picker(Limits::default());
        let req = completion(&"the same long prompt ".repeat(100));
        let h = HeaderMap::new();
        let first = picker
            .decide(&req, &h, None, Purpose::Explain)
            .await
            .expect("decided");
        assert!(!first.placement.decision.candidates.is_empty(), "explained");
        // nothing was recorded: the same request still finds no cached prefix
        let again = picker
            .decide(&req, &h, None, Purpose::Forward)
            .await
            .expect("decided");
        assert_eq!(again.placement.decision.cached_tokens, 0);
        assert!(again.placement.decision.candidates.is_empty());
        // a forwarded one teaches the approximate index where the prefix went
        let third = picker
            .decide(&req, &h, None, Purpose::Explain)
            .await
            .expect("decided");
        assert_eq!(
            third.placement.decision.endpoint,
            again.placement.decision.endpoint
        );
        assert!(third.placement.decision.cached_tokens > 0);
        assert_eq!(third.uncached_on(third.placement.decision.endpoint), {
            third.plan.prompt_tokens - third.placement.decision.cached_tokens
        });
        let other = third.targets().nth(1).expect("a fallback");
        assert_eq!(third.uncached_on(other), third.plan.prompt_tokens);
    }

    /// Long prompts wait for a tokenizing slot: with every slot taken, a long prompt's
    /// decision waits, and it goes on once one is free.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn long_prompts_are_encoded_a_few_at_a_time() {
        let picker = Arc::new(picker(Limits::default()));
        let slots = picker.tokenize_slots.available_permits();
        assert!(slots >= 1);
        let taken = picker
            .tokenize_slots
            .acquire_many(slots as u32)
            .await
            .expect("open");
        let long = completion(&"a long prompt ".repeat(BLOCKING_TOKENIZE_BYTES / 10));
        let waiting = {
            let picker = picker.clone();
            tokio::spawn(async move {
                picker
                    .decide(&long, &HeaderMap::new(), None, Purpose::Explain)
                    .await
                    .map(|d| d.plan.prompt_tokens)
            })
        };
        // a short one does not wait
        picker
            .decide(
                &completion("short"),
                &HeaderMap::new(),
                None,
                Purpose::Explain,
            )
            .await
            .expect("decided");
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!waiting.is_finished(), "no slot was free");
        drop(taken);
        let tokens = waiting.await.expect("joined").expect("decided");
        assert!(tokens > 0);
        assert_eq!(picker.tokenize_slots.available_permits(), slots);
    }

    /// Issue 31: a session is pinned only where a request of it was served — not by an
    /// explanation, nor by a decision alone — and a routing edit keeps the pins.
    #[tokio::test]
    async fn sessions_are_pinned_where_served_and_kept_across_a_routing_edit() {
        let picker = picker(Limits::default());
        let req = completion(&"a session's prompt ".repeat(50));
        let mut h = HeaderMap::new();
        h.insert("x-session-id", "s-1".parse().expect("value"));
        let explained = picker
            .decide(&req, &h, None, Purpose::Explain)
            .await
            .expect("decided");
        let key = explained.session_key().expect("a session");
        let pinned = || picker.pool.pinned(key);
        assert_eq!(pinned(), None, "an explanation pins nothing");
        let forwarded = picker
            .decide(&req, &h, None, Purpose::Forward)
            .await
            .expect("decided");
        assert_eq!(pinned(), None, "not served yet");
        // served by its first fallback (the in-flight cap or a retry moved it)
        let served = forwarded.targets().nth(1).expect("a fallback");
        picker.served(&forwarded, served);
        assert_eq!(pinned(), Some(served));
        let next = picker
            .decide(&completion("another turn"), &h, None, Purpose::Explain)
            .await
            .expect("decided");
        assert_eq!(
            next.placement.decision.endpoint, served,
            "the session follows its pin"
        );
        // the explanation shows each candidate's working set: the session's prompt is on the
        // endpoint that served it, and nowhere else
        let working: Vec<(String, Option<u64>)> = next
            .placement
            .decision
            .candidates
            .iter()
            .map(|c| (c.endpoint.clone(), c.working_set_tokens))
            .collect();
        let prompt = u64::from(forwarded.plan.prompt_tokens);
        for (endpoint, tokens) in &working {
            let want = if *endpoint == served.to_string() {
                prompt
            } else {
                0
            };
            assert_eq!(*tokens, Some(want), "{endpoint}: {working:?}");
        }
        // a routing edit rebuilds the policy, not the pins
        let config = PickerConfig::from_yaml(POOL).expect("valid");
        let mut view = view_from_config(&config);
        view.routing.strategy = crate::config::Strategy::LeastLoad;
        picker.apply_pool(&view).expect("applied");
        assert_eq!(picker.router().policy_name(), "least-load");
        assert_eq!(pinned(), Some(served));
    }

    /// Issue 32: session admission holds a new session's first turn while the live sessions'
    /// context fills the engines' KV capacity; it goes on when a served turn makes room, when
    /// its client leaves (out of the line), or after `maxWait`.
    #[tokio::test]
    async fn session_admission_holds_new_sessions_until_there_is_room() {
        let pool = |max_wait: &str| {
            format!("{POOL}routing: {{admission: {{enabled: true, maxWait: {max_wait}}}}}\n")
        };
        let picker = Arc::new(picker(Limits::default()));
        // the task that steps the pool's gate
        let cancel = tokio_util::sync::CancellationToken::new();
        let gate = tokio::spawn(super::super::flow::run_gate(picker.clone(), cancel.clone()));
        let config = PickerConfig::from_yaml(&pool("1m")).expect("valid");
        picker
            .apply_pool(&view_from_config(&config))
            .expect("applied");
        let session = |id: &str| {
            let mut h = HeaderMap::new();
            h.insert("x-session-id", id.parse().expect("value"));
            h
        };
        let long = completion(&"a long agent context ".repeat(60));
        // session a is served: its context is live
        let a = picker
            .decide(&long, &session("a"), None, Purpose::Forward)
            .await
            .expect("decided");
        assert_eq!(a.admission, Gate::Admit(Admitted::CapacityUnknown));
        picker.served(&a, a.placement.decision.endpoint);
        let p = u64::from(a.plan.prompt_tokens);
        // the engines report room for one and a half such contexts
        let block = 16;
        let blocks = (3 * p / 4).div_ceil(block);
        let now = picker.now_ms();
        let ids: Vec<EndpointId> = picker
            .pool
            .state()
            .endpoints()
            .endpoints()
            .iter()
            .map(|e| e.id)
            .collect();
        let scrape = |now| {
            ids.iter().map(move |id| {
                (
                    *id,
                    crate::load::EndpointLoad {
                        kv_capacity_blocks: Some(blocks),
                        sampled_at_ms: now,
                        ..Default::default()
                    },
                )
            })
        };
        picker.pool.observe_scrape(now, scrape(now));
        // a's next turn is never held; a new session b does not fit
        let next = picker
            .decide(&long, &session("a"), None, Purpose::Explain)
            .await
            .expect("decided");
        assert_eq!(next.admission, Gate::Admit(Admitted::LiveSession));
        let explained = picker
            .decide(&long, &session("b"), None, Purpose::Explain)
            .await
            .expect("decided");
        let Gate::Hold(room) = explained.admission else {
            panic!("held: {:?}", explained.admission);
        };
        assert_eq!(room.live_tokens, p);
        assert_eq!(room.capacity_tokens, 2 * blocks * block);
        // its footprint: the mean live context, no more than one engine's cache
        assert_eq!(room.footprint_tokens, p.min(blocks * block));
        // forwarded, b waits in line
        let waiting = || picker.metrics.admission_waiting.get();
        let until_waiting = |n: i64| {
            let picker = picker.clone();
            async move {
                // bounded, not timed: the task registers long before this runs out
                for _ in 0..10_000 {
                    if picker.metrics.admission_waiting.get() == n {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                panic!("never {n} waiting");
            }
        };
        let b = tokio::spawn({
            let (picker, long, h) = (picker.clone(), long.clone(), session("b"));
            async move { picker.decide(&long, &h, None, Purpose::Forward).await }
        });
        until_waiting(1).await;
        assert!(!b.is_finished());
        assert_eq!(picker.pool.waiting().lock().admission_waiting(), 1);
        // a's next turn is short: its live context shrinks, and b goes on
        let short = picker
            .decide(&completion("ok"), &session("a"), None, Purpose::Forward)
            .await
            .expect("decided");
        picker.served(&short, short.placement.decision.endpoint);
        let b = b.await.expect("joined").expect("decided");
        assert_eq!(waiting(), 0);
        let ticket = b.admission_ticket.expect("admitted after waiting");
        assert!(picker.pool.waiting().lock().reserved(picker.now_ms()) >= p.min(blocks * block));
        let text = picker.metrics.encode();
        assert!(
            text.contains("kvroute_picker_admission_total{kind=\"fits\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("kvroute_picker_admission_wait_seconds_count 1"),
            "{text}"
        );
        // served: its reservation goes, its context counts instead
        picker.served(&b, b.placement.decision.endpoint);
        assert_eq!(picker.pool.waiting().lock().reserved(picker.now_ms()), 0);
        let _ = ticket;
        // c does not fit beside b; its client leaves while it waits: out of the line
        let c = tokio::spawn({
            let (picker, long, h) = (picker.clone(), long.clone(), session("c"));
            async move { picker.decide(&long, &h, None, Purpose::Forward).await }
        });
        until_waiting(1).await;
        c.abort();
        assert!(c.await.expect_err("aborted").is_cancelled());
        until_waiting(0).await;
        assert!(picker.pool.waiting().lock().is_empty());
        // with a short maxWait, d goes on when it has waited that long
        let config = PickerConfig::from_yaml(&pool("50ms")).expect("valid");
        picker
            .apply_pool(&view_from_config(&config))
            .expect("applied");
        picker
            .pool
            .observe_scrape(picker.now_ms(), scrape(picker.now_ms()));
        let d = picker
            .decide(&long, &session("d"), None, Purpose::Forward)
            .await
            .expect("decided");
        assert!(d.admission_ticket.is_some());
        assert!(
            picker
                .metrics
                .encode()
                .contains("kvroute_picker_admission_total{kind=\"timeout\"} 1")
        );
        cancel.cancel();
        gate.await.expect("the gate's task stops");
    }

    #[tokio::test]
    async fn the_gateways_subset_is_matched_by_address_and_port() {
        let picker = picker(Limits::default());
        let req = completion("hello");
        let h = HeaderMap::new();
        for subset in [
            vec![addr("127.0.0.3", 8000)],
            // a bare address admits its every port
            vec![addr("127.0.0.3", 0)],
        ] {
            let d = picker
                .decide(&req, &h, Some(&subset), Purpose::Forward)
                .await
                .expect("decided");
            assert_eq!(
                d.placement.decision.endpoint.address.to_string(),
                "127.0.0.3"
            );
            assert!(
                d.placement.decision.fallbacks.is_empty(),
                "outside the subset"
            );
        }
        // the right address on another port is not the endpoint
        let e = picker
            .decide(&req, &h, Some(&[addr("127.0.0.3", 9000)]), Purpose::Forward)
            .await
            .expect_err("no endpoint");
        assert_eq!((e.status.as_u16(), e.code), (503, "no_eligible_endpoint"));
        // the bodyless path follows the same rule
        let id = picker
            .pick_bodyless("/v1/models", &h, Some(&[addr("127.0.0.2", 8000)]))
            .expect("picked");
        assert_eq!(id.address.to_string(), "127.0.0.2");
        assert!(
            picker
                .pick_bodyless("/v1/models", &h, Some(&[addr("127.0.0.2", 9000)]))
                .is_err()
        );
    }

    /// Hardening IV, 11: `GET /v1/responses/{id}` answered 503 while its engine was briefly
    /// stale, where a continuation went through; a stored response stays reachable on its
    /// holder, and a bodyless request fails open as decisions do.
    #[tokio::test]
    async fn a_stored_response_is_reached_while_its_engine_is_stale() {
        let picker = picker(Limits::default());
        let h = HeaderMap::new();
        let holder = picker
            .pool
            .state()
            .endpoints()
            .endpoints()
            .iter()
            .find(|e| e.id.address.to_string() == "127.0.0.2")
            .expect("an endpoint")
            .id;
        picker.responses.record(
            "resp_1",
            ResponseOwner {
                conversation: "c".into(),
                endpoint: holder,
                tenant: None,
            },
        );
        let stale: Vec<(EndpointId, bool)> = picker
            .pool
            .state()
            .endpoints()
            .endpoints()
            .iter()
            .map(|e| (e.id, e.id == holder))
            .collect();
        picker.pool.state().set_stale(&stale);
        assert_eq!(
            picker
                .pick_bodyless("/v1/responses/resp_1", &h, None)
                .expect("picked"),
            holder
        );
        // every endpoint stale: a bodyless request fails open
        let all: Vec<(EndpointId, bool)> = stale.iter().map(|&(id, _)| (id, true)).collect();
        picker.pool.state().set_stale(&all);
        assert!(picker.pick_bodyless("/v1/models", &h, None).is_ok());
    }

    #[test]
    fn a_rejected_view_changes_nothing_and_its_error_labels_the_metric() {
        let picker = PickerState::new(
            Limits::default(),
            IndexSettings {
                max_endpoints: 2,
                ..IndexSettings::default()
            },
        )
        .expect("picker");
        let config = PickerConfig::from_yaml(POOL).expect("valid");
        let good = view_from_config(&config);
        picker.apply_pool(&good).expect("applied");
        let before = picker.pool.state().endpoints();

        // a third endpoint is more than the index may track: refused whole
        let mut too_many = good.clone();
        let mut third = good.endpoints[0].clone();
        third.id.address = "127.0.0.4".parse().expect("ip");
        too_many.endpoints.push(third);
        let e = picker.apply_pool(&too_many).expect_err("past maxEndpoints");
        assert_eq!(e.metric_label(), "index", "{e}");
        // the message says what was asked and what is tracked, not that the index is full
        assert!(
            e.to_string().contains(
                "tracking 1 more endpoint(s) beside the 2 tracked now would pass index.maxEndpoints (2)"
            ),
            "{e}"
        );
        // a role label that says no role, named in the error
        let mut bad_role = good.clone();
        bad_role.endpoints[1]
            .labels
            .insert("llm-d.ai/role".into(), "prefil".into());
        let e = picker.apply_pool(&bad_role).expect_err("bad role");
        assert!(e.to_string().contains("llm-d.ai/role"), "{e}");
        assert_eq!(picker.pool.state().endpoints().version(), before.version());
        // a good one becomes the endpoint's role
        let mut roles = good.clone();
        roles.endpoints[1]
            .labels
            .insert("llm-d.ai/role".into(), "prefill".into());
        picker.apply_pool(&roles).expect("applied");
        let snapshot = picker.pool.state().endpoints();
        assert_eq!(
            snapshot.get(&roles.endpoints[1].id).map(|e| e.role),
            Some(crate::endpoint::Role::Prefill)
        );
        picker.apply_pool(&good).expect("applied");
        let before = picker.pool.state().endpoints();
        // an endpoint naming a model config the view lacks
        let mut unknown = good.clone();
        unknown.endpoints[1].model_config = "nope".into();
        let e = picker.apply_pool(&unknown).expect_err("unknown config");
        assert_eq!(e.metric_label(), "unknown_model_config", "{e}");
        assert!(e.to_string().contains("\"nope\""), "{e}");
        picker.count_rejection(&e);
        assert_eq!(
            picker
                .metrics
                .config_rejections
                .get_or_create(&crate::service::metrics::ErrorLabels {
                    error: "unknown_model_config".into()
                })
                .get(),
            1
        );
        assert_eq!(
            picker.pool.state().endpoints().endpoints(),
            before.endpoints()
        );
        assert_eq!(picker.pool.state().endpoints().version(), before.version());
    }

    #[tokio::test]
    async fn a_full_endpoint_passes_its_request_to_a_fallback_and_a_full_pool_sheds() {
        let picker = picker(Limits {
            max_inflight_per_endpoint: 1,
            ..Limits::default()
        });
        let req = completion("hello");
        let h = HeaderMap::new();
        let first = picker
            .decide(&req, &h, None, Purpose::Forward)
            .await
            .expect("decided");
        let _a = picker
            .pool
            .inflight()
            .begin(first.placement.decision.endpoint, 1, 1);
        let second = picker
            .decide(&req, &h, None, Purpose::Forward)
            .await
            .expect("decided");
        assert_ne!(
            second.placement.decision.endpoint,
            first.placement.decision.endpoint
        );
        assert_eq!(
            second.placement.decision.fallbacks,
            vec![first.placement.decision.endpoint]
        );
        let _b = picker
            .pool
            .inflight()
            .begin(second.placement.decision.endpoint, 1, 1);
        let e = picker
            .decide(&req, &h, None, Purpose::Forward)
            .await
            .expect_err("shed");
        assert_eq!(e.status.as_u16(), 429);
    }
}
