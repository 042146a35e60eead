//! The picker's shared state and the request → decision path used by the HTTP proxy, the
//! pick API and ext_proc alike.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use bytes::Bytes;
use hmac::{Hmac, Mac};
use http::HeaderMap;
use parking_lot::RwLock;
use serde_json::Value;
use sha2::Sha256;
use tokio::sync::Semaphore;

use super::diagnostics::{Diagnostics, Finding};
use super::errors::ApiError;
use super::metrics::{DecisionLabels, Metrics, MisconfigLabels};
use super::settings::{IndexSettings, Limits};
use crate::block_keys::{BlockHasher, BlockKey, ChainRoot};
use crate::calibration::{Calibration, TtftBasis};
use crate::config::RoutingConfig;
use crate::endpoint::{
    Endpoint, EndpointId, EndpointSet, EndpointState, EngineKind, ModelConfig, RankSelection,
};
use crate::index::{IndexConfig, IndexMode, KvIndex};
use crate::inflight::InflightTracker;
use crate::load::LoadView;
use crate::pool::{Isolation, ModelConfigSpec, TenancySpec};
use crate::router::{Decision, RouteContext, RouteError, RouteRequest, Router, subset_allows};
use crate::tokenize::{
    PromptInput, PromptTokenizer, PromptTokenizerOptions, TokenKind, TokenizeError, TokenizeLimits,
};

/// One model configuration, ready to serve: its tokenizer and hasher built once.
pub struct ModelEntry {
    pub spec: ModelConfigSpec,
    pub config: Arc<ModelConfig>,
    pub tokenizer: Arc<PromptTokenizer>,
}

impl std::fmt::Debug for ModelEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelEntry")
            .field("spec", &self.spec)
            .finish()
    }
}

impl ModelEntry {
    pub fn precise(&self) -> bool {
        self.spec.kv_events.is_some()
    }

    fn build(spec: &ModelConfigSpec, limits: &Limits) -> Result<Self, String> {
        let tok_limits = TokenizeLimits {
            max_prompt_bytes: limits.max_body_bytes,
            max_tokens: limits.max_prompt_tokens,
            max_messages: limits.max_messages,
            ..TokenizeLimits::default()
        };
        let options = PromptTokenizerOptions {
            limits: tok_limits,
            piece_cache_tokens: limits.tokenizer_cache_tokens,
            ..PromptTokenizerOptions::default()
        };
        let read = |p: &str| {
            std::fs::read(p)
                .map_err(|e| format!("modelConfigs {:?}: cannot read {p}: {e}", spec.name))
        };
        let (json, cfg) = match &spec.tokenizer {
            Some(t) => (
                t.path.as_deref().map(read).transpose()?,
                t.config_path
                    .as_deref()
                    .map(|p| read(p).map(|b| String::from_utf8_lossy(&b).into_owned()))
                    .transpose()?,
            ),
            None => (None, None),
        };
        let tokenizer = PromptTokenizer::from_hf_files(json.as_deref(), cfg.as_deref(), options)
            .map_err(|e| format!("modelConfigs {:?}: {e}", spec.name))?;
        if tokenizer.has_tokenizer()
            && let Err(why) = tokenizer.piece_cache()
        {
            tracing::info!(model_config = %spec.name, "tokenizer piece cache off: {why}");
        }
        Ok(Self {
            spec: spec.clone(),
            config: Arc::new(ModelConfig::from(spec)),
            tokenizer: Arc::new(tokenizer),
        })
    }
}

/// Which API a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiKind {
    Completions,
    ChatCompletions,
    /// Any other API whose JSON body names a `model` (`/v1/responses`, `/v1/messages`,
    /// `/v1/embeddings`, a path spelled differently, ...), as the gateway forwards it: routed by
    /// model, tenant and load, its prompt not read. Only the ext_proc listener takes these; the
    /// proxy serves the two OpenAI paths above.
    Other,
}

impl ApiKind {
    /// The engine path of an OpenAI API; `None` for [`ApiKind::Other`], whose path the gateway
    /// keeps.
    pub fn path(self) -> Option<&'static str> {
        match self {
            Self::Completions => Some("/v1/completions"),
            Self::ChatCompletions => Some("/v1/chat/completions"),
            Self::Other => None,
        }
    }

    /// The API of a request path (query ignored); exact spellings only, so that whatever the
    /// engine would not serve as completions is not read as completions either.
    pub fn from_path(path: &str) -> Self {
        match path.split('?').next().unwrap_or(path) {
            "/v1/completions" => Self::Completions,
            "/v1/chat/completions" => Self::ChatCompletions,
            _ => Self::Other,
        }
    }
}

/// A completion prompt as OpenAI accepts it.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    /// Token ids (of the first prompt when a batch was sent).
    Ids(Vec<u32>),
}

impl<'de> serde::Deserialize<'de> for Prompt {
    /// Reads a string, a list of strings, a list of token ids or a list of token-id lists,
    /// keeping only the first prompt of a batch (they usually share the prefix that matters).
    /// Token ids go straight into `u32`s: no intermediate JSON tree for 100k-token prompts.
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{Error, IgnoredAny, SeqAccess, Visitor};

        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum First {
            Text(String),
            Id(u32),
            Ids(Vec<u32>),
        }

        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Prompt;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string, a list of strings or a list of token ids")
            }

            fn visit_str<E: Error>(self, v: &str) -> Result<Prompt, E> {
                Ok(Prompt::Text(v.to_owned()))
            }

            fn visit_string<E: Error>(self, v: String) -> Result<Prompt, E> {
                Ok(Prompt::Text(v))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
                let first: Option<First> = seq.next_element()?;
                let out = match first {
                    None => return Err(A::Error::custom("`prompt` must not be empty")),
                    Some(First::Text(t)) => Prompt::Text(t),
                    Some(First::Ids(ids)) => Prompt::Ids(ids),
                    Some(First::Id(id)) => {
                        let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(1024) + 1);
                        ids.push(id);
                        while let Some(t) = seq.next_element::<u32>()? {
                            ids.push(t);
                        }
                        return Ok(Prompt::Ids(ids));
                    }
                };
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(out)
            }
        }
        d.deserialize_any(V)
    }
}

/// The fields the picker reads from a completions or chat body; everything else is forwarded
/// untouched.
#[derive(serde::Deserialize)]
struct Head {
    #[serde(default)]
    model: Option<Value>,
    #[serde(default)]
    prompt: Option<Prompt>,
    #[serde(default)]
    stream: Option<Value>,
    #[serde(default)]
    messages: Option<Value>,
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    add_generation_prompt: Option<Value>,
    #[serde(default)]
    chat_template_kwargs: Option<Value>,
    #[serde(default)]
    cache_salt: Option<Value>,
}

/// The fields the picker reads from the body of any other API ([`ApiKind::Other`]).
#[derive(serde::Deserialize)]
struct OtherHead {
    #[serde(default)]
    model: Option<Value>,
    #[serde(default)]
    stream: Option<Value>,
    #[serde(default)]
    cache_salt: Option<Value>,
}

/// The chat fields the template needs.
#[derive(Debug, Clone)]
pub struct ChatFields {
    pub messages: Value,
    pub tools: Option<Value>,
    pub add_generation_prompt: bool,
    pub kwargs: Option<Value>,
}

/// Request bodies from this size on are tokenized in `block_in_place` (about 8k tokens of text).
const BLOCKING_TOKENIZE_BYTES: usize = 32 * 1024;

/// A request body parsed once.
#[derive(Debug, Clone)]
pub struct ParsedRequest {
    pub kind: ApiKind,
    pub raw: Bytes,
    pub model: String,
    pub stream: bool,
    pub prompt: Option<Prompt>,
    pub chat: Option<ChatFields>,
    /// The client's own `cache_salt` (vLLM): the engine salts the prefix with it, so the
    /// picker hashes with it too (unless tenancy replaces it).
    pub cache_salt: Option<String>,
}

impl ParsedRequest {
    pub fn parse(kind: ApiKind, raw: Bytes, limits: &Limits) -> Result<Self, ApiError> {
        if raw.len() > limits.max_body_bytes {
            return Err(ApiError::too_large(limits.max_body_bytes));
        }
        if raw.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return Err(ApiError::bad_request(
                "invalid_json",
                "request body must be a JSON object",
            ));
        }
        let invalid = |e: serde_json::Error| {
            let code = if e.is_data() {
                "invalid_field"
            } else {
                "invalid_json"
            };
            ApiError::bad_request(code, format!("invalid request body: {e}"))
        };
        if kind == ApiKind::Other {
            let head: OtherHead = serde_json::from_slice(&raw).map_err(invalid)?;
            let (model, stream, cache_salt) =
                Self::common_fields(head.model, head.stream, head.cache_salt)?;
            return Ok(Self {
                kind,
                raw,
                model,
                stream,
                prompt: None,
                chat: None,
                cache_salt,
            });
        }
        let head: Head = serde_json::from_slice(&raw).map_err(invalid)?;
        let (model, stream, cache_salt) =
            Self::common_fields(head.model, head.stream, head.cache_salt)?;
        let (prompt, chat) = match kind {
            ApiKind::Completions => match head.prompt {
                None => {
                    return Err(ApiError::bad_request(
                        "missing_field",
                        "missing required field `prompt`",
                    ));
                }
                Some(Prompt::Ids(ids)) if ids.len() > limits.max_prompt_tokens => {
                    return Err(ApiError::bad_request(
                        "prompt_too_long",
                        format!(
                            "the prompt has {} tokens, more than the limit of {}",
                            ids.len(),
                            limits.max_prompt_tokens
                        ),
                    ));
                }
                Some(p) => (Some(p), None),
            },
            // read by `OtherHead` above
            ApiKind::Other => (None, None),
            ApiKind::ChatCompletions => {
                let messages = match head.messages {
                    None => {
                        return Err(ApiError::bad_request(
                            "missing_field",
                            "missing required field `messages`",
                        ));
                    }
                    Some(Value::Array(m)) if m.is_empty() => {
                        return Err(ApiError::bad_request(
                            "invalid_field",
                            "`messages` must not be empty",
                        ));
                    }
                    Some(Value::Array(m)) if m.len() > limits.max_messages => {
                        return Err(ApiError::bad_request(
                            "too_many_messages",
                            format!(
                                "`messages` has {} entries, more than the limit of {}",
                                m.len(),
                                limits.max_messages
                            ),
                        ));
                    }
                    Some(m @ Value::Array(_)) => m,
                    Some(_) => {
                        return Err(ApiError::bad_request(
                            "invalid_field",
                            "`messages` must be an array",
                        ));
                    }
                };
                let chat = ChatFields {
                    messages,
                    tools: head.tools.filter(|t| !t.is_null()),
                    add_generation_prompt: head
                        .add_generation_prompt
                        .as_ref()
                        .and_then(Value::as_bool)
                        .unwrap_or(true),
                    kwargs: head.chat_template_kwargs.filter(Value::is_object),
                };
                (None, Some(chat))
            }
        };
        Ok(Self {
            kind,
            raw,
            model,
            stream,
            prompt,
            chat,
            cache_salt,
        })
    }

    /// `model`, `stream` and `cache_salt`, which every API reads alike.
    fn common_fields(
        model: Option<Value>,
        stream: Option<Value>,
        cache_salt: Option<Value>,
    ) -> Result<(String, bool, Option<String>), ApiError> {
        let model = match model {
            Some(Value::String(m)) if !m.is_empty() => m,
            Some(_) => {
                return Err(ApiError::bad_request(
                    "invalid_field",
                    "`model` must be a non-empty string",
                ));
            }
            None => {
                return Err(ApiError::bad_request(
                    "missing_field",
                    "missing required field `model`",
                ));
            }
        };
        let stream = match stream {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => b,
            Some(_) => {
                return Err(ApiError::bad_request(
                    "invalid_field",
                    "`stream` must be a boolean",
                ));
            }
        };
        let cache_salt = match cache_salt {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if !s.is_empty() && s.len() <= MAX_CACHE_SALT_BYTES => Some(s),
            Some(_) => {
                return Err(ApiError::bad_request(
                    "invalid_field",
                    format!(
                        "`cache_salt` must be a non-empty string of at most {MAX_CACHE_SALT_BYTES} bytes"
                    ),
                ));
            }
        };
        Ok((model, stream, cache_salt))
    }
}

/// Longest client `cache_salt` accepted.
pub const MAX_CACHE_SALT_BYTES: usize = 1024;

/// Longest tenant name accepted in the tenant header.
pub const MAX_TENANT_BYTES: usize = 253;

/// Tenancy at run time: the spec plus the salt secret.
#[derive(Default)]
pub struct Tenancy {
    pub spec: TenancySpec,
    secret: Vec<u8>,
}

impl std::fmt::Debug for Tenancy {
    /// Never prints the secret.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tenancy")
            .field("spec", &self.spec)
            .field("secret_len", &self.secret.len())
            .finish()
    }
}

impl Tenancy {
    pub fn new(spec: TenancySpec) -> Result<Self, String> {
        let secret = match &spec.salt_secret_file {
            Some(p) => Self::read_secret(p)?,
            None => Vec::new(),
        };
        Ok(Self { spec, secret })
    }

    fn read_secret(p: &str) -> Result<Vec<u8>, String> {
        let s = std::fs::read(p).map_err(|e| format!("tenancy.saltSecretFile {p}: {e}"))?;
        let trimmed = s.trim_ascii().to_vec();
        if trimmed.len() < 16 {
            return Err(format!(
                "tenancy.saltSecretFile {p}: the secret must be at least 16 bytes"
            ));
        }
        Ok(trimmed)
    }

    /// Re-read the secret file; `Some` with the new tenancy when its content changed (a
    /// rotated Kubernetes Secret is swapped in place under the mount).
    pub fn reloaded(&self) -> Result<Option<Self>, String> {
        let Some(p) = &self.spec.salt_secret_file else {
            return Ok(None);
        };
        let secret = Self::read_secret(p)?;
        if secret == self.secret {
            return Ok(None);
        }
        Ok(Some(Self {
            spec: self.spec.clone(),
            secret,
        }))
    }

    /// The tenant of a request: its header, else the default, else an error when isolation
    /// needs one. A header sent more than once, or whose value is not a plain tenant name, is
    /// an error rather than a guess: a gateway that appends headers (Envoy's default) would
    /// otherwise let a client-supplied first value choose the tenant.
    pub fn tenant_of(&self, headers: &HeaderMap) -> Result<Option<String>, ApiError> {
        let from_header = match self.spec.header.as_deref() {
            Some(name) => {
                let mut values = headers.get_all(name).iter();
                match (values.next(), values.next()) {
                    (None, _) => None,
                    (Some(_), Some(_)) => {
                        return Err(ApiError::bad_request(
                            "invalid_tenant",
                            format!("the tenant header `{name}` must be sent once"),
                        ));
                    }
                    (Some(v), None) => {
                        let v = v
                            .to_str()
                            .ok()
                            .map(str::trim)
                            .filter(|v| v.len() <= MAX_TENANT_BYTES && !v.contains(','))
                            .ok_or_else(|| {
                                ApiError::bad_request(
                                    "invalid_tenant",
                                    format!(
                                        "the tenant header `{name}` must be visible ASCII without \
                                         commas, at most {MAX_TENANT_BYTES} bytes"
                                    ),
                                )
                            })?;
                        (!v.is_empty()).then(|| v.to_owned())
                    }
                }
            }
            None => None,
        };
        match (from_header, &self.spec.default_tenant) {
            (Some(t), _) => Ok(Some(t)),
            (None, Some(d)) => Ok(Some(d.clone())),
            (None, None) if self.spec.isolation == Isolation::None => Ok(None),
            (None, None) => Err(ApiError::bad_request(
                "missing_tenant",
                format!(
                    "missing tenant header `{}`",
                    self.spec.header.as_deref().unwrap_or_default()
                ),
            )),
        }
    }

    /// The keyed salt of a tenant (`SaltedCache`): HMAC-SHA256(secret, tenant), hex. Stable
    /// across restarts and replicas that share the secret; unguessable without it.
    pub fn salt(&self, tenant: Option<&str>) -> Option<String> {
        if self.spec.isolation != Isolation::SaltedCache {
            return None;
        }
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.secret).ok()?;
        mac.update(tenant.unwrap_or_default().as_bytes());
        let tag = mac.finalize().into_bytes();
        Some(tag.iter().take(16).map(|b| format!("{b:02x}")).collect())
    }

    /// Whether `tenant` may use `endpoint` (`DedicatedEndpoints`).
    pub fn allows(&self, tenant: Option<&str>, endpoint: &Endpoint) -> bool {
        if self.spec.isolation != Isolation::DedicatedEndpoints {
            return true;
        }
        let Some(t) = tenant else { return false };
        self.spec.tenants.iter().any(|ts| {
            ts.name == t
                && ts
                    .pod_selector
                    .iter()
                    .all(|(k, v)| endpoint.labels.get(k) == Some(v))
        })
    }
}

/// An endpoint as a source reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointView {
    pub id: EndpointId,
    pub model_config: String,
    pub labels: BTreeMap<String, String>,
    /// `false` while the pod terminates: it finishes what it has but takes nothing new.
    pub serving: bool,
    /// Per-endpoint KV event publisher and replay ports (of this endpoint's rank), when they
    /// differ from the model config's `port + rank` convention.
    pub kv_ports: Option<KvPorts>,
}

/// Where one endpoint publishes KV events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvPorts {
    pub events: u16,
    pub replay: Option<u16>,
}

/// Everything a source (config file or Kubernetes) says about the pool.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolView {
    pub model_configs: Vec<ModelConfigSpec>,
    pub routing: RoutingConfig,
    pub tenancy: TenancySpec,
    pub endpoints: Vec<EndpointView>,
}

/// What changed when a view was applied.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolChange {
    pub added: Vec<EndpointId>,
    pub removed: Vec<EndpointId>,
    pub routing_changed: bool,
}

/// Headers the picker sets on the request it forwards (name, value).
pub type UpstreamHeaders = Vec<(&'static str, String)>;

/// A routed request.
#[derive(Debug)]
pub struct Routed {
    pub decision: Decision,
    pub entry: Arc<ModelEntry>,
    pub keys: Vec<BlockKey>,
    pub prompt_tokens: u32,
    pub tenant: Option<String>,
    /// The salt the keys were hashed with: the tenant's (`SaltedCache`), else the client's.
    pub salt: Option<String>,
    /// Whether `salt` is the tenant's, which every forwarded body must carry.
    pub tenant_salted: bool,
    pub lora: Option<String>,
    pub token_kind: TokenKind,
    /// What the cost model's TTFT estimate for the chosen endpoint rested on, while
    /// calibration is on (`None` as well when the in-flight cap moved the request elsewhere):
    /// a streamed response's first chunk is measured against it.
    pub ttft_basis: Option<TtftBasis>,
}

/// The shared state of one picker.
pub struct PickerCore {
    pub endpoints: EndpointSet,
    catalog: ArcSwap<BTreeMap<String, Arc<ModelEntry>>>,
    router: ArcSwap<Router>,
    routing: ArcSwap<RoutingConfig>,
    tenancy: ArcSwap<Tenancy>,
    pub index: RwLock<KvIndex>,
    pub loads: RwLock<LoadView>,
    pub inflight: InflightTracker,
    /// The cost model's per-endpoint calibration (see `calibration`).
    pub calibration: RwLock<Calibration>,
    pub limits: Limits,
    pub index_settings: IndexSettings,
    pub metrics: Metrics,
    pub http: reqwest::Client,
    start: Instant,
    inflight_total: AtomicUsize,
    pub first_metrics: AtomicBool,
    /// Whether a pool view has been applied: before that, an unknown model means "not loaded
    /// yet" (503), not "no such model" (404), and `start` waits on it.
    pub pool_loaded: tokio::sync::watch::Sender<bool>,
    render_slots: Semaphore,
    /// Bytes of request bodies being read (`bodyBufferBytes`), apart from admission.
    pub body_buffer: Semaphore,
    labels: RwLock<BTreeMap<EndpointId, BTreeMap<String, String>>>,
    kv_ports: RwLock<BTreeMap<EndpointId, KvPorts>>,
    /// Misconfigurations seen per endpoint (block size, KV events that never arrive).
    pub diagnostics: parking_lot::Mutex<Diagnostics>,
    /// Passive health (see `passive_health`).
    pub(super) outliers: parking_lot::Mutex<crate::outlier::OutlierDetector>,
}

impl std::fmt::Debug for PickerCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PickerCore")
            .field("endpoints", &self.endpoints.load().len())
            .finish()
    }
}

impl PickerCore {
    pub fn new(limits: Limits, index_settings: IndexSettings) -> Result<Self, String> {
        let http = reqwest::Client::builder()
            .connect_timeout(limits.connect_timeout)
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(1024)
            .tcp_nodelay(true)
            .build()
            .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
        Ok(Self {
            endpoints: EndpointSet::default(),
            catalog: ArcSwap::from_pointee(BTreeMap::new()),
            router: ArcSwap::from_pointee(Router::new(RoutingConfig::default())),
            routing: ArcSwap::from_pointee(RoutingConfig::default()),
            tenancy: ArcSwap::from_pointee(Tenancy::default()),
            index: RwLock::new(KvIndex::new(IndexConfig {
                max_endpoints: index_settings.max_endpoints,
            })),
            loads: RwLock::new(LoadView::new()),
            inflight: InflightTracker::new(),
            calibration: RwLock::new(Calibration::new(RoutingConfig::default().cost_model)),
            render_slots: Semaphore::new(limits.max_render_concurrency),
            body_buffer: Semaphore::new(limits.body_buffer_bytes.min(Semaphore::MAX_PERMITS)),
            outliers: parking_lot::Mutex::new(crate::outlier::OutlierDetector::new(
                limits.outlier_detection.clone(),
            )),
            limits,
            index_settings,
            metrics: Metrics::new(),
            http,
            start: Instant::now(),
            inflight_total: AtomicUsize::new(0),
            first_metrics: AtomicBool::new(false),
            pool_loaded: tokio::sync::watch::Sender::new(false),
            labels: RwLock::new(BTreeMap::new()),
            kv_ports: RwLock::new(BTreeMap::new()),
            diagnostics: parking_lot::Mutex::new(Diagnostics::default()),
        })
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

    pub fn routing(&self) -> Arc<RoutingConfig> {
        self.routing.load_full()
    }

    pub fn router(&self) -> Arc<Router> {
        self.router.load_full()
    }

    pub fn catalog(&self) -> Arc<BTreeMap<String, Arc<ModelEntry>>> {
        self.catalog.load_full()
    }

    pub fn model_entry(&self, name: &str) -> Option<Arc<ModelEntry>> {
        self.catalog.load().get(name).cloned()
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
    pub fn apply_pool(&self, view: &PoolView) -> Result<PoolChange, String> {
        let routing_changed = **self.routing.load() != view.routing;
        view.routing.validate()?;
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
        let mut endpoints = Vec::with_capacity(view.endpoints.len());
        let mut labels = BTreeMap::new();
        let mut kv_ports = BTreeMap::new();
        let current = self.endpoints.load();
        for ev in &view.endpoints {
            let Some(entry) = catalog.get(&ev.model_config) else {
                return Err(format!(
                    "endpoint {} names unknown model config {:?}",
                    ev.id, ev.model_config
                ));
            };
            let mut e = Endpoint::new(ev.id, entry.config.clone());
            e.labels = ev.labels.clone();
            e.state = if !ev.serving {
                EndpointState::Draining
            } else {
                // keep staleness the scraper determined
                current
                    .get(&ev.id)
                    .filter(|c| c.state == EndpointState::Stale)
                    .map_or(EndpointState::Ready, |c| c.state)
            };
            labels.insert(ev.id, ev.labels.clone());
            if let Some(p) = ev.kv_ports {
                kv_ports.insert(ev.id, p);
            }
            endpoints.push(e);
        }
        // index: register new endpoints with their mode and budget, drop departed ones
        let mut added = Vec::new();
        {
            let mut index = self.index.write();
            for e in &endpoints {
                let Some(entry) = catalog.get(&*e.model_config.name) else {
                    continue;
                };
                let cap = entry
                    .spec
                    .kv_capacity_blocks
                    .unwrap_or(self.index_settings.default_kv_capacity_blocks);
                let (mode, budget) = if entry.precise() {
                    (
                        IndexMode::Precise,
                        cap.saturating_mul(self.index_settings.precise_slack.max(1)),
                    )
                } else {
                    (
                        IndexMode::Approximate {
                            ttl_ms: self.index_settings.approximate_ttl.as_millis() as u64,
                        },
                        cap,
                    )
                };
                let known = index.slot(&e.id).is_some();
                index
                    .add_endpoint(e.id, mode, budget as usize)
                    .map_err(|err| err.to_string())?;
                if !known {
                    added.push(e.id);
                }
            }
        }
        self.catalog.store(Arc::new(catalog));
        self.tenancy.store(Arc::new(tenancy));
        if routing_changed {
            self.router
                .store(Arc::new(Router::new(view.routing.clone())));
            self.routing.store(Arc::new(view.routing.clone()));
        }
        *self.labels.write() = labels;
        *self.kv_ports.write() = kv_ports;
        let removed = self.endpoints.replace(endpoints);
        {
            let mut index = self.index.write();
            let mut loads = self.loads.write();
            let router = self.router.load();
            for id in &removed {
                index.remove_endpoint(id);
                loads.remove(id);
                self.inflight.remove(id);
                router.forget_endpoint(id);
            }
        }
        self.sync_outlier_pool();
        self.sync_calibration();
        self.metrics
            .endpoints
            .set(self.endpoints.load().len() as i64);
        self.pool_loaded
            .send_if_modified(|loaded| !std::mem::replace(loaded, true));
        Ok(PoolChange {
            added,
            removed,
            routing_changed,
        })
    }

    /// Re-read the tenancy salt secret; `true` when it changed and the new salts apply.
    /// Requests routed after this carry salts under the new secret (so the engines start
    /// cold for every tenant, as they should after a rotation).
    pub fn reload_tenancy_secret(&self) -> Result<bool, String> {
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
        !self.endpoints.load().is_empty() && self.first_metrics.load(Ordering::Relaxed)
    }

    /// An endpoint for a request that names no model (a bodyless request through the gateway,
    /// such as `GET /v1/models`): the least-loaded Ready endpoint of any model config that the
    /// tenant may use, within the gateway's subset.
    pub fn pick_bodyless(
        &self,
        headers: &HeaderMap,
        subset: Option<&[SocketAddr]>,
    ) -> Result<EndpointId, ApiError> {
        let tenancy = self.tenancy.load_full();
        let tenant = tenancy.tenant_of(headers)?;
        let ejected = self.ejected_endpoints();
        let snapshot = self.endpoints.load();
        snapshot
            .endpoints()
            .iter()
            .filter(|e| e.state == EndpointState::Ready)
            .filter(|e| {
                subset.is_none_or(|s| subset_allows(s, SocketAddr::new(e.id.address, e.id.port)))
            })
            .filter(|e| tenancy.allows(tenant.as_deref(), e))
            // an endpoint passive health ejected only when nothing else is eligible
            .min_by_key(|e| {
                let ejected = ejected.binary_search(&e.id).is_ok();
                (ejected, self.inflight.get(&e.id).requests, e.id)
            })
            .map(|e| e.id)
            .ok_or_else(|| {
                ApiError::unavailable(
                    "no_eligible_endpoint",
                    "no serving endpoint is eligible for this request",
                )
            })
    }

    /// Tokenize, hash and decide. `explain` fills per-candidate details (pick API).
    pub async fn route(
        &self,
        req: &ParsedRequest,
        headers: &HeaderMap,
        subset: Option<&[SocketAddr]>,
        explain: bool,
    ) -> Result<Routed, ApiError> {
        let started = Instant::now();
        let snapshot = self.endpoints.load();
        let (config, lora) = Router::resolve_model(&snapshot, &req.model).map_err(|_| {
            // a configured model without endpoints is "no endpoint", not "unknown model"
            if self
                .catalog
                .load()
                .values()
                .any(|e| e.config.serves(&req.model).is_some())
            {
                ApiError::unavailable(
                    "no_eligible_endpoint",
                    format!("no endpoint is serving `{}` right now", req.model),
                )
            } else {
                self.no_such_model(&req.model)
            }
        })?;
        let entry = self
            .model_entry(&config.name)
            .ok_or_else(|| self.no_such_model(&req.model))?;
        let tenancy = self.tenancy.load_full();
        let tenant = tenancy.tenant_of(headers)?;
        // the tenant's salt replaces the client's own; either way the engine and the index
        // see the same salt as this request's keys
        let tenant_salt = tenancy.salt(tenant.as_deref());
        let tenant_salted = tenant_salt.is_some();
        let salt = tenant_salt.or_else(|| req.cache_salt.clone());

        // another API's prompt is not read: it is routed by model, tenant and load alone
        let (ids, kind) = if req.kind == ApiKind::Other {
            (Vec::new(), TokenKind::Tokens)
        } else {
            self.tokens(&entry, req, &snapshot).await?
        };
        if ids.len() > self.limits.max_prompt_tokens {
            return Err(ApiError::bad_request(
                "prompt_too_long",
                format!(
                    "the prompt has {} tokens, more than the limit of {}",
                    ids.len(),
                    self.limits.max_prompt_tokens
                ),
            ));
        }
        let hasher = match kind {
            TokenKind::Tokens => BlockHasher::new(entry.config.block_size),
            TokenKind::CharChunks => BlockHasher::new(entry.tokenizer.char_chunk_tokens() as u32),
        };
        let root = ChainRoot::new(&entry.config.model, lora.as_deref(), salt.as_deref());
        let keys = hasher.keys(root, &ids);
        let prompt_tokens = match kind {
            TokenKind::Tokens => ids.len(),
            // about four characters per token, for load accounting only
            TokenKind::CharChunks => ids.len().div_ceil(4),
        } as u32;
        let routing = self.routing.load();
        let session = headers
            .get(routing.session_header.as_str())
            .and_then(|v| v.to_str().ok())
            .filter(|s| !s.is_empty() && s.len() <= 256);
        let fallback_hash = xxhash_rust::xxh3::xxh3_64(&req.raw[..req.raw.len().min(4096)]);
        let allow_fn = |e: &Endpoint| tenancy.allows(tenant.as_deref(), e);
        let ejected = self.ejected_endpoints();
        let calibrating = routing.cost_model.calibrate;
        let decision = {
            let index = self.index.read();
            let loads = self.loads.read();
            let calibration = self.calibration.read();
            let ctx = RouteContext {
                endpoints: &snapshot,
                index: &index,
                loads: &loads,
                inflight: &self.inflight,
                now_ms: self.now_ms(),
                ejected: &ejected,
                calibration: calibrating.then_some(&*calibration),
            };
            let rr = RouteRequest {
                model_config: &config,
                keys: &keys,
                prompt_tokens,
                session,
                tenant: tenant.as_deref(),
                subset,
                allow: if tenancy.spec.isolation == Isolation::DedicatedEndpoints {
                    Some(&allow_fn)
                } else {
                    None
                },
                fallback_hash,
                explain,
            };
            self.router.load().decide(&ctx, &rr)
        };
        let decision = decision.map_err(|e| {
            self.metrics.error(e.kind());
            match e {
                RouteError::UnknownModel(m) => self.no_such_model(&m),
                RouteError::NoEligibleEndpoint(_) => {
                    ApiError::unavailable("no_eligible_endpoint", e.to_string())
                }
                RouteError::AllStale(_) => {
                    ApiError::unavailable("all_endpoints_stale", e.to_string())
                }
            }
        })?;
        // shed when the chosen endpoint and every fallback are full
        let chosen = decision.endpoint;
        let decision = self.apply_inflight_cap(decision)?;
        let ttft_basis = (calibrating && decision.endpoint == chosen)
            .then(|| crate::policy::ttft_basis(&routing.cost_model, &decision.features));
        self.metrics
            .decision_seconds
            .observe(started.elapsed().as_secs_f64());
        Ok(Routed {
            decision,
            entry,
            keys,
            prompt_tokens,
            tenant,
            salt,
            tenant_salted,
            lora,
            token_kind: kind,
            ttft_basis,
        })
    }

    fn apply_inflight_cap(&self, mut d: Decision) -> Result<Decision, ApiError> {
        let cap = self.limits.max_inflight_per_endpoint;
        if self.inflight.get(&d.endpoint).requests < cap {
            return Ok(d);
        }
        let Some(pos) = d
            .fallbacks
            .iter()
            .position(|f| self.inflight.get(f).requests < cap)
        else {
            self.metrics.error("shed");
            return Err(ApiError::shed(format!(
                "every eligible endpoint has {cap} requests in flight"
            )));
        };
        let next = d.fallbacks.remove(pos);
        d.fallbacks.insert(0, d.endpoint);
        d.endpoint = next;
        Ok(d)
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
        let input = match (&req.prompt, &req.chat) {
            (Some(Prompt::Ids(ids)), _) => {
                let out = tok
                    .tokenize(PromptInput::TokenIds(ids))
                    .map_err(tokenize_error)?;
                // token ids are the engine's own tokens whatever the tokenizer setup
                return Ok((out.ids, TokenKind::Tokens));
            }
            (Some(Prompt::Text(t)), _) => PromptInput::Text(t),
            (None, Some(chat)) => PromptInput::Chat {
                messages: &chat.messages,
                tools: chat.tools.as_ref(),
                add_generation_prompt: chat.add_generation_prompt,
                extra: chat.kwargs.as_ref(),
            },
            (None, None) => {
                return Err(ApiError::bad_request(
                    "missing_field",
                    "missing required field `prompt` or `messages`",
                ));
            }
        };
        // Encoding what the piece cache does not hold costs about 1 µs per token: a long prompt
        // keeps the tokenizer busy for milliseconds. On the multi-threaded runtime the worker
        // first hands its other tasks to another thread, so they do not wait behind it.
        let tokenize = || tok.tokenize(input);
        let out = if req.raw.len() >= BLOCKING_TOKENIZE_BYTES
            && tokio::runtime::Handle::try_current()
                .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
        {
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
            .min_by_key(|e| self.inflight.get(&e.id).requests)?;
        let _slot = self.render_slots.try_acquire().ok()?;
        let url = format!(
            "http://{}{}/render",
            target.id.host_port(),
            req.kind.path()?
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

    /// Bookkeeping once a decision is final: metrics, and the approximate index learns that
    /// the prompt's blocks now live on the chosen endpoint.
    pub fn record_routed(&self, routed: &Routed) {
        let d = &routed.decision;
        self.metrics
            .decisions
            .get_or_create(&DecisionLabels {
                policy: d.policy.to_string(),
                endpoint: d.endpoint.to_string(),
                reason: format!("{:?}", d.reason).to_lowercase(),
            })
            .inc();
        self.metrics
            .prompt_tokens
            .inc_by(u64::from(routed.prompt_tokens));
        self.metrics
            .predicted_hit_tokens
            .inc_by(u64::from(d.cached_tokens));
        if !routed.entry.precise() {
            let mut index = self.index.write();
            if let Some(slot) = index.slot(&d.endpoint) {
                index.record_routed(slot, &routed.keys, self.now_ms());
            }
        }
    }

    /// The request to send to `endpoint`: extra headers and the body ([`engine_body`]).
    pub fn upstream_parts(
        &self,
        routed: &Routed,
        req: &ParsedRequest,
        endpoint: EndpointId,
    ) -> Result<(UpstreamHeaders, Bytes), ApiError> {
        let mc = &routed.entry.config;
        let mut headers = Vec::new();
        let mut body_rank = None;
        if mc.dp_size > 1 && mc.rank_selection == RankSelection::Header {
            match mc.engine {
                EngineKind::Sglang => body_rank = Some(endpoint.rank),
                _ => headers.push(("x-data-parallel-rank", endpoint.rank.to_string())),
            }
        }
        let tenant_salt = routed.salt.as_deref().filter(|_| routed.tenant_salted);
        Ok((headers, engine_body(req, tenant_salt, body_rank)?))
    }

    /// Count a request against the global in-flight bound; `None` when it is full.
    pub fn admit(self: &Arc<Self>) -> Option<Admission> {
        let n = self.inflight_total.fetch_add(1, Ordering::AcqRel);
        if n >= self.limits.max_inflight_total {
            self.inflight_total.fetch_sub(1, Ordering::AcqRel);
            self.metrics.error("shed");
            return None;
        }
        Some(Admission { core: self.clone() })
    }

    /// KV event ports of an endpoint that overrides its model config's.
    pub fn kv_ports_of(&self, id: &EndpointId) -> Option<KvPorts> {
        self.kv_ports.read().get(id).copied()
    }

    pub fn labels_of(&self, id: &EndpointId) -> BTreeMap<String, String> {
        self.labels.read().get(id).cloned().unwrap_or_default()
    }
}

/// Holds one slot of the global in-flight bound.
#[derive(Debug)]
pub struct Admission {
    core: Arc<PickerCore>,
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.core.inflight_total.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The body to forward: the client's, rewritten only when a field must be injected (the
/// tenant's salt, replacing the client's own; SGLang's `data_parallel_rank`). A body that must
/// carry the tenant's salt is always rewritten, so what the engine reads is a tree this process
/// built; one that cannot be rewritten is refused, never forwarded as it came: the engine would
/// see the client's own `cache_salt` (or none) while the index credits the tenant's.
pub fn engine_body(
    req: &ParsedRequest,
    tenant_salt: Option<&str>,
    data_parallel_rank: Option<u32>,
) -> Result<Bytes, ApiError> {
    let mut inject: Vec<(&str, Value)> = Vec::new();
    if let Some(rank) = data_parallel_rank {
        inject.push(("data_parallel_rank", Value::from(rank)));
    }
    if let Some(salt) = tenant_salt {
        inject.push(("cache_salt", Value::from(salt)));
    }
    if inject.is_empty() {
        return Ok(req.raw.clone());
    }
    inject_fields(&req.raw, inject)
}

/// `raw` (a JSON object) with `fields` set at its top level. The slow path, only for bodies that
/// need a field injected; a body `serde_json` cannot hold as a tree (a number out of range, a
/// lone surrogate, nesting past its limit) is a 400 naming the reason.
fn inject_fields(raw: &[u8], fields: Vec<(&str, Value)>) -> Result<Bytes, ApiError> {
    let unrewritable = |why: String| {
        ApiError::bad_request(
            "invalid_json",
            format!("the request body cannot be rewritten for the engine: {why}"),
        )
    };
    let mut body = match serde_json::from_slice::<Value>(raw) {
        Ok(Value::Object(body)) => body,
        Ok(_) => return Err(unrewritable("it is not a JSON object".into())),
        Err(e) => return Err(unrewritable(e.to_string())),
    };
    for (k, v) in fields {
        body.insert(k.to_owned(), v);
    }
    serde_json::to_vec(&Value::Object(body))
        .map(Bytes::from)
        .map_err(|e| unrewritable(e.to_string()))
}

fn tokenize_error(e: TokenizeError) -> ApiError {
    let code = match &e {
        TokenizeError::InputLimit { .. } => "prompt_too_long",
        TokenizeError::TemplateLimit { .. } => "template_limit",
        TokenizeError::TokenOutOfVocab { .. } => "invalid_token_id",
        TokenizeError::InvalidChat(_) | TokenizeError::TemplateRaised(_) => "invalid_messages",
        _ => "tokenization_failed",
    };
    ApiError::bad_request(code, e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(kind: ApiKind, body: &str) -> Result<ParsedRequest, ApiError> {
        ParsedRequest::parse(kind, Bytes::from(body.to_owned()), &Limits::default())
    }

    #[test]
    fn prompts_in_every_openai_shape() {
        let p = |b: &str| parse(ApiKind::Completions, b).expect("valid").prompt;
        assert_eq!(
            p(r#"{"model":"m","prompt":"hi"}"#),
            Some(Prompt::Text("hi".into()))
        );
        assert_eq!(
            p(r#"{"model":"m","prompt":["a","b"]}"#),
            Some(Prompt::Text("a".into()))
        );
        assert_eq!(
            p(r#"{"model":"m","prompt":[1,2,3]}"#),
            Some(Prompt::Ids(vec![1, 2, 3]))
        );
        assert_eq!(
            p(r#"{"model":"m","prompt":[[4,5],[6]]}"#),
            Some(Prompt::Ids(vec![4, 5]))
        );
    }

    #[test]
    fn bad_bodies_are_400s_naming_the_problem() {
        for (body, code) in [
            ("[1,2]", "invalid_json"),
            ("{\"model\":\"m\",\"prompt\":", "invalid_json"),
            (r#"{"model":"m","prompt":[-1]}"#, "invalid_field"),
            (r#"{"model":"m","prompt":[1,"x"]}"#, "invalid_field"),
            (r#"{"model":"m","prompt":{}}"#, "invalid_field"),
            (r#"{"model":"m","prompt":[]}"#, "invalid_field"),
            (r#"{"model":"m"}"#, "missing_field"),
            (r#"{"prompt":"x"}"#, "missing_field"),
            (r#"{"model":7,"prompt":"x"}"#, "invalid_field"),
            (
                r#"{"model":"m","prompt":"x","stream":"yes"}"#,
                "invalid_field",
            ),
        ] {
            let e = parse(ApiKind::Completions, body).expect_err(body);
            assert_eq!(
                (e.status.as_u16(), e.code),
                (400, code),
                "{body}: {}",
                e.message
            );
        }
        for (body, code) in [
            (r#"{"model":"m"}"#, "missing_field"),
            (r#"{"model":"m","messages":[]}"#, "invalid_field"),
            (r#"{"model":"m","messages":"hi"}"#, "invalid_field"),
        ] {
            let e = parse(ApiKind::ChatCompletions, body).expect_err(body);
            assert_eq!((e.status.as_u16(), e.code), (400, code), "{body}");
        }
    }

    #[test]
    fn chat_fields_are_kept_for_the_template() {
        let r = parse(
            ApiKind::ChatCompletions,
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"add_generation_prompt":false,"tools":null,"stream":true}"#,
        )
        .expect("valid");
        let chat = r.chat.expect("chat");
        assert!(!chat.add_generation_prompt && chat.tools.is_none() && r.stream);
    }

    #[test]
    fn salts_are_keyed_stable_and_distinct() {
        let dir = std::env::temp_dir().join(format!("kvroute-salt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let secret = dir.join("secret");
        std::fs::write(&secret, "0123456789abcdef-secret").expect("write");
        let spec = TenancySpec {
            isolation: Isolation::SaltedCache,
            header: Some("x-tenant".into()),
            salt_secret_file: Some(secret.display().to_string()),
            ..TenancySpec::default()
        };
        let t = Tenancy::new(spec.clone()).expect("tenancy");
        let again = Tenancy::new(spec.clone()).expect("tenancy");
        let (a, b) = (t.salt(Some("acme")), t.salt(Some("globex")));
        assert!(a.is_some() && a != b);
        assert_eq!(
            a,
            again.salt(Some("acme")),
            "stable across restarts and replicas"
        );
        std::fs::write(&secret, "another-secret-of-16+").expect("write");
        let rotated = Tenancy::new(spec).expect("tenancy");
        assert_ne!(
            a,
            rotated.salt(Some("acme")),
            "changes when the secret rotates"
        );
        let mut h = HeaderMap::new();
        assert_eq!(
            t.tenant_of(&h).expect_err("required").code,
            "missing_tenant"
        );
        h.insert("x-tenant", "acme".parse().expect("header"));
        assert_eq!(t.tenant_of(&h).expect("tenant").as_deref(), Some("acme"));
        let _ = std::fs::remove_dir_all(dir);
    }
}
