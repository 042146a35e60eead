//! Reconcile against a mocked API server, asserting the exact requests: paths, field
//! manager, content type and bodies.

mod common;

use std::sync::Arc;

use common::*;
use k8s_openapi::api::apps::v1::{Deployment, DeploymentStatus};
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service, ServiceAccount};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::runtime::controller::Action;
use kube::runtime::events::{Recorder, Reporter};
use kvroute_crds::kvroute_pool::{KVRoutePool, KVRoutePoolStatus, condition};
use kvroute_operator::desired::{BuildSettings, build};
use kvroute_operator::eligibility::resolve;
use kvroute_operator::metrics::Metrics;
use kvroute_operator::reconcile::{Context, GatewayDiscovery, Stores, reconcile_pool};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

const BASE: &str = "/apis/kvroute.dev/v1alpha1/namespaces/serving/kvroutepools/llama";

/// The live state: pods, and owned objects as the API server holds them.
#[derive(Default, Clone)]
struct Live {
    pods: Vec<Pod>,
    slices: Vec<EndpointSlice>,
    config_maps: Vec<ConfigMap>,
    service_accounts: Vec<ServiceAccount>,
    roles: Vec<Role>,
    role_bindings: Vec<RoleBinding>,
    deployments: Vec<Deployment>,
    services: Vec<Service>,
}

impl Live {
    fn stores(&self) -> Stores {
        Stores {
            pods: store_of(self.pods.clone()),
            slices: store_of(self.slices.clone()),
            config_maps: store_of(self.config_maps.clone()),
            service_accounts: store_of(self.service_accounts.clone()),
            roles: store_of(self.roles.clone()),
            role_bindings: store_of(self.role_bindings.clone()),
            deployments: store_of(self.deployments.clone()),
            services: store_of(self.services.clone()),
        }
    }

    /// Record what the requests wrote, as the API server would hold it (with the fields it
    /// adds), and the pool's new status.
    fn absorb(&mut self, requests: &[Recorded], pool: &mut KVRoutePool) {
        fn put<K: DeserializeOwned + kube::Resource>(list: &mut Vec<K>, body: &Value) {
            let obj: K = serde_json::from_value(body.clone()).expect("typed object");
            list.retain(|o| o.meta().name != obj.meta().name);
            list.push(obj);
        }
        for r in requests {
            let p = r.path();
            match r.method.as_str() {
                "PATCH" if p.ends_with("/status") => {
                    pool.status = Some(
                        serde_json::from_value::<KVRoutePoolStatus>(r.body["status"].clone())
                            .expect("status"),
                    );
                }
                "PATCH" if p.contains("/endpointslices/") => put(&mut self.slices, &r.body),
                "PATCH" if p.contains("/configmaps/") => put(&mut self.config_maps, &r.body),
                "PATCH" if p.contains("/serviceaccounts/") => {
                    put(&mut self.service_accounts, &r.body)
                }
                "PATCH" if p.contains("/rolebindings/") => put(&mut self.role_bindings, &r.body),
                "PATCH" if p.contains("/roles/") => put(&mut self.roles, &r.body),
                "PATCH" if p.contains("/services/") => {
                    // the API server allocates an address unless the Service is headless
                    let mut b = r.body.clone();
                    if b["spec"]["clusterIP"].is_null() {
                        b["spec"]["clusterIP"] = json!("10.96.0.10");
                    }
                    put(&mut self.services, &b);
                }
                "PATCH" if p.contains("/deployments/") => {
                    put(&mut self.deployments, &r.body);
                    if let Some(d) = self.deployments.last_mut() {
                        d.status = Some(DeploymentStatus {
                            replicas: Some(1),
                            available_replicas: Some(1),
                            ready_replicas: Some(1),
                            ..DeploymentStatus::default()
                        });
                    }
                }
                "DELETE" if p.contains("/endpointslices/") => {
                    let name = p.rsplit('/').next().unwrap_or_default();
                    self.slices
                        .retain(|s| s.metadata.name.as_deref() != Some(name));
                }
                _ => {}
            }
        }
    }
}

fn context(api: &MockApi, live: &Live) -> Context {
    Context {
        client: api.client.clone(),
        stores: live.stores(),
        settings: BuildSettings::default(),
        metrics: Arc::new(Metrics::default()),
        recorder: Recorder::new(
            api.client.clone(),
            Reporter {
                controller: "kvroute-operator".into(),
                instance: Some("test".into()),
            },
        ),
        gateway: GatewayDiscovery::fixed(false),
        now: Box::new(fixed_time),
    }
}

/// Reconcile once; return the action and the requests it made.
async fn reconcile_once(pool: &KVRoutePool, live: &Live) -> (Action, Vec<Recorded>) {
    let api = MockApi::start(pool);
    let ctx = context(&api, live);
    let action = reconcile_pool(pool, &ctx).await.expect("reconcile");
    (action, api.requests())
}

fn pods() -> Vec<Pod> {
    vec![
        mk_pod("vllm-0").ip("10.0.0.1").ready().build(),
        mk_pod("vllm-1").ip("10.0.0.2").ready().build(),
    ]
}

/// A pool reconciled once with `pods`: the state every scenario starts from.
async fn settled(spec: Value, pods: Vec<Pod>) -> (KVRoutePool, Live) {
    let mut pool = mk_pool(spec);
    let mut live = Live {
        pods,
        ..Live::default()
    };
    let (_, reqs) = reconcile_once(&pool, &live).await;
    live.absorb(&reqs, &mut pool);
    // the status write lands on the pool; the picker became available meanwhile
    let (_, reqs) = reconcile_once(&pool, &live).await;
    live.absorb(&reqs, &mut pool);
    (pool, live)
}

#[track_caller]
fn assert_apply(r: &Recorded) {
    assert_eq!(r.method, "PATCH", "{}", r.uri);
    assert_eq!(
        r.content_type.as_deref(),
        Some("application/apply-patch+yaml"),
        "{}",
        r.uri
    );
    let q = r.query();
    assert_eq!(
        q.get("fieldManager").map(String::as_str),
        Some("kvroute-operator")
    );
    assert_eq!(q.get("force").map(String::as_str), Some("true"));
}

fn cond<'a>(s: &'a KVRoutePoolStatus, t: &str) -> (&'a str, &'a str) {
    let c = s.condition(t).expect("condition");
    (c.status.as_str(), c.reason.as_str())
}

#[tokio::test]
async fn first_reconcile_applies_everything_then_the_status() {
    let pool = mk_pool(base_spec());
    let live = Live {
        pods: pods(),
        ..Live::default()
    };
    let (action, reqs) = reconcile_once(&pool, &live).await;
    assert_eq!(action, Action::requeue(kvroute_operator::reconcile::RESYNC));
    let paths: Vec<String> = reqs.iter().map(Recorded::short).collect();
    assert_eq!(
        paths,
        [
            "PATCH /api/v1/namespaces/serving/serviceaccounts/llama-picker",
            "PATCH /apis/rbac.authorization.k8s.io/v1/namespaces/serving/roles/llama-picker",
            "PATCH /apis/rbac.authorization.k8s.io/v1/namespaces/serving/rolebindings/llama-picker",
            "PATCH /api/v1/namespaces/serving/configmaps/llama-picker",
            "PATCH /api/v1/namespaces/serving/services/llama-picker",
            "PATCH /api/v1/namespaces/serving/services/llama-peers",
            "PATCH /apis/apps/v1/namespaces/serving/deployments/llama-picker",
            "PATCH /apis/discovery.k8s.io/v1/namespaces/serving/endpointslices/llama-llama-0",
            &format!("PATCH {BASE}/status"),
        ]
    );
    reqs.iter().for_each(assert_apply);

    // bodies are exactly the desired objects
    let desired = build(
        &pool,
        &resolve(&pool.spec, NS, &pods()),
        &BuildSettings::default(),
    )
    .expect("build");
    let (sa, role, binding) = desired.rbac.clone().expect("rbac");
    let expected = [
        serde_json::to_value(&sa),
        serde_json::to_value(&role),
        serde_json::to_value(&binding),
        serde_json::to_value(&desired.config_map),
        serde_json::to_value(&desired.service),
        serde_json::to_value(&desired.peer_service),
        serde_json::to_value(&desired.deployment),
        serde_json::to_value(&desired.slices[0]),
    ];
    for (r, e) in reqs.iter().zip(expected) {
        assert_eq!(r.body, e.expect("json"), "{}", r.uri);
    }
    let slice = &reqs[7].body;
    assert_eq!(
        slice["ports"][1],
        json!({"name": "rank-1", "port": 8000, "protocol": "TCP", "appProtocol": "http"})
    );
    assert_eq!(slice["endpoints"][1]["addresses"], json!(["10.0.0.2"]));

    // status: two eligible pods, four ranks; the picker does not exist yet
    let status = &reqs[8].body;
    assert_eq!(status["apiVersion"], "kvroute.dev/v1alpha1");
    assert_eq!(status["kind"], "KVRoutePool");
    let s: KVRoutePoolStatus = serde_json::from_value(status["status"].clone()).expect("status");
    assert_eq!(s.observed_generation, Some(1));
    assert_eq!(s.ready_endpoints, 4);
    assert_eq!(
        (
            s.model_configs[0].eligible_pods,
            s.model_configs[0].eligible_ranks
        ),
        (2, 4)
    );
    assert_eq!(s.model_configs[0].endpoint_slices, ["llama-llama-0"]);
    assert_eq!(cond(&s, condition::CONFIG_VALID), ("True", "Valid"));
    assert_eq!(
        cond(&s, condition::ENDPOINTS_RESOLVED),
        ("True", "Resolved")
    );
    assert_eq!(cond(&s, condition::PICKER_AVAILABLE), ("False", "Pending"));
    assert_eq!(cond(&s, condition::READY), ("False", "PickerUnavailable"));
    assert_eq!(
        s.conditions[0].last_transition_time,
        fixed_time(),
        "transition times come from the context's clock"
    );
}

#[tokio::test]
async fn second_reconcile_with_nothing_changed_sends_nothing() {
    let (pool, live) = settled(base_spec(), pods()).await;
    let s = pool.status.as_ref().expect("status");
    assert_eq!(cond(s, condition::READY), ("True", "Ready"));
    let (_, reqs) = reconcile_once(&pool, &live).await;
    assert!(
        reqs.is_empty(),
        "{:?}",
        reqs.iter().map(Recorded::short).collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn a_hand_edit_of_an_owned_field_is_reverted() {
    let (pool, mut live) = settled(base_spec(), pods()).await;
    if let Some(spec) = live.deployments[0].spec.as_mut() {
        spec.replicas = Some(5);
    }
    let (_, reqs) = reconcile_once(&pool, &live).await;
    assert_eq!(
        reqs.iter().map(Recorded::short).collect::<Vec<_>>(),
        ["PATCH /apis/apps/v1/namespaces/serving/deployments/llama-picker"]
    );
    assert_eq!(reqs[0].body["spec"]["replicas"], 1);
}

#[tokio::test]
async fn a_weight_change_rewrites_only_the_config_map_and_the_status() {
    let (mut pool, live) = settled(base_spec(), pods()).await;
    pool.spec.routing.weights.queue = 9.0;
    pool.metadata.generation = Some(2);
    let (_, reqs) = reconcile_once(&pool, &live).await;
    assert_eq!(
        reqs.iter().map(Recorded::short).collect::<Vec<_>>(),
        [
            "PATCH /api/v1/namespaces/serving/configmaps/llama-picker".to_owned(),
            format!("PATCH {BASE}/status"),
        ]
    );
    reqs.iter().for_each(assert_apply);
    let yaml = reqs[0].body["data"]["picker.yaml"].as_str().expect("yaml");
    assert!(yaml.contains("queue: 9.0"), "{yaml}");
    let s: KVRoutePoolStatus =
        serde_json::from_value(reqs[1].body["status"].clone()).expect("status");
    assert_eq!(s.observed_generation, Some(2));
    // only the generation moved: transition times stay
    let before = pool.status.as_ref().expect("status");
    for c in &s.conditions {
        let b = before.condition(&c.type_).expect("condition");
        assert_eq!(
            (&c.status, &c.last_transition_time),
            (&b.status, &b.last_transition_time)
        );
    }
}

#[tokio::test]
async fn a_pod_added_then_removed_updates_the_slice_and_the_status() {
    let (mut pool, mut live) = settled(base_spec(), pods()).await;
    live.pods
        .push(mk_pod("vllm-2").ip("10.0.0.3").ready().build());
    let (_, reqs) = reconcile_once(&pool, &live).await;
    assert_eq!(
        reqs.iter().map(Recorded::short).collect::<Vec<_>>(),
        [
            "PATCH /apis/discovery.k8s.io/v1/namespaces/serving/endpointslices/llama-llama-0"
                .to_owned(),
            format!("PATCH {BASE}/status"),
        ]
    );
    let addrs: Vec<&str> = reqs[0].body["endpoints"]
        .as_array()
        .expect("endpoints")
        .iter()
        .filter_map(|e| e["addresses"][0].as_str())
        .collect();
    assert_eq!(addrs, ["10.0.0.1", "10.0.0.2", "10.0.0.3"]);
    assert_eq!(reqs[1].body["status"]["readyEndpoints"], 6);
    live.absorb(&reqs, &mut pool);

    // the pod starts terminating: still listed, not ready, terminating
    live.pods[2] = mk_pod("vllm-2")
        .ip("10.0.0.3")
        .ready()
        .terminating()
        .build();
    let (_, reqs) = reconcile_once(&pool, &live).await;
    assert_eq!(reqs.len(), 2);
    assert_eq!(
        reqs[0].body["endpoints"][2]["conditions"],
        json!({"ready": false, "serving": true, "terminating": true})
    );
    assert_eq!(reqs[1].body["status"]["readyEndpoints"], 4);
    live.absorb(&reqs, &mut pool);

    // and goes
    live.pods.pop();
    let (_, reqs) = reconcile_once(&pool, &live).await;
    assert_eq!(reqs.len(), 2);
    assert_eq!(reqs[0].body["endpoints"].as_array().map(Vec::len), Some(2));
    assert_eq!(
        reqs[1].body["status"]["modelConfigs"][0]["ineligiblePods"],
        0
    );
}

#[tokio::test]
async fn an_incompatible_pod_is_excluded_reported_and_announced_once() {
    let (mut pool, mut live) = settled(base_spec(), pods()).await;
    live.pods[1] = mk_pod("vllm-1")
        .ip("10.0.0.2")
        .ready()
        .label("kvroute.dev/dp-size", "4")
        .build();
    let (_, reqs) = reconcile_once(&pool, &live).await;
    assert_eq!(
        reqs.iter().map(Recorded::short).collect::<Vec<_>>(),
        [
            "PATCH /apis/discovery.k8s.io/v1/namespaces/serving/endpointslices/llama-llama-0"
                .to_owned(),
            format!("PATCH {BASE}/status"),
            "POST /apis/events.k8s.io/v1/namespaces/serving/events".to_owned(),
        ]
    );
    assert_eq!(reqs[0].body["endpoints"].as_array().map(Vec::len), Some(1));
    let mc = &reqs[1].body["status"]["modelConfigs"][0];
    assert_eq!(mc["eligiblePods"], 1);
    assert_eq!(mc["ineligiblePods"], 1);
    assert_eq!(mc["ineligible"][0]["pod"], "vllm-1");
    assert_eq!(mc["ineligible"][0]["reason"], "DataParallelMismatch");
    let ev = &reqs[2].body;
    assert_eq!(ev["type"], "Warning");
    assert_eq!(ev["reason"], "DataParallelMismatch");
    assert_eq!(ev["regarding"]["kind"], "KVRoutePool");
    assert_eq!(ev["regarding"]["name"], "llama");
    assert!(
        ev["note"].as_str().unwrap_or_default().contains("vllm-1"),
        "{ev}"
    );
    live.absorb(&reqs, &mut pool);
    // nothing new: no second event, no writes
    let (_, reqs) = reconcile_once(&pool, &live).await;
    assert!(
        reqs.is_empty(),
        "{:?}",
        reqs.iter().map(Recorded::short).collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn an_invalid_spec_touches_nothing_but_the_status() {
    let (mut pool, live) = settled(base_spec(), pods()).await;
    // what an older CRD without the CEL rule would admit
    pool.spec.routing.weights = serde_json::from_value(json!({
        "prefixCache": 0, "queue": 0, "kvUtilization": 0, "inflight": 0, "sessionAffinity": 0
    }))
    .expect("weights");
    pool.metadata.generation = Some(2);
    let (action, reqs) = reconcile_once(&pool, &live).await;
    assert_eq!(action, Action::await_change());
    assert_eq!(
        reqs.iter().map(Recorded::short).collect::<Vec<_>>(),
        [
            format!("PATCH {BASE}/status"),
            "POST /apis/events.k8s.io/v1/namespaces/serving/events".to_owned(),
        ]
    );
    let s: KVRoutePoolStatus =
        serde_json::from_value(reqs[0].body["status"].clone()).expect("status");
    assert_eq!(cond(&s, condition::CONFIG_VALID), ("False", "InvalidSpec"));
    assert!(
        s.condition(condition::CONFIG_VALID)
            .is_some_and(|c| c.message.contains("at least one weight")),
        "{s:?}"
    );
    assert_eq!(cond(&s, condition::READY), ("False", "ConfigInvalid"));
    assert_eq!(
        s.ready_endpoints, 4,
        "the last valid state is still what runs"
    );
    assert_eq!(reqs[1].body["reason"], "InvalidSpec");
}

#[tokio::test]
async fn a_removed_model_config_loses_its_slices() {
    let mut spec = base_spec();
    spec["modelConfigs"]
        .as_array_mut()
        .expect("array")
        .push(json!({"name": "mistral", "model": "mistral"}));
    let (mut pool, live) = settled(spec, pods()).await;
    assert_eq!(live.slices.len(), 2);
    pool.spec.model_configs.pop();
    pool.metadata.generation = Some(2);
    let (_, reqs) = reconcile_once(&pool, &live).await;
    assert_eq!(
        reqs.iter().map(Recorded::short).collect::<Vec<_>>(),
        [
            "PATCH /api/v1/namespaces/serving/configmaps/llama-picker".to_owned(),
            "DELETE /apis/discovery.k8s.io/v1/namespaces/serving/endpointslices/llama-mistral-0"
                .to_owned(),
            format!("PATCH {BASE}/status"),
        ]
    );
    assert_eq!(reqs[1].body["propagationPolicy"], "Background");
}

#[tokio::test]
async fn a_pool_being_deleted_is_left_to_garbage_collection() {
    let (mut pool, live) = settled(base_spec(), pods()).await;
    // everything it owns carries a controller owner reference to it
    for owned in live
        .slices
        .iter()
        .map(|o| &o.metadata)
        .chain(live.config_maps.iter().map(|o| &o.metadata))
        .chain(live.deployments.iter().map(|o| &o.metadata))
        .chain(live.services.iter().map(|o| &o.metadata))
        .chain(live.service_accounts.iter().map(|o| &o.metadata))
        .chain(live.roles.iter().map(|o| &o.metadata))
        .chain(live.role_bindings.iter().map(|o| &o.metadata))
    {
        let refs = owned.owner_references.as_deref().unwrap_or_default();
        assert!(
            refs.iter()
                .any(|r| r.uid == POOL_UID && r.controller == Some(true)),
            "{:?}",
            owned.name
        );
    }
    assert!(
        pool.metadata.finalizers.is_none(),
        "no finalizer: nothing outside Kubernetes"
    );
    pool.metadata.deletion_timestamp = Some(fixed_time());
    let (action, reqs) = reconcile_once(&pool, &live).await;
    assert_eq!(action, Action::await_change());
    assert!(reqs.is_empty());
}

#[tokio::test]
async fn a_requested_gateway_export_is_applied_when_the_crd_exists() {
    let mut spec = base_spec();
    spec["gateway"] = json!({"exportInferencePool": true});
    let (pool, live) = settled(spec, pods()).await;
    // settled without the CRD: the condition says so
    let s = pool.status.as_ref().expect("status");
    assert_eq!(
        cond(s, condition::GATEWAY_EXPORTED),
        ("False", "NotSupported")
    );

    let api = MockApi::start(&pool);
    let mut ctx = context(&api, &live);
    ctx.gateway = GatewayDiscovery::fixed(true);
    reconcile_pool(&pool, &ctx).await.expect("reconcile");
    let reqs = api.requests();
    let gw = "/apis/inference.networking.k8s.io/v1/namespaces/serving/inferencepools";
    assert_eq!(
        reqs.iter().map(Recorded::short).collect::<Vec<_>>(),
        [
            format!("GET {gw}/llama-llama"),
            format!("PATCH {gw}/llama-llama"),
            format!("GET {gw}"),
            format!("PATCH {BASE}/status"),
        ]
    );
    assert_apply(&reqs[1]);
    assert_eq!(reqs[1].body["kind"], "InferencePool");
    assert_eq!(
        reqs[1].body["spec"]["endpointPickerRef"]["name"],
        "llama-picker"
    );
    assert_eq!(
        reqs[2].query().get("labelSelector").map(String::as_str),
        Some("kvroute.dev%2Fpool%3Dllama")
    );
    let s: KVRoutePoolStatus =
        serde_json::from_value(reqs[3].body["status"].clone()).expect("status");
    assert_eq!(cond(&s, condition::GATEWAY_EXPORTED), ("True", "Exported"));
}
