//! The waiting room: the one gate in front of [`Pool::place`](crate::place::Pool::place) that
//! owns every request waiting for its turn (issue 49).
//!
//! A request passes three stages, in order, each skipped when it is off or has nothing to say:
//! 1. **Later**: a request whose TTFT objective no endpoint was predicted to meet, and which
//!    may still wait for it (`unattainableSlo: Queue`), comes back in [`SLO_RETRY_MS`]
//!    ([`slo_verdict`]).
//! 2. **Flow control** (`routing.flowControl`): while its model config has no headroom, or
//!    others of it wait already, the request waits in the config's [`FlowQueue`] (priority
//!    bands, fairness between flows, deadline order inside a flow, bounds by count, bytes and
//!    time). Released as the endpoints get room, the sheddable bands under their own
//!    thresholds.
//! 3. **Session admission** (`routing.admission`): a new session's first turn waits in the
//!    [`AdmissionQueue`] while its footprint does not fit beside the live context of the
//!    sessions already in the pool.
//!
//! It holds no timers, wakers or channels: its owner tells it what arrives
//! ([`WaitingRoom::arrive`]) and leaves ([`WaitingRoom::leave`]), and asks it what to do
//! ([`WaitingRoom::step`]: dispatch this request, refuse that one) whenever the pool may have
//! changed and at [`WaitingRoom::next_wake`]. The pool's state comes in through [`Headroom`].
//! The service drives it from one task; the offline benchmark drives the same code in virtual
//! time.

use std::collections::{BTreeMap, HashMap, VecDeque};

use serde::Serialize;

use crate::admission::{AdmissionQueue, Admitted, Room, Ticket as Reservation, Turn};
use crate::flow::{FlowQueue, FlowSettings, Refused, Waiting};

/// With `unattainableSlo: Queue`, how long a request whose objective no endpoint is predicted
/// to meet waits before it is placed again.
pub const SLO_RETRY_MS: u64 = 50;

/// The gate's policies, read from one routing config at every call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GateSettings {
    /// Flow control's queue, when it is on.
    pub flow: Option<FlowSettings>,
    /// Session admission, when it is on.
    pub admission: Option<AdmissionLimits>,
}

impl GateSettings {
    /// The gate's policies in `routing`.
    pub fn of(routing: &crate::config::RoutingConfig) -> Self {
        use crate::config::{FlowFairness, FlowOrder};
        use crate::flow::{Fairness, Order};
        let fc = &routing.flow_control;
        let ad = &routing.admission;
        Self {
            flow: fc.enabled.then(|| FlowSettings {
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
            }),
            admission: ad.enabled.then(|| AdmissionLimits {
                max_queue: ad.max_queue as usize,
                max_wait_ms: u64::try_from(ad.max_wait.as_millis()).unwrap_or(u64::MAX),
            }),
        }
    }
}

/// Session admission's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionLimits {
    /// First turns waiting at once; one more goes on without waiting.
    pub max_queue: usize,
    /// Longest a first turn waits, ms.
    pub max_wait_ms: u64,
}

/// What the pool offers the waiting requests, read at every arrival and step.
pub trait Headroom {
    /// Requests model config `config` can take now before its endpoints are saturated: under
    /// the thresholds of every band, or (`sheddable`) under the sheddable (negative) bands'.
    fn free(&self, config: &str, sheddable: bool) -> u64;
    /// The pool's room for a turn of session `session` (a session key) with `prompt_tokens`,
    /// `reserved` tokens being promised to turns admitted and not yet served; `Err` says why
    /// the room is not asked (no session, a live one, capacity unknown).
    fn room(
        &self,
        session: Option<u64>,
        prompt_tokens: u32,
        reserved: u64,
    ) -> Result<Room, Admitted>;
    /// Since when (this replica's clock, ms) the first turn in session admission's line at a
    /// peer replica waits, when one does: admission's lines are one line across replicas.
    fn first_elsewhere(&self) -> Option<u64> {
        None
    }
}

/// A request arriving at the gate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arrival {
    /// The caller's id for it, unique among the requests waiting.
    pub id: u64,
    /// Its model config.
    pub config: String,
    /// Its priority band.
    pub band: i32,
    /// Its fairness flow.
    pub flow: u64,
    /// Prompt + expected output tokens (what serving it costs its flow).
    pub tokens: u64,
    /// Its body's size.
    pub bytes: u64,
    /// When it wants its first token at the latest (ms), if it said.
    pub deadline_ms: Option<u64>,
    /// Its session key, if it has one.
    pub session: Option<u64>,
    /// Its prompt's size.
    pub prompt_tokens: u32,
    /// Not before this time (an SLO retry).
    pub not_before_ms: Option<u64>,
}

/// Why a request is answered without service.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Refusal {
    /// Flow control's queue is full of requests of its band or higher.
    QueueFull,
    /// Its body is larger than flow control's byte bound.
    TooLarge,
    /// It waited flow control's TTL.
    Expired,
    /// A request of a higher band took its place in the full queue.
    Displaced,
    /// No endpoint is predicted to meet its TTFT objective in the time left.
    SloUnattainable,
}

impl Refusal {
    /// The code of its answer (and its metric label).
    pub fn code(self) -> &'static str {
        match self {
            Self::QueueFull => "queue_full",
            Self::TooLarge => "too_large",
            Self::Expired => "queue_expired",
            Self::Displaced => "displaced",
            Self::SloUnattainable => "slo_unattainable",
        }
    }

    /// What its answer tells the client.
    pub fn message(self) -> &'static str {
        match self {
            Self::QueueFull => {
                "the pool is saturated and flow control's queue is full of requests of this priority or higher"
            }
            Self::TooLarge => {
                "the request is larger than flow control's queue (routing.flowControl.maxQueuedBytes)"
            }
            Self::Expired => {
                "the request waited flow control's ttl (routing.flowControl.ttl) for the pool to have headroom"
            }
            Self::Displaced => {
                "a request of a higher priority took this one's place in flow control's full queue"
            }
            Self::SloUnattainable => {
                "no endpoint is predicted to give the first token within the request's objective"
            }
        }
    }
}

/// How a request passed the gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pass {
    /// Why session admission let it by ([`Admitted::Disabled`] when admission is off).
    pub admitted: Admitted,
    /// Its footprint's reservation, when admission held it: give it back with
    /// [`WaitingRoom::release`] once its session is served.
    pub reservation: Option<Reservation>,
    /// How long it waited in flow control's queue, when it did.
    pub flow_wait_ms: Option<u64>,
    /// How long admission held it, when it did.
    pub admission_wait_ms: Option<u64>,
}

impl Pass {
    pub fn straight(admitted: Admitted) -> Self {
        Self {
            admitted,
            reservation: None,
            flow_wait_ms: None,
            admission_wait_ms: None,
        }
    }

    /// Whether it waited at all.
    pub fn waited(&self) -> bool {
        self.flow_wait_ms.is_some() || self.admission_wait_ms.is_some()
    }
}

/// The gate's answer to an arrival.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrived {
    /// Go on to placement now.
    Go(Pass),
    /// Wait: a later [`WaitingRoom::step`] answers it.
    Wait,
    /// Answer it now, without service.
    Refused(Refusal),
}

/// What a step tells its owner to do with a waiting request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Its turn came: place it.
    Go { id: u64, pass: Pass },
    /// Answer it without service.
    Refuse { id: u64, band: i32, reason: Refusal },
}

/// A request's deadline against the best prediction ([`slo_verdict`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slo {
    /// Place it.
    Met,
    /// Come back through the gate at this time (`unattainableSlo: Queue`).
    Retry { at_ms: u64 },
    /// Answer it `slo_unattainable`, with what was left of its objective.
    Refuse { left_ms: u64 },
}

/// A request with its first token due by `deadline_ms`, predicted at best in `best_ms` at
/// `now_ms`: placed when the prediction meets the time left; else, when it may wait
/// (`queue`) and more than [`SLO_RETRY_MS`] is left, asked again then; else refused now
/// rather than answered late.
pub fn slo_verdict(deadline_ms: u64, now_ms: u64, best_ms: f64, queue: bool) -> Slo {
    let left = deadline_ms.saturating_sub(now_ms);
    if best_ms <= left as f64 {
        Slo::Met
    } else if queue && left > SLO_RETRY_MS {
        Slo::Retry {
            at_ms: now_ms + SLO_RETRY_MS,
        }
    } else {
        Slo::Refuse { left_ms: left }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Later(u64),
    Flow,
    Admission(Reservation),
}

#[derive(Debug)]
struct Held {
    arrival: Arrival,
    stage: Stage,
    /// When it entered its stage.
    since_ms: u64,
    flow_wait_ms: Option<u64>,
}

/// See the module documentation.
#[derive(Debug, Default)]
pub struct WaitingRoom {
    held: HashMap<u64, Held>,
    /// (time, id) of the requests waiting to come back.
    later: BTreeMap<(u64, u64), ()>,
    /// Flow control's queue per model config.
    queues: BTreeMap<String, FlowQueue>,
    admission: AdmissionQueue,
    /// Ids in admission's line, in arrival order.
    admission_line: VecDeque<u64>,
    /// Per model config: requests flow control released whose placement has not started
    /// (they do not count in the endpoints' pending requests until it has).
    in_transit: HashMap<String, u64>,
    /// Answers decided outside a step (requests pushed out by an arrival), for the next one.
    outbox: Vec<Action>,
}

impl WaitingRoom {
    pub fn new() -> Self {
        Self::default()
    }

    /// Requests waiting, at any stage.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Requests in flow control's queue per model config (configs with none left out).
    pub fn queued(&self) -> Vec<(String, usize)> {
        self.queues
            .iter()
            .filter(|(_, q)| !q.is_empty())
            .map(|(c, q)| (c.clone(), q.len()))
            .collect()
    }

    /// Since when the first turn in session admission's line waits.
    pub fn first_waiting_since(&self) -> Option<u64> {
        self.admission.first_since()
    }

    /// First turns held by session admission.
    pub fn admission_waiting(&self) -> usize {
        self.admission_line.len()
    }

    /// Whether a step may have something to do before [`Self::next_wake`]: requests wait for
    /// headroom, which grows without the gate being told (scrapes, answers).
    pub fn waits_for_headroom(&self) -> bool {
        self.queues.values().any(|q| !q.is_empty()) || !self.outbox.is_empty()
    }

    /// Footprints reserved at `now_ms` for turns admitted and not yet served.
    pub fn reserved(&self, now_ms: u64) -> u64 {
        self.admission.reserved(now_ms)
    }

    /// `a` arrives at `now_ms`.
    pub fn arrive(
        &mut self,
        now_ms: u64,
        a: Arrival,
        s: &GateSettings,
        h: &impl Headroom,
    ) -> Arrived {
        if self.held.contains_key(&a.id) {
            return Arrived::Refused(Refusal::QueueFull);
        }
        if let Some(at) = a.not_before_ms.filter(|&t| t > now_ms) {
            self.later.insert((at, a.id), ());
            self.hold(a, Stage::Later(at), now_ms, None);
            return Arrived::Wait;
        }
        self.enter_flow(now_ms, a, s, h)
    }

    fn hold(&mut self, arrival: Arrival, stage: Stage, now_ms: u64, flow_wait_ms: Option<u64>) {
        self.held.insert(
            arrival.id,
            Held {
                arrival,
                stage,
                since_ms: now_ms,
                flow_wait_ms,
            },
        );
    }

    fn enter_flow(
        &mut self,
        now_ms: u64,
        a: Arrival,
        s: &GateSettings,
        h: &impl Headroom,
    ) -> Arrived {
        let Some(fs) = s.flow else {
            return self.enter_admission(now_ms, a, None, s, h);
        };
        // nothing of its model config waits and its band has room: straight on
        if self.queues.get(&a.config).is_none_or(FlowQueue::is_empty)
            && h.free(&a.config, a.band < 0) > 0
        {
            return self.enter_admission(now_ms, a, None, s, h);
        }
        let queue = self
            .queues
            .entry(a.config.clone())
            .or_insert_with(|| FlowQueue::new(fs));
        queue.set_settings(fs);
        let pushed = queue.push(Waiting {
            id: a.id,
            band: a.band,
            flow: a.flow,
            tokens: a.tokens,
            bytes: a.bytes,
            arrival_ms: now_ms,
            deadline_ms: a.deadline_ms,
        });
        match pushed {
            Ok(pushed) => {
                for w in pushed.shed {
                    self.held.remove(&w.id);
                    self.outbox.push(Action::Refuse {
                        id: w.id,
                        band: w.band,
                        reason: Refusal::Displaced,
                    });
                }
                self.hold(a, Stage::Flow, now_ms, None);
                Arrived::Wait
            }
            Err(Refused::TooLarge) => Arrived::Refused(Refusal::TooLarge),
            Err(Refused::QueueFull | Refused::Duplicate) => Arrived::Refused(Refusal::QueueFull),
        }
    }

    fn enter_admission(
        &mut self,
        now_ms: u64,
        a: Arrival,
        flow_wait_ms: Option<u64>,
        s: &GateSettings,
        h: &impl Headroom,
    ) -> Arrived {
        let go = |admitted| {
            Arrived::Go(Pass {
                flow_wait_ms,
                ..Pass::straight(admitted)
            })
        };
        let Some(limits) = s.admission else {
            return go(Admitted::Disabled);
        };
        match h.room(a.session, a.prompt_tokens, self.reserved(now_ms)) {
            Err(why) => go(why),
            Ok(room) if room.fits() => go(Admitted::Fits),
            Ok(_) => match self.admission.join(now_ms, limits.max_queue) {
                None => go(Admitted::QueueFull),
                Some(ticket) => {
                    self.admission_line.push_back(a.id);
                    self.hold(a, Stage::Admission(ticket), now_ms, flow_wait_ms);
                    Arrived::Wait
                }
            },
        }
    }

    /// Request `id` leaves (its client went away). Returns whether it was waiting (`false`:
    /// a step has already decided it, or it never waited).
    pub fn leave(&mut self, id: u64) -> bool {
        let Some(held) = self.held.remove(&id) else {
            return false;
        };
        match held.stage {
            Stage::Later(at) => {
                self.later.remove(&(at, id));
            }
            Stage::Flow => {
                if let Some(q) = self.queues.get_mut(&held.arrival.config) {
                    q.remove(id);
                }
            }
            Stage::Admission(ticket) => {
                self.admission.leave(ticket);
                self.admission_line.retain(|&i| i != id);
            }
        }
        true
    }

    /// A request flow control released for `config` has started its placement.
    pub fn placed(&mut self, config: &str) {
        if let Some(n) = self.in_transit.get_mut(config) {
            *n = n.saturating_sub(1);
        }
    }

    /// A turn admission held was served (its session now counts in the working sets): its
    /// reservation goes.
    pub fn release(&mut self, reservation: Reservation) {
        self.admission.release(reservation);
    }

    /// What to do at `now_ms`: the requests whose time came back, flow control's expiries and
    /// releases (as much as each config's headroom allows, less what was released and not
    /// yet placed), then admission's line in order.
    pub fn step(&mut self, now_ms: u64, s: &GateSettings, h: &impl Headroom) -> Vec<Action> {
        let mut out = std::mem::take(&mut self.outbox);
        // back from later
        while let Some((&(at, id), ())) = self.later.first_key_value() {
            if at > now_ms {
                break;
            }
            self.later.remove(&(at, id));
            if let Some(held) = self.held.remove(&id) {
                let a = held.arrival;
                let band = a.band;
                match self.enter_flow(now_ms, a, s, h) {
                    Arrived::Go(pass) => out.push(Action::Go { id, pass }),
                    Arrived::Wait => {}
                    Arrived::Refused(reason) => out.push(Action::Refuse { id, band, reason }),
                }
            }
        }
        out.append(&mut self.outbox);
        self.flow_step(now_ms, s, h, &mut out);
        self.admission_step(now_ms, s, h, &mut out);
        out
    }

    fn flow_step(
        &mut self,
        now_ms: u64,
        s: &GateSettings,
        h: &impl Headroom,
        out: &mut Vec<Action>,
    ) {
        let mut released = Vec::new();
        for (config, q) in &mut self.queues {
            if let Some(fs) = s.flow {
                q.set_settings(fs);
            }
            for w in q.expire(now_ms) {
                if self.held.remove(&w.id).is_some() {
                    out.push(Action::Refuse {
                        id: w.id,
                        band: w.band,
                        reason: Refusal::Expired,
                    });
                }
            }
            if q.is_empty() {
                continue;
            }
            let transit = self.in_transit.entry(config.clone()).or_default();
            // turned off (a live edit): what waits goes on; the sheddable bands' room is read
            // only when one of them is next
            let (mut room, mut sheddable_room) = match s.flow {
                Some(_) => (h.free(config, false).saturating_sub(*transit), None),
                None => (u64::MAX, Some(u64::MAX)),
            };
            while room > 0 {
                if q.peek().is_some_and(|w| w.band < 0) {
                    // the sheddable bands are all that is left
                    let left = sheddable_room
                        .get_or_insert_with(|| h.free(config, true).saturating_sub(*transit));
                    if *left == 0 {
                        break;
                    }
                    *left -= 1;
                }
                let Some(w) = q.pop() else { break };
                if let Some(held) = self.held.remove(&w.id) {
                    room -= 1;
                    released.push(held);
                }
            }
        }
        self.queues.retain(|_, q| !q.is_empty());
        for held in released {
            let id = held.arrival.id;
            let config = held.arrival.config.clone();
            let waited = now_ms.saturating_sub(held.since_ms);
            match self.enter_admission(now_ms, held.arrival, Some(waited), s, h) {
                Arrived::Go(pass) => {
                    *self.in_transit.entry(config).or_default() += 1;
                    out.push(Action::Go { id, pass });
                }
                Arrived::Wait | Arrived::Refused(_) => {}
            }
        }
    }

    fn admission_step(
        &mut self,
        now_ms: u64,
        s: &GateSettings,
        h: &impl Headroom,
        out: &mut Vec<Action>,
    ) {
        let line: Vec<u64> = self.admission_line.iter().copied().collect();
        for id in line {
            let Some(held) = self.held.get(&id) else {
                continue;
            };
            let Stage::Admission(ticket) = held.stage else {
                continue;
            };
            let a = &held.arrival;
            // a turn whose room is no longer asked (its session became live, admission was
            // switched off) goes on
            let asked = s.admission.map(|l| {
                (
                    l,
                    h.room(a.session, a.prompt_tokens, self.admission.reserved(now_ms)),
                )
            });
            let turn = match asked {
                Some((limits, Ok(room))) => self.admission.poll(
                    ticket,
                    now_ms,
                    limits.max_wait_ms,
                    &room,
                    h.first_elsewhere(),
                ),
                Some((_, Err(why))) => {
                    self.admission.leave(ticket);
                    Turn::Admit(why)
                }
                None => {
                    self.admission.leave(ticket);
                    Turn::Admit(Admitted::Disabled)
                }
            };
            let reserved = matches!(asked, Some((_, Ok(_))));
            let Turn::Admit(admitted) = turn else {
                continue;
            };
            let Some(held) = self.held.remove(&id) else {
                continue;
            };
            self.admission_line.retain(|&i| i != id);
            out.push(Action::Go {
                id,
                pass: Pass {
                    admitted,
                    reservation: reserved.then_some(ticket),
                    flow_wait_ms: held.flow_wait_ms,
                    admission_wait_ms: Some(now_ms.saturating_sub(held.since_ms)),
                },
            });
        }
    }

    /// When the gate must be stepped at the latest, whatever else happens: the first request
    /// due back, flow control's first expiry, admission's first deadline.
    pub fn next_wake(&self, s: &GateSettings) -> Option<u64> {
        let later = self.later.keys().next().map(|&(t, _)| t);
        let expiry = self
            .queues
            .values()
            .filter_map(FlowQueue::next_deadline)
            .min();
        let admission = s
            .admission
            .and_then(|l| self.admission.next_deadline(l.max_wait_ms));
        [later, expiry, admission].into_iter().flatten().min()
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;
    use crate::flow::{Fairness, Order};

    /// A pool whose headroom the test sets: free slots, and the live context beside a
    /// capacity (the footprint is the prompt).
    struct Scripted {
        free: Cell<(u64, u64)>,
        live: Cell<u64>,
        capacity: u64,
    }

    impl Scripted {
        fn new(free: u64) -> Self {
            Self {
                free: Cell::new((free, free)),
                live: Cell::new(0),
                capacity: 1_000,
            }
        }
    }

    impl Headroom for Scripted {
        fn free(&self, _: &str, sheddable: bool) -> u64 {
            let (all, low) = self.free.get();
            if sheddable { low } else { all }
        }

        fn room(&self, session: Option<u64>, prompt: u32, reserved: u64) -> Result<Room, Admitted> {
            session.ok_or(Admitted::NoSession)?;
            Ok(Room {
                live_tokens: self.live.get() + reserved,
                capacity_tokens: self.capacity,
                footprint_tokens: u64::from(prompt),
            })
        }
    }

    fn flow() -> FlowSettings {
        FlowSettings {
            max_requests: 3,
            max_bytes: 1 << 20,
            ttl_ms: 1_000,
            fairness: Fairness::RoundRobin,
            order: Order::Fcfs,
        }
    }

    fn both() -> GateSettings {
        GateSettings {
            flow: Some(flow()),
            admission: Some(AdmissionLimits {
                max_queue: 8,
                max_wait_ms: 500,
            }),
        }
    }

    fn arrival(id: u64, band: i32, session: Option<u64>, prompt: u32) -> Arrival {
        Arrival {
            id,
            config: "m".into(),
            band,
            flow: 0,
            tokens: u64::from(prompt),
            bytes: 10,
            deadline_ms: None,
            session,
            prompt_tokens: prompt,
            not_before_ms: None,
        }
    }

    fn gone(actions: &[Action]) -> Vec<u64> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Go { id, .. } => Some(*id),
                Action::Refuse { .. } => None,
            })
            .collect()
    }

    #[test]
    fn with_everything_off_a_request_goes_straight_on() {
        let mut w = WaitingRoom::new();
        let off = GateSettings {
            flow: None,
            admission: None,
        };
        let a = w.arrive(0, arrival(1, 0, Some(7), 5_000), &off, &Scripted::new(0));
        assert_eq!(a, Arrived::Go(Pass::straight(Admitted::Disabled)));
        assert!(w.is_empty());
        assert_eq!(w.next_wake(&off), None);
    }

    #[test]
    fn flow_control_releases_as_room_comes_and_counts_what_is_not_yet_placed() {
        let (mut w, s, h) = (WaitingRoom::new(), both(), Scripted::new(0));
        for id in 1..=2 {
            assert_eq!(w.arrive(0, arrival(id, 0, None, 10), &s, &h), Arrived::Wait);
        }
        assert_eq!(w.queued(), vec![("m".to_owned(), 2)]);
        assert!(w.step(5, &s, &h).is_empty(), "no room");
        // one place frees: the first goes, having waited 10 ms; it is in transit until placed
        h.free.set((1, 1));
        let out = w.step(10, &s, &h);
        assert_eq!(gone(&out), vec![1]);
        let Action::Go { pass, .. } = out[0] else {
            panic!("{out:?}")
        };
        assert_eq!(pass.flow_wait_ms, Some(10));
        assert_eq!(pass.admitted, Admitted::NoSession);
        assert!(w.step(11, &s, &h).is_empty(), "its place is taken");
        // placed, the endpoints count it (the headroom says so, not the gate)
        w.placed("m");
        h.free.set((0, 0));
        assert!(w.step(12, &s, &h).is_empty());
        h.free.set((1, 1));
        assert_eq!(gone(&w.step(13, &s, &h)), vec![2]);
        assert!(w.is_empty());
    }

    #[test]
    fn a_released_request_then_waits_for_admission_and_reserves_its_footprint() {
        let (mut w, s, h) = (WaitingRoom::new(), both(), Scripted::new(0));
        h.live.set(900);
        assert_eq!(
            w.arrive(0, arrival(1, 0, Some(1), 200), &s, &h),
            Arrived::Wait
        );
        h.free.set((5, 5));
        // through flow control at 20, held by admission: 900 + 200 > 1,000
        assert!(w.step(20, &s, &h).is_empty());
        assert_eq!((w.queued().len(), w.admission_waiting()), (0, 1));
        assert_eq!(w.next_wake(&s), Some(520), "its maxWait");
        h.live.set(700);
        let out = w.step(50, &s, &h);
        let [Action::Go { id: 1, pass }] = out[..] else {
            panic!("{out:?}")
        };
        assert_eq!(pass.admitted, Admitted::Fits);
        assert_eq!(
            (pass.flow_wait_ms, pass.admission_wait_ms),
            (Some(20), Some(30))
        );
        assert_eq!(w.reserved(50), 200);
        // a second session does not fit beside the reservation, until it is released
        assert_eq!(
            w.arrive(60, arrival(2, 0, Some(2), 200), &s, &h),
            Arrived::Wait
        );
        assert!(w.step(61, &s, &h).is_empty());
        w.release(pass.reservation.expect("reserved"));
        assert_eq!(gone(&w.step(62, &s, &h)), vec![2]);
    }

    #[test]
    fn leaving_takes_a_request_out_of_any_stage_once() {
        let (mut w, s, h) = (WaitingRoom::new(), both(), Scripted::new(0));
        let later = Arrival {
            not_before_ms: Some(50),
            ..arrival(1, 0, None, 1)
        };
        assert_eq!(w.arrive(0, later, &s, &h), Arrived::Wait);
        assert_eq!(w.arrive(0, arrival(2, 0, None, 1), &s, &h), Arrived::Wait);
        h.free.set((9, 9));
        h.live.set(1_000);
        assert_eq!(
            w.arrive(0, arrival(3, 0, Some(3), 1), &s, &h),
            Arrived::Wait
        );
        assert_eq!(w.len(), 3);
        for id in 1..=3 {
            assert!(w.leave(id), "{id} was waiting");
            assert!(!w.leave(id));
        }
        assert!(w.is_empty());
        assert!(w.step(10_000, &s, &h).is_empty(), "nothing left to answer");
        assert_eq!(w.next_wake(&s), None);
    }

    #[test]
    fn a_retry_comes_back_at_its_time_through_flow_control() {
        let (mut w, s, h) = (WaitingRoom::new(), both(), Scripted::new(1));
        let retry = Arrival {
            not_before_ms: Some(SLO_RETRY_MS),
            ..arrival(1, 0, None, 1)
        };
        assert_eq!(w.arrive(0, retry, &s, &h), Arrived::Wait);
        assert_eq!(w.next_wake(&s), Some(SLO_RETRY_MS));
        assert!(w.step(SLO_RETRY_MS - 1, &s, &h).is_empty());
        let out = w.step(SLO_RETRY_MS, &s, &h);
        assert_eq!(gone(&out), vec![1]);
        // straight through flow control: it did not wait in its queue
        assert!(matches!(out[0], Action::Go { pass, .. } if pass.flow_wait_ms.is_none()));
    }

    #[test]
    fn the_queue_sheds_expires_and_refuses_with_its_reasons() {
        let (mut w, s, h) = (WaitingRoom::new(), both(), Scripted::new(0));
        for id in 1..=3 {
            assert_eq!(
                w.arrive(id, arrival(id, -1, None, 1), &s, &h),
                Arrived::Wait
            );
        }
        // full: a higher band pushes out the newest sheddable one, answered at the next step
        assert_eq!(w.arrive(4, arrival(4, 1, None, 1), &s, &h), Arrived::Wait);
        let refused = |out: &[Action]| -> Vec<(u64, Refusal)> {
            out.iter()
                .filter_map(|a| match *a {
                    Action::Refuse { id, reason, .. } => Some((id, reason)),
                    Action::Go { .. } => None,
                })
                .collect()
        };
        assert_eq!(refused(&w.step(5, &s, &h)), vec![(3, Refusal::Displaced)]);
        // full of its band or higher: refused at once
        assert_eq!(
            w.arrive(6, arrival(5, -1, None, 1), &s, &h),
            Arrived::Refused(Refusal::QueueFull)
        );
        let big = Arrival {
            bytes: 2 << 20,
            ..arrival(6, 1, None, 1)
        };
        assert_eq!(
            w.arrive(6, big, &s, &h),
            Arrived::Refused(Refusal::TooLarge)
        );
        // the TTL
        assert_eq!(w.next_wake(&s), Some(1_001));
        let out = w.step(1_004, &s, &h);
        assert_eq!(
            refused(&out),
            vec![
                (1, Refusal::Expired),
                (2, Refusal::Expired),
                (4, Refusal::Expired)
            ]
        );
        assert!(w.is_empty());
    }

    #[test]
    fn an_objective_is_met_retried_or_refused() {
        assert_eq!(slo_verdict(1_000, 0, 999.0, false), Slo::Met);
        assert_eq!(
            slo_verdict(1_000, 100, 950.0, true),
            Slo::Retry { at_ms: 150 }
        );
        assert_eq!(
            slo_verdict(1_000, 100, 950.0, false),
            Slo::Refuse { left_ms: 900 }
        );
        // too little left to come back
        assert_eq!(
            slo_verdict(1_000, 960, 100.0, true),
            Slo::Refuse { left_ms: 40 }
        );
    }
}
