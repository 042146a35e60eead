//! Session admission: a gate in front of [`Pool::place`](crate::place::Pool::place) that holds
//! the first turn of a session while the pool's KV cache is taken by the live context of the
//! sessions already in it (`routing.admission`).
//!
//! Past that point every further session makes the others recompute their context: each
//! engine's cache evicts, least recently used first, exactly the context whose turn comes
//! next. Holding the newcomer until a session leaves (its context idle past the reuse
//! horizon) keeps the admitted ones hitting. The gate is two pieces:
//! - [`Room`]: what the pool holds against what it can (read by `Pool::gate`, side-effect
//!   free, so `/v1/pick` can show it);
//! - [`AdmissionQueue`]: the waiting turns in arrival order, bounded in length and in time.
//!   Only the first in line is admitted when there is room, so a large session is not starved
//!   by small ones; any turn is admitted once it has waited `maxWait`. An admitted turn keeps
//!   a reservation of its footprint until its session is pinned ([`AdmissionQueue::release`])
//!   or, if it never is (it failed, its client left), for `maxWait`, so turns admitted back
//!   to back do not all count the same room.
//!
//! The queue holds no timers or wakers: its owner polls it when the pool's working sets change
//! and at the deadline, so the service (async), the offline benchmark (virtual time) and a
//! flow-control gate can drive the same code.

use std::collections::VecDeque;

use serde::Serialize;

/// The pool's KV capacity against the live context of its sessions, for one new session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Room {
    /// The live context of the sessions in the pool, and the footprints of turns admitted
    /// but not yet served (tokens).
    pub live_tokens: u64,
    /// The KV capacity the engines report (tokens), times `admission.overcommit`.
    pub capacity_tokens: u64,
    /// What the new session is expected to hold: its prompt, and for a session not seen
    /// before at least the mean live context of a session.
    pub footprint_tokens: u64,
}

impl Room {
    /// Whether the new session's footprint fits beside the live context.
    pub fn fits(&self) -> bool {
        self.live_tokens.saturating_add(self.footprint_tokens) <= self.capacity_tokens
    }
}

/// Why a turn goes on to placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Admitted {
    /// Admission is off.
    Disabled,
    /// The request names no session.
    NoSession,
    /// Its session has live context in the pool.
    LiveSession,
    /// Some endpoint does not report its KV capacity.
    CapacityUnknown,
    /// Its footprint fits.
    Fits,
    /// It waited `maxWait`.
    Timeout,
    /// `maxQueue` turns were already waiting.
    QueueFull,
}

impl Admitted {
    /// Stable label for metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Disabled => "disabled",
            Self::NoSession => "no_session",
            Self::LiveSession => "live_session",
            Self::CapacityUnknown => "capacity_unknown",
            Self::Fits => "fits",
            Self::Timeout => "timeout",
            Self::QueueFull => "queue_full",
        }
    }
}

/// The gate's answer for one turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Gate {
    /// Go on to placement.
    Admit(Admitted),
    /// Its footprint does not fit: wait in the queue.
    Hold(Room),
}

/// A place in the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ticket(u64);

/// A waiting turn's next step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Turn {
    /// Leave the queue and go on to placement; its footprint is reserved until
    /// [`AdmissionQueue::release`] or `maxWait` passes.
    Admit(Admitted),
    /// Keep waiting, at most until `deadline_ms`.
    Wait { deadline_ms: u64 },
}

#[derive(Debug, Clone, Copy)]
struct Waiter {
    ticket: Ticket,
    since_ms: u64,
}

/// The turns waiting for room, in arrival order (see the module documentation).
#[derive(Debug)]
pub struct AdmissionQueue {
    next: u64,
    waiting: VecDeque<Waiter>,
    /// Footprints of admitted turns not yet served: `(ticket, tokens, until_ms)`, in
    /// admission order.
    reservations: VecDeque<(Ticket, u64, u64)>,
}

impl Default for AdmissionQueue {
    fn default() -> Self {
        Self::new()
    }
}

impl AdmissionQueue {
    pub fn new() -> Self {
        Self {
            next: 0,
            waiting: VecDeque::new(),
            reservations: VecDeque::new(),
        }
    }

    /// Turns waiting.
    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Footprints reserved at `now_ms` for turns admitted and not yet served.
    pub fn reserved(&self, now_ms: u64) -> u64 {
        self.reservations
            .iter()
            .filter(|r| r.2 > now_ms)
            .map(|r| r.1)
            .sum()
    }

    /// Join the end of the line at `now_ms`; `None` when `max_queue` turns already wait.
    pub fn join(&mut self, now_ms: u64, max_queue: usize) -> Option<Ticket> {
        if self.waiting.len() >= max_queue {
            return None;
        }
        let ticket = Ticket(self.next);
        self.next += 1;
        self.waiting.push_back(Waiter {
            ticket,
            since_ms: now_ms,
        });
        Some(ticket)
    }

    /// `ticket`'s turn at `now_ms`, the pool's room being `room`: admitted when it is first in
    /// line (here, and among the turns waiting at the peer replicas: none of theirs waits
    /// since before `first_elsewhere_ms`) and its footprint fits, or when it has waited
    /// `max_wait_ms`. A ticket not in the queue (it left) is admitted at once, reserving
    /// nothing.
    pub fn poll(
        &mut self,
        ticket: Ticket,
        now_ms: u64,
        max_wait_ms: u64,
        room: &Room,
        first_elsewhere_ms: Option<u64>,
    ) -> Turn {
        let Some(pos) = self.waiting.iter().position(|w| w.ticket == ticket) else {
            return Turn::Admit(Admitted::Fits);
        };
        let since = self.waiting[pos].since_ms;
        let deadline_ms = since.saturating_add(max_wait_ms);
        let first = pos == 0 && first_elsewhere_ms.is_none_or(|t| since <= t);
        let why = if first && room.fits() {
            Admitted::Fits
        } else if now_ms >= deadline_ms {
            Admitted::Timeout
        } else {
            return Turn::Wait { deadline_ms };
        };
        self.waiting.remove(pos);
        // expired reservations go; at most one per turn that may still wait or be in flight
        self.reservations.retain(|r| r.2 > now_ms);
        while self.reservations.len() > self.waiting.len() + 1024 {
            self.reservations.pop_front();
        }
        self.reservations.push_back((
            ticket,
            room.footprint_tokens,
            now_ms.saturating_add(max_wait_ms),
        ));
        Turn::Admit(why)
    }

    /// `ticket` gives up (its client went away): it leaves the line.
    pub fn leave(&mut self, ticket: Ticket) {
        self.waiting.retain(|w| w.ticket != ticket);
    }

    /// `ticket`'s turn was served (its session now counts in the working sets): its
    /// reservation goes.
    pub fn release(&mut self, ticket: Ticket) {
        self.reservations.retain(|r| r.0 != ticket);
    }

    /// Since when the first turn in line waits.
    pub fn first_since(&self) -> Option<u64> {
        self.waiting.front().map(|w| w.since_ms)
    }

    /// The earliest deadline among the waiting turns.
    pub fn next_deadline(&self, max_wait_ms: u64) -> Option<u64> {
        self.waiting
            .iter()
            .map(|w| w.since_ms.saturating_add(max_wait_ms))
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn room(live: u64, footprint: u64) -> Room {
        Room {
            live_tokens: live,
            capacity_tokens: 1_000,
            footprint_tokens: footprint,
        }
    }

    #[test]
    fn first_in_line_is_admitted_when_it_fits_and_reserves_its_footprint() {
        let mut q = AdmissionQueue::new();
        let a = q.join(0, 8).expect("room in the queue");
        let b = q.join(5, 8).expect("room in the queue");
        assert_eq!(q.len(), 2);
        // b fits but a is first: b waits for a
        assert_eq!(
            q.poll(b, 10, 1_000, &room(0, 100), None),
            Turn::Wait { deadline_ms: 1_005 }
        );
        assert_eq!(
            q.poll(a, 10, 1_000, &room(950, 100), None),
            Turn::Wait { deadline_ms: 1_000 },
            "does not fit"
        );
        assert_eq!(q.reserved(10), 0);
        assert_eq!(
            q.poll(a, 20, 1_000, &room(900, 100), None),
            Turn::Admit(Admitted::Fits)
        );
        assert_eq!(q.reserved(20), 100);
        // now b is first
        assert_eq!(
            q.poll(b, 30, 1_000, &room(100, 150), None),
            Turn::Admit(Admitted::Fits)
        );
        assert!(q.is_empty());
        assert_eq!(q.reserved(30), 250);
        // a is served: its reservation goes; b's lapses after maxWait (it was never served)
        q.release(a);
        assert_eq!(q.reserved(30), 150);
        assert_eq!(q.reserved(1_029), 150);
        assert_eq!(q.reserved(1_030), 0);
    }

    /// Issue 49, item 3: the first in line here goes only when no turn waits at a peer
    /// replica since before it (their lines are one line, in arrival order).
    #[test]
    fn a_turn_waiting_longer_at_a_peer_replica_goes_first() {
        let mut q = AdmissionQueue::new();
        let a = q.join(5, 8).expect("room in the queue");
        let fits = room(0, 100);
        assert_eq!(
            q.poll(a, 10, 1_000, &fits, Some(3)),
            Turn::Wait { deadline_ms: 1_005 },
            "a peer's turn waits since 3"
        );
        assert_eq!(q.reserved(10), 0);
        // the peer's turn went (or it is since 5 too): a goes
        assert_eq!(
            q.poll(a, 11, 1_000, &fits, Some(5)),
            Turn::Admit(Admitted::Fits)
        );
        // maxWait is not delayed by the peers
        let b = q.join(20, 8).expect("room in the queue");
        assert_eq!(
            q.poll(b, 1_020, 1_000, &fits, Some(0)),
            Turn::Admit(Admitted::Timeout)
        );
    }

    #[test]
    fn waits_are_bounded_in_time_and_the_line_in_length() {
        let mut q = AdmissionQueue::new();
        let a = q.join(0, 2).expect("room");
        let b = q.join(100, 2).expect("room");
        assert_eq!(q.join(100, 2), None, "maxQueue reached");
        assert_eq!(q.next_deadline(500), Some(500));
        let full = room(1_000, 100);
        // b times out behind a that still does not fit: b leaves first
        assert_eq!(
            q.poll(b, 599, 500, &full, None),
            Turn::Wait { deadline_ms: 600 }
        );
        assert_eq!(
            q.poll(b, 600, 500, &full, None),
            Turn::Admit(Admitted::Timeout)
        );
        assert_eq!(q.len(), 1);
        assert!(q.join(600, 2).is_some(), "a place freed");
        // a client that goes away leaves the line; polling its ticket admits it, reserving
        // nothing
        let before = q.reserved(700);
        q.leave(a);
        assert_eq!(q.len(), 1);
        assert_eq!(
            q.poll(a, 700, 500, &full, None),
            Turn::Admit(Admitted::Fits)
        );
        assert_eq!(q.reserved(700), before);
    }

    #[test]
    fn a_footprint_fits_up_to_the_capacity() {
        assert!(room(900, 100).fits());
        assert!(!room(901, 100).fits());
        assert!(!room(u64::MAX, 1).fits(), "saturates instead of wrapping");
    }
}
