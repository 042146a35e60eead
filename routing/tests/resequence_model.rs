//! Model-based property test of the KV-event resequencer: a simulated publisher (numbered
//! batches, a bounded replay buffer, restarts) behind a simulated network (dropped, duplicated
//! and reordered live messages, undecodable batches and garbage, replay requests that fail,
//! stop early, skip messages or race with new batches) drives the real
//! [`Resequencer`](kvroute_routing::kv_events::resequence::Resequencer), and a consumer applies
//! what it delivers and clears on every resync.
//!
//! Invariants, checked after every step:
//! - **Safety**: what the consumer holds since its last resync is one publisher process's
//!   history, in order, each batch once, with no batch missing between the first and the last
//!   except batches that were undecodable on the wire (the resequencer reports those and cannot
//!   do better: a replay returns the same bytes). A hole or a batch of another process would
//!   leave the index crediting blocks the engine no longer has.
//! - **Liveness**, at the end, after the link heals (a reconnect, one more batch, an idle
//!   probe): the consumer's view ends at the publisher's newest batch.
//!
//! What the model leaves out, because no subscriber could tell it from the truth:
//! - Messages of a dead publisher process arriving after its successor answers replays. A
//!   restart closes the connection (the engine's socket dies with it, and the picker's frame
//!   relay closes both sides), the subscriber notices before the new process is up (an engine
//!   restart takes seconds), and reconnects; what was queued on the old connection is gone. On
//!   one connection a new process whose batch 0 was dropped would continue the old numbering
//!   indistinguishably (SGLang's topic epochs help only once a live batch of the old process
//!   was seen, and its replies carry none).
//! - Reordering across a restart (TCP keeps order within one connection), and garbage that
//!   decodes as a batch with a plausible number (it is indistinguishable from the publisher's
//!   own; the refusals promised for numbers the publisher never sent are tested in
//!   `tests/zmq_interop.rs`).

use std::collections::{HashMap, HashSet, VecDeque};

use kvroute_routing::kv_events::resequence::{
    Action, Input, Item, ReplayError, Resequencer, ResequencerConfig, Wants,
};
use kvroute_routing::kv_events::{DecodeError, EventBatch};
use proptest::prelude::*;

/// Batches the publisher's replay buffer holds (vLLM's default is 10,000).
const BUFFER: usize = 8;
/// Messages read per replay request: small, so catch-ups take several pages.
const PAGE: usize = 3;
const RESTART_WINDOW: u64 = 16;
/// Garbage numbers start here, far from anything the publisher reaches.
const GARBAGE_SEQ: u64 = 1 << 40;

#[derive(Debug, Clone)]
enum Op {
    /// The publisher publishes a batch; the network delivers it (`lost` = dropped at the
    /// high-water mark; `corrupt` = undecodable, live and in the replay alike).
    Publish { lost: bool, corrupt: bool },
    /// The oldest queued live message reaches the subscriber.
    Receive,
    /// A copy of a recent batch of this process joins the live queue.
    Duplicate(usize),
    /// Two queued live messages of the same process swap places.
    Swap(usize, usize),
    /// The publisher restarts: numbering from 0, buffer empty, a new epoch; the connection
    /// closes and the subscriber reconnects (see the module docs).
    Restart,
    /// The connection drops and is re-established; queued live messages are lost.
    Reconnect,
    /// No live traffic for the probe interval.
    Idle,
    /// An undecodable message with a number far from the stream's.
    Garbage(u64),
    /// A message whose frames did not parse.
    Unreadable,
    /// The publisher's wall clock steps back (NTP): timestamps order batches only roughly.
    ClockStep,
}

/// How the publisher's answer to one replay request goes wrong, if it does.
#[derive(Debug, Clone, Copy)]
enum Fault {
    None,
    /// Cannot connect or send.
    OpenFails,
    /// Times out after this many messages.
    FailsAfter(usize),
    /// The ROUTER dropped the message at this position.
    DropsAt(usize),
    /// The publisher publishes this many batches while answering (they race the reply).
    Races(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (prop::bool::weighted(0.25), prop::bool::weighted(0.08))
            .prop_map(|(lost, corrupt)| Op::Publish { lost, corrupt }),
        6 => Just(Op::Receive),
        1 => (0usize..BUFFER).prop_map(Op::Duplicate),
        1 => (0usize..8, 0usize..8).prop_map(|(a, b)| Op::Swap(a, b)),
        1 => Just(Op::Restart),
        1 => Just(Op::Reconnect),
        1 => Just(Op::Idle),
        1 => (0u64..1_000).prop_map(Op::Garbage),
        1 => Just(Op::Unreadable),
        1 => Just(Op::ClockStep),
    ]
}

fn fault() -> impl Strategy<Value = Fault> {
    prop_oneof![
        6 => Just(Fault::None),
        1 => Just(Fault::OpenFails),
        1 => (0usize..4).prop_map(Fault::FailsAfter),
        1 => (0usize..4).prop_map(Fault::DropsAt),
        1 => (1usize..4).prop_map(Fault::Races),
    ]
}

/// One published batch, as the model knows it.
#[derive(Debug, Clone, Copy)]
struct Published {
    process: u32,
    seq: u64,
    ts: f64,
    corrupt: bool,
}

struct World {
    machine: Resequencer,
    /// Whether the publisher speaks SGLang's topic epochs.
    epochs: bool,
    process: u32,
    next_seq: u64,
    clock: f64,
    buffer: VecDeque<Published>,
    /// Every batch ever published, by timestamp bits (timestamps are unique).
    by_ts: HashMap<u64, Published>,
    /// Batches of each process that were undecodable.
    corrupt: HashSet<(u32, u64)>,
    live: VecDeque<Published>,
    faults: Vec<Fault>,
    next_fault: usize,
    /// The consumer's view since its last resync: (process, seq).
    view: Vec<(u32, u64)>,
}

impl World {
    fn new(replay: bool, epochs: bool, faults: Vec<Fault>) -> Self {
        Self {
            machine: Resequencer::new(ResequencerConfig {
                replay,
                replay_max_batches: PAGE,
                restart_window: RESTART_WINDOW,
            }),
            epochs,
            process: 0,
            next_seq: 0,
            clock: 1_700_000_000.0,
            buffer: VecDeque::new(),
            by_ts: HashMap::new(),
            corrupt: HashSet::new(),
            live: VecDeque::new(),
            faults,
            next_fault: 0,
            view: Vec::new(),
        }
    }

    fn now(&self) -> f64 {
        self.clock
    }

    fn publish(&mut self, lost: bool, corrupt: bool) -> Published {
        self.clock += 0.25;
        // timestamps stay unique (the continuity check compares them; two engine processes
        // stamping the same f64 is not a case worth modelling)
        while self.by_ts.contains_key(&self.clock.to_bits()) {
            self.clock += 0.001;
        }
        let batch = Published {
            process: self.process,
            seq: self.next_seq,
            ts: self.clock,
            corrupt,
        };
        self.next_seq += 1;
        self.by_ts.insert(batch.ts.to_bits(), batch);
        if corrupt {
            self.corrupt.insert((batch.process, batch.seq));
        }
        self.buffer.push_back(batch);
        if self.buffer.len() > BUFFER {
            self.buffer.pop_front();
        }
        if !lost {
            self.live.push_back(batch);
        }
        batch
    }

    fn item(batch: Published) -> Item {
        if batch.corrupt {
            Err(DecodeError::InvalidMarker {
                byte: 0xc1,
                offset: 0,
                what: "batch",
            }
            .into())
        } else {
            Ok(EventBatch {
                ts: batch.ts,
                events: Vec::new(),
                data_parallel_rank: None,
                skipped_unknown: 0,
            })
        }
    }

    fn epoch(&self, process: u32) -> Option<Vec<u8>> {
        self.epochs.then(|| process.to_be_bytes().to_vec())
    }

    fn take_fault(&mut self) -> Fault {
        if self.faults.is_empty() {
            return Fault::None;
        }
        let fault = self.faults[self.next_fault % self.faults.len()];
        self.next_fault += 1;
        fault
    }

    /// Feeds one input, then answers the replay requests it leads to (with `healthy`, none
    /// fails), applying every action and checking the invariant.
    fn step(&mut self, input: Input<'_>, healthy: bool) -> Result<(), TestCaseError> {
        let now = self.now();
        self.machine.handle(input, now);
        self.apply()?;
        let mut guard = 0;
        while let Wants::OpenReplay { from } = self.machine.wants() {
            guard += 1;
            prop_assert!(guard < 1_000, "the resequencer keeps asking for replays");
            let fault = if healthy {
                Fault::None
            } else {
                self.take_fault()
            };
            if matches!(fault, Fault::OpenFails) {
                self.machine.handle(
                    Input::ReplayFailed(ReplayError::Connect("refused".into())),
                    now,
                );
                self.apply()?;
                continue;
            }
            self.machine.handle(Input::ReplayOpened, now);
            self.apply()?;
            // The reply is read lazily from the buffer, as the publisher's ROUTER walks it:
            // batches published meanwhile are in it, and ones evicted meanwhile are not.
            let mut cursor = from;
            let mut sent = 0usize;
            while self.machine.wants() == Wants::ReadReplay {
                if let Fault::Races(n) = fault
                    && sent < n
                {
                    self.publish(false, false);
                }
                if let Fault::FailsAfter(n) = fault
                    && sent == n
                {
                    self.machine
                        .handle(Input::ReplayFailed(ReplayError::ReceiveTimeout), now);
                    self.apply()?;
                    break;
                }
                let next = self.buffer.iter().find(|b| b.seq >= cursor).copied();
                let Some(mut batch) = next else {
                    self.machine.handle(Input::ReplayEnd, now);
                    self.apply()?;
                    break;
                };
                if let Fault::DropsAt(n) = fault
                    && sent == n
                {
                    // this one is lost; the next one (if any) goes out instead
                    match self.buffer.iter().find(|b| b.seq > batch.seq).copied() {
                        Some(after) => batch = after,
                        None => {
                            self.machine.handle(Input::ReplayEnd, now);
                            self.apply()?;
                            break;
                        }
                    }
                }
                cursor = batch.seq + 1;
                sent += 1;
                self.machine
                    .handle(Input::Replayed(Ok((batch.seq, Self::item(batch)))), now);
                self.apply()?;
            }
        }
        prop_assert_eq!(self.machine.wants(), Wants::Live);
        Ok(())
    }

    fn apply(&mut self) -> Result<(), TestCaseError> {
        while let Some(action) = self.machine.next_action() {
            match action {
                Action::Deliver { seq, batch, .. } => {
                    let Some(published) = self.by_ts.get(&batch.ts.to_bits()).copied() else {
                        return Err(TestCaseError::fail(format!(
                            "delivered a batch nobody published: {seq}"
                        )));
                    };
                    prop_assert_eq!(published.seq, seq, "delivered under another number");
                    self.view.push((published.process, seq));
                }
                Action::Resync { .. } => {
                    prop_assert!(!self.view.is_empty(), "resync of an empty view");
                    self.view.clear();
                }
                Action::Skip { .. }
                | Action::Drop { .. }
                | Action::Gap { .. }
                | Action::Continued { .. } => {}
            }
            self.check_view()?;
        }
        // the machine's idea of whether there is a view to clear matches the consumer's
        prop_assert_eq!(self.machine.has_view(), !self.view.is_empty());
        Ok(())
    }

    /// The safety invariant (see the module docs).
    fn check_view(&self) -> Result<(), TestCaseError> {
        for pair in self.view.windows(2) {
            let ((p0, s0), (p1, s1)) = (pair[0], pair[1]);
            prop_assert_eq!(p0, p1, "view mixes publisher processes: {:?}", self.view);
            prop_assert!(s1 > s0, "view out of order or duplicated: {:?}", self.view);
            for missing in s0 + 1..s1 {
                prop_assert!(
                    self.corrupt.contains(&(p0, missing)),
                    "batch {} of process {} missing from the view: {:?}",
                    missing,
                    p0,
                    self.view
                );
            }
        }
        Ok(())
    }

    /// The oldest queued live message reaches the subscriber; `false` when none is queued.
    fn receive(&mut self, healthy: bool) -> Result<bool, TestCaseError> {
        let Some(batch) = self.live.pop_front() else {
            return Ok(false);
        };
        let epoch = self.epoch(batch.process);
        self.step(
            Input::Live {
                seq: batch.seq,
                item: Self::item(batch),
                epoch: epoch.as_deref(),
            },
            healthy,
        )?;
        Ok(true)
    }

    fn run(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::Publish { lost, corrupt } => {
                self.publish(lost, corrupt);
                Ok(())
            }
            Op::Receive => self.receive(false).map(|_| ()),
            Op::Duplicate(back) => {
                if let Some(batch) = self.buffer.iter().rev().nth(back).copied() {
                    self.live.push_back(batch);
                }
                Ok(())
            }
            Op::Swap(a, b) => {
                let same = match (self.live.get(a), self.live.get(b)) {
                    (Some(x), Some(y)) => x.process == y.process,
                    _ => false,
                };
                // only within one process: a restart is a new connection (module docs)
                let between = |i: usize, j: usize| {
                    self.live
                        .range(i.min(j)..=i.max(j))
                        .all(|m| m.process == self.live[i].process)
                };
                if same && between(a, b) {
                    self.live.swap(a, b);
                }
                Ok(())
            }
            Op::Restart => {
                self.process += 1;
                self.next_seq = 0;
                self.buffer.clear();
                self.live.clear();
                self.step(Input::Connected, false)
            }
            Op::Reconnect => {
                self.live.clear();
                self.step(Input::Connected, false)
            }
            Op::Idle => self.step(Input::Idle, false),
            Op::Garbage(n) => {
                let epoch = self.epoch(self.process);
                self.step(
                    Input::Live {
                        seq: GARBAGE_SEQ + n,
                        item: Self::item(Published {
                            process: self.process,
                            seq: GARBAGE_SEQ + n,
                            ts: 0.0,
                            corrupt: true,
                        }),
                        epoch: epoch.as_deref(),
                    },
                    false,
                )
            }
            Op::ClockStep => {
                self.clock -= 30.0;
                Ok(())
            }
            Op::Unreadable => self.step(
                Input::Unreadable(DecodeError::WrongFrameCount { got: 2 }.into()),
                false,
            ),
        }
    }

    /// The link heals: reconnect, one more batch arrives, an idle probe; the view must end
    /// at the publisher's newest batch.
    fn heal(&mut self) -> Result<(), TestCaseError> {
        self.live.clear();
        self.step(Input::Connected, true)?;
        let newest = self.publish(false, false);
        while self.receive(true)? {}
        self.step(Input::Idle, true)?;
        prop_assert_eq!(
            self.view.last().copied(),
            Some((newest.process, newest.seq)),
            "after healing the view does not reach the newest batch: {:?}",
            self.view
        );
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn the_consumer_holds_one_process_history_in_order(
        replay in prop::bool::weighted(0.85),
        epochs in any::<bool>(),
        faults in prop::collection::vec(fault(), 0..12),
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let mut world = World::new(replay, epochs, faults);
        world.step(Input::Connected, false)?;
        for op in &ops {
            world.run(op)?;
        }
        world.heal()?;
    }
}
