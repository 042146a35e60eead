//! End-to-end on a real API server (see `kvroute_e2e::cluster`): the chart installs, the CRD
//! is established, and of two operator replicas exactly one leads and writes; when the leader
//! dies the other takes over.
//!
//! Needs the control-plane binaries of `scripts/k8s-bins.sh`.
#![allow(clippy::unwrap_used)]

mod k8s_support;

use std::net::SocketAddr;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Api;
use kvroute_e2e::cluster::{LEASE, OPERATOR_NAMESPACE, wait};

use k8s_support::*;
use kvroute_testkit::metric_sum;

async fn metrics(addr: SocketAddr) -> String {
    kvroute_testkit::get_text(
        &reqwest::Client::builder().no_proxy().build().unwrap(),
        format!("http://{addr}/metrics"),
    )
    .await
}

async fn lease_holder(api: &Api<Lease>, name: &str) -> Option<String> {
    api.get_opt(name)
        .await
        .ok()
        .flatten()?
        .spec?
        .holder_identity
        .filter(|h| !h.is_empty())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_install_establishes_the_crd_and_one_operator_replica_leads() {
    let c = cluster();
    c.install_chart().unwrap();
    let client = client().await;

    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    wait::until("the KVRoutePool CRD to be established", TIMEOUT, || async {
        let crd = crds.get("kvroutepools.kvroute.dev").await?;
        let established = crd
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True");
        Ok(established.then_some(()))
    })
    .await
    .unwrap();
    let releases = c
        .helm(&[
            "list",
            "--namespace",
            OPERATOR_NAMESPACE,
            "--deployed",
            "-q",
        ])
        .unwrap();
    assert!(releases.lines().any(|l| l == "kvroute"), "{releases}");

    // Two replicas competing for the chart's lease (this test binary runs no other operator),
    // both limited to this test's namespace.
    let ns = c.namespace("leader").await.unwrap();
    let lease_name = LEASE.to_string();
    let args = [
        "--lease-name",
        LEASE,
        "--watch-namespace",
        ns.name.as_str(),
        "--lease-duration",
        "6",
        "--lease-grace",
        "2",
    ];
    let leases: Api<Lease> = Api::namespaced(client.clone(), OPERATOR_NAMESPACE);
    let (mut first, first_addr) = c.start_operator("operator-a", &args).await.unwrap();
    wait::until("operator-a to take the lease", TIMEOUT, || async {
        Ok(
            (lease_holder(&leases, &lease_name).await.as_deref() == Some("operator-a"))
                .then_some(()),
        )
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", first.tail()));
    let (mut second, second_addr) = c.start_operator("operator-b", &args).await.unwrap();

    apply(&ns.name, &sample("llama-vllm-dp-header.yaml"));
    apply(&ns.name, &llama_servers(1));
    wait_pool_eligible(&client, &ns.name, "llama", "llama", 1, 2).await;

    let a = metrics(first_addr).await;
    let b = metrics(second_addr).await;
    assert_eq!(metric_sum(&a, "kvroute_operator_leader", &[]), 1.0, "{a}");
    assert!(
        metric_sum(&a, "kvroute_operator_object_writes_total", &[]) > 0.0,
        "{a}"
    );
    assert_eq!(metric_sum(&b, "kvroute_operator_leader", &[]), 0.0, "{b}");
    assert_eq!(
        metric_sum(&b, "kvroute_operator_object_writes_total", &[]),
        0.0,
        "the follower wrote:\n{b}"
    );
    assert_eq!(
        metric_sum(&b, "kvroute_operator_reconciles_total", &[]),
        0.0,
        "{b}"
    );
    assert_eq!(
        lease_holder(&leases, &lease_name).await.as_deref(),
        Some("operator-a")
    );

    // The leader dies without releasing the lease: the follower takes over once it expires
    // and reconciles from then on.
    first.kill();
    wait::until("operator-b to take the lease", TIMEOUT, || async {
        let holder = lease_holder(&leases, &lease_name).await;
        let leading =
            metric_sum(&metrics(second_addr).await, "kvroute_operator_leader", &[]) == 1.0;
        Ok((holder.as_deref() == Some("operator-b") && leading).then_some(()))
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", second.tail()));
    scale_to_two(&client, &ns.name).await;
    let b = metrics(second_addr).await;
    assert!(
        metric_sum(&b, "kvroute_operator_object_writes_total", &[]) > 0.0,
        "{b}"
    );
    second.terminate(Duration::from_secs(5));
}
