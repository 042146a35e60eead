//! The picker's configuration file (`--config picker.yaml`).
//!
//! `modelConfigs`, `routing` and `tenancy` are the same types as the `KVRoutePool` resource's
//! spec; `endpoints` is only used standalone (in a cluster, endpoints come from the operator's
//! EndpointSlices).

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::{RoutingConfig, duration_str};
use crate::error::PickerError;
use crate::pool::{ModelConfigSpec, TenancySpec};

/// Where the picker listens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Listen {
    /// OpenAI-compatible proxy: only inference endpoints and health.
    pub http: SocketAddr,
    /// `/metrics`, `/healthz`, `/readyz`.
    pub metrics: SocketAddr,
    /// `/v1/pick` and `/debug/*`: they reveal where prefixes are cached, so loopback by
    /// default (or protected by `adminToken`).
    pub admin: SocketAddr,
    /// Envoy ext_proc (Gateway API Inference Extension endpoint picker) and gRPC health;
    /// `null` disables it. Whoever can reach it chooses tenants (it trusts the tenant header
    /// the gateway forwards): bind it where only the gateway reaches it, or require the
    /// gateway's client certificate with `extProcTls.clientCaFile`.
    pub ext_proc: Option<SocketAddr>,
    /// TLS on the ext_proc listener (the gateway connects with TLS); absent = plaintext.
    pub ext_proc_tls: Option<TlsFiles>,
    /// Bearer token required on the admin listener when set (file path).
    pub admin_token_file: Option<String>,
}

/// A TLS server identity and, optionally, the CA that client certificates must chain to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TlsFiles {
    /// PEM certificate chain of the listener.
    pub cert_file: String,
    /// PEM private key of the listener.
    pub key_file: String,
    /// PEM CA bundle: when set, clients must present a certificate it signed (mutual TLS).
    #[serde(default)]
    pub client_ca_file: Option<String>,
}

impl Default for Listen {
    fn default() -> Self {
        Self {
            http: SocketAddr::from(([0, 0, 0, 0], 8080)),
            metrics: SocketAddr::from(([0, 0, 0, 0], 9090)),
            admin: SocketAddr::from(([127, 0, 0, 1], 9091)),
            ext_proc: Some(SocketAddr::from(([0, 0, 0, 0], 9002))),
            ext_proc_tls: None,
            admin_token_file: None,
        }
    }
}

/// A statically configured model server (standalone mode).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StaticEndpoint {
    pub address: IpAddr,
    /// Name of the model config it serves.
    pub model_config: String,
    /// Overrides the model config's port.
    #[serde(default)]
    pub port: Option<u16>,
    /// Labels, matched by tenant selectors. A `kvroute.dev/role` or `llm-d.ai/role` label
    /// gives the endpoint's role, as `role` does.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Its role under prefill/decode disaggregation: `prefill`, `decode` or `both`
    /// (default, or what a role label says).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<crate::endpoint::Role>,
    /// Overrides the model config's KV event publisher port (of rank 0).
    #[serde(default)]
    pub kv_events_port: Option<u16>,
    /// Overrides the model config's KV event replay port (of rank 0).
    #[serde(default)]
    pub kv_replay_port: Option<u16>,
}

/// Bounds on what a request may cost the picker. Each returns a clear error when hit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Limits {
    /// Largest request body accepted (413 above).
    pub max_body_bytes: usize,
    /// Largest prompt in tokens (400 above).
    pub max_prompt_tokens: usize,
    /// Most chat messages in one request (400 above).
    pub max_messages: usize,
    /// Time to connect to an engine.
    #[serde(with = "duration_str")]
    pub connect_timeout: Duration,
    /// Time to the first response byte from an engine (504 after).
    #[serde(with = "duration_str")]
    pub upstream_timeout: Duration,
    /// Longest silence inside a streamed response before it is cut.
    #[serde(with = "duration_str")]
    pub idle_timeout: Duration,
    /// Requests this picker keeps in flight on one endpoint; past it, requests are shed
    /// with 429 when every candidate is full.
    pub max_inflight_per_endpoint: u64,
    /// Requests in flight through this picker in total (429 above).
    pub max_inflight_total: usize,
    /// Token ids each model config's tokenizer keeps for prompt runs it has seen (system prompts,
    /// documents, earlier turns), so that they are not encoded again; 0 turns it off. About
    /// 4 bytes per id.
    pub tokenizer_cache_tokens: usize,
    /// Bytes of prompt text (runs of 64 KiB or more that the tokenizer cache does not hold)
    /// tokenized at once, all requests together: encoding costs about 150 bytes of memory per
    /// byte of text while it runs. A prompt that would pass it while others are being
    /// tokenized gets 429 `overloaded`; one alone is always tokenized.
    pub tokenize_bytes_at_once: usize,
    /// Concurrent calls to engines' render endpoints for tokenization.
    pub max_render_concurrency: usize,
    #[serde(with = "duration_str")]
    pub render_timeout: Duration,
    /// Open client connections per listener (inference and admin); past it a new connection
    /// gets one 503 `too_many_connections` and is closed.
    pub max_connections: usize,
    /// Streams one gateway connection to the ext_proc listener may have open at once
    /// (advertised as HTTP/2 `SETTINGS_MAX_CONCURRENT_STREAMS`: a gateway opens more
    /// connections past it); never more than twice `maxInflightTotal`, the ext_proc stream
    /// limit.
    pub ext_proc_streams_per_connection: u32,
    /// Largest request head (request line plus headers) in bytes; 431 above. At least 8 KiB.
    pub max_header_bytes: usize,
    /// Time a client has to send its request head before the connection is closed (also the
    /// longest a connection may stay silent after connecting, and an idle HTTP/1 keep-alive
    /// connection's lifetime).
    #[serde(with = "duration_str")]
    pub header_read_timeout: Duration,
    /// Time a client has to send the whole request body, once its head is in (408 after, on
    /// the proxy and the pick API; on ext_proc, the time from the headers to the end of the
    /// body). A request is admitted (counted against `maxInflightTotal`) only once its body is
    /// in, so a stalled body never holds an in-flight slot.
    #[serde(with = "duration_str")]
    pub body_read_timeout: Duration,
    /// Bytes of request bodies the proxy and the pick API hold while reading them, all bodies
    /// together (429 `overloaded` past it); at least `maxBodyBytes`.
    pub body_buffer_bytes: usize,
    /// Largest KV event message payload decoded, in bytes; larger messages are skipped and
    /// counted (`kvroute_picker_kv_event_problems_total{kind="decode_error"}`).
    pub max_event_payload_bytes: usize,
    /// Events in one KV event batch; a larger batch is rejected whole.
    pub max_events_per_batch: usize,
    /// Sustained KV events per second accepted from one publisher (endpoint rank). Past it
    /// (after `eventBurst`), batches are dropped and the endpoint's view is cleared, since it
    /// can no longer be trusted; the events that follow rebuild it.
    pub max_events_per_second: u64,
    /// Events a publisher may send at once above the sustained rate.
    pub event_burst: u64,
    /// Passive health: endpoints that keep failing are taken out of rotation for a while.
    pub outlier_detection: crate::outlier::OutlierDetection,
}

impl Limits {
    /// The bounds request bodies are parsed under.
    pub fn request(&self) -> crate::request::RequestLimits {
        crate::request::RequestLimits {
            max_body_bytes: self.max_body_bytes,
            max_prompt_tokens: self.max_prompt_tokens,
            max_messages: self.max_messages,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        let request = crate::request::RequestLimits::default();
        Self {
            max_body_bytes: request.max_body_bytes,
            max_prompt_tokens: request.max_prompt_tokens,
            max_messages: request.max_messages,
            connect_timeout: Duration::from_secs(2),
            upstream_timeout: Duration::from_secs(120),
            idle_timeout: Duration::from_secs(300),
            max_inflight_per_endpoint: crate::inflight::DEFAULT_MAX_PER_ENDPOINT,
            max_inflight_total: 16_384,
            tokenizer_cache_tokens: 1 << 22,
            tokenize_bytes_at_once: 16 << 20,
            max_render_concurrency: 64,
            render_timeout: Duration::from_millis(500),
            max_connections: 8192,
            ext_proc_streams_per_connection: 1024,
            max_header_bytes: 64 * 1024,
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(30),
            body_buffer_bytes: 256 << 20,
            max_event_payload_bytes: 64 << 20,
            max_events_per_batch: 65_536,
            max_events_per_second: 200_000,
            event_burst: 400_000,
            outlier_detection: crate::outlier::OutlierDetection::default(),
        }
    }
}

/// Engine metrics scraping.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct ScrapeSettings {
    #[serde(with = "duration_str")]
    pub interval: Duration,
    #[serde(with = "duration_str")]
    pub timeout: Duration,
    /// Path of the Prometheus endpoint (`/metrics` for vLLM and SGLang,
    /// `/prometheus/metrics` for TRT-LLM serve).
    pub path: Option<String>,
    /// Ask the engines where their KV event publishers are (`GET /kv_event_sources`,
    /// vLLM 0.32 and later) and subscribe there ([`crate::service::feeds::sources`]); off:
    /// the ports computed from the pool's settings only.
    pub event_sources: bool,
}

impl Default for ScrapeSettings {
    fn default() -> Self {
        Self {
            interval: Duration::from_millis(100),
            timeout: Duration::from_millis(500),
            path: None,
            event_sources: true,
        }
    }
}

/// KV index bounds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct IndexSettings {
    pub max_endpoints: usize,
    /// Blocks assumed per endpoint until its metrics report the KV capacity.
    pub default_kv_capacity_blocks: u64,
    /// Precise endpoints may hold this many times their capacity before they are considered
    /// out of sync (missed removals) and rebuilt.
    pub precise_slack: u64,
    /// Approximate entries expire after this long without use.
    #[serde(with = "duration_str")]
    pub approximate_ttl: Duration,
    /// Precise endpoints: the blocks of a request routed to an endpoint count as held there
    /// for this long, or until its engine's KV events for them arrive, so that a burst
    /// sharing a new prefix is not spread before the first event (`0s`: off; at most 10 min).
    #[serde(with = "duration_str")]
    pub provisional_ttl: Duration,
    /// The most blocks the index keeps for one endpoint, slack included, whatever capacity
    /// its engine reports or its model config names (about 66 bytes each).
    pub max_blocks_per_endpoint: u64,
}

impl Default for IndexSettings {
    fn default() -> Self {
        let budget = crate::pool_state::IndexBudget::default();
        Self {
            max_endpoints: crate::index::IndexConfig::default().max_endpoints,
            default_kv_capacity_blocks: budget.default_kv_capacity_blocks,
            precise_slack: budget.precise_slack,
            approximate_ttl: Duration::from_millis(budget.approximate_ttl_ms),
            provisional_ttl: Duration::from_millis(budget.provisional_ttl_ms),
            max_blocks_per_endpoint: budget.max_blocks_per_endpoint,
        }
    }
}

impl IndexSettings {
    /// What the routing core's pool is built with under these index settings and `limits`:
    /// the picker and the offline replay benchmark build theirs from it.
    pub fn pool_settings(&self, limits: &Limits) -> crate::place::PoolSettings {
        crate::place::PoolSettings {
            index: crate::index::IndexConfig {
                max_endpoints: self.max_endpoints,
                ..Default::default()
            },
            budget: crate::pool_state::IndexBudget {
                default_kv_capacity_blocks: self.default_kv_capacity_blocks,
                precise_slack: self.precise_slack,
                approximate_ttl_ms: self.approximate_ttl.as_millis() as u64,
                provisional_ttl_ms: self.provisional_ttl.as_millis() as u64,
                max_blocks_per_endpoint: self.max_blocks_per_endpoint,
            },
            max_inflight_per_endpoint: limits.max_inflight_per_endpoint,
            outlier_detection: limits.outlier_detection.clone(),
            session_capacity: crate::place::DEFAULT_SESSION_CAPACITY,
        }
    }
}

/// The whole file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PickerConfig {
    #[serde(default)]
    pub listen: Listen,
    pub model_configs: Vec<ModelConfigSpec>,
    #[serde(default)]
    pub endpoints: Vec<StaticEndpoint>,
    #[serde(default)]
    pub routing: RoutingConfig,
    #[serde(default)]
    pub tenancy: TenancySpec,
    #[serde(default)]
    pub limits: Limits,
    #[serde(default)]
    pub scrape: ScrapeSettings,
    #[serde(default)]
    pub index: IndexSettings,
    #[serde(default)]
    pub peers: PeerSettings,
    #[serde(default)]
    pub warm_start: WarmStartSettings,
}

/// Warm start (`warmStart`): where a starting picker gets a copy of the KV index from, and
/// what it serves its peers ([`crate::service::warm_start`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct WarmStartSettings {
    /// A file the picker writes its index snapshot to every `snapshotInterval` and when it
    /// stops, and loads at start when no peer has a copy (the chart mounts an `emptyDir`).
    /// Absent: no snapshot.
    pub snapshot_path: Option<String>,
    #[serde(with = "duration_str")]
    pub snapshot_interval: Duration,
    /// Ask the peers (`peers.addresses`, `peers.dns`) for their index at start.
    pub from_peers: bool,
    /// Whether this picker serves its index to peers on the metrics listener (`GET
    /// /internal/index-copy`).
    pub serve_peers: ServePeers,
    /// The port the peers serve their copy on; absent: this picker's metrics port.
    pub peer_port: Option<u16>,
    /// How long the peers are asked at start, all at once.
    #[serde(with = "duration_str")]
    pub peer_timeout: Duration,
    /// Largest copy written, served or read (bytes).
    pub max_bytes: usize,
    /// How long copied blocks that no event has confirmed are kept.
    #[serde(with = "duration_str")]
    pub unconfirmed_ttl: Duration,
    /// A copy taken longer ago than this is not loaded (the engines have turned their caches
    /// over since, or restarted).
    #[serde(with = "duration_str")]
    pub max_age: Duration,
}

impl Default for WarmStartSettings {
    fn default() -> Self {
        Self {
            snapshot_path: None,
            snapshot_interval: Duration::from_secs(10),
            from_peers: true,
            serve_peers: ServePeers::Signed,
            peer_port: None,
            peer_timeout: Duration::from_secs(3),
            max_bytes: 256 << 20,
            unconfirmed_ttl: Duration::from_secs(120),
            max_age: Duration::from_secs(600),
        }
    }
}

/// `warmStart.servePeers`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ServePeers {
    /// To requests signed with the pool's peer key (`peers.keyFile`); without a key, to
    /// nobody: the block keys of an unsalted pool tell whoever reads them which prompts
    /// are cached.
    Signed,
    /// To any request that reaches the metrics listener, signed or not (a pool without a
    /// peer key on a network that only its pickers reach).
    Always,
    /// To nobody.
    Off,
}

impl WarmStartSettings {
    pub fn validate(&self) -> Result<(), PickerError> {
        if self.snapshot_interval < Duration::from_secs(1) {
            return Err("warmStart.snapshotInterval must be at least 1s".into());
        }
        if self.peer_timeout.is_zero() || self.peer_timeout > Duration::from_secs(60) {
            return Err("warmStart.peerTimeout must be between 1ms and 60s".into());
        }
        if self.max_bytes < 4096 {
            return Err("warmStart.maxBytes must be at least 4096".into());
        }
        if self.unconfirmed_ttl.is_zero() {
            return Err("warmStart.unconfirmedTtl must be more than 0".into());
        }
        if self.max_age.is_zero() {
            return Err("warmStart.maxAge must be more than 0".into());
        }
        if self.snapshot_path.as_deref().is_some_and(str::is_empty) {
            return Err("warmStart.snapshotPath must not be empty".into());
        }
        Ok(())
    }
}

/// The exchange of in-flight counts with the pool's other picker replicas (`peers`): each
/// replica publishes, every `interval`, how many requests (and prompt tokens) it has in flight
/// on each endpoint, over UDP to every peer, and adds the fresh counts it receives to its own
/// when it places a request. Without it a replica prices only the queue its own requests make
/// between scrapes, and the scrape shows others' only as a count.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct PeerSettings {
    /// UDP address to receive peers' counts on (and send from); absent: no exchange.
    pub listen: Option<SocketAddr>,
    /// Peers by address (`ip:port`).
    pub addresses: Vec<SocketAddr>,
    /// Peers by DNS name (`name:port`, e.g. a headless Service), resolved again every
    /// `resolveInterval`: every address it returns is a peer.
    pub dns: Option<String>,
    #[serde(with = "duration_str")]
    pub interval: Duration,
    #[serde(with = "duration_str")]
    pub resolve_interval: Duration,
    /// Only datagrams of this group count (the operator sets `namespace/pool`), so that a
    /// replica of another pool on a reused address is not mixed in.
    pub group: String,
    /// A file holding the pool's shared key (at least 16 bytes; the operator renders one per
    /// pool into a Secret): every datagram is sent with its HMAC-SHA256 under it, with a
    /// sequence number and a timestamp, and only datagrams that carry a right tag, a fresh
    /// time and a new number count. Absent: datagrams are trusted on their source address
    /// (IP and port) alone.
    pub key_file: Option<String>,
}

impl Default for PeerSettings {
    fn default() -> Self {
        Self {
            listen: None,
            addresses: Vec::new(),
            dns: None,
            interval: Duration::from_millis(crate::inflight::DEFAULT_PEER_INTERVAL_MS as u64),
            resolve_interval: Duration::from_secs(5),
            group: String::new(),
            key_file: None,
        }
    }
}

/// Peers listed at most (addresses plus what the DNS name returns).
pub const MAX_PEER_ADDRESSES: usize = crate::inflight::MAX_PEERS;

impl PeerSettings {
    pub fn validate(&self) -> Result<(), PickerError> {
        if self.listen.is_none() {
            if !self.addresses.is_empty() || self.dns.is_some() {
                return Err("peers.addresses and peers.dns need peers.listen".into());
            }
            return Ok(());
        }
        if self.addresses.is_empty() && self.dns.is_none() {
            return Err("peers.listen needs peers.addresses or peers.dns".into());
        }
        if self.addresses.len() > MAX_PEER_ADDRESSES {
            return Err(PickerError::Invalid(format!(
                "peers.addresses lists {} peers, at most {MAX_PEER_ADDRESSES}",
                self.addresses.len()
            )));
        }
        if let Some(d) = &self.dns {
            let ok = d.rsplit_once(':').is_some_and(|(host, port)| {
                !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0)
            });
            if !ok {
                return Err(PickerError::Invalid(format!(
                    "peers.dns must be name:port, got {d:?}"
                )));
            }
        }
        if !(Duration::from_millis(5)..=Duration::from_secs(10)).contains(&self.interval) {
            return Err(PickerError::Invalid(format!(
                "peers.interval must be within 5ms-10s, got {:?}",
                self.interval
            )));
        }
        if self.resolve_interval < Duration::from_millis(100) {
            return Err(PickerError::Invalid(format!(
                "peers.resolveInterval must be at least 100ms, got {:?}",
                self.resolve_interval
            )));
        }
        if self.group.len() > 256 {
            return Err("peers.group must be at most 256 bytes".into());
        }
        if self.key_file.as_deref().is_some_and(str::is_empty) {
            return Err("peers.keyFile must name a file".into());
        }
        Ok(())
    }
}

impl PickerConfig {
    pub fn from_yaml(text: &str) -> Result<Self, PickerError> {
        let c: Self = serde_yaml_ng::from_str(text).map_err(PickerError::Parse)?;
        c.validate()?;
        Ok(c)
    }

    pub fn load(path: &Path) -> Result<Self, PickerError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            PickerError::read_file("the config file", &path.display().to_string(), e)
        })?;
        Self::from_yaml(&text).map_err(|e| PickerError::InFile {
            path: path.to_owned(),
            source: Box::new(e),
        })
    }

    /// Cross-field checks; errors name the field.
    pub fn validate(&self) -> Result<(), PickerError> {
        if self.model_configs.is_empty() {
            return Err("modelConfigs must list at least one model config".into());
        }
        let mut names = std::collections::BTreeSet::new();
        for (i, mc) in self.model_configs.iter().enumerate() {
            mc.validate(i)?;
            if !names.insert(mc.name.as_str()) {
                return Err(PickerError::Invalid(format!(
                    "modelConfigs[{i}].name {:?} is duplicated",
                    mc.name
                )));
            }
        }
        for (i, e) in self.endpoints.iter().enumerate() {
            if !names.contains(e.model_config.as_str()) {
                return Err(PickerError::Invalid(format!(
                    "endpoints[{i}].modelConfig {:?} names no entry of modelConfigs",
                    e.model_config
                )));
            }
            if e.port == Some(0) {
                return Err(PickerError::Invalid(format!(
                    "endpoints[{i}].port must be 1-65535"
                )));
            }
            crate::endpoint::Role::from_labels(&e.labels)
                .map_err(|m| PickerError::Invalid(format!("endpoints[{i}].labels: {m}")))?;
        }
        super::source::check_static_endpoints_unique(self)?;
        self.routing.validate()?;
        self.routing
            .check_rewrite_targets(&self.model_configs)
            .map_err(PickerError::Invalid)?;
        self.tenancy.validate()?;
        self.peers.validate()?;
        self.warm_start.validate()?;
        let l = &self.limits;
        for (name, v) in [
            ("limits.maxBodyBytes", l.max_body_bytes),
            ("limits.maxPromptTokens", l.max_prompt_tokens),
            ("limits.maxMessages", l.max_messages),
            ("limits.maxInflightTotal", l.max_inflight_total),
            ("limits.maxRenderConcurrency", l.max_render_concurrency),
            ("limits.tokenizeBytesAtOnce", l.tokenize_bytes_at_once),
            ("limits.maxConnections", l.max_connections),
            ("limits.maxHeaderBytes", l.max_header_bytes),
            ("limits.maxEventPayloadBytes", l.max_event_payload_bytes),
            ("limits.maxEventsPerBatch", l.max_events_per_batch),
            ("index.maxEndpoints", self.index.max_endpoints),
            (
                "index.maxBlocksPerEndpoint",
                usize::try_from(self.index.max_blocks_per_endpoint).unwrap_or(usize::MAX),
            ),
        ] {
            if v == 0 {
                return Err(PickerError::Invalid(format!("{name} must be positive")));
            }
        }
        if l.ext_proc_streams_per_connection == 0 {
            return Err("limits.extProcStreamsPerConnection must be positive".into());
        }
        if l.body_buffer_bytes < l.max_body_bytes {
            return Err(PickerError::Invalid(format!(
                "limits.bodyBufferBytes ({}) must be at least limits.maxBodyBytes ({})",
                l.body_buffer_bytes, l.max_body_bytes
            )));
        }
        if l.tokenizer_cache_tokens > 1 << 28 {
            return Err(
                "limits.tokenizerCacheTokens must be at most 268435456 (1 GiB of ids)".into(),
            );
        }
        if l.max_inflight_per_endpoint == 0 {
            return Err("limits.maxInflightPerEndpoint must be positive".into());
        }
        if l.max_events_per_second == 0 {
            return Err("limits.maxEventsPerSecond must be positive".into());
        }
        for (name, d) in [
            ("limits.connectTimeout", l.connect_timeout),
            ("limits.upstreamTimeout", l.upstream_timeout),
            ("limits.idleTimeout", l.idle_timeout),
            ("limits.renderTimeout", l.render_timeout),
            ("limits.headerReadTimeout", l.header_read_timeout),
            ("limits.bodyReadTimeout", l.body_read_timeout),
            ("scrape.interval", self.scrape.interval),
            ("scrape.timeout", self.scrape.timeout),
            ("index.approximateTtl", self.index.approximate_ttl),
        ] {
            if d.is_zero() {
                return Err(PickerError::Invalid(format!(
                    "{name} must be positive (0s would fail every request)"
                )));
            }
        }
        if self.index.provisional_ttl > Duration::from_secs(600) {
            return Err(PickerError::Invalid(format!(
                "index.provisionalTtl must be at most 10m, got {:?}",
                self.index.provisional_ttl
            )));
        }
        if let Some(tls) = &self.listen.ext_proc_tls {
            if self.listen.ext_proc.is_none() {
                return Err("listen.extProcTls is set but listen.extProc is null".into());
            }
            for (name, v) in [
                ("listen.extProcTls.certFile", Some(&tls.cert_file)),
                ("listen.extProcTls.keyFile", Some(&tls.key_file)),
                (
                    "listen.extProcTls.clientCaFile",
                    tls.client_ca_file.as_ref(),
                ),
            ] {
                if v.is_some_and(|p| p.trim().is_empty()) {
                    return Err(PickerError::Invalid(format!("{name} must name a file")));
                }
            }
        }
        l.outlier_detection
            .validate("limits.outlierDetection")
            .map_err(PickerError::Invalid)?;
        Ok(())
    }

    /// The settings a running picker cannot take on without a restart (`listen`, `limits`,
    /// `scrape`, `index`) that differ between `self` and `next`, by field name.
    pub fn restart_only_changes(&self, next: &Self) -> Vec<&'static str> {
        [
            ("listen", self.listen != next.listen),
            ("limits", self.limits != next.limits),
            ("scrape", self.scrape != next.scrape),
            ("index", self.index != next.index),
        ]
        .into_iter()
        .filter_map(|(name, changed)| changed.then_some(name))
        .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"
modelConfigs:
  - name: llama
    model: meta-llama/Llama-3.1-8B-Instruct
    engine: vllm
    port: 8000
    dataParallel: {size: 2, rankSelection: Header}
    kvEvents: {port: 5557, topic: kv}
endpoints:
  - {address: 127.0.0.1, modelConfig: llama}
routing:
  strategy: Weighted
  weights: {prefixCache: 3, queue: 2}
limits:
  upstreamTimeout: 30s
"#;

    #[test]
    fn sample_parses_with_defaults() {
        let c = PickerConfig::from_yaml(SAMPLE).expect("valid");
        assert_eq!(c.model_configs[0].data_parallel.size, 2);
        assert_eq!(c.limits.upstream_timeout, Duration::from_secs(30));
        assert_eq!(c.scrape.interval, Duration::from_millis(100));
        assert_eq!(c.listen.admin.ip(), IpAddr::from([127, 0, 0, 1]));
    }

    #[test]
    fn errors_name_the_field() {
        let bad = SAMPLE.replace("modelConfig: llama", "modelConfig: mistral");
        let e = PickerConfig::from_yaml(&bad).expect_err("dangling");
        assert!(e.to_string().contains("endpoints[0].modelConfig"), "{e}");
        let bad = SAMPLE.replace("queue: 2", "queue: -2");
        let e = PickerConfig::from_yaml(&bad).expect_err("negative");
        assert!(e.to_string().contains("routing.weights.queue"), "{e}");
        let bad = SAMPLE.replace("upstreamTimeout: 30s", "upstreamTimeout: soon");
        let e = PickerConfig::from_yaml(&bad).expect_err("duration");
        assert!(
            e.to_string().contains("upstreamTimeout") || e.to_string().contains("invalid duration"),
            "{e}"
        );
        let bad = SAMPLE.replace("port: 8000", "port: 8000\n    blockSize: 12");
        let e = PickerConfig::from_yaml(&bad).expect_err("block");
        assert!(e.to_string().contains("modelConfigs[0].blockSize"), "{e}");
        let e = PickerConfig::from_yaml("modelConfigs: []").expect_err("empty");
        assert!(e.to_string().contains("modelConfigs"), "{e}");
    }

    #[test]
    fn every_duration_must_be_positive() {
        for field in [
            "connectTimeout",
            "upstreamTimeout",
            "idleTimeout",
            "renderTimeout",
            "headerReadTimeout",
            "bodyReadTimeout",
        ] {
            let bad = SAMPLE.replace("upstreamTimeout: 30s", &format!("{field}: 0s"));
            let e = PickerConfig::from_yaml(&bad).expect_err(field);
            assert!(
                e.to_string()
                    .contains(&format!("limits.{field} must be positive")),
                "{e}"
            );
        }
        let bad = format!("{SAMPLE}\nindex: {{provisionalTtl: 11m}}\n");
        let e = PickerConfig::from_yaml(&bad).expect_err("provisional ttl");
        assert!(e.to_string().contains("index.provisionalTtl"), "{e}");
        let off = format!("{SAMPLE}\nindex: {{provisionalTtl: 0s}}\n");
        let s = PickerConfig::from_yaml(&off).expect("0s turns it off");
        assert_eq!(s.index.provisional_ttl, Duration::ZERO);
        let bad = format!("{SAMPLE}\nindex: {{approximateTtl: 0s}}\n");
        let e = PickerConfig::from_yaml(&bad).expect_err("ttl");
        assert!(e.to_string().contains("index.approximateTtl"), "{e}");
        let bad = SAMPLE.replace(
            "upstreamTimeout: 30s",
            "maxBodyBytes: 2048\n  bodyBufferBytes: 1024",
        );
        let e = PickerConfig::from_yaml(&bad).expect_err("buffer");
        assert!(e.to_string().contains("limits.bodyBufferBytes"), "{e}");
    }

    #[test]
    fn restart_only_sections_are_named_when_they_change() {
        let a = PickerConfig::from_yaml(SAMPLE).expect("valid");
        let mut b = a.clone();
        b.routing.temperature = 0.5;
        assert!(
            a.restart_only_changes(&b).is_empty(),
            "routing applies live"
        );
        b.limits.upstream_timeout = Duration::from_secs(5);
        b.scrape.interval = Duration::from_secs(1);
        assert_eq!(a.restart_only_changes(&b), vec!["limits", "scrape"]);
    }
}

#[cfg(test)]
mod sample_tests {
    use super::*;

    #[test]
    fn the_shipped_sample_config_is_valid() {
        let c = PickerConfig::from_yaml(include_str!("../../../config/picker.yaml"))
            .expect("config/picker.yaml is valid");
        assert_eq!(c.model_configs[0].data_parallel.size, 2);
        assert_eq!(c.endpoints.len(), 2);
    }

    #[test]
    fn the_config_block_parses_with_defaults_and_errors_name_the_field() {
        use crate::outlier::OutlierDetection;
        let base = "modelConfigs: [{name: a, model: m}]\n";
        let c = PickerConfig::from_yaml(base).expect("valid");
        assert_eq!(c.limits.outlier_detection, OutlierDetection::default());
        let c = PickerConfig::from_yaml(&format!(
            "{base}limits: {{outlierDetection: {{consecutive5xx: 2, baseEjectionTime: 500ms}}}}"
        ))
        .expect("valid");
        assert_eq!(c.limits.outlier_detection.consecutive_5xx, 2);
        assert_eq!(
            c.limits.outlier_detection.base_ejection_time,
            Duration::from_millis(500)
        );
        let e = PickerConfig::from_yaml(&format!(
            "{base}limits: {{outlierDetection: {{maxEjectionPercent: 120}}}}"
        ))
        .expect_err("percent");
        assert!(
            e.to_string()
                .contains("limits.outlierDetection.maxEjectionPercent"),
            "{e}"
        );
        let e = PickerConfig::from_yaml(&format!(
            "{base}limits: {{outlierDetection: {{consecutive5XX: 2}}}}"
        ))
        .expect_err("unknown field");
        assert!(e.to_string().contains("consecutive5XX"), "{e}");
    }
}
