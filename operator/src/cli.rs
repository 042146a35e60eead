//! Command line of the `kvroute-operator` binary and the process around the controller:
//! health and metrics listener, leader election, shutdown.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use clap::Parser;
use kube::Client;
use kube_lease_manager::LeaseManagerBuilder;
use tokio_util::sync::CancellationToken;

use crate::desired::{BuildSettings, PeerKeySeed};
use crate::error::Error;
use crate::metrics::Metrics;
use crate::reconcile::Context;
use crate::server::{Health, app};

/// kvroute's operator: reconciles InferencePools into EndpointSlices (pods × data-parallel
/// ranks) and runs a picker per pool.
#[derive(Debug, Clone, Parser)]
#[command(name = "kvroute-operator", version)]
pub struct Args {
    /// Picker image for pools that name none.
    #[arg(long, env = "KVROUTE_PICKER_IMAGE", default_value_t = BuildSettings::default().picker_image)]
    pub picker_image: String,
    /// CPU and memory of the picker container for pools that set none
    /// (`spec.picker.resources`), as the JSON of a container's `resources`
    /// (`{"requests":{"cpu":"1","memory":"1Gi"}}`). The chart sets it from its sizing rule
    /// (docs/helm.md, "Sizing the pickers"). Default: none.
    #[arg(long, env = "KVROUTE_PICKER_RESOURCES", value_parser = parse_resources)]
    pub picker_resources: Option<k8s_openapi::api::core::v1::ResourceRequirements>,
    /// Watch only this namespace (default: all namespaces).
    #[arg(long, env = "KVROUTE_WATCH_NAMESPACE")]
    pub watch_namespace: Option<String>,
    /// `/metrics`, `/healthz`, `/readyz` listen address.
    #[arg(long, env = "KVROUTE_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    pub metrics_addr: SocketAddr,
    /// Print the bound metrics address as one JSON line on stdout (for harnesses using port 0).
    #[arg(long)]
    pub print_addresses: bool,
    /// Skip leader election (a single replica, or local development).
    #[arg(long)]
    pub no_leader_election: bool,
    /// Name of the coordination.k8s.io Lease replicas compete for.
    #[arg(long, default_value = "kvroute-operator")]
    pub lease_name: String,
    /// Namespace of the Lease (the operator's own).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub lease_namespace: String,
    /// This replica's identity in the Lease (default: the pod name, else the host name).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Seconds a lease stays valid without renewal.
    #[arg(long, default_value_t = 15)]
    pub lease_duration: u64,
    /// Seconds before expiry at which the holder renews.
    #[arg(long, default_value_t = 5)]
    pub lease_grace: u64,
    /// Log as JSON lines.
    #[arg(long)]
    pub log_json: bool,
    /// A file holding the operator's secret (at least 16 bytes) from which each pool's peer
    /// key is derived: the pickers of a pool then authenticate their in-flight exchange. The
    /// chart generates one and keeps it across upgrades. Absent: pickers exchange without a key.
    #[arg(long, env = "KVROUTE_PEER_KEY_SEED_FILE")]
    pub peer_key_seed_file: Option<std::path::PathBuf>,
    /// What `peer_key_seed_file` holds, read once at start.
    #[arg(skip)]
    pub peer_key_seed: Option<PeerKeySeed>,
}

/// `--picker-resources`: a container's `resources` as JSON.
fn parse_resources(s: &str) -> Result<k8s_openapi::api::core::v1::ResourceRequirements, String> {
    serde_json::from_str(s).map_err(|e| {
        format!("not a container's resources (`{{\"requests\":{{\"cpu\":\"1\"}}}}`): {e}")
    })
}

/// The seed named by `--peer-key-seed-file`, read and checked.
fn peer_key_seed(args: &Args) -> anyhow::Result<Option<PeerKeySeed>> {
    let Some(p) = &args.peer_key_seed_file else {
        tracing::warn!("no --peer-key-seed-file: pickers exchange in-flight counts without a key");
        return Ok(None);
    };
    let bytes = std::fs::read(p)
        .map_err(|e| anyhow::anyhow!("--peer-key-seed-file {}: {e}", p.display()))?;
    PeerKeySeed::new(&bytes)
        .map(Some)
        .map_err(|e| anyhow::anyhow!("--peer-key-seed-file {}: {e}", p.display()))
}

fn identity(args: &Args) -> String {
    args.identity
        .clone()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| format!("kvroute-operator-{}", std::process::id()))
}

/// Run the operator until SIGTERM/Ctrl-C (or lost leadership, which is an error: the process
/// exits and its restart competes again).
pub async fn run(mut args: Args) -> anyhow::Result<()> {
    kvroute_process::init_logging(args.log_json, "info");
    args.peer_key_seed = peer_key_seed(&args)?;
    let client = Client::try_default().await.map_err(Error::Client)?;
    let metrics = Arc::new(Metrics::default());
    let ready = Arc::new(AtomicBool::new(false));
    let cancel = CancellationToken::new();

    let listener = tokio::net::TcpListener::bind(args.metrics_addr)
        .await
        .map_err(Error::Http)?;
    let bound = listener.local_addr().map_err(Error::Http)?;
    if args.print_addresses {
        println!("{}", serde_json::json!({ "metrics": bound }));
    }
    tracing::info!(%bound, "serving /metrics, /healthz, /readyz");
    let health = app(Health {
        metrics: metrics.clone(),
        ready: ready.clone(),
    });
    let http_cancel = cancel.clone();
    let http = tokio::spawn(async move {
        axum::serve(listener, health)
            .with_graceful_shutdown(async move { http_cancel.cancelled().await })
            .await
    });
    {
        let cancel = cancel.clone();
        tokio::spawn(async move {
            kvroute_process::shutdown_signal().await;
            tracing::info!("shutting down");
            cancel.cancel();
        });
    }

    let id = identity(&args);
    let result = if args.no_leader_election {
        metrics.set_leader(true);
        run_controller(
            &args,
            client,
            metrics.clone(),
            ready.clone(),
            id,
            cancel.clone(),
        )
        .await;
        Ok(())
    } else {
        lead(
            &args,
            client,
            metrics.clone(),
            ready.clone(),
            id,
            cancel.clone(),
        )
        .await
    };
    cancel.cancel();
    let _ = http.await;
    result.map_err(anyhow::Error::from)
}

async fn run_controller(
    args: &Args,
    client: Client,
    metrics: Arc<Metrics>,
    ready: Arc<AtomicBool>,
    id: String,
    cancel: CancellationToken,
) {
    ready.store(false, Ordering::Relaxed);
    let settings = BuildSettings {
        picker_image: args.picker_image.clone(),
        peer_key_seed: args.peer_key_seed.clone(),
        picker_resources: args.picker_resources.clone(),
    };
    let ctx_client = client.clone();
    crate::controller::run(
        client,
        args.watch_namespace.clone(),
        move |stores| Context::new(ctx_client, stores, settings, metrics, id),
        move || {
            tracing::info!("caches synced");
            ready.store(true, Ordering::Relaxed);
        },
        async move { cancel.cancelled().await },
    )
    .await;
}

/// Wait for the lease, run the controller while holding it, release it on shutdown.
async fn lead(
    args: &Args,
    client: Client,
    metrics: Arc<Metrics>,
    ready: Arc<AtomicBool>,
    id: String,
    cancel: CancellationToken,
) -> Result<(), Error> {
    let manager = LeaseManagerBuilder::new(client.clone(), &args.lease_name)
        .with_namespace(&args.lease_namespace)
        .with_identity(&id)
        .with_duration(args.lease_duration)
        .with_grace(args.lease_grace)
        .with_field_manager(format!("{}-lease", kvroute_crds::contract::FIELD_MANAGER))
        .build()
        .await
        .map_err(Error::Lease)?;
    let (mut leader, lease_task) = manager.watch().await;
    // a standby is ready: it takes over when the leader goes
    ready.store(true, Ordering::Relaxed);
    tracing::info!(identity = %id, lease = %args.lease_name, "waiting for leadership");
    loop {
        if *leader.borrow_and_update() {
            break;
        }
        tokio::select! {
            () = cancel.cancelled() => {
                drop(leader);
                let _ = lease_task.await;
                return Ok(());
            }
            changed = leader.changed() => if changed.is_err() {
                return Err(Error::LostLeadership);
            }
        }
    }
    tracing::info!(identity = %id, "became leader");
    metrics.set_leader(true);
    let controller_cancel = cancel.child_token();
    let lost = async {
        loop {
            if leader.changed().await.is_err() || !*leader.borrow_and_update() {
                return;
            }
        }
    };
    let outcome = tokio::select! {
        () = run_controller(args, client, metrics.clone(), ready, id, controller_cancel.clone()) => Ok(()),
        () = lost => {
            controller_cancel.cancel();
            Err(Error::LostLeadership)
        }
    };
    metrics.set_leader(false);
    drop(leader);
    // the lease task ends when the channel closes; release so a standby need not wait out
    // the lease duration
    if let Ok(Ok(manager)) = lease_task.await
        && let Err(e) = manager.release().await
    {
        tracing::warn!(error = %e, "cannot release the lease");
    }
    outcome
}
