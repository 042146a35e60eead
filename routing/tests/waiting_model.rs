//! Model-based property test of the waiting room (`routing::waiting`): random arrivals, leaves,
//! steps, headroom and clock changes against a simple reference gate (flat lists scanned on
//! every step: one flow, first come first served inside a band), every answer compared.

use kvroute_routing::admission::{Admitted, Room};
use kvroute_routing::flow::{Fairness, FlowSettings, Order};
use kvroute_routing::waiting::{
    Action, AdmissionLimits, Arrival, Arrived, GateSettings, Headroom, Pass, Refusal, WaitingRoom,
};
use proptest::prelude::*;

const MAX_QUEUED: usize = 4;
const TTL_MS: u64 = 200;
const MAX_LINE: usize = 3;
const MAX_WAIT_MS: u64 = 150;
const CAPACITY: u64 = 100;

#[derive(Debug, Clone)]
enum Op {
    Arrive {
        band: i32,
        prompt: u32,
        session: bool,
    },
    Leave(usize),
    Free(u64, u64),
    Live(u64),
    Step,
    Advance(u64),
    Placed,
    Release(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (-1i32..2, 1u32..60, prop::bool::weighted(0.7))
            .prop_map(|(band, prompt, session)| Op::Arrive { band, prompt, session }),
        1 => (0usize..32).prop_map(Op::Leave),
        2 => (0u64..3, 0u64..3).prop_map(|(a, b)| Op::Free(a.max(b), a.min(b))),
        1 => (0u64..120).prop_map(Op::Live),
        4 => Just(Op::Step),
        2 => (0u64..120).prop_map(Op::Advance),
        1 => Just(Op::Placed),
        1 => (0usize..32).prop_map(Op::Release),
    ]
}

/// The pool as the test sets it.
#[derive(Default)]
struct Pool {
    free: (u64, u64),
    live: u64,
}

impl Headroom for Pool {
    fn free(&self, _: &str, sheddable: bool) -> u64 {
        if sheddable { self.free.1 } else { self.free.0 }
    }

    fn room(&self, session: Option<u64>, prompt: u32, reserved: u64) -> Result<Room, Admitted> {
        session.ok_or(Admitted::NoSession)?;
        Ok(Room {
            live_tokens: self.live + reserved,
            capacity_tokens: CAPACITY,
            footprint_tokens: u64::from(prompt),
        })
    }
}

/// An answer, with the reservation reduced to whether there is one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    Go {
        admitted: Admitted,
        reserved: bool,
        flow_wait_ms: Option<u64>,
        admission_wait_ms: Option<u64>,
    },
    Refuse(Refusal),
    Wait,
}

fn of_pass(p: Pass) -> Answer {
    Answer::Go {
        admitted: p.admitted,
        reserved: p.reservation.is_some(),
        flow_wait_ms: p.flow_wait_ms,
        admission_wait_ms: p.admission_wait_ms,
    }
}

/// The reference: every waiting request in a list, each decision a scan.
#[derive(Default)]
struct Reference {
    /// (id, band, arrival, footprint or none): flow control's queue.
    queue: Vec<(u64, i32, u64, Option<u64>)>,
    /// (id, footprint or none, since, flow wait): admission's line.
    line: Vec<(u64, Option<u64>, u64, Option<u64>)>,
    /// (id, footprint, until)
    reservations: Vec<(u64, u64, u64)>,
    transit: u64,
    outbox: Vec<(u64, Answer)>,
}

impl Reference {
    fn reserved(&self, now: u64) -> u64 {
        self.reservations
            .iter()
            .filter(|r| r.2 > now)
            .map(|r| r.1)
            .sum()
    }

    fn len(&self) -> usize {
        self.queue.len() + self.line.len()
    }

    fn arrive(&mut self, now: u64, id: u64, band: i32, fp: Option<u64>, pool: &Pool) -> Answer {
        let room = if band < 0 { pool.free.1 } else { pool.free.0 };
        if self.queue.is_empty() && room > 0 {
            return self.admit(now, id, fp, None, pool);
        }
        if self.queue.len() >= MAX_QUEUED {
            // the newest of the lowest band below its own
            let victim = self
                .queue
                .iter()
                .filter(|e| e.1 < band)
                .min_by_key(|e| (e.1, std::cmp::Reverse((e.2, e.0))))
                .copied();
            let Some(v) = victim else {
                return Answer::Refuse(Refusal::QueueFull);
            };
            self.queue.retain(|e| e.0 != v.0);
            self.outbox.push((v.0, Answer::Refuse(Refusal::Displaced)));
        }
        self.queue.push((id, band, now, fp));
        Answer::Wait
    }

    fn admit(
        &mut self,
        now: u64,
        id: u64,
        fp: Option<u64>,
        flow: Option<u64>,
        pool: &Pool,
    ) -> Answer {
        let go = |admitted| Answer::Go {
            admitted,
            reserved: false,
            flow_wait_ms: flow,
            admission_wait_ms: None,
        };
        let Some(fp) = fp else {
            return go(Admitted::NoSession);
        };
        if pool.live + self.reserved(now) + fp <= CAPACITY {
            return go(Admitted::Fits);
        }
        if self.line.len() >= MAX_LINE {
            return go(Admitted::QueueFull);
        }
        self.line.push((id, Some(fp), now, flow));
        Answer::Wait
    }

    fn step(&mut self, now: u64, pool: &Pool) -> Vec<(u64, Answer)> {
        let mut out = std::mem::take(&mut self.outbox);
        let mut expired: Vec<(u64, u64)> = self
            .queue
            .iter()
            .filter(|e| e.2 + TTL_MS <= now)
            .map(|e| (e.2 + TTL_MS, e.0))
            .collect();
        expired.sort_unstable();
        for (_, id) in expired {
            self.queue.retain(|e| e.0 != id);
            out.push((id, Answer::Refuse(Refusal::Expired)));
        }
        let mut room = pool.free.0.saturating_sub(self.transit);
        let mut low = pool.free.1.saturating_sub(self.transit);
        let mut released = Vec::new();
        while room > 0 && !self.queue.is_empty() {
            // the highest band, first come first served
            let (i, head) = self
                .queue
                .iter()
                .enumerate()
                .max_by_key(|(_, e)| (e.1, std::cmp::Reverse((e.2, e.0))))
                .map(|(i, e)| (i, *e))
                .expect("not empty");
            if head.1 < 0 {
                if low == 0 {
                    break;
                }
                low -= 1;
            }
            self.queue.remove(i);
            room -= 1;
            released.push(head);
        }
        for (id, _, since, fp) in released {
            let a = self.admit(now, id, fp, Some(now - since), pool);
            if a != Answer::Wait {
                self.transit += 1;
                out.push((id, a));
            }
        }
        let mut i = 0;
        while i < self.line.len() {
            let (id, fp, since, flow) = self.line[i];
            let fp = fp.expect("in line with a footprint");
            let why = if i == 0 && pool.live + self.reserved(now) + fp <= CAPACITY {
                Admitted::Fits
            } else if now >= since + MAX_WAIT_MS {
                Admitted::Timeout
            } else {
                i += 1;
                continue;
            };
            self.line.remove(i);
            self.reservations.retain(|r| r.2 > now);
            self.reservations.push((id, fp, now + MAX_WAIT_MS));
            out.push((
                id,
                Answer::Go {
                    admitted: why,
                    reserved: true,
                    flow_wait_ms: flow,
                    admission_wait_ms: Some(now - since),
                },
            ));
        }
        out
    }

    fn leave(&mut self, id: u64) -> bool {
        let before = self.len();
        self.queue.retain(|e| e.0 != id);
        self.line.retain(|e| e.0 != id);
        self.len() < before
    }
}

fn settings() -> GateSettings {
    GateSettings {
        flow: Some(FlowSettings {
            max_requests: MAX_QUEUED,
            max_bytes: u64::MAX,
            ttl_ms: TTL_MS,
            fairness: Fairness::RoundRobin,
            order: Order::Fcfs,
        }),
        admission: Some(AdmissionLimits {
            max_queue: MAX_LINE,
            max_wait_ms: MAX_WAIT_MS,
        }),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn the_waiting_room_answers_as_the_reference_gate(ops in prop::collection::vec(op(), 1..80)) {
        let s = settings();
        let (mut gate, mut reference, mut pool) = (WaitingRoom::new(), Reference::default(), Pool::default());
        let mut now = 0u64;
        let mut next_id = 0u64;
        let mut reservations = Vec::new();
        for op in ops {
            match op {
                Op::Arrive { band, prompt, session } => {
                    next_id += 1;
                    let fp = session.then_some(u64::from(prompt));
                    let a = Arrival {
                        id: next_id,
                        config: "m".into(),
                        band,
                        flow: 0,
                        tokens: u64::from(prompt),
                        bytes: 1,
                        deadline_ms: None,
                        session: session.then_some(next_id),
                        prompt_tokens: prompt,
                        not_before_ms: None,
                    };
                    let got = match gate.arrive(now, a, &s, &pool) {
                        Arrived::Go(p) => of_pass(p),
                        Arrived::Wait => Answer::Wait,
                        Arrived::Refused(r) => Answer::Refuse(r),
                    };
                    prop_assert_eq!(got, reference.arrive(now, next_id, band, fp, &pool));
                }
                Op::Leave(i) => {
                    let id = i as u64 % (next_id + 1);
                    prop_assert_eq!(gate.leave(id), reference.leave(id));
                }
                Op::Free(all, low) => pool.free = (all, low),
                Op::Live(n) => pool.live = n,
                Op::Advance(ms) => now += ms,
                Op::Placed => {
                    gate.placed("m");
                    reference.transit = reference.transit.saturating_sub(1);
                }
                Op::Release(i) => {
                    if !reservations.is_empty() {
                        let (id, r) = reservations.remove(i % reservations.len());
                        gate.release(r);
                        reference.reservations.retain(|e| e.0 != id);
                    }
                }
                Op::Step => {
                    let got: Vec<(u64, Answer)> = gate
                        .step(now, &s, &pool)
                        .into_iter()
                        .map(|a| match a {
                            Action::Go { id, pass } => {
                                if let Some(r) = pass.reservation {
                                    reservations.push((id, r));
                                }
                                (id, of_pass(pass))
                            }
                            Action::Refuse { id, reason, .. } => (id, Answer::Refuse(reason)),
                        })
                        .collect();
                    prop_assert_eq!(got, reference.step(now, &pool));
                }
            }
            prop_assert_eq!(gate.len(), reference.len());
            prop_assert_eq!(gate.reserved(now), reference.reserved(now));
        }
    }
}
