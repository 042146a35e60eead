//! Pool specification: the model configurations a pool serves and its tenancy.
//!
//! Like [`crate::config`], these types are shared by the picker's config file and the
//! `KVRoutePool` custom resource, so doc comments are written for `kubectl explain`. Schema
//! attributes (bounds, patterns, `x-kubernetes-validations` CEL rules) make the API server reject
//! what [`ModelConfigSpec::validate`] and [`TenancySpec::validate`] would reject, at
//! `kubectl apply` time. Strings and lists that CEL rules read are bounded so the API server can
//! bound the rules' cost.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The serving engine behind an endpoint (`vllm`, `sglang` or `trtllm`); decides the metric
/// names the picker scrapes and how a data-parallel rank is selected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// vLLM's OpenAI-compatible server.
    #[default]
    Vllm,
    /// SGLang's OpenAI-compatible server.
    Sglang,
    /// TensorRT-LLM's `trtllm-serve`.
    Trtllm,
}

impl EngineKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Vllm => "vllm",
            Self::Sglang => "sglang",
            Self::Trtllm => "trtllm",
        }
    }
}

/// How a data-parallel rank is addressed: `Header` (one server, the rank in a header or body
/// field) or `Port` (one server per rank on `port + rank`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, JsonSchema)]
pub enum RankSelection {
    /// One HTTP server for all ranks; the rank travels in `X-data-parallel-rank` (vLLM) or in
    /// the `data_parallel_rank` body field (SGLang).
    #[default]
    Header,
    /// One HTTP server per rank, listening on `port + rank`.
    Port,
}

/// Data parallelism of the engine in each pod. Each rank owns a private slice of the KV cache,
/// so a session must stay on the rank that holds its prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DataParallel {
    /// Data-parallel ranks per pod (1-1024). Each rank owns a private slice of the KV cache,
    /// so the picker routes to a (pod, rank) pair.
    #[schemars(range(min = 1, max = 1024))]
    pub size: u32,
    /// `Header`: one HTTP server for all ranks, the rank selected by the
    /// `X-data-parallel-rank` header (vLLM) or the `data_parallel_rank` body field (SGLang).
    /// `Port`: each rank serves on `port + rank`.
    #[serde(default)]
    pub rank_selection: RankSelection,
}

impl Default for DataParallel {
    fn default() -> Self {
        Self {
            size: 1,
            rank_selection: RankSelection::Header,
        }
    }
}

/// Where the engine publishes KV-cache events. Absent: the engine publishes none, and the
/// picker learns cache contents approximately from its own routing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KvEventsSpec {
    /// ZMQ PUB port of rank 0; rank k publishes on `port + k`. An engine that lists its
    /// publishers at `GET /kv_event_sources` (vLLM 0.32 and later, which may bind them at
    /// port 0) is subscribed where it lists them instead; this port serves the others (older
    /// vLLM, SGLang).
    #[schemars(range(min = 1, max = 65535))]
    pub port: u16,
    /// Topic filter (empty = every topic).
    #[serde(default)]
    #[schemars(length(max = 256))]
    pub topic: String,
    /// ZMQ ROUTER port of rank 0 serving replays of missed batches (offset by the rank too;
    /// an engine's `/kv_event_sources` list outranks it as for `port`). Absent: gaps are
    /// repaired by clearing the endpoint's blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub replay_port: Option<u16>,
}

/// How the picker turns a request into token ids. In a cluster, name a ConfigMap in
/// `configMap`; `path` and `configPath` are for standalone pickers (files on the picker's host).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TokenizerSpec {
    /// Path of a Hugging Face `tokenizer.json` (in Kubernetes: mounted from `configMap`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Path of `tokenizer_config.json` holding the chat template and special tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_path: Option<String>,
    /// Name of a ConfigMap (in the pool's namespace) holding `tokenizer.json` and optionally
    /// `tokenizer_config.json`; the operator mounts it into the picker. ConfigMaps hold at most
    /// 1 MiB: larger tokenizers need `binaryData` compression or `useEngineRender`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
    )]
    pub config_map: Option<String>,
    /// Ask the engine itself for the tokens (vLLM's `/v1/completions/render` and
    /// `/v1/chat/completions/render`): exact parity with its chat template at the cost of one
    /// extra hop per request. Falls back to the local tokenizer on failure.
    #[serde(default)]
    pub use_engine_render: bool,
}

/// One model configuration: which pods serve which model with which engine settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "!has(self.dataParallel) || !has(self.dataParallel.rankSelection) || self.dataParallel.rankSelection != 'Port' || (has(self.port) ? self.port : 8000) + (has(self.dataParallel.size) ? self.dataParallel.size : 1) - 1 <= 65535",
        "message": "with rankSelection Port, port + dataParallel.size - 1 must not exceed 65535"
    },
    {
        "rule": "!has(self.kvEvents) || self.kvEvents.port + (has(self.dataParallel) && has(self.dataParallel.size) ? self.dataParallel.size : 1) - 1 <= 65535",
        "message": "kvEvents.port + dataParallel.size - 1 must not exceed 65535"
    },
    {
        "rule": "!has(self.loraAdapters) || self.loraAdapters.all(a, a != self.model)",
        "message": "loraAdapters must differ from the base model"
    }
]))]
pub struct ModelConfigSpec {
    /// Unique name of this configuration within the pool (a DNS label).
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    pub name: String,
    /// Served model name, as clients put it in the request's `model` field.
    #[schemars(length(min = 1, max = 256))]
    pub model: String,
    /// The engine serving this configuration: `vllm` (default), `sglang` or `trtllm`.
    #[serde(default)]
    pub engine: EngineKind,
    /// HTTP port of the engine's OpenAI-compatible server (rank 0 with `Port` selection).
    #[serde(default = "default_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: u16,
    /// Tokens per KV block in the engine (a power of two, 1-4096). Must match the engine.
    #[serde(default = "default_block_size")]
    #[schemars(
        range(min = 1, max = 4096),
        extend("enum" = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096])
    )]
    pub block_size: u32,
    /// Data-parallel ranks per pod and how a rank is addressed. Default: one rank.
    #[serde(default)]
    pub data_parallel: DataParallel,
    /// Where the engine publishes KV-cache events (precise cache tracking). Absent: the
    /// picker tracks cache contents approximately from its own routing decisions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<KvEventsSpec>,
    /// Tokenizer of the model. Absent: prompts are hashed in fixed-size character chunks,
    /// which still finds shared prefixes but cannot match the engine's own blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<TokenizerSpec>,
    /// LoRA adapters the engine serves; requests may name one in `model`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(min = 1, max = 256)))]
    pub lora_adapters: Vec<String>,
    /// The subset of the pool's pods that run this configuration (labels they must carry in
    /// addition to the pool selector).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 32))]
    pub pod_selector: BTreeMap<String, String>,
    /// KV capacity per rank in blocks, when the engine does not report it in its metrics;
    /// bounds the approximate index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub kv_capacity_blocks: Option<u64>,
    /// What loading a prefix back from a tier below the GPU costs (vLLM's KV offloading,
    /// SGLang's HiCache), when the engine reports such tiers in its KV events. Absent: the
    /// defaults documented on each field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_offload: Option<KvOffloadSpec>,
    /// Milliseconds to load a LoRA adapter the engine is not running (vLLM reports the
    /// running ones in `vllm:lora_requests_info`); the cost model adds it for a request naming
    /// that adapter. Default 50.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 600_000))]
    pub lora_load_ms: Option<u32>,
    /// Milliseconds a request for an adapter that is not running waits when each of the
    /// engine's `max_lora` slots holds an adapter with running requests (it cannot be loaded
    /// until one finishes); added to `loraLoadMs`. Default 2000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 600_000))]
    pub lora_slot_wait_ms: Option<u32>,
}

/// The cost of a cache hit in a tier below the GPU: the cost model charges the time to load
/// the blocks back (`kvBytesPerToken` over the tier's bandwidth) instead of prefilling them;
/// the weighted and KV-cost policies count each such block as `creditWeight` of a GPU block.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KvOffloadSpec {
    /// KV-cache bytes per token over all layers (K and V). Default 131072: a Llama-3-8B-class
    /// model in 16-bit (32 layers x 8 KV heads x 128 dims x 2 x 2 bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1_073_741_824))]
    pub kv_bytes_per_token: Option<u64>,
    /// Host memory (`medium: CPU`). Defaults: 25 GB/s (PCIe 4.0 x16 from pinned memory),
    /// credit weight 0.75.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<TierCostSpec>,
    /// Local disk or object storage (`medium: STORAGE`). Defaults: 3 GB/s (one NVMe drive),
    /// credit weight 0.25.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage: Option<TierCostSpec>,
    /// A remote or shared tier (`locality: REMOTE`, a secondary tier's `ownership`). Defaults:
    /// 12.5 GB/s (a 100 Gb/s RDMA link), credit weight 0.5.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<TierCostSpec>,
}

/// One tier's load bandwidth and credit weight.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TierCostSpec {
    /// Bandwidth of loading KV blocks back into the GPU, in GB/s (10^9 bytes per second).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.001, max = 100_000.0))]
    pub bandwidth_gbps: Option<f64>,
    /// A block held in this tier counts as this fraction of a GPU-resident block (0-1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub credit_weight: Option<f64>,
}

impl KvOffloadSpec {
    /// Refuses values the schema's ranges refuse; errors name the field.
    fn validate(&self, at: &dyn Fn(&str) -> String) -> Result<(), String> {
        if let Some(b) = self.kv_bytes_per_token
            && !(1..=1 << 30).contains(&b)
        {
            return Err(format!(
                "{} must be 1-1073741824, got {b}",
                at("kvOffload.kvBytesPerToken")
            ));
        }
        for (name, t) in [
            ("cpu", &self.cpu),
            ("storage", &self.storage),
            ("remote", &self.remote),
        ] {
            let Some(t) = t else { continue };
            if let Some(b) = t.bandwidth_gbps
                && !(b.is_finite() && (0.001..=100_000.0).contains(&b))
            {
                return Err(format!(
                    "{} must be between 0.001 and 100000 (GB/s), got {b}",
                    at(&format!("kvOffload.{name}.bandwidthGbps"))
                ));
            }
            if let Some(w) = t.credit_weight
                && !(w.is_finite() && (0.0..=1.0).contains(&w))
            {
                return Err(format!(
                    "{} must be between 0 and 1, got {w}",
                    at(&format!("kvOffload.{name}.creditWeight"))
                ));
            }
        }
        Ok(())
    }
}

fn default_port() -> u16 {
    8000
}

fn default_block_size() -> u32 {
    16
}

impl ModelConfigSpec {
    /// Validate what the schema cannot; errors name the field (`modelConfigs[i].field`).
    pub fn validate(&self, i: usize) -> Result<(), String> {
        let at = |f: &str| format!("modelConfigs[{i}].{f}");
        let dns = |s: &str| {
            !s.is_empty()
                && s.len() <= 63
                && s.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !s.starts_with('-')
                && !s.ends_with('-')
        };
        if !dns(&self.name) {
            return Err(format!(
                "{} must be a DNS label (lowercase letters, digits, '-'), got {:?}",
                at("name"),
                self.name
            ));
        }
        if self.model.is_empty() {
            return Err(format!("{} must not be empty", at("model")));
        }
        if let Some(o) = &self.kv_offload {
            o.validate(&at)?;
        }
        for (field, v) in [
            ("loraLoadMs", self.lora_load_ms),
            ("loraSlotWaitMs", self.lora_slot_wait_ms),
        ] {
            if let Some(v) = v
                && v > 600_000
            {
                return Err(format!("{} must be at most 600000, got {v}", at(field)));
            }
        }
        if self.port == 0 {
            return Err(format!("{} must be 1-65535", at("port")));
        }
        if !self.block_size.is_power_of_two() || self.block_size > 4096 {
            return Err(format!(
                "{} must be a power of two between 1 and 4096, got {}",
                at("blockSize"),
                self.block_size
            ));
        }
        if !(1..=1024).contains(&self.data_parallel.size) {
            return Err(format!(
                "{} must be 1-1024, got {}",
                at("dataParallel.size"),
                self.data_parallel.size
            ));
        }
        if self.data_parallel.rank_selection == RankSelection::Port
            && u32::from(self.port) + self.data_parallel.size - 1 > 65535
        {
            return Err(format!(
                "{}: port + size - 1 exceeds 65535",
                at("dataParallel")
            ));
        }
        if let Some(ev) = &self.kv_events
            && u32::from(ev.port) + self.data_parallel.size - 1 > 65535
        {
            return Err(format!(
                "{}: port + DP size - 1 exceeds 65535",
                at("kvEvents")
            ));
        }
        if self
            .lora_adapters
            .iter()
            .any(|a| a.is_empty() || *a == self.model)
        {
            return Err(format!(
                "{} must be non-empty names different from the base model",
                at("loraAdapters")
            ));
        }
        Ok(())
    }

    /// `(port, rank)` of every data-parallel rank of one pod: header-selected ranks share
    /// the port, port-selected ranks use `port + rank`.
    pub fn rank_ports(&self) -> Vec<(u16, u32)> {
        (0..self.data_parallel.size)
            .map(|rank| {
                let port = match self.data_parallel.rank_selection {
                    RankSelection::Header => self.port,
                    RankSelection::Port => self.port.saturating_add(rank as u16),
                };
                (port, rank)
            })
            .collect()
    }

    /// The KV event publisher port of an endpoint's rank.
    pub fn kv_events_port(&self, rank: u32) -> Option<u16> {
        self.kv_events
            .as_ref()
            .map(|e| e.port.saturating_add(rank as u16))
    }
}

/// How tenants are kept apart: `None`, `SaltedCache` or `DedicatedEndpoints`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, JsonSchema)]
pub enum Isolation {
    /// Tenants share endpoints and prefix caches.
    #[default]
    None,
    /// Tenants share endpoints, but block keys are salted per tenant and the engine gets a
    /// `cache_salt`, so no tenant gets prefix credit for (or timing about) another's prompts.
    SaltedCache,
    /// Each tenant has its own endpoints (pods matching its selector); requests never leave
    /// them, even on failure.
    DedicatedEndpoints,
}

/// A tenant with dedicated endpoints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TenantSpec {
    /// The tenant's name as it appears in the tenant header.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Labels of the pods this tenant may use (in addition to the pool and model-config
    /// selectors).
    #[schemars(extend("maxProperties" = 32))]
    pub pod_selector: BTreeMap<String, String>,
}

/// Multi-tenancy of a pool. A cache hit is an optimization, not an authorization decision:
/// with isolation on, a request only reaches endpoints its tenant may use and never gets
/// credit for another tenant's cached prompt.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "!has(self.isolation) || self.isolation == 'None' || (has(self.header) && size(self.header) > 0)",
        "message": "tenancy.header is required unless tenancy.isolation is None"
    },
    {
        "rule": "!has(self.isolation) || self.isolation != 'DedicatedEndpoints' || (has(self.tenants) && size(self.tenants) > 0)",
        "message": "tenancy.tenants must list at least one tenant for DedicatedEndpoints isolation"
    }
]))]
pub struct TenancySpec {
    /// `None` (default): tenants share endpoints and caches. `SaltedCache`: shared endpoints,
    /// per-tenant cache salts. `DedicatedEndpoints`: each tenant only uses its own pods.
    pub isolation: Isolation,
    /// Request header naming the tenant, set by the gateway that authenticated the caller.
    /// Required unless `isolation` is `None`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 256))]
    pub header: Option<String>,
    /// Tenant of requests without the header; absent = such requests are rejected (when
    /// isolation is on).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub default_tenant: Option<String>,
    /// File holding the secret that keys tenants' cache salts (HMAC). In a cluster, leave it
    /// unset and name a Secret in `spec.picker.saltSecretRef`: the operator mounts it and
    /// points the picker at it.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 4096))]
    pub salt_secret_file: Option<String>,
    /// Tenants and the pods each may use (`DedicatedEndpoints`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = 256),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"])
    )]
    pub tenants: Vec<TenantSpec>,
}

impl TenancySpec {
    pub fn validate(&self) -> Result<(), String> {
        if self.isolation != Isolation::None && self.header.as_deref().is_none_or(str::is_empty) {
            return Err("tenancy.header is required when tenancy.isolation is not None".into());
        }
        if self.isolation == Isolation::SaltedCache && self.salt_secret_file.is_none() {
            return Err("tenancy.saltSecretFile is required for SaltedCache isolation".into());
        }
        if self.isolation == Isolation::DedicatedEndpoints && self.tenants.is_empty() {
            return Err(
                "tenancy.tenants must list at least one tenant for DedicatedEndpoints".into(),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> ModelConfigSpec {
        serde_json::from_str(r#"{"name":"llama","model":"meta-llama/Llama-3.1-8B"}"#)
            .expect("minimal spec")
    }

    #[test]
    fn defaults_and_validation() {
        let s = spec();
        assert_eq!((s.port, s.block_size, s.data_parallel.size), (8000, 16, 1));
        s.validate(0).expect("valid");
        let mut bad = spec();
        bad.block_size = 24;
        assert!(
            bad.validate(2)
                .expect_err("pow2")
                .starts_with("modelConfigs[2].blockSize")
        );
        let mut bad = spec();
        bad.data_parallel.size = 0;
        assert!(
            bad.validate(0)
                .expect_err("dp")
                .contains("dataParallel.size")
        );
        let mut bad = spec();
        bad.name = "Llama_3".into();
        assert!(
            bad.validate(0)
                .expect_err("dns")
                .contains("modelConfigs[0].name")
        );
    }

    #[test]
    fn kv_offload_prices_tiers_and_refuses_bad_values_by_field() {
        use crate::endpoint::{ModelConfig, OffloadCosts};
        use crate::index::TierBlocks;
        let s: ModelConfigSpec = serde_json::from_str(
            r#"{"name":"a","model":"m","kvOffload":{"kvBytesPerToken":1000,"cpu":{"bandwidthGbps":1.0,"creditWeight":0.5}}}"#,
        )
        .expect("spec");
        s.validate(0).expect("valid");
        let costs = ModelConfig::from(&s).offload;
        let four_cpu = TierBlocks {
            cpu: 4,
            ..TierBlocks::default()
        };
        // 4 blocks × 16 tokens × 1000 bytes at 1 GB/s (10^6 bytes per ms)
        assert!((costs.load_ms(&four_cpu, 16) - 0.064).abs() < 1e-9);
        assert!((costs.credit_blocks(&four_cpu) - 2.0).abs() < 1e-9);
        // the storage tier keeps its defaults: 3 GB/s, weight 0.25
        let one_storage = TierBlocks {
            storage: 1,
            ..TierBlocks::default()
        };
        assert!((costs.credit_blocks(&one_storage) - 0.25).abs() < 1e-9);
        assert_eq!(OffloadCosts::default().kv_bytes_per_token, 131_072);
        for (json, field) in [
            (r#"{"kvBytesPerToken":0}"#, "kvOffload.kvBytesPerToken"),
            (
                r#"{"cpu":{"bandwidthGbps":0}}"#,
                "kvOffload.cpu.bandwidthGbps",
            ),
            (
                r#"{"storage":{"creditWeight":1.5}}"#,
                "kvOffload.storage.creditWeight",
            ),
        ] {
            let mut bad = spec();
            bad.kv_offload = Some(serde_json::from_str(json).expect("offload"));
            let e = bad.validate(1).expect_err(json);
            assert!(e.starts_with(&format!("modelConfigs[1].{field}")), "{e}");
        }
    }

    #[test]
    fn ranks_expand_by_header_or_port() {
        let mut s = spec();
        s.data_parallel = DataParallel {
            size: 3,
            rank_selection: RankSelection::Header,
        };
        assert_eq!(s.rank_ports(), [(8000, 0), (8000, 1), (8000, 2)]);
        s.data_parallel.rank_selection = RankSelection::Port;
        let ports = s.rank_ports();
        assert_eq!(ports, [(8000, 0), (8001, 1), (8002, 2)]);
    }

    #[test]
    fn unknown_fields_are_rejected_with_their_name() {
        let e =
            serde_json::from_str::<ModelConfigSpec>(r#"{"name":"a","model":"m","blocksize":16}"#)
                .expect_err("typo");
        assert!(e.to_string().contains("blocksize"), "{e}");
    }

    #[test]
    fn tenancy_requires_its_pieces() {
        let t = TenancySpec {
            isolation: Isolation::SaltedCache,
            header: Some("x-tenant".into()),
            ..TenancySpec::default()
        };
        assert!(t.validate().expect_err("secret").contains("saltSecretFile"));
        TenancySpec::default().validate().expect("none is fine");
    }
}
