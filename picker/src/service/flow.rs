//! Flow control in the service (`routing.flowControl`): one [`FlowQueue`] per model config, a
//! dispatcher task that releases waiting requests as the model config's endpoints get headroom
//! ([`kvroute_routing::place::Pool::free_slots`]), and the answers of the ones that cannot wait.
//!
//! A waiting request holds a oneshot receiver; the dispatcher (one task, woken by arrivals and
//! every [`ROUND`]) expires, dispatches and sheds under one lock, so 100k waiting requests cost
//! no wakeups until their turn. A request whose client leaves drops its receiver and its guard
//! takes it out of the queue.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_routing::config::{FlowControlSettings, FlowFairness, FlowOrder};
use kvroute_routing::flow::{Fairness, FlowQueue, FlowSettings, Order, Refused, Waiting};
use parking_lot::Mutex;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::state::PickerState;

/// How often the dispatcher looks for headroom when nothing wakes it.
pub const ROUND: Duration = Duration::from_millis(10);

/// How a waiting request's wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Its model config has headroom: place it now.
    Dispatched,
    /// It waited the queue's TTL.
    Expired,
    /// A higher-priority request took its place in a full queue.
    Displaced,
}

struct Entry {
    config: String,
    tx: oneshot::Sender<Outcome>,
    since: Instant,
}

#[derive(Default)]
struct Inner {
    queues: HashMap<String, FlowQueue>,
    waiting: HashMap<u64, Entry>,
    /// Per model config: requests dispatched whose placement has not started yet (they do not
    /// count in the endpoints' pending requests until it has).
    in_transit: HashMap<String, u64>,
    next_id: u64,
}

/// See the module documentation.
#[derive(Default)]
pub struct FlowControl {
    inner: Mutex<Inner>,
    wake: tokio::sync::Notify,
}

/// The queue's settings from the routing config.
pub fn queue_settings(fc: &FlowControlSettings) -> FlowSettings {
    FlowSettings {
        max_requests: fc.max_queued as usize,
        max_bytes: fc.max_queued_bytes,
        ttl_ms: u64::try_from(fc.ttl.as_millis()).unwrap_or(u64::MAX),
        fairness: match fc.fairness {
            FlowFairness::LeastAttainedService => Fairness::LeastAttainedService,
            FlowFairness::RoundRobin => Fairness::RoundRobin,
        },
        order: match fc.order {
            FlowOrder::EarliestDeadline => Order::EarliestDeadline,
            FlowOrder::FirstComeFirstServed => Order::Fcfs,
        },
    }
}

/// A request about to wait.
pub struct Arrival {
    pub band: i32,
    pub flow: u64,
    pub tokens: u64,
    pub bytes: u64,
    pub now_ms: u64,
    /// Its arrival plus its TTFT objective (`Order::EarliestDeadline`).
    pub deadline_ms: Option<u64>,
}

/// What [`FlowControl::enqueue`] hands the waiting request.
pub struct Ticket {
    pub id: u64,
    pub rx: oneshot::Receiver<Outcome>,
}

impl FlowControl {
    /// Whether nothing of `config` waits (a request may then go straight on).
    pub fn is_empty_for(&self, config: &str) -> bool {
        self.inner
            .lock()
            .queues
            .get(config)
            .is_none_or(FlowQueue::is_empty)
    }

    /// Puts a request of `config` in line; the lower-band requests it pushes out are answered
    /// [`Outcome::Displaced`] (their bands are returned).
    ///
    /// # Errors
    /// [`Refused`] when it cannot wait.
    pub fn enqueue(
        &self,
        config: &str,
        settings: FlowSettings,
        a: &Arrival,
    ) -> Result<(Ticket, Vec<i32>), Refused> {
        let mut inner = self.inner.lock();
        inner.next_id += 1;
        let id = inner.next_id;
        let queue = inner
            .queues
            .entry(config.to_owned())
            .or_insert_with(|| FlowQueue::new(settings));
        queue.set_settings(settings);
        let pushed = queue.push(Waiting {
            id,
            band: a.band,
            flow: a.flow,
            tokens: a.tokens,
            bytes: a.bytes,
            arrival_ms: a.now_ms,
            deadline_ms: a.deadline_ms,
        })?;
        let displaced: Vec<i32> = pushed.shed.iter().map(|w| w.band).collect();
        for w in pushed.shed {
            if let Some(e) = inner.waiting.remove(&w.id) {
                let _ = e.tx.send(Outcome::Displaced);
            }
        }
        let (tx, rx) = oneshot::channel();
        inner.waiting.insert(
            id,
            Entry {
                config: config.to_owned(),
                tx,
                since: Instant::now(),
            },
        );
        drop(inner);
        self.wake.notify_one();
        Ok((Ticket { id, rx }, displaced))
    }

    /// Takes request `id` out of line (its client left); nothing when it is not waiting.
    pub fn cancel(&self, id: u64) {
        let mut inner = self.inner.lock();
        if let Some(e) = inner.waiting.remove(&id)
            && let Some(q) = inner.queues.get_mut(&e.config)
        {
            q.remove(id);
        }
    }

    /// A dispatched request of `config` has started its placement.
    pub fn placed(&self, config: &str) {
        if let Some(n) = self.inner.lock().in_transit.get_mut(config) {
            *n = n.saturating_sub(1);
        }
    }

    /// Requests waiting per model config.
    pub fn queued(&self) -> Vec<(String, usize)> {
        let inner = self.inner.lock();
        let mut v: Vec<(String, usize)> = inner
            .queues
            .iter()
            .map(|(c, q)| (c.clone(), q.len()))
            .collect();
        v.sort();
        v
    }

    /// One dispatcher round at `now_ms`: expire, then release as many requests of each model
    /// config as `free(config)` allows (less those dispatched and not yet placed): its first
    /// figure is the room for every band, its second the room for negative bands (of the
    /// same places, so a release counts against both). Returns the waits of the released
    /// requests and the bands of those expired.
    pub fn round(
        &self,
        now_ms: u64,
        settings: FlowSettings,
        mut free: impl FnMut(&str) -> (u64, u64),
    ) -> (Vec<Duration>, Vec<i32>) {
        let mut inner = self.inner.lock();
        let Inner {
            queues,
            waiting,
            in_transit,
            ..
        } = &mut *inner;
        let mut released = Vec::new();
        let mut expired = Vec::new();
        for (config, q) in queues.iter_mut() {
            q.set_settings(settings);
            for w in q.expire(now_ms) {
                if let Some(e) = waiting.remove(&w.id) {
                    let _ = e.tx.send(Outcome::Expired);
                    expired.push(w.band);
                }
            }
            if q.is_empty() {
                continue;
            }
            let transit = in_transit.entry(config.clone()).or_default();
            let (all, sheddable) = free(config);
            let mut room = all.saturating_sub(*transit);
            let mut sheddable_room = sheddable.saturating_sub(*transit);
            while room > 0 {
                if q.peek().is_some_and(|w| w.band < 0) {
                    // lower bands are all that is left
                    if sheddable_room == 0 {
                        break;
                    }
                    sheddable_room -= 1;
                }
                let Some(w) = q.pop() else { break };
                let Some(e) = waiting.remove(&w.id) else {
                    continue;
                };
                if e.tx.send(Outcome::Dispatched).is_ok() {
                    *transit += 1;
                    room -= 1;
                    released.push(e.since.elapsed());
                }
            }
        }
        queues.retain(|_, q| !q.is_empty());
        (released, expired)
    }
}

/// The dispatcher: a round on every arrival and every [`ROUND`], while flow control is on.
pub async fn run_dispatcher(picker: Arc<PickerState>, cancel: CancellationToken) {
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            () = picker.flow.wake.notified() => {}
            () = tokio::time::sleep(ROUND) => {}
        }
        let routing = picker.routing();
        let settings = queue_settings(&routing.flow_control);
        let now = picker.now_ms();
        // turned off (a live edit), what waits goes on
        let enabled = routing.flow_control.enabled;
        let (released, expired) = picker.flow.round(now, settings, |config| {
            if enabled {
                let s = &routing.saturation;
                let all = picker.pool.free_slots(config, s);
                let sheddable = if s.for_band(-1) == *s {
                    all
                } else {
                    picker.pool.free_slots(config, &s.for_band(-1))
                };
                (all, sheddable)
            } else {
                (u64::MAX, u64::MAX)
            }
        });
        for wait in released {
            picker.metrics.flow_dispatched.inc();
            picker.metrics.flow_wait_seconds.observe(wait.as_secs_f64());
        }
        for band in expired {
            picker.metrics.flow_shed("queue_expired", band);
        }
        picker.metrics.set_flow_queued(&picker.flow.queued());
    }
}
