//! Builders of pods and pools, and a recording mock of the Kubernetes API.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::Arc;

use http::{Request, Response, StatusCode};
use k8s_openapi::api::core::v1::{Pod, PodCondition, PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::client::Body;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use kvroute_crds::kvroute_pool::{KVRoutePool, KVRoutePoolSpec};
use parking_lot_free::Mutex;
use serde_json::{Value, json};

/// `std::sync::Mutex` without poisoning noise in tests.
pub mod parking_lot_free {
    pub struct Mutex<T>(std::sync::Mutex<T>);
    impl<T> Mutex<T> {
        pub fn new(v: T) -> Self {
            Self(std::sync::Mutex::new(v))
        }
        pub fn lock(&self) -> std::sync::MutexGuard<'_, T> {
            match self.0.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            }
        }
    }
}

pub const NS: &str = "serving";
pub const POOL_UID: &str = "0b7a1f6e-5c1e-4d0a-9a53-2f1f4c0b9e01";

/// A pod builder: `mk_pod("vllm-0").ip("10.0.0.1").ready()`.
#[derive(Clone)]
pub struct MkPod(pub Pod);

pub fn mk_pod(name: &str) -> MkPod {
    MkPod(Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(NS.into()),
            uid: Some(format!("uid-{name}")),
            labels: Some(BTreeMap::from([("app".to_owned(), "vllm".to_owned())])),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            node_name: Some("node-a".into()),
            ..PodSpec::default()
        }),
        status: Some(PodStatus {
            phase: Some("Running".into()),
            ..PodStatus::default()
        }),
    })
}

impl MkPod {
    pub fn ip(mut self, ip: &str) -> Self {
        self.status().pod_ip = Some(ip.into());
        self
    }
    pub fn no_ip(mut self) -> Self {
        self.status().pod_ip = None;
        self
    }
    fn status(&mut self) -> &mut PodStatus {
        self.0.status.get_or_insert_with(PodStatus::default)
    }
    pub fn ready_is(mut self, ready: bool) -> Self {
        self.status().conditions = Some(vec![PodCondition {
            type_: "Ready".into(),
            status: if ready { "True" } else { "False" }.into(),
            ..PodCondition::default()
        }]);
        self
    }
    pub fn ready(self) -> Self {
        self.ready_is(true)
    }
    pub fn not_ready(self) -> Self {
        self.ready_is(false)
    }
    pub fn terminating(mut self) -> Self {
        self.0.metadata.deletion_timestamp = Some(Time(Timestamp::UNIX_EPOCH));
        self
    }
    pub fn phase(mut self, phase: &str) -> Self {
        self.status().phase = Some(phase.into());
        self
    }
    pub fn label(mut self, k: &str, v: &str) -> Self {
        self.0
            .metadata
            .labels
            .get_or_insert_with(BTreeMap::new)
            .insert(k.into(), v.into());
        self
    }
    pub fn without_label(mut self, k: &str) -> Self {
        if let Some(l) = self.0.metadata.labels.as_mut() {
            l.remove(k);
        }
        self
    }
    pub fn annotation(mut self, k: &str, v: &str) -> Self {
        self.0
            .metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(k.into(), v.into());
        self
    }
    pub fn namespace(mut self, ns: &str) -> Self {
        self.0.metadata.namespace = Some(ns.into());
        self
    }
    pub fn build(self) -> Pod {
        self.0
    }
}

/// A pool named `llama` in [`NS`] selecting `app: vllm`, from a spec in JSON.
pub fn mk_pool(spec: Value) -> KVRoutePool {
    let spec: KVRoutePoolSpec = serde_json::from_value(spec).expect("pool spec");
    let mut pool = KVRoutePool::new("llama", spec);
    pool.metadata.namespace = Some(NS.into());
    pool.metadata.uid = Some(POOL_UID.into());
    pool.metadata.generation = Some(1);
    pool
}

/// The spec most tests use: one vLLM model config with two header-selected ranks.
pub fn base_spec() -> Value {
    json!({
        "selector": {"matchLabels": {"app": "vllm"}},
        "modelConfigs": [{
            "name": "llama",
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "port": 8000,
            "dataParallel": {"size": 2, "rankSelection": "Header"},
            "kvEvents": {"port": 5557}
        }],
        "routing": {"strategy": "Weighted"}
    })
}

pub fn store_of<K>(objs: impl IntoIterator<Item = K>) -> Store<K>
where
    K: kube::Resource<DynamicType = ()> + Clone + 'static,
{
    let (reader, mut writer) = reflector::store();
    for o in objs {
        writer.apply_watcher_event(&watcher::Event::Apply(o));
    }
    reader
}

/// A request the mock API server received.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub method: String,
    /// Path and query, e.g.
    /// `/apis/apps/v1/namespaces/serving/deployments/llama-picker?&force=true&fieldManager=kvroute-operator`.
    pub uri: String,
    pub content_type: Option<String>,
    pub body: Value,
}

impl Recorded {
    pub fn path(&self) -> &str {
        self.uri.split('?').next().unwrap_or(&self.uri)
    }
    pub fn query(&self) -> BTreeMap<String, String> {
        self.uri
            .split_once('?')
            .map(|(_, q)| {
                q.split('&')
                    .filter(|kv| !kv.is_empty())
                    .filter_map(|kv| kv.split_once('='))
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
                    .collect()
            })
            .unwrap_or_default()
    }
    pub fn short(&self) -> String {
        format!("{} {}", self.method, self.path())
    }
}

/// A mock API server that records every request and answers like a permissive API server:
/// applies and creates echo the body, status applies return the pool with that status, GETs
/// of unknown objects are 404, deletes succeed.
pub struct MockApi {
    pub client: Client,
    log: Arc<Mutex<Vec<Recorded>>>,
    task: tokio::task::JoinHandle<()>,
}

impl MockApi {
    pub fn start(pool: &KVRoutePool) -> Self {
        let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = Client::new(svc, "default");
        let log = Arc::new(Mutex::new(Vec::new()));
        let pool_json = serde_json::to_value(pool).expect("pool json");
        let task_log = log.clone();
        let task = tokio::spawn(async move {
            while let Some((req, send)) = handle.next_request().await {
                let method = req.method().to_string();
                let uri = req
                    .uri()
                    .path_and_query()
                    .map(|p| p.to_string())
                    .unwrap_or_default();
                let content_type = req
                    .headers()
                    .get(http::header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned);
                let bytes = req.into_body().collect_bytes().await.unwrap_or_default();
                let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
                let rec = Recorded {
                    method,
                    uri,
                    content_type,
                    body,
                };
                let (code, answer) = respond(&rec, &pool_json);
                task_log.lock().push(rec);
                let resp = Response::builder()
                    .status(code)
                    .header(http::header::CONTENT_TYPE, "application/json")
                    .body(Body::from(serde_json::to_vec(&answer).unwrap_or_default()))
                    .expect("response");
                send.send_response(resp);
            }
        });
        Self { client, log, task }
    }

    pub fn requests(&self) -> Vec<Recorded> {
        self.log.lock().clone()
    }

    pub fn shorts(&self) -> Vec<String> {
        self.requests().iter().map(Recorded::short).collect()
    }
}

impl Drop for MockApi {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn not_found() -> (StatusCode, Value) {
    (
        StatusCode::NOT_FOUND,
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404, "message": "not found"}),
    )
}

const COLLECTIONS: [&str; 4] = ["kvroutepools", "inferencepools", "endpointslices", "events"];

fn respond(rec: &Recorded, pool: &Value) -> (StatusCode, Value) {
    match rec.method.as_str() {
        "PATCH" if rec.path().ends_with("/status") => {
            let mut p = pool.clone();
            p["status"] = rec.body["status"].clone();
            (StatusCode::OK, p)
        }
        "PATCH" => (StatusCode::OK, rec.body.clone()),
        "POST" => (StatusCode::CREATED, rec.body.clone()),
        "DELETE" => (
            StatusCode::OK,
            json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 200}),
        ),
        // a collection: the last path segment is a resource's plural
        "GET" if COLLECTIONS.contains(&rec.path().rsplit('/').next().unwrap_or_default()) => (
            StatusCode::OK,
            json!({"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": "1"}, "items": []}),
        ),
        _ => not_found(),
    }
}

pub fn fixed_time() -> Time {
    Time(Timestamp::from_second(1_767_225_600).expect("time"))
}
