//! A local Kubernetes control plane for the end-to-end tests: real etcd, kube-apiserver and
//! kube-controller-manager (built by `scripts/k8s-bins.sh`), a node agent in place of the
//! kubelet, and the operator as a local process authenticated by a ServiceAccount token.
//!
//! One [`Cluster`] per test binary ([`Cluster::shared`]): starting an API server takes seconds,
//! so tests share it and isolate themselves by namespace ([`Cluster::namespace`]). The shared
//! cluster lives on a thread of its own, with its own Tokio runtime (the node agent's watches
//! run there); tests build their own clients on their own runtimes.

pub mod agent;
pub mod bins;
pub mod certs;
pub mod control_plane;
pub mod process;
pub mod wait;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use kube::api::PostParams;
use kube::{Api, Client};
use serde_json::json;

pub use agent::AgentHandle;
pub use bins::{K8sBins, WorkspaceBins, sim_binary};
pub use control_plane::{ControlPlane, Credential, client_from, write_kubeconfig};
pub use process::Proc;

/// Where the chart installs the operator, and the names it gives it.
pub const OPERATOR_NAMESPACE: &str = "kvroute-system";
pub const RELEASE: &str = "kvroute";
/// The operator's ServiceAccount (set explicitly at install) and the chart's default Lease,
/// the only one its leader-election Role lets the operator touch.
pub const OPERATOR_SERVICE_ACCOUNT: &str = "kvroute-operator";
pub const LEASE: &str = "kvroute-operator";

/// The repository root (the workspace).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap_or(Path::new("."))
        .to_path_buf()
}

/// A control plane, a node agent and (once asked for) an operator.
#[derive(Debug)]
pub struct Cluster {
    pub plane: ControlPlane,
    pub agent: AgentHandle,
    pub bins: WorkspaceBins,
    // async: held while the operator starts, so concurrent tests start one
    operator: tokio::sync::Mutex<Option<Proc>>,
    chart_installed: Mutex<bool>,
}

static SHARED: OnceLock<Result<Cluster, String>> = OnceLock::new();

impl Cluster {
    /// The test binary's cluster, started on first use. `sim` is the path of the
    /// `kvroute-sim` binary ([`sim_binary`]).
    pub fn shared(sim: &Path) -> anyhow::Result<&'static Cluster> {
        let result = SHARED.get_or_init(|| Self::start_shared(sim).map_err(|e| format!("{e:#}")));
        result.as_ref().map_err(|e| anyhow::anyhow!("{e}"))
    }

    fn start_shared(sim: &Path) -> anyhow::Result<Cluster> {
        let k8s = K8sBins::locate()?;
        let bins = WorkspaceBins::locate(sim)?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("kvroute-e2e-cluster".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = tx.send(Err(anyhow::Error::from(e)));
                        return;
                    }
                };
                rt.block_on(async move {
                    let started = Self::start(k8s, bins).await;
                    let _ = tx.send(started);
                    // keep the runtime (and the node agent on it) alive with the process
                    std::future::pending::<()>().await;
                });
            })?;
        rx.recv().context("the cluster thread died")?
    }

    async fn start(k8s: K8sBins, bins: WorkspaceBins) -> anyhow::Result<Cluster> {
        agent::ensure_pod_range()?;
        let started = std::time::Instant::now();
        let plane = ControlPlane::start(k8s).await?;
        // the node agent logs with tracing: into the state folder, unless the test set a
        // subscriber of its own
        if let Ok(file) = std::fs::File::create(plane.log_dir().join("node-agent.log")) {
            let _ = tracing_subscriber::fmt()
                .with_writer(std::sync::Mutex::new(file))
                .with_ansi(false)
                .with_env_filter(tracing_subscriber::EnvFilter::new("info,kube=warn"))
                .try_init();
        }
        eprintln!(
            "kvroute-e2e: control plane ready at {} in {:.1?} (state in {})",
            plane.server,
            started.elapsed(),
            plane.dir.display()
        );
        let agent = agent::start(
            plane.admin_client().await?,
            agent::AgentConfig {
                node: "kvroute-e2e-node".into(),
                bins: bins.clone(),
                dir: plane.dir.join("pods"),
                server: plane.server.clone(),
                ca: plane.pki.ca_cert.clone(),
                group: plane.group(),
                // distinct pod addresses per test process, so concurrent runs do not collide
                address_octet: u8::try_from(std::process::id() % 250).unwrap_or(0),
                restart_delay: Duration::from_secs(1),
            },
        )
        .await?;
        Ok(Cluster {
            plane,
            agent,
            bins,
            operator: tokio::sync::Mutex::new(None),
            chart_installed: Mutex::new(false),
        })
    }

    /// An admin client on the caller's runtime.
    pub async fn client(&self) -> anyhow::Result<Client> {
        self.plane.admin_client().await
    }

    /// A fresh namespace named `<prefix>-<n>`, deleted when the guard drops.
    pub async fn namespace(&self, prefix: &str) -> anyhow::Result<TestNamespace> {
        let client = self.client().await?;
        let api: Api<Namespace> = Api::all(client);
        let ns: Namespace = serde_json::from_value(json!({
            "metadata": {"generateName": format!("{prefix}-"), "labels": {"kvroute.dev/e2e": "true"}},
        }))?;
        let created = api.create(&PostParams::default(), &ns).await?;
        let name = created
            .metadata
            .name
            .context("the API server named no namespace")?;
        Ok(TestNamespace {
            name,
            kubectl: self.plane.bins.kubectl.clone(),
            kubeconfig: self.plane.admin_kubeconfig.clone(),
        })
    }

    /// Run `kubectl` as admin; fails with its output unless it exits 0.
    pub fn kubectl(&self, args: &[&str]) -> anyhow::Result<String> {
        run_ok(self.plane.kubectl().args(args), "kubectl")
    }

    /// Run a shell command line (a command from the docs, say) as admin from the repository's
    /// root, with this cluster's `kubectl` first on `PATH`; its output whatever the exit status.
    pub fn shell(&self, line: &str) -> anyhow::Result<Output> {
        let bin_dir = self
            .plane
            .bins
            .kubectl
            .parent()
            .context("kubectl has no folder")?
            .to_path_buf();
        let path = std::env::var_os("PATH").unwrap_or_default();
        let path =
            std::env::join_paths(std::iter::once(bin_dir).chain(std::env::split_paths(&path)))?;
        Ok(Command::new("sh")
            .args(["-c", line])
            .current_dir(repo_root())
            .env("KUBECONFIG", &self.plane.admin_kubeconfig)
            .env("PATH", path)
            .output()?)
    }

    /// Run `kubectl` as admin and return its output whatever the exit status.
    pub fn kubectl_output(&self, args: &[&str]) -> anyhow::Result<Output> {
        Ok(self.plane.kubectl().args(args).output()?)
    }

    /// Run `kubectl apply -f -` with `yaml` on stdin.
    pub fn kubectl_apply(&self, namespace: &str, yaml: &str) -> anyhow::Result<Output> {
        use std::io::Write as _;
        let mut child = self
            .plane
            .kubectl()
            .args(["apply", "--namespace", namespace, "-f", "-"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin.write_all(yaml.as_bytes())?;
        }
        Ok(child.wait_with_output()?)
    }

    /// Run `helm` as admin; fails with its output unless it exits 0.
    pub fn helm(&self, args: &[&str]) -> anyhow::Result<String> {
        run_ok(self.plane.helm().args(args), "helm")
    }

    /// Install the chart (CRDs, ServiceAccount, RBAC) with the operator Deployment scaled to
    /// zero: the tests run the operator themselves, as a local process with the chart's
    /// ServiceAccount. Idempotent.
    pub fn install_chart(&self) -> anyhow::Result<()> {
        let mut installed = self
            .chart_installed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if *installed {
            return Ok(());
        }
        let chart = repo_root().join("charts/kvroute");
        let chart = chart.display().to_string();
        self.helm(&[
            "install",
            RELEASE,
            &chart,
            "--namespace",
            OPERATOR_NAMESPACE,
            "--create-namespace",
            "--set",
            "operator.replicas=0",
            "--set",
            &format!("serviceAccount.name={OPERATOR_SERVICE_ACCOUNT}"),
            "--set",
            &format!("operator.leaderElection.leaseName={LEASE}"),
        ])?;
        *installed = true;
        Ok(())
    }

    /// A kubeconfig authenticating as the operator's ServiceAccount (TokenRequest).
    pub async fn operator_kubeconfig(&self, name: &str) -> anyhow::Result<PathBuf> {
        let client = self.client().await?;
        let sa = OPERATOR_SERVICE_ACCOUNT;
        let api: Api<ServiceAccount> = Api::namespaced(client, OPERATOR_NAMESPACE);
        let request = json!({
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": 7200},
        });
        let created: serde_json::Value = api
            .create_subresource("token", sa, &PostParams::default(), &request)
            .await
            .with_context(|| format!("TokenRequest for {OPERATOR_NAMESPACE}/{sa}"))?;
        let token = created["status"]["token"]
            .as_str()
            .context("TokenRequest answered without a token")?;
        let path = self.plane.dir.join(format!("{name}.kubeconfig"));
        write_kubeconfig(
            &path,
            &self.plane.server,
            &self.plane.pki.ca_cert,
            &format!("system:serviceaccount:{OPERATOR_NAMESPACE}:{sa}"),
            &Credential::Token(token.to_string()),
            Some(OPERATOR_NAMESPACE),
        )?;
        Ok(path)
    }

    /// Start an operator process (not shared): `args` are added to the harness's defaults.
    /// Returns the process and its metrics address.
    pub async fn start_operator(
        &self,
        name: &str,
        args: &[&str],
    ) -> anyhow::Result<(Proc, std::net::SocketAddr)> {
        self.install_chart()?;
        let kubeconfig = self.operator_kubeconfig(name).await?;
        // what the chart's generated Secret holds, as the kubelet would mount it
        let seed = self.plane.log_dir().join("operator-peer-seed");
        std::fs::write(&seed, "e2e-operator-peer-key-seed-0123456789")?;
        let mut cmd = Command::new(&self.bins.operator);
        cmd.env("KUBECONFIG", kubeconfig)
            .env(
                "RUST_LOG",
                std::env::var("KVROUTE_E2E_OPERATOR_LOG")
                    .unwrap_or_else(|_| "info,kube=warn".into()),
            )
            .env_remove("POD_NAME")
            .env_remove("POD_NAMESPACE")
            .args([
                "--metrics-addr",
                "127.0.0.1:0",
                "--print-addresses",
                "--lease-namespace",
                OPERATOR_NAMESPACE,
                "--identity",
                name,
                "--picker-image",
                "kvroute:e2e",
            ])
            .arg("--peer-key-seed-file")
            .arg(&seed)
            .args(args);
        let mut proc = Proc::spawn(
            name,
            cmd,
            self.plane.group(),
            &self.plane.log_dir().join(format!("{name}.log")),
        )?;
        let line = wait::first_line(&mut proc, Duration::from_secs(60)).await?;
        let v: serde_json::Value = serde_json::from_str(&line)
            .with_context(|| format!("{name} printed {line:?}, not its addresses"))?;
        let addr = v["metrics"]
            .as_str()
            .context("no metrics address")?
            .parse()?;
        Ok((proc, addr))
    }

    /// The operator every test uses, started on first call, holding the chart's lease.
    pub async fn ensure_operator(&self) -> anyhow::Result<()> {
        let mut guard = self.operator.lock().await;
        if let Some(p) = guard.as_mut() {
            return match p.exited() {
                None => Ok(()),
                Some(status) => bail!("the shared operator exited ({status})\n{}", p.tail()),
            };
        }
        let (proc, _) = self
            .start_operator("kvroute-operator-e2e", &["--lease-name", LEASE])
            .await?;
        *guard = Some(proc);
        Ok(())
    }

    /// After a control-plane outage: start the shared operator again if it exited, as the
    /// kubelet restarts its pod. An operator that cannot renew its lease exits on purpose (a
    /// replica that may have lost leadership must not keep writing). Returns how it exited.
    pub async fn restart_operator_if_exited(
        &self,
    ) -> anyhow::Result<Option<std::process::ExitStatus>> {
        let mut guard = self.operator.lock().await;
        let status = match guard.as_mut() {
            Some(p) => match p.exited() {
                None => return Ok(None),
                Some(status) => status,
            },
            None => bail!("the shared operator was never started"),
        };
        let (proc, _) = self
            .start_operator("kvroute-operator-e2e", &["--lease-name", LEASE])
            .await?;
        *guard = Some(proc);
        Ok(Some(status))
    }

    /// What a namespace holds, and the node agent's log, for failure messages.
    pub fn dump(&self, namespace: &str) -> String {
        let objects = self
            .kubectl_output(&[
                "get",
                "kvroutepools,deployments,replicasets,pods,endpointslices,events",
                "--namespace",
                namespace,
                "-o",
                "wide",
            ])
            .map(|o| {
                format!(
                    "{}{}",
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                )
            })
            .unwrap_or_else(|e| e.to_string());
        format!(
            "--- kubectl get ... -n {namespace} ---\n{objects}\n{}\n{}",
            process::log_tail(&self.plane.log_dir().join("node-agent.log"), 30),
            self.operator_log()
        )
    }

    /// The last lines of every operator's log, for failure messages.
    pub fn operator_log(&self) -> String {
        let mut out = String::new();
        for entry in std::fs::read_dir(self.plane.log_dir())
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.contains("operator") {
                out.push_str(&process::log_tail(&entry.path(), 40));
                out.push('\n');
            }
        }
        out
    }
}

fn run_ok(cmd: &mut Command, what: &str) -> anyhow::Result<String> {
    let out = cmd.output().with_context(|| format!("cannot run {what}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!(
            "{what} {:?} failed ({}):\n{stdout}\n{}",
            cmd.get_args().collect::<Vec<_>>(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(stdout)
}

/// A test's namespace; deleted (in the background) when dropped.
#[derive(Debug)]
pub struct TestNamespace {
    pub name: String,
    kubectl: PathBuf,
    kubeconfig: PathBuf,
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        if std::env::var_os("KVROUTE_E2E_KEEP").is_some() {
            return;
        }
        // the namespace controller deletes what is inside; the node agent stops the pods
        let _ = Command::new(&self.kubectl)
            .env("KUBECONFIG", &self.kubeconfig)
            .args(["delete", "namespace", &self.name, "--wait=false"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
    }
}
