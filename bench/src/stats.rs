//! Per-request records and the per-policy summary the report prints.

use serde::{Deserialize, Serialize};

/// What happened to one request. Times are simulated milliseconds.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestRecord {
    pub release_ms: f64,
    pub prompt_tokens: u32,
    /// `None` for a failed request.
    pub ttft_ms: Option<f64>,
    pub e2e_ms: Option<f64>,
    /// Mean time between output tokens after the first; `None` with fewer than two tokens.
    pub tpot_ms: Option<f64>,
    pub output_tokens: u32,
    /// Prompt tokens the engine served from its cache (its own accounting), when known.
    pub cached_tokens: Option<u32>,
    /// When the response ended (or failed).
    pub end_ms: f64,
    pub error: Option<String>,
}

/// Service-level objectives a request must meet to count as attained.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slo {
    pub ttft_ms: f64,
    pub tpot_ms: f64,
}

impl Slo {
    /// Whether an answered request met both targets.
    pub fn met(&self, r: &RequestRecord) -> bool {
        r.ttft_ms.is_some_and(|t| t <= self.ttft_ms) && r.tpot_ms.is_none_or(|t| t <= self.tpot_ms)
    }
}

/// Prompt tokens the engines had cached over the prompt tokens of `rs` (0 without prompts).
pub fn cached_fraction<'a>(rs: impl Iterator<Item = &'a RequestRecord> + Clone) -> f64 {
    let prompt: u64 = rs.clone().map(|r| u64::from(r.prompt_tokens)).sum();
    let cached: u64 = rs.filter_map(|r| r.cached_tokens).map(u64::from).sum();
    if prompt == 0 {
        0.0
    } else {
        cached as f64 / prompt as f64
    }
}

/// One policy's figures. The JSON keys are fixed (`--json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub policy: String,
    pub requests: u64,
    pub errors: u64,
    pub hit_rate: f64,
    pub hit_rate_ceiling: f64,
    pub ttft_ms_p50: f64,
    pub ttft_ms_p90: f64,
    pub ttft_ms_p99: f64,
    pub e2e_ms_p50: f64,
    pub e2e_ms_p99: f64,
    pub tpot_ms_p50: f64,
    pub tpot_ms_p90: f64,
    pub output_tok_s: f64,
    pub slo_attainment: f64,
    pub load_cv: f64,
    pub prefill_util: f64,
    /// `null` when unknown (a router that exports no decision histogram).
    pub decision_us_p99: Option<f64>,
}

/// A policy's run beyond the summary: what the HTML report plots.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RunDetail {
    /// TTFTs of successful requests, sorted (ms).
    pub ttfts_sorted: Vec<f64>,
    /// Per endpoint: `(time s, requests waiting + running)` samples.
    pub load_series: Vec<(String, Vec<(f64, f64)>)>,
    /// The pooled-LRU ideal hit rate with the configured capacity, when computed.
    pub hit_rate_ideal: Option<f64>,
    /// First error messages (bounded), for the terminal.
    pub error_samples: Vec<String>,
    /// What the picker believed, from its own metrics (live runs through kvroute's picker).
    pub picker: Option<PickerFigures>,
    /// Tokens each engine rank prefilled (prompt tokens minus its cache hits), by its own
    /// counters (live runs).
    pub engine_prefill_tokens: Vec<f64>,
    /// Prompt tokens each engine rank was given (cached or not), by its own counters.
    pub engine_prompt_tokens: Vec<f64>,
    /// The turns session admission held (offline runs with admission on).
    pub admission: Option<AdmissionFigures>,
    /// LoRA adapters (offline runs with `--lora-adapters`): requests naming one, of those
    /// the ones whose adapter was already in a GPU slot, and adapter loads.
    pub lora: Option<(u64, u64, u64)>,
    /// Per request class (offline runs with bands or tenants): its name, requests, the ones
    /// answered without being served, and the served ones' TTFT p50 and p90 (ms).
    pub classes: Vec<(String, usize, usize, f64, f64)>,
    /// Offline runs with a scenario: the figures of each phase, and when each event's TTFT
    /// came back.
    pub phases: Vec<crate::scenario::Phase>,
    pub recoveries: Vec<crate::scenario::Recovery>,
    /// Live, several pickers and a `picker-restart`: the restarted picker's first requests
    /// against the others'.
    pub restarted_picker: Option<crate::scenario::RestartedPicker>,
}

/// What session admission held: how many first turns and how long (their TTFTs include it).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AdmissionFigures {
    pub held: usize,
    /// Placed because they waited `maxWait`.
    pub timeouts: usize,
    pub wait_ms_p50: f64,
    pub wait_ms_p99: f64,
    pub wait_ms_max: f64,
    /// The sessions' live context in the pool (each session's last prompt, while its last
    /// turn is within the reuse horizon, at most one engine's cache) over the KV capacity
    /// times `overcommit`, sampled at every scrape: its mean and its peak.
    pub live_mean: f64,
    pub live_peak: f64,
}

impl AdmissionFigures {
    pub fn from_waits(waits: &[f64], timeouts: usize, live: &[f64]) -> Self {
        let mut v = waits.to_vec();
        v.sort_by(f64::total_cmp);
        Self {
            held: v.len(),
            timeouts,
            wait_ms_p50: percentile(&v, 50.0),
            wait_ms_p99: percentile(&v, 99.0),
            wait_ms_max: v.last().copied().unwrap_or(0.0),
            live_mean: live.iter().sum::<f64>() / live.len().max(1) as f64,
            live_peak: live.iter().copied().fold(0.0, f64::max),
        }
    }
}

/// The picker's view of a run: set beside the engines' counters, it shows whether the picker
/// credited cache the engines did not have, and how often sessions overrode the policy.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PickerFigures {
    /// Prompt tokens the picker expected to be served from cache, over all prompt tokens it
    /// routed (`kvroute_picker_predicted_prefix_hit_tokens_total` / `..._prompt_tokens_total`).
    pub credited: Option<f64>,
    /// Share of decisions made by a session pin rather than by the policy.
    pub session_pinned: Option<f64>,
    pub decisions: f64,
    /// What the cost model learned per endpoint at the end of the run:
    /// `(endpoint, overhead ms per step, prefill ms per token, decode step ms)`.
    pub learned: Vec<(String, f64, f64, f64)>,
}

impl PickerFigures {
    /// The figures between two scrapes of the picker's `/metrics`.
    pub fn from_metrics(before: &str, after: &str) -> Self {
        use super::live::prom::counter_sum;
        let delta = |name: &str, with: &[(&str, &str)]| {
            (counter_sum(after, name, with) - counter_sum(before, name, with)).max(0.0)
        };
        let prompt = delta("kvroute_picker_prompt_tokens_total", &[]);
        let credited = delta("kvroute_picker_predicted_prefix_hit_tokens_total", &[]);
        let decisions = delta("kvroute_picker_decisions_total", &[]);
        let pinned = delta("kvroute_picker_decisions_total", &[("reason", "session")]);
        let gauge =
            |name: &str, endpoint: &str| counter_sum(after, name, &[("endpoint", endpoint)]);
        let learned = super::live::prom::label_values(
            after,
            "kvroute_picker_cost_model_prefill_ms_per_token",
            "endpoint",
        )
        .into_iter()
        .map(|e| {
            let row = (
                gauge("kvroute_picker_cost_model_overhead_ms", &e),
                gauge("kvroute_picker_cost_model_prefill_ms_per_token", &e),
                gauge("kvroute_picker_cost_model_decode_step_ms", &e),
            );
            (e, row.0, row.1, row.2)
        })
        .collect();
        Self {
            credited: (prompt > 0.0).then(|| credited / prompt),
            session_pinned: (decisions > 0.0).then(|| pinned / decisions),
            decisions,
            learned,
        }
    }
}

/// Nearest-rank percentile of sorted values (0 when empty).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

pub fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

/// Coefficient of variation (0 for fewer than two values or a zero mean).
pub fn coefficient_of_variation(values: &[f64]) -> f64 {
    if values.len() < 2 {
        return 0.0;
    }
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    if mean <= 0.0 {
        return 0.0;
    }
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
    var.sqrt() / mean
}

/// Figures measured outside the request records.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EngineFigures {
    /// Engine-reported cache hit rate; `None` = derive it from the records.
    pub hit_rate: Option<f64>,
    pub load_cv: f64,
    pub prefill_util: f64,
    pub decision_us_p99: Option<f64>,
}

/// Most error messages kept for display.
pub const MAX_ERROR_SAMPLES: usize = 5;

/// Summarize one policy's records.
pub fn summarize(
    policy: &str,
    records: &[RequestRecord],
    ceiling: f64,
    engines: EngineFigures,
    slo: Slo,
) -> (Summary, Vec<f64>, Vec<String>) {
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.error.is_none()).collect();
    let errors = records.len() - ok.len();
    let ttft = sorted(ok.iter().filter_map(|r| r.ttft_ms).collect());
    let e2e = sorted(ok.iter().filter_map(|r| r.e2e_ms).collect());
    let tpot = sorted(ok.iter().filter_map(|r| r.tpot_ms).collect());
    let start = records
        .iter()
        .map(|r| r.release_ms)
        .fold(f64::INFINITY, f64::min);
    let end = records
        .iter()
        .map(|r| r.end_ms)
        .fold(f64::NEG_INFINITY, f64::max);
    let span_s = if end > start {
        (end - start) / 1000.0
    } else {
        0.0
    };
    let out_tokens: u64 = ok.iter().map(|r| u64::from(r.output_tokens)).sum();
    let attained = ok.iter().filter(|r| slo.met(r)).count();
    let hit_rate = engines
        .hit_rate
        .unwrap_or_else(|| cached_fraction(ok.iter().copied()));
    let errors_seen: Vec<String> = records
        .iter()
        .filter_map(|r| r.error.clone())
        .take(MAX_ERROR_SAMPLES)
        .collect();
    let s = Summary {
        policy: policy.to_string(),
        requests: records.len() as u64,
        errors: errors as u64,
        hit_rate,
        hit_rate_ceiling: ceiling,
        ttft_ms_p50: percentile(&ttft, 50.0),
        ttft_ms_p90: percentile(&ttft, 90.0),
        ttft_ms_p99: percentile(&ttft, 99.0),
        e2e_ms_p50: percentile(&e2e, 50.0),
        e2e_ms_p99: percentile(&e2e, 99.0),
        tpot_ms_p50: percentile(&tpot, 50.0),
        tpot_ms_p90: percentile(&tpot, 90.0),
        output_tok_s: if span_s > 0.0 {
            out_tokens as f64 / span_s
        } else {
            0.0
        },
        slo_attainment: if records.is_empty() {
            0.0
        } else {
            attained as f64 / records.len() as f64
        },
        load_cv: engines.load_cv,
        prefill_util: engines.prefill_util,
        decision_us_p99: engines.decision_us_p99,
    };
    (s, ttft, errors_seen)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 100.0), 100.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }

    #[test]
    fn cv_of_equal_values_is_zero() {
        assert_eq!(coefficient_of_variation(&[3.0, 3.0, 3.0]), 0.0);
        assert!((coefficient_of_variation(&[1.0, 3.0]) - 0.5).abs() < 1e-12);
    }
}
