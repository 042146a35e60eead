//! The operator's Prometheus metrics.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::error::Error;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    error: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: String,
}

/// Reconciles, their failures by error kind and their duration; writes by object kind;
/// leadership.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    reconciles: Counter,
    errors: Family<ErrorLabels, Counter>,
    duration: Histogram,
    writes: Family<KindLabels, Counter>,
    status_writes: Counter,
    leader: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("kvroute_operator");
        let reconciles = Counter::default();
        let errors = Family::<ErrorLabels, Counter>::default();
        let duration = Histogram::new(exponential_buckets(0.001, 2.0, 14));
        let writes = Family::<KindLabels, Counter>::default();
        let status_writes = Counter::default();
        let leader = Gauge::default();
        registry.register("reconciles", "KVRoutePool reconciles", reconciles.clone());
        registry.register(
            "reconcile_errors",
            "Failed reconciles by error kind",
            errors.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Time to reconcile one KVRoutePool",
            duration.clone(),
        );
        registry.register(
            "object_writes",
            "Owned objects applied or deleted, by kind (a no-op reconcile writes none)",
            writes.clone(),
        );
        registry.register(
            "status_writes",
            "KVRoutePool status updates",
            status_writes.clone(),
        );
        registry.register(
            "leader",
            "1 while this replica holds the leader lease",
            leader.clone(),
        );
        Self {
            registry,
            reconciles,
            errors,
            duration,
            writes,
            status_writes,
            leader,
        }
    }
}

impl Metrics {
    pub fn reconciled(&self, outcome: Result<(), &Error>, took: Duration) {
        self.reconciles.inc();
        self.duration.observe(took.as_secs_f64());
        if let Err(e) = outcome {
            self.errors
                .get_or_create(&ErrorLabels {
                    error: e.metric_label(),
                })
                .inc();
        }
    }

    pub fn wrote(&self, kind: &str, n: usize) {
        if n > 0 {
            self.writes
                .get_or_create(&KindLabels { kind: kind.into() })
                .inc_by(n as u64);
        }
    }

    pub fn status_written(&self) {
        self.status_writes.inc();
    }

    pub fn set_leader(&self, leader: bool) {
        self.leader.set(i64::from(leader));
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}
