//! Calibration wiring: what the proxy, the gateway and the scraper observe feeds the cost
//! model's per-endpoint calibration ([`crate::calibration`]); the router reads it at every
//! decision, `/v1/pick` explains it per candidate, the metrics and `/debug/endpoints` show it.

use std::time::Duration;

use super::metrics::{EndpointLabels, SourceLabels};
use super::state::PickerState;
use crate::calibration::{Source, TtftBasis};
use crate::endpoint::EndpointId;
use crate::engine_metrics::PerfCounters;

impl PickerState {
    /// Whether the cost model calibrates itself (`routing.costModel.calibrate`).
    pub fn calibrating(&self) -> bool {
        self.routing().cost_model.calibrate
    }

    /// The first chunk of a streamed response from `endpoint` arrived `ttft` after the request
    /// was forwarded; `basis` is what the router estimated at the pick.
    pub fn observe_ttft(&self, endpoint: EndpointId, basis: TtftBasis, ttft: Duration) {
        if self.calibrating() {
            let now = self.now_ms();
            let mut calibration = self.pool.calibration().write();
            calibration.age_endpoint(&endpoint, now);
            calibration.observe_ttft(&endpoint, basis, ttft.as_secs_f64() * 1000.0);
        }
    }

    /// One scrape's latency counters: (endpoint, counters, KV usage) each.
    pub fn observe_engines(&self, scraped: &[(EndpointId, PerfCounters, f64)]) {
        if scraped.is_empty() || !self.calibrating() {
            return;
        }
        let now = self.now_ms();
        let mut calibration = self.pool.calibration().write();
        calibration.age(now);
        for (id, counters, kv_usage) in scraped {
            calibration.observe_engine(id, counters, *kv_usage);
        }
    }

    /// Follow the configuration: `routing.costModel` is the prior (a changed model restarts
    /// learning), nothing is kept while calibration is off; the `departed` endpoints (which
    /// the pool forgot) lose their gauges. Called whenever a pool view is applied.
    pub(super) fn sync_calibration(&self, departed: &[EndpointId]) {
        let routing = self.routing();
        {
            let mut calibration = self.pool.calibration().write();
            calibration.set_prior(routing.cost_model);
            if !routing.cost_model.calibrate {
                calibration.reset();
            }
        }
        for id in departed {
            self.remove_calibration_gauges(id);
        }
        self.refresh_calibration_gauges();
    }

    /// Bring the per-endpoint gauges up to date (before metrics are served).
    pub fn refresh_calibration_gauges(&self) {
        let statuses: Vec<_> = self.pool.calibration().read().statuses().collect();
        for (id, status) in statuses {
            let Some(learned) = status.learned else {
                self.remove_calibration_gauges(&id);
                continue;
            };
            let endpoint = EndpointLabels {
                endpoint: id.to_string(),
            };
            let m = &self.metrics;
            m.cost_model_overhead_ms
                .get_or_create(&endpoint)
                .set(learned.overhead_ms);
            m.cost_model_prefill_ms_per_token
                .get_or_create(&endpoint)
                .set(learned.prefill_ms_per_token);
            m.cost_model_decode_step_ms
                .get_or_create(&endpoint)
                .set(learned.decode_step_ms);
            for source in Source::ALL {
                let n = status.observations.get(source);
                m.cost_model_observations
                    .get_or_create(&SourceLabels {
                        endpoint: endpoint.endpoint.clone(),
                        source: source.as_str().to_owned(),
                    })
                    .set(i64::try_from(n).unwrap_or(i64::MAX));
            }
        }
    }

    fn remove_calibration_gauges(&self, id: &EndpointId) {
        let endpoint = EndpointLabels {
            endpoint: id.to_string(),
        };
        let m = &self.metrics;
        m.cost_model_overhead_ms.remove(&endpoint);
        m.cost_model_prefill_ms_per_token.remove(&endpoint);
        m.cost_model_decode_step_ms.remove(&endpoint);
        for source in Source::ALL {
            m.cost_model_observations.remove(&SourceLabels {
                endpoint: endpoint.endpoint.clone(),
                source: source.as_str().to_owned(),
            });
        }
    }
}
