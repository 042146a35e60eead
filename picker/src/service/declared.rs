//! The pool as the picker's sources report it (endpoints, model configs, routing, tenancy),
//! and the model configs built from it, ready to serve.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::settings::Limits;
use crate::config::RoutingConfig;
use crate::endpoint::{EndpointId, ModelConfig};
use crate::error::PickerError;
use crate::pool::{ModelConfigSpec, TenancySpec};
use crate::tokenize::{PromptTokenizer, PromptTokenizerOptions, TokenizeLimits};

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

    pub(super) fn build(spec: &ModelConfigSpec, limits: &Limits) -> Result<Self, PickerError> {
        let tok_limits = TokenizeLimits {
            max_prompt_bytes: limits.max_body_bytes,
            max_tokens: limits.max_prompt_tokens,
            max_messages: limits.max_messages,
            max_encode_bytes_at_once: limits.tokenize_bytes_at_once,
            ..TokenizeLimits::default()
        };
        let options = PromptTokenizerOptions {
            limits: tok_limits,
            piece_cache_tokens: limits.tokenizer_cache_tokens,
            ..PromptTokenizerOptions::default()
        };
        let read = |p: &str| {
            std::fs::read(p).map_err(|e| {
                PickerError::read_file(format!("modelConfigs {:?}: tokenizer", spec.name), p, e)
            })
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
            .map_err(|e| PickerError::Tokenizer {
                name: spec.name.clone(),
                message: e.to_string(),
            })?;
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

/// An endpoint as a source reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeclaredEndpoint {
    pub id: EndpointId,
    pub model_config: String,
    pub labels: BTreeMap<String, String>,
    /// `false` while the pod terminates: it finishes what it has but takes nothing new.
    pub serving: bool,
    /// Per-endpoint KV event publisher and replay ports (of this endpoint's rank), when they
    /// differ from the model config's `port + rank` convention.
    pub kv_ports: Option<KvPorts>,
}

pub use crate::endpoint::KvPorts;

/// Everything a source (config file or Kubernetes) says about the pool.
#[derive(Debug, Clone, PartialEq)]
pub struct DeclaredPool {
    pub model_configs: Vec<ModelConfigSpec>,
    pub routing: RoutingConfig,
    pub tenancy: TenancySpec,
    pub endpoints: Vec<DeclaredEndpoint>,
}

/// What changed when a view was applied.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolChange {
    pub added: Vec<EndpointId>,
    pub removed: Vec<EndpointId>,
    pub routing_changed: bool,
}
