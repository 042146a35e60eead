//! Command line of the `kvroute-picker` binary.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use tokio_util::sync::CancellationToken;

use crate::service::kube_source::{KubeSource, KubeSourceOptions};
use crate::service::settings::PickerConfig;
use crate::service::source::{EndpointSource, FileSource};
use crate::service::start;

/// kvroute's KV-cache-aware endpoint picker: an OpenAI-compatible proxy, a pick API and a
/// Gateway API Inference Extension endpoint picker (Envoy ext_proc).
#[derive(Debug, Parser)]
#[command(name = "kvroute-picker", version)]
pub struct Args {
    /// Picker config file (YAML). Endpoints, routing weights and model configs reload live
    /// when it changes. With `--pool`, only its listener, limits, scrape, index and peers
    /// settings are used (optional: defaults otherwise).
    #[arg(long, env = "KVROUTE_CONFIG", required_unless_present = "pool")]
    pub config: Option<PathBuf>,
    /// Cluster mode: serve this KVRoutePool. Model configs, routing and tenancy come live
    /// from the resource, endpoints from the EndpointSlices the operator writes for it.
    #[arg(long, env = "KVROUTE_POOL", requires = "namespace")]
    pub pool: Option<String>,
    /// Namespace of `--pool`.
    #[arg(long, env = "KVROUTE_NAMESPACE")]
    pub namespace: Option<String>,
    /// Cluster mode: where the operator mounts tokenizer ConfigMaps.
    #[arg(long, default_value = kvroute_crds::contract::TOKENIZER_MOUNT_ROOT)]
    pub tokenizer_dir: PathBuf,
    /// Cluster mode: where the operator mounts the tenant salt Secret.
    #[arg(long, default_value = kvroute_crds::contract::SALT_MOUNT_DIR)]
    pub salt_dir: PathBuf,
    /// Override the proxy listen address (e.g. 127.0.0.1:0).
    #[arg(long)]
    pub http: Option<std::net::SocketAddr>,
    /// Override the admin listen address.
    #[arg(long)]
    pub admin: Option<std::net::SocketAddr>,
    /// Override the metrics listen address.
    #[arg(long)]
    pub metrics: Option<std::net::SocketAddr>,
    /// Override the ext_proc listen address.
    #[arg(long)]
    pub ext_proc: Option<std::net::SocketAddr>,
    /// Override the peer exchange's UDP address (`peers.listen`), when the config has one.
    #[arg(long)]
    pub peers: Option<std::net::SocketAddr>,
    /// Override where the peer key is read (`peers.keyFile`), when the config names one.
    #[arg(long)]
    pub peer_key_file: Option<String>,
    /// Print the bound addresses as one JSON line on stdout once listening (for harnesses
    /// that start the picker on port 0).
    #[arg(long)]
    pub print_addresses: bool,
    /// Log as JSON lines.
    #[arg(long)]
    pub log_json: bool,
}

/// Parse arguments, run until SIGTERM/Ctrl-C, drain, exit.
pub async fn run(args: Args) -> anyhow::Result<()> {
    // OpenTelemetry when OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT is set (docs/picker.md)
    let (otel_layer, telemetry) = match crate::service::telemetry::from_env()? {
        Some((layer, telemetry)) => (Some(layer), Some(telemetry)),
        None => (None, None),
    };
    kvroute_process::init_logging_with(args.log_json, "info", otel_layer);
    let mut config = match (&args.config, &args.pool) {
        (Some(path), None) => PickerConfig::load(path).map_err(anyhow::Error::msg)?,
        // cluster mode: the pool resource supplies model configs, routing and tenancy, so
        // the file (the operator's ConfigMap) only matters for the other sections
        (Some(path), Some(_)) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
            serde_yaml_ng::from_str::<PickerConfig>(&text)
                .map_err(|e| anyhow::anyhow!("{}: invalid config: {e}", path.display()))?
        }
        // every section at its default
        (None, _) => serde_yaml_ng::from_str::<PickerConfig>("modelConfigs: []")?,
    };
    if let Some(a) = args.http {
        config.listen.http = a;
    }
    if let Some(a) = args.admin {
        config.listen.admin = a;
    }
    if let Some(a) = args.metrics {
        config.listen.metrics = a;
    }
    if args.ext_proc.is_some() {
        config.listen.ext_proc = args.ext_proc;
    }
    if args.peers.is_some() && config.peers.listen.is_some() {
        config.peers.listen = args.peers;
    }
    if args.peer_key_file.is_some() && config.peers.key_file.is_some() {
        config.peers.key_file.clone_from(&args.peer_key_file);
    }
    let cancel = CancellationToken::new();
    let source: Box<dyn EndpointSource> = match (&args.pool, &args.namespace, &args.config) {
        (Some(pool), Some(ns), _) => {
            let mut options = KubeSourceOptions::new(pool, ns);
            options.tokenizer_root = args.tokenizer_dir.clone();
            options.salt_dir = args.salt_dir.clone();
            Box::new(
                KubeSource::try_default(options)
                    .await
                    .map_err(anyhow::Error::msg)?,
            )
        }
        (_, _, Some(path)) => Box::new(FileSource::new(path.clone(), Duration::from_millis(500))),
        _ => anyhow::bail!("give --config FILE, or --pool NAME --namespace NS"),
    };
    let running = start(config, source, cancel.clone())
        .await
        .map_err(anyhow::Error::msg)?;
    tracing::info!(addrs = ?running.addrs, "kvroute-picker listening");
    if args.print_addresses {
        println!("{}", serde_json::to_string(&running.addrs)?);
    }
    kvroute_process::shutdown_signal().await;
    tracing::info!("shutting down: draining in-flight requests");
    running.shutdown().await;
    if let Some(t) = telemetry {
        t.shutdown();
    }
    Ok(())
}
