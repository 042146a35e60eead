//! Cluster mode: the picker's pool as the `KVRoutePool` resource and the EndpointSlices the
//! operator writes for it say (`kvroute-picker --pool NAME --namespace NS`).
//!
//! Model configs, routing and tenancy come from the resource's spec; endpoints from the
//! slices labelled `kvroute.dev/pool=NAME`, one `(address, port, rank)` per slice endpoint
//! and `rank-<k>` port (see `kvroute_crds::contract`). Both are watched (read-only) and every
//! change is republished as a whole [`DeclaredPool`], so weight edits and endpoint changes apply
//! live. A malformed resource is logged and skipped: the last good view stays in force.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::{StreamExt, stream};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ApiResource, DynamicObject};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use kvroute_crds::contract;
use kvroute_crds::gateway_pool::{
    InferenceModelRewrite, InferenceObjective, objectives_for, rewrites_for,
};
use kvroute_crds::kvroute_pool::{KVRoutePool, KVRoutePoolSpec};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::declared::{DeclaredEndpoint, DeclaredPool};
use super::source::EndpointSource;
use crate::endpoint::EndpointId;
use crate::error::PickerError;

/// Which pool to follow and where the operator mounts its files in the picker pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeSourceOptions {
    pub pool: String,
    pub namespace: String,
    /// Root of the mounted tokenizer ConfigMaps (one directory per ConfigMap).
    pub tokenizer_root: PathBuf,
    /// Directory of the mounted salt Secret (`spec.picker.saltSecretRef`).
    pub salt_dir: PathBuf,
    /// Quiet time after a change before the view is rebuilt, so a burst of slice updates is
    /// applied once, consistently.
    pub debounce: Duration,
}

impl KubeSourceOptions {
    pub fn new(pool: impl Into<String>, namespace: impl Into<String>) -> Self {
        Self {
            pool: pool.into(),
            namespace: namespace.into(),
            tokenizer_root: PathBuf::from(contract::TOKENIZER_MOUNT_ROOT),
            salt_dir: PathBuf::from(contract::SALT_MOUNT_DIR),
            debounce: Duration::from_millis(50),
        }
    }
}

/// The pool's endpoints from the operator's EndpointSlices, in a stable order. Slices of
/// model configs the spec no longer has, unparsable addresses and ports not named
/// `rank-<k>` are skipped; an endpoint listed twice (a pod moving between slices) is serving
/// if any listing says so.
pub fn endpoints_from_slices<'a>(
    spec: &KVRoutePoolSpec,
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
) -> Vec<DeclaredEndpoint> {
    let configs: BTreeSet<&str> = spec.model_configs.iter().map(|m| m.name.as_str()).collect();
    let mut out: BTreeMap<(String, EndpointId), DeclaredEndpoint> = BTreeMap::new();
    for slice in slices {
        let Some(mc) = slice.labels().get(contract::LABEL_MODEL_CONFIG) else {
            continue;
        };
        if !configs.contains(mc.as_str()) {
            continue;
        }
        let labels_by_pod: BTreeMap<String, BTreeMap<String, String>> = slice
            .annotations()
            .get(contract::ANNOTATION_ENDPOINT_LABELS)
            .and_then(|text| serde_json::from_str(text).ok())
            .unwrap_or_default();
        let ranks: Vec<(u16, u32)> = slice
            .ports
            .iter()
            .flatten()
            .filter_map(|p| {
                let rank = contract::parse_rank_port_name(p.name.as_deref()?)?;
                let port = u16::try_from(p.port?).ok().filter(|p| *p > 0)?;
                Some((port, rank))
            })
            .collect();
        for ep in slice.endpoints.iter().flatten() {
            let Some(address) = ep.addresses.first().and_then(|a| a.parse::<IpAddr>().ok()) else {
                continue;
            };
            // Kubernetes: an unknown readiness is to be read as ready
            let serving = ep.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true);
            let labels = ep
                .target_ref
                .as_ref()
                .and_then(|r| r.name.as_deref())
                .and_then(|pod| labels_by_pod.get(pod))
                .cloned()
                .unwrap_or_default();
            for &(port, rank) in &ranks {
                let id = EndpointId::new(address, port, rank);
                out.entry((mc.clone(), id))
                    .and_modify(|v| v.serving |= serving)
                    .or_insert_with(|| DeclaredEndpoint {
                        id,
                        model_config: mc.clone(),
                        labels: labels.clone(),
                        serving,
                        // the model config's `kvEvents.port + rank` convention
                        kv_ports: None,
                    });
            }
        }
    }
    out.into_values().collect()
}

/// The pool as the resource and its slices describe it. `exists` tells whether an optional
/// mounted file (a tokenizer's `tokenizer_config.json`) is there.
pub fn declared<'a>(
    spec: &KVRoutePoolSpec,
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
    tokenizer_root: &Path,
    salt_dir: &Path,
    exists: &dyn Fn(&Path) -> bool,
) -> DeclaredPool {
    let (model_configs, tenancy) = spec.for_picker(tokenizer_root, salt_dir, exists);
    DeclaredPool {
        model_configs,
        routing: spec.routing.clone(),
        tenancy,
        endpoints: endpoints_from_slices(spec, slices),
    }
}

/// The Gateway API InferencePools this pool serves (`inferencePoolRef`) or exports.
fn gateway_pools(spec: &KVRoutePoolSpec, pool: &str) -> Vec<String> {
    let mut pools: Vec<String> = spec
        .inference_pool_ref
        .iter()
        .map(|r| r.name.clone())
        .collect();
    if spec.gateway.is_some_and(|g| g.export_inference_pool) {
        pools.extend(
            spec.model_configs
                .iter()
                .map(|mc| contract::gateway_pool_name(pool, &mc.name)),
        );
    }
    pools
}

/// The objects of `store` that parse as `T` (others are skipped).
fn parsed<T: serde::de::DeserializeOwned>(store: &Store<DynamicObject>) -> Vec<T> {
    store
        .state()
        .iter()
        .filter_map(|d| serde_json::from_value(serde_json::to_value(d.as_ref()).ok()?).ok())
        .collect()
}

/// Adds to `spec.routing.modelRewrites` the rules of the `InferenceModelRewrite`s naming a
/// Gateway API InferencePool this pool serves (`inferencePoolRef`) or exports; the pool's own
/// rules come first and win for the same model, and rules naming targets the pool does not
/// serve are left out (logged).
pub fn add_gateway_rewrites(
    spec: &mut KVRoutePoolSpec,
    pool: &str,
    rewrites: &Store<DynamicObject>,
) {
    let pools = gateway_pools(spec, pool);
    if pools.is_empty() {
        return;
    }
    let parsed: Vec<InferenceModelRewrite> = parsed(rewrites);
    let model_configs = spec.model_configs.clone();
    let served = |m: &str| {
        model_configs
            .iter()
            .any(|mc| mc.model == m || mc.lora_adapters.iter().any(|a| a == m))
    };
    let (rules, skipped) = rewrites_for(&pools, &parsed, &served);
    for why in skipped {
        tracing::debug!(%why, "InferenceModelRewrite rule not applied");
    }
    let own = &mut spec.routing.model_rewrites;
    for r in rules {
        if own.len() < 64 && !own.iter().any(|o| o.model == r.model) {
            own.push(r);
        }
    }
}

/// Adds to `spec.routing.flowControl.objectives` the `InferenceObjective`s naming a Gateway API
/// InferencePool this pool serves or exports; the pool's own objectives win for the same name.
pub fn add_gateway_objectives(
    spec: &mut KVRoutePoolSpec,
    pool: &str,
    objectives: &Store<DynamicObject>,
) {
    let pools = gateway_pools(spec, pool);
    if pools.is_empty() {
        return;
    }
    let parsed: Vec<InferenceObjective> = parsed(objectives);
    let own = &mut spec.routing.flow_control.objectives;
    for o in objectives_for(&pools, &parsed) {
        if own.len() < 64 && !own.iter().any(|x| x.name == o.name) {
            own.push(o);
        }
    }
}

/// The pool resource and its EndpointSlices, watched.
#[derive(Clone)]
pub struct KubeSource {
    client: Client,
    options: KubeSourceOptions,
}

impl std::fmt::Debug for KubeSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeSource")
            .field("options", &self.options)
            .finish()
    }
}

impl KubeSource {
    pub fn new(client: Client, options: KubeSourceOptions) -> Self {
        Self { client, options }
    }

    /// With the in-cluster service account, or `KUBECONFIG` outside a cluster.
    pub async fn try_default(options: KubeSourceOptions) -> Result<Self, PickerError> {
        let client = Client::try_default().await.map_err(PickerError::Kube)?;
        Ok(Self::new(client, options))
    }

    /// The current view, if the pool exists and its spec parses.
    fn current(
        &self,
        pools: &Store<DynamicObject>,
        slices: &Store<EndpointSlice>,
        gateway: &GatewayStores,
    ) -> Option<DeclaredPool> {
        let o = &self.options;
        let pool = pools.state().into_iter().find(|p| p.name_any() == o.pool)?;
        let spec = match pool
            .data
            .get("spec")
            .cloned()
            .map(serde_json::from_value::<KVRoutePoolSpec>)
        {
            Some(Ok(spec)) => spec,
            Some(Err(e)) => {
                tracing::error!(pool = %o.pool, error = %e, "pool spec not understood; keeping the previous view");
                return None;
            }
            None => {
                tracing::error!(pool = %o.pool, "pool has no spec; keeping the previous view");
                return None;
            }
        };
        let mut spec = spec;
        add_gateway_rewrites(&mut spec, &o.pool, &gateway.rewrites);
        add_gateway_objectives(&mut spec, &o.pool, &gateway.objectives);
        let mut slices: Vec<_> = slices
            .state()
            .into_iter()
            .filter(|s| s.labels().get(contract::LABEL_POOL) == Some(&o.pool))
            .collect();
        slices.sort_by_key(|s| s.name_any());
        Some(declared(
            &spec,
            slices.iter().map(|s| s.as_ref()),
            &o.tokenizer_root,
            &o.salt_dir,
            &|p| p.exists(),
        ))
    }
}

/// The Gateway API Inference Extension's resources a pool takes settings from.
struct GatewayStores {
    rewrites: Store<DynamicObject>,
    objectives: Store<DynamicObject>,
}

impl KubeSource {
    /// A watch of the namespace's resources of `ar` when its CRD is installed (checked once),
    /// else an empty store and no events.
    async fn watch_optional(
        &self,
        ar: ApiResource,
    ) -> (
        Store<DynamicObject>,
        futures::stream::BoxStream<'static, Result<(), watcher::Error>>,
    ) {
        let installed = self
            .client
            .list_api_group_resources(&ar.api_version)
            .await
            .is_ok_and(|l| l.resources.iter().any(|r| r.name == ar.plural));
        let writer = reflector::store::Writer::<DynamicObject>::new(ar.clone());
        let store = writer.as_reader();
        let events = if installed {
            let api: Api<DynamicObject> =
                Api::namespaced_with(self.client.clone(), &self.options.namespace, &ar);
            watcher(api, watcher::Config::default())
                .default_backoff()
                .reflect(writer)
                .map(|e| e.map(|_| ()))
                .boxed()
        } else {
            stream::empty().boxed()
        };
        (store, events)
    }
}

impl EndpointSource for KubeSource {
    fn name(&self) -> &'static str {
        "kubernetes"
    }

    fn run(
        self: Box<Self>,
        tx: watch::Sender<Option<DeclaredPool>>,
        cancel: CancellationToken,
    ) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            let o = self.options.clone();
            // the pool as a dynamic object, so that a spec this picker does not understand
            // (a newer CRD) is one logged error, not a stalled watch
            let ar = ApiResource::erase::<KVRoutePool>(&());
            let pools_api: Api<DynamicObject> =
                Api::namespaced_with(self.client.clone(), &o.namespace, &ar);
            let slices_api: Api<EndpointSlice> = Api::namespaced(self.client.clone(), &o.namespace);
            let pools_writer = reflector::store::Writer::<DynamicObject>::new(ar.clone());
            let pools = pools_writer.as_reader();
            let (slices, slices_writer) = reflector::store();
            let pool_events = watcher(
                pools_api,
                watcher::Config::default().fields(&format!("metadata.name={}", o.pool)),
            )
            .default_backoff()
            .reflect(pools_writer)
            .map(|e| e.map(|_| ()));
            let slice_events = watcher(
                slices_api,
                watcher::Config::default().labels(&format!("{}={}", contract::LABEL_POOL, o.pool)),
            )
            .default_backoff()
            .reflect(slices_writer)
            .map(|e| e.map(|_| ()));
            // llm-d's InferenceModelRewrites and InferenceObjectives, where their CRDs are
            // installed (checked at start)
            let (rewrites, rewrite_events) = self
                .watch_optional(ApiResource::erase::<InferenceModelRewrite>(&()))
                .await;
            let (objectives, objective_events) = self
                .watch_optional(ApiResource::erase::<InferenceObjective>(&()))
                .await;
            let gateway = GatewayStores {
                rewrites,
                objectives,
            };
            let mut events = std::pin::pin!(stream::select(
                stream::select(pool_events, slice_events),
                stream::select(rewrite_events, objective_events)
            ));
            let mut last: Option<DeclaredPool> = None;
            let mut dirty = false;
            tracing::info!(pool = %o.pool, namespace = %o.namespace, "watching the pool and its EndpointSlices");
            loop {
                let quiet = async {
                    if dirty {
                        tokio::time::sleep(o.debounce).await;
                    } else {
                        std::future::pending::<()>().await;
                    }
                };
                tokio::select! {
                    () = cancel.cancelled() => return,
                    ev = events.next() => match ev {
                        Some(Ok(())) => dirty = true,
                        Some(Err(e)) => tracing::warn!(error = %e, "watch error; retrying"),
                        None => return,
                    },
                    () = quiet => {
                        dirty = false;
                        if let Some(view) = self.current(&pools, &slices, &gateway)
                            && last.as_ref() != Some(&view)
                        {
                            tracing::info!(
                                endpoints = view.endpoints.len(),
                                model_configs = view.model_configs.len(),
                                "pool changed"
                            );
                            last = Some(view.clone());
                            let _ = tx.send(Some(view));
                        }
                    }
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ObjectReference;
    use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use kvroute_crds::pool::RankSelection;
    use serde_json::json;

    fn spec() -> KVRoutePoolSpec {
        serde_json::from_value(json!({
            "selector": {"matchLabels": {"app": "vllm"}},
            "modelConfigs": [
                {"name": "llama", "model": "meta-llama/Llama-3.1-8B-Instruct",
                 "dataParallel": {"size": 2, "rankSelection": "Header"},
                 "tokenizer": {"configMap": "llama-tok"}},
                {"name": "qwen", "model": "Qwen/Qwen2.5-7B", "port": 30000,
                 "dataParallel": {"size": 2, "rankSelection": "Port"}}
            ],
            "routing": {"strategy": "Weighted", "weights": {"queue": 5}},
            "tenancy": {"isolation": "SaltedCache", "header": "x-tenant"},
            "picker": {"saltSecretRef": {"name": "salt"}}
        }))
        .expect("spec")
    }

    fn endpoint(ip: &str, pod: &str, ready: Option<bool>) -> Endpoint {
        Endpoint {
            addresses: vec![ip.into()],
            conditions: Some(EndpointConditions {
                ready,
                serving: ready,
                terminating: Some(ready == Some(false)),
            }),
            target_ref: Some(ObjectReference {
                kind: Some("Pod".into()),
                name: Some(pod.into()),
                ..ObjectReference::default()
            }),
            ..Endpoint::default()
        }
    }

    fn slice(name: &str, mc: &str, ports: &[(&str, i32)], eps: Vec<Endpoint>) -> EndpointSlice {
        EndpointSlice {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some(BTreeMap::from([
                    (contract::LABEL_POOL.to_owned(), "llama".to_owned()),
                    (contract::LABEL_MODEL_CONFIG.to_owned(), mc.to_owned()),
                ])),
                ..ObjectMeta::default()
            },
            address_type: "IPv4".into(),
            endpoints: Some(eps),
            ports: Some(
                ports
                    .iter()
                    .map(|(n, p)| EndpointPort {
                        name: Some((*n).into()),
                        port: Some(*p),
                        protocol: Some("TCP".into()),
                        app_protocol: None,
                    })
                    .collect(),
            ),
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    #[test]
    fn slices_become_rank_endpoints() {
        let s = spec();
        let slices = [
            slice(
                "llama-llama-0",
                "llama",
                &[("rank-0", 8000), ("rank-1", 8000)],
                vec![
                    endpoint("10.0.0.1", "a", Some(true)),
                    endpoint("10.0.0.2", "b", Some(false)),
                ],
            ),
            slice(
                "llama-qwen-0",
                "qwen",
                &[("rank-0", 30000), ("rank-1", 30001), ("metrics", 9000)],
                vec![endpoint("10.0.1.1", "c", None)],
            ),
        ];
        let eps = endpoints_from_slices(&s, &slices);
        let got: Vec<(String, EndpointId, bool)> = eps
            .iter()
            .map(|e| (e.model_config.clone(), e.id, e.serving))
            .collect();
        assert_eq!(
            got,
            [
                (
                    "llama".into(),
                    EndpointId::new(ip("10.0.0.1"), 8000, 0),
                    true
                ),
                (
                    "llama".into(),
                    EndpointId::new(ip("10.0.0.1"), 8000, 1),
                    true
                ),
                (
                    "llama".into(),
                    EndpointId::new(ip("10.0.0.2"), 8000, 0),
                    false
                ),
                (
                    "llama".into(),
                    EndpointId::new(ip("10.0.0.2"), 8000, 1),
                    false
                ),
                (
                    "qwen".into(),
                    EndpointId::new(ip("10.0.1.1"), 30000, 0),
                    true
                ),
                (
                    "qwen".into(),
                    EndpointId::new(ip("10.0.1.1"), 30001, 1),
                    true
                ),
            ]
        );
        // the same expansion the picker does from a config file
        let qwen = s
            .model_configs
            .iter()
            .find(|m| m.name == "qwen")
            .expect("qwen");
        assert_eq!(qwen.data_parallel.rank_selection, RankSelection::Port);
        let from_file: Vec<EndpointId> = crate::endpoint::rank_endpoints(qwen, ip("10.0.1.1"));
        assert_eq!(
            from_file,
            eps.iter()
                .filter(|e| e.model_config == "qwen")
                .map(|e| e.id)
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn stale_configs_bad_addresses_and_duplicates_are_handled() {
        let s = spec();
        let slices = [
            slice(
                "x-0",
                "gone",
                &[("rank-0", 8000)],
                vec![endpoint("10.0.0.9", "z", Some(true))],
            ),
            slice(
                "llama-llama-0",
                "llama",
                &[("rank-0", 8000), ("rank-01", 8000), ("rank-2", 0)],
                vec![
                    endpoint("not-an-ip", "y", Some(true)),
                    endpoint("10.0.0.1", "a", Some(false)),
                ],
            ),
            // the pod moved to another chunk and is serving there
            slice(
                "llama-llama-1",
                "llama",
                &[("rank-0", 8000)],
                vec![endpoint("10.0.0.1", "a", Some(true))],
            ),
        ];
        let eps = endpoints_from_slices(&s, &slices);
        assert_eq!(eps.len(), 1);
        assert_eq!(eps[0].id, EndpointId::new(ip("10.0.0.1"), 8000, 0));
        assert!(eps[0].serving);
    }

    #[test]
    fn tenant_labels_come_from_the_slice_annotation() {
        let s = spec();
        let mut sl = slice(
            "llama-llama-0",
            "llama",
            &[("rank-0", 8000)],
            vec![
                endpoint("10.0.0.1", "a", Some(true)),
                endpoint("10.0.0.2", "b", Some(true)),
            ],
        );
        sl.metadata.annotations = Some(BTreeMap::from([(
            contract::ANNOTATION_ENDPOINT_LABELS.to_owned(),
            r#"{"a": {"tenant": "team-a"}}"#.to_owned(),
        )]));
        let eps = endpoints_from_slices(&s, [&sl]);
        assert_eq!(
            eps[0].labels,
            BTreeMap::from([("tenant".to_owned(), "team-a".to_owned())])
        );
        assert!(eps[1].labels.is_empty());
    }

    #[test]
    fn the_view_carries_the_spec_with_mounted_paths() {
        let s = spec();
        let root = Path::new("/tok");
        let view = declared(&s, [], root, Path::new("/salt"), &|p| {
            p == Path::new("/tok/llama-tok/tokenizer_config.json")
        });
        assert_eq!(view.routing, s.routing);
        assert_eq!(view.routing.weights.queue, 5.0);
        let t = view.model_configs[0].tokenizer.as_ref().expect("tokenizer");
        assert_eq!(t.path.as_deref(), Some("/tok/llama-tok/tokenizer.json"));
        assert_eq!(
            t.config_path.as_deref(),
            Some("/tok/llama-tok/tokenizer_config.json")
        );
        assert_eq!(view.tenancy.salt_secret_file.as_deref(), Some("/salt/salt"));
        assert!(view.endpoints.is_empty());
        view.routing.validate().expect("routing valid");
        view.tenancy.validate().expect("tenancy valid");
        for (i, mc) in view.model_configs.iter().enumerate() {
            mc.validate(i).expect("model config valid");
        }
    }
}
