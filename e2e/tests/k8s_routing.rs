//! End-to-end on a real API server (see `kvroute_e2e::cluster`): requests through the picker
//! the operator runs, routing changes applied live, endpoints coming and going, engines that
//! crash, pickers that restart.
//!
//! Needs the control-plane binaries of `scripts/k8s-bins.sh`.
#![allow(clippy::unwrap_used)]

mod k8s_support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::bail;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kvroute_e2e::cluster::{TestNamespace, wait};
use serde_json::{Value, json};

use k8s_support::*;

/// Events replay on 5600 + rank: a restarted picker fetches what it missed from the engines.
const REPLAY_PORT: &str = "5600";

/// A namespace with the llama pool (changed by `edit`) over `replicas` model servers, and
/// its picker once it routes to every rank.
async fn pool(
    prefix: &str,
    replicas: u32,
    edit: impl FnOnce(&mut Value),
) -> (TestNamespace, Picker) {
    let c = cluster();
    c.ensure_operator().await.unwrap();
    let ns = c.namespace(prefix).await.unwrap();
    let client = client().await;
    apply(
        &ns.name,
        &llama_pool(|p| {
            p["spec"]["modelConfigs"][0]["kvEvents"]["replayPort"] = json!(5600);
            edit(p);
        }),
    );
    apply(
        &ns.name,
        &llama_servers_with(replicas, &["--kv-replay-port", REPLAY_PORT]),
    );
    wait_pool_eligible(&client, &ns.name, "llama", "llama", replicas, 2 * replicas).await;
    let picker = picker(&client, &ns.name, "llama").await;
    picker.wait_endpoints(2 * replicas as usize).await;
    (ns, picker)
}

/// Send a real request with `prefix` so that an engine caches it, then wait until the
/// picker's index (fed by the engine's KV events) credits that engine; the pick.
async fn warm(picker: &Picker, prefix: &str) -> Value {
    picker
        .complete(LLAMA_MODEL, prompt(prefix, "warm", 512), false)
        .await
        .unwrap();
    // indexed, and the warming request gone from the engine's queue in the scraped metrics:
    // an engine still reporting it waiting is priced with that queue, and an empty engine
    // with room can rightly win (the cost model charges a recomputation little where it
    // evicts nothing)
    wait::until("the picker to index the warmed prefix", TIMEOUT, || async {
        let pick = picker
            .pick(LLAMA_MODEL, prompt(prefix, "probe", 512))
            .await?;
        let idle = pick["candidates"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|c| c["features"]["matched_blocks"].as_u64().unwrap_or(0) > 0)
            .all(|c| c["features"]["waiting"] == 0.0 && c["features"]["running"] == 0.0);
        Ok((pick["matched_blocks"].as_u64().unwrap_or(0) > 0 && idle).then_some(pick))
    })
    .await
    .unwrap()
}

/// Picks of `n` prompts sharing `prefix` (or not, with `shared == false`).
async fn picks(picker: &Picker, prefix: &str, n: usize, shared: bool) -> Vec<Value> {
    let mut out = Vec::new();
    for i in 0..n {
        let p = if shared {
            prompt(prefix, &format!("question {i}"), 512)
        } else {
            prompt(&format!("{prefix} distinct {i}"), "q", 512)
        };
        out.push(picker.pick(LLAMA_MODEL, &p).await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_through_the_picker_follow_the_cache() {
    let (_ns, picker) = pool("requests", 2, |_| {}).await;

    let body = picker
        .complete(LLAMA_MODEL, "Hello there", false)
        .await
        .unwrap();
    let v: Value = serde_json::from_str(&body).unwrap();
    assert!(v["choices"][0]["text"].is_string(), "{body}");
    let sse = picker
        .complete(LLAMA_MODEL, "Hello again", true)
        .await
        .unwrap();
    assert!(sse.contains("data: ") && sse.contains("[DONE]"), "{sse}");
    let body = picker.chat(LLAMA_MODEL, "Hi", false).await.unwrap();
    let v: Value = serde_json::from_str(&body).unwrap();
    assert!(v["choices"][0]["message"].is_object(), "{body}");
    let sse = picker.chat(LLAMA_MODEL, "Hi again", true).await.unwrap();
    assert!(sse.contains("data: ") && sse.contains("[DONE]"), "{sse}");

    // a long shared prefix: every request goes to the engine and rank that cached it
    let warmed = warm(
        &picker,
        "You are a helpful assistant for the kvroute project.",
    )
    .await;
    let shared = picks(
        &picker,
        "You are a helpful assistant for the kvroute project.",
        8,
        true,
    )
    .await;
    assert_eq!(
        distinct(&shared),
        [target(&warmed)].into(),
        "shared prefix spread: {shared:?}"
    );
    assert!(
        shared
            .iter()
            .all(|p| p["matched_blocks"].as_u64() > Some(0))
    );
    // distinct prefixes, nothing cached: spread over the ranks
    let spread = picks(&picker, "unrelated", 16, false).await;
    assert!(
        distinct(&spread).len() > 1,
        "distinct prefixes all on one endpoint: {spread:?}"
    );
    // and the requests themselves succeed wherever they go
    for i in 0..4 {
        picker
            .complete(
                LLAMA_MODEL,
                prompt(&format!("other topic {i}"), "x", 256),
                i % 2 == 0,
            )
            .await
            .unwrap();
    }
}

/// Send `prompt` straight to one engine rank, bypassing the picker.
async fn complete_on(endpoint: &str, rank: u64, prompt: &[u32]) {
    let r = reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .post(format!("http://{endpoint}/v1/completions"))
        .header("x-data-parallel-rank", rank.to_string())
        .json(&json!({"model": LLAMA_MODEL, "prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn patched_weights_change_decisions_without_a_restart() {
    // only the prefix cache counts
    let (ns, picker) = pool("weights", 2, |p| {
        p["spec"]["routing"]["strategy"] = json!("Weighted");
        p["spec"]["routing"]["weights"] = json!({
            "prefixCache": 10.0, "queue": 0.0, "kvUtilization": 0.0, "inflight": 0.0, "sessionAffinity": 0.0,
        });
    })
    .await;
    let prefix = "A system prompt that every request of this tenant shares.";
    // nothing cached: every score ties, and the tie-break (a hash of request and endpoint)
    // names the endpoint this prompt goes to when the cache does not count
    let tie = picker
        .pick(LLAMA_MODEL, prompt(prefix, "probe", 512))
        .await
        .unwrap();
    let view = picker.endpoints().await.unwrap();
    let other = view["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| format!("{}#{}", e["endpoint"].as_str().unwrap(), e["rank"]) != target(&tie))
        .unwrap()
        .clone();
    // cache the prefix on another endpoint, behind the picker's back: its KV events tell
    complete_on(
        other["endpoint"].as_str().unwrap(),
        other["rank"].as_u64().unwrap(),
        &prompt(prefix, "warm", 512),
    )
    .await;
    let cached = format!("{}#{}", other["endpoint"].as_str().unwrap(), other["rank"]);
    let before = wait::until("decisions to follow the cached prefix", TIMEOUT, || async {
        let pick = picker
            .pick(LLAMA_MODEL, prompt(prefix, "probe", 512))
            .await?;
        Ok((target(&pick) == cached).then_some(pick))
    })
    .await
    .unwrap();
    assert!(before["matched_blocks"].as_u64() > Some(0), "{before}");

    // prefix cache off, in-flight load on: all idle, the tie-break decides again
    cluster()
        .kubectl(&[
            "patch",
            "kvpool",
            "llama",
            "--namespace",
            &ns.name,
            "--type=merge",
            "-p",
            r#"{"spec":{"routing":{"weights":{"prefixCache":0,"inflight":1}}}}"#,
        ])
        .unwrap();
    wait::until("decisions to follow the new weights", TIMEOUT, || async {
        let pick = picker
            .pick(LLAMA_MODEL, prompt(prefix, "probe", 512))
            .await?;
        if target(&pick) == target(&tie) {
            Ok(Some(()))
        } else {
            bail!("still {}", target(&pick))
        }
    })
    .await
    .unwrap();
    let debug = picker.endpoints().await.unwrap();
    assert_eq!(
        debug["routing"]["weights"]["prefixCache"],
        json!(0.0),
        "{debug}"
    );

    // the same picker process did it
    let client = client().await;
    let pod = Api::<Pod>::namespaced(client, &ns.name)
        .get(&picker.name)
        .await
        .unwrap();
    assert_eq!(pod.metadata.uid.as_deref(), Some(picker.uid.as_str()));
    let restarts = pod.status.unwrap().container_statuses.unwrap()[0].restart_count;
    assert_eq!(restarts, 0);
}

/// Requests sent in a loop until stopped: (sent, failed) and the failures' messages.
struct Load {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicUsize>,
    failed_after_gone: Arc<AtomicUsize>,
    gone: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<Vec<String>>>,
}

impl Load {
    fn start(picker: &Picker, workers: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicUsize::new(0));
        let failed_after_gone = Arc::new(AtomicUsize::new(0));
        let gone = Arc::new(AtomicBool::new(false));
        let tasks = (0..workers)
            .map(|w| {
                let (picker, stop, sent) = (picker.clone(), stop.clone(), sent.clone());
                let (failed_after_gone, gone) = (failed_after_gone.clone(), gone.clone());
                tokio::spawn(async move {
                    let mut errors = Vec::new();
                    let mut i = 0;
                    while !stop.load(Ordering::Relaxed) {
                        let was_gone = gone.load(Ordering::Relaxed);
                        let p = prompt(&format!("load {w} {i}"), "go", 128);
                        if let Err(e) = picker.complete(LLAMA_MODEL, &p, i % 2 == 0).await {
                            errors.push(format!("{e:#}"));
                            if was_gone {
                                failed_after_gone.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        sent.fetch_add(1, Ordering::Relaxed);
                        i += 1;
                    }
                    errors
                })
            })
            .collect();
        Self {
            stop,
            sent,
            failed_after_gone,
            gone,
            tasks,
        }
    }

    async fn finish(self) -> (usize, usize, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        let mut errors = Vec::new();
        for t in self.tasks {
            errors.extend(t.await.unwrap());
        }
        (
            self.sent.load(Ordering::Relaxed),
            self.failed_after_gone.load(Ordering::Relaxed),
            errors,
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scaled_up_endpoints_take_traffic_and_deleted_pods_leave() {
    let (ns, picker) = pool("scale", 1, |_| {}).await;
    let client = client().await;
    let c = cluster();
    let first = ready_pods(&client, &ns.name, "app.kubernetes.io/name=vllm-llama").await;
    let first_ip = pod_ip(&first[0]);

    scale_to_two(&client, &ns.name).await;
    picker.wait_endpoints(4).await;
    let pods = ready_pods(&client, &ns.name, "app.kubernetes.io/name=vllm-llama").await;
    let new = pods.iter().find(|p| pod_ip(p) != first_ip).unwrap();
    let new_ip = pod_ip(new);
    // distinct prompts spread over the ranks, the new engine's included
    for i in 0..16 {
        picker
            .complete(LLAMA_MODEL, prompt(&format!("scale {i}"), "q", 256), false)
            .await
            .unwrap();
    }
    let served = kvroute_testkit::get_text(
        &reqwest::Client::builder().no_proxy().build().unwrap(),
        format!("http://{new_ip}:8000/metrics"),
    )
    .await;
    let successes = kvroute_testkit::metric_sum(&served, "vllm:request_success_total", &[]);
    assert!(successes > 0.0, "the new engine took no traffic:\n{served}");

    // delete one pod under load: it leaves the picker's view, and nothing fails once it's gone
    let load = Load::start(&picker, 2);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let victim = pods[0].metadata.name.clone().unwrap();
    let victim_ip = pod_ip(&pods[0]);
    c.kubectl(&[
        "delete",
        "pod",
        &victim,
        "--namespace",
        &ns.name,
        "--wait=false",
    ])
    .unwrap();
    let pods_api: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    wait::until("the deleted pod to be gone", TIMEOUT, || async {
        Ok(pods_api.get_opt(&victim).await?.is_none().then_some(()))
    })
    .await
    .unwrap();
    wait::until("the picker to drop the deleted pod", TIMEOUT, || async {
        let v = picker.endpoints().await?;
        let still = v["endpoints"].as_array().into_iter().flatten().any(|e| {
            e["endpoint"]
                .as_str()
                .is_some_and(|a| a.starts_with(&format!("{victim_ip}:")))
        });
        Ok((!still).then_some(()))
    })
    .await
    .unwrap();
    load.gone.store(true, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (sent, failed_after_gone, errors) = load.finish().await;
    assert!(sent > 0);
    assert_eq!(
        failed_after_gone, 0,
        "requests failed after the pod was gone ({sent} sent): {errors:?}"
    );
    assert!(
        errors.is_empty(),
        "requests failed while the pod was deleted ({sent} sent): {errors:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_engine_goes_stale_and_restarts_without_credit() {
    let (ns, picker) = pool("crash", 2, |_| {}).await;
    let client = client().await;
    let prefix = "Context that one engine cached before it crashed.";
    let warmed = warm(&picker, prefix).await;
    let warm_ip = warmed["endpoint"]
        .as_str()
        .unwrap()
        .split(':')
        .next()
        .unwrap()
        .to_string();
    let pods = ready_pods(&client, &ns.name, "app.kubernetes.io/name=vllm-llama").await;
    let victim = pods.iter().find(|p| pod_ip(p) == warm_ip).unwrap();
    let victim_name = victim.metadata.name.clone().unwrap();

    // the process dies; the pod is not deleted
    cluster()
        .agent
        .kill_process(&ns.name, &victim_name, true)
        .await
        .unwrap();
    let on_victim = |v: &Value| {
        v["endpoint"]
            .as_str()
            .is_some_and(|a| a.starts_with(&format!("{warm_ip}:")))
    };
    wait::until(
        "the picker to stop routing to the dead engine",
        TIMEOUT,
        || async {
            let view = picker.endpoints().await?;
            let states: Vec<String> = view["endpoints"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|e| on_victim(e))
                .map(|e| e["state"].as_str().unwrap_or("?").to_string())
                .collect();
            if states.iter().any(|s| s == "ready") {
                bail!("dead engine still ready: {states:?}");
            }
            let sample = picks(&picker, prefix, 6, true).await;
            if sample.iter().any(on_victim) {
                bail!("still routed to the dead engine: {sample:?}");
            }
            Ok(Some(()))
        },
    )
    .await
    .unwrap();
    // requests still succeed elsewhere
    picker
        .complete(LLAMA_MODEL, prompt(prefix, "while down", 512), false)
        .await
        .unwrap();

    // a fresh process (empty cache) on the same address: routable again, and its old blocks
    // are not credited. The picker forgets a stale endpoint's blocks; a restart quicker than
    // the staleness threshold is caught by the KV-event subscriber's resync instead, which
    // may land a moment after the endpoint is ready again, hence waiting for it rather than
    // asserting on the first view.
    cluster()
        .agent
        .release(&ns.name, &victim_name)
        .await
        .unwrap();
    wait::until(
        "the restarted engine to be routable without its old blocks",
        TIMEOUT,
        || async {
            let view = picker.endpoints().await?;
            let victim: Vec<&Value> = view["endpoints"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|e| on_victim(e))
                .collect();
            let ready = victim.iter().filter(|e| e["state"] == "ready").count();
            let credited = victim.iter().any(|e| e["cached_blocks"] != json!(0));
            if ready == 2 && !credited {
                Ok(Some(()))
            } else {
                bail!("{victim:?}")
            }
        },
    )
    .await
    .unwrap();
    let pick = picker
        .pick(LLAMA_MODEL, prompt(prefix, "after", 512))
        .await
        .unwrap();
    if on_victim(&pick) {
        assert_eq!(pick["matched_blocks"], json!(0), "{pick}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_picker_rebuilds_its_view() {
    let (ns, picker) = pool("restart", 2, |_| {}).await;
    let client = client().await;
    let prefix = "A prefix cached before the picker restarts.";
    let warmed = warm(&picker, prefix).await;

    // the picker pod goes; its Deployment brings a new one (a new process, a new address)
    cluster()
        .kubectl(&[
            "delete",
            "pod",
            &picker.name,
            "--namespace",
            &ns.name,
            "--wait=false",
        ])
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    wait::until("the old picker pod to be gone", TIMEOUT, || async {
        Ok(pods.get_opt(&picker.name).await?.is_none().then_some(()))
    })
    .await
    .unwrap();
    let fresh = k8s_support::picker(&client, &ns.name, "llama").await;
    assert_ne!(fresh.uid, picker.uid);
    fresh.wait_endpoints(4).await;
    // the engines' replayed events rebuild the index: the cached prefix wins again
    let pick = wait::until(
        "the new picker to credit the cached prefix",
        TIMEOUT,
        || async {
            let pick = fresh
                .pick(LLAMA_MODEL, prompt(prefix, "probe", 512))
                .await?;
            Ok((pick["matched_blocks"].as_u64().unwrap_or(0) > 0).then_some(pick))
        },
    )
    .await
    .unwrap();
    assert_eq!(target(&pick), target(&warmed));
    fresh
        .complete(LLAMA_MODEL, prompt(prefix, "after restart", 512), true)
        .await
        .unwrap();
}
