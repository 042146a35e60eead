//! One rank in real time: the engine model behind a lock, the per-request output channels, and
//! the driver task that steps the engine and sleeps each step's duration.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvroute_routing::kv_events::{EventBatch, KvEvent};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use tokio::sync::{Notify, mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::events::{PublishCmd, PublisherState};
use super::metrics::Histogram;
use crate::engine::{FinishedRequest, Rank, Request, RequestId, SubmitError};

/// What a request's HTTP handler receives.
#[derive(Debug, Clone)]
pub(crate) enum Delta {
    /// One output token (its id is the code point of its text).
    Token(u32),
    /// The last output token, and the request's accounting.
    Last(u32, FinishedRequest),
    /// The engine dropped the request (restart).
    Aborted(&'static str),
}

/// Mutable state of a rank, under one lock so that a step's results and the channels they go
/// to never disagree.
pub(crate) struct RankInner {
    pub engine: Rank,
    /// Output channel per in-flight request. Unbounded on purpose: a request receives exactly
    /// `max_tokens` tokens plus one final message, so each channel is bounded by the request
    /// itself, and the driver must never block on a slow client.
    pub streams: FxHashMap<RequestId, mpsc::UnboundedSender<Delta>>,
    pub ttft: Histogram,
    pub e2e: Histogram,
}

/// Why a submission was refused.
#[derive(Debug)]
pub(crate) enum Rejected {
    QueueFull(usize),
    Invalid(SubmitError),
}

pub(crate) struct RankState {
    pub rank: u32,
    pub inner: Mutex<RankInner>,
    pub wake: Notify,
    pub events: Option<mpsc::Sender<PublishCmd>>,
    pub publisher: Arc<Mutex<PublisherState>>,
    max_waiting: usize,
    /// Its id on the KV connector (new for every incarnation of the engine).
    pub engine_id: String,
    /// The `background_prefill` fault's load, read by [`background`].
    pub background: watch::Sender<Option<Background>>,
}

/// Synthetic prefill work besides the served requests (the `background_prefill` fault).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Background {
    pub tokens_per_second: f64,
    pub prompt_tokens: u32,
}

/// How often the background prefill takes its share (wall time).
const BACKGROUND_TICK: Duration = Duration::from_millis(100);
/// Work a late tick may catch up on, in seconds of its rate.
const BACKGROUND_CATCH_UP_S: f64 = 0.5;

/// Wall-clock to virtual-time mapping shared by the ranks of an engine.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Clock {
    start: Instant,
    speedup: f64,
}

impl Clock {
    pub fn new(speedup: f64) -> Self {
        Self {
            start: Instant::now(),
            speedup,
        }
    }

    /// Virtual milliseconds since the engine started.
    pub fn now_ms(&self) -> f64 {
        self.start.elapsed().as_secs_f64() * 1000.0 * self.speedup
    }

    /// Wall time from now until the virtual instant `t_ms` (zero if it has passed).
    pub fn until(&self, t_ms: f64) -> Duration {
        let ms = t_ms - self.now_ms();
        Duration::from_secs_f64((ms / 1000.0 / self.speedup).clamp(0.0, 86_400.0))
    }
}

impl RankState {
    pub fn new(
        rank: u32,
        engine: Rank,
        events: Option<mpsc::Sender<PublishCmd>>,
        publisher: Arc<Mutex<PublisherState>>,
        max_waiting: usize,
        engine_id: String,
    ) -> Self {
        Self {
            rank,
            inner: Mutex::new(RankInner {
                engine,
                streams: FxHashMap::default(),
                ttft: Histogram::ttft(),
                e2e: Histogram::e2e(),
            }),
            wake: Notify::new(),
            events,
            publisher,
            max_waiting,
            engine_id,
            background: watch::Sender::new(None),
        }
    }

    /// Prompt tokens of `tokens` this rank's cache holds now.
    pub fn cached_prefix(
        &self,
        tokens: &[u32],
        cache_salt: Option<&str>,
        lora: Option<&str>,
    ) -> u32 {
        self.inner
            .lock()
            .engine
            .probe_prefix(tokens, cache_salt, lora)
    }

    /// vLLM's data-parallel load score: `4 * waiting + running`.
    pub fn load_score(&self) -> usize {
        let g = self.inner.lock();
        4 * g.engine.num_waiting() + g.engine.num_running()
    }

    /// Queue a request and return the channel its output arrives on.
    pub fn submit(
        &self,
        request: Request,
        arrival_ms: f64,
    ) -> Result<mpsc::UnboundedReceiver<Delta>, Rejected> {
        let id = request.id;
        let mut g = self.inner.lock();
        if g.engine.num_waiting() >= self.max_waiting {
            return Err(Rejected::QueueFull(self.max_waiting));
        }
        g.engine
            .submit_at(request, arrival_ms)
            .map_err(Rejected::Invalid)?;
        let (tx, rx) = mpsc::unbounded_channel();
        g.streams.insert(id, tx);
        drop(g);
        self.wake.notify_one();
        Ok(rx)
    }

    /// Drop a request whose client went away.
    pub fn abort(&self, id: RequestId) {
        let mut g = self.inner.lock();
        g.streams.remove(&id);
        if g.engine.abort(id) {
            tracing::debug!(rank = self.rank, id, "request aborted by client");
        }
    }

    /// Restart in place: fail in-flight requests, clear cache and counters, publish
    /// `AllBlocksCleared` (after resetting the sequence when `seq_zero`).
    pub async fn restart(&self, seq_zero: bool) {
        let events = {
            let mut g = self.inner.lock();
            let (_, events) = g.engine.reset(true);
            for (_, tx) in g.streams.drain() {
                let _ = tx.send(Delta::Aborted("the engine restarted"));
            }
            g.ttft = Histogram::ttft();
            g.e2e = Histogram::e2e();
            events
        };
        if let Some(tx) = &self.events {
            if seq_zero {
                let _ = tx.send(PublishCmd::ResetSeq).await;
            }
            let _ = tx.send(PublishCmd::Batch(self.batch(events))).await;
        }
    }

    fn batch(&self, events: Vec<KvEvent>) -> EventBatch {
        EventBatch {
            ts: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
            events,
            data_parallel_rank: Some(self.rank),
            skipped_unknown: 0,
        }
    }
}

/// Steps the engine for as long as it has work, sleeping until each step's modelled end
/// (scaled by the speed-up), then delivers the step's tokens and publishes its events. Pauses
/// while `hang` is set; returns when `cancel` fires.
///
/// While busy, steps follow each other in the engine's virtual time and the driver sleeps
/// until wall time catches up with each step's end, so timer granularity (about 1 ms) and
/// scheduling delays are absorbed by the next sleep instead of slowing the model down: at a
/// high speed-up several short steps share one sleep. Only after an idle period does the
/// engine clock jump to the wall clock.
pub(crate) async fn drive(
    state: Arc<RankState>,
    clock: Clock,
    mut hang: watch::Receiver<bool>,
    cancel: CancellationToken,
) {
    let mut busy = false;
    loop {
        if *hang.borrow() {
            busy = false;
            tokio::select! {
                () = cancel.cancelled() => return,
                _ = hang.wait_for(|h| !*h) => continue,
            }
        }
        let step = {
            let mut g = state.inner.lock();
            if !busy {
                g.engine.advance_to(clock.now_ms());
            }
            g.engine.next_step()
        };
        let Some(outcome) = step else {
            busy = false;
            tokio::select! {
                () = cancel.cancelled() => return,
                () = state.wake.notified() => continue,
                _ = hang.changed() => continue,
            }
        };
        busy = true;
        let wait = clock.until(outcome.end_ms);
        if !wait.is_zero() {
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(wait) => {}
            }
        }
        {
            let mut g = state.inner.lock();
            let inner = &mut *g;
            for f in &outcome.finished {
                inner
                    .ttft
                    .observe((f.first_token_ms - f.arrival_ms).max(0.0) / 1000.0);
                inner
                    .e2e
                    .observe((f.finish_ms - f.arrival_ms).max(0.0) / 1000.0);
            }
            for (id, token) in &outcome.tokens {
                // A request finishes only in a step that gave it a token, so its last token
                // carries the accounting.
                match outcome.finished.iter().find(|f| f.id == *id) {
                    Some(f) => {
                        if let Some(tx) = inner.streams.remove(id) {
                            let _ = tx.send(Delta::Last(*token, f.clone()));
                        }
                    }
                    None => {
                        if let Some(tx) = inner.streams.get(id) {
                            let _ = tx.send(Delta::Token(*token));
                        }
                    }
                }
            }
        }
        if !outcome.kv_events.is_empty()
            && let Some(tx) = &state.events
        {
            let batch = state.batch(outcome.kv_events);
            if tx.send(PublishCmd::Batch(batch)).await.is_err() {
                tracing::debug!(rank = state.rank, "event publisher is gone");
            }
        }
    }
}

/// Runs the `background_prefill` fault's load: every tick, the prompts its rate owes are
/// prefilled ([`Rank::prefill_synthetic`], prompt ids drawn from `seed`) and their events
/// published as one batch. Idle while no load is set; returns when `cancel` fires.
pub(crate) async fn background(state: Arc<RankState>, seed: u64, cancel: CancellationToken) {
    let mut load_rx = state.background.subscribe();
    let mut prompts: u64 = 0;
    loop {
        let load = *load_rx.borrow_and_update();
        let Some(load) = load else {
            tokio::select! {
                () = cancel.cancelled() => return,
                _ = load_rx.changed() => continue,
            }
        };
        let mut tick = tokio::time::interval(BACKGROUND_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let prompt = f64::from(load.prompt_tokens);
        let most = (load.tokens_per_second * BACKGROUND_CATCH_UP_S).max(prompt);
        let mut owed = 0.0_f64;
        let mut last = Instant::now();
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                _ = load_rx.changed() => break,
                _ = tick.tick() => {}
            }
            let now = Instant::now();
            owed =
                (owed + load.tokens_per_second * now.duration_since(last).as_secs_f64()).min(most);
            last = now;
            let mut events = Vec::new();
            {
                let mut g = state.inner.lock();
                while owed >= prompt {
                    owed -= prompt;
                    prompts += 1;
                    let s = seed ^ prompts.wrapping_mul(0x9e37_79b9_7f4a_7c15);
                    events.extend(g.engine.prefill_synthetic(s, load.prompt_tokens));
                }
            }
            if !events.is_empty()
                && let Some(tx) = &state.events
                && tx
                    .send(PublishCmd::Batch(state.batch(events)))
                    .await
                    .is_err()
            {
                return;
            }
        }
    }
}
