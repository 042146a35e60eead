//! What every kvroute binary (the operator, the picker, the bench) does at start and stop.
//!
//! - [`init_logging`]: `tracing` to stderr, filtered by `RUST_LOG` (else a default level), as
//!   text or as JSON lines;
//! - [`shutdown_signal`]: a future that resolves on SIGTERM (the kubelet's stop) or SIGINT
//!   (Ctrl-C).

use std::future::Future;

/// Install the global `tracing` subscriber: stderr, `RUST_LOG` or else `default_filter`
/// (`"info"`, `"warn"`...), JSON lines when `json`, colours only when stderr is a terminal
/// (a pod's log is not). Returns `false` when a subscriber was
/// already installed (a test harness, a second call), which is then kept.
pub fn init_logging(json: bool, default_filter: &str) -> bool {
    init_logging_with(json, default_filter, None)
}

/// A layer beside the log's (the picker's OpenTelemetry exporter).
pub type ExtraLayer =
    Box<dyn tracing_subscriber::Layer<tracing_subscriber::Registry> + Send + Sync>;

/// [`init_logging`] with `extra` beside the log. The log never shows the spans of the
/// `kvroute::trace` target: they are for the OpenTelemetry layer alone, and with no layer
/// enabling them they are never created.
pub fn init_logging_with(json: bool, default_filter: &str, extra: Option<ExtraLayer>) -> bool {
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    if let Ok(off) = "kvroute::trace=off".parse() {
        filter = filter.add_directive(off);
    }
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let log: ExtraLayer = if json {
        fmt.json().with_filter(filter).boxed()
    } else {
        fmt.with_filter(filter).boxed()
    };
    let layers: Vec<ExtraLayer> = std::iter::once(log).chain(extra).collect();
    tracing_subscriber::registry()
        .with(layers)
        .try_init()
        .is_ok()
}

/// A future that resolves when the process is asked to stop: SIGTERM or SIGINT.
///
/// The handlers are installed when this is called, not when the future is first polled, so
/// a signal that arrives in between is not lost. Must be called inside a Tokio runtime. If
/// no handler can be installed the failure is logged and the future never resolves (the
/// process then stops only by being killed), rather than shutting down at once.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let term = signal(SignalKind::terminate());
        let interrupt = signal(SignalKind::interrupt());
        async move {
            match (term, interrupt) {
                (Ok(mut t), Ok(mut i)) => {
                    tokio::select! {
                        _ = t.recv() => {},
                        _ = i.recv() => {},
                    }
                }
                (Ok(mut t), Err(e)) => {
                    tracing::warn!(error = %e, "cannot handle SIGINT; SIGTERM still stops");
                    t.recv().await;
                }
                (Err(e), Ok(mut i)) => {
                    tracing::warn!(error = %e, "cannot handle SIGTERM; SIGINT still stops");
                    i.recv().await;
                }
                (Err(e), Err(_)) => {
                    tracing::error!(error = %e, "cannot handle SIGTERM or SIGINT");
                    std::future::pending::<()>().await;
                }
            }
        }
    }
    #[cfg(not(unix))]
    {
        async {
            if let Err(e) = tokio::signal::ctrl_c().await {
                tracing::error!(error = %e, "cannot handle Ctrl-C");
                std::future::pending::<()>().await;
            }
        }
    }
}
