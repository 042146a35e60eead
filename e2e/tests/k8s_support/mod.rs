//! Shared by the `k8s_*` end-to-end tests: the per-binary cluster, manifests for model-server
//! Deployments, and clients for the picker the operator runs.
#![allow(dead_code, clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, Client};
use kvroute_crds::KVRoutePool;
use kvroute_e2e::cluster::{Cluster, repo_root, sim_binary, wait};
use serde_json::{Value, json};

/// Long enough for a cold API server, a pod start, a picker start on a busy 2-core machine.
pub const TIMEOUT: Duration = Duration::from_secs(120);

/// The test binary's cluster (started by the first test that asks).
pub fn cluster() -> &'static Cluster {
    match sim_binary().and_then(|sim| Cluster::shared(&sim)) {
        Ok(c) => c,
        Err(e) => panic!("the end-to-end cluster did not start: {e:#}"),
    }
}

/// A sample pool's YAML from `config/samples`.
pub fn sample(file: &str) -> String {
    std::fs::read_to_string(repo_root().join("config/samples").join(file)).unwrap()
}

/// The llama sample's model, DP size and ports (`config/samples/llama-vllm-dp-header.yaml`).
pub const LLAMA_MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// A model-server Deployment the node agent runs as `kvroute-sim` processes: `labels` on
/// the pods, `sim_args` given to the simulator (the agent adds `--host`).
pub fn sim_deployment(
    name: &str,
    replicas: u32,
    labels: &Value,
    annotations: &Value,
    sim_args: &[&str],
) -> String {
    let doc = json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"e2e.kvroute.dev/deployment": name}},
            "template": {
                "metadata": {
                    "labels": merge(labels, &json!({"e2e.kvroute.dev/deployment": name})),
                    "annotations": annotations,
                },
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "containers": [{
                        "name": "engine",
                        "image": "kvroute-sim:e2e",
                        "args": sim_args,
                        "ports": [{"name": "http", "containerPort": 8000}],
                        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 1},
                        // as for any server behind endpoint-based load balancing: keep serving
                        // until the pickers have seen the pod terminate
                        "lifecycle": {"preStop": {"sleep": {"seconds": 2}}},
                    }],
                },
            },
        },
    });
    serde_yaml_ng::to_string(&doc).unwrap()
}

fn merge(a: &Value, b: &Value) -> Value {
    let mut out = a.clone();
    if let (Some(o), Some(b)) = (out.as_object_mut(), b.as_object()) {
        for (k, v) in b {
            o.insert(k.clone(), v.clone());
        }
    }
    out
}

/// The llama sample pool's model servers: vLLM flavour, 2 DP ranks behind one port selected
/// by header, KV events on 5557 + rank, block size 16, a fast clock.
pub fn llama_servers(replicas: u32) -> String {
    llama_servers_with(replicas, &[])
}

/// [`llama_servers`] with more simulator flags.
pub fn llama_servers_with(replicas: u32, extra: &[&str]) -> String {
    let mut args = vec![
        "--port",
        "8000",
        "--dp-size",
        "2",
        "--model",
        LLAMA_MODEL,
        "--block-size",
        "16",
        "--kv-events-port",
        "5557",
        "--speedup",
        "20",
        "--seed",
        "7",
    ];
    args.extend_from_slice(extra);
    sim_deployment(
        "vllm-llama",
        replicas,
        &json!({
            "app.kubernetes.io/name": "vllm-llama",
            "kvroute.dev/engine": "vllm",
            "kvroute.dev/dp-size": "2",
        }),
        &json!({"kvroute.dev/model": LLAMA_MODEL}),
        &args,
    )
}

/// The llama sample pool, changed by `edit` (on its JSON form).
pub fn llama_pool(edit: impl FnOnce(&mut Value)) -> String {
    let mut pool: Value = serde_yaml_ng::from_str(&sample("llama-vllm-dp-header.yaml")).unwrap();
    edit(&mut pool);
    serde_yaml_ng::to_string(&pool).unwrap()
}

/// `kubectl apply` that must succeed.
pub fn apply(ns: &str, yaml: &str) {
    let out = cluster().kubectl_apply(ns, yaml).unwrap();
    assert!(
        out.status.success(),
        "kubectl apply failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

pub async fn client() -> Client {
    cluster().client().await.unwrap()
}

/// Scale the `vllm-llama` Deployment in `ns` to 2 pods and wait until the pool `llama` reports
/// both eligible, with their 4 ranks.
pub async fn scale_to_two(client: &Client, ns: &str) {
    cluster()
        .kubectl(&[
            "scale",
            "deployment/vllm-llama",
            "--replicas=2",
            "--namespace",
            ns,
        ])
        .unwrap();
    wait_pool_eligible(client, ns, "llama", "llama", 2, 4).await;
}

/// Wait until the pool's status reports `pods` eligible pods and `ranks` eligible ranks for
/// its model config `config`, with the status up to date.
pub async fn wait_pool_eligible(
    client: &Client,
    ns: &str,
    pool: &str,
    config: &str,
    pods: u32,
    ranks: u32,
) -> KVRoutePool {
    let api: Api<KVRoutePool> = Api::namespaced(client.clone(), ns);
    let result = wait::until(
        &format!("pool {ns}/{pool} to report {pods} eligible pods, {ranks} ranks"),
        TIMEOUT,
        || async {
            let p = api.get(pool).await?;
            let Some(status) = &p.status else {
                return Ok(None);
            };
            let current = status.observed_generation == p.metadata.generation;
            let mc = status.model_configs.iter().find(|m| m.name == config);
            match mc {
                Some(m) if current && m.eligible_pods == pods && m.eligible_ranks == ranks => {
                    Ok(Some(p))
                }
                _ => bail!("status: {}", serde_json::to_string(status)?),
            }
        },
    )
    .await;
    match result {
        Ok(p) => p,
        Err(e) => panic!("{e:#}\n{}", cluster().dump(ns)),
    }
}

/// Running, Ready pods matching `selector`.
pub async fn ready_pods(client: &Client, ns: &str, selector: &str) -> Vec<Pod> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let pods = api
        .list(&ListParams::default().labels(selector))
        .await
        .unwrap();
    pods.items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none() && is_ready(p))
        .collect()
}

pub fn is_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

pub fn pod_ip(p: &Pod) -> String {
    p.status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .unwrap_or_default()
}

/// The pool's picker: its Ready pod (waits for exactly one) and that pod's IP.
pub async fn picker(client: &Client, ns: &str, pool: &str) -> Picker {
    let selector = format!("{}={pool}", kvroute_crds::contract::LABEL_POOL);
    let pod = wait::until(
        &format!("one Ready picker pod of {ns}/{pool}"),
        TIMEOUT,
        || {
            let selector = selector.clone();
            async move {
                let pods = ready_pods(client, ns, &selector).await;
                Ok((pods.len() == 1).then(|| pods.into_iter().next()).flatten())
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", cluster().dump(ns)));
    Picker {
        name: pod.metadata.name.clone().unwrap_or_default(),
        uid: pod.metadata.uid.clone().unwrap_or_default(),
        ip: pod_ip(&pod),
    }
}

#[derive(Debug, Clone)]
pub struct Picker {
    pub name: String,
    pub uid: String,
    pub ip: String,
}

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

impl Picker {
    fn url(&self, port: u16, path: &str) -> String {
        format!("http://{}:{port}{path}", self.ip)
    }

    /// `body` posted to `path` through the proxy; the answer's text, or an error with it.
    async fn post_through(&self, path: &str, body: &Value) -> anyhow::Result<String> {
        let r = http()
            .post(self.url(kvroute_crds::contract::PICKER_HTTP_PORT, path))
            .json(body)
            .send()
            .await?;
        let status = r.status();
        let body = r.text().await?;
        if !status.is_success() {
            bail!("{status}: {body}");
        }
        Ok(body)
    }

    /// `/v1/completions` through the proxy; the parsed body (or the SSE text when streaming).
    pub async fn complete(
        &self,
        model: &str,
        prompt: impl serde::Serialize,
        stream: bool,
    ) -> anyhow::Result<String> {
        let body = json!({"model": model, "prompt": prompt, "max_tokens": 4, "stream": stream});
        self.post_through("/v1/completions", &body).await
    }

    /// `/v1/chat/completions` through the proxy.
    pub async fn chat(&self, model: &str, content: &str, stream: bool) -> anyhow::Result<String> {
        let body = json!({"model": model, "messages": [{"role": "user", "content": content}],
                          "max_tokens": 4, "stream": stream});
        self.post_through("/v1/chat/completions", &body).await
    }

    /// The admin API's decision for a completion prompt.
    pub async fn pick(&self, model: &str, prompt: impl serde::Serialize) -> anyhow::Result<Value> {
        let r = http()
            .post(self.url(kvroute_crds::contract::PICKER_ADMIN_PORT, "/v1/pick"))
            .json(&json!({"model": model, "prompt": prompt}))
            .send()
            .await?;
        let status = r.status();
        let body: Value = r.json().await?;
        if !status.is_success() {
            bail!("{status}: {body}");
        }
        Ok(body)
    }

    /// The picker's endpoint view (`/debug/endpoints`).
    pub async fn endpoints(&self) -> anyhow::Result<Value> {
        Ok(http()
            .get(self.url(
                kvroute_crds::contract::PICKER_ADMIN_PORT,
                "/debug/endpoints",
            ))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?)
    }

    /// Wait until the picker routes to `n` endpoints that are ready.
    pub async fn wait_endpoints(&self, n: usize) -> Value {
        wait::until(
            &format!("picker {} to see {n} ready endpoints", self.name),
            TIMEOUT,
            || async {
                let v = self.endpoints().await?;
                let ready = v["endpoints"]
                    .as_array()
                    .context("no endpoints")?
                    .iter()
                    .filter(|e| e["state"] == "Ready" || e["state"] == "ready")
                    .count();
                if ready == n {
                    Ok(Some(v))
                } else {
                    bail!("{ready} ready: {v}")
                }
            },
        )
        .await
        .unwrap()
    }
}

/// `endpoint#rank` of a pick.
pub fn target(pick: &Value) -> String {
    format!(
        "{}#{}",
        pick["endpoint"].as_str().unwrap_or("?"),
        pick["rank"]
    )
}

/// A prompt of `n` token ids: all but the last block (16 tokens) derived from `prefix`, the
/// last block from `suffix`. Token ids, not text: these pools have no tokenizer, and only
/// token ids hash to the blocks the engines report in their KV events (text would be hashed
/// in character chunks, an approximation that events cannot confirm).
pub fn prompt(prefix: &str, suffix: &str, n: usize) -> Vec<u32> {
    fn seeded(seed: &str, n: usize) -> impl Iterator<Item = u32> {
        // FNV-1a seed, then a 64-bit LCG: stable across runs and platforms
        let mut state = seed.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        (0..n).map(move |_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            u32::try_from(state >> 33).unwrap() % 30_000 + 1
        })
    }
    let shared = n.saturating_sub(16);
    seeded(prefix, shared)
        .chain(seeded(suffix, n - shared))
        .collect()
}

/// Distinct endpoints in a set of picks.
pub fn distinct(picks: &[Value]) -> BTreeSet<String> {
    picks.iter().map(target).collect()
}
