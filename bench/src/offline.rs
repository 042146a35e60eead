//! Offline mode: a deterministic discrete-event simulation in virtual time.
//!
//! `engines × dp_size` ranks of the engine model ([`Rank`]) and the picker's routing core run
//! in one thread on one virtual clock:
//! * requests are placed by the service's own decision: a [`Pool`] built from the picker's
//!   default settings (`IndexSettings::pool_settings`: index budget, in-flight cap, session
//!   pins, calibration), [`Pool::place`] then [`Pool::record`], and [`Pool::served`] once the
//!   rank takes the request. The pool's index is fed by the ranks' own KV events (precise
//!   mode, [`PoolState::apply_batch`](kvroute_picker::pool_state::PoolState::apply_batch)),
//!   its loads by the ranks' statistics once per scrape interval (so they are as stale as a
//!   real scrape), its in-flight counts at send, first token and finish, and its calibration
//!   by each streamed request's first token — the inputs the live picker has (the engines'
//!   latency histograms, which the live picker also scrapes, are not modelled here);
//! * each rank runs step after step while it has work; a step's tokens, finished requests and
//!   KV events take effect at the step's end.
//!
//! Events at the same instant are processed in a fixed order (step ends and scrapes in the
//! order they were scheduled, then the driver's releases), and nothing reads the wall clock
//! except the optional decision timing, so the same inputs give the same results.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use kvroute_picker::admission::{Admitted, Ticket};
use kvroute_picker::block_keys::BlockHasher;
use kvroute_picker::calibration::TtftBasis;
use kvroute_picker::config::FlowPlacement;
use kvroute_picker::endpoint::{Endpoint, EndpointId, ModelConfig, Role};
use kvroute_picker::engine_metrics::LoraActivity;
use kvroute_picker::inflight::InflightGuard;
use kvroute_picker::kv_events::ingest::IngestKeys;
use kvroute_picker::kv_events::resequence::ResyncReason;
use kvroute_picker::kv_events::{EventBatch, KvEvent};
use kvroute_picker::load::EndpointLoad;
use kvroute_picker::place::Pool;
use kvroute_picker::plan::{PlanInput, RequestPlan, Scope};
use kvroute_picker::pool_state::PoolMember;
use kvroute_picker::router::Router;
use kvroute_picker::service::settings::Limits;
use kvroute_picker::tokenize::TokenKind;
use kvroute_picker::waiting::{Action as GateAction, Arrival, Arrived, Pass};
use kvroute_sim::engine::{Rank, Request, StepOutcome};
use rustc_hash::FxHashMap;

use super::ceiling::Ceilings;
use super::classes;
use super::driver::{Driver, Issue};
use super::scenario::{self, Action};
use super::stats::{self, AdmissionFigures, EngineFigures, RequestRecord, RunDetail};
use super::workload::Workload;
use super::workload::tokens::{mix64, prompt_tokens};
use super::{BenchOptions, MODEL, PolicyRun, PolicySpec};

/// Load samples kept per endpoint for the report (downsampled beyond this).
const MAX_SERIES_POINTS: usize = 2_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// The step of engine rank `.0` started in its generation `.1` ends.
    StepEnd(usize, u64),
    Scrape,
    /// Step the pickers' gates (a deadline, or a session's context expiring).
    Gate,
    /// The scenario's item `.0` takes effect.
    Scenario(usize),
    /// Engine rank `.0` joins the pool (cold).
    Join(usize),
    /// Delayed KV-event batches that are due arrive.
    Deliver,
    /// Every picker publishes its in-flight counts to the others (`--peer-sync-ms`).
    PeerSync,
}

/// A KV-event batch held back by an `event-delay` item: when it arrives, from which engine
/// rank and generation.
struct Delayed {
    due_ms: f64,
    engine: usize,
    generation: u64,
    batch: EventBatch,
}

struct Engine {
    rank: Rank,
    id: EndpointId,
    /// The engine (of the cluster's `--engines`) this rank belongs to; a replacement takes
    /// the number of the engine it replaces.
    host: usize,
    /// How the pool sees it (role, model).
    member: Endpoint,
    /// In the pool's view: out before a scale-out joins it and while it restarts.
    in_pool: bool,
    /// Killed by a `replace` item (a replacement serves in its place).
    dead: bool,
    /// Bumped when the engine dies or restarts: a step or a delayed batch of an earlier
    /// generation is dropped.
    generation: u64,
    /// Event batches published so far (what decides which ones an `event-loss` item drops).
    batches: u64,
    /// A batch of it was lost since the last one the pickers got: the next one shows them the
    /// gap, which no replay fills (a lost batch is not replayable).
    lost: bool,
    /// Its batches of the last `replay_keep_ms`, for a restarted picker's replay.
    log: VecDeque<(f64, EventBatch)>,
    /// The step in progress: its results apply at its end.
    pending: Option<StepOutcome>,
    prefill_ms: f64,
    prefill_tokens: u64,
    series: Vec<(f64, f64)>,
}

struct InFlight {
    guard: InflightGuard,
    engine: usize,
    /// The picker that routed it (its guard, calibration and pins are that picker's).
    picker: usize,
    prompt_tokens: u32,
    /// Its request class ([`Sim::class`]).
    class: usize,
    /// When the driver released it (earlier than `sent_ms` when admission held it).
    release_ms: f64,
    /// When it was sent, and what the cost model estimated its TTFT on (calibration learns
    /// from its first token, as the service does from a streamed response's first chunk).
    sent_ms: f64,
    basis: Option<TtftBasis>,
    /// A split request on its prefill engine: where it decodes next.
    decode: Option<DecodeLeg>,
    /// The prompt tokens its prefill engine had cached (a split request's hit).
    prefill_cached: Option<u32>,
}

/// The decode half of a split request, sent once its prefill finished.
struct DecodeLeg {
    engine: usize,
    /// Counts the request on its decode endpoint from its placement on, as the service does:
    /// the KV it will pull is on its way there.
    guard: InflightGuard,
    tokens: Vec<u32>,
    output_len: u32,
    lora: Option<String>,
}

impl Engine {
    /// A fresh rank serving as `member` (its endpoint id is the member's) for engine `host`.
    fn new(rank: Rank, host: usize, member: Endpoint, in_pool: bool) -> Self {
        Self {
            rank,
            id: member.id,
            host,
            member,
            in_pool,
            dead: false,
            generation: 0,
            batches: 0,
            lost: false,
            log: VecDeque::new(),
            pending: None,
            prefill_ms: 0.0,
            prefill_tokens: 0,
            series: Vec::new(),
        }
    }
}

fn key(t: f64) -> u64 {
    t.max(0.0).to_bits()
}

/// The simulation of one policy.
struct Sim<'a> {
    opts: &'a BenchOptions,
    policy: PolicySpec,
    block_tokens: u32,
    engines: Vec<Engine>,
    by_id: FxHashMap<EndpointId, usize>,
    model_config: Arc<ModelConfig>,
    /// The pickers (`--pickers`), each with every table the service's decision reads and its
    /// policy; all of them get every engine's events and scrapes, each routes its share of
    /// the requests. The first is the one admission, flow control and a `picker-restart`
    /// item act on.
    pickers: Vec<Pool>,
    hasher: BlockHasher,
    /// The service's bounds on a request (prompt length, in-flight per endpoint).
    limits: Limits,
    queue: BinaryHeap<Reverse<(u64, u64, Event)>>,
    seq: u64,
    inflight: FxHashMap<u64, InFlight>,
    records: Vec<RequestRecord>,
    decision_ns: Vec<u64>,
    ceilings: Ceilings,
    scrapes: u64,
    series_every: u64,
    /// The requests waiting at a picker's gate (flow control, session admission), by id.
    waiting: FxHashMap<u64, Issue>,
    /// When an `Event::Gate` is scheduled, if one is.
    gate_check: Option<f64>,
    /// How long each turn admission held waited (ms), and how many left at `maxWait`.
    held_waits: Vec<f64>,
    held_timeouts: usize,
    /// Each session's last served prompt (at most one engine's cache) and when, and the
    /// pool's live context over its capacity at every scrape (admission on).
    last_turns: FxHashMap<u64, (u64, f64)>,
    live_samples: Vec<f64>,
    /// The class of each record, in record order ([`Sim::class`]).
    record_class: Vec<usize>,
    /// KV-event batches an `event-delay` item holds back, in publication order.
    delayed: Vec<Delayed>,
    /// How long engines keep their batches for a restarted picker's replay (the longest
    /// `picker-restart` replay of the scenario; 0: not kept).
    replay_keep_ms: f64,
    /// `--warm-start snapshot`: the first picker's last snapshot (taken every
    /// [`SNAPSHOT_EVERY_MS`] of simulated time) and when it was taken.
    snapshot: Option<(f64, IndexSnapshot)>,
}

/// Every endpoint's copied blocks (`PoolState::export_endpoint`).
type IndexSnapshot = Vec<(EndpointId, Vec<(u64, u64)>)>;

/// How often the offline picker writes its snapshot (the service's default
/// `warmStart.snapshotInterval`).
const SNAPSHOT_EVERY_MS: f64 = 10_000.0;

/// How long copied blocks no event confirmed are kept (the service's default
/// `warmStart.unconfirmedTtl`).
const UNCONFIRMED_TTL_MS: u64 = 120_000;

/// A copy of `pool`'s index, endpoint by endpoint.
fn copy_index(pool: &Pool, engines: &[Engine]) -> IndexSnapshot {
    engines
        .iter()
        .filter_map(|e| {
            let (exported, _) = pool.state().export_endpoint(&e.id)?;
            Some((e.id, exported.blocks))
        })
        .collect()
}

/// The picker's pool for `policy`, as the service builds it from its settings.
fn new_pool(policy: PolicySpec, opts: &BenchOptions, limits: &Limits) -> anyhow::Result<Pool> {
    let mut routing = policy.routing(&opts.routing);
    routing.cost_model.max_batched_tokens = opts.cluster.engine.max_num_batched_tokens;
    // the gate reads flow control from the routing config (the bench gives each request
    // its band itself)
    routing.flow_control.enabled = opts.flow_control;
    routing.validate().map_err(anyhow::Error::msg)?;
    let router = Router::with_policy(routing.clone(), policy.build(&routing, opts.seed));
    // the picker's own settings: index budget, in-flight cap, session pins, ejections
    Ok(Pool::new(
        opts.index_settings().pool_settings(limits),
        router,
    ))
}

impl<'a> Sim<'a> {
    fn new(
        workload: &Workload,
        policy: PolicySpec,
        opts: &'a BenchOptions,
    ) -> anyhow::Result<Self> {
        let c = &opts.cluster;
        anyhow::ensure!(
            c.engines >= 1 && c.dp_size >= 1,
            "need at least one engine rank"
        );
        let block = c.engine.block_size.max(1);
        let mut mc = ModelConfig::new("sim", MODEL);
        mc.block_size = block;
        mc.dp_size = c.dp_size;
        if opts.lora_blind {
            mc.lora_load_ms = 0;
            mc.lora_slot_wait_ms = 0;
        }
        let mc = Arc::new(mc);
        opts.scenario
            .validate(c.engines)
            .map_err(anyhow::Error::msg)?;
        let joining = opts.scenario.joining(c.engines);
        let mut engines = Vec::new();
        let mut by_id = FxHashMap::default();
        for e in 0..c.engines {
            for r in 0..c.dp_size {
                let port = u16::try_from(8000 + e).context("too many engines")?;
                let id = EndpointId::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port, r);
                let mut cfg = c.engine.clone();
                cfg.hash_seed = mix64(opts.seed ^ mix64(e as u64 + 1));
                by_id.insert(id, engines.len());
                let mut endpoint = Endpoint::new(id, mc.clone());
                if c.prefill_engines > 0 {
                    endpoint.role = if e < c.prefill_engines {
                        Role::Prefill
                    } else {
                        Role::Decode
                    };
                }
                let in_pool = !joining.iter().any(|&(j, _)| j == e);
                engines.push(Engine::new(Rank::new(cfg), e, endpoint, in_pool));
            }
        }
        let limits = Limits::default();
        let mut pickers = Vec::new();
        for _ in 0..opts.pickers.max(1) {
            let pool = new_pool(policy, opts, &limits)?;
            pool.apply_view(members(&engines), || {})
                .map_err(|err| anyhow::anyhow!("index: {err}"))?;
            if opts.pickers > 1 && opts.peer_sync_ms > 0.0 {
                pool.share_sessions();
            }
            pickers.push(pool);
        }
        let replay_keep_ms = opts
            .scenario
            .events
            .iter()
            .map(|e| match e.action {
                Action::PickerRestart { replay_ms } => replay_ms,
                _ => 0.0,
            })
            .fold(0.0, f64::max);
        let series_every = ((1000.0 / opts.scrape_ms.max(1.0)).round() as u64).max(1);
        Ok(Self {
            opts,
            policy,
            block_tokens: workload.block_tokens,
            engines,
            by_id,
            model_config: mc,
            pickers,
            hasher: BlockHasher::new(block),
            limits,
            queue: BinaryHeap::new(),
            seq: 0,
            inflight: FxHashMap::default(),
            records: Vec::new(),
            decision_ns: Vec::new(),
            ceilings: Ceilings::new(workload.block_tokens, block, c.capacity_tokens()),
            scrapes: 0,
            series_every,
            waiting: FxHashMap::default(),
            gate_check: None,
            held_waits: Vec::new(),
            held_timeouts: 0,
            last_turns: FxHashMap::default(),
            live_samples: Vec::new(),
            record_class: Vec::new(),
            delayed: Vec::new(),
            replay_keep_ms,
            snapshot: None,
        })
    }

    fn push(&mut self, t: f64, e: Event) {
        self.seq += 1;
        self.queue.push(Reverse((key(t), self.seq, e)));
    }

    /// The request class of `session` ([`classes::of`]).
    fn class(&self, session: u64) -> usize {
        classes::of(self.opts, session)
    }

    fn fail(&mut self, issue: &Issue, t: f64, error: String) {
        self.fail_record(
            self.class(issue.session),
            issue.release_ms,
            issue.input_len,
            t,
            error,
        );
    }

    /// Record a request that ends without an answer at `t`.
    fn fail_record(
        &mut self,
        class: usize,
        release_ms: f64,
        prompt_tokens: u32,
        t: f64,
        error: String,
    ) {
        self.record_class.push(class);
        self.records.push(RequestRecord {
            release_ms,
            prompt_tokens,
            ttft_ms: None,
            e2e_ms: None,
            tpot_ms: None,
            output_tokens: 0,
            cached_tokens: None,
            end_ms: t,
            error: Some(error),
        });
    }

    /// The LoRA adapter of `issue`'s session (`--lora-adapters`): skewed, so that the first
    /// adapters carry most sessions, as a few popular fine-tunes do.
    fn adapter(&self, issue: &Issue) -> Option<String> {
        let k = self.opts.lora_adapters;
        (k > 0).then(|| {
            let u = (mix64(issue.session ^ 0x10ad) >> 11) as f64 / (1u64 << 53) as f64;
            format!("lora-{}", ((f64::from(k) * u * u) as u32).min(k - 1))
        })
    }

    fn session(&self, issue: &Issue) -> Option<String> {
        self.opts
            .session_header
            .then(|| format!("s{}", issue.session))
    }

    /// The request as the service would plan it: no tenant or client salt.
    fn plan(
        &self,
        issue: &Issue,
        tokens: &[u32],
        session: Option<&str>,
    ) -> Result<RequestPlan, String> {
        let lora = self.adapter(issue);
        RequestPlan::new(PlanInput {
            config: &self.model_config,
            lora: lora.as_deref(),
            tokens,
            token_kind: TokenKind::Tokens,
            char_chunk_tokens: self.model_config.block_size,
            tenant_salt: None,
            client_salt: None,
            session,
            request_bytes: &issue.id.to_le_bytes(),
            max_prompt_tokens: self.limits.max_prompt_tokens,
        })
        .map_err(|e| e.to_string())
    }

    /// The picker a request goes through: the client spreads them over the pickers.
    fn picker_of(&self, issue: &Issue) -> usize {
        (issue.id % self.pickers.len() as u64) as usize
    }

    /// A released request at `t` arrives at its picker's gate ([`Pool::arrive`]): sent now,
    /// held (answered by a later [`Self::step_gates`]) or refused. Returns `false` when it
    /// failed (and must be completed in the driver right away).
    fn dispatch(&mut self, issue: &Issue, t: f64) -> bool {
        let class = self.class(issue.session);
        let session = self.session(issue);
        let prompt = issue
            .input_len
            .min(u32::try_from(issue.hash_ids.len()).unwrap_or(u32::MAX) * self.block_tokens);
        let arrival = Arrival {
            id: issue.id,
            config: self.model_config.name.to_string(),
            band: classes::priority(class),
            flow: classes::flow(class),
            tokens: u64::from(issue.input_len) + u64::from(issue.output_len),
            bytes: 0,
            deadline_ms: None,
            session: Router::session_key(None, session.as_deref()),
            prompt_tokens: prompt,
            not_before_ms: None,
        };
        let k = self.picker_of(issue);
        match self.pickers[k].arrive(t as u64, arrival) {
            Arrived::Go(pass) => self.send(issue, t, pass),
            Arrived::Wait => {
                self.waiting.insert(issue.id, issue.clone());
                self.schedule_gate_check();
                true
            }
            Arrived::Refused(_) => {
                self.fail(
                    issue,
                    t,
                    "flow control: answered 429 without service".into(),
                );
                false
            }
        }
    }

    fn schedule_gate_check(&mut self) {
        let next = self.pickers.iter().filter_map(Pool::next_wake).min();
        if let Some(at) = next {
            let at = at as f64;
            if self.gate_check.is_none_or(|s| at < s) {
                self.gate_check = Some(at);
                self.push(at, Event::Gate);
            }
        }
    }

    /// Every picker's gate at `t` ([`Pool::step_waiting`]): the requests whose turn came, to
    /// be sent, and those answered without service.
    fn step_gates(&mut self, t: f64) -> (Vec<(Issue, Pass)>, Vec<Issue>) {
        let (mut go, mut gone) = (Vec::new(), Vec::new());
        if self.waiting.is_empty() {
            return (go, gone);
        }
        for k in 0..self.pickers.len() {
            for action in self.pickers[k].step_waiting(t as u64) {
                match action {
                    GateAction::Go { id, pass } => {
                        let Some(issue) = self.waiting.remove(&id) else {
                            continue;
                        };
                        if pass.admission_wait_ms.is_some() {
                            self.held_waits.push(t - issue.release_ms);
                            self.held_timeouts += usize::from(pass.admitted == Admitted::Timeout);
                        }
                        go.push((issue, pass));
                    }
                    GateAction::Refuse { id, .. } => gone.extend(self.waiting.remove(&id)),
                }
            }
        }
        self.schedule_gate_check();
        (go, gone)
    }

    /// Route and submit one request at `t` that passed its picker's gate with `pass`: what
    /// the pass took is given back once it is placed (flow control's in-transit count) and
    /// served (admission's reservation). Returns `false` when it failed (and must be
    /// completed in the driver right away).
    fn send(&mut self, issue: &Issue, t: f64, pass: Pass) -> bool {
        let sent = self.route_and_submit(issue, t, pass.reservation);
        if pass.flow_wait_ms.is_some() {
            let pool = &self.pickers[self.picker_of(issue)];
            pool.waiting().lock().placed(&self.model_config.name);
        }
        sent
    }

    fn route_and_submit(&mut self, issue: &Issue, t: f64, reservation: Option<Ticket>) -> bool {
        let tokens = prompt_tokens(&issue.hash_ids, self.block_tokens, issue.input_len);
        self.ceilings.observe(&issue.hash_ids, issue.input_len);
        let session = self.session(issue);
        let started = self.opts.time_decisions.then(Instant::now);
        let plan = self.plan(issue, &tokens, session.as_deref());
        let now = t as u64;
        let k = self.picker_of(issue);
        // flow control places a request on an endpoint with room for its band, when one has
        let router = self.pickers[k].router();
        let routing = router.config();
        let room: Option<Vec<EndpointId>> = (routing.flow_control.enabled
            && routing.flow_control.placement == FlowPlacement::WithRoom)
            .then(|| {
                let band = classes::priority(self.class(issue.session));
                let s = routing.saturation.for_band(band);
                self.pickers[k]
                    .rooms(&self.model_config.name, &s)
                    .into_iter()
                    .map(|(e, _)| e)
                    .collect::<Vec<_>>()
            })
            .filter(|v| !v.is_empty());
        let allow = |e: &Endpoint| room.as_ref().is_none_or(|r| r.binary_search(&e.id).is_ok());
        let scope = Scope {
            allow: room
                .is_some()
                .then_some(&allow as &(dyn Fn(&Endpoint) -> bool + Sync)),
            ..Scope::default()
        };
        let placed = plan.and_then(|plan| {
            let req = plan.route_request(&self.model_config, scope, false);
            let pool = &self.pickers[k];
            let split = pool.place_split(&req, now).map_err(|e| e.to_string())?;
            // what the service records for a forwarded request
            if let Some(prefill) = &split.prefill {
                pool.record(prefill, &plan.keys, now);
            }
            pool.record(&split.placement, &plan.keys, now);
            Ok((split, plan))
        });
        if let Some(s) = started {
            self.decision_ns.push(s.elapsed().as_nanos() as u64);
        }
        let (split, plan) = match placed {
            Ok(p) => p,
            Err(e) => {
                self.fail(issue, t, format!("routing: {e}"));
                return false;
            }
        };
        let placement = split.placement;
        // a split request goes to its prefill engine first, for one token
        let (first, decode) = match &split.prefill {
            Some(prefill) => (prefill, true),
            None => (&placement, false),
        };
        let d = &first.decision;
        let Some(&e) = self.by_id.get(&d.endpoint) else {
            self.fail(
                issue,
                t,
                format!("routing chose unknown endpoint {}", d.endpoint),
            );
            return false;
        };
        let prompt = tokens.len() as u64;
        let guard = self.pickers[k].begin(
            d.endpoint,
            prompt,
            prompt.saturating_sub(u64::from(d.cached_tokens)),
            !plan.keys.is_empty(),
        );
        let lora = self.adapter(issue);
        let decode = match decode {
            false => None,
            true => {
                let Some(&engine) = self.by_id.get(&placement.decision.endpoint) else {
                    self.fail(issue, t, "routing chose an unknown decode endpoint".into());
                    return false;
                };
                // nothing to prefill there: its KV arrives (as the service counts it)
                let guard = self.pickers[k].begin(
                    placement.decision.endpoint,
                    prompt,
                    0,
                    !plan.keys.is_empty(),
                );
                Some(DecodeLeg {
                    engine,
                    guard,
                    tokens: tokens.clone(),
                    output_len: issue.output_len,
                    lora: lora.clone(),
                })
            }
        };
        let eng = &mut self.engines[e];
        let submitted = eng.rank.submit_at(
            Request {
                id: issue.id,
                token_ids: tokens,
                max_tokens: if decode.is_some() {
                    1
                } else {
                    issue.output_len
                },
                cache_salt: None,
                lora,
                remote_blocks: 0,
            },
            t,
        );
        if let Err(err) = submitted {
            drop(guard);
            self.fail(issue, t, format!("engine rejected the request: {err}"));
            return false;
        }
        // the simulated engine serves it where it goes: the session is pinned there (where
        // it decodes)
        self.pickers[k].settle(
            placement.session_key,
            u64::from(placement.prompt_tokens),
            placement.decision.endpoint,
            reservation,
            t as u64,
        );
        if placement.session_key.is_some() {
            let engine_cache = u64::from(self.opts.cluster.engine.num_blocks)
                * u64::from(self.opts.cluster.engine.block_size);
            self.last_turns
                .insert(issue.session, (prompt.min(engine_cache), t));
        }
        self.inflight.insert(
            issue.id,
            InFlight {
                guard,
                engine: e,
                picker: k,
                prompt_tokens: prompt as u32,
                class: self.class(issue.session),
                release_ms: issue.release_ms,
                sent_ms: t,
                basis: placement.ttft_basis,
                decode,
                prefill_cached: None,
            },
        );
        if self.engines[e].pending.is_none() {
            self.engines[e].rank.advance_to(t);
            self.start_step(e);
        }
        true
    }

    fn start_step(&mut self, e: usize) {
        if let Some(out) = self.engines[e].rank.next_step() {
            let end = out.end_ms;
            self.engines[e].pending = Some(out);
            let generation = self.engines[e].generation;
            self.push(end, Event::StepEnd(e, generation));
        }
    }

    /// Apply the step that ended at `t` on engine `e`; returns the finished request ids.
    fn step_end(&mut self, e: usize, generation: u64, t: f64, done: &mut Vec<u64>) {
        if self.engines[e].generation != generation {
            return; // a step of an engine that has died or restarted since
        }
        let Some(out) = self.engines[e].pending.take() else {
            return;
        };
        let eng = &mut self.engines[e];
        let model = &eng.rank.config().step_time;
        let prefill = (model.prefill_ms(u64::from(out.prefill_tokens), 0.0) * eng.rank.slowdown())
            .min(out.duration_ms);
        eng.prefill_ms += prefill;
        eng.prefill_tokens += u64::from(out.prefill_tokens);
        let mut events = out.kv_events;
        if self.opts.tier_blind {
            events.retain(|e| match e {
                KvEvent::BlockStored { medium, .. } | KvEvent::BlockRemoved { medium, .. } => {
                    medium.as_deref().is_none_or(|m| m == "GPU")
                }
                // the simulator writes through to its CPU tier: it never moves a block
                KvEvent::BlockMoved { .. } => false,
                KvEvent::AllBlocksCleared => true,
            });
        }
        if !events.is_empty() {
            let batch = EventBatch {
                ts: t / 1000.0,
                events: coalesce_removals(events),
                data_parallel_rank: Some(eng.id.rank),
                skipped_unknown: 0,
            };
            self.publish(e, t, batch);
        }
        let id_e = self.engines[e].id;
        for id in &out.first_tokens {
            if let Some(f) = self.inflight.get_mut(id) {
                f.guard.first_token();
                if let Some(basis) = f.basis {
                    let mut calibration = self.pickers[f.picker].calibration().write();
                    calibration.age_endpoint(&id_e, t as u64);
                    calibration.observe_ttft(&id_e, basis, t - f.sent_ms);
                }
            }
        }
        let mut decodes = Vec::new();
        for f in out.finished {
            let Some(mut fl) = self.inflight.remove(&f.id) else {
                continue;
            };
            debug_assert_eq!(fl.engine, e);
            if let Some(leg) = fl.decode.take() {
                // the prefill step answered: the decode engine pulls the prompt's KV
                decodes.push((f.id, f.cached_tokens, fl, leg));
                continue;
            }
            drop(fl.guard);
            let tpot = (f.output_tokens > 1)
                .then(|| (f.finish_ms - f.first_token_ms) / f64::from(f.output_tokens - 1));
            // from its release: a turn admission held waited that long too
            self.record_class.push(fl.class);
            self.records.push(RequestRecord {
                release_ms: fl.release_ms,
                prompt_tokens: f.prompt_tokens,
                ttft_ms: Some(f.first_token_ms - fl.release_ms),
                e2e_ms: Some(f.finish_ms - fl.release_ms),
                tpot_ms: tpot,
                output_tokens: f.output_tokens,
                cached_tokens: Some(fl.prefill_cached.unwrap_or(f.cached_tokens)),
                end_ms: f.finish_ms,
                error: None,
            });
            done.push(f.id);
        }
        if self.engines[e].rank.has_work() {
            self.start_step(e);
        }
        for (id, cached, fl, leg) in decodes {
            self.send_decode(id, cached, fl, leg, t);
        }
    }

    /// Send the decode step of split request `id` (its prefill done at `t`, with `cached`
    /// prompt tokens from the prefill engine's cache) to its decode engine.
    fn send_decode(&mut self, id: u64, cached: u32, fl: InFlight, leg: DecodeLeg, t: f64) {
        let InFlight {
            guard,
            class,
            release_ms,
            picker,
            ..
        } = fl;
        drop(guard);
        let prompt = leg.tokens.len() as u64;
        // every block of the prompt, the partial last one included (the prefill engine keeps
        // the request's blocks for the pull)
        let blocks = u32::try_from(prompt.div_ceil(u64::from(
            self.engines[leg.engine].rank.config().block_size.max(1),
        )))
        .unwrap_or(u32::MAX);
        let guard = leg.guard;
        let submitted = self.engines[leg.engine].rank.submit_at(
            Request {
                id,
                token_ids: leg.tokens,
                max_tokens: leg.output_len,
                cache_salt: None,
                lora: leg.lora,
                remote_blocks: blocks,
            },
            t,
        );
        if let Err(err) = submitted {
            drop(guard);
            self.fail_record(
                class,
                release_ms,
                prompt as u32,
                t,
                format!("decode engine rejected the request: {err}"),
            );
            return;
        }
        self.inflight.insert(
            id,
            InFlight {
                guard,
                engine: leg.engine,
                picker,
                prompt_tokens: prompt as u32,
                class,
                release_ms,
                sent_ms: t,
                basis: None,
                decode: None,
                prefill_cached: Some(cached),
            },
        );
        if self.engines[leg.engine].pending.is_none() {
            self.engines[leg.engine].rank.advance_to(t);
            self.start_step(leg.engine);
        }
    }

    fn scrape(&mut self, t: f64) {
        if self.opts.warm_start == crate::WarmStartSource::Snapshot
            && self
                .snapshot
                .as_ref()
                .is_none_or(|(at, _)| t - at >= SNAPSHOT_EVERY_MS)
        {
            self.snapshot = Some((t, copy_index(&self.pickers[0], &self.engines)));
        }
        let admission = self.pickers[0].router().config().admission;
        if admission.enabled {
            // the sessions' live context, as one picker seeing every turn would count it
            let horizon = self.pickers[0].reuse_horizon_ms() as f64;
            let live: u64 = self
                .last_turns
                .values()
                .filter(|(_, at)| t - at <= horizon)
                .map(|(tokens, _)| tokens)
                .sum();
            let capacity = self.opts.cluster.capacity_tokens() as f64 * admission.overcommit;
            self.live_samples.push(live as f64 / capacity.max(1.0));
        }
        let record = self.scrapes.is_multiple_of(self.series_every);
        self.scrapes += 1;
        let mut samples = Vec::with_capacity(self.engines.len());
        for eng in &mut self.engines {
            if eng.dead || !eng.in_pool {
                continue;
            }
            let s = eng.rank.stats();
            // what vLLM's `lora_requests_info` would say
            let l = eng.rank.lora_state();
            let csv = |v: &[Arc<str>]| v.iter().map(|n| &**n).collect::<Vec<_>>().join(",");
            let lora = l
                .max_loras
                .map(|m| LoraActivity::new(&csv(&l.running), &csv(&l.waiting), Some(m)));
            samples.push((
                eng.id,
                EndpointLoad {
                    waiting: s.waiting as f64,
                    running: s.running as f64,
                    kv_usage: s.kv_usage,
                    kv_capacity_blocks: Some(u64::from(s.num_blocks)),
                    sampled_at_ms: t as u64,
                    lora,
                },
            ));
            if record {
                eng.series
                    .push((t / 1000.0, (s.waiting + s.running) as f64));
            }
        }
        // what the service's scraper does with a scrape (none arrives while metrics are stale)
        let now = t as u64;
        if self
            .opts
            .scenario
            .active(t, |a| matches!(a, Action::StaleMetrics { .. }))
            .is_none()
        {
            for pool in &self.pickers {
                pool.observe_scrape(now, samples.clone());
            }
        }
        for pool in &self.pickers {
            if pool.router().config().cost_model.calibrate {
                pool.calibration().write().age(now);
            }
        }
    }

    fn busy(&self) -> bool {
        self.engines.iter().any(|e| e.pending.is_some())
    }

    /// Engine rank `e` publishes a KV-event batch at `t`: the picker gets it now, later
    /// (`event-delay`, or behind earlier delayed batches of the engine) or never
    /// (`event-loss`).
    fn publish(&mut self, e: usize, t: f64, batch: EventBatch) {
        let keep = self.replay_keep_ms;
        let eng = &mut self.engines[e];
        eng.batches += 1;
        if keep > 0.0 {
            eng.log.push_back((t, batch.clone()));
            while eng.log.front().is_some_and(|(at, _)| *at < t - keep) {
                eng.log.pop_front();
            }
        }
        let scenario = &self.opts.scenario;
        if let Some(&Action::EventLoss { fraction, .. }) =
            scenario.active(t, |a| matches!(a, Action::EventLoss { .. }))
        {
            let u = (mix64(self.opts.seed ^ mix64(e as u64 + 1) ^ mix64(eng.batches)) >> 11) as f64
                / (1u64 << 53) as f64;
            if u < fraction {
                eng.lost = true;
                return;
            }
        }
        let delay = match scenario.active(t, |a| matches!(a, Action::EventDelay { .. })) {
            Some(&Action::EventDelay { delay_ms, .. }) => delay_ms,
            _ => 0.0,
        };
        // a feed keeps its order: a batch waits behind the engine's delayed ones
        let behind = self
            .delayed
            .iter()
            .filter(|d| d.engine == e)
            .map(|d| d.due_ms)
            .fold(f64::NEG_INFINITY, f64::max);
        if delay > 0.0 || behind.is_finite() {
            let due_ms = (t + delay).max(behind);
            let generation = self.engines[e].generation;
            self.delayed.push(Delayed {
                due_ms,
                engine: e,
                generation,
                batch,
            });
            self.push(due_ms, Event::Deliver);
            return;
        }
        self.resync_if_lost(e);
        self.apply(e, &batch, 0..self.pickers.len());
    }

    /// A batch of engine rank `e` arrives after one that was lost: each picker's subscriber
    /// sees the gap, asks for a replay that does not hold it, and resyncs (the service's
    /// `PoolState::resync`).
    fn resync_if_lost(&mut self, e: usize) {
        if std::mem::take(&mut self.engines[e].lost) {
            let id = self.engines[e].id;
            let reason = ResyncReason::ReplayShort {
                requested: self.engines[e].batches,
                first: None,
            };
            for pool in &self.pickers {
                pool.state().resync(&id, &reason);
            }
        }
    }

    /// The delayed batches due by `t` arrive, in publication order.
    fn deliver(&mut self, t: f64) {
        let (due, later): (Vec<Delayed>, Vec<Delayed>) = std::mem::take(&mut self.delayed)
            .into_iter()
            .partition(|d| d.due_ms <= t);
        self.delayed = later;
        for d in due {
            if self.engines[d.engine].generation == d.generation {
                self.resync_if_lost(d.engine);
                self.apply(d.engine, &d.batch, 0..self.pickers.len());
            }
        }
    }

    /// Every picker publishes its own in-flight counts to every other one, and forgets what
    /// a peer has not refreshed within the peer TTL (as the service's `peers` feed does).
    fn peer_sync(&self, t: f64) {
        let now = t as u64;
        let ttl = kvroute_picker::inflight::peer_ttl_ms(self.opts.peer_sync_ms as u64);
        for (k, from) in self.pickers.iter().enumerate() {
            let counts = from.inflight().own_counts();
            let news = from.take_shared(now);
            for (j, to) in self.pickers.iter().enumerate() {
                if j != k {
                    to.inflight().apply_peer(
                        k as u64,
                        &counts,
                        now,
                        kvroute_picker::inflight::PeerBound::default(),
                    );
                    to.apply_shared(k as u64, &news, now);
                }
            }
        }
        for p in &self.pickers {
            p.inflight().expire_peers(now.saturating_sub(ttl));
            p.expire_peers(now.saturating_sub(ttl));
        }
    }

    /// The pickers `pickers` ingest a batch of engine rank `e`, as the service does.
    fn apply(&self, e: usize, batch: &EventBatch, pickers: std::ops::Range<usize>) {
        let keys = IngestKeys {
            hasher: self.hasher,
            model: MODEL,
        };
        let id = self.engines[e].id;
        for pool in &self.pickers[pickers] {
            let stats = pool.state().apply_batch(&id, keys, batch);
            // (orphan stores are expected after a picker restart: they mark the view's gap)
            if stats.is_some_and(|s| s.overflowed) {
                tracing::warn!(endpoint = %id, ?stats, "offline index lost track of an engine");
            }
        }
    }

    /// Give the pool the engines that serve now (what the controller's view would say).
    fn refresh_view(&mut self) {
        for pool in &self.pickers {
            if let Err(err) = pool.apply_view(members(&self.engines), || {}) {
                tracing::warn!(%err, "offline: the pool refused the view");
            }
        }
    }

    /// Item `i` of the scenario takes effect at `t`; requests it ends go to `done`.
    fn scenario_event(&mut self, i: usize, t: f64, done: &mut Vec<u64>) -> anyhow::Result<()> {
        let action = self.opts.scenario.events[i].action.clone();
        let ranks = |sim: &Self, host: usize| -> Vec<usize> {
            (0..sim.engines.len())
                .filter(|&r| sim.engines[r].host == host && !sim.engines[r].dead)
                .collect()
        };
        match action {
            // the engines it adds are out of the view from the start and join by their own
            // events
            Action::ScaleOut { .. }
            | Action::StaleMetrics { .. }
            | Action::EventDelay { .. }
            | Action::EventLoss { .. } => {}
            Action::Replace { engine, after_ms } => {
                for r in ranks(self, engine) {
                    self.kill(r, t, "the engine died", done);
                    self.engines[r].dead = true;
                    let new = self.spawn_replacement(r)?;
                    self.push(t + after_ms, Event::Join(new));
                }
                self.refresh_view();
            }
            Action::Restart { engine, down_ms } => {
                for r in ranks(self, engine) {
                    self.kill(r, t, "the engine restarted", done);
                    self.push(t + down_ms, Event::Join(r));
                }
                self.refresh_view();
            }
            Action::PickerRestart { replay_ms } => self.restart_picker(t, replay_ms, done)?,
        }
        Ok(())
    }

    /// Engine rank `r` goes away at `t` with its cache: the requests on it (or bound for it)
    /// fail with `why`; it leaves the pool's view (the caller refreshes it).
    fn kill(&mut self, r: usize, t: f64, why: &str, done: &mut Vec<u64>) {
        let eng = &mut self.engines[r];
        eng.generation += 1;
        eng.pending = None;
        eng.in_pool = false;
        eng.log.clear();
        eng.rank.reset(false);
        eng.rank.advance_to(t);
        let mut ids: Vec<u64> = self
            .inflight
            .iter()
            .filter(|(_, f)| f.engine == r || f.decode.as_ref().is_some_and(|d| d.engine == r))
            .map(|(&id, _)| id)
            .collect();
        ids.sort_unstable();
        for id in ids {
            self.end_inflight(id, t, why, done);
        }
    }

    /// Request `id` in flight ends at `t` without an answer (`why`); its engine drops it.
    fn end_inflight(&mut self, id: u64, t: f64, why: &str, done: &mut Vec<u64>) {
        let Some(f) = self.inflight.remove(&id) else {
            return;
        };
        self.engines[f.engine].rank.abort(id);
        self.fail_record(f.class, f.release_ms, f.prompt_tokens, t, why.to_string());
        done.push(id);
    }

    /// A new engine rank like `r` (role, configuration), empty, out of the pool until it
    /// joins; returns its index.
    fn spawn_replacement(&mut self, r: usize) -> anyhow::Result<usize> {
        let n = self.engines.len();
        let old = &self.engines[r];
        let port = u16::try_from(9000 + n).context("too many engine replacements")?;
        let id = EndpointId::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port, old.id.rank);
        let mut cfg = old.rank.config().clone();
        cfg.hash_seed = mix64(self.opts.seed ^ mix64(n as u64 + 0x5e1a));
        let mut member = old.member.clone();
        member.id = id;
        let engine = Engine::new(Rank::new(cfg), old.host, member, false);
        self.by_id.insert(id, n);
        self.engines.push(engine);
        Ok(n)
    }

    /// The (first) picker restarts at `t`: the requests it held (in flight through it, or
    /// waiting in its admission or flow-control queues) fail; its index, loads, pins and
    /// calibration start empty, and each engine replays the batches of its last `replay_ms`.
    fn restart_picker(
        &mut self,
        t: f64,
        replay_ms: f64,
        done: &mut Vec<u64>,
    ) -> anyhow::Result<()> {
        let mut ids: Vec<u64> = self
            .inflight
            .iter()
            .filter(|(_, f)| f.picker == 0)
            .map(|(&id, _)| id)
            .collect();
        ids.sort_unstable();
        for id in ids {
            self.end_inflight(id, t, "the picker restarted", done);
        }
        // what waited at its gate
        let mut waiting: Vec<u64> = self
            .waiting
            .keys()
            .copied()
            .filter(|&id| id % self.pickers.len() as u64 == 0)
            .collect();
        waiting.sort_unstable();
        for id in waiting {
            if let Some(issue) = self.waiting.remove(&id) {
                self.fail(&issue, t, "the picker restarted".into());
                done.push(issue.id);
            }
        }
        // warm start: the copy it starts from (a peer's index now, or its own last snapshot)
        let copy = match self.opts.warm_start {
            crate::WarmStartSource::None => Vec::new(),
            crate::WarmStartSource::Peer => {
                let peer = &self.pickers[self.pickers.len().min(2) - 1];
                copy_index(peer, &self.engines)
            }
            crate::WarmStartSource::Snapshot => {
                self.snapshot.take().map(|(_, c)| c).unwrap_or_default()
            }
        };
        let pool = new_pool(self.policy, self.opts, &self.limits)?;
        pool.apply_view(members(&self.engines), || {})
            .map_err(|err| anyhow::anyhow!("index: {err}"))?;
        for (id, blocks) in &copy {
            pool.state()
                .seed_endpoint(id, blocks, t as u64 + UNCONFIRMED_TTL_MS, None);
        }
        if self.pickers.len() > 1 && self.opts.peer_sync_ms > 0.0 {
            pool.share_sessions();
        }
        self.pickers[0] = pool;
        // what the new subscriptions get replayed (a batch still delayed reaches the others
        // and, after the replay, the new one too)
        for e in 0..self.engines.len() {
            if self.engines[e].dead || !self.engines[e].in_pool {
                continue;
            }
            let replay: Vec<EventBatch> = self.engines[e]
                .log
                .iter()
                .filter(|(at, _)| *at >= t - replay_ms)
                .map(|(_, b)| b.clone())
                .collect();
            for batch in &replay {
                self.apply(e, batch, 0..1);
            }
        }
        Ok(())
    }
}

/// The pool members the engines make: those in the view.
fn members(engines: &[Engine]) -> Vec<PoolMember> {
    engines
        .iter()
        .filter(|e| e.in_pool && !e.dead)
        .map(|e| PoolMember {
            endpoint: e.member.clone(),
            precise: true,
            kv_capacity_blocks: None,
        })
        .collect()
}

/// Replay `workload` through `strategy` on a fresh simulated cluster. `progress` is called
/// with (completed, total) as requests finish.
pub fn run(
    workload: &Workload,
    policy: impl Into<PolicySpec>,
    opts: &BenchOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> anyhow::Result<PolicyRun> {
    let policy = policy.into();
    let mut sim = Sim::new(workload, policy, opts)?;
    for (i, e) in opts.scenario.events.iter().enumerate() {
        sim.push(e.at_ms, Event::Scenario(i));
    }
    for (host, at) in opts.scenario.joining(opts.cluster.engines) {
        for r in 0..sim.engines.len() {
            if sim.engines[r].host == host {
                sim.push(at, Event::Join(r));
            }
        }
    }
    let mut driver = Driver::new(workload, opts.max_requests).with_deadline(opts.max_duration_ms);
    let total = driver.total_requests();
    let mut issues: Vec<Issue> = Vec::new();
    let mut done: Vec<u64> = Vec::new();
    let mut completed = 0usize;
    sim.push(0.0, Event::Scrape);
    if sim.pickers.len() > 1 && opts.peer_sync_ms > 0.0 {
        sim.push(0.0, Event::PeerSync);
    }
    loop {
        let tq = sim
            .queue
            .peek()
            .map(|Reverse((k, _, _))| f64::from_bits(*k));
        let td = driver.next_due();
        let t = match (tq, td) {
            (None, None) => break,
            (Some(q), Some(d)) if d < q => {
                driver.release_due(d, &mut issues);
                d
            }
            (None, Some(d)) => {
                driver.release_due(d, &mut issues);
                d
            }
            (Some(_), _) => {
                let Some(Reverse((k, _, ev))) = sim.queue.pop() else {
                    break;
                };
                let t = f64::from_bits(k);
                match ev {
                    Event::StepEnd(e, generation) => sim.step_end(e, generation, t, &mut done),
                    Event::Scenario(i) => sim.scenario_event(i, t, &mut done)?,
                    Event::Join(r) => {
                        sim.engines[r].in_pool = true;
                        sim.refresh_view();
                    }
                    Event::Deliver => sim.deliver(t),
                    Event::Scrape => {
                        sim.scrape(t);
                        if !driver.finished() || sim.busy() {
                            sim.push(t + opts.scrape_ms.max(1.0), Event::Scrape);
                        }
                    }
                    Event::Gate => sim.gate_check = None,
                    Event::PeerSync => {
                        sim.peer_sync(t);
                        if !driver.finished() || sim.busy() {
                            sim.push(t + opts.peer_sync_ms, Event::PeerSync);
                        }
                    }
                }
                t
            }
        };
        for id in done.drain(..) {
            completed += 1;
            driver.complete(id, t, &mut issues);
        }
        // dispatching may fail a request, which completes it and may release the next one;
        // the turns admission holds are polled after every event (served turns and expiring
        // sessions change the room)
        loop {
            while !issues.is_empty() {
                let batch: Vec<Issue> = std::mem::take(&mut issues);
                for issue in batch {
                    if !sim.dispatch(&issue, t) {
                        completed += 1;
                        driver.complete(issue.id, t, &mut issues);
                    }
                }
            }
            let (released, gone) = sim.step_gates(t);
            for issue in gone {
                sim.fail(
                    &issue,
                    t,
                    "flow control: answered 429 without service".into(),
                );
                completed += 1;
                driver.complete(issue.id, t, &mut issues);
            }
            if released.is_empty() && issues.is_empty() {
                break;
            }
            for (issue, pass) in released {
                if !sim.send(&issue, t, pass) {
                    completed += 1;
                    driver.complete(issue.id, t, &mut issues);
                }
            }
        }
        progress(completed, total);
        if !sim.busy() && driver.next_due().is_none() && !sim.inflight.is_empty() {
            anyhow::bail!(
                "the simulated engines stopped with {} requests unfinished (a request that \
                 can never be scheduled)",
                sim.inflight.len()
            );
        }
        if driver.finished()
            && !sim.busy()
            && sim
                .queue
                .iter()
                .all(|Reverse((_, _, e))| matches!(e, Event::Scrape | Event::PeerSync))
        {
            break;
        }
    }
    progress(completed, total);
    Ok(finish(sim, &policy.name()))
}

fn finish(sim: Sim<'_>, name: &str) -> PolicyRun {
    let start = sim
        .records
        .iter()
        .map(|r| r.release_ms)
        .fold(f64::INFINITY, f64::min);
    let end = sim.records.iter().map(|r| r.end_ms).fold(0.0, f64::max);
    let span = if end > start { end - start } else { 0.0 };
    let (mut hits, mut queries) = (0u64, 0u64);
    let mut prompt_tokens: Vec<f64> = Vec::with_capacity(sim.engines.len());
    for e in &sim.engines {
        let s = e.rank.stats();
        hits += s.prefix_cache_hits;
        queries += s.prefix_cache_queries;
        prompt_tokens.push(s.prefix_cache_queries as f64);
    }
    let prefill_tokens: Vec<f64> = sim
        .engines
        .iter()
        .map(|e| e.prefill_tokens as f64)
        .collect();
    let prefill_util = if span > 0.0 {
        sim.engines
            .iter()
            .map(|e| (e.prefill_ms / span).min(1.0))
            .sum::<f64>()
            / sim.engines.len() as f64
    } else {
        0.0
    };
    let decision_us_p99 = if sim.decision_ns.is_empty() {
        None
    } else {
        let mut v: Vec<f64> = sim.decision_ns.iter().map(|&n| n as f64 / 1000.0).collect();
        v.sort_by(f64::total_cmp);
        Some((stats::percentile(&v, 99.0) * 10.0).round() / 10.0)
    };
    let figures = EngineFigures {
        // a split request queries the cache of both its engines: its hit is the prefill's,
        // in its record
        hit_rate: (queries > 0 && sim.opts.cluster.prefill_engines == 0)
            .then(|| hits as f64 / queries as f64),
        load_cv: stats::coefficient_of_variation(&prefill_tokens),
        prefill_util,
        decision_us_p99,
    };
    let (summary, ttfts, errors) = stats::summarize(
        name,
        &sim.records,
        sim.ceilings.ceiling(),
        figures,
        sim.opts.slo,
    );
    let (phases, recoveries) = if sim.opts.scenario.is_empty() {
        (Vec::new(), Vec::new())
    } else {
        (
            scenario::phases(&sim.opts.scenario, &sim.records, sim.opts.slo),
            scenario::recoveries(&sim.opts.scenario, &sim.records),
        )
    };
    let load_series = sim
        .engines
        .iter()
        .map(|e| (e.id.to_string(), downsample(&e.series, MAX_SERIES_POINTS)))
        .collect();
    PolicyRun {
        summary,
        detail: RunDetail {
            ttfts_sorted: ttfts,
            load_series,
            hit_rate_ideal: sim.ceilings.ideal(),
            error_samples: errors,
            picker: None,
            engine_prefill_tokens: prefill_tokens,
            engine_prompt_tokens: prompt_tokens,
            classes: classes::figures(sim.opts, &sim.records, &sim.record_class),
            lora: (sim.opts.lora_adapters > 0).then(|| {
                sim.engines.iter().fold((0, 0, 0), |(q, r, l), e| {
                    let s = e.rank.stats();
                    (q + s.lora_requests, r + s.lora_resident, l + s.lora_loads)
                })
            }),
            phases,
            recoveries,
            restarted_picker: None,
            admission: sim.pickers[0].router().config().admission.enabled.then(|| {
                AdmissionFigures::from_waits(&sim.held_waits, sim.held_timeouts, &sim.live_samples)
            }),
        },
    }
}

/// Merge runs of consecutive `BlockRemoved` events into one. The engine model reports each
/// evicted block on its own; the index removes a batch with its memory accesses overlapped,
/// which is most of the offline run time on long traces. Order is preserved.
fn coalesce_removals(events: Vec<KvEvent>) -> Vec<KvEvent> {
    let mut out: Vec<KvEvent> = Vec::with_capacity(events.len());
    for e in events {
        if let KvEvent::BlockRemoved {
            block_hashes,
            medium,
            place,
        } = e
        {
            if let Some(KvEvent::BlockRemoved {
                block_hashes: prev,
                medium: prev_medium,
                place: prev_place,
            }) = out.last_mut()
                && *prev_medium == medium
                && *prev_place == place
            {
                prev.extend_from_slice(&block_hashes);
                continue;
            }
            out.push(KvEvent::BlockRemoved {
                block_hashes,
                medium,
                place,
            });
        } else {
            out.push(e);
        }
    }
    out
}

/// Keep at most `max` points, evenly spaced.
pub(crate) fn downsample(points: &[(f64, f64)], max: usize) -> Vec<(f64, f64)> {
    if points.len() <= max || max == 0 {
        return points.to_vec();
    }
    let step = points.len().div_ceil(max);
    points.iter().step_by(step).copied().collect()
}
