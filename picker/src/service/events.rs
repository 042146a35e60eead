//! The KV-event feed: one ZMQ subscription per publishing endpoint (rank), kept in step with
//! the endpoint set, each applying its batches to the index under short write locks. Routing
//! only ever takes the read lock, so ingestion never waits on a socket while holding it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::core::PickerCore;
use crate::block_keys::BlockHasher;
use crate::endpoint::EndpointId;
use crate::feeds::kv_subscriber::{SubscriberConfig, SubscriberEvent, spawn_subscriber};
use crate::ingest::{IngestKeys, apply_batch};

/// What a subscription is for; a change in any part means a new subscription.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct SubscriptionKey {
    endpoint: EndpointId,
    publisher: String,
    replay: Option<String>,
    topic: String,
    block_size: u32,
    model: String,
}

fn desired(core: &PickerCore) -> HashMap<EndpointId, SubscriptionKey> {
    let snap = core.endpoints.load();
    let catalog = core.catalog();
    let mut out = HashMap::new();
    for e in snap.endpoints() {
        let Some(entry) = catalog.get(&*e.model_config.name) else {
            continue;
        };
        let Some(ev) = &entry.spec.kv_events else {
            continue;
        };
        let host = match e.id.address {
            std::net::IpAddr::V4(a) => a.to_string(),
            std::net::IpAddr::V6(a) => format!("[{a}]"),
        };
        let rank = e.id.rank as u16;
        let (events_port, replay_port) = match core.kv_ports_of(&e.id) {
            Some(p) => (p.events, p.replay),
            None => (
                ev.port.saturating_add(rank),
                ev.replay_port.map(|p| p.saturating_add(rank)),
            ),
        };
        out.insert(
            e.id,
            SubscriptionKey {
                endpoint: e.id,
                publisher: format!("tcp://{host}:{events_port}"),
                replay: replay_port.map(|p| format!("tcp://{host}:{p}")),
                topic: ev.topic.clone(),
                block_size: entry.config.block_size,
                model: entry.config.model.to_string(),
            },
        );
    }
    out
}

/// Apply one subscriber's events until it ends.
async fn consume(
    core: Arc<PickerCore>,
    key: SubscriptionKey,
    mut rx: mpsc::Receiver<SubscriberEvent>,
) {
    let keys = IngestKeys {
        hasher: BlockHasher::new(key.block_size),
        model: &key.model,
    };
    while let Some(ev) = rx.recv().await {
        match ev {
            SubscriberEvent::Batch { batch, .. } => {
                let stats = {
                    let mut index = core.index.write();
                    let Some(slot) = index.slot(&key.endpoint) else {
                        continue;
                    };
                    apply_batch(&mut index, slot, keys, &batch)
                };
                core.metrics.event_batches.inc();
                if stats.orphan_blocks > 0 {
                    core.metrics.event_problem("orphan_blocks");
                }
                if stats.malformed_blocks > 0 {
                    core.metrics.event_problem("malformed_blocks");
                }
                if stats.overflowed {
                    core.metrics.event_problem("overflow");
                    tracing::warn!(endpoint = %key.endpoint, "endpoint exceeded its block budget; cleared");
                }
                let now = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64());
                let lag = now - batch.ts;
                if (0.0..3600.0).contains(&lag) {
                    core.metrics.event_lag_seconds.observe(lag);
                }
            }
            SubscriberEvent::Resync { reason } => {
                tracing::warn!(endpoint = %key.endpoint, ?reason, "KV events resync: clearing the endpoint's blocks");
                core.metrics.event_problem("resync");
                let mut index = core.index.write();
                if let Some(slot) = index.slot(&key.endpoint) {
                    index.clear_endpoint(slot);
                }
            }
            SubscriberEvent::DecodeError { error, .. } => {
                core.metrics.event_problem("decode_error");
                tracing::debug!(endpoint = %key.endpoint, %error, "undecodable KV event message");
            }
            SubscriberEvent::Connected => {
                tracing::debug!(endpoint = %key.endpoint, publisher = %key.publisher, "KV events connected");
            }
            SubscriberEvent::Disconnected { error } => {
                core.metrics.event_problem("disconnect");
                tracing::debug!(endpoint = %key.endpoint, %error, "KV events disconnected");
            }
        }
    }
}

/// Keep subscriptions in step with the endpoint set until cancelled.
pub async fn run_event_manager(core: Arc<PickerCore>, cancel: CancellationToken) {
    let mut running: HashMap<EndpointId, (SubscriptionKey, CancellationToken)> = HashMap::new();
    let mut seen_version = None;
    loop {
        let version = (
            core.endpoints.load().version(),
            Arc::as_ptr(&core.catalog()) as usize,
        );
        if seen_version != Some(version) {
            seen_version = Some(version);
            let want = desired(&core);
            running.retain(|id, (key, token)| {
                let keep = want.get(id) == Some(key);
                if !keep {
                    token.cancel();
                }
                keep
            });
            for (id, key) in want {
                if running.contains_key(&id) {
                    continue;
                }
                // a new subscription starts from an empty view of its endpoint
                {
                    let mut index = core.index.write();
                    if let Some(slot) = index.slot(&id) {
                        index.clear_endpoint(slot);
                    }
                }
                let mut cfg = SubscriberConfig::new(key.publisher.clone());
                cfg.replay = key.replay.clone();
                cfg.topic = key.topic.as_bytes().to_vec();
                let (tx, rx) = cfg.channel();
                let token = cancel.child_token();
                // the consumer ends when the subscriber (the sender) does
                drop(spawn_subscriber(cfg, tx, token.clone()));
                tokio::spawn(consume(core.clone(), key.clone(), rx));
                running.insert(id, (key, token));
            }
        }
        tokio::select! {
            () = cancel.cancelled() => {
                for (_, (_, t)) in running.drain() {
                    t.cancel();
                }
                return;
            }
            () = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
    }
}
