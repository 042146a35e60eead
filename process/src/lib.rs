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
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    if json {
        builder.json().try_init().is_ok()
    } else {
        builder.try_init().is_ok()
    }
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
