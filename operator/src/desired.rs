//! The objects a pool should own, built from the pool and its resolved endpoints. Pure and
//! client-free: every test can construct them and compare.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{
    ConfigMap, ObjectReference, ResourceRequirements, Secret, Service, ServiceAccount,
};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::{Resource, ResourceExt};
use kvroute_crds::contract;
use kvroute_crds::kvroute_pool::KVRoutePool;
use kvroute_crds::pool::RankSelection;
use kvroute_crds::routing::FailureMode;
use serde::Serialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::eligibility::{ConfigEndpoints, ListedPod};
use crate::error::{Error, Result};

/// Operator-wide settings that shape what it builds.
#[derive(Debug, Clone, PartialEq)]
pub struct BuildSettings {
    /// Picker image when the pool names none.
    pub picker_image: String,
    /// The operator's secret from which each pool's peer key is derived (`--peer-key-seed-file`);
    /// none: pickers exchange in-flight counts without a key.
    pub peer_key_seed: Option<PeerKeySeed>,
    /// CPU and memory of the picker container when the pool sets none
    /// (`--picker-resources`; the chart's `operator.pickerResources`).
    pub picker_resources: Option<ResourceRequirements>,
}

impl Default for BuildSettings {
    fn default() -> Self {
        Self {
            picker_image: format!("ghcr.io/kvroute/kvroute:{}", env!("CARGO_PKG_VERSION")),
            peer_key_seed: None,
            picker_resources: None,
        }
    }
}

/// The operator's secret for peer keys; never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct PeerKeySeed(Vec<u8>);

impl std::fmt::Debug for PeerKeySeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PeerKeySeed(..)")
    }
}

impl PeerKeySeed {
    /// A seed of at least 16 bytes (surrounding whitespace trimmed).
    pub fn new(bytes: &[u8]) -> std::result::Result<Self, String> {
        let b = bytes.trim_ascii();
        if b.len() < 16 {
            return Err(format!(
                "the peer key seed must be at least 16 bytes, got {}",
                b.len()
            ));
        }
        Ok(Self(b.to_vec()))
    }

    /// The key of the pool with `uid`: HMAC-SHA256 of the uid under the seed, hex. The same
    /// on every reconcile and every operator replica (no write churn, no key to store), and
    /// new for a pool deleted and created again.
    pub fn pool_key(&self, uid: &str) -> String {
        use hmac::Mac;
        let mut mac = <hmac::Hmac<sha2::Sha256> as Mac>::new_from_slice(&self.0)
            .unwrap_or_else(|_| unreachable!("HMAC takes a key of any length"));
        mac.update(b"kvroute peers key\0");
        mac.update(uid.as_bytes());
        mac.finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

/// Everything one pool should own.
#[derive(Debug, Clone, PartialEq)]
pub struct Desired {
    pub slices: Vec<EndpointSlice>,
    pub config_map: ConfigMap,
    /// The per-pool ServiceAccount, Role and RoleBinding; `None` when the pool names its own
    /// ServiceAccount.
    pub rbac: Option<(ServiceAccount, Role, RoleBinding)>,
    pub deployment: Deployment,
    pub service: Service,
    /// The headless Service through which picker replicas find each other (`peers`).
    pub peer_service: Service,
    /// The pool's peer key (`peers.keyFile`), when the operator has a seed.
    pub peer_secret: Option<Secret>,
    /// Gateway API Inference Extension pools, when the pool asks for them.
    pub gateway_pools: Vec<DynamicObject>,
    /// Slice names per model config, for the status.
    pub slice_names: BTreeMap<String, Vec<String>>,
}

/// `inference.networking.k8s.io/v1` `InferencePool`.
pub fn gateway_pool_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("inference.networking.k8s.io", "v1", "InferencePool"),
        "inferencepools",
    )
}

fn owner(pool: &KVRoutePool) -> Result<OwnerReference> {
    let mut r = pool
        .controller_owner_ref(&())
        .ok_or(Error::MissingObjectKey("metadata.name or metadata.uid"))?;
    r.block_owner_deletion = Some(true);
    Ok(r)
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// Labels of the picker's objects; the first two select its pods.
fn picker_labels(pool: &str) -> BTreeMap<String, String> {
    labels(&[
        (contract::LABEL_NAME, "kvroute-picker"),
        (contract::LABEL_INSTANCE, pool),
        (contract::LABEL_COMPONENT, "picker"),
        (contract::LABEL_MANAGED_BY, contract::MANAGED_BY),
        (contract::LABEL_POOL, pool),
    ])
}

fn picker_selector(pool: &str) -> BTreeMap<String, String> {
    labels(&[
        (contract::LABEL_NAME, "kvroute-picker"),
        (contract::LABEL_INSTANCE, pool),
    ])
}

fn meta(
    name: String,
    namespace: &str,
    labels: BTreeMap<String, String>,
    owner: &OwnerReference,
) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: Some(namespace.to_owned()),
        labels: Some(labels),
        owner_references: Some(vec![owner.clone()]),
        ..ObjectMeta::default()
    }
}

/// Hex SHA-256 (first 16 bytes) of a value's JSON.
pub fn hash_of<T: Serialize>(v: &T) -> Result<String> {
    let bytes = serde_json::to_vec(v).map_err(|source| Error::Render {
        what: "hash input",
        source,
    })?;
    let digest = Sha256::digest(&bytes);
    Ok(digest.iter().take(16).map(|b| format!("{b:02x}")).collect())
}

/// Stamp the object with the hash of its own content (see
/// [`contract::ANNOTATION_APPLIED_HASH`]).
pub fn stamp<K: Resource + Serialize>(mut obj: K) -> Result<K> {
    if let Some(a) = obj.meta_mut().annotations.as_mut() {
        a.remove(contract::ANNOTATION_APPLIED_HASH);
    }
    let h = hash_of(&obj)?;
    obj.meta_mut()
        .annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(contract::ANNOTATION_APPLIED_HASH.to_owned(), h);
    Ok(obj)
}

/// The `(port, rank)` pairs of a model config, as slice ports.
fn rank_ports(mc: &kvroute_crds::pool::ModelConfigSpec) -> Vec<EndpointPort> {
    mc.rank_ports()
        .into_iter()
        .map(|(port, rank)| EndpointPort {
            name: Some(contract::rank_port_name(rank)),
            port: Some(i32::from(port)),
            protocol: Some("TCP".into()),
            app_protocol: Some("http".into()),
        })
        .collect()
}

fn slice_endpoint(pod: &ListedPod, namespace: &str) -> Endpoint {
    Endpoint {
        addresses: vec![pod.ip.to_string()],
        conditions: Some(EndpointConditions {
            ready: Some(pod.conditions.ready),
            serving: Some(pod.conditions.serving),
            terminating: Some(pod.conditions.terminating),
        }),
        node_name: pod.node_name.clone(),
        target_ref: Some(ObjectReference {
            kind: Some("Pod".into()),
            namespace: Some(namespace.to_owned()),
            name: Some(pod.name.clone()),
            uid: pod.uid.clone(),
            ..ObjectReference::default()
        }),
        ..Endpoint::default()
    }
}

/// The EndpointSlices of one model config: pods split by address family and into chunks of
/// [`contract::MAX_PODS_PER_SLICE`], ranks into chunks of [`contract::MAX_RANKS_PER_SLICE`].
fn config_slices(
    pool: &KVRoutePool,
    namespace: &str,
    owner: &OwnerReference,
    mc: &kvroute_crds::pool::ModelConfigSpec,
    endpoints: &ConfigEndpoints,
    tenant_keys: bool,
) -> Result<Vec<EndpointSlice>> {
    let pool_name = pool.name_any();
    let ports = rank_ports(mc);
    let rank_chunks: Vec<&[EndpointPort]> = ports
        .chunks(contract::MAX_RANKS_PER_SLICE as usize)
        .collect();
    let (v4, v6): (Vec<&ListedPod>, Vec<&ListedPod>) =
        endpoints.listed.iter().partition(|p| p.ip.is_ipv4());
    let mut groups: Vec<(&str, Vec<&ListedPod>)> = Vec::new();
    for (family, pods) in [("IPv4", v4), ("IPv6", v6)] {
        if pods.is_empty() {
            continue;
        }
        for chunk in pods.chunks(contract::MAX_PODS_PER_SLICE) {
            groups.push((family, chunk.to_vec()));
        }
    }
    if groups.is_empty() {
        groups.push(("IPv4", Vec::new()));
    }
    let mut out = Vec::new();
    for (family, pods) in &groups {
        for ranks in &rank_chunks {
            let name = contract::slice_name(&pool_name, &mc.name, out.len());
            let mut m = meta(
                name,
                namespace,
                labels(&[
                    (contract::LABEL_MANAGED_BY, contract::MANAGED_BY),
                    (contract::LABEL_SLICE_MANAGED_BY, contract::SLICE_MANAGED_BY),
                    (contract::LABEL_POOL, &pool_name),
                    (contract::LABEL_MODEL_CONFIG, &mc.name),
                    (contract::LABEL_COMPONENT, "endpoints"),
                ]),
                owner,
            );
            // tenant selectors' keys, and the roles of pods that have one
            if tenant_keys || pods.iter().any(|p| !p.labels.is_empty()) {
                let projection: BTreeMap<&str, &BTreeMap<String, String>> =
                    pods.iter().map(|p| (p.name.as_str(), &p.labels)).collect();
                let text = serde_json::to_string(&projection).map_err(|source| Error::Render {
                    what: "endpoint labels",
                    source,
                })?;
                m.annotations = Some(BTreeMap::from([(
                    contract::ANNOTATION_ENDPOINT_LABELS.to_owned(),
                    text,
                )]));
            }
            out.push(stamp(EndpointSlice {
                metadata: m,
                address_type: (*family).to_owned(),
                endpoints: Some(pods.iter().map(|p| slice_endpoint(p, namespace)).collect()),
                ports: Some(ranks.to_vec()),
            })?);
        }
    }
    Ok(out)
}

/// The picker config file: listeners, and the pool's model configs, routing and tenancy as
/// the picker will run them. Pickers in cluster mode take model configs, routing and tenancy
/// live from the pool resource; the file's copy is for inspection and validation.
pub fn render_picker_config(pool: &KVRoutePool, keyed: bool) -> Result<(String, String)> {
    let (model_configs, tenancy) = pool.spec.for_picker(
        std::path::Path::new(contract::TOKENIZER_MOUNT_ROOT),
        std::path::Path::new(contract::SALT_MOUNT_DIR),
        &|_| false,
    );
    let listen = json!({
        "http": format!("0.0.0.0:{}", contract::PICKER_HTTP_PORT),
        "metrics": format!("0.0.0.0:{}", contract::PICKER_METRICS_PORT),
        "admin": format!("127.0.0.1:{}", contract::PICKER_ADMIN_PORT),
        "extProc": format!("0.0.0.0:{}", contract::PICKER_EXT_PROC_PORT),
    });
    let name = pool.name_any();
    let namespace = pool
        .namespace()
        .ok_or(Error::MissingObjectKey("metadata.namespace"))?;
    // replicas find each other through the headless Service of the picker pods
    let peers = json!({
        "listen": format!("0.0.0.0:{}", contract::PICKER_PEER_PORT),
        "dns": format!(
            "{}.{namespace}.svc:{}",
            contract::picker_peers_name(&name),
            contract::PICKER_PEER_PORT
        ),
        "group": format!("{namespace}/{name}"),
    });
    let mut peers = peers;
    if keyed {
        peers["keyFile"] = json!(format!(
            "{}/{}",
            contract::PEER_KEY_MOUNT_DIR,
            contract::PEER_KEY_FILE
        ));
    }
    let doc = json!({
        "listen": listen,
        "modelConfigs": to_value("modelConfigs", &model_configs)?,
        "routing": to_value("routing", &pool.spec.routing)?,
        "tenancy": to_value("tenancy", &tenancy)?,
        "peers": peers,
        // the snapshot outlives a container restart in its pod; a new pod copies a peer's
        "warmStart": {
            "snapshotPath": format!("{}/{}", contract::WARM_START_DIR, contract::WARM_START_SNAPSHOT),
        },
    });
    // what a picker reads only at startup: a change rolls the pickers
    let static_hash = hash_of(&json!({
        "listen": doc["listen"],
        "peers": doc["peers"],
        "warmStart": doc["warmStart"],
    }))?;
    let yaml = serde_yaml_ng::to_string(&doc).map_err(Error::RenderYaml)?;
    Ok((
        format!(
            "# Rendered by kvroute-operator for KVRoutePool {}; edits are overwritten.\n{yaml}",
            name
        ),
        static_hash,
    ))
}

fn to_value<T: Serialize>(what: &'static str, v: &T) -> Result<Value> {
    serde_json::to_value(v).map_err(|source| Error::Render { what, source })
}

fn from_json<T: serde::de::DeserializeOwned>(what: &'static str, v: Value) -> Result<T> {
    serde_json::from_value(v).map_err(|source| Error::Render { what, source })
}

fn picker_deployment(
    pool: &KVRoutePool,
    namespace: &str,
    owner: &OwnerReference,
    settings: &BuildSettings,
    config_hash: &str,
) -> Result<Deployment> {
    let name = pool.name_any();
    let picker = &pool.spec.picker;
    let obj_name = contract::picker_name(&name);
    let mut volumes = vec![json!({
        "name": "config",
        "configMap": {"name": obj_name},
    })];
    let mut mounts = vec![json!({
        "name": "config",
        "mountPath": contract::PICKER_CONFIG_DIR,
        "readOnly": true,
    })];
    let tokenizer_maps: BTreeSet<&str> = pool
        .spec
        .model_configs
        .iter()
        .filter_map(|mc| mc.tokenizer.as_ref()?.config_map.as_deref())
        .collect();
    for (i, cm) in tokenizer_maps.iter().enumerate() {
        let vol = format!("tokenizer-{i}");
        volumes.push(json!({"name": vol, "configMap": {"name": cm}}));
        mounts.push(json!({
            "name": vol,
            "mountPath": contract::tokenizer_dir(std::path::Path::new(contract::TOKENIZER_MOUNT_ROOT), cm).display().to_string(),
            "readOnly": true,
        }));
    }
    volumes.push(json!({
        "name": "warm-start",
        "emptyDir": {"sizeLimit": contract::WARM_START_SIZE_LIMIT},
    }));
    mounts.push(json!({"name": "warm-start", "mountPath": contract::WARM_START_DIR}));
    if settings.peer_key_seed.is_some() {
        volumes.push(json!({
            "name": "peer-key",
            "secret": {"secretName": contract::picker_peers_name(&name)},
        }));
        mounts.push(
            json!({"name": "peer-key", "mountPath": contract::PEER_KEY_MOUNT_DIR, "readOnly": true}),
        );
    }
    if let Some(s) = &picker.salt_secret_ref {
        volumes.push(json!({
            "name": "salt",
            "secret": {"secretName": s.name, "items": [{"key": s.key, "path": contract::SALT_FILE}]},
        }));
        mounts
            .push(json!({"name": "salt", "mountPath": contract::SALT_MOUNT_DIR, "readOnly": true}));
    }
    let mut container = json!({
        "name": "picker",
        "image": picker.image.clone().unwrap_or_else(|| settings.picker_image.clone()),
        "args": [
            "--config", format!("{}/{}", contract::PICKER_CONFIG_DIR, contract::PICKER_CONFIG_KEY),
            "--pool", name,
            "--namespace", namespace,
            "--log-json",
        ],
        "ports": [
            {"name": "http", "containerPort": contract::PICKER_HTTP_PORT, "protocol": "TCP"},
            {"name": "ext-proc", "containerPort": contract::PICKER_EXT_PROC_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": contract::PICKER_METRICS_PORT, "protocol": "TCP"},
            {"name": "peers", "containerPort": contract::PICKER_PEER_PORT, "protocol": "UDP"},
        ],
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": "metrics"},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "metrics"},
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
        "securityContext": {
            "allowPrivilegeEscalation": false,
            "readOnlyRootFilesystem": true,
            "runAsNonRoot": true,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": mounts,
    });
    if let Some(p) = picker.image_pull_policy {
        container["imagePullPolicy"] = json!(p.as_str());
    }
    if let Some(level) = &picker.log_level {
        container["env"] = json!([{"name": "RUST_LOG", "value": level}]);
    }
    if let Some(r) = picker
        .resources
        .as_ref()
        .or(settings.picker_resources.as_ref())
    {
        container["resources"] = to_value("picker resources", r)?;
    }
    let service_account = picker
        .service_account_name
        .clone()
        .unwrap_or_else(|| obj_name.clone());
    let mut template_labels = picker_labels(&name);
    template_labels.remove(contract::LABEL_MANAGED_BY);
    let deployment = json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(obj_name, namespace, picker_labels(&name), owner),
        "spec": {
            "replicas": picker.replicas,
            "selector": {"matchLabels": picker_selector(&name)},
            "template": {
                "metadata": {
                    "labels": template_labels,
                    "annotations": {contract::ANNOTATION_CONFIG_HASH: config_hash},
                },
                "spec": {
                    "serviceAccountName": service_account,
                    "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    });
    stamp(from_json("picker Deployment", deployment)?)
}

fn picker_service(pool: &KVRoutePool, namespace: &str, owner: &OwnerReference) -> Result<Service> {
    let name = pool.name_any();
    let service = json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(contract::picker_name(&name), namespace, picker_labels(&name), owner),
        "spec": {
            "type": "ClusterIP",
            "selector": picker_selector(&name),
            "ports": [
                {"name": "http", "port": contract::PICKER_HTTP_PORT, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"},
                {"name": "ext-proc", "port": contract::PICKER_EXT_PROC_PORT, "targetPort": "ext-proc", "protocol": "TCP", "appProtocol": "kubernetes.io/h2c"},
                {"name": "metrics", "port": contract::PICKER_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP", "appProtocol": "http"},
            ],
        },
    });
    stamp(from_json("picker Service", service)?)
}

/// The headless Service of the picker pods, for the replicas' in-flight exchange: its DNS
/// name returns every pod, ready or not (a replica that starts hears its peers at once).
fn picker_peers_service(
    pool: &KVRoutePool,
    namespace: &str,
    owner: &OwnerReference,
) -> Result<Service> {
    let name = pool.name_any();
    let service = json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(contract::picker_peers_name(&name), namespace, picker_labels(&name), owner),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": true,
            "selector": picker_selector(&name),
            "ports": [
                {"name": "peers", "port": contract::PICKER_PEER_PORT, "targetPort": "peers", "protocol": "UDP"},
            ],
        },
    });
    stamp(from_json("picker peers Service", service)?)
}

fn picker_rbac(
    pool: &KVRoutePool,
    namespace: &str,
    owner: &OwnerReference,
) -> Result<(ServiceAccount, Role, RoleBinding)> {
    let name = pool.name_any();
    let obj_name = contract::picker_name(&name);
    let sa = stamp(ServiceAccount {
        metadata: meta(obj_name.clone(), namespace, picker_labels(&name), owner),
        ..ServiceAccount::default()
    })?;
    let role = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": meta(obj_name.clone(), namespace, picker_labels(&name), owner),
        "rules": [
            {
                "apiGroups": [contract::GROUP],
                "resources": ["kvroutepools"],
                "resourceNames": [name],
                "verbs": ["get", "list", "watch"],
            },
            {
                "apiGroups": ["inference.networking.x-k8s.io"],
                "resources": ["inferencemodelrewrites", "inferenceobjectives"],
                "verbs": ["get", "list", "watch"],
            },
            {
                "apiGroups": ["discovery.k8s.io"],
                "resources": ["endpointslices"],
                "verbs": ["get", "list", "watch"],
            },
        ],
    });
    let binding = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": meta(obj_name.clone(), namespace, picker_labels(&name), owner),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": obj_name},
        "subjects": [{"kind": "ServiceAccount", "name": obj_name, "namespace": namespace}],
    });
    Ok((
        sa,
        stamp(from_json("picker Role", role)?)?,
        stamp(from_json("picker RoleBinding", binding)?)?,
    ))
}

fn gateway_pools(
    pool: &KVRoutePool,
    namespace: &str,
    owner: &OwnerReference,
) -> Result<Vec<DynamicObject>> {
    let Some(gw) = pool.spec.gateway.filter(|g| g.export_inference_pool) else {
        return Ok(Vec::new());
    };
    let name = pool.name_any();
    let failure_mode = match gw.failure_mode.unwrap_or(FailureMode::FailClose) {
        FailureMode::FailOpen => "FailOpen",
        FailureMode::FailClose => "FailClose",
    };
    let ar = gateway_pool_resource();
    let mut out = Vec::new();
    for mc in &pool.spec.model_configs {
        let mut selector = pool.spec.selector_labels().clone();
        selector.extend(mc.pod_selector.clone());
        let ports: BTreeSet<u16> = match mc.data_parallel.rank_selection {
            RankSelection::Header => BTreeSet::from([mc.port]),
            RankSelection::Port => mc.rank_ports().into_iter().map(|(p, _)| p).collect(),
        };
        let mut labels = labels(&[
            (contract::LABEL_MANAGED_BY, contract::MANAGED_BY),
            (contract::LABEL_POOL, &name),
            (contract::LABEL_MODEL_CONFIG, &mc.name),
        ]);
        labels.insert(contract::LABEL_COMPONENT.into(), "gateway".into());
        let mut obj = DynamicObject::new(&contract::gateway_pool_name(&name, &mc.name), &ar)
            .within(namespace)
            .data(json!({
                "spec": {
                    "selector": {"matchLabels": selector},
                    "targetPorts": ports.iter().map(|p| json!({"number": p})).collect::<Vec<_>>(),
                    "endpointPickerRef": {
                        "group": "",
                        "kind": "Service",
                        "name": contract::picker_name(&name),
                        "port": {"number": contract::PICKER_EXT_PROC_PORT},
                        "failureMode": failure_mode,
                    },
                },
            }));
        obj.metadata.labels = Some(labels);
        obj.metadata.owner_references = Some(vec![owner.clone()]);
        out.push(stamp(obj)?);
    }
    Ok(out)
}

/// Build everything a valid pool should own.
pub fn build(
    pool: &KVRoutePool,
    resolved: &[ConfigEndpoints],
    settings: &BuildSettings,
) -> Result<Desired> {
    let namespace = pool
        .namespace()
        .ok_or(Error::MissingObjectKey("metadata.namespace"))?;
    let owner = owner(pool)?;
    let name = pool.name_any();
    let tenant_keys = !crate::eligibility::tenant_label_keys(&pool.spec).is_empty();
    let mut slices = Vec::new();
    let mut slice_names = BTreeMap::new();
    for mc in &pool.spec.model_configs {
        let empty = ConfigEndpoints::default();
        let eps = resolved
            .iter()
            .find(|c| c.name == mc.name)
            .unwrap_or(&empty);
        let s = config_slices(pool, &namespace, &owner, mc, eps, tenant_keys)?;
        slice_names.insert(
            mc.name.clone(),
            s.iter().map(|s| s.name_any()).collect::<Vec<_>>(),
        );
        slices.extend(s);
    }
    let (config_text, config_hash) = render_picker_config(pool, settings.peer_key_seed.is_some())?;
    let peer_secret = match &settings.peer_key_seed {
        Some(seed) => {
            let uid = pool.uid().ok_or(Error::MissingObjectKey("metadata.uid"))?;
            Some(stamp(Secret {
                metadata: meta(
                    contract::picker_peers_name(&name),
                    &namespace,
                    picker_labels(&name),
                    &owner,
                ),
                string_data: None,
                data: Some(BTreeMap::from([(
                    contract::PEER_KEY_FILE.to_owned(),
                    k8s_openapi::ByteString(seed.pool_key(&uid).into_bytes()),
                )])),
                ..Secret::default()
            })?)
        }
        None => None,
    };
    let config_map = stamp(ConfigMap {
        metadata: meta(
            contract::picker_name(&name),
            &namespace,
            picker_labels(&name),
            &owner,
        ),
        data: Some(BTreeMap::from([(
            contract::PICKER_CONFIG_KEY.to_owned(),
            config_text,
        )])),
        ..ConfigMap::default()
    })?;
    let rbac = match pool.spec.picker.service_account_name {
        Some(_) => None,
        None => Some(picker_rbac(pool, &namespace, &owner)?),
    };
    Ok(Desired {
        slices,
        config_map,
        rbac,
        deployment: picker_deployment(pool, &namespace, &owner, settings, &config_hash)?,
        service: picker_service(pool, &namespace, &owner)?,
        peer_service: picker_peers_service(pool, &namespace, &owner)?,
        peer_secret,
        gateway_pools: gateway_pools(pool, &namespace, &owner)?,
        slice_names,
    })
}
