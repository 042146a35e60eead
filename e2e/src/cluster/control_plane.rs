//! etcd, kube-apiserver and kube-controller-manager on loopback, with generated certificates,
//! RBAC authorization, service-account tokens and an admin kubeconfig. Everything lives in
//! one temporary folder; everything stops on drop (or, for a harness kept in a `static`, when
//! the test process exits: see [`super::process::Reaper`]).

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use kube::Client;
use kube::config::{KubeConfigOptions, Kubeconfig};

use super::bins::K8sBins;
use super::certs::Pki;
use super::process::{Proc, Reaper, free_port};

/// How long the API server gets to report ready (a cold start on a busy 2-core machine takes
/// tens of seconds).
const READY_TIMEOUT: Duration = Duration::from_secs(180);

/// The controllers a test cluster needs: Deployments make ReplicaSets make Pods, owner
/// references are garbage-collected, namespaces get their default ServiceAccount and can be
/// deleted. No scheduler and no kubelet: the node agent binds and "runs" pods.
const CONTROLLERS: &str = "deployment-controller,replicaset-controller,\
garbage-collector-controller,serviceaccount-controller,namespace-controller";

/// How a kubeconfig authenticates.
#[derive(Debug, Clone)]
pub enum Credential {
    ClientCert { cert: PathBuf, key: PathBuf },
    Token(String),
}

/// Write a kubeconfig for `server` with `credential` to `path`.
pub fn write_kubeconfig(
    path: &Path,
    server: &str,
    ca: &Path,
    user: &str,
    credential: &Credential,
    namespace: Option<&str>,
) -> anyhow::Result<()> {
    let user_body = match credential {
        Credential::ClientCert { cert, key } => serde_json::json!({
            "client-certificate": cert, "client-key": key,
        }),
        Credential::Token(t) => serde_json::json!({ "token": t }),
    };
    let mut context = serde_json::json!({ "cluster": "e2e", "user": user });
    if let Some(ns) = namespace {
        context["namespace"] = serde_json::json!(ns);
    }
    let doc = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "e2e", "cluster": {"server": server, "certificate-authority": ca}}],
        "users": [{"name": user, "user": user_body}],
        "contexts": [{"name": "e2e", "context": context}],
        "current-context": "e2e",
    });
    std::fs::write(path, serde_yaml_ng::to_string(&doc)?)
        .with_context(|| format!("cannot write {}", path.display()))
}

/// A kube client from a kubeconfig file, on the calling task's runtime.
pub async fn client_from(kubeconfig: &Path) -> anyhow::Result<Client> {
    let kc = Kubeconfig::read_from(kubeconfig)?;
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    Ok(Client::try_from(config)?)
}

/// A running control plane.
/// With `KVROUTE_E2E_AUDIT` set, the API server logs every request a ServiceAccount (the
/// operator, the pickers) makes, with its response code, to `logs/audit.log`.
const AUDIT_POLICY: &str = "\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    userGroups: [system:serviceaccounts]
  - level: None
";

#[derive(Debug)]
pub struct ControlPlane {
    // field order is drop order: processes first, then the reaper, then the folder
    processes: std::sync::Mutex<Vec<Proc>>,
    /// How the API server was started, to restart it the same way (fault tests).
    apiserver_args: Vec<std::ffi::OsString>,
    reaper: Reaper,
    pub bins: K8sBins,
    pub dir: PathBuf,
    pub server: String,
    pub pki: Pki,
    pub admin_kubeconfig: PathBuf,
    tempdir: Option<tempfile::TempDir>,
}

impl ControlPlane {
    /// Start etcd, the API server (wait for `/readyz`) and the controller manager.
    /// `KVROUTE_E2E_KEEP=1` keeps the state folder (logs, certificates) after the run.
    pub async fn start(bins: K8sBins) -> anyhow::Result<Self> {
        let tempdir = tempfile::Builder::new()
            .prefix("kvroute-e2e-")
            .tempdir()
            .context("cannot create the state folder")?;
        let dir = tempdir.path().to_path_buf();
        let keep = std::env::var_os("KVROUTE_E2E_KEEP").is_some();
        let (tempdir, reaper) = if keep {
            eprintln!("kvroute-e2e: keeping {}", dir.display());
            let _kept = tempdir.keep();
            (None, Reaper::start(Path::new("/nonexistent-kvroute-e2e"))?)
        } else {
            let reaper = Reaper::start(&dir)?;
            (Some(tempdir), reaper)
        };
        let group = reaper.group();
        let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let pki = Pki::write(&dir.join("pki"), &[loopback, "10.96.0.1".parse()?])?;
        let logs = dir.join("logs");
        std::fs::create_dir_all(&logs)?;

        let client_port = free_port(loopback)?;
        let peer_port = free_port(loopback)?;
        let etcd_url = format!("http://127.0.0.1:{client_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let mut etcd = Command::new(&bins.etcd);
        etcd.arg("--name=e2e")
            .arg(format!("--data-dir={}", dir.join("etcd").display()))
            .arg(format!("--listen-client-urls={etcd_url}"))
            .arg(format!("--advertise-client-urls={etcd_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=e2e={peer_url}"))
            // a throwaway store: no fsync, a small backend
            .arg("--unsafe-no-fsync=true")
            .arg("--quota-backend-bytes=1073741824")
            .arg("--log-level=warn");
        let mut processes = vec![Proc::spawn("etcd", etcd, group, &logs.join("etcd.log"))?];

        let port = free_port(loopback)?;
        let server = format!("https://127.0.0.1:{port}");
        let mut api = Command::new(&bins.kube_apiserver);
        api.arg(format!("--etcd-servers={etcd_url}"))
            .arg("--bind-address=127.0.0.1")
            .arg("--advertise-address=127.0.0.1")
            .arg(format!("--secure-port={port}"))
            .arg(format!("--cert-dir={}", dir.join("apiserver").display()))
            .arg(format!("--tls-cert-file={}", pki.serving_cert.display()))
            .arg(format!(
                "--tls-private-key-file={}",
                pki.serving_key.display()
            ))
            .arg(format!("--client-ca-file={}", pki.ca_cert.display()))
            .arg("--authorization-mode=RBAC")
            .arg("--service-account-issuer=https://kubernetes.default.svc.cluster.local")
            .arg(format!(
                "--service-account-key-file={}",
                pki.service_account_pub.display()
            ))
            .arg(format!(
                "--service-account-signing-key-file={}",
                pki.service_account_key.display()
            ))
            .arg("--service-cluster-ip-range=10.96.0.0/16")
            // front proxy (aggregation) settings: the controller manager's delegated
            // authentication reads them, and complains without
            .arg(format!(
                "--requestheader-client-ca-file={}",
                pki.ca_cert.display()
            ))
            .arg("--requestheader-allowed-names=front-proxy-client")
            .arg("--requestheader-username-headers=X-Remote-User")
            .arg("--requestheader-group-headers=X-Remote-Group")
            .arg("--requestheader-extra-headers-prefix=X-Remote-Extra-")
            .arg(format!(
                "--proxy-client-cert-file={}",
                pki.front_proxy_cert.display()
            ))
            .arg(format!(
                "--proxy-client-key-file={}",
                pki.front_proxy_key.display()
            ))
            .arg("--allow-privileged=true")
            .arg("--profiling=false")
            .arg("--v=1");
        if std::env::var_os("KVROUTE_E2E_AUDIT").is_some() {
            let policy = dir.join("audit-policy.yaml");
            std::fs::write(&policy, AUDIT_POLICY)?;
            api.arg(format!("--audit-policy-file={}", policy.display()))
                .arg(format!(
                    "--audit-log-path={}",
                    logs.join("audit.log").display()
                ));
        }
        let apiserver_args = api.get_args().map(ToOwned::to_owned).collect();
        processes.push(Proc::spawn(
            "kube-apiserver",
            api,
            group,
            &logs.join("kube-apiserver.log"),
        )?);

        let admin_kubeconfig = dir.join("admin.kubeconfig");
        write_kubeconfig(
            &admin_kubeconfig,
            &server,
            &pki.ca_cert,
            "admin",
            &Credential::ClientCert {
                cert: pki.admin_cert.clone(),
                key: pki.admin_key.clone(),
            },
            None,
        )?;
        let plane = Self {
            processes: std::sync::Mutex::new(processes),
            apiserver_args,
            reaper,
            bins,
            dir: dir.clone(),
            server: server.clone(),
            pki,
            admin_kubeconfig,
            tempdir,
        };
        plane.wait_ready().await?;

        let cm_kubeconfig = dir.join("controller-manager.kubeconfig");
        write_kubeconfig(
            &cm_kubeconfig,
            &server,
            &plane.pki.ca_cert,
            "system:kube-controller-manager",
            &Credential::ClientCert {
                cert: plane.pki.controller_manager_cert.clone(),
                key: plane.pki.controller_manager_key.clone(),
            },
            None,
        )?;
        let mut cm = Command::new(&plane.bins.kube_controller_manager);
        cm.arg(format!("--kubeconfig={}", cm_kubeconfig.display()))
            .arg(format!(
                "--authentication-kubeconfig={}",
                cm_kubeconfig.display()
            ))
            .arg(format!(
                "--authorization-kubeconfig={}",
                cm_kubeconfig.display()
            ))
            .arg(format!("--controllers={CONTROLLERS}"))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--secure-port={}", free_port(loopback)?))
            .arg(format!(
                "--cert-dir={}",
                dir.join("controller-manager").display()
            ))
            .arg("--leader-elect=false")
            // each controller acts as its own ServiceAccount with the bootstrap RBAC roles
            // (the controller manager's own identity may only mint their tokens)
            .arg("--use-service-account-credentials=true")
            .arg(format!("--root-ca-file={}", plane.pki.ca_cert.display()))
            .arg(format!(
                "--service-account-private-key-file={}",
                plane.pki.service_account_key.display()
            ))
            .arg("--v=1");
        let cm = Proc::spawn(
            "kube-controller-manager",
            cm,
            plane.reaper.group(),
            &logs.join("kube-controller-manager.log"),
        )?;
        plane.lock_processes().push(cm);
        Ok(plane)
    }

    fn lock_processes(&self) -> std::sync::MutexGuard<'_, Vec<Proc>> {
        self.processes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    async fn wait_ready(&self) -> anyhow::Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        let client = client_from(&self.admin_kubeconfig).await?;
        let mut last;
        loop {
            {
                let mut processes = self.lock_processes();
                for p in processes.iter_mut() {
                    if let Some(status) = p.exited() {
                        bail!("{} exited ({status})\n{}", p.name, p.tail());
                    }
                }
            }
            let req = http::Request::get("/readyz").body(Vec::new())?;
            match client.request_text(req).await {
                Ok(body) if body.trim() == "ok" => return Ok(()),
                Ok(body) => last = body,
                Err(e) => last = e.to_string(),
            }
            if Instant::now() > deadline {
                let tails: Vec<String> = self.lock_processes().iter().map(Proc::tail).collect();
                bail!(
                    "kube-apiserver not ready within {READY_TIMEOUT:?}: {last}\n{}",
                    tails.join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Stop the API server (SIGTERM, then SIGKILL): clients see connection errors until
    /// [`Self::start_apiserver`]. etcd keeps the cluster's state.
    pub fn stop_apiserver(&self) {
        let mut processes = self.lock_processes();
        if let Some(p) = processes.iter_mut().find(|p| p.name == "kube-apiserver") {
            p.terminate(Duration::from_secs(10));
        }
        processes.retain(|p| p.name != "kube-apiserver");
    }

    /// Start the API server again, on the same address with the same settings, and wait for
    /// `/readyz`.
    pub async fn start_apiserver(&self) -> anyhow::Result<()> {
        let mut api = Command::new(&self.bins.kube_apiserver);
        api.args(&self.apiserver_args);
        let n = self.lock_processes().len();
        let proc = Proc::spawn(
            "kube-apiserver",
            api,
            self.reaper.group(),
            &self.log_dir().join(format!("kube-apiserver.{n}.log")),
        )?;
        self.lock_processes().push(proc);
        self.wait_ready().await
    }

    /// An admin client on the calling task's runtime.
    pub async fn admin_client(&self) -> anyhow::Result<Client> {
        client_from(&self.admin_kubeconfig).await
    }

    /// The reaper's process group, for the processes other parts of the harness start.
    pub fn group(&self) -> i32 {
        self.reaper.group()
    }

    /// Where logs go.
    pub fn log_dir(&self) -> PathBuf {
        self.dir.join("logs")
    }

    /// `kubectl` (the control plane's version) as admin.
    pub fn kubectl(&self) -> Command {
        let mut c = Command::new(&self.bins.kubectl);
        c.env("KUBECONFIG", &self.admin_kubeconfig);
        c
    }

    /// `helm` as admin, with its caches inside the state folder.
    pub fn helm(&self) -> Command {
        let mut c = Command::new(&self.bins.helm);
        c.env("KUBECONFIG", &self.admin_kubeconfig)
            .env("HELM_CACHE_HOME", self.dir.join("helm/cache"))
            .env("HELM_CONFIG_HOME", self.dir.join("helm/config"))
            .env("HELM_DATA_HOME", self.dir.join("helm/data"));
        c
    }

    /// Whether the state folder is removed at the end.
    pub fn keeps_state(&self) -> bool {
        self.tempdir.is_none()
    }
}
