//! Command line of the `kvroute-picker` binary.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use tokio_util::sync::CancellationToken;

use crate::service::settings::PickerConfig;
use crate::service::source::FileSource;
use crate::service::{http::shutdown_signal, start};

/// kvroute's KV-cache-aware endpoint picker: an OpenAI-compatible proxy, a pick API and a
/// Gateway API Inference Extension endpoint picker (Envoy ext_proc).
#[derive(Debug, Parser)]
#[command(name = "kvroute-picker", version)]
pub struct Args {
    /// Picker config file (YAML). Endpoints, routing weights and model configs reload live
    /// when it changes.
    #[arg(long, env = "KVROUTE_CONFIG")]
    pub config: PathBuf,
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
    /// Print the bound addresses as one JSON line on stdout once listening (for harnesses
    /// that start the picker on port 0).
    #[arg(long)]
    pub print_addresses: bool,
    /// Log as JSON lines.
    #[arg(long)]
    pub log_json: bool,
}

fn init_logging(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// Parse arguments, run until SIGTERM/Ctrl-C, drain, exit.
pub async fn run(args: Args) -> anyhow::Result<()> {
    init_logging(args.log_json);
    let mut config = PickerConfig::load(&args.config).map_err(anyhow::Error::msg)?;
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
    let cancel = CancellationToken::new();
    let source = Box::new(FileSource::new(
        args.config.clone(),
        Duration::from_millis(500),
    ));
    let running = start(config, source, cancel.clone())
        .await
        .map_err(anyhow::Error::msg)?;
    tracing::info!(addrs = ?running.addrs, "kvroute-picker listening");
    if args.print_addresses {
        println!("{}", serde_json::to_string(&running.addrs)?);
    }
    shutdown_signal().await;
    tracing::info!("shutting down: draining in-flight requests");
    running.shutdown().await;
    Ok(())
}
