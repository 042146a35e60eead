//! The node agent: a stand-in for the kubelet (and the scheduler) of a cluster that has
//! neither.
//!
//! It registers one Node, binds every unscheduled pod to it, and "runs" each pod as a local
//! process on the pod's own address, then reports the pod's IP, phase, container status and
//! Ready condition.
//!
//! # Pod addresses
//!
//! Each pod gets its own address in [`POD_RANGE`] (`198.18.0.0/16`, the range RFC 2544 reserves
//! for benchmarks), routed to the loopback device by one `local` route — so traffic never
//! leaves the machine, exactly as with `127.0.0.x`. Loopback addresses themselves cannot be
//! used: the API server rejects EndpointSlices listing `127.0.0.0/8` ("may not be in the
//! loopback range"), and EndpointSlices are what the operator writes. [`ensure_pod_range`]
//! adds the route when it is missing (root, or `CAP_NET_ADMIN`, needed once per boot). When a pod is deleted it stops the
//! process (SIGTERM, SIGKILL after the grace period) and finishes the deletion, as a kubelet
//! would. A process that dies on its own is reported (container not ready, pod not Ready) and
//! restarted, as `restartPolicy: Always` wants — unless a test holds it down.
//!
//! # Which program runs a pod
//!
//! Only the pod's first container is run, chosen by its image:
//!
//! | image (any registry, any tag) | program | arguments |
//! |---|---|---|
//! | `…/kvroute-sim` | `kvroute-sim` | the container's `args`, plus `--host <pod IP>` |
//! | `…/kvroute`, or a container named `picker` | `kvroute-picker` | the container's `args`, paths under volume mounts rewritten to the pod's folder, plus `--print-addresses` and listeners on the pod IP |
//!
//! So a model-server pod declares its engine with the simulator's own flags, e.g.
//! `args: [--port, "8000", --dp-size, "2", --kv-events-port, "5557", --model, m]`; the
//! container ports are informative. Other images are never started: their pods stay Pending
//! with the reason `NodeAgentUnknownImage`.
//!
//! Deletion follows the kubelet: a `lifecycle.preStop.sleep` first (the process keeps
//! serving while the pod shows as terminating), SIGTERM, SIGKILL after the grace period.
//!
//! A pod is Ready once its process printed its address line (both binaries print one JSON
//! line when they listen) and, when the container has an HTTP `readinessProbe`, while that
//! probe answers 2xx. ConfigMap and Secret volumes are copied into the pod's folder when the
//! process starts. A picker pod authenticates with a token of its own ServiceAccount
//! (TokenRequest), so the RBAC the operator grants pickers is what they run with.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{ConfigMap, Container, Node, Pod, Secret, ServiceAccount};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client, ResourceExt as _};
use serde_json::json;
use tokio::sync::{mpsc, oneshot};

use super::bins::WorkspaceBins;
use super::control_plane::{Credential, write_kubeconfig};
use super::process::Proc;

/// Pod addresses: a `/16` routed to the loopback device (see the module docs).
pub const POD_RANGE: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 0);

/// Make [`POD_RANGE`] bindable: a `local` route to the loopback device, added with `ip route`
/// when missing. Fails with what to run when it cannot be added.
pub fn ensure_pod_range() -> anyhow::Result<()> {
    let [a, b, ..] = POD_RANGE.octets();
    let probe = Ipv4Addr::new(a, b, 255, 254);
    let bindable = || std::net::TcpListener::bind((probe, 0)).is_ok();
    if bindable() {
        return Ok(());
    }
    let route = format!("{POD_RANGE}/16");
    let out = Command::new("ip")
        .args(["route", "add", "local", &route, "dev", "lo"])
        .output();
    if bindable() {
        return Ok(());
    }
    let why = match out {
        Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_string(),
        Err(e) => e.to_string(),
    };
    anyhow::bail!(
        "the node agent gives pods addresses in {route} on the loopback device (the API server \
         rejects loopback addresses in EndpointSlices), and could not add the route ({why}). \
         Run once, as root: ip route add local {route} dev lo"
    )
}

/// Where a pod's program comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Program {
    Sim,
    Picker,
}

/// The program the agent runs for `container` (see the module docs).
pub fn program_for(container: &Container) -> Option<Program> {
    let image = container.image.as_deref().unwrap_or_default();
    // strip the tag or digest, then the registry and repository path
    let no_digest = image.split('@').next().unwrap_or_default();
    let last = no_digest.rsplit('/').next().unwrap_or_default();
    let base = last.split(':').next().unwrap_or_default();
    match base {
        "kvroute-sim" => Some(Program::Sim),
        "kvroute" | "kvroute-picker" => Some(Program::Picker),
        _ if container.name == "picker" => Some(Program::Picker),
        _ => None,
    }
}

/// What the agent needs to know.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub node: String,
    pub bins: WorkspaceBins,
    /// Per-pod folders (volumes, logs, kubeconfigs) go here.
    pub dir: PathBuf,
    /// The API server and its CA, for the kubeconfigs of picker pods.
    pub server: String,
    pub ca: PathBuf,
    /// Process group of the harness's reaper.
    pub group: i32,
    /// Third octet of the pod addresses `198.18.<octet>.y` (one per test process).
    pub address_octet: u8,
    /// Pause before restarting a process that died on its own.
    pub restart_delay: Duration,
}

enum Command_ {
    Kill {
        namespace: String,
        name: String,
        hold: bool,
        reply: oneshot::Sender<anyhow::Result<()>>,
    },
    Release {
        namespace: String,
        name: String,
        reply: oneshot::Sender<anyhow::Result<()>>,
    },
}

/// Talks to a running agent from any runtime.
#[derive(Debug, Clone)]
pub struct AgentHandle {
    tx: mpsc::UnboundedSender<Command_>,
    pub node: String,
}

impl std::fmt::Debug for Command_ {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Kill {
                namespace, name, ..
            } => write!(f, "Kill({namespace}/{name})"),
            Self::Release {
                namespace, name, ..
            } => write!(f, "Release({namespace}/{name})"),
        }
    }
}

impl AgentHandle {
    /// SIGKILL the process of a pod without deleting the pod (a crash). With `hold`, the
    /// agent does not restart it until [`AgentHandle::release`].
    pub async fn kill_process(
        &self,
        namespace: &str,
        name: &str,
        hold: bool,
    ) -> anyhow::Result<()> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command_::Kill {
                namespace: namespace.into(),
                name: name.into(),
                hold,
                reply,
            })
            .map_err(|_| anyhow::anyhow!("the node agent stopped"))?;
        rx.await?
    }

    /// Let the agent restart a held process (its state starts empty: a fresh process).
    pub async fn release(&self, namespace: &str, name: &str) -> anyhow::Result<()> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command_::Release {
                namespace: namespace.into(),
                name: name.into(),
                reply,
            })
            .map_err(|_| anyhow::anyhow!("the node agent stopped"))?;
        rx.await?
    }
}

/// One pod the agent runs.
struct Running {
    namespace: String,
    name: String,
    uid: String,
    ip: Ipv4Addr,
    program: Program,
    container: Container,
    pod: Pod,
    proc: Option<Proc>,
    hold: bool,
    restarts: i32,
    /// When a dead process may be restarted.
    restart_at: Option<Instant>,
    started_at: String,
    probe_ok: bool,
    last_status: serde_json::Value,
}

struct Agent {
    client: Client,
    config: AgentConfig,
    pods: HashMap<(String, String), Running>,
    next_address: u32,
    http: reqwest::Client,
}

fn now_rfc3339() -> String {
    k8s_openapi::jiff::Timestamp::now().to_string()
}

/// Start the agent on the current runtime: registers the Node, then serves until the
/// runtime stops.
pub async fn start(client: Client, config: AgentConfig) -> anyhow::Result<AgentHandle> {
    register_node(&client, &config.node).await?;
    std::fs::create_dir_all(&config.dir)?;
    let (tx, rx) = mpsc::unbounded_channel();
    let handle = AgentHandle {
        tx,
        node: config.node.clone(),
    };
    let agent = Agent {
        client,
        config,
        pods: HashMap::new(),
        next_address: 0,
        http: reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(1))
            .build()?,
    };
    tokio::spawn(agent.run(rx));
    Ok(handle)
}

async fn register_node(client: &Client, node: &str) -> anyhow::Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    let body: Node = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": node, "labels": {"kubernetes.io/hostname": node, "kubernetes.io/os": "linux"}},
    }))?;
    match nodes.create(&PostParams::default(), &body).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => return Err(e).context("cannot register the node"),
    }
    let status = json!({"status": {
        "conditions": [{"type": "Ready", "status": "True", "reason": "KvrouteNodeAgent",
                        "message": "kvroute e2e node agent", "lastHeartbeatTime": now_rfc3339()}],
        "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": node}],
        "capacity": {"cpu": "64", "memory": "256Gi", "pods": "250"},
        "allocatable": {"cpu": "64", "memory": "256Gi", "pods": "250"},
    }});
    nodes
        .patch_status(node, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .context("cannot set the node's status")?;
    Ok(())
}

impl Agent {
    async fn run(mut self, mut commands: mpsc::UnboundedReceiver<Command_>) {
        let pods: Api<Pod> = Api::all(self.client.clone());
        let mut events = watcher(pods, watcher::Config::default())
            .default_backoff()
            .boxed();
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                ev = events.next() => match ev {
                    Some(Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod))) => {
                        self.on_pod(pod).await;
                    }
                    Some(Ok(watcher::Event::Delete(pod))) => self.on_gone(&pod),
                    Some(Ok(_)) => {}
                    Some(Err(e)) => tracing::warn!(error = %e, "node agent: pod watch error"),
                    None => return,
                },
                Some(cmd) = commands.recv() => self.on_command(cmd),
                _ = tick.tick() => self.on_tick().await,
            }
        }
    }

    fn on_command(&mut self, cmd: Command_) {
        match cmd {
            Command_::Kill {
                namespace,
                name,
                hold,
                reply,
            } => {
                let result = match self.pods.get_mut(&(namespace.clone(), name.clone())) {
                    Some(run) => {
                        run.hold = hold;
                        if let Some(p) = run.proc.as_mut() {
                            p.kill();
                        }
                        Ok(())
                    }
                    None => Err(anyhow::anyhow!(
                        "the node agent runs no pod {namespace}/{name}"
                    )),
                };
                let _ = reply.send(result);
            }
            Command_::Release {
                namespace,
                name,
                reply,
            } => {
                let result = match self.pods.get_mut(&(namespace.clone(), name.clone())) {
                    Some(run) => {
                        run.hold = false;
                        Ok(())
                    }
                    None => Err(anyhow::anyhow!(
                        "the node agent runs no pod {namespace}/{name}"
                    )),
                };
                let _ = reply.send(result);
            }
        }
    }

    fn allocate_ip(&mut self) -> Ipv4Addr {
        let n = self.next_address;
        self.next_address += 1;
        // .0, .1 and .255 are skipped; 253 pods per test process, more than a test binary makes
        let fourth = u8::try_from(n % 253 + 2).unwrap_or(2);
        let [a, b, ..] = POD_RANGE.octets();
        Ipv4Addr::new(a, b, self.config.address_octet, fourth)
    }

    async fn on_pod(&mut self, pod: Pod) {
        let (Some(namespace), name) = (pod.namespace(), pod.name_any()) else {
            return;
        };
        let key = (namespace.clone(), name.clone());
        let spec = pod.spec.clone().unwrap_or_default();
        if pod.metadata.deletion_timestamp.is_some() {
            self.delete(&pod, key).await;
            return;
        }
        match spec.node_name.as_deref() {
            None => {
                if let Err(e) = self.bind(&namespace, &name).await {
                    tracing::warn!(pod = %name, error = %e, "node agent: cannot bind");
                }
                return;
            }
            Some(n) if n != self.config.node => return,
            Some(_) => {}
        }
        let uid = pod.uid().unwrap_or_default();
        if let Some(run) = self.pods.get_mut(&key) {
            if run.uid == uid {
                run.pod = pod;
                return;
            }
            // a new pod with the same name (a StatefulSet would do that): start over
            if let Some(old) = self.pods.remove(&key) {
                drop(old);
            }
        }
        let Some(container) = spec.containers.first().cloned() else {
            return;
        };
        let Some(program) = program_for(&container) else {
            let status = json!({"status": {
                "phase": "Pending",
                "conditions": [{"type": "PodScheduled", "status": "True"}],
                "containerStatuses": [{
                    "name": container.name, "ready": false, "restartCount": 0,
                    "image": container.image.clone().unwrap_or_default(), "imageID": "",
                    "state": {"waiting": {"reason": "NodeAgentUnknownImage",
                        "message": "the kvroute e2e node agent runs only kvroute-sim and kvroute picker images"}},
                }],
            }});
            let _ = Api::<Pod>::namespaced(self.client.clone(), &namespace)
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
                .await;
            return;
        };
        let ip = self.allocate_ip();
        let run = Running {
            namespace,
            name,
            uid,
            ip,
            program,
            container,
            pod,
            proc: None,
            hold: false,
            restarts: 0,
            restart_at: Some(Instant::now()),
            started_at: now_rfc3339(),
            probe_ok: false,
            last_status: serde_json::Value::Null,
        };
        self.pods.insert(key.clone(), run);
        self.maybe_start(&key).await;
        self.report(&key).await;
    }

    fn on_gone(&mut self, pod: &Pod) {
        if let Some(ns) = pod.namespace() {
            // dropping `Running` kills its process
            self.pods.remove(&(ns, pod.name_any()));
        }
    }

    async fn bind(&self, namespace: &str, name: &str) -> anyhow::Result<()> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let binding = json!({
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name},
            "target": {"apiVersion": "v1", "kind": "Node", "name": self.config.node},
        });
        match pods
            .create_subresource::<_, serde_json::Value>(
                "binding",
                name,
                &PostParams::default(),
                &binding,
            )
            .await
        {
            Ok(_) => Ok(()),
            // already bound (a repeated event) or already gone
            Err(kube::Error::Api(e)) if e.code == 409 || e.code == 404 => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Stop the process (the container's `preStop` sleep, then SIGTERM, then SIGKILL after the
    /// pod's grace period, at most 10 s) and finish the deletion the API server waits for.
    async fn delete(&mut self, pod: &Pod, key: (String, String)) {
        let grace = pod
            .metadata
            .deletion_grace_period_seconds
            .and_then(|s| u64::try_from(s).ok())
            .unwrap_or(30)
            .min(10);
        let run = self.pods.remove(&key);
        let bound_here = pod.spec.as_ref().and_then(|s| s.node_name.as_deref())
            == Some(self.config.node.as_str());
        if run.is_none() && !bound_here {
            return;
        }
        // a preStop sleep, as kubelets run it: the process keeps serving while endpoints
        // consumers see the pod terminating, then gets SIGTERM
        let pre_stop = pod
            .spec
            .as_ref()
            .and_then(|s| s.containers.first())
            .and_then(|c| c.lifecycle.as_ref()?.pre_stop.as_ref()?.sleep.as_ref())
            .and_then(|s| u64::try_from(s.seconds).ok())
            .unwrap_or(0)
            .min(grace);
        let client = self.client.clone();
        let uid = pod.uid();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(pre_stop)).await;
            if let Some(mut p) = run.and_then(|mut run| run.proc.take()) {
                let _ = tokio::task::spawn_blocking(move || {
                    p.terminate(Duration::from_secs(grace));
                })
                .await;
            }
            let pods: Api<Pod> = Api::namespaced(client, &key.0);
            let dp = DeleteParams {
                grace_period_seconds: Some(0),
                preconditions: uid.map(|uid| Preconditions {
                    uid: Some(uid),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            };
            match pods.delete(&key.1, &dp).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
                Err(e) => {
                    tracing::warn!(pod = %key.1, error = %e, "node agent: cannot finish deletion")
                }
            }
        });
    }

    async fn on_tick(&mut self) {
        let keys: Vec<(String, String)> = self.pods.keys().cloned().collect();
        for key in keys {
            self.check(&key).await;
            self.maybe_start(&key).await;
            self.report(&key).await;
        }
    }

    /// Notice a dead process; run the readiness probe.
    async fn check(&mut self, key: &(String, String)) {
        let restart_delay = self.config.restart_delay;
        let Some(run) = self.pods.get_mut(key) else {
            return;
        };
        if let Some(status) = run.proc.as_mut().and_then(Proc::exited) {
            tracing::info!(pod = %run.name, %status, "node agent: process exited");
            run.proc = None;
            run.restarts += 1;
            run.probe_ok = false;
            run.restart_at = Some(Instant::now() + restart_delay);
        }
        let Some(p) = run.proc.as_ref() else { return };
        if p.try_first_line().is_none() {
            return;
        }
        let probe = run
            .container
            .readiness_probe
            .as_ref()
            .and_then(|p| p.http_get.as_ref());
        run.probe_ok = match probe {
            None => true,
            Some(get) => {
                let port = match &get.port {
                    k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(n) => {
                        u16::try_from(*n).ok()
                    }
                    k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(name) => run
                        .container
                        .ports
                        .iter()
                        .flatten()
                        .find(|p| p.name.as_deref() == Some(name.as_str()))
                        .and_then(|p| u16::try_from(p.container_port).ok()),
                };
                match port {
                    None => false,
                    Some(port) => {
                        let path = get.path.as_deref().unwrap_or("/");
                        let url = format!("http://{}:{port}{path}", run.ip);
                        matches!(self.http.get(url).send().await, Ok(r) if r.status().is_success())
                    }
                }
            }
        };
    }

    async fn maybe_start(&mut self, key: &(String, String)) {
        let (client, config) = (self.client.clone(), self.config.clone());
        let Some(run) = self.pods.get_mut(key) else {
            return;
        };
        if run.proc.is_some() || run.hold {
            return;
        }
        match run.restart_at {
            Some(at) if at <= Instant::now() => {}
            _ => return,
        }
        run.restart_at = None;
        match start_process(&client, &config, run).await {
            Ok(p) => {
                run.started_at = now_rfc3339();
                run.proc = Some(p);
            }
            Err(e) => {
                tracing::warn!(pod = %run.name, error = %format!("{e:#}"), "node agent: cannot start");
                run.restarts += 1;
                run.restart_at = Some(Instant::now() + Duration::from_secs(2));
            }
        }
    }

    /// Patch the pod's status when what it should say changed.
    async fn report(&mut self, key: &(String, String)) {
        let Some(run) = self.pods.get_mut(key) else {
            return;
        };
        let running = run.proc.is_some();
        let ready = running && run.probe_ok;
        let flag = |b: bool| if b { "True" } else { "False" };
        let state = if running {
            json!({"running": {"startedAt": run.started_at}})
        } else if run.hold || run.restarts > 0 {
            json!({"waiting": {"reason": "CrashLoopBackOff", "message": "the process exited"}})
        } else {
            json!({"waiting": {"reason": "ContainerCreating"}})
        };
        let ip = run.ip.to_string();
        let status = json!({"status": {
            "phase": if running || run.restarts > 0 { "Running" } else { "Pending" },
            "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "startTime": run.pod.status.as_ref().and_then(|s| s.start_time.as_ref()).map_or_else(now_rfc3339, |t| t.0.to_string()),
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Initialized", "status": "True"},
                {"type": "ContainersReady", "status": flag(ready)},
                {"type": "Ready", "status": flag(ready)},
            ],
            "containerStatuses": [{
                "name": run.container.name,
                "ready": ready,
                "started": running,
                "restartCount": run.restarts,
                "image": run.container.image.clone().unwrap_or_default(),
                "imageID": "",
                "state": state,
            }],
        }});
        if status == run.last_status {
            return;
        }
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &run.namespace);
        match pods
            .patch_status(&run.name, &PatchParams::default(), &Patch::Merge(&status))
            .await
        {
            Ok(_) => run.last_status = status,
            Err(e) => {
                tracing::debug!(pod = %run.name, error = %e, "node agent: status patch failed")
            }
        }
    }
}

/// Materialize the pod's ConfigMap and Secret volumes under `root` at their mount paths.
async fn materialize_volumes(
    client: &Client,
    namespace: &str,
    pod: &Pod,
    container: &Container,
    root: &Path,
) -> anyhow::Result<()> {
    let volumes = pod
        .spec
        .as_ref()
        .and_then(|s| s.volumes.clone())
        .unwrap_or_default();
    for mount in container.volume_mounts.iter().flatten() {
        let Some(volume) = volumes.iter().find(|v| v.name == mount.name) else {
            continue;
        };
        let target = root.join(mount.mount_path.trim_start_matches('/'));
        std::fs::create_dir_all(&target)?;
        let mut files: BTreeMap<String, Vec<u8>> = BTreeMap::new();
        let mut items = None;
        if let Some(cm) = &volume.config_map {
            let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
            let map = api
                .get(&cm.name)
                .await
                .with_context(|| format!("configMap volume {}", cm.name))?;
            for (k, v) in map.data.unwrap_or_default() {
                files.insert(k, v.into_bytes());
            }
            for (k, v) in map.binary_data.unwrap_or_default() {
                files.insert(k, v.0);
            }
            items = cm.items.clone();
        } else if let Some(s) = &volume.secret {
            let name = s.secret_name.clone().unwrap_or_default();
            let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
            let secret = api
                .get(&name)
                .await
                .with_context(|| format!("secret volume {name}"))?;
            for (k, v) in secret.data.unwrap_or_default() {
                files.insert(k, v.0);
            }
            items = s.items.clone();
        }
        match items {
            Some(items) => {
                for item in items {
                    if let Some(data) = files.get(&item.key) {
                        std::fs::write(target.join(&item.path), data)?;
                    }
                }
            }
            None => {
                for (k, data) in files {
                    std::fs::write(target.join(k), data)?;
                }
            }
        }
    }
    Ok(())
}

/// A short-lived token of `service_account`, bound to the pod.
async fn service_account_token(
    client: &Client,
    namespace: &str,
    service_account: &str,
    pod: &Pod,
) -> anyhow::Result<String> {
    let api: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    let request = json!({
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {
            "expirationSeconds": 3600,
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": pod.name_any(), "uid": pod.uid()},
        },
    });
    let created: serde_json::Value = api
        .create_subresource("token", service_account, &PostParams::default(), &request)
        .await
        .with_context(|| format!("TokenRequest for {namespace}/{service_account}"))?;
    created["status"]["token"]
        .as_str()
        .map(str::to_string)
        .context("TokenRequest answered without a token")
}

async fn start_process(
    client: &Client,
    config: &AgentConfig,
    run: &Running,
) -> anyhow::Result<Proc> {
    let pod_dir = config
        .dir
        .join(format!("{}_{}_{}", run.namespace, run.name, run.restarts));
    let root = pod_dir.join("root");
    std::fs::create_dir_all(&root)?;
    let ip = IpAddr::V4(run.ip);
    let mut env: Vec<(String, String)> = Vec::new();
    for e in run.container.env.iter().flatten() {
        let value = match (&e.value, &e.value_from) {
            (Some(v), _) => v.clone(),
            (None, Some(from)) => match from.field_ref.as_ref().map(|f| f.field_path.as_str()) {
                Some("metadata.name") => run.name.clone(),
                Some("metadata.namespace") => run.namespace.clone(),
                Some("status.podIP") => ip.to_string(),
                Some("spec.nodeName") => config.node.clone(),
                _ => continue,
            },
            (None, None) => String::new(),
        };
        env.push((e.name.clone(), value));
    }
    let args: Vec<String> = run.container.args.clone().unwrap_or_default();
    let mut cmd;
    match run.program {
        Program::Sim => {
            cmd = Command::new(&config.bins.sim);
            cmd.args(&args).arg("--host").arg(ip.to_string());
        }
        Program::Picker => {
            materialize_volumes(client, &run.namespace, &run.pod, &run.container, &root).await?;
            // paths inside the "container" resolve under the pod's root folder
            let mounts: Vec<String> = run
                .container
                .volume_mounts
                .iter()
                .flatten()
                .map(|m| m.mount_path.clone())
                .collect();
            let rewrite = |a: &String| -> String {
                if mounts.iter().any(|m| a.starts_with(m.as_str())) {
                    root.join(a.trim_start_matches('/')).display().to_string()
                } else {
                    a.clone()
                }
            };
            let in_root = |p: &str| root.join(p.trim_start_matches('/')).display().to_string();
            cmd = Command::new(&config.bins.picker);
            cmd.args(args.iter().map(rewrite))
                .arg("--tokenizer-dir")
                .arg(in_root(kvroute_crds::contract::TOKENIZER_MOUNT_ROOT))
                .arg("--salt-dir")
                .arg(in_root(kvroute_crds::contract::SALT_MOUNT_DIR))
                .arg("--http")
                .arg(format!("{ip}:{}", kvroute_crds::contract::PICKER_HTTP_PORT))
                .arg("--metrics")
                .arg(format!(
                    "{ip}:{}",
                    kvroute_crds::contract::PICKER_METRICS_PORT
                ))
                .arg("--ext-proc")
                .arg(format!(
                    "{ip}:{}",
                    kvroute_crds::contract::PICKER_EXT_PROC_PORT
                ))
                .arg("--peers")
                .arg(format!("{ip}:{}", kvroute_crds::contract::PICKER_PEER_PORT))
                .arg("--peer-key-file")
                .arg(in_root(&format!(
                    "{}/{}",
                    kvroute_crds::contract::PEER_KEY_MOUNT_DIR,
                    kvroute_crds::contract::PEER_KEY_FILE
                )))
                // the pod's loopback is its own address here
                .arg("--admin")
                .arg(format!(
                    "{ip}:{}",
                    kvroute_crds::contract::PICKER_ADMIN_PORT
                ))
                .arg("--print-addresses");
            let service_account = run
                .pod
                .spec
                .as_ref()
                .and_then(|s| s.service_account_name.clone())
                .unwrap_or_else(|| "default".to_string());
            let token =
                service_account_token(client, &run.namespace, &service_account, &run.pod).await?;
            let kubeconfig = pod_dir.join("kubeconfig");
            write_kubeconfig(
                &kubeconfig,
                &config.server,
                &config.ca,
                &format!("system:serviceaccount:{}:{service_account}", run.namespace),
                &Credential::Token(token),
                Some(&run.namespace),
            )?;
            cmd.env("KUBECONFIG", kubeconfig);
        }
    }
    cmd.envs(env);
    if !cmd.get_envs().any(|(k, _)| k == "RUST_LOG") {
        cmd.env("RUST_LOG", "info");
    }
    let log = pod_dir.join("process.log");
    // readiness follows the address line, on a later tick
    Proc::spawn(
        &format!("{}/{}", run.namespace, run.name),
        cmd,
        config.group,
        &log,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn container(name: &str, image: &str) -> Container {
        Container {
            name: name.into(),
            image: Some(image.into()),
            ..Container::default()
        }
    }

    #[test]
    fn programs_follow_the_image() {
        assert_eq!(
            program_for(&container("engine", "kvroute-sim")),
            Some(Program::Sim)
        );
        assert_eq!(
            program_for(&container("engine", "ghcr.io/x/kvroute-sim:1.0")),
            Some(Program::Sim)
        );
        assert_eq!(
            program_for(&container("x", "ghcr.io/kvroute/kvroute:0.1.0")),
            Some(Program::Picker)
        );
        assert_eq!(
            program_for(&container("picker", "registry.local/other:1")),
            Some(Program::Picker)
        );
        assert_eq!(
            program_for(&container("vllm", "vllm/vllm-openai:v0.9")),
            None
        );
        assert_eq!(
            program_for(&container("x", "localhost:5000/kvroute-sim@sha256:ab")),
            Some(Program::Sim)
        );
    }
}
