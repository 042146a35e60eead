//! Endpoints: `(address, port, data-parallel rank)` plus the model configuration they serve and
//! their routing state. The set is published as immutable snapshots so that routing reads a
//! consistent view without locks while the feeds replace or patch it.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use crate::pool::ModelConfigSpec;
use arc_swap::ArcSwap;
use serde::{Deserialize, Serialize};

/// Where a request goes: a model-server address, its HTTP port and the data-parallel rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct EndpointId {
    pub address: IpAddr,
    pub port: u16,
    pub rank: u32,
}

impl EndpointId {
    pub const fn new(address: IpAddr, port: u16, rank: u32) -> Self {
        Self {
            address,
            port,
            rank,
        }
    }

    /// `ip:port`, the form gateways use in `x-gateway-destination-endpoint`.
    pub fn host_port(&self) -> String {
        match self.address {
            IpAddr::V4(a) => format!("{a}:{}", self.port),
            IpAddr::V6(a) => format!("[{a}]:{}", self.port),
        }
    }
}

impl fmt::Display for EndpointId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.host_port(), self.rank)
    }
}

use crate::index::TierBlocks;
use crate::pool::KvOffloadSpec;
pub use crate::pool::{EngineKind, RankSelection};

/// What the picker needs to know about the model configuration an endpoint serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelConfig {
    /// Name of the configuration (unique within a pool).
    pub name: Arc<str>,
    /// The served model name clients put in `model`.
    pub model: Arc<str>,
    pub engine: EngineKind,
    /// Tokens per KV block in the engine (a power of two).
    pub block_size: u32,
    /// Data-parallel ranks per pod.
    pub dp_size: u32,
    pub rank_selection: RankSelection,
    /// LoRA adapters served next to the base model; requests may name them in `model`.
    pub lora_adapters: Vec<Arc<str>>,
    /// Identifier of the tokenizer to use (a path or a ConfigMap reference); `None` means
    /// character-chunk hashing.
    pub tokenizer: Option<Arc<str>>,
    /// What a hit in a tier below the GPU costs (`kvOffload`).
    pub offload: OffloadCosts,
    /// `loraLoadMs`: loading an adapter the engine is not running.
    pub lora_load_ms: u32,
    /// `loraSlotWaitMs`: waiting for one of the engine's `max_lora` slots when all hold busy
    /// adapters.
    pub lora_slot_wait_ms: u32,
}

/// `loraLoadMs` when unset: loading a rank-16 adapter of an 8B model (~50 MB) from host
/// memory or a local disk.
pub const DEFAULT_LORA_LOAD_MS: u32 = 50;
/// `loraSlotWaitMs` when unset: about one long request finishing and freeing a slot.
pub const DEFAULT_LORA_SLOT_WAIT_MS: u32 = 2000;

/// `kvOffload` resolved: per tier below the GPU (CPU, remote, storage, in
/// [`TierBlocks`]' order), the bytes it loads back per millisecond and the fraction of a GPU
/// block one of its blocks counts as (in thousandths, so that the config stays `Eq`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OffloadCosts {
    pub kv_bytes_per_token: u64,
    pub bytes_per_ms: [u64; 3],
    pub weight_permille: [u32; 3],
}

impl Default for OffloadCosts {
    /// The defaults documented on `KvOffloadSpec`.
    fn default() -> Self {
        Self::from_spec(None)
    }
}

impl OffloadCosts {
    pub fn from_spec(spec: Option<&KvOffloadSpec>) -> Self {
        // (GB/s, weight) of cpu, remote, storage
        const DEFAULTS: [(f64, f64); 3] = [(25.0, 0.75), (12.5, 0.5), (3.0, 0.25)];
        let tiers = spec.map_or([None, None, None], |s| {
            [s.cpu.as_ref(), s.remote.as_ref(), s.storage.as_ref()]
        });
        let mut bytes_per_ms = [0; 3];
        let mut weight_permille = [0; 3];
        for (i, t) in tiers.iter().enumerate() {
            let gbps = t.and_then(|t| t.bandwidth_gbps).unwrap_or(DEFAULTS[i].0);
            let w = t.and_then(|t| t.credit_weight).unwrap_or(DEFAULTS[i].1);
            bytes_per_ms[i] = ((gbps * 1e6).round() as u64).max(1);
            weight_permille[i] = (w.clamp(0.0, 1.0) * 1000.0).round() as u32;
        }
        Self {
            kv_bytes_per_token: spec
                .and_then(|s| s.kv_bytes_per_token)
                .unwrap_or(131_072)
                .max(1),
            bytes_per_ms,
            weight_permille,
        }
    }

    /// Milliseconds to load `tiers`' blocks (of `block_size` tokens) back into the GPU.
    pub fn load_ms(&self, tiers: &TierBlocks, block_size: u32) -> f64 {
        let per_block = self.kv_bytes_per_token as f64 * f64::from(block_size);
        [tiers.cpu, tiers.remote, tiers.storage]
            .iter()
            .zip(self.bytes_per_ms)
            .map(|(&n, rate)| f64::from(n) * per_block / rate as f64)
            .sum()
    }

    /// `tiers`' blocks in GPU-block equivalents, by the tiers' credit weights.
    pub fn credit_blocks(&self, tiers: &TierBlocks) -> f64 {
        [tiers.cpu, tiers.remote, tiers.storage]
            .iter()
            .zip(self.weight_permille)
            .map(|(&n, w)| f64::from(n) * f64::from(w) / 1000.0)
            .sum()
    }
}

impl ModelConfig {
    /// A configuration with defaults suitable for tests and the simplest deployments.
    pub fn new(name: &str, model: &str) -> Self {
        Self {
            name: name.into(),
            model: model.into(),
            engine: EngineKind::Vllm,
            block_size: 16,
            dp_size: 1,
            rank_selection: RankSelection::Header,
            lora_adapters: Vec::new(),
            tokenizer: None,
            offload: OffloadCosts::default(),
            lora_load_ms: DEFAULT_LORA_LOAD_MS,
            lora_slot_wait_ms: DEFAULT_LORA_SLOT_WAIT_MS,
        }
    }

    /// Whether a request's `model` field is served by this configuration, and with which LoRA
    /// adapter (`Some(name)` when the request names an adapter).
    pub fn serves<'a>(&self, requested: &'a str) -> Option<Option<&'a str>> {
        if *self.model == *requested {
            Some(None)
        } else if self.lora_adapters.iter().any(|a| **a == *requested) {
            Some(Some(requested))
        } else {
            None
        }
    }
}

impl From<&ModelConfigSpec> for ModelConfig {
    fn from(spec: &ModelConfigSpec) -> Self {
        Self {
            name: spec.name.as_str().into(),
            model: spec.model.as_str().into(),
            engine: spec.engine,
            block_size: spec.block_size,
            dp_size: spec.data_parallel.size,
            rank_selection: spec.data_parallel.rank_selection,
            lora_adapters: spec
                .lora_adapters
                .iter()
                .map(|a| Arc::from(a.as_str()))
                .collect(),
            tokenizer: spec
                .tokenizer
                .as_ref()
                .and_then(|t| t.path.as_deref().or(t.config_map.as_deref()))
                .map(Arc::from),
            offload: OffloadCosts::from_spec(spec.kv_offload.as_ref()),
            lora_load_ms: spec.lora_load_ms.unwrap_or(DEFAULT_LORA_LOAD_MS),
            lora_slot_wait_ms: spec.lora_slot_wait_ms.unwrap_or(DEFAULT_LORA_SLOT_WAIT_MS),
        }
    }
}

/// The endpoints one pod (or host) at `address` contributes for a model config: one per
/// data-parallel rank.
pub fn rank_endpoints(spec: &ModelConfigSpec, address: IpAddr) -> Vec<EndpointId> {
    spec.rank_ports()
        .into_iter()
        .map(|(port, rank)| EndpointId::new(address, port, rank))
        .collect()
}

/// Whether an endpoint may take new requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EndpointState {
    /// Eligible and fresh.
    Ready,
    /// Finishing what it has; takes no new requests (pod terminating, being removed).
    Draining,
    /// Its metrics or events are older than the staleness threshold.
    Stale,
}

/// One routable endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub id: EndpointId,
    pub model_config: Arc<ModelConfig>,
    pub state: EndpointState,
    /// Labels of the pod (or of the static entry), used by tenant filters.
    pub labels: BTreeMap<String, String>,
    /// Where this endpoint publishes KV events when it overrides its model config's ports.
    pub kv_ports: Option<KvPorts>,
    /// What it serves under prefill/decode disaggregation ([`Role::from_labels`]).
    pub role: Role,
}

/// An endpoint's part under prefill/decode disaggregation.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Prefills split requests and takes no whole request.
    Prefill,
    /// Decodes split requests (pulling their KV) and runs whole ones.
    Decode,
    /// Runs whole requests and decodes split ones: an engine without a role.
    #[default]
    Both,
}

/// Pod labels naming an endpoint's role, the first present wins: kvroute's own, then llm-d's.
pub const ROLE_LABELS: [&str; 2] = ["kvroute.dev/role", "llm-d.ai/role"];

impl Role {
    /// The role the labels give (`prefill`, `decode` or `both`; `prefill-decode` is read as
    /// `both`); no role label: `Both`.
    ///
    /// # Errors
    /// A role label with another value, naming the label.
    pub fn from_labels(labels: &BTreeMap<String, String>) -> Result<Self, String> {
        let Some((label, value)) = ROLE_LABELS
            .iter()
            .find_map(|l| labels.get(*l).map(|v| (*l, v)))
        else {
            return Ok(Self::Both);
        };
        Self::parse(value).ok_or_else(|| {
            format!("label {label}={value:?}: the role must be prefill, decode or both")
        })
    }

    /// `prefill`, `decode`, `both` (or `prefill-decode`).
    pub fn parse(value: &str) -> Option<Self> {
        match value {
            "prefill" => Some(Self::Prefill),
            "decode" => Some(Self::Decode),
            "both" | "prefill-decode" => Some(Self::Both),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
            Self::Both => "both",
        }
    }

    /// Whether it takes whole requests and the decode of split ones.
    pub fn decodes(self) -> bool {
        self != Self::Prefill
    }
}

/// KV-event ports of one endpoint: the publisher and, optionally, the replay service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvPorts {
    pub events: u16,
    pub replay: Option<u16>,
}

impl Endpoint {
    pub fn new(id: EndpointId, model_config: Arc<ModelConfig>) -> Self {
        Self {
            id,
            model_config,
            state: EndpointState::Ready,
            labels: BTreeMap::new(),
            kv_ports: None,
            role: Role::Both,
        }
    }
}

/// An immutable snapshot of the endpoints, sorted by id so iteration order (and therefore
/// tie-breaking) is the same in every picker replica.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EndpointSnapshot {
    endpoints: Vec<Endpoint>,
    version: u64,
}

impl EndpointSnapshot {
    pub fn new(mut endpoints: Vec<Endpoint>) -> Self {
        endpoints.sort_by_key(|e| e.id);
        endpoints.dedup_by_key(|e| e.id);
        Self {
            endpoints,
            version: 0,
        }
    }

    pub fn endpoints(&self) -> &[Endpoint] {
        &self.endpoints
    }

    pub fn get(&self, id: &EndpointId) -> Option<&Endpoint> {
        self.endpoints
            .binary_search_by_key(id, |e| e.id)
            .ok()
            .map(|i| &self.endpoints[i])
    }

    /// Monotonic version, bumped by every replace or patch.
    pub fn version(&self) -> u64 {
        self.version
    }

    pub fn len(&self) -> usize {
        self.endpoints.len()
    }

    pub fn is_empty(&self) -> bool {
        self.endpoints.is_empty()
    }
}

/// A change to one endpoint, applied by [`EndpointSet::patch`].
#[derive(Debug, Clone)]
pub enum EndpointPatch {
    Upsert(Endpoint),
    Remove(EndpointId),
    SetState(EndpointId, EndpointState),
}

/// The live endpoint set: readers take a snapshot (`load`), writers replace or patch it
/// atomically. Readers never block writers and never see a half-applied change.
#[derive(Debug, Default)]
pub struct EndpointSet {
    current: ArcSwap<EndpointSnapshot>,
}

impl EndpointSet {
    pub fn new(endpoints: Vec<Endpoint>) -> Self {
        Self {
            current: ArcSwap::from_pointee(EndpointSnapshot::new(endpoints)),
        }
    }

    pub fn load(&self) -> Arc<EndpointSnapshot> {
        self.current.load_full()
    }

    /// Replace the whole set; returns the ids that left it (their index entries should go).
    pub fn replace(&self, endpoints: Vec<Endpoint>) -> Vec<EndpointId> {
        let mut removed = Vec::new();
        self.current.rcu(|old| {
            let mut next = EndpointSnapshot::new(endpoints.clone());
            next.version = old.version + 1;
            removed = old
                .endpoints
                .iter()
                .filter(|e| next.get(&e.id).is_none())
                .map(|e| e.id)
                .collect();
            next
        });
        removed
    }

    /// Apply several changes as one atomic step; returns the ids that left the set.
    pub fn patch(&self, patches: &[EndpointPatch]) -> Vec<EndpointId> {
        let mut removed = Vec::new();
        self.current.rcu(|old| {
            removed.clear();
            let mut map: BTreeMap<EndpointId, Endpoint> =
                old.endpoints.iter().map(|e| (e.id, e.clone())).collect();
            for p in patches {
                match p {
                    EndpointPatch::Upsert(e) => {
                        map.insert(e.id, e.clone());
                    }
                    EndpointPatch::Remove(id) => {
                        if map.remove(id).is_some() {
                            removed.push(*id);
                        }
                    }
                    EndpointPatch::SetState(id, s) => {
                        if let Some(e) = map.get_mut(id) {
                            e.state = *s;
                        }
                    }
                }
            }
            EndpointSnapshot {
                endpoints: map.into_values().collect(),
                version: old.version + 1,
            }
        });
        removed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn ep(last: u8, rank: u32) -> Endpoint {
        let mc = Arc::new(ModelConfig::new("default", "m"));
        Endpoint::new(
            EndpointId::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, last)), 8000, rank),
            mc,
        )
    }

    #[test]
    fn snapshot_is_sorted_and_deduplicated() {
        let s = EndpointSnapshot::new(vec![ep(2, 0), ep(1, 1), ep(1, 0), ep(2, 0)]);
        let ids: Vec<_> = s.endpoints().iter().map(|e| e.id.to_string()).collect();
        assert_eq!(
            ids,
            ["10.0.0.1:8000#0", "10.0.0.1:8000#1", "10.0.0.2:8000#0"]
        );
    }

    #[test]
    fn replace_reports_removed_and_bumps_version() {
        let set = EndpointSet::new(vec![ep(1, 0), ep(2, 0)]);
        let v0 = set.load().version();
        let removed = set.replace(vec![ep(2, 0), ep(3, 0)]);
        assert_eq!(removed, vec![ep(1, 0).id]);
        let snap = set.load();
        assert_eq!(snap.version(), v0 + 1);
        assert!(snap.get(&ep(3, 0).id).is_some());
        assert!(snap.get(&ep(1, 0).id).is_none());
    }

    #[test]
    fn patch_is_atomic_and_old_snapshots_stay_valid() {
        let set = EndpointSet::new(vec![ep(1, 0), ep(2, 0)]);
        let before = set.load();
        let removed = set.patch(&[
            EndpointPatch::Remove(ep(1, 0).id),
            EndpointPatch::SetState(ep(2, 0).id, EndpointState::Stale),
            EndpointPatch::Upsert(ep(4, 1)),
            EndpointPatch::Remove(ep(9, 0).id),
        ]);
        assert_eq!(removed, vec![ep(1, 0).id]);
        assert_eq!(
            before.len(),
            2,
            "a reader's snapshot does not change under it"
        );
        let after = set.load();
        assert_eq!(after.len(), 2);
        assert_eq!(
            after.get(&ep(2, 0).id).map(|e| e.state),
            Some(EndpointState::Stale)
        );
    }

    #[test]
    fn serves_base_model_and_adapters() {
        let mut mc = ModelConfig::new("c", "llama");
        mc.lora_adapters.push("sql-lora".into());
        assert_eq!(mc.serves("llama"), Some(None));
        assert_eq!(mc.serves("sql-lora"), Some(Some("sql-lora")));
        assert_eq!(mc.serves("other"), None);
    }

    #[test]
    fn ipv6_host_port_is_bracketed() {
        let id = EndpointId::new("::1".parse().expect("ip"), 80, 0);
        assert_eq!(id.host_port(), "[::1]:80");
    }
}
