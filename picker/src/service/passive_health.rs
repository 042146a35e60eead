//! Passive health wiring: what forwarded requests got feeds the outlier detector
//! ([`crate::outlier`]); its ejections reach the router's candidate filter, the metrics and
//! `/debug/endpoints`. The proxy and the ext_proc path both report here.

use super::metrics::{EjectionLabels, EndpointLabels};
use super::state::PickerState;
use crate::endpoint::EndpointId;
use crate::outlier::{Outcome, OutlierStatus};

impl PickerState {
    /// One request's result on `endpoint`.
    pub fn record_outcome(&self, endpoint: EndpointId, outcome: Outcome) {
        let now = self.now_ms();
        let Some(e) = self
            .pool
            .outliers()
            .lock()
            .on_result(endpoint, outcome, now)
        else {
            return;
        };
        let name = endpoint.to_string();
        self.metrics
            .outlier_ejections
            .get_or_create(&EjectionLabels {
                endpoint: name.clone(),
                trigger: e.trigger.as_str().to_owned(),
            })
            .inc();
        self.metrics
            .outlier_ejected
            .get_or_create(&EndpointLabels { endpoint: name })
            .set(1);
        tracing::warn!(
            endpoint = %endpoint,
            trigger = e.trigger.as_str(),
            ejections = e.ejections,
            for_ms = e.until_ms.saturating_sub(now),
            "endpoint ejected by passive health"
        );
    }

    /// The endpoints out of rotation right now, sorted (what the router skips).
    pub fn ejected_endpoints(&self) -> Vec<EndpointId> {
        self.pool.outliers().lock().ejected(self.now_ms())
    }

    pub fn outlier_status(&self, endpoint: &EndpointId) -> Option<OutlierStatus> {
        self.pool.outliers().lock().status(endpoint, self.now_ms())
    }

    /// The `departed` endpoints (which the pool forgot) lose their gauges. Called whenever a
    /// pool view is applied.
    pub(super) fn sync_outlier_pool(&self, departed: &[EndpointId]) {
        for id in departed {
            let labels = EndpointLabels {
                endpoint: id.to_string(),
            };
            self.metrics.outlier_ejected.remove(&labels);
            self.metrics.working_set_tokens.remove(&labels);
        }
        self.refresh_outlier_gauges();
    }

    /// Sessions age out of working sets as time passes: bring the gauges up to date (before
    /// metrics are served). Every member has its gauge (0 when nothing is pinned there); a
    /// departed endpoint's goes with it.
    pub fn refresh_working_set_gauges(&self) {
        let now = self.now_ms();
        let sets = self.pool.working_sets(now);
        for e in self.pool.state().endpoints().endpoints() {
            self.metrics
                .working_set_tokens
                .get_or_create(&EndpointLabels {
                    endpoint: e.id.to_string(),
                })
                .set(sets.get(&e.id).copied().unwrap_or(0) as i64);
        }
        self.metrics
            .session_reuse_horizon_seconds
            .set(self.pool.reuse_horizon_ms() as f64 / 1000.0);
    }

    /// Ejections end by themselves as time passes: bring the per-endpoint gauges up to date
    /// (before metrics are served).
    pub fn refresh_outlier_gauges(&self) {
        let states: Vec<(EndpointId, bool)> =
            self.pool.outliers().lock().states(self.now_ms()).collect();
        for (id, ejected) in states {
            self.metrics
                .outlier_ejected
                .get_or_create(&EndpointLabels {
                    endpoint: id.to_string(),
                })
                .set(i64::from(ejected));
        }
    }
}
