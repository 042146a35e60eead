//! The `KVRoutePool` custom resource (`kvroute.dev/v1alpha1`, short name `kvpool`).
//!
//! Its spec reuses the picker's own config types ([`ModelConfigSpec`], [`RoutingConfig`],
//! [`TenancySpec`]), so what users write in the resource is exactly what the pickers run.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use k8s_openapi::api::core::v1::ResourceRequirements;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::contract;
use crate::gateway_pool::GatewayInferencePoolSpec;
use crate::pool::{Isolation, ModelConfigSpec, TenancySpec};
use crate::routing::{FailureMode, RoutingConfig};

/// The desired state of an KVRoutePool: its model-server pods (selector and model configs),
/// the routing policy, tenancy, and the picker Deployment.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "kvroute.dev",
    version = "v1alpha1",
    kind = "KVRoutePool",
    plural = "kvroutepools",
    shortname = "kvpool",
    category = "kvroute",
    namespaced,
    status = "KVRoutePoolStatus",
    derive = "PartialEq",
    doc = "An KVRoutePool: the model-server pods of one or more model configurations, the routing policy the pool's pickers apply to them, and the pickers themselves. The operator reconciles the pods and their data-parallel ranks into EndpointSlices (the eligibility sets), runs a picker Deployment and Service for the pool, and reports what it sees in status. Short name: kvpool.",
    printcolumn = r#"{"name":"Ready","type":"string","description":"Whether the pool serves: config valid, endpoints resolved, picker available","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Endpoints","type":"integer","description":"Eligible (pod, data-parallel rank) endpoints","jsonPath":".status.readyEndpoints"}"#,
    printcolumn = r#"{"name":"Strategy","type":"string","description":"Routing strategy","jsonPath":".spec.routing.strategy"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    validation = kube::core::Rule::new("self.metadata.name.size() <= 56").message("metadata.name must be at most 56 characters: the picker Service is named <name>-picker"),
    validation = kube::core::Rule::new("self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')").message("metadata.name must be a DNS label starting with a letter: it names the picker Service")
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "!has(self.tenancy) || !has(self.tenancy.isolation) || self.tenancy.isolation != 'SaltedCache' || has(self.tenancy.saltSecretFile) || (has(self.picker) && has(self.picker.saltSecretRef))",
        "message": "SaltedCache isolation needs a salt secret: set picker.saltSecretRef (or tenancy.saltSecretFile)"
    },
    {
        "rule": "has(self.selector) != has(self.inferencePoolRef)",
        "message": "set exactly one of selector and inferencePoolRef"
    },
    {
        "rule": "!has(self.inferencePoolRef) || !has(self.gateway) || !has(self.gateway.exportInferencePool) || !self.gateway.exportInferencePool",
        "message": "gateway.exportInferencePool creates Gateway API InferencePools; inferencePoolRef serves an existing one: set one of them"
    },
    {
        "rule": "!has(self.gateway) || !has(self.gateway.exportInferencePool) || !self.gateway.exportInferencePool || self.modelConfigs.all(m, !has(m.dataParallel) || !has(m.dataParallel.rankSelection) || m.dataParallel.rankSelection != 'Port' || !has(m.dataParallel.size) || m.dataParallel.size <= 8)",
        "message": "gateway.exportInferencePool: a Gateway API InferencePool lists at most 8 target ports, so Port rank selection is limited to dataParallel.size <= 8"
    }
]))]
pub struct KVRoutePoolSpec {
    /// Labels selecting the pool's model-server pods, in the pool's namespace. Set this or
    /// `inferencePoolRef`, not both.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<PoolSelector>,
    /// A Gateway API Inference Extension InferencePool (`inference.networking.k8s.io/v1`) in
    /// this namespace that this resource configures, instead of `selector`: its selector picks
    /// the pods and its target ports are the endpoints (one data-parallel rank per port; the
    /// ports must be consecutive; `appProtocol` `http`), while model configs and routing come
    /// from here. kvroute
    /// runs the picker for it and reports in the InferencePool's `status.parents` under its
    /// own entry (parentRef kind `KVRoutePool`). Point the InferencePool's
    /// `endpointPickerRef` at this pool's picker Service (`<name>-picker`, port 9002).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inference_pool_ref: Option<InferencePoolRef>,
    /// The model configurations the pool serves (1-32, names unique). A request's `model`
    /// field selects one (or one of its LoRA adapters).
    #[schemars(
        length(min = 1, max = 32),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"])
    )]
    pub model_configs: Vec<ModelConfigSpec>,
    /// The routing policy. Pickers apply edits live, without a restart.
    #[serde(default)]
    pub routing: RoutingConfig,
    /// Multi-tenancy: who may use which endpoints, and whether caches are salted per tenant.
    #[serde(default)]
    pub tenancy: TenancySpec,
    /// The picker Deployment the operator runs for this pool.
    #[serde(default)]
    pub picker: PickerSpec,
    /// Integration with the Gateway API Inference Extension.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<GatewaySpec>,
}

/// A Gateway API InferencePool in the same namespace, by name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolRef {
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
    )]
    pub name: String,
}

/// Pods selected by labels (all must match).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolSelector {
    /// Labels the pool's pods carry (at least one).
    #[schemars(extend("minProperties" = 1, "maxProperties" = 32))]
    pub match_labels: BTreeMap<String, String>,
}

impl PoolSelector {
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        labels_match(&self.match_labels, labels)
    }
}

/// Whether `labels` carry every `key: value` of `selector`.
pub fn labels_match(
    selector: &BTreeMap<String, String>,
    labels: &BTreeMap<String, String>,
) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// When the kubelet pulls the picker image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum PullPolicy {
    /// Pull on every pod start.
    Always,
    /// Pull when the node lacks the image.
    IfNotPresent,
    /// Never pull; the image must be on the node.
    Never,
}

impl PullPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Always => "Always",
            Self::IfNotPresent => "IfNotPresent",
            Self::Never => "Never",
        }
    }
}

/// A key of a Secret in the pool's namespace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    /// Name of the Secret.
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
    )]
    pub name: String,
    /// Key within the Secret. Default `salt`.
    #[serde(default = "default_salt_key")]
    #[schemars(length(min = 1, max = 253), regex(pattern = r"^[-._a-zA-Z0-9]+$"))]
    pub key: String,
}

fn default_salt_key() -> String {
    contract::SALT_FILE.to_owned()
}

/// The picker Deployment of a pool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct PickerSpec {
    /// Picker replicas (0-64). Each replica routes independently from the same inputs, with
    /// deterministic tie-breaks. 0 runs no in-cluster picker (pickers run elsewhere, e.g.
    /// `kvroute-picker --pool NAME --namespace NS` outside the cluster); `Ready` then does not
    /// wait for one.
    #[schemars(range(min = 0, max = 64))]
    pub replicas: i32,
    /// Picker container image. Default: the operator's `--picker-image`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    pub image: Option<String>,
    /// `Always`, `IfNotPresent` or `Never`. Default: Kubernetes' default for the image tag.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<PullPolicy>,
    /// CPU and memory of the picker container (default: the operator's, which the chart sets
    /// from its sizing rule). Measured per picker (docs/helm.md, "Sizing the pickers"): 300 MiB
    /// and 0.1 core, plus per 100 endpoints with full caches (31k blocks) and busy event
    /// streams about 250 MiB and 0.1 core, plus per 100 requests/s 0.1-0.15 core at 8k-32k
    /// tokens as token ids or 8k of text, 0.4 at 32k tokens of text and 2 at 128k (each
    /// prompt a tenth new).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Run pickers under this existing ServiceAccount instead of the per-pool one the
    /// operator creates (with read-only access to this pool and its EndpointSlices).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
    )]
    pub service_account_name: Option<String>,
    /// Secret holding the key of tenants' cache salts (`SaltedCache` isolation), at least 16
    /// bytes. The operator mounts it into the pickers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub salt_secret_ref: Option<SecretKeyRef>,
    /// Log filter of the pickers (`RUST_LOG` syntax), e.g. `info` or `kvroute_picker=debug`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256))]
    pub log_level: Option<String>,
}

impl Default for PickerSpec {
    fn default() -> Self {
        Self {
            replicas: 1,
            image: None,
            image_pull_policy: None,
            resources: None,
            service_account_name: None,
            salt_secret_ref: None,
            log_level: None,
        }
    }
}

/// Export to the Gateway API Inference Extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", default)]
pub struct GatewaySpec {
    /// Create an `inference.networking.k8s.io/v1` InferencePool per model config (named
    /// `<pool>-<modelConfig>`) whose `endpointPickerRef` is this pool's picker Service, so any
    /// conformant gateway (Envoy Gateway, kgateway, Istio, agentgateway) routes through
    /// kvroute. Reported in the `GatewayExported` condition; skipped while that CRD is not
    /// installed.
    pub export_inference_pool: bool,
    /// What the gateway does when the picker does not answer: `FailClose` (default) or
    /// `FailOpen`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failure_mode: Option<FailureMode>,
}

/// What the operator sees. Written only when it changes.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KVRoutePoolStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, `ConfigValid`, `EndpointsResolved`, `PickerAvailable`, and `GatewayExported`
    /// when an export is requested.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// Eligible (pod, data-parallel rank) endpoints over all model configs.
    #[serde(default)]
    pub ready_endpoints: u32,
    /// Per model config: eligible pods and ranks, ineligible pods and why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub model_configs: Vec<ModelConfigStatus>,
    /// The pool's picker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub picker: Option<PickerStatus>,
}

impl KVRoutePoolStatus {
    pub fn condition(&self, type_: &str) -> Option<&Condition> {
        self.conditions.iter().find(|c| c.type_ == type_)
    }
}

/// Condition types of [`KVRoutePoolStatus::conditions`].
pub mod condition {
    /// Config valid, every model config has eligible endpoints, and a picker is available.
    pub const READY: &str = "Ready";
    /// The spec passed validation (the schema's and the operator's own checks).
    pub const CONFIG_VALID: &str = "ConfigValid";
    /// Every model config has at least one eligible endpoint.
    pub const ENDPOINTS_RESOLVED: &str = "EndpointsResolved";
    /// At least one picker replica is available.
    pub const PICKER_AVAILABLE: &str = "PickerAvailable";
    /// The Gateway API Inference Extension InferencePools exist (when requested).
    pub const GATEWAY_EXPORTED: &str = "GatewayExported";
}

/// At most this many ineligible pods are listed per model config (all are counted).
pub const MAX_LISTED_INELIGIBLE: usize = 32;

/// Endpoints of one model config.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelConfigStatus {
    /// The model config's name.
    pub name: String,
    /// Pods that are ready, not terminating, have an IP and declare a compatible config.
    pub eligible_pods: u32,
    /// Routable (pod, rank) endpoints: eligible pods times the data-parallel size.
    pub eligible_ranks: u32,
    /// Eligible pods by their role under prefill/decode disaggregation (the
    /// `kvroute.dev/role` or `llm-d.ai/role` label; unlabelled pods are `both`).
    #[serde(default)]
    pub eligible_pods_by_role: RoleCounts,
    /// Pods selected for this config that are not eligible.
    pub ineligible_pods: u32,
    /// Up to 32 ineligible pods, by name, with the reason.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = 32),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["pod"])
    )]
    pub ineligible: Vec<IneligiblePod>,
    /// The EndpointSlices listing this config's endpoints.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub endpoint_slices: Vec<String>,
}

/// Pods by role under prefill/decode disaggregation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RoleCounts {
    /// Pods that only prefill split requests.
    pub prefill: u32,
    /// Pods that decode split requests and run whole ones.
    pub decode: u32,
    /// Pods without a split role: whole requests and decodes.
    pub both: u32,
}

impl RoleCounts {
    /// Count one pod of `role`.
    pub fn count(&mut self, role: kvroute_routing::endpoint::Role) {
        use kvroute_routing::endpoint::Role;
        let n = match role {
            Role::Prefill => &mut self.prefill,
            Role::Decode => &mut self.decode,
            Role::Both => &mut self.both,
        };
        *n = n.saturating_add(1);
    }
}

/// A pod that does not serve a model config, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IneligiblePod {
    /// Pod name.
    pub pod: String,
    pub reason: IneligibleReason,
    /// Details, e.g. the mismatching values.
    pub message: String,
}

/// Why a pod is not eligible.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
pub enum IneligibleReason {
    /// The pod's Ready condition is not True.
    NotReady,
    /// The pod is being deleted.
    Terminating,
    /// The pod has no IP yet.
    NoAddress,
    /// `kvroute.dev/model` differs from the config's model.
    ModelMismatch,
    /// `kvroute.dev/engine` differs from the config's engine.
    EngineMismatch,
    /// `kvroute.dev/dp-size` differs from the config's data-parallel size.
    DataParallelMismatch,
    /// `kvroute.dev/block-size` differs from the config's block size.
    BlockSizeMismatch,
    /// A `kvroute.dev/*` declaration cannot be parsed.
    InvalidDeclaration,
}

impl IneligibleReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NotReady => "NotReady",
            Self::Terminating => "Terminating",
            Self::NoAddress => "NoAddress",
            Self::ModelMismatch => "ModelMismatch",
            Self::EngineMismatch => "EngineMismatch",
            Self::DataParallelMismatch => "DataParallelMismatch",
            Self::BlockSizeMismatch => "BlockSizeMismatch",
            Self::InvalidDeclaration => "InvalidDeclaration",
        }
    }

    /// A configuration error (as opposed to a lifecycle state that resolves by itself):
    /// reported with a Warning Event.
    pub fn is_misconfiguration(self) -> bool {
        matches!(
            self,
            Self::ModelMismatch
                | Self::EngineMismatch
                | Self::DataParallelMismatch
                | Self::BlockSizeMismatch
                | Self::InvalidDeclaration
        )
    }
}

/// The pool's picker.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PickerStatus {
    /// The picker Service: OpenAI-compatible HTTP on 8080, ext_proc gRPC on 9002, metrics on
    /// 9090.
    pub service: String,
    pub replicas: i32,
    pub available_replicas: i32,
}

impl KVRoutePoolSpec {
    /// Everything the schema checks plus what it cannot (the picker's own validation), so a
    /// pool admitted by an older CRD still gets a clear `ConfigValid=False`. Errors name the
    /// field.
    pub fn validate(&self, pool_name: &str) -> Result<(), String> {
        if pool_name.len() > contract::MAX_POOL_NAME_LEN
            || !pool_name.starts_with(|c: char| c.is_ascii_lowercase())
            || pool_name.ends_with('-')
            || !pool_name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        {
            return Err(format!(
                "metadata.name {pool_name:?} must be a DNS label of at most {} characters starting with a letter",
                contract::MAX_POOL_NAME_LEN
            ));
        }
        match (&self.selector, &self.inference_pool_ref) {
            (Some(sel), None) if sel.match_labels.is_empty() => {
                return Err("selector.matchLabels must name at least one label".into());
            }
            (Some(_), None) => {}
            (None, Some(r)) if r.name.is_empty() => {
                return Err("inferencePoolRef.name must not be empty".into());
            }
            (None, Some(_)) => {
                if self.gateway.is_some_and(|g| g.export_inference_pool) {
                    return Err("gateway.exportInferencePool creates Gateway API InferencePools; inferencePoolRef serves an existing one: set one of them".into());
                }
            }
            _ => return Err("set exactly one of selector and inferencePoolRef".into()),
        }
        if self.model_configs.is_empty() {
            return Err("modelConfigs must list at least one model config".into());
        }
        let mut names = BTreeSet::new();
        for (i, mc) in self.model_configs.iter().enumerate() {
            mc.validate(i)?;
            if !names.insert(mc.name.as_str()) {
                return Err(format!(
                    "modelConfigs[{i}].name {:?} is duplicated",
                    mc.name
                ));
            }
        }
        self.routing.validate()?;
        self.routing.check_rewrite_targets(&self.model_configs)?;
        let mut tenancy = self.tenancy.clone();
        if tenancy.salt_secret_file.is_none() && self.picker.salt_secret_ref.is_some() {
            tenancy.salt_secret_file = Some(String::new());
        }
        if self.tenancy.isolation == Isolation::SaltedCache
            && self.tenancy.salt_secret_file.is_none()
            && self.picker.salt_secret_ref.is_none()
        {
            return Err(
                "SaltedCache isolation needs a salt secret: set picker.saltSecretRef".into(),
            );
        }
        tenancy.validate()?;
        if !(0..=64).contains(&self.picker.replicas) {
            return Err(format!(
                "picker.replicas must be 0-64, got {}",
                self.picker.replicas
            ));
        }
        if self.gateway.is_some_and(|g| g.export_inference_pool) {
            for (i, mc) in self.model_configs.iter().enumerate() {
                if mc.data_parallel.rank_selection == crate::pool::RankSelection::Port
                    && mc.data_parallel.size > 8
                {
                    return Err(format!(
                        "modelConfigs[{i}]: a Gateway API InferencePool lists at most 8 target ports, so gateway.exportInferencePool needs dataParallel.size <= 8 with Port rank selection"
                    ));
                }
            }
        }
        Ok(())
    }

    /// The pod labels the pool selects (empty until a referenced InferencePool resolved it).
    pub fn selector_labels(&self) -> &BTreeMap<String, String> {
        static NONE: BTreeMap<String, String> = BTreeMap::new();
        self.selector.as_ref().map_or(&NONE, |s| &s.match_labels)
    }

    /// The spec with a referenced Gateway API InferencePool's selector and ports in place: its
    /// `matchLabels` become the selector (its `appProtocol` must be HTTP/1.1, the default:
    /// the picker speaks the engines' OpenAI HTTP API); one target port becomes each model config's port
    /// (its data-parallel ranks as declared); several, which must be consecutive, become ranks
    /// by port (`port` the first, `dataParallel.size` their count, `rankSelection: Port`). A
    /// model config that declares another layout is an error naming it.
    pub fn resolve(&self, gateway: &GatewayInferencePoolSpec) -> Result<Self, String> {
        let mut out = self.clone();
        if gateway.selector.match_labels.is_empty() {
            return Err("the referenced InferencePool's selector.matchLabels is empty".into());
        }
        if gateway.app_protocol == Some(crate::gateway_pool::AppProtocol::H2c) {
            return Err("the referenced InferencePool's appProtocol is kubernetes.io/h2c (gRPC model servers): kvroute's picker speaks the engines' HTTP/1.1 OpenAI API".into());
        }
        out.selector = Some(PoolSelector {
            match_labels: gateway.selector.match_labels.clone(),
        });
        let mut ports: Vec<i32> = gateway.target_ports.iter().map(|p| p.number).collect();
        ports.sort_unstable();
        let first = ports
            .first()
            .and_then(|p| u16::try_from(*p).ok())
            .ok_or("the referenced InferencePool lists no valid target port")?;
        if ports.windows(2).any(|w| w[1] != w[0] + 1) {
            return Err(format!(
                "the referenced InferencePool's targetPorts {ports:?} are not consecutive: kvroute addresses data-parallel rank k at the first port + k"
            ));
        }
        let n = u32::try_from(ports.len()).unwrap_or(u32::MAX);
        for (i, mc) in out.model_configs.iter_mut().enumerate() {
            mc.port = first;
            if n == 1 {
                continue;
            }
            let dp = &mut mc.data_parallel;
            if dp.size > 1
                && (dp.size != n || dp.rank_selection != crate::pool::RankSelection::Port)
            {
                return Err(format!(
                    "modelConfigs[{i}].dataParallel: the referenced InferencePool has {n} target ports, a rank per port, so dataParallel must be size {n} with rankSelection Port (or left out)"
                ));
            }
            dp.size = n;
            dp.rank_selection = crate::pool::RankSelection::Port;
        }
        Ok(out)
    }

    /// The model configs and tenancy as a picker in the cluster runs them: tokenizer
    /// ConfigMaps become files under `tokenizer_root` (`tokenizer_config.json` only where
    /// `exists` says it is there), and a `picker.saltSecretRef` becomes the salt file under
    /// `salt_dir`.
    pub fn for_picker(
        &self,
        tokenizer_root: &Path,
        salt_dir: &Path,
        exists: &dyn Fn(&Path) -> bool,
    ) -> (Vec<ModelConfigSpec>, TenancySpec) {
        let model_configs = self
            .model_configs
            .iter()
            .map(|mc| {
                let mut mc = mc.clone();
                if let Some(t) = mc.tokenizer.as_mut()
                    && let Some(cm) = t.config_map.as_deref()
                {
                    let dir = contract::tokenizer_dir(tokenizer_root, cm);
                    if t.path.is_none() {
                        t.path = Some(dir.join(contract::TOKENIZER_JSON).display().to_string());
                    }
                    let cfg = dir.join(contract::TOKENIZER_CONFIG_JSON);
                    if t.config_path.is_none() && exists(&cfg) {
                        t.config_path = Some(cfg.display().to_string());
                    }
                }
                mc
            })
            .collect();
        let mut tenancy = self.tenancy.clone();
        if tenancy.salt_secret_file.is_none() && self.picker.salt_secret_ref.is_some() {
            tenancy.salt_secret_file =
                Some(salt_dir.join(contract::SALT_FILE).display().to_string());
        }
        (model_configs, tenancy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(extra: serde_json::Value) -> KVRoutePoolSpec {
        let mut v = json!({
            "selector": {"matchLabels": {"app": "vllm"}},
            "modelConfigs": [{"name": "llama", "model": "m", "tokenizer": {"configMap": "tok"}}]
        });
        if let (Some(obj), Some(extra)) = (v.as_object_mut(), extra.as_object()) {
            obj.extend(extra.clone());
        }
        serde_json::from_value(v).expect("spec")
    }

    #[test]
    fn validation_mirrors_the_schema() {
        spec(json!({})).validate("llama").expect("valid");
        let e = spec(json!({})).validate("Llama").expect_err("name");
        assert!(e.contains("metadata.name"), "{e}");
        let e = spec(json!({})).validate(&"a".repeat(57)).expect_err("long");
        assert!(e.contains("56"), "{e}");
        let e = spec(json!({"selector": {"matchLabels": {}}}))
            .validate("llama")
            .expect_err("selector");
        assert!(e.contains("selector.matchLabels"), "{e}");
        let e = spec(
            json!({"modelConfigs": [{"name": "a", "model": "m"}, {"name": "a", "model": "n"}]}),
        )
        .validate("llama")
        .expect_err("dup");
        assert!(e.contains("duplicated"), "{e}");
        let e = spec(json!({"tenancy": {"isolation": "SaltedCache", "header": "x-t"}}))
            .validate("llama")
            .expect_err("salt");
        assert!(e.contains("saltSecretRef"), "{e}");
        spec(json!({
            "tenancy": {"isolation": "SaltedCache", "header": "x-t"},
            "picker": {"saltSecretRef": {"name": "s"}}
        }))
        .validate("llama")
        .expect("salt from a secret");
        let e = spec(json!({
            "gateway": {"exportInferencePool": true},
            "modelConfigs": [{"name": "a", "model": "m", "dataParallel": {"size": 9, "rankSelection": "Port"}}]
        }))
        .validate("llama")
        .expect_err("gateway ports");
        assert!(e.contains("at most 8"), "{e}");
    }

    #[test]
    fn picker_paths_come_from_the_mounts() {
        let s = spec(json!({"picker": {"saltSecretRef": {"name": "s"}}}));
        let (mcs, tenancy) = s.for_picker(Path::new("/t"), Path::new("/s"), &|_| false);
        let t = mcs[0].tokenizer.as_ref().expect("tokenizer");
        assert_eq!(t.path.as_deref(), Some("/t/tok/tokenizer.json"));
        assert_eq!(t.config_path, None, "only when mounted");
        assert_eq!(tenancy.salt_secret_file.as_deref(), Some("/s/salt"));
        assert_eq!(s.picker.replicas, 1);
        assert_eq!(
            s.picker.salt_secret_ref.as_ref().map(|r| r.key.as_str()),
            Some("salt")
        );
    }

    #[test]
    fn a_referenced_gateway_pool_resolves_selector_and_ports() {
        use crate::gateway_pool::GatewayInferencePoolSpec;
        let gw = |ports: &[i32]| -> GatewayInferencePoolSpec {
            serde_json::from_value(json!({
                "selector": {"matchLabels": {"app": "vllm-llama"}},
                "targetPorts": ports.iter().map(|p| json!({"number": p})).collect::<Vec<_>>()
            }))
            .expect("gateway spec")
        };
        let r = spec(json!({"selector": null, "inferencePoolRef": {"name": "llama"}}));
        r.validate("llama")
            .expect("a reference instead of a selector");
        assert!(r.selector_labels().is_empty());
        // one port: the model configs' port, their ranks as declared
        let one = r.resolve(&gw(&[8080])).expect("resolves");
        assert_eq!(
            one.selector_labels().get("app").map(String::as_str),
            Some("vllm-llama")
        );
        assert_eq!(one.model_configs[0].port, 8080);
        assert_eq!(one.model_configs[0].data_parallel.size, 1);
        // several, in any order: a rank per port from the first
        let four = r.resolve(&gw(&[8003, 8001, 8000, 8002])).expect("resolves");
        let dp = &four.model_configs[0].data_parallel;
        assert_eq!((four.model_configs[0].port, dp.size), (8000, 4));
        assert_eq!(dp.rank_selection, crate::pool::RankSelection::Port);
        let e = r.resolve(&gw(&[8000, 8002])).expect_err("a gap");
        assert!(e.contains("not consecutive"), "{e}");
        let mut h2c = gw(&[8000]);
        h2c.app_protocol = Some(crate::gateway_pool::AppProtocol::H2c);
        let e = r.resolve(&h2c).expect_err("gRPC model servers");
        assert!(e.contains("appProtocol"), "{e}");
        let header = spec(json!({
            "selector": null, "inferencePoolRef": {"name": "llama"},
            "modelConfigs": [{"name": "a", "model": "m", "dataParallel": {"size": 2, "rankSelection": "Header"}}]
        }));
        let e = header
            .resolve(&gw(&[8000, 8001]))
            .expect_err("header ranks on two ports");
        assert!(e.contains("modelConfigs[0].dataParallel"), "{e}");

        for (extra, want) in [
            (
                json!({"inferencePoolRef": {"name": "llama"}}),
                "exactly one",
            ),
            (json!({"selector": null}), "exactly one"),
            (
                json!({"selector": null, "inferencePoolRef": {"name": "llama"}, "gateway": {"exportInferencePool": true}}),
                "set one of them",
            ),
        ] {
            let e = spec(extra.clone()).validate("llama").expect_err("invalid");
            assert!(e.contains(want), "{extra}: {e}");
        }
    }

    #[test]
    fn rewrite_targets_must_be_served_by_the_pool() {
        let ok = spec(json!({"routing": {"modelRewrites": [
            {"model": "chat", "targets": [{"model": "m", "weight": 1}]}
        ]}}));
        ok.validate("llama").expect("m is served");
        let bad = spec(json!({"routing": {"modelRewrites": [
            {"model": "chat", "targets": [{"model": "m", "weight": 1}, {"model": "nope", "weight": 1}]}
        ]}}));
        let e = bad.validate("llama").expect_err("nope is not served");
        assert!(
            e.contains("routing.modelRewrites[0].targets[1].model"),
            "{e}"
        );
    }
}
