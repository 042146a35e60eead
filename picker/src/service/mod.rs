//! The picker service: listeners, feeds and the endpoint source around the routing core.

pub mod calibration;
pub mod declared;
pub mod diagnostics;
pub mod disagg;
pub mod errors;
pub mod ext_proc;
pub mod feeds;
pub mod flow;
pub mod gateway;
pub mod http;
pub mod kube_source;
pub mod listener;
pub mod metrics;
pub mod model_rewrite;
pub mod models;
pub mod passive_health;
pub use kvroute_routing::request;
pub mod responses;
pub mod settings;
pub mod source;
pub mod state;
pub mod telemetry;
pub mod tenancy;
pub mod warm_start;

use std::net::SocketAddr;
use std::sync::Arc;

use serde::Serialize;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use self::declared::DeclaredPool;
use self::http::{AppState, admin_app, inference_app, metrics_app};
use self::settings::PickerConfig;
use self::source::EndpointSource;
use self::state::PickerState;
use crate::error::PickerError;

/// How often the tenancy salt secret file is re-read: a rotated Kubernetes Secret reaches
/// the mounted file within about a minute, and salts follow within this.
pub const SECRET_RELOAD_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);

/// How long [`start`] waits for the endpoint source's first view to be applied.
pub const FIRST_VIEW_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Addresses the listeners actually bound (port 0 resolved).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BoundAddrs {
    pub http: SocketAddr,
    pub admin: SocketAddr,
    pub metrics: SocketAddr,
    pub ext_proc: Option<SocketAddr>,
    /// The UDP address of the peer exchange (`peers.listen`).
    pub peers: Option<SocketAddr>,
}

/// A running picker.
#[derive(Debug)]
pub struct Running {
    pub addrs: BoundAddrs,
    pub state: Arc<PickerState>,
    pub cancel: CancellationToken,
    tasks: JoinSet<()>,
}

impl Running {
    /// Wait until every task has stopped (after `cancel`).
    pub async fn wait(mut self) {
        while self.tasks.join_next().await.is_some() {}
    }

    /// Stop accepting, drain in-flight streams (up to the deadline), stop the feeds.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        let _ = tokio::time::timeout(http::DRAIN_DEADLINE, self.wait()).await;
    }
}

/// Connections the admin and the metrics listener each keep open at most: they serve
/// operators and scrapers, not clients.
pub const SIDE_LISTENER_CONNECTIONS: usize = 256;

/// File descriptors kept back from the listeners' connection caps for engine connections, KV
/// event sockets, files and the like, beyond one per request in flight.
const FD_RESERVE: u64 = 512;

/// Connection caps of the inference and ext_proc listeners that fit in the process's file
/// descriptor limit (raised to its hard limit first): each gets at most half of what is left
/// after the reserve, the side listeners and the requests in flight (each holds an engine
/// connection). Too small a limit is logged, never a crash on `EMFILE` later.
fn connection_caps(config: &PickerConfig) -> usize {
    let nofile = match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(n) => n,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the open-file limit; assuming 1024");
            1024
        }
    };
    let side = 2 * SIDE_LISTENER_CONNECTIONS as u64;
    let inflight = config.limits.max_inflight_total as u64;
    let room = nofile.saturating_sub(FD_RESERVE + side + inflight.min(nofile / 2)) / 2;
    let cap = usize::try_from(room).unwrap_or(usize::MAX).max(16);
    let configured = config.limits.max_connections;
    if cap < configured {
        tracing::warn!(
            open_file_limit = nofile,
            configured,
            effective = cap,
            "limits.maxConnections does not fit in the open-file limit: each of the proxy and ext_proc listeners keeps at most the effective number of connections (raise the limit, e.g. `ulimit -n`, or lower maxConnections)"
        );
    }
    configured.min(cap)
}

/// The ext_proc listener's TLS: its identity and, with a client CA, required client
/// certificates; handshakes bounded like request heads.
fn ext_proc_tls(
    tls: &settings::TlsFiles,
    handshake_timeout: std::time::Duration,
) -> Result<tonic::transport::ServerTlsConfig, PickerError> {
    let read = |field: &str, p: &str| {
        std::fs::read(p)
            .map_err(|e| PickerError::read_file(format!("listen.extProcTls.{field}"), p, e))
    };
    let identity = tonic::transport::Identity::from_pem(
        read("certFile", &tls.cert_file)?,
        read("keyFile", &tls.key_file)?,
    );
    let mut config = tonic::transport::ServerTlsConfig::new()
        .identity(identity)
        .timeout(handshake_timeout);
    if let Some(ca) = &tls.client_ca_file {
        config = config.client_ca_root(tonic::transport::Certificate::from_pem(read(
            "clientCaFile",
            ca,
        )?));
    }
    Ok(config)
}

/// Start the picker: bind listeners, apply the first pool view, start the feeds.
pub async fn start(
    config: PickerConfig,
    source: Box<dyn EndpointSource>,
    cancel: CancellationToken,
) -> Result<Running, PickerError> {
    let admin_token = match &config.listen.admin_token_file {
        Some(p) => Some(Arc::<str>::from(
            std::fs::read_to_string(p)
                .map_err(|e| PickerError::read_file("listen.adminTokenFile", p, e))?
                .trim(),
        )),
        None => None,
    };
    let picker = Arc::new(PickerState::new(
        config.limits.clone(),
        config.index.clone(),
    )?);
    let bind = |addr: SocketAddr| async move {
        let listen = |source| PickerError::Listen { addr, source };
        let l = TcpListener::bind(addr).await.map_err(listen)?;
        let bound = l.local_addr().map_err(listen)?;
        Ok::<_, PickerError>((l, bound))
    };
    let (http_l, http_addr) = bind(config.listen.http).await?;
    let (admin_l, admin_addr) = bind(config.listen.admin).await?;
    let (metrics_l, metrics_addr) = bind(config.listen.metrics).await?;
    let (ext_l, ext_addr) = match config.listen.ext_proc {
        Some(a) => {
            let (l, bound) = bind(a).await?;
            (Some(l), Some(bound))
        }
        None => (None, None),
    };
    let peer_key = feeds::peers::PeerKey::load(&config.peers)?;
    let peer_socket = match config.peers.listen {
        Some(addr) => {
            let listen = |source| PickerError::Listen { addr, source };
            let s = tokio::net::UdpSocket::bind(addr).await.map_err(listen)?;
            let bound = s.local_addr().map_err(listen)?;
            Some((s, bound))
        }
        None => None,
    };
    let addrs = BoundAddrs {
        http: http_addr,
        admin: admin_addr,
        metrics: metrics_addr,
        ext_proc: ext_addr,
        peers: peer_socket.as_ref().map(|(_, a)| *a),
    };
    let state = AppState {
        picker: picker.clone(),
        admin_token,
    };
    let mut tasks = JoinSet::new();
    let conn_limits = listener::ConnLimits {
        max_connections: connection_caps(&config),
        max_header_bytes: config.limits.max_header_bytes,
        header_read_timeout: config.limits.header_read_timeout,
    };
    let side_limits = listener::ConnLimits {
        max_connections: SIDE_LISTENER_CONNECTIONS.min(conn_limits.max_connections),
        ..conn_limits
    };
    for (l, app, limits) in [
        (http_l, inference_app(state.clone()), conn_limits),
        (admin_l, admin_app(state.clone()), side_limits),
        (metrics_l, metrics_app(state), side_limits),
    ] {
        tasks.spawn(listener::serve_bounded(
            l,
            app,
            limits,
            Some(picker.clone()),
            cancel.clone(),
            http::DRAIN_DEADLINE,
        ));
    }
    if let Some(listener) = ext_l {
        let gateway_picker = Arc::new(gateway::GatewayPicker::new(picker.clone()));
        let limits = ext_proc::ExtProcLimits {
            max_body_bytes: config.limits.max_body_bytes,
            // streams still collecting a body are not admitted yet: room beyond the in-flight
            // bound, so that overload is the admission's 429 as on the proxy
            max_concurrent_streams: config.limits.max_inflight_total.saturating_mul(2),
            body_timeout: config.limits.body_read_timeout,
            // a gateway sends a stream's headers as it opens it: a silent stream is cut soon
            head_timeout: config
                .limits
                .header_read_timeout
                .min(ext_proc::ExtProcLimits::default().head_timeout),
            max_streams_per_connection: config.limits.ext_proc_streams_per_connection.min(
                u32::try_from(config.limits.max_inflight_total.saturating_mul(2))
                    .unwrap_or(u32::MAX),
            ),
            ..ext_proc::ExtProcLimits::default()
        };
        // two connections' worth of opening streams per peer address
        let limits = ext_proc::ExtProcLimits {
            max_opening_per_address: (limits.max_streams_per_connection as usize).saturating_mul(2),
            ..limits
        };
        let mut server = tonic::transport::Server::builder()
            .max_concurrent_streams(Some(limits.max_streams_per_connection));
        if let Some(tls) = &config.listen.ext_proc_tls {
            server = server
                .tls_config(ext_proc_tls(tls, config.limits.header_read_timeout)?)
                .map_err(|e| format!("listen.extProcTls: {e}"))?;
        }
        let (health, health_server) = ext_proc::health_service(false).await;
        let grpc_cancel = cancel.clone();
        let incoming =
            listener::bounded_incoming(listener, conn_limits, Some(picker.clone()), cancel.clone());
        tasks.spawn(async move {
            let r = server
                .add_service(health_server)
                .add_service(ext_proc::ext_proc_server(gateway_picker, limits))
                .serve_with_incoming_shutdown(incoming, grpc_cancel.cancelled())
                .await;
            if let Err(e) = r {
                tracing::error!(error = %e, "ext_proc listener failed");
            }
        });
        // readiness follows the picker's: endpoints known and metrics loaded
        let ready_picker = picker.clone();
        let ready_cancel = cancel.clone();
        tasks.spawn(async move {
            let mut pool_changes = ready_picker.watch_pool();
            let mut scraped = ready_picker.first_metrics.subscribe();
            let mut last = None;
            loop {
                let ready = ready_picker.is_ready();
                if last != Some(ready) {
                    health.set_ready(ready).await;
                    last = Some(ready);
                }
                // both senders live in the picker this task holds
                tokio::select! {
                    () = ready_cancel.cancelled() => return,
                    Ok(()) = pool_changes.changed() => {}
                    Ok(()) = scraped.changed() => {}
                }
            }
        });
    }

    // the endpoint source and the task applying its views
    let (tx, mut rx) = watch::channel::<Option<DeclaredPool>>(None);
    tracing::info!(source = source.name(), "starting endpoint source");
    tasks.spawn(source.run(tx, cancel.clone()));
    let applier_picker = picker.clone();
    let applier_cancel = cancel.clone();
    tasks.spawn(async move {
        loop {
            let view = rx.borrow_and_update().clone();
            if let Some(view) = view {
                match applier_picker.apply_pool(&view) {
                    Ok(change) => tracing::info!(
                        added = change.added.len(),
                        removed = change.removed.len(),
                        routing_changed = change.routing_changed,
                        endpoints = applier_picker.pool.state().endpoints().len(),
                        "pool applied"
                    ),
                    Err(e) => {
                        applier_picker.count_rejection(&e);
                        tracing::error!(error = %e, "pool view rejected; keeping the previous one")
                    }
                }
            }
            tokio::select! {
                () = applier_cancel.cancelled() => return,
                r = rx.changed() => if r.is_err() { return },
            }
        }
    });
    // Requests that arrive before the first view can only be refused (503 `not_ready`): wait
    // for it, up to a bound (a source that cannot load, such as an unreachable API server,
    // leaves the picker running and not ready, as `/readyz` reports).
    let mut loaded = picker.pool_loaded.subscribe();
    if tokio::time::timeout(FIRST_VIEW_WAIT, loaded.wait_for(|loaded| *loaded))
        .await
        .is_err()
    {
        tracing::warn!(
            waited = ?FIRST_VIEW_WAIT,
            "no pool view applied yet; serving, not ready, until one is"
        );
    }
    // where the engines publish (vLLM's /kv_event_sources), then a copy of the index from a
    // peer or the snapshot, before the subscriptions start
    if config.scrape.event_sources {
        feeds::sources::round(&picker).await;
        tasks.spawn(feeds::sources::run_discovery(
            picker.clone(),
            cancel.clone(),
        ));
    }
    let warm = warm_start::WarmStart {
        settings: config.warm_start.clone(),
        peers: config.peers.clone(),
        key: warm_start::key_bytes(&peer_key),
        metrics_port: metrics_addr.port(),
    };
    warm.load(&picker).await;
    tasks.spawn(warm.run_snapshots(picker.clone(), cancel.clone()));
    tasks.spawn(feeds::sources::run_discovery(
        picker.clone(),
        cancel.clone(),
    ));
    tasks.spawn(feeds::subscriptions::run_event_manager_thread(
        picker.clone(),
        cancel.clone(),
    ));
    // a rotated salt secret takes effect without a restart
    let reload_picker = picker.clone();
    let reload_cancel = cancel.clone();
    tasks.spawn(async move {
        loop {
            tokio::select! {
                () = reload_cancel.cancelled() => return,
                () = tokio::time::sleep(SECRET_RELOAD_INTERVAL) => {}
            }
            match reload_picker.reload_tenancy_secret() {
                Ok(true) => tracing::info!("tenancy salt secret rotated"),
                Ok(false) => {}
                Err(e) => {
                    reload_picker.count_rejection(&e);
                    tracing::warn!(error = %e, "cannot re-read the tenancy salt secret; keeping the current one");
                }
            }
        }
    });
    tasks.spawn(flow::run_gate(picker.clone(), cancel.clone()));
    if let Some((socket, _)) = peer_socket {
        tasks.spawn(feeds::peers::run_peers(
            picker.clone(),
            config.peers.clone(),
            peer_key,
            crate::inflight::PeerBound {
                requests: config.limits.max_inflight_per_endpoint,
                tokens_per_request: u64::try_from(config.limits.max_prompt_tokens)
                    .unwrap_or(u64::MAX),
            },
            socket,
            cancel.clone(),
        ));
    }
    tasks.spawn(feeds::scraper::run_scraper(
        picker.clone(),
        config.scrape.clone(),
        cancel.clone(),
    ));
    Ok(Running {
        addrs,
        state: picker,
        cancel,
        tasks,
    })
}
