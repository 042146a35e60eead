//! Misconfigurations the picker can see from the outside, per endpoint: a block size that
//! differs from the engine's, and a KV-event endpoint nobody publishes on. Both used to be
//! silent (a `malformed_blocks` counter, an endpoint that looked idle) while routing went
//! blind; each is now warned about once per endpoint, exported as
//! `kvroute_picker_endpoint_misconfigured{endpoint, reason}` and shown in `/debug/endpoints`.
//!
//! The state is a plain struct fed by the scraper and the KV-event consumer with values and
//! times; it answers with what became true, and the callers log and set the metric.

use std::collections::HashMap;

use serde::Serialize;

use crate::endpoint::EndpointId;

/// How long an endpoint whose engine is busy may go without a single KV-event batch before
/// the picker says its events never arrive. An engine serving requests publishes a batch per
/// scheduler step that stores or frees blocks, so half a minute of silence is not idleness.
pub const KV_SILENCE_WARN_AFTER_MS: u64 = 30_000;

/// The metric label of a block-size mismatch.
pub const REASON_BLOCK_SIZE: &str = "block_size_mismatch";
/// The metric label of KV events that never arrived.
pub const REASON_KV_EVENTS: &str = "kv_events_never_received";

/// Where the engine's block size was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockSizeSource {
    /// `vllm:cache_config_info{block_size=...}` (or TRT-LLM's tokens per block).
    Metrics,
    /// The `block_size` field of a `BlockStored` event.
    KvEvents,
}

/// The pool's block size and the engine's, when they differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BlockSizeMismatch {
    /// `blockSize` of the endpoint's model config.
    pub configured: u32,
    /// What the engine reports.
    pub engine: u32,
    pub source: BlockSizeSource,
}

impl BlockSizeMismatch {
    /// The warning, naming both sizes and the fix.
    pub fn message(&self) -> String {
        let source = match self.source {
            BlockSizeSource::Metrics => "its metrics (vllm:cache_config_info)",
            BlockSizeSource::KvEvents => "its KV events (BlockStored.block_size)",
        };
        format!(
            "the model config sets blockSize {} but the engine uses block_size {} (from {source}): \
             its KV events cannot be keyed and its cached prefixes earn no credit. Set blockSize: \
             {} in the model config, or start the engine with --block-size {}",
            self.configured, self.engine, self.engine, self.configured
        )
    }
}

/// What the picker knows of an endpoint's KV-event feed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KvEventsStatus {
    /// The model config has no `kvEvents`: nothing is expected.
    #[default]
    NotConfigured,
    /// Subscribed; no batch yet, and no sign yet that one is overdue.
    Waiting,
    /// At least one batch arrived since the subscription started.
    Receiving,
    /// Subscribed for [`KV_SILENCE_WARN_AFTER_MS`] while the engine served requests, and not
    /// one batch came.
    NeverReceived,
}

/// The warning for [`KvEventsStatus::NeverReceived`], naming the likely causes.
pub fn kv_silence_message(publisher: &str, silent_ms: u64) -> String {
    format!(
        "no KV events from {publisher} in {} s although the engine is serving requests: \
         routing cannot see its cache. Likely causes: vLLM binds its KV-event PUB socket only \
         when the endpoint contains '*' (\"endpoint\": \"tcp://*:5557\" in --kv-events-config); \
         with a plain address it connects out instead and nothing listens here; the port is \
         wrong (vLLM adds the data-parallel rank to it); or enable_kv_cache_events is off",
        silent_ms / 1000
    )
}

/// One endpoint's findings, as `/debug/endpoints` shows them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct EndpointDiagnosis {
    pub block_size_mismatch: Option<BlockSizeMismatch>,
    pub kv_events: KvEventsStatus,
}

#[derive(Debug, Default)]
struct Entry {
    diagnosis: EndpointDiagnosis,
    /// Publisher and start of the current subscription.
    subscribed: Option<(String, u64)>,
    /// The engine was seen serving after the subscription started: requests queued or
    /// running, or its prefix-cache lookup counter moving past `queries_baseline`.
    engine_busy: bool,
    /// `prefix_cache_queries` at the first scrape after the subscription started.
    queries_baseline: Option<f64>,
}

/// What one scrape says about an engine's activity.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EngineActivity {
    /// Requests waiting plus running.
    pub requests: f64,
    /// The engine's prefix-cache lookup counter (tokens), when it exports one.
    pub prefix_cache_queries: Option<f64>,
    /// This picker has sent the endpoint a prompt of at least one full KV block. Before that
    /// an engine publishes nothing (prompts shorter than a block store no block), so silence
    /// says nothing.
    pub full_block_sent: bool,
}

/// A change the caller should report (log once, set or clear the metric).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finding {
    /// Newly found: warn with this message and set the metric for `reason`.
    Raised {
        endpoint: EndpointId,
        reason: &'static str,
        message: String,
    },
    /// No longer true: clear the metric for `reason`.
    Cleared {
        endpoint: EndpointId,
        reason: &'static str,
    },
}

/// Per-endpoint findings. Behind one lock in the core; every method is a plain step.
#[derive(Debug)]
pub struct Diagnostics {
    entries: HashMap<EndpointId, Entry>,
    silence_after_ms: u64,
}

impl Default for Diagnostics {
    fn default() -> Self {
        Self {
            entries: HashMap::new(),
            silence_after_ms: KV_SILENCE_WARN_AFTER_MS,
        }
    }
}

impl Diagnostics {
    /// Sets how long a busy engine's KV events may be missing before it is a finding
    /// (default [`KV_SILENCE_WARN_AFTER_MS`]; tests shorten it).
    pub fn set_kv_silence_after(&mut self, after: std::time::Duration) {
        self.silence_after_ms = u64::try_from(after.as_millis()).unwrap_or(u64::MAX);
    }

    /// The engine reports `engine` tokens per block where the pool configures `configured`.
    pub fn block_size_seen(
        &mut self,
        id: EndpointId,
        configured: u32,
        engine: u32,
        source: BlockSizeSource,
    ) -> Option<Finding> {
        let entry = self.entries.entry(id).or_default();
        let before = entry.diagnosis.block_size_mismatch;
        if configured == engine {
            // the metrics are the engine's own statement; events only ever raise
            if source == BlockSizeSource::Metrics && before.is_some() {
                entry.diagnosis.block_size_mismatch = None;
                return Some(Finding::Cleared {
                    endpoint: id,
                    reason: REASON_BLOCK_SIZE,
                });
            }
            return None;
        }
        if before.is_some_and(|b| b.configured == configured && b.engine == engine) {
            return None;
        }
        let mismatch = BlockSizeMismatch {
            configured,
            engine,
            source,
        };
        entry.diagnosis.block_size_mismatch = Some(mismatch);
        Some(Finding::Raised {
            endpoint: id,
            reason: REASON_BLOCK_SIZE,
            message: mismatch.message(),
        })
    }

    /// A (new) KV-event subscription to `publisher` started at `now_ms`.
    pub fn kv_subscribed(
        &mut self,
        id: EndpointId,
        publisher: &str,
        now_ms: u64,
    ) -> Option<Finding> {
        let entry = self.entries.entry(id).or_default();
        let was = entry.diagnosis.kv_events;
        entry.diagnosis.kv_events = KvEventsStatus::Waiting;
        entry.subscribed = Some((publisher.to_owned(), now_ms));
        entry.engine_busy = false;
        entry.queries_baseline = None;
        (was == KvEventsStatus::NeverReceived).then_some(Finding::Cleared {
            endpoint: id,
            reason: REASON_KV_EVENTS,
        })
    }

    /// A batch arrived on `id`'s subscription.
    pub fn kv_batch(&mut self, id: EndpointId) -> Option<Finding> {
        let entry = self.entries.get_mut(&id)?;
        let was = std::mem::replace(&mut entry.diagnosis.kv_events, KvEventsStatus::Receiving);
        (was == KvEventsStatus::NeverReceived).then_some(Finding::Cleared {
            endpoint: id,
            reason: REASON_KV_EVENTS,
        })
    }

    /// A scrape of `id`'s engine at `now_ms`: raises the finding when its events are overdue.
    /// An idle engine publishes nothing (blocks it cached before the subscription are not
    /// announced again), so only an engine seen serving since then makes silence a finding.
    pub fn engine_seen(
        &mut self,
        id: EndpointId,
        activity: EngineActivity,
        now_ms: u64,
    ) -> Option<Finding> {
        let entry = self.entries.get_mut(&id)?;
        let since = entry.subscribed.as_ref()?.1;
        let queried = match (entry.queries_baseline, activity.prefix_cache_queries) {
            (Some(base), Some(q)) => q > base,
            (None, Some(q)) => {
                entry.queries_baseline = Some(q);
                false
            }
            (_, None) => false,
        };
        entry.engine_busy |= activity.requests > 0.0 || queried;
        let silent = now_ms.saturating_sub(since);
        if entry.diagnosis.kv_events == KvEventsStatus::Waiting
            && entry.engine_busy
            && activity.full_block_sent
            && silent >= self.silence_after_ms
        {
            entry.diagnosis.kv_events = KvEventsStatus::NeverReceived;
            return Some(Finding::Raised {
                endpoint: id,
                reason: REASON_KV_EVENTS,
                message: kv_silence_message(
                    entry.subscribed.as_ref().map_or("", |(p, _)| p.as_str()),
                    silent,
                ),
            });
        }
        None
    }

    /// Forgets every endpoint `keep` refuses (it left the set); returns the findings to
    /// clear.
    pub fn retain(&mut self, keep: impl Fn(&EndpointId) -> bool) -> Vec<Finding> {
        let gone: Vec<EndpointId> = self
            .entries
            .keys()
            .filter(|id| !keep(id))
            .copied()
            .collect();
        gone.iter().flat_map(|id| self.forget(id)).collect()
    }

    /// `id` left the endpoint set: forget it, clearing any metric it had raised.
    pub fn forget(&mut self, id: &EndpointId) -> Vec<Finding> {
        let Some(entry) = self.entries.remove(id) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        if entry.diagnosis.block_size_mismatch.is_some() {
            out.push(Finding::Cleared {
                endpoint: *id,
                reason: REASON_BLOCK_SIZE,
            });
        }
        if entry.diagnosis.kv_events == KvEventsStatus::NeverReceived {
            out.push(Finding::Cleared {
                endpoint: *id,
                reason: REASON_KV_EVENTS,
            });
        }
        out
    }

    /// The KV-event subscription of `id` stopped.
    pub fn kv_unsubscribed(&mut self, id: &EndpointId) -> Option<Finding> {
        let entry = self.entries.get_mut(id)?;
        entry.subscribed = None;
        let was = std::mem::take(&mut entry.diagnosis.kv_events);
        (was == KvEventsStatus::NeverReceived).then_some(Finding::Cleared {
            endpoint: *id,
            reason: REASON_KV_EVENTS,
        })
    }

    /// What is known of `id`.
    pub fn get(&self, id: &EndpointId) -> EndpointDiagnosis {
        self.entries
            .get(id)
            .map(|e| e.diagnosis)
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{IpAddr, Ipv4Addr};

    fn id(n: u8) -> EndpointId {
        EndpointId::new(IpAddr::V4(Ipv4Addr::new(127, 0, 0, n)), 8000, 0)
    }

    #[test]
    fn a_block_size_mismatch_is_raised_once_and_cleared_by_the_metrics() {
        let mut d = Diagnostics::default();
        let e = id(1);
        assert_eq!(d.block_size_seen(e, 16, 16, BlockSizeSource::Metrics), None);
        let Some(Finding::Raised {
            reason, message, ..
        }) = d.block_size_seen(e, 16, 32, BlockSizeSource::Metrics)
        else {
            panic!("not raised")
        };
        assert_eq!(reason, REASON_BLOCK_SIZE);
        assert!(message.contains("blockSize 16"), "{message}");
        assert!(message.contains("block_size 32"), "{message}");
        assert!(message.contains("Set blockSize: 32"), "{message}");
        // once: every scrape and every event batch says it again
        assert_eq!(d.block_size_seen(e, 16, 32, BlockSizeSource::Metrics), None);
        assert_eq!(
            d.block_size_seen(e, 16, 32, BlockSizeSource::KvEvents),
            None
        );
        assert_eq!(
            d.get(&e).block_size_mismatch,
            Some(BlockSizeMismatch {
                configured: 16,
                engine: 32,
                source: BlockSizeSource::Metrics
            })
        );
        // events agreeing do not clear what the metrics said; the metrics do
        assert_eq!(
            d.block_size_seen(e, 16, 16, BlockSizeSource::KvEvents),
            None
        );
        assert_eq!(
            d.block_size_seen(e, 16, 16, BlockSizeSource::Metrics),
            Some(Finding::Cleared {
                endpoint: e,
                reason: REASON_BLOCK_SIZE
            })
        );
        assert_eq!(d.get(&e), EndpointDiagnosis::default());
        // from events alone
        assert!(matches!(
            d.block_size_seen(id(2), 32, 16, BlockSizeSource::KvEvents),
            Some(Finding::Raised { .. })
        ));
        assert_eq!(d.forget(&id(2)).len(), 1);
    }

    #[test]
    fn kv_events_that_never_arrive_are_raised_only_for_a_busy_engine() {
        let mut d = Diagnostics::default();
        let e = id(1);
        let t0 = 1_000;
        assert_eq!(d.kv_subscribed(e, "tcp://127.0.0.1:5557", t0), None);
        assert_eq!(d.get(&e).kv_events, KvEventsStatus::Waiting);
        let idle = |queries| EngineActivity {
            requests: 0.0,
            prefix_cache_queries: Some(queries),
            full_block_sent: true,
        };
        let serving = EngineActivity {
            requests: 2.0,
            prefix_cache_queries: None,
            full_block_sent: true,
        };
        // serving only prompts shorter than one block: no block is stored, nothing published
        // (finding 6 of issue 35: such a pool was reported as misconfigured)
        let short_prompts = EngineActivity {
            full_block_sent: false,
            ..serving
        };
        let short = id(3);
        d.kv_subscribed(short, "tcp://127.0.0.1:5558", t0);
        assert_eq!(d.engine_seen(short, short_prompts, t0 + 60_000), None);
        assert_eq!(d.get(&short).kv_events, KvEventsStatus::Waiting);
        // its first full block arms the check
        assert!(matches!(
            d.engine_seen(short, serving, t0 + 61_000),
            Some(Finding::Raised { .. })
        ));
        // an idle engine publishes nothing: silence is not a finding
        assert_eq!(d.engine_seen(e, idle(500.0), t0 + 1_000), None);
        assert_eq!(d.engine_seen(e, idle(500.0), t0 + 60_000), None);
        // lookups since the subscription mean it served requests between two scrapes
        assert!(matches!(
            d.engine_seen(e, idle(564.0), t0 + 61_000),
            Some(Finding::Raised { .. })
        ));
        // busy, but not silent long enough
        assert_eq!(
            d.kv_subscribed(e, "tcp://127.0.0.1:5557", t0),
            Some(Finding::Cleared {
                endpoint: e,
                reason: REASON_KV_EVENTS
            })
        );
        assert_eq!(
            d.engine_seen(e, serving, t0 + KV_SILENCE_WARN_AFTER_MS - 1),
            None
        );
        let Some(Finding::Raised {
            reason, message, ..
        }) = d.engine_seen(e, idle(0.0), t0 + KV_SILENCE_WARN_AFTER_MS)
        else {
            panic!("not raised")
        };
        assert_eq!(reason, REASON_KV_EVENTS);
        for cause in [
            "tcp://*:5557",
            "connects out",
            "port",
            "enable_kv_cache_events",
        ] {
            assert!(message.contains(cause), "{cause}: {message}");
        }
        assert!(message.contains("tcp://127.0.0.1:5557"), "{message}");
        assert_eq!(d.get(&e).kv_events, KvEventsStatus::NeverReceived);
        // once
        assert_eq!(d.engine_seen(e, serving, t0 + 120_000), None);
        // the first batch clears it
        assert_eq!(
            d.kv_batch(e),
            Some(Finding::Cleared {
                endpoint: e,
                reason: REASON_KV_EVENTS
            })
        );
        assert_eq!(d.get(&e).kv_events, KvEventsStatus::Receiving);
        assert_eq!(d.engine_seen(e, serving, t0 + 600_000), None);
        // an endpoint without a subscription is never flagged
        assert_eq!(d.engine_seen(id(2), serving, t0 + 600_000), None);
        assert_eq!(d.get(&id(2)).kv_events, KvEventsStatus::NotConfigured);
    }
}
