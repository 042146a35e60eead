//! Endpoint sources: where the pool's model configs, routing and endpoints come from.
//!
//! A source publishes whole [`PoolView`]s on a watch channel; the service applies each one.
//! The config file source and the Kubernetes source (the pool resource plus the operator's
//! EndpointSlices) implement the same trait, so the rest of the picker does not know which
//! one runs.

use std::path::PathBuf;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::core::{EndpointView, KvPorts, PoolView};
use super::settings::PickerConfig;

pub trait EndpointSource: Send + 'static {
    fn name(&self) -> &'static str;

    /// Publish pool views until cancelled. A view that fails to load is logged and skipped:
    /// the last good one stays in force.
    fn run(
        self: Box<Self>,
        tx: watch::Sender<Option<PoolView>>,
        cancel: CancellationToken,
    ) -> BoxFuture<'static, ()>;
}

/// The pool as a config file describes it (standalone mode).
pub fn view_from_config(c: &PickerConfig) -> PoolView {
    let mut endpoints = Vec::new();
    for e in &c.endpoints {
        let Some(spec) = c.model_configs.iter().find(|m| m.name == e.model_config) else {
            continue;
        };
        let mut spec = spec.clone();
        if let Some(p) = e.port {
            spec.port = p;
        }
        for id in crate::endpoint::rank_endpoints(&spec, e.address) {
            let rank = id.rank as u16;
            let kv_ports = e.kv_events_port.map(|p| KvPorts {
                events: p.saturating_add(rank),
                replay: e
                    .kv_replay_port
                    .or(spec.kv_events.as_ref().and_then(|k| k.replay_port))
                    .map(|r| r.saturating_add(rank)),
            });
            endpoints.push(EndpointView {
                id,
                model_config: spec.name.clone(),
                labels: e.labels.clone(),
                serving: true,
                kv_ports,
            });
        }
    }
    PoolView {
        model_configs: c.model_configs.clone(),
        routing: c.routing.clone(),
        tenancy: c.tenancy.clone(),
        endpoints,
    }
}

/// Watches a YAML config file and republishes it when its contents change.
#[derive(Debug)]
pub struct FileSource {
    path: PathBuf,
    poll: Duration,
}

impl FileSource {
    pub fn new(path: PathBuf, poll: Duration) -> Self {
        Self { path, poll }
    }
}

impl EndpointSource for FileSource {
    fn name(&self) -> &'static str {
        "file"
    }

    fn run(
        self: Box<Self>,
        tx: watch::Sender<Option<PoolView>>,
        cancel: CancellationToken,
    ) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            let mut last: Option<Vec<u8>> = None;
            // the settings the process started with: changes to the sections it reads only at
            // start are reported, not silently ignored
            let mut started: Option<PickerConfig> = None;
            loop {
                match tokio::fs::read(&self.path).await {
                    Ok(bytes) if last.as_deref() != Some(bytes.as_slice()) => {
                        let text = String::from_utf8_lossy(&bytes).into_owned();
                        match PickerConfig::from_yaml(&text) {
                            Ok(c) => {
                                let pending = started
                                    .as_ref()
                                    .map(|s| s.restart_only_changes(&c))
                                    .unwrap_or_default();
                                if pending.is_empty() {
                                    tracing::info!(path = %self.path.display(), "config loaded");
                                } else {
                                    tracing::warn!(
                                        path = %self.path.display(),
                                        sections = ?pending,
                                        "config loaded: modelConfigs, endpoints, routing and tenancy applied; the changes to these sections take effect only after a restart"
                                    );
                                }
                                let _ = tx.send(Some(view_from_config(&c)));
                                started.get_or_insert(c);
                            }
                            Err(e) => {
                                tracing::error!(path = %self.path.display(), error = %e, "config rejected; keeping the previous one");
                            }
                        }
                        last = Some(bytes);
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(path = %self.path.display(), error = %e, "cannot read config");
                    }
                }
                tokio::select! {
                    () = cancel.cancelled() => return,
                    () = tokio::time::sleep(self.poll) => {}
                }
            }
        })
    }
}

/// A fixed pool view (embedding, tests).
#[derive(Debug)]
pub struct StaticSource(pub PoolView);

impl EndpointSource for StaticSource {
    fn name(&self) -> &'static str {
        "static"
    }

    fn run(
        self: Box<Self>,
        tx: watch::Sender<Option<PoolView>>,
        cancel: CancellationToken,
    ) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            let _ = tx.send(Some(self.0));
            cancel.cancelled().await;
        })
    }
}
