//! The picker's own Prometheus metrics.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    pub policy: String,
    pub endpoint: String,
    pub reason: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointLabels {
    pub endpoint: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EjectionLabels {
    pub endpoint: String,
    pub trigger: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelConfigLabels {
    pub model_config: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: String,
}

/// Flow control's shed requests: why, and the band (`sheddable` below priority 0, `standard`
/// at 0, `critical` above).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ShedLabels {
    pub kind: String,
    pub band: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RewriteLabels {
    pub from: String,
    pub to: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub error: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabels {
    pub endpoint: String,
    pub source: String,
}

/// A gauge of floating-point values.
pub type FloatGauge = Gauge<f64, AtomicU64>;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MisconfigLabels {
    pub endpoint: String,
    pub reason: String,
}

pub struct Metrics {
    registry: Registry,
    pub decisions: Family<DecisionLabels, Counter>,
    pub predicted_hit_tokens: Counter,
    pub prompt_tokens: Counter,
    /// Per chosen endpoint, the prompt tokens it is predicted to prefill (prompt less the
    /// predicted hit): the share of the pool's prefill each endpoint does.
    pub prefill_tokens: Family<EndpointLabels, Counter>,
    pub piece_cache_tokens: Counter,
    pub decision_seconds: Histogram,
    pub upstream_ttft_seconds: Histogram,
    pub errors: Family<KindLabels, Counter>,
    pub event_batches: Counter,
    /// Batches of trace spans the OTLP exporter failed to deliver (synced from
    /// [`super::telemetry::export_failures`] when metrics are served).
    pub trace_export_failures: Counter,
    pub event_lag_seconds: Histogram,
    pub event_problems: Family<KindLabels, Counter>,
    /// By `kind` (`ScrapeError::kind`).
    pub scrape_failures: Family<KindLabels, Counter>,
    /// Peer replicas whose in-flight counts are fresh (`peers`).
    pub peer_replicas: Gauge,
    /// Datagrams of the peer exchange, by kind (sent, received, send_failed, unknown_source,
    /// malformed, other_group).
    pub peer_datagrams: Family<KindLabels, Counter>,
    pub config_rejections: Family<ErrorLabels, Counter>,
    pub stale_endpoints: Gauge,
    pub endpoints: Gauge,
    pub index_blocks: Gauge,
    pub retries: Counter,
    pub gateway_fallbacks: Counter,
    pub endpoint_misconfigured: Family<MisconfigLabels, Gauge>,
    pub outlier_ejections: Family<EjectionLabels, Counter>,
    pub outlier_ejected: Family<EndpointLabels, Gauge>,
    pub working_set_tokens: Family<EndpointLabels, Gauge>,
    pub session_reuse_horizon_seconds: FloatGauge,
    /// Per model config, the mean of its endpoints' saturation (`routing.saturation`).
    pub pool_saturation: Family<ModelConfigLabels, FloatGauge>,
    /// Flow control: requests waiting per model config.
    pub flow_queued: Family<ModelConfigLabels, Gauge>,
    /// Model configs with a `flow_queued` series.
    flow_queued_configs: parking_lot::Mutex<Vec<String>>,
    /// Flow control: requests released from the queue, and how long they waited.
    pub flow_dispatched: Counter,
    pub flow_wait_seconds: Histogram,
    /// Flow control: requests answered without being served, by reason and band.
    pub flow_shed: Family<ShedLabels, Counter>,
    /// Session admission: turns by how they went on to placement (`admission::Admitted`).
    pub admission: Family<KindLabels, Counter>,
    pub admission_wait_seconds: Histogram,
    pub admission_waiting: Gauge,
    /// Responses and Messages requests routed without reading their prompt, by why.
    pub unread_prompts: Family<KindLabels, Counter>,
    /// Requests a `routing.modelRewrites` rule sent to another model.
    pub model_rewrites: Family<RewriteLabels, Counter>,
    /// Prefill/decode disaggregation: forwarded requests by the decider's verdict.
    pub disaggregation: Family<KindLabels, Counter>,
    /// Prefill steps that failed, by what followed: `retried` (on another prefill
    /// endpoint) or `aggregated` (the request ran whole on its decode endpoint).
    pub prefill_failures: Family<KindLabels, Counter>,
    pub cost_model_overhead_ms: Family<EndpointLabels, FloatGauge>,
    pub cost_model_prefill_ms_per_token: Family<EndpointLabels, FloatGauge>,
    pub cost_model_decode_step_ms: Family<EndpointLabels, FloatGauge>,
    pub cost_model_observations: Family<SourceLabels, Gauge>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("kvroute_picker");
        let decisions = Family::<DecisionLabels, Counter>::default();
        registry.register(
            "decisions",
            "Routing decisions by policy, chosen endpoint and reason (policy: the best score; session: the session's pinned endpoint, for a cache-placing policy where it scores as well as the best)",
            decisions.clone(),
        );
        let predicted_hit_tokens = Counter::default();
        registry.register(
            "predicted_prefix_hit_tokens",
            "Prompt tokens predicted to be cached on the chosen endpoint",
            predicted_hit_tokens.clone(),
        );
        let prompt_tokens = Counter::default();
        registry.register(
            "prompt_tokens",
            "Prompt tokens routed",
            prompt_tokens.clone(),
        );
        let prefill_tokens = Family::<EndpointLabels, Counter>::default();
        registry.register(
            "endpoint_prefill_tokens",
            "Prompt tokens routed to the endpoint that it is predicted to prefill (not cached \
             there): its share of the pool's prefill",
            prefill_tokens.clone(),
        );
        let piece_cache_tokens = Counter::default();
        registry.register(
            "tokenizer_cached_tokens",
            "Prompt tokens taken from the tokenizer's piece cache instead of being encoded",
            piece_cache_tokens.clone(),
        );
        let decision_seconds = Histogram::new(exponential_buckets(1e-6, 2.0, 24));
        registry.register(
            "decision_seconds",
            "Time to decide (tokenize, hash, match, score)",
            decision_seconds.clone(),
        );
        let upstream_ttft_seconds = Histogram::new(exponential_buckets(1e-3, 2.0, 20));
        registry.register(
            "upstream_ttft_seconds",
            "Time from forwarding to the engine's first response byte",
            upstream_ttft_seconds.clone(),
        );
        let errors = Family::<KindLabels, Counter>::default();
        registry.register("errors", "Request errors by kind", errors.clone());
        let trace_export_failures = Counter::default();
        registry.register(
            "trace_export_failures",
            "Batches of request trace spans the OTLP exporter could not deliver (the collector \
             unreachable or refusing); their spans are lost",
            trace_export_failures.clone(),
        );
        let event_batches = Counter::default();
        registry.register(
            "kv_event_batches",
            "KV event batches applied to the index",
            event_batches.clone(),
        );
        let event_lag_seconds = Histogram::new(exponential_buckets(1e-4, 2.0, 20));
        registry.register(
            "kv_event_lag_seconds",
            "Delay between an event batch's timestamp and its application",
            event_lag_seconds.clone(),
        );
        let event_problems = Family::<KindLabels, Counter>::default();
        registry.register(
            "kv_event_problems",
            "Sequence gaps, resyncs, decode errors and orphan blocks in KV event streams",
            event_problems.clone(),
        );
        let scrape_failures = Family::<KindLabels, Counter>::default();
        registry.register(
            "scrape_failures",
            "Failed engine metrics scrapes, by kind (request, http_status, too_large, not_utf8, timeout, parse)",
            scrape_failures.clone(),
        );
        let peer_replicas = Gauge::default();
        registry.register(
            "peer_replicas",
            "Peer picker replicas whose in-flight counts are fresh",
            peer_replicas.clone(),
        );
        let peer_datagrams = Family::<KindLabels, Counter>::default();
        registry.register(
            "peer_datagrams",
            "Datagrams of the in-flight exchange with peer replicas, by kind (sent, received, send_failed, unknown_source, malformed, other_group)",
            peer_datagrams.clone(),
        );
        let config_rejections = Family::<ErrorLabels, Counter>::default();
        registry.register(
            "config_rejections",
            "Pool views rejected (the previous one stays in force) and tenancy secret reloads that failed, by error (PickerError::metric_label)",
            config_rejections.clone(),
        );
        let stale_endpoints = Gauge::default();
        registry.register(
            "stale_endpoints",
            "Endpoints whose metrics are older than the staleness threshold",
            stale_endpoints.clone(),
        );
        let endpoints = Gauge::default();
        registry.register("endpoints", "Endpoints in the set", endpoints.clone());
        let index_blocks = Gauge::default();
        registry.register(
            "index_blocks",
            "(endpoint, block) pairs in the KV index",
            index_blocks.clone(),
        );
        let retries = Counter::default();
        registry.register(
            "upstream_retries",
            "Requests retried on a fallback endpoint after a connection failure or a 5xx \
             answered before any response byte was relayed",
            retries.clone(),
        );
        let gateway_fallbacks = Counter::default();
        registry.register(
            "gateway_fallbacks",
            "Requests a gateway served on another endpoint than the chosen one (it walked down the fallback list)",
            gateway_fallbacks.clone(),
        );
        let endpoint_misconfigured = Family::<MisconfigLabels, Gauge>::default();
        registry.register(
            "endpoint_misconfigured",
            "1 while an endpoint shows a misconfiguration: reason block_size_mismatch (the \
             model config's blockSize differs from the engine's) or kv_events_never_received \
             (the engine serves requests but no KV event ever arrived)",
            endpoint_misconfigured.clone(),
        );
        let outlier_ejections = Family::<EjectionLabels, Counter>::default();
        registry.register(
            "outlier_ejections",
            "Endpoints taken out of rotation by passive health, by endpoint and trigger",
            outlier_ejections.clone(),
        );
        let outlier_ejected = Family::<EndpointLabels, Gauge>::default();
        registry.register(
            "outlier_ejected",
            "1 while passive health keeps the endpoint out of rotation",
            outlier_ejected.clone(),
        );
        let working_set_tokens = Family::<EndpointLabels, Gauge>::default();
        registry.register(
            "working_set_tokens",
            "Prompt tokens of the live sessions pinned to the endpoint (served within the reuse horizon): what its KV cache must hold for their next turns to hit",
            working_set_tokens.clone(),
        );
        let session_reuse_horizon_seconds = FloatGauge::default();
        registry.register(
            "session_reuse_horizon_seconds",
            "How long a session's context is taken to stay wanted: the 90th percentile of the gaps between a session's turns",
            session_reuse_horizon_seconds.clone(),
        );
        let pool_saturation = Family::<ModelConfigLabels, FloatGauge>::default();
        registry.register(
            "pool_saturation",
            "Per model config, the mean over its endpoints of max(waiting requests / routing.saturation.queueDepth, KV-cache usage / routing.saturation.kvCacheUsage) (waiting: the engine's count or the picker's requests without a first token, whichever is larger; a stale endpoint counting 1), plus the requests flow control holds over queueDepth times the endpoints: at 1 or more, on average every endpoint is at a threshold or the picker holds requests (what an autoscaler scales on)",
            pool_saturation.clone(),
        );
        let flow_queued = Family::<ModelConfigLabels, Gauge>::default();
        registry.register(
            "flow_queued",
            "Flow control (routing.flowControl): requests waiting per model config",
            flow_queued.clone(),
        );
        let flow_dispatched = Counter::default();
        registry.register(
            "flow_dispatched",
            "Flow control: requests released from the queue to be placed",
            flow_dispatched.clone(),
        );
        let flow_wait_seconds = Histogram::new(exponential_buckets(1e-3, 2.0, 22));
        registry.register(
            "flow_wait_seconds",
            "Flow control: how long released requests waited",
            flow_wait_seconds.clone(),
        );
        let flow_shed = Family::<ShedLabels, Counter>::default();
        registry.register(
            "flow_shed",
            "Flow control: requests answered 429 by reason: queue_full (no lower band to push out), too_large (its body exceeds maxQueuedBytes), queue_expired (waited the ttl), displaced (a higher band took its place), slo_unattainable (no endpoint is predicted to meet its TTFT objective); and by band: sheddable (priority below 0), standard (0), critical (above 0)",
            flow_shed.clone(),
        );
        let disaggregation = Family::<KindLabels, Counter>::default();
        registry.register(
            "disaggregation",
            "Prefill/decode disaggregation: forwarded requests by the decider's verdict: split, always (split, mode Always), off, no_prefill_endpoint, prefill_stale, few_uncached (too little of the prompt uncached where it would run whole), prefill_busy (the prefill endpoint's queue reached maxPrefillQueue), prefill_slower (its first token predicted beyond maxTtftRatio times whole), unsplittable (an API without a KV-transfer step)",
            disaggregation.clone(),
        );
        let prefill_failures = Family::<KindLabels, Counter>::default();
        registry.register(
            "prefill_failures",
            "Prefill steps of split requests that failed (no answer, a 5xx, no kv_transfer_params), by what followed: retried on another prefill endpoint, or aggregated (run whole on the decode endpoint)",
            prefill_failures.clone(),
        );
        let admission = Family::<KindLabels, Counter>::default();
        registry.register(
            "admission",
            "Session admission (routing.admission, while enabled): turns by kind of admission: fits, timeout (waited maxWait), queue_full, live_session, no_session, capacity_unknown",
            admission.clone(),
        );
        let admission_wait_seconds = Histogram::new(exponential_buckets(1e-3, 2.0, 22));
        registry.register(
            "admission_wait_seconds",
            "How long session admission held a new session's first turn before placing it",
            admission_wait_seconds.clone(),
        );
        let admission_waiting = Gauge::default();
        registry.register(
            "admission_waiting",
            "First turns session admission holds now",
            admission_waiting.clone(),
        );
        let unread_prompts = Family::<KindLabels, Counter>::default();
        registry.register(
            "unread_prompts",
            "Generating requests routed by model, tenant and load alone, their prompt not read, by why: previous_response_id (the engine holds the conversation; its pin routes it), or an input item, content block or embeddings input whose rendering the picker does not reproduce",
            unread_prompts.clone(),
        );
        let model_rewrites = Family::<RewriteLabels, Counter>::default();
        registry.register(
            "model_rewrites",
            "Requests a routing.modelRewrites rule sent to another model, by the model named (from) and the one served (to)",
            model_rewrites.clone(),
        );
        let cost_model_overhead_ms = Family::<EndpointLabels, FloatGauge>::default();
        registry.register(
            "cost_model_overhead_ms",
            "Cost model: fixed milliseconds per engine step of prefill learned for the endpoint \
             (routing.costModel.prefillConstantMs is the prior)",
            cost_model_overhead_ms.clone(),
        );
        let cost_model_prefill_ms_per_token = Family::<EndpointLabels, FloatGauge>::default();
        registry.register(
            "cost_model_prefill_ms_per_token",
            "Cost model: milliseconds per prefilled token learned for the endpoint \
             (routing.costModel.prefillLinearMs is the prior)",
            cost_model_prefill_ms_per_token.clone(),
        );
        let cost_model_decode_step_ms = Family::<EndpointLabels, FloatGauge>::default();
        registry.register(
            "cost_model_decode_step_ms",
            "Cost model: decode step time at an empty KV cache learned for the endpoint \
             (routing.costModel.decodeBaseMs is the prior)",
            cost_model_decode_step_ms.clone(),
        );
        let cost_model_observations = Family::<SourceLabels, Gauge>::default();
        registry.register(
            "cost_model_calibration_observations",
            "Observations the endpoint's learned cost model rests on, by source: picker_ttft \
             (this picker's time-to-first-token measurements), engine_prefill and engine_decode \
             (the engine's own histograms)",
            cost_model_observations.clone(),
        );
        Self {
            registry,
            decisions,
            predicted_hit_tokens,
            prefill_tokens,
            prompt_tokens,
            piece_cache_tokens,
            decision_seconds,
            upstream_ttft_seconds,
            errors,
            event_batches,
            trace_export_failures,
            event_lag_seconds,
            event_problems,
            scrape_failures,
            peer_replicas,
            peer_datagrams,
            config_rejections,
            stale_endpoints,
            endpoints,
            index_blocks,
            retries,
            gateway_fallbacks,
            endpoint_misconfigured,
            outlier_ejections,
            outlier_ejected,
            working_set_tokens,
            session_reuse_horizon_seconds,
            pool_saturation,
            flow_queued,
            flow_queued_configs: parking_lot::Mutex::new(Vec::new()),
            flow_dispatched,
            flow_wait_seconds,
            flow_shed,
            admission,
            admission_wait_seconds,
            admission_waiting,
            unread_prompts,
            model_rewrites,
            disaggregation,
            prefill_failures,
            cost_model_overhead_ms,
            cost_model_prefill_ms_per_token,
            cost_model_decode_step_ms,
            cost_model_observations,
        }
    }

    pub fn flow_shed(&self, reason: &str, priority: i32) {
        let band = match priority {
            ..0 => "sheddable",
            0 => "standard",
            _ => "critical",
        };
        self.flow_shed
            .get_or_create(&ShedLabels {
                kind: reason.into(),
                band,
            })
            .inc();
    }

    /// The flow queue lengths now: model configs no longer waiting lose their series.
    pub fn set_flow_queued(&self, queued: &[(String, usize)]) {
        let mut known = self.flow_queued_configs.lock();
        for model_config in known.drain(..) {
            if !queued.iter().any(|(c, _)| *c == model_config) {
                self.flow_queued.remove(&ModelConfigLabels { model_config });
            }
        }
        for (model_config, n) in queued {
            self.flow_queued
                .get_or_create(&ModelConfigLabels {
                    model_config: model_config.clone(),
                })
                .set(*n as i64);
            known.push(model_config.clone());
        }
    }

    pub fn error(&self, kind: &str) {
        self.errors
            .get_or_create(&KindLabels { kind: kind.into() })
            .inc();
    }

    pub fn admitted(&self, why: crate::admission::Admitted) {
        self.admission
            .get_or_create(&KindLabels {
                kind: why.as_str().into(),
            })
            .inc();
    }

    pub fn model_rewritten(&self, from: &str, to: &str) {
        self.model_rewrites
            .get_or_create(&RewriteLabels {
                from: from.into(),
                to: to.into(),
            })
            .inc();
    }

    pub fn unread_prompt(&self, why: &str) {
        self.unread_prompts
            .get_or_create(&KindLabels { kind: why.into() })
            .inc();
    }

    pub fn event_problem(&self, kind: &str) {
        self.event_problems
            .get_or_create(&KindLabels { kind: kind.into() })
            .inc();
    }

    /// Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}
