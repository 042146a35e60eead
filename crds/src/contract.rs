//! The contract between the operator, the pickers it runs and the model-server pods: names,
//! labels, annotations, port names and mount paths. Both sides import them from here so they
//! cannot drift apart.
//!
//! # Pod labels and annotations (written by users on model-server pods)
//!
//! A pod may declare what it runs; when it does, the operator checks it against the model
//! config and reports a mismatch (ineligible pod, status reason, Event) instead of routing to a
//! server that would answer wrongly. Each key is read from the pod's annotations first, then
//! from its labels; an absent key means "not declared" and is not checked.
//!
//! | key | value | checked against |
//! |---|---|---|
//! | `kvroute.dev/model` | served model name (annotation: label values cannot hold `/`) | `modelConfigs[].model` |
//! | `kvroute.dev/engine` | `vllm`, `sglang`, `trtllm` | `modelConfigs[].engine` |
//! | `kvroute.dev/dp-size` | integer | `modelConfigs[].dataParallel.size` |
//! | `kvroute.dev/block-size` | integer | `modelConfigs[].blockSize` |
//!
//! # EndpointSlices (written by the operator, read by pickers)
//!
//! One or more `discovery.k8s.io/v1` EndpointSlices per (pool, model config), labelled
//! [`LABEL_POOL`] and [`LABEL_MODEL_CONFIG`]. Each endpoint is one pod (its IP, `nodeName`,
//! `targetRef`, and conditions `ready`/`serving`/`terminating` as Kubernetes defines them).
//! **Data-parallel ranks are encoded as named ports**: the slice lists one port per rank,
//! named `rank-<k>` ([`rank_port_name`]), whose number is the port that reaches rank `k` —
//! `port + k` with `Port` rank selection, the shared `port` with `Header` selection. So every
//! (endpoint, port) pair of a slice is one routable `(address, port, rank)` and a reader needs
//! nothing but the slice. A slice holds at most [`MAX_RANKS_PER_SLICE`] ports and
//! [`MAX_PODS_PER_SLICE`] endpoints (the API's limits); larger sets span several slices.
//!
//! Pods included: eligible ones (`ready: true`), plus compatible pods with an IP that are
//! not ready or terminating (`ready: false`), so pickers drain them instead of forgetting
//! what their caches hold when readiness flaps. Incompatible pods and pods without an IP
//! are never listed.
//!
//! Tenant selectors match pod labels, which EndpointSlices cannot carry per endpoint: when
//! `tenancy.tenants` name label keys, the slice's [`ANNOTATION_ENDPOINT_LABELS`] holds, per
//! pod name, just those keys' values (a JSON object of objects).

use std::path::{Path, PathBuf};

/// API group of kvroute's resources.
pub const GROUP: &str = "kvroute.dev";

/// The one field manager of everything the operator writes (server-side apply).
pub const FIELD_MANAGER: &str = "kvroute-operator";

/// `app.kubernetes.io/managed-by` value on everything the operator writes; its watches select
/// on it.
pub const MANAGED_BY: &str = "kvroute-operator";
pub const LABEL_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
pub const LABEL_NAME: &str = "app.kubernetes.io/name";
pub const LABEL_INSTANCE: &str = "app.kubernetes.io/instance";
pub const LABEL_COMPONENT: &str = "app.kubernetes.io/component";

/// The pool an owned object belongs to.
pub const LABEL_POOL: &str = "kvroute.dev/pool";
/// The model config an EndpointSlice lists endpoints for.
pub const LABEL_MODEL_CONFIG: &str = "kvroute.dev/model-config";

/// `endpointslice.kubernetes.io/managed-by`: tells Kubernetes' own EndpointSlice controllers
/// that these slices are not theirs.
pub const LABEL_SLICE_MANAGED_BY: &str = "endpointslice.kubernetes.io/managed-by";
pub const SLICE_MANAGED_BY: &str = "operator.kvroute.dev";

/// Per-pod projection of the labels tenant selectors read (see the module docs).
pub const ANNOTATION_ENDPOINT_LABELS: &str = "kvroute.dev/endpoint-labels";

/// Hash of what the operator last applied to an object; a change forces a re-apply even when
/// the live object still contains every desired field (so removed fields are removed).
pub const ANNOTATION_APPLIED_HASH: &str = "kvroute.dev/applied-hash";

/// Hash of the picker's static settings (the rendered config minus what pickers apply live),
/// on the picker pod template: a change rolls the pickers; a routing change does not.
pub const ANNOTATION_CONFIG_HASH: &str = "kvroute.dev/config-hash";

/// Pod declarations checked against the model config (see the module docs).
pub mod pod {
    pub const MODEL: &str = "kvroute.dev/model";
    pub const ENGINE: &str = "kvroute.dev/engine";
    pub const DP_SIZE: &str = "kvroute.dev/dp-size";
    pub const BLOCK_SIZE: &str = "kvroute.dev/block-size";
}

/// Kubernetes allows at most 100 ports per EndpointSlice.
pub const MAX_RANKS_PER_SLICE: u32 = 100;
/// Kubernetes allows at most 1000 endpoints per EndpointSlice.
pub const MAX_PODS_PER_SLICE: usize = 1000;

const RANK_PORT_PREFIX: &str = "rank-";

/// Name of the EndpointSlice port reaching data-parallel rank `rank`.
pub fn rank_port_name(rank: u32) -> String {
    format!("{RANK_PORT_PREFIX}{rank}")
}

/// The rank a slice port name encodes (`rank-3` → 3); `None` for any other name.
pub fn parse_rank_port_name(name: &str) -> Option<u32> {
    let digits = name.strip_prefix(RANK_PORT_PREFIX)?;
    if digits.is_empty() || (digits.len() > 1 && digits.starts_with('0')) {
        return None;
    }
    digits.parse().ok()
}

/// Name of the picker's Deployment, Service, ConfigMap, ServiceAccount, Role and RoleBinding.
pub fn picker_name(pool: &str) -> String {
    format!("{pool}-picker")
}

/// Name of the headless Service whose addresses are the pool's picker pods: how replicas find
/// each other for the in-flight exchange (`peers`). Shorter than [`picker_name`], so it fits
/// wherever that does.
pub fn picker_peers_name(pool: &str) -> String {
    format!("{pool}-peers")
}

/// Name of EndpointSlice number `index` of a (pool, model config).
pub fn slice_name(pool: &str, model_config: &str, index: usize) -> String {
    format!("{pool}-{model_config}-{index}")
}

/// Name of the exported Gateway API Inference Extension InferencePool of a model config.
pub fn gateway_pool_name(pool: &str, model_config: &str) -> String {
    format!("{pool}-{model_config}")
}

/// Longest pool name: the picker Service `<name>-picker` must be a 63-character DNS label.
pub const MAX_POOL_NAME_LEN: usize = 63 - "-picker".len();

/// Picker container ports (also the Service ports).
pub const PICKER_HTTP_PORT: u16 = 8080;
pub const PICKER_EXT_PROC_PORT: u16 = 9002;
pub const PICKER_METRICS_PORT: u16 = 9090;
/// UDP port of the in-flight exchange between picker replicas.
pub const PICKER_PEER_PORT: u16 = 9190;
/// The admin listener stays on loopback inside the picker pod.
pub const PICKER_ADMIN_PORT: u16 = 9091;

/// Where the picker's rendered config file is mounted, and its key in the ConfigMap.
pub const PICKER_CONFIG_DIR: &str = "/etc/kvroute";
pub const PICKER_CONFIG_KEY: &str = "picker.yaml";

/// Where tokenizer ConfigMaps are mounted in the picker, one directory per ConfigMap.
pub const TOKENIZER_MOUNT_ROOT: &str = "/var/lib/kvroute/tokenizers";
pub const TOKENIZER_JSON: &str = "tokenizer.json";
pub const TOKENIZER_CONFIG_JSON: &str = "tokenizer_config.json";

/// Where the pool's peer key Secret (named [`picker_peers_name`]) is mounted in the picker,
/// and its one key, which becomes this file (`peers.keyFile`).
pub const PEER_KEY_MOUNT_DIR: &str = "/var/run/secrets/kvroute/peers";
pub const PEER_KEY_FILE: &str = "key";

/// Where the picker keeps its index snapshot (`warmStart.snapshotPath`): an `emptyDir`,
/// which outlives a restart of the picker's container in its pod, of at most
/// [`WARM_START_SIZE_LIMIT`] (twice the largest snapshot: the last one and the next, which
/// is written beside it and renamed over it).
pub const WARM_START_DIR: &str = "/var/lib/kvroute/warm";
pub const WARM_START_SNAPSHOT: &str = "index.snapshot";
pub const WARM_START_SIZE_LIMIT: &str = "512Mi";

/// Where `spec.picker.saltSecretRef` is mounted in the picker; the key becomes this file.
pub const SALT_MOUNT_DIR: &str = "/var/run/secrets/kvroute/salt";
pub const SALT_FILE: &str = "salt";

/// The directory a tokenizer ConfigMap is mounted at under `root`.
pub fn tokenizer_dir(root: &Path, config_map: &str) -> PathBuf {
    root.join(config_map)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_port_names_round_trip() {
        for rank in [0, 1, 99, 1023] {
            assert_eq!(parse_rank_port_name(&rank_port_name(rank)), Some(rank));
        }
        for bad in ["rank-", "rank-01", "rank-x", "http", "rank--1", "Rank-1"] {
            assert_eq!(parse_rank_port_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn names_fit_kubernetes_limits() {
        let pool = "p".repeat(MAX_POOL_NAME_LEN);
        assert_eq!(picker_name(&pool).len(), 63);
        assert_eq!(slice_name("llama", "qwen", 2), "llama-qwen-2");
    }
}
