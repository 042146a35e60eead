//! The cost model's calibration per endpoint, learned online.
//!
//! The configured [`CostModelCalibration`] describes one kind of engine (by default an
//! 8B-class model on one H100-class GPU); the engines of a pool may be nothing like it (a CPU
//! vLLM prefills 20–50 times slower) nor like each other. This state machine learns, per
//! endpoint, the two constants of the prefill model and a scale of the decode step from what
//! is observed, with the configured values as the prior:
//!
//! - prefill of `T` tokens ≈ `overheadMs · steps(T) + msPerToken · tokens'(T)`, in the prior's
//!   own shape ([`prefill_regressors`]: `T` chunked by `maxBatchedTokens`, each chunk's
//!   quadratic term in units of its linear one), so that with the prior's constants it is the
//!   configured model exactly;
//! - decode step at KV usage `u` ≈ `decodeScale · decode_step(u)` of the configured curve.
//!
//! # Sources and what each weighs
//! - **The picker's own measurement** (weight 1 each): a streamed response's time from
//!   forwarding to its first chunk, against the work the router estimated at the pick
//!   ([`TtftBasis`]: queued plus uncached tokens), minus the decode time it estimated.
//! - **The engine's histograms**, taken as deltas between two scrapes: the mean prefill time
//!   per request (`request_prefill_time_seconds`, else TTFT minus queue time) against the mean
//!   uncached tokens per request, and the mean inter-token latency against the configured
//!   decode step at the scraped KV usage. An engine reports on itself, so what it says can be
//!   wrong in every scrape alike (a forged exporter, another notion of "prefill"): its reports
//!   are not independent evidence and must not pile up without bound. A scrape counts
//!   [`ENGINE_REQUEST_WEIGHT`] per request, for at most [`ENGINE_REQUESTS_PER_SCRAPE`]
//!   requests, and all of an engine's data together weigh at most [`ENGINE_PRIOR_MULTIPLE`]
//!   priors plus [`ENGINE_OWN_SHARE`] of the picker's own measurements: alone they move an
//!   estimate at most 80% of the way (by weight) from the prior to what they claim, and the
//!   picker's measurements soon outweigh them two to one. A counter that goes backwards is an
//!   engine restart: that scrape only sets a new baseline.
//!
//! # Estimator
//! Ridge regression on exponentially weighted sufficient statistics (a window of [`WINDOW`]
//! observations): the prior counts as [`PRIOR_WEIGHT`] observations of itself, so with few
//! observations the estimate is the prior, with many it is the data's. Each observation is
//! first winsorized in log space to within `3 ×` the source's running mean absolute log
//! residual of the current prediction (never more than [`CLIP_RATIO`]× off, never less than
//! 25%): an outlier (a stalled stream, a pause) moves the estimate little once the fit is
//! good, while a prior 50× off, or a real change, widens the band and is followed within a few
//! dozen observations (a Huber-type M-estimator with an online robust scale).
//!
//! # Bounds
//! A learned constant stays within `[reference / MAX_FASTER, reference × MAX_SLOWER]` of the
//! configured one (4× faster, 100× slower; a reference below 1 ms or 0.001 ms/token counts as
//! that), whatever the data: engines much slower than the GPU prior are real, much faster ones
//! are not. Values that are not finite, not positive, longer than an hour or larger than 16M
//! tokens are ignored.
//!
//! # Ageing
//! Besides the window in observations, everything learned ages in time: [`Calibration::age`]
//! halves every endpoint's statistics (and its count of recent observations, which sets how
//! far its own values stand from its pool's, see [`pooled`]) every [`HALF_LIFE_MS`]. An
//! endpoint priced high gets no traffic, so no new observation of its own would ever correct
//! a price that has outlived its cause (an engine's absurd histograms, a burst of stalls):
//! with nothing new, its values fall back to the pool's within a minute, and the traffic that
//! then comes measures it again. Data that is invalid (non-finite sums) does not stop the
//! ageing either.
//!
//! Without I/O or clocks: observations and the time go in, estimates come out. Memory is one entry per
//! endpoint of the pool ([`Calibration::set_pool`]); observations of other endpoints are
//! dropped.

use hashbrown::{HashMap, HashSet};
use serde::Serialize;

use crate::config::CostModelCalibration;
use crate::endpoint::EndpointId;
use crate::engine_metrics::{PerfCounters, SumCount};
use crate::policy::{decode_step_ms, prefill_regressors};

/// Observations the configured calibration counts as.
pub const PRIOR_WEIGHT: f64 = 4.0;
/// Observations after which an old one weighs `1/e` of a new one.
pub const WINDOW: f64 = 256.0;
/// An observation is winsorized to at most this factor from the current prediction.
pub const CLIP_RATIO: f64 = 4.0;
/// Narrowest winsorizing band, as a factor from the prediction.
const MIN_CLIP_RATIO: f64 = 1.25;
/// Band width in units of the running mean absolute log residual.
const CLIP_SPREADS: f64 = 3.0;
/// Step of the running mean absolute log residual.
const SPREAD_STEP: f64 = 1.0 / 32.0;
/// A learned constant is at most this many times the configured one...
pub const MAX_SLOWER: f64 = 100.0;
/// ... and at least the configured one divided by this.
pub const MAX_FASTER: f64 = 4.0;
/// Weight of one request's worth of an engine's self-reported data.
pub const ENGINE_REQUEST_WEIGHT: f64 = 0.25;
/// Requests one scrape may count for.
pub const ENGINE_REQUESTS_PER_SCRAPE: f64 = 32.0;
/// An engine's data weigh at most this many priors...
pub const ENGINE_PRIOR_MULTIPLE: f64 = 1.0;
/// ... plus this share of the picker's own measurements.
pub const ENGINE_OWN_SHARE: f64 = 0.5;
/// Every endpoint's statistics halve in this much time without new observations.
pub const HALF_LIFE_MS: f64 = 10_000.0;
/// Observed times beyond this (ms) are ignored.
pub const MAX_OBSERVED_MS: f64 = 3_600_000.0;
/// Observed token counts beyond this are ignored.
pub const MAX_OBSERVED_TOKENS: f64 = 16_777_216.0;
/// The prefill size the per-token prior is weighed at.
const REFERENCE_TOKENS: f64 = 1024.0;
/// Smallest references the bounds are taken from.
const MIN_REFERENCE_OVERHEAD_MS: f64 = 1.0;
const MIN_REFERENCE_MS_PER_TOKEN: f64 = 1e-3;

/// Where an observation came from (a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// This picker's own time-to-first-token measurement.
    PickerTtft,
    /// The engine's prefill time histogram (or TTFT minus queue time).
    EnginePrefill,
    /// The engine's inter-token latency histogram.
    EngineDecode,
}

impl Source {
    pub const ALL: [Source; 3] = [Self::PickerTtft, Self::EnginePrefill, Self::EngineDecode];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::PickerTtft => "picker_ttft",
            Self::EnginePrefill => "engine_prefill",
            Self::EngineDecode => "engine_decode",
        }
    }

    fn index(self) -> usize {
        match self {
            Self::PickerTtft => 0,
            Self::EnginePrefill => 1,
            Self::EngineDecode => 2,
        }
    }
}

/// What the router's TTFT estimate rested on at the pick: the regressors of one observation.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct TtftBasis {
    /// Prefill tokens up to the request's first token: queued ahead of it plus its uncached.
    pub work_tokens: f64,
    /// Decode time (ms) the estimate added for the engine's running requests.
    pub decode_ms: f64,
}

/// The cost model's constants learned for one endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LearnedCost {
    /// Fixed milliseconds per engine step of prefill (`prefillConstantMs`, learned).
    pub overhead_ms: f64,
    /// Milliseconds per prefilled token (`prefillLinearMs`, learned; the quadratic term
    /// scales with it).
    pub prefill_ms_per_token: f64,
    /// Decode step time relative to the configured curve (1 = as configured).
    pub decode_scale: f64,
    /// The learned decode step at an empty KV cache, in ms.
    pub decode_step_ms: f64,
    /// Observations behind these values, all sources.
    pub observations: u64,
    /// The same, aged in time ([`HALF_LIFE_MS`]); what [`pooled`] weighs an endpoint by.
    pub recent_observations: f64,
}

/// What became of one observation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Fed {
    /// Taken as it came.
    Learned,
    /// Taken, winsorized towards the current prediction.
    Clipped,
    /// Not finite, not positive, no work, or beyond the limits: ignored.
    Ignored,
}

/// What one scrape's counters fed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct ScrapeFed {
    /// `None` when there was nothing to learn from (first scrape, no finished requests, no
    /// prefill timing or token counts).
    pub prefill: Option<Fed>,
    pub decode: Option<Fed>,
    /// A counter went backwards (the engine restarted): the scrape only set a new baseline.
    pub counter_reset: bool,
}

/// Observation counts by source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct Observations {
    pub picker_ttft: u64,
    pub engine_prefill: u64,
    pub engine_decode: u64,
}

impl Observations {
    pub fn get(&self, source: Source) -> u64 {
        match source {
            Source::PickerTtft => self.picker_ttft,
            Source::EnginePrefill => self.engine_prefill,
            Source::EngineDecode => self.engine_decode,
        }
    }
}

/// One endpoint's calibration, for `/debug/endpoints` and the metrics.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CalibrationStatus {
    /// `None` until the first observation (the configured calibration applies).
    pub learned: Option<LearnedCost>,
    pub observations: Observations,
    /// Observations winsorized towards the prediction.
    pub clipped: u64,
    /// Observations ignored as invalid.
    pub ignored: u64,
    /// Scrapes whose counters went backwards.
    pub counter_resets: u64,
    /// Current (decayed) weights of the picker's and the engine's prefill data, and the
    /// factor the engine's is scaled by to respect its cap.
    pub picker_weight: f64,
    pub engine_weight: f64,
    pub engine_factor: f64,
}

/// Exponentially weighted sufficient statistics of a weighted least-squares fit `y ≈ θ·z`,
/// with the running mean absolute log residual that sets the winsorizing band.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Moments<const N: usize> {
    zz: [[f64; N]; N],
    zy: [f64; N],
    weight: f64,
    spread: f64,
}

impl<const N: usize> Default for Moments<N> {
    fn default() -> Self {
        Self {
            zz: [[0.0; N]; N],
            zy: [0.0; N],
            weight: 0.0,
            spread: CLIP_RATIO.ln() / CLIP_SPREADS,
        }
    }
}

impl<const N: usize> Moments<N> {
    /// Scale the statistics by `f` (ageing); the winsorizing band stays.
    fn scale(&mut self, f: f64) {
        for row in &mut self.zz {
            for v in row {
                *v *= f;
            }
        }
        for v in &mut self.zy {
            *v *= f;
        }
        self.weight *= f;
    }

    /// Winsorize `y` towards `predicted` (> 0), update the spread, and add the observation.
    fn add(&mut self, z: [f64; N], y: f64, predicted: f64, w: f64) -> Fed {
        let band = (CLIP_SPREADS * self.spread).clamp(MIN_CLIP_RATIO.ln(), CLIP_RATIO.ln());
        let residual = if y > 0.0 {
            (y / predicted).ln()
        } else {
            f64::NEG_INFINITY
        };
        let clipped = residual.clamp(-band, band);
        let fed = if clipped == residual {
            Fed::Learned
        } else {
            Fed::Clipped
        };
        let y = predicted * clipped.exp();
        self.spread += SPREAD_STEP * (clipped.abs() - self.spread);
        let keep = (1.0 - 1.0 / WINDOW).powf(w);
        for i in 0..N {
            for j in 0..N {
                self.zz[i][j] = self.zz[i][j] * keep + w * z[i] * z[j];
            }
            self.zy[i] = self.zy[i] * keep + w * z[i] * y;
        }
        self.weight = self.weight * keep + w;
        fed
    }
}

/// The factor that keeps data of total weight `weight` within `cap`.
fn capped(weight: f64, cap: f64) -> f64 {
    if weight > cap { cap / weight } else { 1.0 }
}

/// What the configured calibration implies for the fit, computed once per prior.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Reference {
    /// `tokens'` of a [`REFERENCE_TOKENS`]-token prefill: the per-token regressor is divided
    /// by it, so both parameters are in milliseconds and the ridge weighs them alike.
    tokens: f64,
    /// The prior in the fit's parameters: `[overhead, msPerToken × tokens]`.
    prior: [f64; 2],
    overhead: (f64, f64),
    per_token: (f64, f64),
    /// The configured decode step at an empty cache (ms, at least 1).
    decode_ms: f64,
}

fn bounds(reference: f64, floor: f64) -> (f64, f64) {
    let r = if reference.is_finite() {
        reference.max(floor)
    } else {
        floor
    };
    (r / MAX_FASTER, r * MAX_SLOWER)
}

impl Reference {
    fn of(cal: &CostModelCalibration) -> Self {
        let tokens = prefill_regressors(cal, REFERENCE_TOKENS)[1].max(1.0);
        Self {
            tokens,
            prior: [cal.prefill_constant_ms, cal.prefill_linear_ms * tokens],
            overhead: bounds(cal.prefill_constant_ms, MIN_REFERENCE_OVERHEAD_MS),
            per_token: bounds(cal.prefill_linear_ms, MIN_REFERENCE_MS_PER_TOKEN),
            decode_ms: decode_step_ms(cal, 0.0),
        }
    }

    /// Regressors of a `tokens`-token prefill in the fit's units; `None` for no work.
    fn regressors(&self, cal: &CostModelCalibration, tokens: f64) -> Option<[f64; 2]> {
        let [steps, equivalent] = prefill_regressors(cal, tokens);
        (steps >= 1.0).then(|| [steps, equivalent / self.tokens])
    }
}

#[derive(Debug, Clone, Default)]
struct EndpointState {
    own: Moments<2>,
    engine: Moments<2>,
    decode: Moments<1>,
    /// The last scrape's counters, which the next scrape's are compared with.
    baseline: Option<PerfCounters>,
    observations: [u64; 3],
    /// Observations counted, aged like the statistics.
    recent: f64,
    /// When the statistics were last aged (ms on the caller's clock).
    aged_at_ms: Option<u64>,
    clipped: u64,
    ignored: u64,
    counter_resets: u64,
    learned: Option<LearnedCost>,
}

impl EndpointState {
    fn engine_factor(&self) -> f64 {
        capped(
            self.engine.weight,
            ENGINE_PRIOR_MULTIPLE * PRIOR_WEIGHT + ENGINE_OWN_SHARE * self.own.weight,
        )
    }

    fn count(&mut self, source: Source, fed: Fed) -> Fed {
        match fed {
            Fed::Ignored => self.ignored += 1,
            Fed::Clipped => {
                self.clipped += 1;
                self.observations[source.index()] += 1;
                self.recent += 1.0;
            }
            Fed::Learned => {
                self.observations[source.index()] += 1;
                self.recent += 1.0;
            }
        }
        fed
    }

    /// Age the statistics to `now_ms`; `true` when they changed.
    fn age(&mut self, now_ms: u64) -> bool {
        let from = self
            .aged_at_ms
            .replace(now_ms.max(self.aged_at_ms.unwrap_or(0)));
        let Some(from) = from.filter(|&f| now_ms > f) else {
            return false;
        };
        let f = 0.5f64.powf((now_ms - from) as f64 / HALF_LIFE_MS);
        self.own.scale(f);
        self.engine.scale(f);
        self.decode.scale(f);
        self.recent *= f;
        true
    }
}

/// Per-endpoint calibration of the cost model. See the module documentation.
#[derive(Debug, Clone)]
pub struct Calibration {
    prior: CostModelCalibration,
    reference: Reference,
    endpoints: HashMap<EndpointId, EndpointState>,
}

impl Default for Calibration {
    fn default() -> Self {
        Self::new(CostModelCalibration::default())
    }
}

/// Whether two calibrations describe the same model (the fields the fit depends on).
fn same_model(a: &CostModelCalibration, b: &CostModelCalibration) -> bool {
    a.prefill_quadratic_ms == b.prefill_quadratic_ms
        && a.prefill_linear_ms == b.prefill_linear_ms
        && a.prefill_constant_ms == b.prefill_constant_ms
        && a.decode_base_ms == b.decode_base_ms
        && a.decode_linear_ms == b.decode_linear_ms
        && a.decode_quadratic_ms == b.decode_quadratic_ms
        && a.max_batched_tokens == b.max_batched_tokens
}

fn valid(v: f64, max: f64) -> bool {
    v.is_finite() && v > 0.0 && v <= max
}

/// A counter delta, or `Err` when the counter went backwards.
fn delta(now: Option<f64>, before: Option<f64>) -> Result<Option<f64>, ()> {
    match (now, before) {
        (Some(n), Some(b)) if n < b => Err(()),
        (Some(n), Some(b)) => Ok(Some(n - b)),
        _ => Ok(None),
    }
}

fn delta_pair(now: Option<SumCount>, before: Option<SumCount>) -> Result<Option<SumCount>, ()> {
    let (Some(n), Some(b)) = (now, before) else {
        return Ok(None);
    };
    match (
        delta(Some(n.sum), Some(b.sum))?,
        delta(Some(n.count), Some(b.count))?,
    ) {
        (Some(sum), Some(count)) => Ok(Some(SumCount { sum, count })),
        _ => Ok(None),
    }
}

/// The per-scrape deltas the engine observations are made of.
struct Deltas {
    prefill_time: Option<SumCount>,
    ttft: Option<SumCount>,
    queue_time: Option<SumCount>,
    prefill_tokens: Option<SumCount>,
    inter_token_latency: Option<SumCount>,
    prompt_tokens: Option<f64>,
    cached_tokens: Option<f64>,
}

impl Deltas {
    fn between(now: &PerfCounters, before: &PerfCounters) -> Result<Self, ()> {
        Ok(Self {
            prefill_time: delta_pair(now.prefill_time, before.prefill_time)?,
            ttft: delta_pair(now.ttft, before.ttft)?,
            queue_time: delta_pair(now.queue_time, before.queue_time)?,
            prefill_tokens: delta_pair(now.prefill_tokens, before.prefill_tokens)?,
            inter_token_latency: delta_pair(now.inter_token_latency, before.inter_token_latency)?,
            prompt_tokens: delta(now.prompt_tokens, before.prompt_tokens)?,
            cached_tokens: delta(now.cached_tokens, before.cached_tokens)?,
        })
    }

    /// Requests that reached their first token, and their mean prefill time in ms.
    fn prefill(&self) -> Option<(f64, f64)> {
        if let Some(p) = self.prefill_time.filter(|p| p.count >= 1.0) {
            return Some((p.count, p.sum / p.count * 1000.0));
        }
        let t = self.ttft.filter(|t| t.count >= 1.0)?;
        let q = self.queue_time.filter(|q| q.count >= 1.0)?;
        Some((t.count, (t.sum / t.count - q.sum / q.count) * 1000.0))
    }

    /// Mean uncached prompt tokens per request of `requests`.
    fn tokens_per_request(&self, requests: f64) -> Option<f64> {
        if let Some(p) = self.prefill_tokens.filter(|p| p.count >= 1.0) {
            return Some(p.sum / p.count);
        }
        Some((self.prompt_tokens? - self.cached_tokens?) / requests)
    }
}

fn counters_valid(c: &PerfCounters) -> bool {
    let ok = |v: f64| v.is_finite() && v >= 0.0;
    let pair = |p: Option<SumCount>| p.is_none_or(|p| ok(p.sum) && ok(p.count));
    pair(c.prefill_time)
        && pair(c.ttft)
        && pair(c.queue_time)
        && pair(c.prefill_tokens)
        && pair(c.inter_token_latency)
        && c.prompt_tokens.is_none_or(ok)
        && c.cached_tokens.is_none_or(ok)
}

impl Calibration {
    pub fn new(prior: CostModelCalibration) -> Self {
        Self {
            reference: Reference::of(&prior),
            prior,
            endpoints: HashMap::new(),
        }
    }

    pub fn prior(&self) -> &CostModelCalibration {
        &self.prior
    }

    /// Use a new configured calibration. When it describes another model the statistics,
    /// gathered in the old one's terms, are dropped and learning starts again from the new
    /// prior (returns `true`); scrape baselines are kept.
    pub fn set_prior(&mut self, prior: CostModelCalibration) -> bool {
        let changed = !same_model(&self.prior, &prior);
        self.prior = prior;
        if changed {
            self.reference = Reference::of(&prior);
            self.reset();
        }
        changed
    }

    /// Forget everything learned (scrape baselines are kept).
    pub fn reset(&mut self) {
        for s in self.endpoints.values_mut() {
            *s = EndpointState {
                baseline: s.baseline,
                ..EndpointState::default()
            };
        }
    }

    /// Follow the endpoint set: endpoints not yet known get an empty entry, departed ones are
    /// forgotten and returned (sorted).
    pub fn set_pool(&mut self, ids: impl IntoIterator<Item = EndpointId>) -> Vec<EndpointId> {
        let keep: HashSet<EndpointId> = ids.into_iter().collect();
        let mut departed: Vec<EndpointId> = self
            .endpoints
            .keys()
            .filter(|id| !keep.contains(*id))
            .copied()
            .collect();
        departed.sort_unstable();
        for id in &departed {
            self.endpoints.remove(id);
        }
        for id in keep {
            self.endpoints.entry(id).or_default();
        }
        departed
    }

    /// Endpoints with an entry.
    pub fn len(&self) -> usize {
        self.endpoints.len()
    }

    pub fn is_empty(&self) -> bool {
        self.endpoints.is_empty()
    }

    /// What the cost model should use for `id`; `None` before any observation of it (the
    /// configured calibration applies).
    pub fn learned(&self, id: &EndpointId) -> Option<LearnedCost> {
        self.endpoints.get(id).and_then(|s| s.learned)
    }

    pub fn status(&self, id: &EndpointId) -> Option<CalibrationStatus> {
        self.endpoints.get(id).map(|s| CalibrationStatus {
            learned: s.learned,
            observations: Observations {
                picker_ttft: s.observations[0],
                engine_prefill: s.observations[1],
                engine_decode: s.observations[2],
            },
            clipped: s.clipped,
            ignored: s.ignored,
            counter_resets: s.counter_resets,
            picker_weight: s.own.weight,
            engine_weight: s.engine.weight,
            engine_factor: s.engine_factor(),
        })
    }

    /// Age every endpoint's statistics to `now_ms` (see the module docs) and estimate again.
    /// The service calls it on every scrape.
    pub fn age(&mut self, now_ms: u64) {
        let reference = self.reference;
        for state in self.endpoints.values_mut() {
            if state.age(now_ms) {
                state.learned = estimate(&reference, state);
            }
        }
    }

    /// [`Calibration::age`] for `id` alone: before an observation of it.
    pub fn age_endpoint(&mut self, id: &EndpointId, now_ms: u64) {
        let reference = self.reference;
        if let Some(state) = self.endpoints.get_mut(id)
            && state.age(now_ms)
        {
            state.learned = estimate(&reference, state);
        }
    }

    /// Every endpoint's status, in no particular order.
    pub fn statuses(&self) -> impl Iterator<Item = (EndpointId, CalibrationStatus)> + '_ {
        self.endpoints
            .keys()
            .filter_map(|id| Some((*id, self.status(id)?)))
    }

    /// The first token of a streamed response routed to `id` with `basis` arrived `ttft_ms`
    /// after it was forwarded. `None` when `id` is not in the pool.
    pub fn observe_ttft(&mut self, id: &EndpointId, basis: TtftBasis, ttft_ms: f64) -> Option<Fed> {
        let (prior, reference) = (self.prior, self.reference);
        let state = self.endpoints.get_mut(id)?;
        let regressors = valid(basis.work_tokens, MAX_OBSERVED_TOKENS)
            .then(|| reference.regressors(&prior, basis.work_tokens))
            .flatten();
        let decode_ok = basis.decode_ms.is_finite() && basis.decode_ms >= 0.0;
        let fed = match regressors {
            Some(z) if decode_ok && valid(ttft_ms, MAX_OBSERVED_MS) => {
                let predicted = predict(&reference, state.learned.as_ref(), z);
                state.own.add(z, ttft_ms - basis.decode_ms, predicted, 1.0)
            }
            _ => Fed::Ignored,
        };
        let fed = state.count(Source::PickerTtft, fed);
        state.learned = estimate(&reference, state);
        Some(fed)
    }

    /// One scrape of `id`'s engine counters, with the KV usage it reported. `None` when `id`
    /// is not in the pool.
    pub fn observe_engine(
        &mut self,
        id: &EndpointId,
        counters: &PerfCounters,
        kv_usage: f64,
    ) -> Option<ScrapeFed> {
        let (prior, reference) = (self.prior, self.reference);
        let state = self.endpoints.get_mut(id)?;
        let mut fed = ScrapeFed::default();
        if !counters_valid(counters) || !kv_usage.is_finite() {
            // the baseline stays: the next good scrape is compared with the last good one
            fed.prefill = Some(state.count(Source::EnginePrefill, Fed::Ignored));
            return Some(fed);
        }
        let Some(before) = state.baseline.replace(*counters) else {
            return Some(fed);
        };
        let Ok(d) = Deltas::between(counters, &before) else {
            state.counter_resets += 1;
            fed.counter_reset = true;
            return Some(fed);
        };
        if let Some((requests, mean_ms)) = d.prefill() {
            let z = d
                .tokens_per_request(requests)
                .filter(|t| valid(*t, MAX_OBSERVED_TOKENS))
                .and_then(|t| reference.regressors(&prior, t));
            let outcome = match z {
                Some(z) if valid(mean_ms, MAX_OBSERVED_MS) => {
                    let predicted = predict(&reference, state.learned.as_ref(), z);
                    let w = ENGINE_REQUEST_WEIGHT * requests.min(ENGINE_REQUESTS_PER_SCRAPE);
                    state.engine.add(z, mean_ms, predicted, w)
                }
                _ => Fed::Ignored,
            };
            fed.prefill = Some(state.count(Source::EnginePrefill, outcome));
        }
        if let Some(itl) = d.inter_token_latency.filter(|i| i.count >= 1.0) {
            let mean_ms = itl.sum / itl.count * 1000.0;
            let z = decode_step_ms(&prior, kv_usage) / reference.decode_ms;
            let outcome = if valid(mean_ms, MAX_OBSERVED_MS) {
                let scale = state.learned.map_or(1.0, |l| l.decode_scale);
                let w = ENGINE_REQUEST_WEIGHT * itl.count.min(ENGINE_REQUESTS_PER_SCRAPE);
                state
                    .decode
                    .add([z], mean_ms / reference.decode_ms, scale * z, w)
            } else {
                Fed::Ignored
            };
            fed.decode = Some(state.count(Source::EngineDecode, outcome));
        }
        state.learned = estimate(&reference, state);
        Some(fed)
    }
}

/// The prefill time (ms) the current estimate predicts for regressors `z` (> 0).
fn predict(reference: &Reference, learned: Option<&LearnedCost>, z: [f64; 2]) -> f64 {
    let (overhead, per_token) = learned.map_or(
        (reference.prior[0], reference.prior[1] / reference.tokens),
        |l| (l.overhead_ms, l.prefill_ms_per_token),
    );
    let overhead = overhead.clamp(reference.overhead.0, reference.overhead.1);
    let per_token = per_token.clamp(reference.per_token.0, reference.per_token.1);
    overhead * z[0] + per_token * reference.tokens * z[1]
}

/// `value` within `bounds`, or `fallback` within them when `value` is not a number.
fn bounded(value: f64, fallback: f64, (lo, hi): (f64, f64)) -> f64 {
    let v = if value.is_finite() { value } else { fallback };
    v.clamp(lo, hi)
}

/// Ridge estimate of one endpoint's constants; `None` before any observation.
fn estimate(reference: &Reference, s: &EndpointState) -> Option<LearnedCost> {
    let observations: u64 = s.observations.iter().sum();
    if observations == 0 {
        return None;
    }
    let f = s.engine_factor();
    let mut a = [[PRIOR_WEIGHT, 0.0], [0.0, PRIOR_WEIGHT]];
    let mut c = [
        PRIOR_WEIGHT * reference.prior[0],
        PRIOR_WEIGHT * reference.prior[1],
    ];
    for (m, w) in [(&s.own, 1.0), (&s.engine, f)] {
        for ((row, zz), (ci, zy)) in a.iter_mut().zip(&m.zz).zip(c.iter_mut().zip(&m.zy)) {
            row[0] += w * zz[0];
            row[1] += w * zz[1];
            *ci += w * zy;
        }
    }
    let det = a[0][0] * a[1][1] - a[0][1] * a[1][0];
    let (overhead, scaled) = if det.is_finite() && det > 0.0 {
        (
            (a[1][1] * c[0] - a[0][1] * c[1]) / det,
            (a[0][0] * c[1] - a[1][0] * c[0]) / det,
        )
    } else {
        (reference.prior[0], reference.prior[1])
    };
    let fd = capped(s.decode.weight, ENGINE_PRIOR_MULTIPLE * PRIOR_WEIGHT);
    let scale = (PRIOR_WEIGHT + fd * s.decode.zy[0]) / (PRIOR_WEIGHT + fd * s.decode.zz[0][0]);
    let decode_scale = bounded(scale, 1.0, (1.0 / MAX_FASTER, MAX_SLOWER));
    Some(LearnedCost {
        overhead_ms: bounded(overhead, reference.prior[0], reference.overhead),
        prefill_ms_per_token: bounded(
            scaled / reference.tokens,
            reference.prior[1] / reference.tokens,
            reference.per_token,
        ),
        decode_scale,
        decode_step_ms: decode_scale * reference.decode_ms,
        observations,
        recent_observations: s.recent,
    })
}

/// Observations at which an endpoint's own values weigh as much as its pool's.
pub const POOL_SHRINK_OBSERVATIONS: f64 = 32.0;
/// An endpoint's values stay within this factor of its pool's.
pub const POOL_MAX_RATIO: f64 = 2.0;
/// An endpoint whose prefill prediction (at the pool's balance point) and decode scale are
/// both closer than this factor to its pool's is priced with the pool's values.
pub const POOL_SAME_RATIO: f64 = 1.1;

/// The values the cost model prices each candidate with: the pool's fit (the observation-
/// weighted geometric mean over the candidates that learned something), which an endpoint
/// without observations inherits, and each endpoint's own values shrunk towards it (its own
/// weigh `n / (n + POOL_SHRINK_OBSERVATIONS)` after `n` recent observations, aged in time:
/// an endpoint that stopped being observed falls back to its pool) and kept within
/// [`POOL_MAX_RATIO`] of it. Endpoints of one model config are usually alike, and two free
/// constants per endpoint are poorly determined outside the work sizes observed; priced
/// alone, an endpoint learned slow is avoided and never corrected, and a new one at the
/// configured (GPU) prior looks faster than every calibrated peer and takes all the traffic.
/// An inherited entry reports 0 observations. No candidate learned anything: unchanged.
pub fn pooled(learned: &[Option<LearnedCost>]) -> Vec<Option<LearnedCost>> {
    // what counts towards the pool and keeps values of its own
    let usable = |l: &LearnedCost| {
        l.recent_observations > 0.0
            && l.overhead_ms > 0.0
            && l.prefill_ms_per_token > 0.0
            && l.decode_scale > 0.0
    };
    let (mut w, mut lo, mut lp, mut ld) = (0.0, 0.0, 0.0, 0.0);
    for l in learned.iter().flatten().filter(|l| usable(l)) {
        let n = l.recent_observations;
        w += n;
        lo += n * l.overhead_ms.ln();
        lp += n * l.prefill_ms_per_token.ln();
        ld += n * l.decode_scale.ln();
    }
    if w <= 0.0 {
        return learned.to_vec();
    }
    let (po, pp, pd) = (lo / w, lp / w, ld / w);
    let bound = POOL_MAX_RATIO.ln();
    // the endpoint's own value is held within the bound before it is weighed, so that a
    // far outlier with few recent observations moves its price only a little
    let mix = |own: f64, pool: f64, a: f64| {
        (a * own.ln().clamp(pool - bound, pool + bound) + (1.0 - a) * pool).exp()
    };
    // Within the estimator's noise of the pool is the pool: alike endpoints tie exactly, so
    // the tie-break still spreads their requests. The two prefill constants are compared
    // through what they predict where the pool's steps cost as much in overhead as in tokens
    // (`overhead / ms per token` tokens), the direction the data determines: identical
    // engines learn pairs like 83 ms + 0.061 ms/token and 57 ms + 0.075 (1.5x apart in each
    // constant) that predict the same step within 10%.
    let (pool_overhead, pool_per_token, pool_decode) = (po.exp(), pp.exp(), pd.exp());
    let balance_tokens = pool_overhead / pool_per_token;
    let same = |overhead: f64, per_token: f64, decode: f64| {
        let own = overhead + per_token * balance_tokens;
        let pool = 2.0 * pool_overhead;
        (own / pool).ln().abs() < POOL_SAME_RATIO.ln()
            && (decode / pool_decode).ln().abs() < POOL_SAME_RATIO.ln()
    };
    learned
        .iter()
        .map(|l| match l {
            Some(l) if usable(l) => {
                let n = l.recent_observations;
                let a = n / (n + POOL_SHRINK_OBSERVATIONS);
                let (mut overhead_ms, mut prefill_ms_per_token, mut decode_scale) = (
                    mix(l.overhead_ms, po, a),
                    mix(l.prefill_ms_per_token, pp, a),
                    mix(l.decode_scale, pd, a),
                );
                if same(overhead_ms, prefill_ms_per_token, decode_scale) {
                    (overhead_ms, prefill_ms_per_token, decode_scale) =
                        (pool_overhead, pool_per_token, pool_decode);
                }
                Some(LearnedCost {
                    overhead_ms,
                    prefill_ms_per_token,
                    decode_step_ms: l.decode_step_ms / l.decode_scale * decode_scale,
                    decode_scale,
                    observations: l.observations,
                    recent_observations: l.recent_observations,
                })
            }
            other => {
                let base = other.or_else(|| learned.iter().flatten().next().copied())?;
                let decode_scale = pool_decode;
                Some(LearnedCost {
                    overhead_ms: pool_overhead,
                    prefill_ms_per_token: pool_per_token,
                    decode_step_ms: base.decode_step_ms / base.decode_scale.max(f64::MIN_POSITIVE)
                        * decode_scale,
                    decode_scale,
                    observations: 0,
                    recent_observations: 0.0,
                })
            }
        })
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::policy::prefill_ms;
    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use std::net::{IpAddr, Ipv4Addr};

    fn ep(n: u8) -> EndpointId {
        EndpointId::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, n)), 8000, 0)
    }

    fn with_pool(n: u8) -> Calibration {
        let mut c = Calibration::default();
        c.set_pool((1..=n).map(ep));
        c
    }

    fn basis(work_tokens: f64) -> TtftBasis {
        TtftBasis {
            work_tokens,
            decode_ms: 0.0,
        }
    }

    /// A linear truth in the model's own shape.
    fn truth(overhead: f64, per_token: f64, tokens: f64) -> f64 {
        let [steps, equivalent] = prefill_regressors(&CostModelCalibration::default(), tokens);
        overhead * steps + per_token * equivalent
    }

    fn rel(a: f64, b: f64) -> f64 {
        (a - b).abs() / b.abs()
    }

    /// A scrape of a vLLM with `requests` finished requests so far, each of `tokens` uncached
    /// tokens and `prefill_ms` of prefill, and `itl_ms` per output token (10 per request).
    fn scrape(requests: f64, tokens: f64, prefill_ms: f64, itl_ms: f64) -> PerfCounters {
        PerfCounters {
            prefill_time: Some(SumCount {
                sum: requests * prefill_ms / 1000.0,
                count: requests,
            }),
            prefill_tokens: Some(SumCount {
                sum: requests * tokens,
                count: requests,
            }),
            inter_token_latency: Some(SumCount {
                sum: requests * 10.0 * itl_ms / 1000.0,
                count: requests * 10.0,
            }),
            ..PerfCounters::default()
        }
    }

    #[test]
    fn without_observations_the_prior_applies() {
        let mut c = with_pool(2);
        assert_eq!(c.learned(&ep(1)), None);
        let s = c.status(&ep(1)).unwrap();
        assert_eq!(s.observations, Observations::default());
        // an observation that agrees with the prior leaves the estimate at the prior
        let cal = CostModelCalibration::default();
        for tokens in [100.0, 1000.0, 5000.0, 20_000.0] {
            let fed = c.observe_ttft(&ep(1), basis(tokens), prefill_ms(&cal, tokens));
            assert_eq!(fed, Some(Fed::Learned));
        }
        let l = c.learned(&ep(1)).unwrap();
        assert!(rel(l.overhead_ms, cal.prefill_constant_ms) < 1e-9, "{l:?}");
        assert!(rel(l.prefill_ms_per_token, cal.prefill_linear_ms) < 1e-9);
        assert_eq!((l.decode_scale, l.observations), (1.0, 4));
        assert_eq!(c.learned(&ep(2)), None, "per endpoint");
    }

    #[test]
    fn converges_to_a_linear_truth_from_noisy_observations_with_outliers() {
        // a CPU engine: 15x the prior's overhead, 40x its cost per token
        let (overhead, per_token) = (250.0, 0.6);
        let mut c = with_pool(1);
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for i in 0..3000 {
            let tokens = rng.random_range(64.0..4000.0);
            let noise = rng.random_range(0.9..1.1);
            // one in twenty is a stall of ten times the truth
            let stall = if i % 20 == 7 { 10.0 } else { 1.0 };
            let y = truth(overhead, per_token, tokens) * noise * stall;
            c.observe_ttft(&ep(1), basis(tokens), y).unwrap();
        }
        let l = c.learned(&ep(1)).unwrap();
        assert!(rel(l.overhead_ms, overhead) < 0.1, "{l:?}");
        assert!(rel(l.prefill_ms_per_token, per_token) < 0.1, "{l:?}");
        let s = c.status(&ep(1)).unwrap();
        assert!(s.clipped >= 150, "the stalls were clipped: {s:?}");
    }

    #[test]
    fn decode_interference_estimated_at_the_pick_is_taken_out() {
        let mut c = with_pool(1);
        for i in 0..400 {
            let tokens = 500.0 + f64::from(i % 40) * 100.0;
            let decode_ms = f64::from(i % 3) * 40.0;
            let b = TtftBasis {
                work_tokens: tokens,
                decode_ms,
            };
            c.observe_ttft(&ep(1), b, truth(100.0, 0.2, tokens) + decode_ms);
        }
        let l = c.learned(&ep(1)).unwrap();
        assert!(rel(l.overhead_ms, 100.0) < 0.05, "{l:?}");
        assert!(rel(l.prefill_ms_per_token, 0.2) < 0.05, "{l:?}");
    }

    #[test]
    fn engine_reports_move_the_estimate_less_than_the_pickers_own() {
        let cal = CostModelCalibration::default();
        let (overhead, per_token) = (300.0, 0.5);
        let mut c = with_pool(2);
        // the engine's cumulative histograms, one request per scrape
        let mut cumulative = scrape(0.0, 0.0, 0.0, 0.0);
        c.observe_engine(&ep(2), &cumulative, 0.0);
        for i in 0..600 {
            let tokens = 200.0 + f64::from(i % 30) * 150.0;
            let y = truth(overhead, per_token, tokens);
            c.observe_ttft(&ep(1), basis(tokens), y);
            // the same numbers, as the engine's histograms
            for (pair, v) in [
                (&mut cumulative.prefill_time, y / 1000.0),
                (&mut cumulative.prefill_tokens, tokens),
            ] {
                let p = pair.as_mut().unwrap();
                p.sum += v;
                p.count += 1.0;
            }
            let fed = c.observe_engine(&ep(2), &cumulative, 0.0).unwrap();
            assert!(fed.prefill.is_some() && !fed.counter_reset, "{fed:?}");
        }
        let own = c.learned(&ep(1)).unwrap();
        let engine = c.learned(&ep(2)).unwrap();
        assert!(rel(own.prefill_ms_per_token, per_token) < 0.05, "{own:?}");
        assert!(rel(own.overhead_ms, overhead) < 0.05, "{own:?}");
        // the engine's data alone weigh as much as the prior: part of the way, not all of it
        let moved = |l: &LearnedCost| learned_ms(&cal, l, 2000.0) - prefill_ms(&cal, 2000.0);
        assert!(moved(&engine) > 0.3 * moved(&own), "{engine:?}");
        assert!(moved(&engine) < 0.9 * moved(&own), "{engine:?} vs {own:?}");
        let s = c.status(&ep(2)).unwrap();
        assert!(s.engine_factor < 0.1, "{s:?}");
        assert_eq!(s.observations.engine_prefill, 600);
    }

    #[test]
    fn the_inter_token_latency_scales_the_decode_step() {
        let cal = CostModelCalibration::default();
        let mut c = with_pool(1);
        let mut requests = 0.0;
        for _ in 0..200 {
            requests += 4.0;
            // 6x the configured step at 50% KV usage
            let itl = 6.0 * decode_step_ms(&cal, 0.5);
            c.observe_engine(&ep(1), &scrape(requests, 1000.0, 400.0, itl), 0.5);
        }
        let l = c.learned(&ep(1)).unwrap();
        // the engine's weight is capped: most of the way from 1 to 6, not all of it
        assert!(l.decode_scale > 4.5 && l.decode_scale < 6.0, "{l:?}");
        assert!(rel(l.decode_step_ms, l.decode_scale * decode_step_ms(&cal, 0.0)) < 1e-9);
    }

    #[test]
    fn counter_resets_only_set_a_new_baseline() {
        let mut c = with_pool(1);
        let first = c.observe_engine(&ep(1), &scrape(10.0, 1000.0, 500.0, 40.0), 0.2);
        assert_eq!(
            first,
            Some(ScrapeFed::default()),
            "the first scrape is a baseline"
        );
        let next = c
            .observe_engine(&ep(1), &scrape(20.0, 1000.0, 500.0, 40.0), 0.2)
            .unwrap();
        assert!(next.prefill.is_some() && next.decode.is_some(), "{next:?}");
        let learned = c.learned(&ep(1));
        // the engine restarted: its counters start again from zero
        let reset = c
            .observe_engine(&ep(1), &scrape(3.0, 1000.0, 500.0, 40.0), 0.2)
            .unwrap();
        assert_eq!(
            reset,
            ScrapeFed {
                counter_reset: true,
                ..ScrapeFed::default()
            }
        );
        assert_eq!(c.learned(&ep(1)), learned, "nothing learned from the reset");
        let after = c
            .observe_engine(&ep(1), &scrape(5.0, 1000.0, 500.0, 40.0), 0.2)
            .unwrap();
        assert!(after.prefill.is_some(), "deltas from the new baseline");
        // no new requests: nothing to learn
        let idle = c
            .observe_engine(&ep(1), &scrape(5.0, 1000.0, 500.0, 40.0), 0.2)
            .unwrap();
        assert_eq!(idle, ScrapeFed::default());
        let s = c.status(&ep(1)).unwrap();
        assert_eq!((s.counter_resets, s.observations.engine_prefill), (1, 2));
    }

    #[test]
    fn engines_without_prefill_timing_teach_nothing_about_prefill() {
        let mut c = with_pool(1);
        let ttft_only = |n: f64| PerfCounters {
            ttft: Some(SumCount {
                sum: n * 0.5,
                count: n,
            }),
            prompt_tokens: Some(n * 1000.0),
            cached_tokens: Some(0.0),
            ..PerfCounters::default()
        };
        c.observe_engine(&ep(1), &ttft_only(1.0), 0.0);
        let fed = c.observe_engine(&ep(1), &ttft_only(9.0), 0.0).unwrap();
        assert_eq!(fed, ScrapeFed::default());
        // with queue time, TTFT minus queue time is the prefill; tokens from the counters
        let with_queue = |n: f64| PerfCounters {
            queue_time: Some(SumCount {
                sum: n * 0.1,
                count: n,
            }),
            ..ttft_only(n)
        };
        c.observe_engine(&ep(1), &with_queue(10.0), 0.0);
        let fed = c.observe_engine(&ep(1), &with_queue(20.0), 0.0).unwrap();
        assert!(fed.prefill.is_some(), "{fed:?}");
    }

    #[test]
    fn departed_endpoints_are_forgotten_and_unknown_ones_not_learned() {
        let mut c = with_pool(3);
        for n in 1..=3 {
            c.observe_ttft(&ep(n), basis(1000.0), 500.0).unwrap();
        }
        assert_eq!(c.set_pool([ep(2)]), vec![ep(1), ep(3)]);
        assert_eq!(c.len(), 1);
        assert_eq!(c.observe_ttft(&ep(1), basis(1000.0), 500.0), None);
        assert_eq!(
            c.observe_engine(&ep(3), &PerfCounters::default(), 0.0),
            None
        );
        assert_eq!(c.len(), 1, "late observations do not bring them back");
        assert!(c.learned(&ep(2)).is_some());
        // rejoining starts from the prior
        c.set_pool([ep(1), ep(2)]);
        assert_eq!(c.learned(&ep(1)), None);
    }

    #[test]
    fn a_new_prior_restarts_learning() {
        let mut c = with_pool(1);
        c.observe_ttft(&ep(1), basis(1000.0), 500.0);
        let mut cal = CostModelCalibration {
            recompute_weight: 2.0,
            ..CostModelCalibration::default()
        };
        assert!(!c.set_prior(cal), "the model is the same");
        assert!(c.learned(&ep(1)).is_some());
        cal.prefill_linear_ms = 0.05;
        assert!(c.set_prior(cal));
        assert_eq!(c.learned(&ep(1)), None);
    }

    #[test]
    fn absurd_values_are_ignored() {
        let mut c = with_pool(1);
        for v in [f64::NAN, f64::INFINITY, -5.0, 0.0, 1e12] {
            assert_eq!(c.observe_ttft(&ep(1), basis(1000.0), v), Some(Fed::Ignored));
            assert_eq!(c.observe_ttft(&ep(1), basis(v), 100.0), Some(Fed::Ignored));
        }
        let nan = TtftBasis {
            work_tokens: 100.0,
            decode_ms: f64::NAN,
        };
        assert_eq!(c.observe_ttft(&ep(1), nan, 100.0), Some(Fed::Ignored));
        let bad = PerfCounters {
            ttft: Some(SumCount {
                sum: f64::NAN,
                count: 1.0,
            }),
            ..PerfCounters::default()
        };
        let fed = c.observe_engine(&ep(1), &bad, 0.0).unwrap();
        assert_eq!(fed.prefill, Some(Fed::Ignored));
        assert_eq!(c.learned(&ep(1)), None, "ignored values teach nothing");
        assert_eq!(c.status(&ep(1)).unwrap().ignored, 12);
    }

    fn within_bounds(c: &Calibration, id: &EndpointId) -> Result<(), String> {
        let Some(l) = c.learned(id) else {
            return Ok(());
        };
        let cal = c.prior();
        let (lo, hi) = bounds(cal.prefill_constant_ms, MIN_REFERENCE_OVERHEAD_MS);
        let (plo, phi) = bounds(cal.prefill_linear_ms, MIN_REFERENCE_MS_PER_TOKEN);
        let ok = (lo..=hi).contains(&l.overhead_ms)
            && (plo..=phi).contains(&l.prefill_ms_per_token)
            && (1.0 / MAX_FASTER..=MAX_SLOWER).contains(&l.decode_scale)
            && l.decode_step_ms.is_finite();
        if ok { Ok(()) } else { Err(format!("{l:?}")) }
    }

    #[test]
    fn a_hostile_stream_stops_at_the_bounds() {
        let cal = CostModelCalibration::default();
        let mut c = with_pool(2);
        let mut requests = 0.0;
        for _ in 0..2000 {
            c.observe_ttft(&ep(1), basis(1000.0), MAX_OBSERVED_MS);
            requests += 32.0;
            c.observe_engine(&ep(2), &scrape(requests, 1.0, 1e-6, 1e-6), 1.0);
        }
        let slow = c.learned(&ep(1)).unwrap();
        assert_eq!(slow.overhead_ms, cal.prefill_constant_ms * MAX_SLOWER);
        assert_eq!(
            slow.prefill_ms_per_token,
            cal.prefill_linear_ms * MAX_SLOWER
        );
        // an engine claiming to be infinitely fast gets at most 4x faster than the prior
        let fast = c.learned(&ep(2)).unwrap();
        assert!(
            fast.overhead_ms >= cal.prefill_constant_ms / MAX_FASTER,
            "{fast:?}"
        );
        assert!(fast.decode_scale >= 1.0 / MAX_FASTER, "{fast:?}");
        // and once the picker measures the truth, the engine's claim is outweighed
        for _ in 0..400 {
            c.observe_ttft(&ep(2), basis(1000.0), prefill_ms(&cal, 1000.0) * 3.0);
        }
        let l = c.learned(&ep(2)).unwrap();
        let predicted = learned_ms(&cal, &l, 1000.0);
        assert!(predicted > prefill_ms(&cal, 1000.0) * 1.5, "{l:?}");
    }

    fn learned_ms(cal: &CostModelCalibration, l: &LearnedCost, tokens: f64) -> f64 {
        crate::policy::learned_prefill_ms(cal, l, tokens)
    }

    fn any_value() -> BoxedStrategy<f64> {
        prop_oneof![
            Just(f64::NAN),
            Just(f64::INFINITY),
            Just(f64::NEG_INFINITY),
            Just(-1.0),
            Just(0.0),
            Just(1e300),
            Just(f64::MIN_POSITIVE),
            0.0..1e3,
            0.0..1e7,
            any::<f64>(),
        ]
        .boxed()
    }

    fn any_pair() -> BoxedStrategy<Option<SumCount>> {
        proptest::option::of(
            (any_value(), any_value()).prop_map(|(sum, count)| SumCount { sum, count }),
        )
        .boxed()
    }

    #[derive(Debug, Clone)]
    enum Op {
        Ttft(u8, f64, f64, f64),
        Engine(u8, PerfCounters, f64),
        Pool(Vec<u8>),
    }

    fn any_op() -> BoxedStrategy<Op> {
        let counters = (
            any_pair(),
            any_pair(),
            any_pair(),
            any_pair(),
            any_pair(),
            proptest::option::of(any_value()),
            proptest::option::of(any_value()),
        )
            .prop_map(|(p, t, q, k, i, pr, ca)| PerfCounters {
                prefill_time: p,
                ttft: t,
                queue_time: q,
                prefill_tokens: k,
                inter_token_latency: i,
                prompt_tokens: pr,
                cached_tokens: ca,
            })
            .boxed();
        prop_oneof![
            8 => (1u8..4, any_value(), any_value(), any_value())
                .prop_map(|(e, w, d, y)| Op::Ttft(e, w, d, y)),
            8 => (1u8..4, counters, any_value()).prop_map(|(e, c, u)| Op::Engine(e, c, u)),
            1 => proptest::collection::vec(1u8..5, 0..4).prop_map(Op::Pool),
        ]
        .boxed()
    }

    proptest! {
        /// Whatever arrives, in whatever order, every estimate stays finite and within its
        /// bounds, and entries exist only for the pool's endpoints.
        #[test]
        fn any_stream_stays_within_the_bounds(ops in proptest::collection::vec(any_op(), 1..200)) {
            let mut c = with_pool(3);
            let mut pool: Vec<u8> = vec![1, 2, 3];
            for op in ops {
                match op {
                    Op::Ttft(e, work, decode, y) => {
                        let fed = c.observe_ttft(&ep(e), TtftBasis { work_tokens: work, decode_ms: decode }, y);
                        prop_assert_eq!(fed.is_some(), pool.contains(&e));
                    }
                    Op::Engine(e, counters, u) => {
                        let fed = c.observe_engine(&ep(e), &counters, u);
                        prop_assert_eq!(fed.is_some(), pool.contains(&e));
                    }
                    Op::Pool(ids) => {
                        c.set_pool(ids.iter().map(|n| ep(*n)));
                        pool = ids;
                        pool.sort_unstable();
                        pool.dedup();
                    }
                }
                prop_assert_eq!(c.len(), pool.len());
                for n in 1..5 {
                    if let Err(e) = within_bounds(&c, &ep(n)) {
                        return Err(TestCaseError::fail(e));
                    }
                }
            }
        }
    }

    /// Finding 5 of issue 35: an endpoint priced high by a burst of slow measurements and
    /// absurd engine histograms gets no traffic afterwards, so nothing of its own corrects
    /// the price. Aged in time, its values fall back to its pool's within a minute while its
    /// identical peer keeps being measured; absurd (non-finite) scrapes do not freeze it.
    #[test]
    fn a_skewed_price_falls_back_to_the_pool_once_nothing_new_is_observed() {
        let cal = CostModelCalibration::default();
        let (overhead, per_token) = (250.0, 0.6);
        let mut c = with_pool(2);
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let mut now = 0u64;
        let priced = |c: &Calibration| {
            let pool = pooled(&[c.learned(&ep(1)), c.learned(&ep(2))]);
            let ms = |l: &Option<LearnedCost>| learned_ms(&cal, l.as_ref().unwrap(), 2000.0);
            (ms(&pool[0]), ms(&pool[1]))
        };
        // a minute of both being measured honestly, one request each every half second
        while now < 60_000 {
            for e in [1, 2] {
                let tokens = rng.random_range(200.0..4000.0);
                c.age(now);
                c.observe_ttft(&ep(e), basis(tokens), truth(overhead, per_token, tokens));
            }
            now += 500;
        }
        let (a, b) = priced(&c);
        assert!(rel(a, b) < 0.1, "alike at first: {a} vs {b}");
        // ten seconds of stalls on endpoint 1 (five times the truth), and its engine reports
        // absurd histograms
        let mut counters = scrape(0.0, 0.0, 0.0, 0.0);
        c.observe_engine(&ep(1), &counters, 0.1);
        while now < 70_000 {
            let tokens = rng.random_range(200.0..4000.0);
            c.age(now);
            c.observe_ttft(
                &ep(1),
                basis(tokens),
                5.0 * truth(overhead, per_token, tokens),
            );
            counters = scrape(now as f64, 2000.0, 60_000.0, 500.0);
            c.observe_engine(&ep(1), &counters, 0.1);
            now += 100;
        }
        let (a, b) = priced(&c);
        assert!(a > 1.3 * b, "skewed: {a} vs {b}");
        // then endpoint 1 gets no traffic (its engine's sums turn non-finite for a while),
        // endpoint 2 is measured every second; scrapes every 100 ms
        let broken = PerfCounters {
            prefill_time: Some(SumCount {
                sum: f64::NAN,
                count: 1.0,
            }),
            ..PerfCounters::default()
        };
        let start = now;
        while now < start + 60_000 {
            c.age(now);
            if now.is_multiple_of(1000) {
                let tokens = rng.random_range(200.0..4000.0);
                c.observe_ttft(&ep(2), basis(tokens), truth(overhead, per_token, tokens));
            }
            let scraped = if now < start + 20_000 {
                &broken
            } else {
                &counters
            };
            c.observe_engine(&ep(1), scraped, 0.1);
            now += 100;
        }
        let (a, b) = priced(&c);
        assert!(
            rel(a, b) < 0.1,
            "back with its pool after a minute: {a} vs {b}"
        );
    }

    fn cost(overhead: f64, per_token: f64, n: u64) -> LearnedCost {
        LearnedCost {
            overhead_ms: overhead,
            prefill_ms_per_token: per_token,
            decode_scale: 1.0,
            decode_step_ms: 5.7,
            observations: n,
            recent_observations: n as f64,
        }
    }

    #[test]
    fn a_new_endpoint_inherits_its_pool_and_outliers_are_held_near_it() {
        // nothing learned anywhere: the configured calibration for all
        assert_eq!(pooled(&[None, None]), vec![None, None]);
        // two peers learned ~10x the prior; a new endpoint is priced like them, not at the prior
        let p = pooled(&[
            Some(cost(100.0, 0.1, 200)),
            Some(cost(100.0, 0.1, 200)),
            None,
        ]);
        let new = p[2].expect("inherited");
        assert!((new.prefill_ms_per_token - 0.1).abs() < 1e-9 && new.observations == 0);
        assert!((new.overhead_ms - 100.0).abs() < 1e-9);
        // few observations: mostly the pool's values; a far outlier stays within 2x of the pool
        let p = pooled(&[Some(cost(100.0, 0.1, 1000)), Some(cost(100.0, 0.5, 4))]);
        let young = p[1].expect("kept");
        assert!(young.prefill_ms_per_token < 0.15, "{young:?}");
        let p = pooled(&[Some(cost(100.0, 0.1, 1000)), Some(cost(100.0, 100.0, 1000))]);
        let pool = (0.1f64.ln() * 0.5 + 100.0f64.ln() * 0.5).exp();
        for l in p.iter().flatten() {
            let r = l.prefill_ms_per_token / pool;
            assert!((0.5 - 1e-9..=2.0 + 1e-9).contains(&r), "{r}");
        }
        // values within the noise of each other are exactly the pool's: a tie
        let p = pooled(&[
            Some(cost(14.04, 0.015188, 1)),
            Some(cost(14.05, 0.015187, 1)),
            None,
        ]);
        let v: Vec<_> = p
            .iter()
            .flatten()
            .map(|l| (l.overhead_ms, l.prefill_ms_per_token))
            .collect();
        assert!(v.windows(2).all(|w| w[0] == w[1]), "{v:?}");
        // identical CPU engines' fits from one real-vLLM round (BENCHMARKS §7): each constant
        // 1.2-1.5x apart, their prediction at the pool's balance point within 10%: the pool's
        let p = pooled(&[Some(cost(83.5, 0.0610, 300)), Some(cost(56.8, 0.0750, 300))]);
        let (a, b) = (p[0].expect("a"), p[1].expect("b"));
        assert_eq!(
            (a.overhead_ms, a.prefill_ms_per_token),
            (b.overhead_ms, b.prefill_ms_per_token)
        );
        // a decode scale 1.5x apart is a real difference: both keep their own
        let mut slow_decode = cost(70.0, 0.07, 300);
        slow_decode.decode_scale = 1.5;
        let p = pooled(&[Some(cost(70.0, 0.07, 300)), Some(slow_decode)]);
        assert!(p[1].expect("b").decode_scale > p[0].expect("a").decode_scale * 1.3);
        // well-observed endpoints keep most of a real difference
        let p = pooled(&[Some(cost(50.0, 0.05, 2000)), Some(cost(50.0, 0.15, 2000))]);
        let (a, b) = (p[0].expect("a"), p[1].expect("b"));
        assert!(
            b.prefill_ms_per_token / a.prefill_ms_per_token > 2.5,
            "{a:?} {b:?}"
        );
    }
}
