//! Control-plane faults under a serving pool (issue: hardening): the API server goes away and
//! comes back; a picker replica dies. One test binary of its own, because stopping the API
//! server would disturb every other test sharing the binary's cluster.
#![allow(clippy::unwrap_used)]

mod k8s_support;

use std::collections::BTreeSet;

use kvroute_e2e::cluster::wait;
use serde_json::json;

use k8s_support::*;

/// The tests stop parts of the shared cluster: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Ready picker pods of a pool.
async fn picker_pods(client: &kube::Client, ns: &str, pool: &str) -> Vec<Picker> {
    let selector = format!("{}={pool}", kvroute_crds::contract::LABEL_POOL);
    ready_pods(client, ns, &selector)
        .await
        .iter()
        .map(|p| Picker {
            name: p.metadata.name.clone().unwrap_or_default(),
            uid: p.metadata.uid.clone().unwrap_or_default(),
            ip: pod_ip(p),
        })
        .collect()
}

/// The API server is stopped while a pool serves: the picker keeps routing on its last known
/// endpoints, and once the API server is back it (and the operator, and the node agent)
/// resume their watches: a scale-up made afterwards reaches the picker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pickers_serve_through_an_api_server_restart_and_resync() {
    let _serial = SERIAL.lock().await;
    let c = cluster();
    c.ensure_operator().await.unwrap();
    let ns = c.namespace("apirestart").await.unwrap();
    let client = client().await;
    // The picks checked at the end rely on the cost model's own terms: the pick API records no
    // load, so a cost learned from the eight requests below (calibration, on by default) would
    // send every pick to whichever endpoint looks fastest.
    apply(
        &ns.name,
        &llama_pool(|p| {
            p["spec"]["routing"]["costModel"] = json!({"calibrate": false});
        }),
    );
    apply(&ns.name, &llama_servers(1));
    wait_pool_eligible(&client, &ns.name, "llama", "llama", 1, 2).await;
    let picker = picker(&client, &ns.name, "llama").await;
    picker.wait_endpoints(2).await;
    // the ranks there before the scale-up
    let before: BTreeSet<String> = picker
        .pick(LLAMA_MODEL, prompt("before", "x", 64))
        .await
        .unwrap()["candidates"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["endpoint"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(before.len(), 2, "{before:?}");

    let down = std::time::Instant::now();
    c.plane.stop_apiserver();
    // every request while the API server is down is served, on the endpoints known before
    for i in 0..8 {
        let body = picker
            .complete(LLAMA_MODEL, prompt("down", &format!("{i}"), 64), i % 2 == 0)
            .await
            .unwrap_or_else(|e| panic!("request {i} with the API server down: {e:#}"));
        assert!(!body.is_empty());
    }
    c.plane.start_apiserver().await.unwrap();
    let back = std::time::Instant::now();
    // an operator that could not renew its lease during the outage exits; its Deployment's
    // pod would be restarted by the kubelet, so the harness does the same
    if let Some(status) = c.restart_operator_if_exited().await.unwrap() {
        eprintln!("the operator exited during the outage ({status}); restarted");
    }

    // the watches resume: a change made after the restart reaches the picker
    let client = k8s_support::client().await;
    scale_to_two(&client, &ns.name).await;
    picker.wait_endpoints(4).await;
    // figures for docs/RELIABILITY.md, not assertions
    eprintln!(
        "API server down for {:.1?} (8/8 requests served); a scale-up after it was back reached \
         the picker in {:.1?}",
        back - down,
        back.elapsed()
    );
    let picks: Vec<_> = {
        let mut v = Vec::new();
        for i in 0..16 {
            v.push(
                picker
                    .pick(LLAMA_MODEL, prompt(&format!("after{i}"), "x", 64))
                    .await
                    .unwrap(),
            );
        }
        v
    };
    // cold prompts reach the scaled-up engine (with room in its cache, the cost model
    // prefers it; the pick API records no load, so they need not spread over all four)
    let reached = distinct(&picks);
    assert!(
        reached.iter().any(|e| !before.contains(e)),
        "distinct prompts should reach the scaled-up engine's ranks: {reached:?}, before {before:?}"
    );
    drop(ns);
}

/// With two picker replicas, killing one leaves the other serving every request; the killed
/// one comes back (the node agent restarts it like a kubelet) and serves again, with the pool's
/// endpoints rebuilt from the API server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_picker_replica_leaves_the_other_serving() {
    let _serial = SERIAL.lock().await;
    let c = cluster();
    c.ensure_operator().await.unwrap();
    let ns = c.namespace("pickerkill").await.unwrap();
    let client = client().await;
    apply(
        &ns.name,
        &llama_pool(|p| p["spec"]["picker"] = json!({"replicas": 2})),
    );
    apply(&ns.name, &llama_servers(1));
    wait_pool_eligible(&client, &ns.name, "llama", "llama", 1, 2).await;
    let pickers = wait::until("two Ready picker replicas", TIMEOUT, || {
        let client = client.clone();
        let ns = ns.name.clone();
        async move {
            let p = picker_pods(&client, &ns, "llama").await;
            Ok((p.len() == 2).then_some(p))
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", c.dump(&ns.name)));
    for p in &pickers {
        p.wait_endpoints(2).await;
    }
    let (victim, survivor) = (&pickers[0], &pickers[1]);

    let killed = std::time::Instant::now();
    c.agent
        .kill_process(&ns.name, &victim.name, false)
        .await
        .unwrap();
    for i in 0..8 {
        survivor
            .complete(LLAMA_MODEL, prompt("survivor", &format!("{i}"), 64), false)
            .await
            .unwrap_or_else(|e| panic!("request {i} to the surviving replica: {e:#}"));
    }

    // the victim restarts, rebuilds its view from the API server and serves again
    victim.wait_endpoints(2).await;
    let body = victim
        .complete(LLAMA_MODEL, prompt("back", "again", 64), false)
        .await
        .unwrap();
    assert!(!body.is_empty());
    // the restarted container reports Ready again (the node agent patches the pod status
    // once its readiness probe passes, a moment after it serves)
    let want: BTreeSet<String> = [victim.name.clone(), survivor.name.clone()].into();
    wait::until("both picker replicas Ready again", TIMEOUT, || {
        let client = client.clone();
        let ns = ns.name.clone();
        let want = want.clone();
        async move {
            let names: BTreeSet<String> = picker_pods(&client, &ns, "llama")
                .await
                .into_iter()
                .map(|p| p.name)
                .collect();
            Ok((names == want).then_some(()))
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", c.dump(&ns.name)));
    eprintln!(
        "picker replica killed: the other served 8/8; the killed one was Ready again after {:.1?}",
        killed.elapsed()
    );
    drop(ns);
}
