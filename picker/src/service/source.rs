//! Endpoint sources: where the pool's model configs, routing and endpoints come from.
//!
//! A source publishes whole [`DeclaredPool`]s on a watch channel; the service applies each one.
//! The config file source and the Kubernetes source (the pool resource plus the operator's
//! EndpointSlices) implement the same trait, so the rest of the picker does not know which
//! one runs.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::declared::{DeclaredEndpoint, DeclaredPool, KvPorts};
use super::settings::PickerConfig;
use crate::endpoint::EndpointId;
use crate::error::PickerError;

pub trait EndpointSource: Send + 'static {
    fn name(&self) -> &'static str;

    /// Publish pool views until cancelled. A view that fails to load is logged and skipped:
    /// the last good one stays in force.
    fn run(
        self: Box<Self>,
        tx: watch::Sender<Option<DeclaredPool>>,
        cancel: CancellationToken,
    ) -> BoxFuture<'static, ()>;
}

/// The pool as a config file describes it (standalone mode).
pub fn view_from_config(c: &PickerConfig) -> DeclaredPool {
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
            let mut labels = e.labels.clone();
            if let Some(role) = e.role {
                labels.insert(
                    crate::endpoint::ROLE_LABELS[0].to_owned(),
                    role.as_str().to_owned(),
                );
            }
            endpoints.push(DeclaredEndpoint {
                id,
                model_config: spec.name.clone(),
                labels,
                serving: true,
                kv_ports,
            });
        }
    }
    DeclaredPool {
        model_configs: c.model_configs.clone(),
        routing: c.routing.clone(),
        tenancy: c.tenancy.clone(),
        endpoints,
    }
}

/// Static endpoints must not overlap: the same address and port listed twice (with
/// conflicting labels or model configs, the first would win in routing and the last in the
/// labels). The error names both entries.
pub fn check_static_endpoints_unique(c: &PickerConfig) -> Result<(), PickerError> {
    let mut owners: BTreeMap<SocketAddr, usize> = BTreeMap::new();
    for (i, e) in c.endpoints.iter().enumerate() {
        let Some(spec) = c.model_configs.iter().find(|m| m.name == e.model_config) else {
            continue;
        };
        let mut spec = spec.clone();
        if let Some(p) = e.port {
            spec.port = p;
        }
        for (port, _) in spec.rank_ports() {
            let socket = SocketAddr::new(e.address, port);
            match owners.get(&socket) {
                Some(&first) if first != i => {
                    return Err(PickerError::Invalid(format!(
                        "endpoints[{i}] and endpoints[{first}] both serve {socket}: list each \
                         address and port once"
                    )));
                }
                Some(_) => {}
                None => {
                    owners.insert(socket, i);
                }
            }
        }
    }
    Ok(())
}

/// A pool view must list each endpoint once, and one address and port under one model config
/// only; the error names the conflicting entries. (The Kubernetes source merges the listings
/// of one pod under one model config, so a duplicate here is always a conflict.)
pub fn check_view_endpoints_unique(endpoints: &[DeclaredEndpoint]) -> Result<(), PickerError> {
    let mut by_id: BTreeMap<EndpointId, &DeclaredEndpoint> = BTreeMap::new();
    let mut by_socket: BTreeMap<SocketAddr, &DeclaredEndpoint> = BTreeMap::new();
    let describe =
        |v: &DeclaredEndpoint| format!("model config {:?}, labels {:?}", v.model_config, v.labels);
    for v in endpoints {
        if let Some(first) = by_id.insert(v.id, v) {
            return Err(PickerError::Invalid(format!(
                "endpoint {} is listed twice ({}; and {})",
                v.id,
                describe(first),
                describe(v)
            )));
        }
        let socket = SocketAddr::new(v.id.address, v.id.port);
        match by_socket.get(&socket) {
            Some(first) if first.model_config != v.model_config => {
                return Err(PickerError::Invalid(format!(
                    "endpoints {} and {} share {socket} under different model configs ({}; and {})",
                    first.id,
                    v.id,
                    describe(first),
                    describe(v)
                )));
            }
            Some(_) => {}
            None => {
                by_socket.insert(socket, v);
            }
        }
    }
    Ok(())
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
        tx: watch::Sender<Option<DeclaredPool>>,
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
pub struct StaticSource(pub DeclaredPool);

impl EndpointSource for StaticSource {
    fn name(&self) -> &'static str {
        "static"
    }

    fn run(
        self: Box<Self>,
        tx: watch::Sender<Option<DeclaredPool>>,
        cancel: CancellationToken,
    ) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            let _ = tx.send(Some(self.0));
            cancel.cancelled().await;
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::settings::{IndexSettings, Limits};
    use crate::service::state::PickerState;

    const TWO: &str = r#"
modelConfigs:
  - {name: a, model: m, port: 8000}
  - {name: b, model: m, port: 9000}
endpoints:
  - {address: 127.0.0.2, modelConfig: a, labels: {tenant: acme}}
  - {address: 127.0.0.3, modelConfig: a}
"#;

    #[test]
    fn a_static_address_listed_twice_is_refused_naming_both_entries() {
        assert!(PickerConfig::from_yaml(TWO).is_ok());
        for dup in [
            // same address and port, conflicting labels
            "  - {address: 127.0.0.2, modelConfig: a, labels: {tenant: globex}}",
            // the port spelled out
            "  - {address: 127.0.0.2, modelConfig: a, port: 8000}",
            // another model config on the same port
            "  - {address: 127.0.0.2, modelConfig: b, port: 8000}",
        ] {
            let e = PickerConfig::from_yaml(&format!("{TWO}{dup}\n")).expect_err(dup);
            assert!(
                e.to_string().contains("endpoints[2]")
                    && e.to_string().contains("endpoints[0]")
                    && e.to_string().contains("127.0.0.2:8000"),
                "{dup}: {e}"
            );
        }
        // one address on two ports is two endpoints
        let ok = format!("{TWO}  - {{address: 127.0.0.2, modelConfig: b}}\n");
        assert!(PickerConfig::from_yaml(&ok).is_ok());
    }

    #[test]
    fn a_pool_view_with_a_duplicate_is_rejected_and_the_previous_one_stays() {
        let picker = PickerState::new(Limits::default(), IndexSettings::default()).expect("picker");
        let config = PickerConfig::from_yaml(TWO).expect("valid");
        let good = view_from_config(&config);
        picker.apply_pool(&good).expect("applied");
        let before = picker.pool.state().endpoints();
        // what a Kubernetes source yields when two model configs' slices list one pod
        let mut bad = good.clone();
        let mut twin = bad.endpoints[0].clone();
        twin.model_config = "b".into();
        twin.labels.insert("tenant".into(), "globex".into());
        bad.endpoints.push(twin);
        let e = picker.apply_pool(&bad).expect_err("duplicate");
        assert!(
            e.to_string().contains("127.0.0.2:8000#0")
                && e.to_string().contains("\"a\"")
                && e.to_string().contains("\"b\"")
                && e.to_string().contains("globex"),
            "{e}"
        );
        // the same id listed twice under one model config, labels differing
        let mut bad = good.clone();
        let mut twin = bad.endpoints[1].clone();
        twin.labels.insert("tenant".into(), "globex".into());
        bad.endpoints.push(twin);
        let e = picker.apply_pool(&bad).expect_err("duplicate");
        assert!(
            e.to_string().contains("127.0.0.3:8000#0") && e.to_string().contains("listed twice"),
            "{e}"
        );
        assert_eq!(
            picker.pool.state().endpoints().endpoints(),
            before.endpoints()
        );
        assert_eq!(
            picker
                .labels_of(&before.endpoints()[0].id)
                .get("tenant")
                .map(String::as_str),
            Some("acme")
        );
    }
}
