//! Plays a [`Plan`] against a clock it does not own.
//!
//! The driver is a pure state machine: the caller asks when the next request is due
//! ([`Driver::next_due`]), hands it the current time to release what is due
//! ([`Driver::release_due`]), and reports each response's end ([`Driver::complete`]), which
//! schedules the session's next request after its think time. The offline simulator calls it
//! in virtual time and the live runner in (scaled) wall time, so both replay the same sessions
//! in the same way.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;

use rustc_hash::FxHashMap;

use super::workload::tokens::mix64;
use super::workload::weka::LOCAL_ID_LIMIT;
use super::workload::{Node, Plan, TraceRequest, Workload};

/// A request to send now.
#[derive(Debug, Clone)]
pub struct Issue {
    /// Unique, increasing in release order.
    pub id: u64,
    /// The session it belongs to (for session headers).
    pub session: u64,
    /// When it was released (its arrival, for latency accounting).
    pub release_ms: f64,
    /// Global hash ids.
    pub hash_ids: Arc<[u64]>,
    pub input_len: u32,
    pub output_len: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Timer {
    /// Start timed session `i` (index into the plan).
    StartTimed(usize),
    /// Start the next concurrent session.
    StartNext,
    /// Send thread `t`'s current request.
    Release(usize),
}

/// A sequence of nodes being played: a session's main thread or one of its sub-agents.
#[derive(Debug)]
struct Thread {
    session: u64,
    /// Added to local hash ids (0 for plans with global ids).
    id_space: Option<u64>,
    nodes: Arc<[Node]>,
    cursor: usize,
    parent: Option<usize>,
    children: usize,
    waiting_children: bool,
}

/// Time keys must be totally ordered: milliseconds as ordered bits of a non-negative f64.
fn key(t: f64) -> u64 {
    t.max(0.0).to_bits()
}

pub struct Driver {
    plan: Plan,
    timers: BinaryHeap<Reverse<(u64, u64, Timer)>>,
    seq: u64,
    threads: Vec<Option<Thread>>,
    free_threads: Vec<usize>,
    inflight: FxHashMap<u64, usize>,
    next_request: u64,
    next_session: u64,
    max_requests: usize,
    released: usize,
    active_sessions: usize,
    stopped: bool,
    /// Nothing is released after this time (ms); `None` = no deadline.
    deadline_ms: Option<f64>,
}

impl Driver {
    /// A driver releasing at most `max_requests` requests. Without a limit a timed plan plays
    /// all its sessions, and a concurrent plan as many passes over its templates as it has
    /// slots per template (so that every slot plays about one whole session).
    pub fn new(workload: &Workload, max_requests: Option<usize>) -> Self {
        let per_pass = workload.requests_per_pass();
        let default = match &workload.plan {
            Plan::Timed(_) => per_pass,
            Plan::Concurrent {
                templates,
                concurrency,
                ..
            } => per_pass * (concurrency / templates.len().max(1)).max(1),
        };
        let max_requests = max_requests.unwrap_or(default);
        let mut d = Self {
            plan: workload.plan.clone(),
            timers: BinaryHeap::new(),
            seq: 0,
            threads: Vec::new(),
            free_threads: Vec::new(),
            inflight: FxHashMap::default(),
            next_request: 0,
            next_session: 0,
            max_requests,
            released: 0,
            active_sessions: 0,
            stopped: max_requests == 0,
            deadline_ms: None,
        };
        match &workload.plan {
            Plan::Timed(sessions) => {
                if let Some(first) = sessions.first() {
                    d.push(first.start_ms, Timer::StartTimed(0));
                }
            }
            Plan::Concurrent {
                concurrency,
                stagger_ms,
                templates,
            } => {
                if !templates.is_empty() {
                    for i in 0..*concurrency {
                        d.push(i as f64 * stagger_ms, Timer::StartNext);
                    }
                }
            }
        }
        d
    }

    /// Release nothing after `deadline_ms` (a run of bounded duration: requests in flight
    /// then still complete).
    pub fn with_deadline(mut self, deadline_ms: Option<f64>) -> Self {
        self.deadline_ms = deadline_ms.filter(|d| d.is_finite() && *d >= 0.0);
        self
    }

    /// Requests this run will release at most.
    pub fn total_requests(&self) -> usize {
        self.max_requests
    }

    pub fn released(&self) -> usize {
        self.released
    }

    fn push(&mut self, at_ms: f64, t: Timer) {
        self.seq += 1;
        self.timers.push(Reverse((key(at_ms), self.seq, t)));
    }

    /// When the next timer fires (`None`: nothing scheduled; the run ends once the requests
    /// in flight complete).
    pub fn next_due(&self) -> Option<f64> {
        self.timers
            .peek()
            .map(|Reverse((k, _, _))| f64::from_bits(*k))
    }

    /// Whether everything released has completed and nothing more will be.
    pub fn finished(&self) -> bool {
        self.timers.is_empty() && self.inflight.is_empty()
    }

    /// Requests released and not completed.
    pub fn in_flight(&self) -> usize {
        self.inflight.len()
    }

    /// Fire every timer due at or before `now_ms`, appending the requests to send to `out`.
    pub fn release_due(&mut self, now_ms: f64, out: &mut Vec<Issue>) {
        while let Some(Reverse((k, _, _))) = self.timers.peek() {
            let at = f64::from_bits(*k);
            if at > now_ms {
                break;
            }
            if self.deadline_ms.is_some_and(|d| at > d) {
                self.stopped = true;
                self.timers.clear();
                break;
            }
            let Some(Reverse((_, _, timer))) = self.timers.pop() else {
                break;
            };
            match timer {
                Timer::StartTimed(i) => self.start_timed(i, at, out),
                Timer::StartNext => self.start_next(at, out),
                Timer::Release(t) => self.release(t, at, out),
            }
        }
    }

    /// A request finished (successfully or not) at `now_ms`.
    pub fn complete(&mut self, id: u64, now_ms: f64, out: &mut Vec<Issue>) {
        let Some(t) = self.inflight.remove(&id) else {
            return;
        };
        if let Some(th) = self.threads.get_mut(t).and_then(Option::as_mut) {
            th.cursor += 1;
        }
        self.advance(t, now_ms, out);
    }

    fn start_timed(&mut self, i: usize, at: f64, out: &mut Vec<Issue>) {
        let Plan::Timed(sessions) = &self.plan else {
            return;
        };
        if self.stopped {
            return;
        }
        let nodes = sessions[i].nodes.clone();
        if let Some(next) = sessions.get(i + 1) {
            let start = next.start_ms;
            self.push(start, Timer::StartTimed(i + 1));
        }
        self.spawn_session(nodes, None, at, out);
    }

    fn start_next(&mut self, at: f64, out: &mut Vec<Issue>) {
        let Plan::Concurrent { templates, .. } = &self.plan else {
            return;
        };
        if self.stopped || templates.is_empty() {
            return;
        }
        let k = self.next_session;
        let nodes = templates[(k % templates.len() as u64) as usize].clone();
        // a fresh id space per copy: copies are distinct conversations
        let space = (k + 1).wrapping_mul(LOCAL_ID_LIMIT);
        self.spawn_session(nodes, Some(space), at, out);
    }

    fn spawn_session(
        &mut self,
        nodes: Arc<[Node]>,
        id_space: Option<u64>,
        at: f64,
        out: &mut Vec<Issue>,
    ) {
        let session = self.next_session;
        self.next_session += 1;
        self.active_sessions += 1;
        let t = self.new_thread(Thread {
            session,
            id_space,
            nodes,
            cursor: 0,
            parent: None,
            children: 0,
            waiting_children: false,
        });
        self.advance(t, at, out);
    }

    fn new_thread(&mut self, th: Thread) -> usize {
        match self.free_threads.pop() {
            Some(i) => {
                self.threads[i] = Some(th);
                i
            }
            None => {
                self.threads.push(Some(th));
                self.threads.len() - 1
            }
        }
    }

    /// Move thread `t` forward from its cursor: spawn sub-agents, then schedule its next
    /// request (after its sub-agents and its think time), or end it.
    fn advance(&mut self, t: usize, now_ms: f64, out: &mut Vec<Issue>) {
        loop {
            let Some(th) = self.threads.get(t).and_then(Option::as_ref) else {
                return;
            };
            if self.stopped {
                self.end_thread(t, now_ms, out);
                return;
            }
            match th.nodes.get(th.cursor).cloned() {
                Some(Node::Subagent(children)) => {
                    let child = Thread {
                        session: th.session,
                        id_space: th.id_space,
                        nodes: children.into(),
                        cursor: 0,
                        parent: Some(t),
                        children: 0,
                        waiting_children: false,
                    };
                    if let Some(th) = self.threads.get_mut(t).and_then(Option::as_mut) {
                        th.cursor += 1;
                        th.children += 1;
                    }
                    let c = self.new_thread(child);
                    self.advance(c, now_ms, out);
                }
                Some(Node::Request { think_ms, .. }) => {
                    if th.children > 0 {
                        if let Some(th) = self.threads.get_mut(t).and_then(Option::as_mut) {
                            th.waiting_children = true;
                        }
                        return;
                    }
                    self.push(now_ms + think_ms, Timer::Release(t));
                    return;
                }
                None => {
                    if th.children > 0 {
                        if let Some(th) = self.threads.get_mut(t).and_then(Option::as_mut) {
                            th.waiting_children = true;
                        }
                        return;
                    }
                    self.end_thread(t, now_ms, out);
                    return;
                }
            }
        }
    }

    fn end_thread(&mut self, t: usize, now_ms: f64, out: &mut Vec<Issue>) {
        let Some(th) = self.threads.get_mut(t).and_then(Option::take) else {
            return;
        };
        self.free_threads.push(t);
        match th.parent {
            Some(p) => {
                let resume = match self.threads.get_mut(p).and_then(Option::as_mut) {
                    Some(parent) => {
                        parent.children = parent.children.saturating_sub(1);
                        parent.children == 0 && std::mem::take(&mut parent.waiting_children)
                    }
                    None => false,
                };
                if resume {
                    self.advance(p, now_ms, out);
                }
            }
            None => {
                self.active_sessions = self.active_sessions.saturating_sub(1);
                if matches!(self.plan, Plan::Concurrent { .. }) && !self.stopped {
                    self.push(now_ms, Timer::StartNext);
                }
            }
        }
    }

    fn release(&mut self, t: usize, at: f64, out: &mut Vec<Issue>) {
        let Some(th) = self.threads.get(t).and_then(Option::as_ref) else {
            return;
        };
        if self.released >= self.max_requests {
            self.stopped = true;
            self.timers.clear();
            self.end_thread(t, at, out);
            return;
        }
        let Some(Node::Request { req, .. }) = th.nodes.get(th.cursor) else {
            return;
        };
        let hash_ids = globalize(req, th.id_space);
        let issue = Issue {
            id: self.next_request,
            session: th.session,
            release_ms: at,
            hash_ids,
            input_len: req.input_len,
            output_len: req.output_len,
        };
        self.next_request += 1;
        self.released += 1;
        if self.released >= self.max_requests {
            // nothing more will be sent: drop every pending start and think timer so that a
            // real-time run does not sleep through them
            self.stopped = true;
            self.timers.clear();
        }
        self.inflight.insert(issue.id, t);
        out.push(issue);
    }
}

/// Hash ids of a request in the id space of its session copy.
fn globalize(req: &TraceRequest, space: Option<u64>) -> Arc<[u64]> {
    match space {
        None => req.hash_ids.clone(),
        Some(s) => req
            .hash_ids
            .iter()
            .map(|&h| {
                if h < LOCAL_ID_LIMIT {
                    s.wrapping_add(h)
                } else {
                    mix64(s ^ h)
                }
            })
            .collect(),
    }
}
