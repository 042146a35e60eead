//! The KV-event feed: one ZMQ subscription per publishing endpoint (rank), kept in step with
//! the endpoint set, each applying its batches to the index under short write locks, all on a
//! thread of their own ([`run_event_manager_thread`]). Routing only ever takes the read lock,
//! so ingestion never waits on a socket while holding it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::kv_subscriber::{SubscriberConfig, SubscriberEvent, spawn_subscriber};
use super::zmtp_guard::spawn_guard;
use crate::block_keys::BlockHasher;
use crate::endpoint::EndpointId;
use crate::kv_events::budget::{Admit, EventBudget};
use crate::kv_events::ingest::IngestKeys;
use crate::pool_state::{ClearCause, Resynced};
use crate::service::diagnostics::BlockSizeSource;
use crate::service::state::PickerState;

/// What a subscription is for; a change in any part means a new subscription.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct SubscriptionKey {
    pub(crate) endpoint: EndpointId,
    pub(crate) publisher: String,
    replay: Option<String>,
    topic: String,
    block_size: u32,
    model: String,
}

/// The subscription `endpoint` gets: its publisher (from the ports the engine serves, else
/// the model config's port plus the rank), replay, topic and keying; `None` when its model
/// config publishes no KV events.
pub(crate) fn subscription_for(
    picker: &PickerState,
    catalog: &std::collections::BTreeMap<String, Arc<crate::service::declared::ModelEntry>>,
    e: &crate::endpoint::Endpoint,
) -> Option<SubscriptionKey> {
    let entry = catalog.get(&*e.model_config.name)?;
    let ev = entry.spec.kv_events.as_ref()?;
    let host = match e.id.address {
        std::net::IpAddr::V4(a) => a.to_string(),
        std::net::IpAddr::V6(a) => format!("[{a}]"),
    };
    let rank = e.id.rank as u16;
    let (events_port, replay_port) = match picker.kv_ports_of(&e.id) {
        Some(p) => (p.events, p.replay),
        None => (
            ev.port.saturating_add(rank),
            ev.replay_port.map(|p| p.saturating_add(rank)),
        ),
    };
    // what the engine lists at /kv_event_sources outranks what the pool computes
    let (publisher, replay, topic) = match picker.event_sources.get(&e.id) {
        Some(s) => (s.publisher, s.replay, s.topic),
        None => (
            format!("tcp://{host}:{events_port}"),
            replay_port.map(|p| format!("tcp://{host}:{p}")),
            ev.topic.clone(),
        ),
    };
    Some(SubscriptionKey {
        endpoint: e.id,
        publisher,
        replay,
        topic,
        block_size: entry.config.block_size,
        model: entry.config.model.to_string(),
    })
}

fn desired(picker: &PickerState) -> HashMap<EndpointId, SubscriptionKey> {
    let snap = picker.pool.state().endpoints();
    let catalog = picker.catalog();
    snap.endpoints()
        .iter()
        .filter_map(|e| subscription_for(picker, &catalog, e).map(|k| (e.id, k)))
        .collect()
}

/// Apply one subscriber's events until it ends.
async fn consume(
    picker: Arc<PickerState>,
    key: SubscriptionKey,
    mut rx: mpsc::Receiver<SubscriberEvent>,
) {
    let keys = IngestKeys {
        hasher: BlockHasher::new(key.block_size),
        model: &key.model,
    };
    let limits = &picker.limits;
    let mut budget = EventBudget::new(
        limits.max_events_per_second,
        limits.event_burst,
        Instant::now(),
    );
    let mut received = false;
    while let Some(ev) = rx.recv().await {
        match ev {
            SubscriberEvent::Batch { seq, batch } => {
                if !std::mem::replace(&mut received, true) {
                    picker.report(picker.diagnostics.lock().kv_batch(key.endpoint));
                }
                match budget.admit(batch.budget_cost(), Instant::now()) {
                    Admit::Apply => {}
                    Admit::Drop => {
                        picker.metrics.event_problem("rate_limited");
                        picker.pool.state().forget_position(&key.endpoint);
                        continue;
                    }
                    Admit::DropAndClear => {
                        picker.metrics.event_problem("rate_limited");
                        tracing::warn!(endpoint = %key.endpoint, "KV event publisher over its rate limit: dropping batches, clearing the endpoint's blocks");
                        picker
                            .pool
                            .state()
                            .clear(&key.endpoint, ClearCause::RateLimited);
                        continue;
                    }
                }
                let Some(stats) = picker.pool.state().apply_numbered_batch(
                    &key.endpoint,
                    keys,
                    &batch,
                    Some(seq),
                ) else {
                    continue;
                };
                picker.metrics.event_batches.inc();
                // (`unmodelled_group`: a hybrid engine with a KV-cache group kind the picker
                // does not model gets no credit rather than false credit, docs/cache-state.md)
                for (blocks, kind) in [
                    (stats.orphan_blocks, "orphan_blocks"),
                    (stats.opaque_blocks, "opaque_blocks"),
                    (stats.malformed_blocks, "malformed_blocks"),
                    (stats.unmodelled_blocks, "unmodelled_group"),
                    (stats.untracked_tier_blocks, "untracked_tier"),
                    (stats.lower_tier_orphans, "lower_tier_orphans"),
                    (stats.unplaced_blocks, "unplaced_blocks"),
                    (stats.unknown_moved_blocks, "unknown_moved_blocks"),
                ] {
                    if blocks > 0 {
                        picker.metrics.event_problem(kind);
                    }
                }
                if let Some(engine) = stats.foreign_block_size {
                    picker.report(picker.diagnostics.lock().block_size_seen(
                        key.endpoint,
                        key.block_size,
                        engine,
                        BlockSizeSource::KvEvents,
                    ));
                }
                if stats.overflowed {
                    picker.metrics.event_problem("overflow");
                    tracing::warn!(endpoint = %key.endpoint, "endpoint exceeded its block budget; cleared");
                }
                let lag = crate::kv_events::unix_now() - batch.ts;
                if (0.0..3600.0).contains(&lag) {
                    picker.metrics.event_lag_seconds.observe(lag);
                }
                // A batch is applied without an await: a busy stream would otherwise keep its
                // worker thread for as many batches as the channel holds (tokio's budget is
                // 128 receives, tens of milliseconds at a few hundred blocks each) while the
                // other streams' tasks wait. A yield per batch lets them in between two
                // batches (`kvroute-bench scale`, picker/BENCHMARKS.md section 4).
                tokio::task::yield_now().await;
            }
            SubscriberEvent::Resync { reason } => {
                picker.metrics.event_problem("resync");
                let resynced = picker.pool.state().resync(&key.endpoint, &reason);
                match resynced {
                    Resynced::Cleared(_) => {
                        tracing::warn!(endpoint = %key.endpoint, %reason, "KV events resync: cleared the endpoint's blocks")
                    }
                    Resynced::Kept => {
                        tracing::warn!(endpoint = %key.endpoint, %reason, "KV events lost: the endpoint's blocks are kept and its view marked as having a gap")
                    }
                }
                if let crate::kv_events::resequence::ResyncReason::ContinuityLost { .. } = reason {
                    picker
                        .warm
                        .lock()
                        .not_continued(key.endpoint, resynced == Resynced::Kept);
                }
            }
            SubscriberEvent::Continued { seq } => {
                let confirmed = picker.pool.state().confirm_seed(&key.endpoint);
                if confirmed > 0 {
                    tracing::info!(endpoint = %key.endpoint, seq, confirmed, "the engine's replay continues the copied view: its blocks are confirmed");
                    picker.warm.lock().confirmed(key.endpoint);
                }
            }
            SubscriberEvent::DecodeError { error, .. } => {
                picker.metrics.event_problem("decode_error");
                tracing::debug!(endpoint = %key.endpoint, %error, "undecodable KV event message");
            }
            SubscriberEvent::Connected => {
                tracing::debug!(endpoint = %key.endpoint, publisher = %key.publisher, "KV events connected");
            }
            SubscriberEvent::Disconnected { error } => {
                picker.metrics.event_problem("disconnect");
                // the engine may have come back on other ports
                picker.event_sources.nudge(&key.endpoint);
                tracing::debug!(endpoint = %key.endpoint, %error, "KV events disconnected");
            }
        }
    }
}

/// How long stopping waits for the subscriber and consumer tasks.
pub const STOP_WAIT: Duration = Duration::from_secs(5);

/// [`run_event_manager`] on a thread of its own with a runtime of its own, returning once it
/// has stopped. The kernel then shares the CPU between event ingestion and the request path:
/// requests that saturate the request runtime's workers cannot hold the events back for
/// seconds (leaving the index stale just when routing matters most), and a burst of events
/// takes no more than this thread's share from the requests. Every subscriber and consumer
/// task is spawned on that runtime. If the thread cannot be started, the manager runs here.
pub async fn run_event_manager_thread(picker: Arc<PickerState>, cancel: CancellationToken) {
    let (done, stopped) = tokio::sync::oneshot::channel::<()>();
    let (on_thread, token) = (picker.clone(), cancel.clone());
    let spawned = std::thread::Builder::new()
        .name("kvroute-events".into())
        .spawn(move || {
            match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => {
                    runtime.block_on(run_event_manager(on_thread, token));
                    let _ = done.send(());
                }
                Err(e) => {
                    tracing::error!(error = %e, "cannot build the KV-event runtime; no KV events are read")
                }
            }
        });
    match spawned {
        // the sender is dropped unsent if the thread ends any other way
        Ok(thread) => {
            if stopped.await.is_err() {
                tracing::error!("the KV-event thread stopped early; no KV events are read");
            }
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot start the KV-event thread; reading events on the request runtime");
            run_event_manager(picker, cancel).await;
        }
    }
}

/// Keep subscriptions in step with the endpoint set until cancelled. Every subscriber and
/// consumer task it starts belongs to its `JoinSet`: finished ones are reaped as it goes, and
/// it returns only once all of them have stopped (at most [`STOP_WAIT`] after cancellation).
pub async fn run_event_manager(picker: Arc<PickerState>, cancel: CancellationToken) {
    let mut running: HashMap<EndpointId, (SubscriptionKey, CancellationToken)> = HashMap::new();
    let mut tasks = tokio::task::JoinSet::new();
    // wakes on every applied pool view (the model configs may have changed with it) and every
    // change of the endpoint set
    let mut changes = picker.watch_pool();
    let mut sources = picker.event_sources.watch();
    let mut seen_version = None;
    loop {
        let version = (
            picker.pool.state().endpoints().version(),
            Arc::as_ptr(&picker.catalog()) as usize,
            picker.event_sources.version(),
        );
        if seen_version != Some(version) {
            seen_version = Some(version);
            let want = desired(&picker);
            running.retain(|id, (key, token)| {
                let keep = want.get(id) == Some(key);
                if !keep {
                    token.cancel();
                    picker.report(picker.diagnostics.lock().kv_unsubscribed(id));
                }
                keep
            });
            for (id, key) in want {
                if running.contains_key(&id) {
                    continue;
                }
                // a view copied from a snapshot or a peer is kept, and continued from its
                // position when it was taken from this same publisher
                let resume = match picker.pool.state().take_seed(&id) {
                    Some(position) => picker.warm.lock().resume_for(
                        id,
                        &key.publisher,
                        key.replay.is_some(),
                        position,
                    ),
                    None => {
                        picker.pool.state().clear(&id, ClearCause::Subscribed);
                        None
                    }
                };
                // the engine's sockets are reached through frame-checking relays: the
                // `zeromq` crate would abort on a frame announcing an absurd size
                // (twice the payload bound: a merely oversized payload is skipped and counted
                // by the subscriber; only absurd frames cost the connection)
                let max_frame = (picker.limits.max_event_payload_bytes as u64)
                    .saturating_mul(2)
                    .max(1 << 20);
                let token = cancel.child_token();
                let guarded = |upstream: String| {
                    let token = token.clone();
                    async move {
                        match spawn_guard(&upstream, max_frame, Duration::from_secs(5), token).await
                        {
                            Ok(g) => g.endpoint,
                            Err(e) => {
                                tracing::warn!(%upstream, error = %e, "cannot start the frame guard; connecting directly");
                                upstream
                            }
                        }
                    }
                };
                let publisher = guarded(key.publisher.clone()).await;
                let replay = match &key.replay {
                    Some(r) => Some(guarded(r.clone()).await),
                    None => None,
                };
                let mut cfg = SubscriberConfig::new(publisher);
                cfg.replay = replay;
                cfg.topic = key.topic.as_bytes().to_vec();
                cfg.max_payload_bytes = picker.limits.max_event_payload_bytes;
                cfg.limits.max_events_per_batch = picker.limits.max_events_per_batch;
                cfg.resume = resume;
                let (tx, rx) = cfg.channel();
                picker.report(picker.diagnostics.lock().kv_subscribed(
                    id,
                    &key.publisher,
                    picker.now_ms(),
                ));
                // the consumer ends when the subscriber (the sender) does
                let subscriber = spawn_subscriber(cfg, tx, token.clone());
                tasks.spawn(async move {
                    let _ = subscriber.await;
                });
                tasks.spawn(consume(picker.clone(), key.clone(), rx));
                running.insert(id, (key, token));
            }
        }
        // (the pool, and with it the sender, lives as long as the picker this task holds)
        let stop = tokio::select! {
            () = cancel.cancelled() => true,
            changed = changes.changed() => changed.is_err(),
            Ok(()) = sources.changed() => false,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
        };
        if stop {
            for (_, (_, t)) in running.drain() {
                t.cancel();
            }
            let drained = async { while tasks.join_next().await.is_some() {} };
            if tokio::time::timeout(STOP_WAIT, drained).await.is_err() {
                tracing::warn!("KV event tasks still running after {STOP_WAIT:?}: aborted");
                tasks.abort_all();
            }
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 31: the subscriber and consumer tasks belong to the manager, which returns only
    /// once they have stopped; nothing of the picker outlives it (the consumers hold it). On
    /// this single-threaded runtime the tasks would also have stopped by then without the
    /// manager waiting for them: the test guards the outcome (no consumer left behind, as when
    /// one hangs), not the waiting itself.
    #[tokio::test]
    async fn the_manager_returns_only_once_its_tasks_have_stopped() {
        use crate::service::settings::{IndexSettings, Limits, PickerConfig};
        use crate::service::source::view_from_config;
        // nothing listens on the event ports: the subscribers keep reconnecting
        let config = PickerConfig::from_yaml(
            "modelConfigs:\n  - {name: a, model: m, port: 8000, kvEvents: {port: 1}}\n\
             endpoints:\n  - {address: 127.0.0.2, modelConfig: a}\n  \
             - {address: 127.0.0.3, modelConfig: a}\n",
        )
        .expect("valid");
        let picker = Arc::new(
            PickerState::new(Limits::default(), IndexSettings::default()).expect("picker"),
        );
        picker
            .apply_pool(&view_from_config(&config))
            .expect("applied");
        for own_thread in [false, true] {
            let cancel = CancellationToken::new();
            let manager = if own_thread {
                tokio::spawn(run_event_manager_thread(picker.clone(), cancel.clone()))
            } else {
                tokio::spawn(run_event_manager(picker.clone(), cancel.clone()))
            };
            // both endpoints subscribed: their consumers hold the picker
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            while Arc::strong_count(&picker) < 4 + usize::from(own_thread) {
                assert!(tokio::time::Instant::now() < deadline, "never subscribed");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert_eq!(events_threads(), usize::from(own_thread));
            cancel.cancel();
            manager.await.expect("the manager ends");
            assert_eq!(Arc::strong_count(&picker), 1, "a task outlived the manager");
            // the thread leaves the process's task list once it has exited
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while events_threads() > 0 {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the thread outlived its manager"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }

    /// Threads of this process named as the KV-event thread.
    fn events_threads() -> usize {
        std::fs::read_dir("/proc/self/task")
            .expect("/proc/self/task")
            .filter_map(Result::ok)
            .filter(|t| {
                std::fs::read_to_string(t.path().join("comm"))
                    .is_ok_and(|name| name.trim() == "kvroute-events")
            })
            .count()
    }
}
