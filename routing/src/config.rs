//! Routing policy configuration.
//!
//! These types are both the `routing` section of the picker's YAML config file and the
//! `spec.routing` section of the `KVRoutePool` custom resource (the CRD's schema is generated
//! from them), so what users write in the resource is exactly what the picker runs. Doc comments
//! here are what `kubectl explain` shows.

use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// How the picker chooses among eligible endpoints: `CostModel` (default), `Weighted`,
/// `LeastLoad`, `RoundRobin`, `Random`, `CacheAware`, `KvCost` or `SessionHash`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, JsonSchema)]
pub enum Strategy {
    /// Estimate each endpoint's time-to-first-token (queued prefill work ahead of the request
    /// plus the prefill of its uncached tokens) and take the minimum. The default.
    #[default]
    CostModel,
    /// Weighted sum of normalized scores (prefix cache, queue, KV utilization, in-flight,
    /// session affinity); the highest wins.
    Weighted,
    /// Least loaded endpoint; ignores the cache. A baseline.
    LeastLoad,
    /// Endpoints in turn. A baseline.
    RoundRobin,
    /// Uniformly random. A baseline.
    Random,
    /// SGLang-router style: least loaded when load is imbalanced beyond the balance thresholds,
    /// else the best prefix match above `cacheAware.matchThreshold`, else the endpoint with
    /// the most free cache.
    CacheAware,
    /// Dynamo-router style cost: `overlapWeight * prefill blocks + decode blocks`, chosen by
    /// softmax sampling with `temperature` (0 = always the minimum).
    KvCost,
    /// Consistent (rendezvous) hashing of the session (`sessionHeader`, within its tenant;
    /// a request without one hashes its first block): a session stays on one endpoint while
    /// the set holds, and only the sessions of an endpoint that leaves move. Ignores load and
    /// cache. A baseline: what agentic deployments of other routers run.
    SessionHash,
}

impl Strategy {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::CostModel => "cost-model",
            Self::Weighted => "weighted",
            Self::LeastLoad => "least-load",
            Self::RoundRobin => "round-robin",
            Self::Random => "random",
            Self::CacheAware => "cache-aware",
            Self::KvCost => "kv-cost",
            Self::SessionHash => "session-hash",
        }
    }

    /// Parse the kebab-case names used on command lines (`cost-model`, `least-load`, ...).
    pub fn from_cli(s: &str) -> Option<Self> {
        [
            Self::CostModel,
            Self::Weighted,
            Self::LeastLoad,
            Self::RoundRobin,
            Self::Random,
            Self::CacheAware,
            Self::KvCost,
            Self::SessionHash,
        ]
        .into_iter()
        .find(|k| k.as_str() == s)
    }
}

/// Weights of the `Weighted` strategy's scorers. Each scorer is normalized to [0, 1]; weights
/// are >= 0 and at least one is positive. Edit them live: pickers apply changes without a
/// restart.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "[self.prefixCache, self.queue, self.kvUtilization, self.inflight, self.sessionAffinity].exists(w, w > 0.0)",
        "message": "routing.weights: at least one weight must be positive"
    }
]))]
pub struct Weights {
    /// Fraction of the prompt's blocks already cached on the endpoint.
    #[schemars(range(min = 0.0))]
    pub prefix_cache: f64,
    /// Shorter waiting queue scores higher (relative to the other candidates).
    #[schemars(range(min = 0.0))]
    pub queue: f64,
    /// Lower KV-cache utilization scores higher.
    #[schemars(range(min = 0.0))]
    pub kv_utilization: f64,
    /// Fewer requests in flight from this picker scores higher.
    #[schemars(range(min = 0.0))]
    pub inflight: f64,
    /// The endpoint (and rank) that served the request's session before scores 1.
    #[schemars(range(min = 0.0))]
    pub session_affinity: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Self {
            prefix_cache: 3.0,
            queue: 2.0,
            kv_utilization: 2.0,
            inflight: 0.0,
            session_affinity: 0.0,
        }
    }
}

impl Weights {
    pub fn validate(&self) -> Result<(), String> {
        let all = [
            ("prefixCache", self.prefix_cache),
            ("queue", self.queue),
            ("kvUtilization", self.kv_utilization),
            ("inflight", self.inflight),
            ("sessionAffinity", self.session_affinity),
        ];
        for (name, w) in all {
            if !w.is_finite() || w < 0.0 {
                return Err(format!(
                    "routing.weights.{name} must be a finite number >= 0, got {w}"
                ));
            }
        }
        if all.iter().all(|(_, w)| *w == 0.0) {
            return Err("routing.weights: at least one weight must be positive".into());
        }
        Ok(())
    }
}

/// When load counts as imbalanced. An endpoint is overloaded when its load (requests waiting
/// plus running) exceeds the least loaded candidate's by more than `absolute` AND is more than
/// `relative` times it. Cache-aware strategies never send new work to an overloaded endpoint,
/// so a hot prefix cannot pile all load on one replica.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Balance {
    /// Requests (waiting + running) above the least loaded candidate before an endpoint can
    /// count as overloaded.
    #[schemars(range(min = 0))]
    pub absolute: u32,
    /// Load ratio to the least loaded candidate (>= 1) before an endpoint can count as
    /// overloaded.
    #[schemars(range(min = 1.0))]
    pub relative: f64,
}

impl Default for Balance {
    fn default() -> Self {
        Self {
            absolute: 8,
            relative: 1.5,
        }
    }
}

/// What to do when every eligible endpoint is stale (its metrics or events are too old).
/// `FailOpen` (route to stale endpoints anyway) or `FailClose` (reject with 503).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, JsonSchema)]
pub enum FailureMode {
    /// Route to stale endpoints anyway (availability first).
    #[default]
    FailOpen,
    /// Reject with 503 (never route on stale data).
    FailClose,
}

/// Calibration of the `CostModel` strategy: prefill time of a batch of `T` tokens is
/// `prefillQuadraticMs * T^2 + prefillLinearMs * T + prefillConstantMs`, chunked by
/// `maxBatchedTokens`; each engine step also spends the decode time of the running requests.
/// The defaults fit an 8B-class model on one H100-class GPU. With `calibrate` (the default)
/// these values are the prior of what the picker learns per endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct CostModelCalibration {
    /// Milliseconds per squared prefill token (attention's quadratic term).
    #[schemars(range(min = 0.0))]
    pub prefill_quadratic_ms: f64,
    /// Milliseconds per prefill token.
    #[schemars(range(min = 0.0))]
    pub prefill_linear_ms: f64,
    /// Fixed milliseconds per prefill batch.
    #[schemars(range(min = 0.0))]
    pub prefill_constant_ms: f64,
    /// Decode step time at KV usage u: `decodeBaseMs + decodeLinearMs*u + decodeQuadraticMs*u^2`.
    pub decode_base_ms: f64,
    /// See `decodeBaseMs`.
    pub decode_linear_ms: f64,
    /// See `decodeBaseMs`.
    pub decode_quadratic_ms: f64,
    /// Tokens the engine prefills per step (chunked prefill budget).
    #[schemars(range(min = 1))]
    pub max_batched_tokens: u32,
    /// Uncached prompt tokens assumed for each request the engine reports waiting that this
    /// picker did not send itself.
    #[schemars(range(min = 0))]
    pub assumed_waiting_tokens: u32,
    /// The value of locality: each candidate is also charged this many times the prefill time
    /// of the tokens it would recompute. The TTFT estimate counts a recomputation once, as
    /// this request's latency, but it also takes engine time from every request queued behind
    /// it and puts a second copy of the prefix in a cache, evicting others; near saturation
    /// that feeds on itself. One engine step's fixed cost of it is charged in full (any
    /// placement that recomputes pays it), the rest in the share of the copy that would evict
    /// cached context there (what the endpoint holds plus the copy, over its reported KV
    /// capacity): an engine with room, a new or idle one, pays little beyond its TTFT, so it
    /// is not left without traffic while others queue. 0 = the greedy TTFT estimate. Default 8 (see
    /// bench/BENCHMARKS.md: best or near best on every Mooncake load tested).
    #[schemars(range(min = 0.0))]
    pub recompute_weight: f64,
    /// The value of cache balance: each candidate is also charged this many times the prefill
    /// time of the other live sessions' context that placing the request there would evict,
    /// so that they will recompute it on their next turn. A session's context is live until
    /// its reuse horizon passes (learned from the gaps between its turns); what an endpoint
    /// must hold is the live context of the sessions pinned to it (requests need the session
    /// header), and what does not fit in the engine's reported KV capacity is evicted. 0 = no
    /// charge. Default 0 (see bench/BENCHMARKS.md §2, issue 32).
    #[schemars(range(min = 0.0))]
    pub displacement_weight: f64,
    /// Learn each endpoint's prefill cost (per step and per token) and decode step time
    /// online, with the values above as the prior: from this picker's own time-to-first-token
    /// measurements of streamed responses and, with less weight, from the engine's latency
    /// histograms. An endpoint much slower than the prior (a CPU engine is 20-50x slower than
    /// the GPU defaults) is then priced as it is. Learned values stay between 1/4 and 100
    /// times the configured ones. `false`: the values above for every endpoint. Default true.
    pub calibrate: bool,
}

impl Default for CostModelCalibration {
    fn default() -> Self {
        Self {
            prefill_quadratic_ms: 4.21e-7,
            prefill_linear_ms: 1.52e-2,
            prefill_constant_ms: 16.5,
            decode_base_ms: 5.7,
            decode_linear_ms: 54.0,
            decode_quadratic_ms: -25.7,
            max_batched_tokens: 8192,
            assumed_waiting_tokens: 1024,
            recompute_weight: 8.0,
            displacement_weight: 0.0,
            calibrate: true,
        }
    }
}

/// Settings of the `CacheAware` strategy.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct CacheAwareSettings {
    /// Minimum fraction of the prompt cached on the best endpoint for the match to win.
    #[schemars(range(min = 0.0, max = 1.0))]
    pub match_threshold: f64,
}

impl Default for CacheAwareSettings {
    fn default() -> Self {
        Self {
            match_threshold: 0.5,
        }
    }
}

/// The routing policy of a pool. Every field has a default; edits apply live.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct RoutingConfig {
    /// How the picker chooses among eligible endpoints. Default `CostModel`.
    pub strategy: Strategy,
    /// Scorer weights of the `Weighted` strategy.
    pub weights: Weights,
    /// When load counts as imbalanced (cache-aware strategies never pile work on an
    /// overloaded endpoint).
    pub balance: Balance,
    /// Softmax temperature of the `KvCost` strategy; 0 picks the minimum cost.
    #[schemars(range(min = 0.0))]
    pub temperature: f64,
    /// Weight of prefill blocks against decode blocks in the `KvCost` strategy.
    #[schemars(range(min = 0.0))]
    pub overlap_weight: f64,
    /// An endpoint whose last good metrics scrape is older than this is stale, e.g. `2s`,
    /// `500ms`.
    #[serde(with = "duration_str")]
    #[schemars(with = "String", regex(pattern = r"^[1-9][0-9]*(ms|s|m)$"))]
    pub staleness_threshold: Duration,
    /// What to do when every eligible endpoint is stale: `FailOpen` (default) or `FailClose`.
    pub failure_mode: FailureMode,
    /// Request header whose value identifies a session. Under the load-only strategies
    /// (`LeastLoad`, `RoundRobin`, `Random`) requests of one session stay on the same endpoint
    /// and rank unless it is overloaded; the cache-aware ones follow the session's cached
    /// blocks (the KV index) and use the session's last endpoint to break ties.
    #[schemars(length(min = 1, max = 256), regex(pattern = r"^[A-Za-z0-9_-]+$"))]
    pub session_header: String,
    /// Calibration of the `CostModel` strategy's time-to-first-token estimate.
    pub cost_model: CostModelCalibration,
    /// Settings of the `CacheAware` strategy.
    pub cache_aware: CacheAwareSettings,
    /// Session admission: hold a new session's first turn while the pool's KV cache is
    /// taken by the live context of the sessions already in it.
    pub admission: AdmissionSettings,
    /// When an endpoint counts as saturated, for the pool-saturation gauge
    /// (`kvroute_picker_pool_saturation`) an autoscaler scales on, and for flow control.
    pub saturation: SaturationSettings,
    /// Flow control: while every endpoint of a model config is saturated, requests wait in a
    /// queue by priority band, fair between flows, instead of piling into the engines' own
    /// queues.
    pub flow_control: FlowControlSettings,
    /// Prefill/decode disaggregation: when the model config has endpoints of role `prefill`,
    /// whether a request's prefill runs there and its KV moves to a decode endpoint.
    pub disaggregation: DisaggregationSettings,
    /// Model rewrites and traffic splits: requests naming a model go to other models or LoRA
    /// adapters the pool serves, by weight (at most 64 rules, model names unique).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = 64),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["model"])
    )]
    pub model_rewrites: Vec<ModelRewrite>,
}

/// When a request is split between a prefill and a decode endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, JsonSchema)]
pub enum DisaggregationMode {
    /// Never: requests run whole on `decode` and `both` endpoints; `prefill` ones take none.
    Off,
    /// The decider's choice: split when the prompt's uncached part on the endpoint it would
    /// run whole on reaches `minUncachedTokens`, the chosen prefill endpoint's queue is below
    /// `maxPrefillQueue` and its predicted first token within `maxTtftRatio` of the whole
    /// run's; otherwise run it whole on a `decode` or `both` endpoint.
    #[default]
    Auto,
    /// Every request the prefill endpoints can take is split.
    Always,
}

impl DisaggregationMode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Off => "Off",
            Self::Auto => "Auto",
            Self::Always => "Always",
        }
    }
}

/// Prefill/decode disaggregation. An endpoint's role comes from its pod's `llm-d.ai/role` or
/// `kvroute.dev/role` label (`prefill`, `decode` or `both`; unlabelled: `both`). A split
/// request is prefilled on a `prefill` endpoint chosen by the routing strategy (its prefix
/// cache decides the cost), then decoded on a `decode` or `both` endpoint chosen for room
/// and decode load, which pulls the KV over the engines' KV connector (vLLM's
/// `kv_transfer_params`). A model config without `prefill` endpoints is never split.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct DisaggregationSettings {
    /// `Off`, `Auto` (default) or `Always`.
    pub mode: DisaggregationMode,
    /// `Auto` splits a request only when at least this many of its prompt tokens are not
    /// cached on the `decode` or `both` endpoint it would run whole on (a short prompt, or a
    /// conversation whose earlier turns that endpoint holds, costs less to prefill there than
    /// a KV transfer). Default 512.
    #[schemars(range(max = 10_000_000))]
    pub min_uncached_tokens: u32,
    /// `Auto` splits a request only while the chosen prefill endpoint has fewer requests
    /// waiting than this (the prefill pool is not the bottleneck). Default 8.
    #[schemars(range(min = 1, max = 100_000))]
    pub max_prefill_queue: u32,
    /// `Auto` splits a request only while the cost model predicts its first token split
    /// (the prefill endpoint's queue and prefill, then the KV transfer) within this many times
    /// its first token run whole (on the decode endpoint, with its own queue and prefill): a
    /// split trades some time to first token for decode steps free of prefill. Default 2.
    #[schemars(range(min = 1.0, max = 1000.0))]
    pub max_ttft_ratio: f64,
    /// Output tokens a decode endpoint must have KV room for, beyond the prompt. Default 256.
    #[schemars(range(max = 10_000_000))]
    pub expected_output_tokens: u32,
    /// Milliseconds to pull one KV block the decode endpoint does not hold from the prefill
    /// endpoint. Default 0.1.
    #[schemars(range(min = 0.0))]
    pub transfer_ms_per_block: f64,
    /// Fixed milliseconds of a KV transfer (the connector's handshake). Default 2.
    #[schemars(range(min = 0.0))]
    pub transfer_latency_ms: f64,
}

impl Default for DisaggregationSettings {
    fn default() -> Self {
        Self {
            mode: DisaggregationMode::default(),
            min_uncached_tokens: 512,
            max_prefill_queue: 8,
            max_ttft_ratio: 2.0,
            expected_output_tokens: 256,
            transfer_ms_per_block: 0.1,
            transfer_latency_ms: 2.0,
        }
    }
}

impl DisaggregationSettings {
    fn validate(&self) -> Result<(), String> {
        if self.min_uncached_tokens > 10_000_000 {
            return Err(format!(
                "routing.disaggregation.minUncachedTokens must be at most 10000000, got {}",
                self.min_uncached_tokens
            ));
        }
        if !(1..=100_000).contains(&self.max_prefill_queue) {
            return Err(format!(
                "routing.disaggregation.maxPrefillQueue must be in [1, 100000], got {}",
                self.max_prefill_queue
            ));
        }
        if !(1.0..=1000.0).contains(&self.max_ttft_ratio) {
            return Err(format!(
                "routing.disaggregation.maxTtftRatio must be in [1, 1000], got {}",
                self.max_ttft_ratio
            ));
        }
        if self.expected_output_tokens > 10_000_000 {
            return Err(format!(
                "routing.disaggregation.expectedOutputTokens must be at most 10000000, got {}",
                self.expected_output_tokens
            ));
        }
        for (name, v) in [
            ("transferMsPerBlock", self.transfer_ms_per_block),
            ("transferLatencyMs", self.transfer_latency_ms),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(format!(
                    "routing.disaggregation.{name} must be a finite number >= 0, got {v}"
                ));
            }
        }
        Ok(())
    }
}

/// Requests naming `model` go to the `targets` (models or LoRA adapters the pool serves) in
/// proportion to their weights, e.g. a new adapter as a canary at 10%. The engine is sent the
/// target's name; the response's `model` field is written back to the name the client asked
/// for. A session (the session header, a Responses `session_id` or conversation) keeps one
/// target, so its cache stays on one model; a request without a session is assigned by a
/// hash of its body, the same on every picker replica. A target may name `model` itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ModelRewrite {
    /// The model name clients send.
    #[schemars(length(min = 1, max = 256))]
    pub model: String,
    /// Where its requests go (1-16 targets).
    #[schemars(length(min = 1, max = 16))]
    pub targets: Vec<RewriteTarget>,
}

/// One target of a [`ModelRewrite`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RewriteTarget {
    /// A model (a model config's `model`) or LoRA adapter the pool serves.
    #[schemars(length(min = 1, max = 256))]
    pub model: String,
    /// Its share, relative to the other targets' weights (0-1,000,000; 0 sends it nothing).
    #[schemars(range(max = 1_000_000))]
    pub weight: u32,
}

/// Session admission. Once the live sessions' context (their working sets: see
/// `costModel.displacementWeight`; requests need the session header) fills the KV capacity the
/// engines report, one more session makes the others recompute theirs. With `enabled`, the
/// first turn of a session that has no live context in the pool (a new one, or one idle past
/// its reuse horizon) waits, in arrival order, until the live context plus its expected
/// footprint (its prompt; for a session not seen before, at least the mean live context of a
/// session) fits; then, or
/// after `maxWait`, it is placed as usual. Turns of live sessions and requests without a
/// session are never held.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct AdmissionSettings {
    /// Hold new sessions while the pool's cache is full. Default false.
    pub enabled: bool,
    /// Longest a first turn waits; then it is placed anyway, e.g. `30s`. Default `30s`.
    #[serde(with = "duration_str")]
    #[schemars(with = "String", regex(pattern = r"^[1-9][0-9]*(ms|s|m)$"))]
    pub max_wait: Duration,
    /// First turns waiting at once (per pool); one more is placed without waiting.
    /// Default 1024.
    #[schemars(range(min = 1))]
    pub max_queue: u32,
    /// How full the pool's reported KV capacity may get before new sessions wait: the live
    /// context plus the new session's footprint must be within this multiple of it. Above 1
    /// admits past the capacity (the engines then evict some live context, but their batches
    /// stay fuller). Default 1.
    #[schemars(range(min = 0.1, max = 10.0))]
    pub overcommit: f64,
}

/// An endpoint's saturation is the larger of its waiting requests over `queueDepth` and its
/// KV-cache usage over `kvCacheUsage` (1 = at a threshold); an endpoint whose metrics are
/// stale or missing counts as 1. A model config's pool saturation is the mean over its
/// endpoints: at 1 or more, on average every endpoint is at a threshold (scale out).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct SaturationSettings {
    /// Waiting requests (the engine's own queue) at which an endpoint is saturated.
    /// Default 5.
    #[schemars(range(min = 1, max = 100_000))]
    pub queue_depth: u32,
    /// KV-cache usage (0-1) at which an endpoint is saturated. Default 0.8.
    #[schemars(range(min = 0.01, max = 1.0))]
    pub kv_cache_usage: f64,
    /// Flow control: waiting requests at which an endpoint has no room for requests of
    /// negative priority (llm-d's sheddable ones), keeping the places up to `queueDepth` for
    /// the other bands. Default: `queueDepth`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100_000))]
    pub sheddable_queue_depth: Option<u32>,
    /// Flow control: KV-cache usage at which an endpoint has no room for requests of negative
    /// priority, keeping the cache up to `kvCacheUsage` for the other bands. Default:
    /// `kvCacheUsage`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.01, max = 1.0))]
    pub sheddable_kv_cache_usage: Option<f64>,
}

impl Default for SaturationSettings {
    fn default() -> Self {
        Self {
            queue_depth: 5,
            kv_cache_usage: 0.8,
            sheddable_queue_depth: None,
            sheddable_kv_cache_usage: None,
        }
    }
}

impl SaturationSettings {
    /// The thresholds flow control dispatches requests of priority `band` under: the
    /// sheddable ones below zero.
    pub fn for_band(&self, band: i32) -> Self {
        if band >= 0 {
            return *self;
        }
        Self {
            queue_depth: self.sheddable_queue_depth.unwrap_or(self.queue_depth),
            kv_cache_usage: self.sheddable_kv_cache_usage.unwrap_or(self.kv_cache_usage),
            ..*self
        }
    }

    /// The saturation of an endpoint with `load` (`None`, or `stale`: 1).
    pub fn of(&self, load: Option<&crate::load::EndpointLoad>, stale: bool) -> f64 {
        match load {
            Some(l) if !stale => {
                let queue = l.waiting.max(0.0) / f64::from(self.queue_depth.max(1));
                let kv = l.kv_usage.clamp(0.0, 1.0) / self.kv_cache_usage.clamp(0.01, 1.0);
                queue.max(kv)
            }
            _ => 1.0,
        }
    }
}

/// One named objective: requests naming it in the objective header get its priority.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Objective {
    /// The name clients send (e.g. llm-d's `InferenceObjective` name).
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Its priority band: higher is served first; under overload the lowest are shed first.
    #[schemars(range(min = -1000, max = 1000))]
    pub priority: i32,
    /// Its time-to-first-token objective in ms, for requests that send none in
    /// `ttftSloHeader`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 3_600_000))]
    pub ttft_slo_ms: Option<u32>,
}

/// How flow control orders the requests of one flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub enum FlowOrder {
    /// The request whose time-to-first-token objective ends first goes first (its deadline is
    /// its arrival plus the objective); requests without one follow in arrival order. With no
    /// objectives this is first come, first served.
    #[default]
    EarliestDeadline,
    /// First come, first served, objectives or not.
    FirstComeFirstServed,
}

/// Where flow control lets a request be placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub enum FlowPlacement {
    /// On an endpoint with room for the request's band (below the `routing.saturation`
    /// thresholds that apply to it), when one has; otherwise anywhere. A request released
    /// because the pool has room goes where the room is, even if its prefix is cached on a
    /// saturated endpoint.
    #[default]
    WithRoom,
    /// Wherever the routing policy chooses, saturated or not: more cache reuse, and the
    /// request may wait in that engine's own queue.
    Anywhere,
}

/// What flow control does with a request whose time-to-first-token objective the cost model
/// predicts no endpoint can meet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub enum UnattainableSlo {
    /// Answer it 429 `slo_unattainable` at once.
    #[default]
    Shed,
    /// Put it (back) in line and place it again when it is released; answered 429
    /// `slo_unattainable` once its objective has passed, or `queue_expired` at the ttl.
    Queue,
}

/// How flow control orders requests between flows of one band.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub enum FlowFairness {
    /// The flow served the fewest tokens (prompt + expected output) goes next.
    #[default]
    LeastAttainedService,
    /// One request from each flow in turn.
    RoundRobin,
}

/// Flow control (`routing.flowControl`). While a model config has an endpoint with headroom
/// (below both `routing.saturation` thresholds, counting the requests this picker sent that
/// have not had their first token, with fresh metrics) and nothing of it waits, requests go
/// straight on. Otherwise they wait in the model config's queue: the highest priority band
/// first, fair between flows inside a band, by deadline then arrival inside a flow, and are placed
/// (the routing decision is made then, on the current index and loads) as headroom appears.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct FlowControlSettings {
    /// Queue requests while the pool is saturated. Default false.
    pub enabled: bool,
    /// Requests waiting per model config; past it a newcomer pushes out the newest request of
    /// a lower band, or is refused (429 `queue_full`). Default 10000.
    #[schemars(range(min = 1, max = 1_000_000))]
    pub max_queued: u32,
    /// Request bytes waiting per model config (their bodies are held). Default 1 GiB.
    #[schemars(range(min = 1024))]
    pub max_queued_bytes: u64,
    /// Longest a request waits; then it is answered 429 `queue_expired`, e.g. `60s`.
    /// Default `60s`.
    #[serde(with = "duration_str")]
    #[schemars(with = "String", regex(pattern = r"^[1-9][0-9]*(ms|s|m)$"))]
    pub ttl: Duration,
    /// Between the flows of a band. Default `LeastAttainedService`.
    pub fairness: FlowFairness,
    /// Inside a flow. Default `EarliestDeadline`.
    pub order: FlowOrder,
    /// Where a request may be placed. Default `WithRoom`.
    pub placement: FlowPlacement,
    /// A request whose TTFT objective no endpoint is predicted to meet. Default `Shed`.
    pub unattainable_slo: UnattainableSlo,
    /// Header carrying a raw priority as an integer (-1000 to 1000). Unset by default: any
    /// client could name the highest band, so a raw priority is believed only from a header
    /// your gateway sets and strips from clients (e.g. `x-kvroute-priority`); otherwise
    /// priorities come from `objectives` named in `objectiveHeader`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256), regex(pattern = r"^[A-Za-z0-9_-]+$"))]
    pub priority_header: Option<String>,
    /// Header naming an objective of `objectives`. Default `x-llm-d-inference-objective`.
    #[schemars(length(min = 1, max = 256), regex(pattern = r"^[A-Za-z0-9_-]+$"))]
    pub objective_header: String,
    /// Header naming the request's flow when tenancy does not (the tenant is the flow when
    /// it is on). Default `x-llm-d-inference-fairness-id`.
    #[schemars(length(min = 1, max = 256), regex(pattern = r"^[A-Za-z0-9_-]+$"))]
    pub fairness_header: String,
    /// Header carrying a request's time-to-first-token objective in ms: while flow control is
    /// on, it sets the request's deadline (`order`), and a request whose objective the cost
    /// model predicts no endpoint can meet is handled per `unattainableSlo` instead of timing
    /// out late. Default `x-slo-ttft-ms`.
    #[schemars(length(min = 1, max = 256), regex(pattern = r"^[A-Za-z0-9_-]+$"))]
    pub ttft_slo_header: String,
    /// Priority of a request that names none (or an objective not listed). Default 0.
    #[schemars(range(min = -1000, max = 1000))]
    pub default_priority: i32,
    /// Named objectives and their priorities (at most 64, names unique).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = 64),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"])
    )]
    pub objectives: Vec<Objective>,
}

impl Default for FlowControlSettings {
    fn default() -> Self {
        Self {
            enabled: false,
            max_queued: 10_000,
            max_queued_bytes: 1 << 30,
            ttl: Duration::from_secs(60),
            fairness: FlowFairness::default(),
            order: FlowOrder::default(),
            placement: FlowPlacement::default(),
            unattainable_slo: UnattainableSlo::default(),
            priority_header: None,
            objective_header: "x-llm-d-inference-objective".into(),
            fairness_header: "x-llm-d-inference-fairness-id".into(),
            ttft_slo_header: "x-slo-ttft-ms".into(),
            default_priority: 0,
            objectives: Vec::new(),
        }
    }
}

impl FlowControlSettings {
    /// A request's priority from its headers' values: an integer priority header, else a
    /// listed objective's, else the default (an unparsable or out-of-range value counts as
    /// absent).
    pub fn priority(&self, priority: Option<&str>, objective: Option<&str>) -> i32 {
        priority
            .and_then(|p| p.trim().parse::<i32>().ok())
            .filter(|p| (-1000..=1000).contains(p))
            .or_else(|| {
                let name = objective?;
                self.objectives
                    .iter()
                    .find(|o| o.name == name)
                    .map(|o| o.priority)
            })
            .unwrap_or(self.default_priority)
    }

    /// A request's time-to-first-token objective (ms): the header's (a positive integer up to
    /// an hour), else its objective's, else none.
    pub fn ttft_slo_ms(&self, header: Option<&str>, objective: Option<&str>) -> Option<u32> {
        header
            .and_then(|v| v.trim().parse::<u32>().ok())
            .filter(|v| (1..=3_600_000).contains(v))
            .or_else(|| {
                let name = objective?;
                self.objectives.iter().find(|o| o.name == name)?.ttft_slo_ms
            })
    }

    fn validate(&self) -> Result<(), String> {
        let f = "routing.flowControl";
        if !(1..=1_000_000).contains(&self.max_queued) {
            return Err(format!(
                "{f}.maxQueued must be in [1, 1000000], got {}",
                self.max_queued
            ));
        }
        if self.max_queued_bytes < 1024 {
            return Err(format!(
                "{f}.maxQueuedBytes must be at least 1024, got {}",
                self.max_queued_bytes
            ));
        }
        if self.ttl.is_zero() {
            return Err(format!("{f}.ttl must be positive"));
        }
        for (name, h) in [
            ("priorityHeader", self.priority_header.as_ref()),
            ("objectiveHeader", Some(&self.objective_header)),
            ("fairnessHeader", Some(&self.fairness_header)),
            ("ttftSloHeader", Some(&self.ttft_slo_header)),
        ] {
            let Some(h) = h else { continue };
            let ok = !h.is_empty()
                && h.len() <= 256
                && h.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
            if !ok {
                return Err(format!(
                    "{f}.{name} must be 1-256 letters, digits, '-' or '_', got {h:?}"
                ));
            }
        }
        if !(-1000..=1000).contains(&self.default_priority) {
            return Err(format!(
                "{f}.defaultPriority must be in [-1000, 1000], got {}",
                self.default_priority
            ));
        }
        if self.objectives.len() > 64 {
            return Err(format!(
                "{f}.objectives has {} entries, more than 64",
                self.objectives.len()
            ));
        }
        let mut seen = std::collections::BTreeSet::new();
        for (i, o) in self.objectives.iter().enumerate() {
            if o.name.is_empty() || o.name.len() > 253 {
                return Err(format!("{f}.objectives[{i}].name must be 1-253 characters"));
            }
            if !seen.insert(o.name.as_str()) {
                return Err(format!(
                    "{f}.objectives[{i}].name {:?} is listed twice",
                    o.name
                ));
            }
            if !(-1000..=1000).contains(&o.priority) {
                return Err(format!(
                    "{f}.objectives[{i}].priority must be in [-1000, 1000], got {}",
                    o.priority
                ));
            }
            if o.ttft_slo_ms.is_some_and(|v| !(1..=3_600_000).contains(&v)) {
                return Err(format!(
                    "{f}.objectives[{i}].ttftSloMs must be in [1, 3600000]"
                ));
            }
        }
        Ok(())
    }
}

impl Default for AdmissionSettings {
    fn default() -> Self {
        Self {
            enabled: false,
            max_wait: Duration::from_secs(30),
            max_queue: 1024,
            overcommit: 1.0,
        }
    }
}

impl Default for RoutingConfig {
    fn default() -> Self {
        Self {
            strategy: Strategy::default(),
            weights: Weights::default(),
            balance: Balance::default(),
            temperature: 0.0,
            overlap_weight: 1.0,
            staleness_threshold: Duration::from_secs(2),
            failure_mode: FailureMode::default(),
            session_header: "x-session-id".into(),
            cost_model: CostModelCalibration::default(),
            cache_aware: CacheAwareSettings::default(),
            admission: AdmissionSettings::default(),
            saturation: SaturationSettings::default(),
            flow_control: FlowControlSettings::default(),
            disaggregation: DisaggregationSettings::default(),
            model_rewrites: Vec::new(),
        }
    }
}

impl RoutingConfig {
    /// The model a request naming `model` goes to: `None` without a rule for it, else the
    /// target whose share of the weights `key` (a well-mixed hash) falls in.
    pub fn rewrite_model(&self, model: &str, key: u64) -> Option<&str> {
        let rule = self.model_rewrites.iter().find(|r| r.model == model)?;
        let total: u64 = rule.targets.iter().map(|t| u64::from(t.weight)).sum();
        let mut x = key.checked_rem(total)?;
        for t in &rule.targets {
            let w = u64::from(t.weight);
            if x < w {
                return Some(&t.model);
            }
            x -= w;
        }
        None
    }

    /// Every rewrite target is a model or LoRA adapter of `model_configs`.
    pub fn check_rewrite_targets(
        &self,
        model_configs: &[crate::pool::ModelConfigSpec],
    ) -> Result<(), String> {
        for (i, r) in self.model_rewrites.iter().enumerate() {
            for (j, t) in r.targets.iter().enumerate() {
                let served = model_configs
                    .iter()
                    .any(|mc| mc.model == t.model || mc.lora_adapters.contains(&t.model));
                if !served {
                    return Err(format!(
                        "routing.modelRewrites[{i}].targets[{j}].model {:?} is not a model or LoRA adapter of the pool's model configs",
                        t.model
                    ));
                }
            }
        }
        Ok(())
    }

    /// Check what the schema cannot express (or what a config file skipped); errors name the
    /// field.
    pub fn validate(&self) -> Result<(), String> {
        self.weights.validate()?;
        let finite_nonneg = [
            ("routing.temperature", self.temperature),
            ("routing.overlapWeight", self.overlap_weight),
            (
                "routing.costModel.prefillQuadraticMs",
                self.cost_model.prefill_quadratic_ms,
            ),
            (
                "routing.costModel.prefillLinearMs",
                self.cost_model.prefill_linear_ms,
            ),
            (
                "routing.costModel.prefillConstantMs",
                self.cost_model.prefill_constant_ms,
            ),
            (
                "routing.costModel.recomputeWeight",
                self.cost_model.recompute_weight,
            ),
            (
                "routing.costModel.displacementWeight",
                self.cost_model.displacement_weight,
            ),
        ];
        for (name, v) in finite_nonneg {
            if !v.is_finite() || v < 0.0 {
                return Err(format!("{name} must be a finite number >= 0, got {v}"));
            }
        }
        if !self.balance.relative.is_finite() || self.balance.relative < 1.0 {
            return Err(format!(
                "routing.balance.relative must be >= 1, got {}",
                self.balance.relative
            ));
        }
        if self.cost_model.max_batched_tokens == 0 {
            return Err("routing.costModel.maxBatchedTokens must be >= 1".into());
        }
        let t = self.cache_aware.match_threshold;
        if !(0.0..=1.0).contains(&t) {
            return Err(format!(
                "routing.cacheAware.matchThreshold must be in [0, 1], got {t}"
            ));
        }
        if self.staleness_threshold.is_zero() {
            return Err("routing.stalenessThreshold must be positive".into());
        }
        if self.admission.max_wait.is_zero() {
            return Err("routing.admission.maxWait must be positive".into());
        }
        let o = self.admission.overcommit;
        if !(0.1..=10.0).contains(&o) {
            return Err(format!(
                "routing.admission.overcommit must be in [0.1, 10], got {o}"
            ));
        }
        if self.admission.max_queue == 0 {
            return Err("routing.admission.maxQueue must be >= 1".into());
        }
        if !(1..=100_000).contains(&self.saturation.queue_depth) {
            return Err(format!(
                "routing.saturation.queueDepth must be in [1, 100000], got {}",
                self.saturation.queue_depth
            ));
        }
        let u = self.saturation.kv_cache_usage;
        if !(0.01..=1.0).contains(&u) {
            return Err(format!(
                "routing.saturation.kvCacheUsage must be in [0.01, 1], got {u}"
            ));
        }
        if let Some(d) = self.saturation.sheddable_queue_depth
            && !(1..=100_000).contains(&d)
        {
            return Err(format!(
                "routing.saturation.sheddableQueueDepth must be in [1, 100000], got {d}"
            ));
        }
        if let Some(u) = self.saturation.sheddable_kv_cache_usage
            && !(0.01..=1.0).contains(&u)
        {
            return Err(format!(
                "routing.saturation.sheddableKvCacheUsage must be in [0.01, 1], got {u}"
            ));
        }
        self.flow_control.validate()?;
        self.disaggregation.validate()?;
        if self.model_rewrites.len() > 64 {
            return Err(format!(
                "routing.modelRewrites has {} rules, more than 64",
                self.model_rewrites.len()
            ));
        }
        let mut seen = std::collections::BTreeSet::new();
        for (i, r) in self.model_rewrites.iter().enumerate() {
            let at = format!("routing.modelRewrites[{i}]");
            if r.model.is_empty() || r.model.len() > 256 {
                return Err(format!("{at}.model must be 1-256 characters"));
            }
            if !seen.insert(r.model.as_str()) {
                return Err(format!("{at}.model {:?} has another rule", r.model));
            }
            if r.targets.is_empty() || r.targets.len() > 16 {
                return Err(format!("{at}.targets must list 1-16 targets"));
            }
            for (j, t) in r.targets.iter().enumerate() {
                if t.model.is_empty() || t.model.len() > 256 {
                    return Err(format!("{at}.targets[{j}].model must be 1-256 characters"));
                }
                if t.weight > 1_000_000 {
                    return Err(format!(
                        "{at}.targets[{j}].weight must be at most 1000000, got {}",
                        t.weight
                    ));
                }
            }
            if r.targets.iter().all(|t| t.weight == 0) {
                return Err(format!(
                    "{at}.targets: at least one weight must be positive"
                ));
            }
        }
        if self.session_header.is_empty()
            || !self
                .session_header
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(format!(
                "routing.sessionHeader must be a non-empty HTTP header name, got {:?}",
                self.session_header
            ));
        }
        Ok(())
    }
}

/// Durations written as Kubernetes users write them: `500ms`, `2s`, `1m`.
pub mod duration_str {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub fn parse(s: &str) -> Result<Duration, String> {
        let s = s.trim();
        let (num, unit) = s
            .find(|c: char| !c.is_ascii_digit())
            .map_or((s, ""), |i| s.split_at(i));
        let n: u64 = num
            .parse()
            .map_err(|_| format!("invalid duration {s:?}: expected e.g. 500ms, 2s, 1m"))?;
        let d = match unit {
            "ms" => Duration::from_millis(n),
            "s" => Duration::from_secs(n),
            "m" => Duration::from_secs(n.saturating_mul(60)),
            _ => {
                return Err(format!("invalid duration {s:?}: unit must be ms, s or m"));
            }
        };
        Ok(d)
    }

    pub fn format(d: &Duration) -> String {
        let ms = d.as_millis();
        if ms.is_multiple_of(60_000) && ms > 0 {
            format!("{}m", ms / 60_000)
        } else if ms.is_multiple_of(1000) {
            format!("{}s", ms / 1000)
        } else {
            format!("{ms}ms")
        }
    }

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format(d))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        parse(&s).map_err(D::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_round_trip() {
        let c = RoutingConfig::default();
        c.validate().expect("defaults valid");
        let json = serde_json::to_string(&c).expect("serialize");
        let back: RoutingConfig = serde_json::from_str(&json).expect("deserialize");
        assert_eq!(c, back);
        assert!(json.contains("\"stalenessThreshold\":\"2s\""), "{json}");
        assert!(json.contains("\"calibrate\":true"), "{json}");
        let off: RoutingConfig =
            serde_json::from_str(r#"{"costModel":{"calibrate":false}}"#).expect("parse");
        assert!(!off.cost_model.calibrate);
        assert_eq!(off.cost_model.recompute_weight, 8.0);
    }

    #[test]
    fn partial_config_fills_defaults() {
        let c: RoutingConfig =
            serde_json::from_str(r#"{"strategy":"Weighted","weights":{"queue":5}}"#)
                .expect("parse");
        assert_eq!(c.strategy, Strategy::Weighted);
        assert_eq!(c.weights.queue, 5.0);
        assert_eq!(c.weights.prefix_cache, 3.0);
    }

    #[test]
    fn unknown_fields_and_strategies_are_rejected() {
        let e =
            serde_json::from_str::<RoutingConfig>(r#"{"stratgy":"Weighted"}"#).expect_err("typo");
        assert!(e.to_string().contains("stratgy"), "{e}");
        let e = serde_json::from_str::<RoutingConfig>(r#"{"strategy":"Fastest"}"#)
            .expect_err("unknown");
        assert!(e.to_string().contains("Fastest"), "{e}");
    }

    #[test]
    fn disaggregation_settings_parse_and_bad_values_name_their_field() {
        let c: RoutingConfig = serde_json::from_str(
            r#"{"disaggregation":{"mode":"Always","minUncachedTokens":2048,"transferMsPerBlock":0.5}}"#,
        )
        .expect("parse");
        assert_eq!(c.disaggregation.mode, DisaggregationMode::Always);
        assert_eq!(c.disaggregation.min_uncached_tokens, 2048);
        assert_eq!(c.disaggregation.max_prefill_queue, 8);
        c.validate().expect("valid");
        let e = serde_json::from_str::<RoutingConfig>(r#"{"disaggregation":{"mode":"Sometimes"}}"#)
            .expect_err("unknown mode");
        assert!(e.to_string().contains("Sometimes"), "{e}");
        let mut c = RoutingConfig::default();
        c.disaggregation.max_prefill_queue = 0;
        let e = c.validate().expect_err("zero queue");
        assert!(e.contains("routing.disaggregation.maxPrefillQueue"), "{e}");
        let mut c = RoutingConfig::default();
        c.disaggregation.max_ttft_ratio = 0.5;
        let e = c.validate().expect_err("ratio below 1");
        assert!(e.contains("routing.disaggregation.maxTtftRatio"), "{e}");
        let mut c = RoutingConfig::default();
        c.disaggregation.transfer_ms_per_block = f64::NAN;
        let e = c.validate().expect_err("nan");
        assert!(
            e.contains("routing.disaggregation.transferMsPerBlock"),
            "{e}"
        );
    }

    #[test]
    fn validation_names_the_field() {
        let mut c = RoutingConfig::default();
        c.weights.queue = -1.0;
        assert!(
            c.validate()
                .expect_err("neg")
                .contains("routing.weights.queue")
        );
        let c = RoutingConfig {
            weights: Weights {
                prefix_cache: 0.0,
                queue: 0.0,
                kv_utilization: 0.0,
                inflight: 0.0,
                session_affinity: 0.0,
            },
            ..RoutingConfig::default()
        };
        assert!(c.validate().expect_err("zero").contains("at least one"));
        let mut c = RoutingConfig::default();
        c.balance.relative = 0.5;
        assert!(c.validate().expect_err("rel").contains("balance.relative"));
        let c = RoutingConfig {
            session_header: "x session".into(),
            ..RoutingConfig::default()
        };
        assert!(c.validate().expect_err("hdr").contains("sessionHeader"));
        let mut c = RoutingConfig::default();
        c.saturation.kv_cache_usage = 0.0;
        assert!(
            c.validate()
                .expect_err("usage")
                .contains("routing.saturation.kvCacheUsage")
        );
        let mut c = RoutingConfig::default();
        c.saturation.sheddable_kv_cache_usage = Some(1.5);
        assert!(
            c.validate()
                .expect_err("sheddable usage")
                .contains("routing.saturation.sheddableKvCacheUsage")
        );
        c.saturation.sheddable_kv_cache_usage = Some(0.6);
        c.saturation.sheddable_queue_depth = Some(0);
        assert!(
            c.validate()
                .expect_err("sheddable depth")
                .contains("routing.saturation.sheddableQueueDepth")
        );
        c.saturation.sheddable_queue_depth = None;
        c.saturation.queue_depth = 0;
        assert!(
            c.validate()
                .expect_err("depth")
                .contains("routing.saturation.queueDepth")
        );
    }

    #[test]
    fn flow_control_priority_and_validation() {
        let mut fc = FlowControlSettings {
            objectives: vec![
                Objective {
                    name: "critical".into(),
                    priority: 10,
                    ttft_slo_ms: Some(500),
                },
                Objective {
                    name: "batch".into(),
                    priority: -5,
                    ttft_slo_ms: None,
                },
            ],
            ..FlowControlSettings::default()
        };
        assert_eq!(
            fc.priority(Some("3"), Some("critical")),
            3,
            "the number wins"
        );
        assert_eq!(fc.priority(None, Some("batch")), -5);
        assert_eq!(
            fc.priority(Some("9999"), Some("critical")),
            10,
            "out of range"
        );
        assert_eq!(fc.priority(Some("x"), Some("nope")), 0, "the default");
        let mut c = RoutingConfig {
            flow_control: fc.clone(),
            ..RoutingConfig::default()
        };
        assert!(c.validate().is_ok());
        assert_eq!(fc.ttft_slo_ms(Some("200"), Some("critical")), Some(200));
        assert_eq!(fc.ttft_slo_ms(None, Some("critical")), Some(500));
        assert_eq!(fc.ttft_slo_ms(Some("0"), Some("batch")), None);
        fc.objectives.push(Objective {
            name: "batch".into(),
            priority: 1,
            ttft_slo_ms: None,
        });
        c.flow_control = fc;
        assert!(
            c.validate()
                .expect_err("dup")
                .contains("routing.flowControl.objectives[2].name")
        );
        let mut c = RoutingConfig::default();
        c.flow_control.max_queued = 0;
        assert!(
            c.validate()
                .expect_err("zero")
                .contains("routing.flowControl.maxQueued")
        );
        let mut c = RoutingConfig::default();
        c.flow_control.priority_header = Some("x priority".into());
        assert!(
            c.validate()
                .expect_err("hdr")
                .contains("routing.flowControl.priorityHeader")
        );
        let mut c = RoutingConfig::default();
        c.flow_control.ttl = Duration::ZERO;
        assert!(
            c.validate()
                .expect_err("ttl")
                .contains("routing.flowControl.ttl")
        );
    }

    #[test]
    fn saturation_is_the_larger_of_queue_and_kv_usage_and_stale_counts_full() {
        use crate::load::EndpointLoad;
        let s = SaturationSettings::default();
        let load = |waiting, kv_usage| EndpointLoad {
            waiting,
            kv_usage,
            ..EndpointLoad::default()
        };
        assert_eq!(s.of(Some(&load(0.0, 0.4)), false), 0.5);
        assert_eq!(s.of(Some(&load(10.0, 0.4)), false), 2.0);
        assert_eq!(s.of(Some(&load(0.0, 0.0)), true), 1.0);
        assert_eq!(s.of(None, false), 1.0);
    }

    #[test]
    fn durations_parse_and_format() {
        use duration_str::{format, parse};
        assert_eq!(parse("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse("1m"), Ok(Duration::from_secs(60)));
        assert!(parse("2h").is_err());
        assert!(parse("s").is_err());
        assert!(parse("").is_err());
        assert_eq!(format(&Duration::from_millis(1500)), "1500ms");
        assert_eq!(format(&Duration::from_secs(120)), "2m");
    }

    #[test]
    fn strategy_cli_names() {
        assert_eq!(Strategy::from_cli("least-load"), Some(Strategy::LeastLoad));
        assert_eq!(Strategy::from_cli("cost-model"), Some(Strategy::CostModel));
        assert_eq!(Strategy::from_cli("nope"), None);
    }

    #[test]
    fn model_rewrites_split_by_weight_and_are_validated() {
        let c = RoutingConfig {
            model_rewrites: vec![ModelRewrite {
                model: "chat".into(),
                targets: vec![
                    RewriteTarget {
                        model: "a".into(),
                        weight: 3,
                    },
                    RewriteTarget {
                        model: "b".into(),
                        weight: 0,
                    },
                    RewriteTarget {
                        model: "c".into(),
                        weight: 1,
                    },
                ],
            }],
            ..RoutingConfig::default()
        };
        c.validate().expect("valid");
        let picks: Vec<Option<&str>> = (0..8).map(|k| c.rewrite_model("chat", k)).collect();
        assert_eq!(
            picks,
            [
                Some("a"),
                Some("a"),
                Some("a"),
                Some("c"),
                Some("a"),
                Some("a"),
                Some("a"),
                Some("c")
            ]
        );
        assert_eq!(c.rewrite_model("other", 0), None);
        for (edit, want) in [
            (
                (|c: &mut RoutingConfig| {
                    c.model_rewrites[0]
                        .targets
                        .iter_mut()
                        .for_each(|t| t.weight = 0)
                }) as fn(&mut RoutingConfig),
                "at least one weight",
            ),
            (
                |c| c.model_rewrites.push(c.model_rewrites[0].clone()),
                "another rule",
            ),
            (|c| c.model_rewrites[0].targets.clear(), "1-16 targets"),
            (
                |c| c.model_rewrites[0].targets[0].weight = 2_000_000,
                "at most 1000000",
            ),
        ] {
            let mut bad = c.clone();
            edit(&mut bad);
            let e = bad.validate().expect_err(want);
            assert!(
                e.contains(want) && e.contains("routing.modelRewrites"),
                "{e}"
            );
        }
    }
}
