//! End-to-end on a real API server (see `kvroute_e2e::cluster`): a sample pool and its model
//! servers become eligibility sets and a running picker; invalid pools are rejected by
//! `kubectl apply`, incompatible pods reported; deleting a pool garbage-collects what it owns.
//!
//! Needs the control-plane binaries of `scripts/k8s-bins.sh`.
#![allow(clippy::unwrap_used)]

mod k8s_support;

use anyhow::bail;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service, ServiceAccount};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::Api;
use kube::api::ListParams;
use kvroute_crds::KVRoutePool;
use kvroute_crds::contract;
use kvroute_e2e::cluster::wait;
use serde_json::json;

use k8s_support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sample_pool_and_servers_become_eligibility_sets_and_a_picker() {
    let c = cluster();
    c.ensure_operator().await.unwrap();
    let ns = c.namespace("pool").await.unwrap();
    let client = client().await;
    apply(&ns.name, &sample("llama-vllm-dp-header.yaml"));
    apply(&ns.name, &llama_servers(2));

    // 2 pods x 2 data-parallel ranks
    let pool = wait_pool_eligible(&client, &ns.name, "llama", "llama", 2, 4).await;
    let status = pool.status.unwrap();
    assert_eq!(status.ready_endpoints, 4, "{status:?}");
    let mc = &status.model_configs[0];
    assert_eq!(mc.ineligible_pods, 0, "{mc:?}");
    assert!(!mc.endpoint_slices.is_empty(), "{mc:?}");

    // the pods are Ready through the node agent, each on its own address
    let servers = ready_pods(&client, &ns.name, "app.kubernetes.io/name=vllm-llama").await;
    assert_eq!(servers.len(), 2);
    let ips: std::collections::BTreeSet<String> = servers.iter().map(pod_ip).collect();
    assert_eq!(ips.len(), 2, "{ips:?}");

    // EndpointSlices: every pod, every rank as a named port
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), &ns.name);
    let listed = slices
        .list(&ListParams::default().labels(&format!("{}=llama", contract::LABEL_POOL)))
        .await
        .unwrap();
    let addresses: std::collections::BTreeSet<String> = listed
        .items
        .iter()
        .flat_map(|s| s.endpoints.iter().flatten())
        .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
        .flat_map(|e| e.addresses.iter().cloned())
        .collect();
    assert_eq!(addresses, ips);
    let ports: std::collections::BTreeSet<String> = listed
        .items
        .iter()
        .flat_map(|s| s.ports.iter().flatten())
        .filter_map(|p| Some(format!("{}={}", p.name.clone()?, p.port?)))
        .collect();
    assert_eq!(
        ports,
        ["rank-0=8000", "rank-1=8000"].map(String::from).into(),
        "header rank selection: both ranks share the port"
    );

    // the picker's objects exist and its pod runs (as the operator's own Deployment says)
    let name = contract::picker_name("llama");
    Api::<Deployment>::namespaced(client.clone(), &ns.name)
        .get(&name)
        .await
        .unwrap();
    Api::<Service>::namespaced(client.clone(), &ns.name)
        .get(&name)
        .await
        .unwrap();
    // and the headless Service through which its replicas find each other
    let peers = Api::<Service>::namespaced(client.clone(), &ns.name)
        .get(&contract::picker_peers_name("llama"))
        .await
        .unwrap();
    let spec = peers.spec.unwrap();
    assert_eq!(spec.cluster_ip.as_deref(), Some("None"), "headless");
    assert_eq!(spec.ports.unwrap()[0].protocol.as_deref(), Some("UDP"));
    // the pool's peer key, derived from the operator's seed, which the pickers mount
    let key = Api::<Secret>::namespaced(client.clone(), &ns.name)
        .get(&contract::picker_peers_name("llama"))
        .await
        .unwrap();
    assert_eq!(
        key.data.unwrap()[contract::PEER_KEY_FILE].0.len(),
        64,
        "HMAC-SHA256 of the pool's uid, in hex"
    );
    Api::<ConfigMap>::namespaced(client.clone(), &ns.name)
        .get(&name)
        .await
        .unwrap();
    Api::<ServiceAccount>::namespaced(client.clone(), &ns.name)
        .get(&name)
        .await
        .unwrap();
    Api::<Role>::namespaced(client.clone(), &ns.name)
        .get(&name)
        .await
        .unwrap();
    Api::<RoleBinding>::namespaced(client.clone(), &ns.name)
        .get(&name)
        .await
        .unwrap();
    let picker = picker(&client, &ns.name, "llama").await;
    picker.wait_endpoints(4).await;

    let pools: Api<KVRoutePool> = Api::namespaced(client.clone(), &ns.name);
    wait::until("the pool's Ready condition", TIMEOUT, || async {
        let p = pools.get("llama").await?;
        let status = p.status.unwrap_or_default();
        match status.condition("Ready") {
            Some(c) if c.status == "True" => Ok(Some(())),
            other => bail!("Ready: {other:?}"),
        }
    })
    .await
    .unwrap();
}

/// `kubectl apply` of a pool that must fail; its stderr.
fn rejected(ns: &str, pool: &serde_json::Value) -> String {
    let out = cluster()
        .kubectl_apply(ns, &serde_yaml_ng::to_string(pool).unwrap())
        .unwrap();
    assert!(
        !out.status.success(),
        "the API server accepted an invalid pool: {pool}"
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn pool_with(
    name: &str,
    model_config: serde_json::Value,
    routing: serde_json::Value,
) -> serde_json::Value {
    json!({
        "apiVersion": "kvroute.dev/v1alpha1",
        "kind": "KVRoutePool",
        "metadata": {"name": name},
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/name": "vllm-llama"}},
            "modelConfigs": [model_config],
            "routing": routing,
        },
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_pools_are_rejected_and_incompatible_pods_reported() {
    let c = cluster();
    c.ensure_operator().await.unwrap();
    let ns = c.namespace("invalid").await.unwrap();
    let mc = json!({"name": "llama", "model": LLAMA_MODEL, "engine": "vllm", "port": 8000});

    let err = rejected(
        &ns.name,
        &pool_with(
            "negative",
            mc.clone(),
            json!({"strategy": "Weighted", "weights": {"prefixCache": -1.0}}),
        ),
    );
    assert!(err.contains("prefixCache"), "{err}");
    let err = rejected(
        &ns.name,
        &pool_with(
            "zero",
            mc.clone(),
            json!({"strategy": "Weighted", "weights": {"prefixCache": 0.0, "queue": 0.0, "kvUtilization": 0.0, "inflight": 0.0, "sessionAffinity": 0.0}}),
        ),
    );
    assert!(
        err.contains("at least one weight must be positive"),
        "{err}"
    );
    let err = rejected(
        &ns.name,
        &pool_with("strategy", mc.clone(), json!({"strategy": "Fastest"})),
    );
    assert!(
        err.contains("Unsupported value") && err.contains("Fastest"),
        "{err}"
    );
    let mut dp0 = mc.clone();
    dp0["dataParallel"] = json!({"size": 0});
    let err = rejected(&ns.name, &pool_with("dp", dp0, json!({})));
    assert!(err.contains("dataParallel.size"), "{err}");
    let err = rejected(
        &ns.name,
        &pool_with(
            "nomodel",
            json!({"name": "llama", "engine": "vllm"}),
            json!({}),
        ),
    );
    assert!(
        err.contains("model") && err.contains("Required value"),
        "{err}"
    );

    // a valid pool whose pods declare another DP size: listed as ineligible, with the reason
    apply(&ns.name, &sample("llama-vllm-dp-header.yaml"));
    apply(
        &ns.name,
        &sim_deployment(
            "vllm-llama",
            1,
            &json!({"app.kubernetes.io/name": "vllm-llama", "kvroute.dev/engine": "vllm", "kvroute.dev/dp-size": "4"}),
            &json!({"kvroute.dev/model": LLAMA_MODEL}),
            &[
                "--port",
                "8000",
                "--dp-size",
                "4",
                "--model",
                LLAMA_MODEL,
                "--kv-events-port",
                "5557",
            ],
        ),
    );
    let client = client().await;
    let pools: Api<KVRoutePool> = Api::namespaced(client.clone(), &ns.name);
    let reason = wait::until("the pod to be reported ineligible", TIMEOUT, || async {
        let p = pools.get("llama").await?;
        let status = p.status.unwrap_or_default();
        let Some(mc) = status.model_configs.first() else {
            return Ok(None);
        };
        Ok(mc
            .ineligible
            .first()
            .map(|i| (mc.eligible_pods, i.reason, i.message.clone())))
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", c.operator_log()));
    // the pod is Ready (its engine runs) yet not eligible: the declaration does not match
    let (eligible, reason, message) = reason;
    assert_eq!(eligible, 0);
    assert_eq!(format!("{reason:?}"), "DataParallelMismatch", "{message}");
    assert!(message.contains('4') && message.contains('2'), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_pool_garbage_collects_what_it_owns() {
    let c = cluster();
    c.ensure_operator().await.unwrap();
    let ns = c.namespace("gc").await.unwrap();
    let client = client().await;
    apply(&ns.name, &sample("llama-vllm-dp-header.yaml"));
    apply(&ns.name, &llama_servers(1));
    wait_pool_eligible(&client, &ns.name, "llama", "llama", 1, 2).await;
    let picker = picker(&client, &ns.name, "llama").await;

    c.kubectl(&[
        "delete",
        "kvpool",
        "llama",
        "--namespace",
        &ns.name,
        "--wait=false",
    ])
    .unwrap();
    let name = contract::picker_name("llama");
    let selector = format!("{}=llama", contract::LABEL_POOL);
    wait::until(
        "the pool's objects to be garbage-collected",
        TIMEOUT,
        || async {
            let mut left = Vec::new();
            if Api::<Deployment>::namespaced(client.clone(), &ns.name)
                .get_opt(&name)
                .await?
                .is_some()
            {
                left.push("Deployment");
            }
            if Api::<Service>::namespaced(client.clone(), &ns.name)
                .get_opt(&name)
                .await?
                .is_some()
            {
                left.push("Service");
            }
            if Api::<ConfigMap>::namespaced(client.clone(), &ns.name)
                .get_opt(&name)
                .await?
                .is_some()
            {
                left.push("ConfigMap");
            }
            if Api::<Secret>::namespaced(client.clone(), &ns.name)
                .get_opt(&contract::picker_peers_name("llama"))
                .await?
                .is_some()
            {
                left.push("Secret");
            }
            if Api::<ServiceAccount>::namespaced(client.clone(), &ns.name)
                .get_opt(&name)
                .await?
                .is_some()
            {
                left.push("ServiceAccount");
            }
            if Api::<Role>::namespaced(client.clone(), &ns.name)
                .get_opt(&name)
                .await?
                .is_some()
            {
                left.push("Role");
            }
            if Api::<RoleBinding>::namespaced(client.clone(), &ns.name)
                .get_opt(&name)
                .await?
                .is_some()
            {
                left.push("RoleBinding");
            }
            let slices = Api::<EndpointSlice>::namespaced(client.clone(), &ns.name)
                .list(&ListParams::default().labels(&selector))
                .await?;
            if !slices.items.is_empty() {
                left.push("EndpointSlice");
            }
            if Api::<Pod>::namespaced(client.clone(), &ns.name)
                .get_opt(&picker.name)
                .await?
                .is_some()
            {
                left.push("picker Pod");
            }
            if left.is_empty() {
                Ok(Some(()))
            } else {
                bail!("still there: {left:?}")
            }
        },
    )
    .await
    .unwrap();
    // what the pool did not own stays
    let servers = ready_pods(&client, &ns.name, "app.kubernetes.io/name=vllm-llama").await;
    assert_eq!(servers.len(), 1);
}
