//! The KV-event subscriber's sequencing decisions, as a state machine without I/O.
//!
//! A publisher's batches reach the subscriber over two sockets: the live PUB stream, which
//! drops messages under back-pressure, and a replay ROUTER that answers "everything from N
//! on" out of a bounded buffer (DESIGN.md §6). [`Resequencer`] turns what arrives on both into
//! the one ordered stream the index needs — every batch of the current publisher process once,
//! in order — or, when it can no longer vouch for that, a resync that clears the endpoint.
//!
//! It does no I/O and keeps no clock: the socket loop
//! (the picker service's KV subscriber) feeds it [`Input`]s, asks [`Resequencer::wants`]
//! what to read next (the live stream, a new replay request from a number, or the next message
//! of the open one), and carries out the [`Action`]s it queues. Everything the subscriber
//! decides — gaps, duplicates, stale batches, publisher restarts, continuity across reconnects,
//! replay pages and holes, undecodable numbers — is here, so it can be driven by a simulated
//! publisher in a model test (`routing/tests/resequence_model.rs`) as well as by real sockets.
//!
//! # Protocol
//!
//! - [`Wants::Live`]: read the live stream; feed [`Input::Live`] (or [`Input::Unreadable`]),
//!   [`Input::Idle`] after a quiet spell, [`Input::Connected`] after each (re)connection.
//! - [`Wants::OpenReplay`]: drop any open replay request, send a new one for `from` on, then
//!   feed [`Input::ReplayOpened`] or [`Input::ReplayFailed`].
//! - [`Wants::ReadReplay`]: read the next message of the open request and feed
//!   [`Input::Replayed`], [`Input::ReplayEnd`] for the end marker, or [`Input::ReplayFailed`].
//!
//! An input the machine did not ask for is ignored (a debug build asserts): a live batch
//! ignored so is as if the network dropped it, and the next one shows the gap. Each input
//! queues at most a handful of actions; take them all with [`Resequencer::next_action`] before
//! the next input.

use std::collections::VecDeque;
use std::fmt;

use thiserror::Error;
use tracing::{debug, info, warn};

use super::{DecodeError, EventBatch, SeqOutcome, SequenceTracker};

/// Replay requests one catch-up may issue before giving up. A request ends early when it
/// reaches [`ResequencerConfig::replay_max_batches`] or when the engine's ROUTER dropped part
/// of its answer (it drops, rather than blocks, at its high-water mark); the next request
/// resumes after the last batch delivered.
pub const MAX_REPLAY_PAGES: usize = 8;

/// Consecutive live numbers refused by empty replays (see [`MessageError::NotFromPublisher`])
/// after which the resequencer accepts that the publisher keeps no replay buffer and follows
/// it. Bogus numbers are rarely consecutive; a real stream always is.
pub const REFUSALS_BEFORE_FOLLOWING: u32 = 3;

/// One message's batch, or why it did not decode.
pub type Item = Result<EventBatch, MessageError>;

/// What the machine needs to know about the publisher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResequencerConfig {
    /// The publisher has a replay socket. Without one every gap, restart or reconnect is a
    /// resync.
    pub replay: bool,
    /// Most messages read from one replay request.
    pub replay_max_batches: usize,
    /// A number more than this far below the expected one is a publisher restart rather than
    /// a duplicate (see [`SequenceTracker::with_restart_window`]).
    pub restart_window: u64,
}

/// What happened, as the machine's input.
#[derive(Debug)]
pub enum Input<'a> {
    /// Connected (or reconnected) to the publisher.
    Connected,
    /// A live message with a readable sequence number.
    Live {
        /// Its number.
        seq: u64,
        /// Its batch, or why the payload did not decode.
        item: Item,
        /// SGLang's topic epoch, when the topic carries one.
        epoch: Option<&'a [u8]>,
    },
    /// A live message whose frames or number were unusable.
    Unreadable(MessageError),
    /// No live message for the idle-probe interval.
    Idle,
    /// The replay request asked for by [`Wants::OpenReplay`] was sent.
    ReplayOpened,
    /// One message of the open replay request (not the end marker).
    Replayed(Result<(u64, Item), MessageError>),
    /// The open replay request's end marker.
    ReplayEnd,
    /// Opening, sending or reading the replay request failed or timed out.
    ReplayFailed(ReplayError),
}

/// Why a replay request failed. A socket error is kept as its message (the socket library's
/// errors are not comparable), so that a reason can be compared and cloned.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ReplayError {
    /// No replay endpoint is configured.
    #[error("no replay endpoint")]
    NoEndpoint,
    /// A read was asked for while no request was open.
    #[error("no replay request is open")]
    NotOpen,
    #[error("connect: {0}")]
    Connect(String),
    #[error("connect timed out")]
    ConnectTimeout,
    /// The request message could not be built.
    #[error("request: {0}")]
    Request(String),
    #[error("send: {0}")]
    Send(String),
    #[error("send timed out")]
    SendTimeout,
    #[error("receive: {0}")]
    Receive(String),
    #[error("no reply within the replay timeout")]
    ReceiveTimeout,
}

impl ReplayError {
    /// A metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::NoEndpoint => "no_endpoint",
            Self::NotOpen => "not_open",
            Self::Connect(_) => "connect",
            Self::ConnectTimeout => "connect_timeout",
            Self::Request(_) => "request",
            Self::Send(_) => "send",
            Self::SendTimeout => "send_timeout",
            Self::Receive(_) => "receive",
            Self::ReceiveTimeout => "receive_timeout",
        }
    }
}

/// What the socket loop reads next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wants {
    /// The live stream.
    Live,
    /// A new replay request (on a fresh connection) for batches from `from` on.
    OpenReplay {
        /// First number asked for.
        from: u64,
    },
    /// The next message of the open replay request.
    ReadReplay,
}

/// What the socket loop carries out, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Hand the endpoint's next batch to the consumer.
    Deliver {
        /// Its number.
        seq: u64,
        /// The batch.
        batch: EventBatch,
        /// It came from a replay.
        replayed: bool,
    },
    /// Tell the consumer to clear the endpoint's view; what follows rebuilds it. Only queued
    /// when a batch was delivered since the last resync.
    Resync {
        /// Why.
        reason: ResyncReason,
    },
    /// A message was skipped as undecodable, or as not the publisher's; tell the consumer.
    Skip {
        /// Its number, when readable.
        seq: Option<u64>,
        /// Why.
        error: MessageError,
    },
    /// A batch was dropped without telling the consumer (its events are already applied).
    Drop {
        /// Its number.
        seq: u64,
        /// Why.
        reason: DropReason,
    },
    /// The replay showed that the stream continues the view the consumer holds from before a
    /// reconnect (or from a seed, [`Resequencer::resuming`]): batch `seq` with the same
    /// timestamp. What follows it is delivered next.
    Continued {
        /// The last batch the view held.
        seq: u64,
    },
    /// A gap was seen in the live stream (for the counters; the replay follows).
    Gap {
        /// First missing number.
        expected: u64,
        /// The number that revealed it.
        got: u64,
    },
}

/// Why a batch was dropped silently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// Its number was already delivered (a replay overlapped the live stream, or the other
    /// way round).
    Duplicate,
    /// Numbered below what the view holds and older than its newest batch: it waited in the
    /// socket's queue while a replay moved past it.
    Stale,
}

/// Why the subscriber asked for a resync.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResyncReason {
    /// Batches from `missing_from` on were missed and there is no replay socket.
    NoReplayEndpoint {
        /// First missed sequence number.
        missing_from: u64,
    },
    /// The replay started later than requested (the publisher's buffer had moved on), or had
    /// nothing although the publisher had published past the request (`first` = `None`).
    ReplayShort {
        /// First number asked for.
        requested: u64,
        /// First number the replay held.
        first: Option<u64>,
    },
    /// The replay request failed (connect, timeout, socket error).
    ReplayFailed {
        /// First number asked for.
        requested: u64,
        /// Why.
        error: ReplayError,
    },
    /// The replay ended before reaching the batch that revealed the gap (dropped replies).
    ReplayIncomplete {
        /// First number still missing.
        expected: u64,
        /// The live batch that revealed the gap.
        got: u64,
    },
    /// The sequence went back to 0, or far back: the engine restarted, its cache is new.
    PublisherRestarted {
        /// What the old stream expected next.
        expected: u64,
        /// What arrived.
        got: u64,
    },
    /// SGLang's topic epoch changed: the publisher restarted.
    EpochChanged,
    /// After a reconnect, the replay did not show the last batch we delivered with the same
    /// timestamp (the publisher restarted or its buffer moved on), or there is no replay
    /// socket to ask.
    ContinuityLost {
        /// The last sequence number delivered before the disconnect.
        last_seq: u64,
        /// The replay showed another process: that number with another timestamp, or
        /// nothing from it on (a process that sent it still buffers it or later ones).
        /// `false` when it could not tell (the buffer moved on, or no replay).
        restarted: bool,
    },
}

impl ResyncReason {
    /// Whether the engine's cache outlived what was missed: batches were lost but the same
    /// engine process goes on publishing (a gap no replay filled), as opposed to a restart or a
    /// reconnect that cannot tell.
    pub fn cache_survived(&self) -> bool {
        match self {
            Self::NoReplayEndpoint { .. }
            | Self::ReplayShort { .. }
            | Self::ReplayFailed { .. }
            | Self::ReplayIncomplete { .. } => true,
            Self::PublisherRestarted { .. } | Self::EpochChanged | Self::ContinuityLost { .. } => {
                false
            }
        }
    }
}

impl fmt::Display for ResyncReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoReplayEndpoint { missing_from } => {
                write!(
                    f,
                    "missed batches from {missing_from} and no replay endpoint"
                )
            }
            Self::ReplayShort {
                requested,
                first: Some(first),
            } => write!(f, "replay from {requested} started at {first}"),
            Self::ReplayShort {
                requested,
                first: None,
            } => write!(f, "replay from {requested} was empty"),
            Self::ReplayFailed { requested, error } => {
                write!(f, "replay from {requested} failed: {error}")
            }
            Self::ReplayIncomplete { expected, got } => {
                write!(f, "replay stopped at {expected} before live batch {got}")
            }
            Self::PublisherRestarted { expected, got } => {
                write!(f, "publisher restarted (expected {expected}, got {got})")
            }
            Self::EpochChanged => f.write_str("publisher epoch changed"),
            Self::ContinuityLost { last_seq, .. } => {
                write!(
                    f,
                    "cannot show continuity after {last_seq} across a reconnect"
                )
            }
        }
    }
}

/// Why one message was skipped.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum MessageError {
    /// The frames or the payload did not decode.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// The payload is larger than the subscriber's limit.
    #[error("payload of {len} bytes exceeds the limit of {limit}")]
    PayloadTooLarge {
        /// Its size.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// A live message numbered past the newest batch in the publisher's own replay buffer.
    /// Publishers (vLLM's, SGLang's) buffer every batch as they send it, before they answer
    /// a replay request, so the publisher never sent this number: following it would make
    /// every real batch below it look like a duplicate.
    #[error("sequence number {seq} is past the publisher's newest batch (next is {next})")]
    NotFromPublisher {
        /// The number received.
        seq: u64,
        /// The number after the newest batch the replay returned.
        next: u64,
    },
    /// A live message carried the replay end marker's sequence number, which is not a batch.
    #[error("sequence number {seq:#x} is reserved for the replay end marker")]
    ReservedSequence {
        /// The number.
        seq: u64,
    },
}

/// How a whole catch-up (one or more replay requests) ended.
#[derive(Debug)]
enum FillEnd {
    /// Reached the end marker after at least one message.
    Complete,
    /// The first reply was just the end marker.
    Empty,
    /// Gave up after [`MAX_REPLAY_PAGES`] requests without reaching the end.
    GaveUp,
    /// A request failed.
    Failed(ReplayError),
}

/// Where a replayed number stands relative to what was delivered.
enum ReplayPlace {
    Next,
    Duplicate,
    Hole,
}

/// What to do once a catch-up ends.
#[derive(Debug)]
enum Then {
    /// It was the start-up fetch; then this.
    Startup(AfterStartup),
    /// It was an idle probe.
    Probe,
    /// It filled the gap `expected..got` that live batch `got` revealed; place that batch.
    Gap {
        expected: u64,
        got: u64,
        batch: EventBatch,
    },
    /// It caught up after a verified reconnect.
    Resume,
}

/// What follows a start-up fetch.
#[derive(Debug)]
enum AfterStartup {
    Nothing,
    /// The publisher restarted, and live batch `got` of its new process showed it.
    Restarted {
        got: u64,
        batch: EventBatch,
    },
    /// The topic epoch changed at live batch `seq`; sequence it against the new process.
    Epoch {
        seq: u64,
        batch: EventBatch,
    },
}

/// One catch-up in progress.
#[derive(Debug)]
struct Fill {
    /// First number the catch-up asked for.
    from: u64,
    /// First number the current request asks for.
    start: u64,
    /// The first batch of the reply must be `from` (else the buffer moved on: resync).
    check_first: bool,
    /// Any message came in any request of this catch-up.
    received_any: bool,
    /// The current request is open.
    opened: bool,
    /// Requests started, the current one included.
    pages: usize,
    /// Messages read from the current request.
    in_page: usize,
    then: Then,
}

/// What the machine is doing.
#[derive(Debug)]
enum Mode {
    /// Following the live stream.
    Live,
    /// Reconnected with a view: the replay must show the last batch delivered, `seq`, with
    /// the same timestamp, before the rest of its reply counts as what came after it.
    Verifying {
        seq: u64,
        ts_bits: u64,
        opened: bool,
    },
    /// Catching up from the replay.
    Filling(Fill),
}

/// The sequencing state of one publisher (see the module docs).
#[derive(Debug)]
pub struct Resequencer {
    cfg: ResequencerConfig,
    mode: Mode,
    actions: VecDeque<Action>,
    /// The caller's wall clock at the current input, Unix seconds.
    now: f64,
    tracker: SequenceTracker,
    /// When the tracker is unset, the number we know must come next (0 after an empty or
    /// failed start-up replay), so that a first live batch above it is treated as a gap.
    floor: Option<u64>,
    /// Sequence number and timestamp bits of the last batch delivered since the last
    /// resync; `None` when the consumer's view is empty. The timestamp identifies the
    /// publisher process across a reconnect.
    last: Option<(u64, u64)>,
    /// SGLang topic epoch of the current publisher process, once seen.
    epoch: Option<Vec<u8>>,
    /// Timestamp bits of batch 0 of the current publisher process, once delivered.
    /// [`SequenceTracker`] reads any 0 below the expected number as a restart, but a start-up
    /// replay that already delivered 0 overlaps the live stream exactly there; the timestamp
    /// tells that duplicate from a new process.
    zero_ts: Option<u64>,
    /// Newest batch timestamp delivered from the current publisher process. A live batch
    /// numbered below the expected one and older than this is stale, not a restart: it sat
    /// in the socket's queue while a replay moved past it (a restarted process's batches are
    /// newer than anything the old one sent).
    newest_ts: Option<f64>,
    /// The last live number refused because the publisher's replay held nothing from the
    /// expected number on (it never sent it, or it keeps no replay buffer), and how many
    /// consecutive numbers were refused so. [`REFUSALS_BEFORE_FOLLOWING`] in a row show the
    /// stream really is there.
    refused_ahead: Option<(u64, u32)>,
    /// Consecutive live numbers `(first, last)` that arrived undecodable, starting at the
    /// number expected next. An undecodable message never moves the sequence state (its
    /// number may be as corrupt as its payload); only when the next decodable batch follows
    /// the run does the run count as the publisher's own, lost, batches.
    undecoded: Option<(u64, u64)>,
}

impl Resequencer {
    /// A machine that has seen nothing: the consumer's view of the endpoint is empty.
    #[must_use]
    pub fn new(cfg: ResequencerConfig) -> Self {
        Self {
            tracker: SequenceTracker::with_restart_window(cfg.restart_window),
            cfg,
            mode: Mode::Live,
            actions: VecDeque::new(),
            now: 0.0,
            floor: None,
            last: None,
            epoch: None,
            zero_ts: None,
            newest_ts: None,
            refused_ahead: None,
            undecoded: None,
        }
    }

    /// A machine for a consumer that already holds a view up to batch `seq`, whose timestamp
    /// has the bits `ts_bits` (an index copied from a snapshot or a peer replica, with the
    /// position it was taken at): on connecting it asks the replay for that batch, as after a
    /// reconnect, and either continues from it ([`Action::Continued`]) or asks for a resync
    /// ([`ResyncReason::ContinuityLost`]).
    #[must_use]
    pub fn resuming(cfg: ResequencerConfig, seq: u64, ts_bits: u64) -> Self {
        let mut m = Self::new(cfg);
        let _first = m.tracker.observe(seq);
        m.last = Some((seq, ts_bits));
        m.newest_ts = Some(f64::from_bits(ts_bits));
        m
    }

    /// What to read next.
    #[must_use]
    pub fn wants(&self) -> Wants {
        match &self.mode {
            Mode::Live => Wants::Live,
            Mode::Verifying {
                seq, opened: false, ..
            } => Wants::OpenReplay { from: *seq },
            Mode::Filling(Fill {
                start,
                opened: false,
                ..
            }) => Wants::OpenReplay { from: *start },
            Mode::Verifying { .. } | Mode::Filling(_) => Wants::ReadReplay,
        }
    }

    /// The next queued action, oldest first.
    pub fn next_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// Whether the consumer holds anything delivered since the last resync.
    #[must_use]
    pub fn has_view(&self) -> bool {
        self.last.is_some()
    }

    /// Takes one input; `now_unix` is the caller's wall clock (Unix seconds), used only to
    /// ignore batch timestamps from the far future.
    pub fn handle(&mut self, input: Input<'_>, now_unix: f64) {
        self.now = now_unix;
        let live = matches!(self.mode, Mode::Live);
        match input {
            Input::Connected if live => self.after_connect(),
            Input::Live { seq, item, epoch } if live => self.on_live(seq, item, epoch),
            Input::Unreadable(error) if live => self.skip(None, error),
            Input::Idle if live => self.probe(),
            Input::ReplayOpened
            | Input::Replayed(_)
            | Input::ReplayEnd
            | Input::ReplayFailed(_)
                if !live =>
            {
                self.on_replay(input);
            }
            input => debug_assert!(false, "input out of turn ({:?}): {input:?}", self.wants()),
        }
    }

    // ------------------------------------------------------------------------------------------
    // Connection and probing
    // ------------------------------------------------------------------------------------------

    /// Brings the view up to date after a (re)connection.
    fn after_connect(&mut self) {
        match self.last {
            Some((seq, ts_bits)) if self.cfg.replay => {
                // ask the replay for our last batch; the same number with the same timestamp
                // proves the same publisher process, and the rest of the reply is what we
                // missed
                self.mode = Mode::Verifying {
                    seq,
                    ts_bits,
                    opened: false,
                };
            }
            Some((seq, _)) => {
                // Without a replay socket nothing shows whether the publisher restarted
                // while we were away; a restarted one would have its numbers misread as
                // duplicates, so start over.
                self.resync(ResyncReason::ContinuityLost {
                    last_seq: seq,
                    restarted: false,
                });
                self.restart_tracking();
            }
            None => {
                self.restart_tracking();
                self.start_fill(AfterStartup::Nothing);
            }
        }
    }

    /// No message for a while: ask for anything after the last batch seen.
    fn probe(&mut self) {
        if !self.cfg.replay {
            return;
        }
        match self.tracker.expected() {
            Some(next) => self.begin_fill(next, true, Then::Probe),
            None => {
                self.restart_tracking();
                self.start_fill(AfterStartup::Nothing);
            }
        }
    }

    /// Forgets the sequence position and the epoch (new publisher process, or unknown).
    fn restart_tracking(&mut self) {
        self.tracker.reset();
        self.floor = None;
        self.epoch = None;
        self.zero_ts = None;
        self.newest_ts = None;
        self.refused_ahead = None;
        self.undecoded = None;
    }

    /// Fetches everything the publisher still buffers (its process start, when the buffer
    /// reaches back that far), then does `then`. Failures are only logged: the view is
    /// empty, so nothing is wrong yet, and the first live batch retries.
    fn start_fill(&mut self, then: AfterStartup) {
        if self.cfg.replay {
            self.begin_fill(0, true, Then::Startup(then));
        } else {
            self.after_startup(then);
        }
    }

    fn begin_fill(&mut self, from: u64, check_first: bool, then: Then) {
        self.mode = Mode::Filling(Fill {
            from,
            start: from,
            check_first,
            received_any: false,
            opened: false,
            pages: 1,
            in_page: 0,
            then,
        });
    }

    // ------------------------------------------------------------------------------------------
    // Live messages
    // ------------------------------------------------------------------------------------------

    fn on_live(&mut self, seq: u64, item: Item, epoch: Option<&[u8]>) {
        // An undecodable message shows nothing about the stream: a corrupt or foreign
        // message can carry any number (or topic), and one numbered far ahead would otherwise
        // open a gap that clears the view. It is dropped and counted, and moves nothing.
        let batch = match item {
            Ok(batch) => batch,
            Err(error) => {
                self.note_undecoded(seq);
                self.skip(Some(seq), error);
                return;
            }
        };
        self.step_over_undecoded(seq);
        if let Some(epoch) = epoch {
            match &self.epoch {
                Some(known) if known.as_slice() != epoch => {
                    info!("publisher epoch changed: it restarted");
                    self.resync(ResyncReason::EpochChanged);
                    self.restart_tracking();
                    self.epoch = Some(epoch.to_vec());
                    self.start_fill(AfterStartup::Epoch { seq, batch });
                    return;
                }
                Some(_) => {}
                None => self.epoch = Some(epoch.to_vec()),
            }
        }
        self.sequence_live(seq, batch);
    }

    /// Places a decodable live batch of the current publisher process.
    fn sequence_live(&mut self, seq: u64, batch: EventBatch) {
        if seq == 0
            && self.tracker.expected().is_some_and(|next| next > 0)
            && self.zero_ts == Some(batch.ts.to_bits())
        {
            self.drop_batch(seq, DropReason::Duplicate);
            return;
        }
        let below = seq != 0
            && self
                .tracker
                .expected()
                .or(self.floor)
                .is_some_and(|next| seq < next);
        if below && self.newest_ts.is_some_and(|t| batch.ts < t) {
            self.drop_batch(seq, DropReason::Stale);
            return;
        }
        let floor = self.floor.take();
        match self.tracker.observe(seq) {
            SeqOutcome::First => match floor {
                Some(floor) if seq > floor => self.fill_gap(floor, seq, batch),
                _ => self.deliver(seq, Ok(batch), false),
            },
            SeqOutcome::InOrder => self.deliver(seq, Ok(batch), false),
            SeqOutcome::Duplicate => self.drop_batch(seq, DropReason::Duplicate),
            SeqOutcome::Gap { expected, got } => self.fill_gap(expected, got, batch),
            SeqOutcome::Restart { expected, got } => {
                info!(expected, got, "sequence went back: the publisher restarted");
                self.resync(ResyncReason::PublisherRestarted { expected, got });
                let epoch = self.epoch.take();
                self.restart_tracking();
                self.epoch = epoch;
                if got > 0 {
                    self.start_fill(AfterStartup::Restarted { got, batch });
                } else {
                    self.after_fill(got, batch);
                }
            }
        }
    }

    /// Remembers undecodable live number `seq` if it extends the run that starts at the
    /// number expected next (see [`Resequencer::undecoded`]); any other number is ignored.
    fn note_undecoded(&mut self, seq: u64) {
        let next = self.tracker.expected().or(self.floor);
        self.undecoded = match self.undecoded {
            Some((first, last)) if last.checked_add(1) == Some(seq) => Some((first, seq)),
            _ if next == Some(seq) => Some((seq, seq)),
            run => run,
        };
    }

    /// A decodable live batch `seq` arrived: if it directly follows a run of undecodable
    /// numbers that started where the stream was expected to go on, those were the
    /// publisher's batches (lost to the view, as the skips said), so the tracker steps over
    /// them and `seq` is in order rather than a gap.
    fn step_over_undecoded(&mut self, seq: u64) {
        let Some((first, last)) = self.undecoded.take() else {
            return;
        };
        if last.checked_add(1) != Some(seq) || self.tracker.expected().or(self.floor) != Some(first)
        {
            return;
        }
        self.floor = None;
        for n in first..=last {
            // in order by construction: `first` is the expected number
            let _ = self.tracker.observe(n);
        }
    }

    /// Batches `expected..got` were missed; `batch` is batch `got`. Replays the missing ones,
    /// then places `got`.
    fn fill_gap(&mut self, expected: u64, got: u64, batch: EventBatch) {
        self.actions.push_back(Action::Gap { expected, got });
        debug!(expected, got, "sequence gap");
        if !self.cfg.replay {
            self.resync(ResyncReason::NoReplayEndpoint {
                missing_from: expected,
            });
            // the tracker has already moved past `got`
            self.deliver(got, Ok(batch), false);
            return;
        }
        // Re-observe from `expected` so that the replayed batches count as in order.
        self.tracker.reset();
        self.begin_fill(
            expected,
            true,
            Then::Gap {
                expected,
                got,
                batch,
            },
        );
    }

    /// Places live batch `got` after a replay that should have delivered everything before
    /// it (and usually `got` itself).
    fn after_fill(&mut self, got: u64, batch: EventBatch) {
        match self.tracker.observe(got) {
            SeqOutcome::First | SeqOutcome::InOrder => self.deliver(got, Ok(batch), false),
            // the replay delivered it
            SeqOutcome::Duplicate => {}
            SeqOutcome::Gap { expected, got } => {
                self.resync(ResyncReason::ReplayIncomplete { expected, got });
                self.deliver(got, Ok(batch), false);
            }
            SeqOutcome::Restart { expected, got } => {
                self.resync(ResyncReason::PublisherRestarted { expected, got });
                self.deliver(got, Ok(batch), false);
            }
        }
    }

    // ------------------------------------------------------------------------------------------
    // Replay
    // ------------------------------------------------------------------------------------------

    fn on_replay(&mut self, input: Input<'_>) {
        match std::mem::replace(&mut self.mode, Mode::Live) {
            Mode::Live => {}
            Mode::Verifying {
                seq,
                ts_bits,
                opened,
            } => self.on_verify(seq, ts_bits, opened, input),
            Mode::Filling(fill) => self.on_fill(fill, input),
        }
    }

    fn on_verify(&mut self, seq: u64, ts_bits: u64, opened: bool, input: Input<'_>) {
        match input {
            Input::ReplayOpened if !opened => {
                self.mode = Mode::Verifying {
                    seq,
                    ts_bits,
                    opened: true,
                };
            }
            Input::Replayed(Ok((got, Ok(batch))))
                if opened && got == seq && batch.ts.to_bits() == ts_bits =>
            {
                debug!(seq, "continuity verified after reconnect");
                self.actions.push_back(Action::Continued { seq });
                let from = seq.saturating_add(1);
                self.mode = Mode::Filling(Fill {
                    from,
                    start: from,
                    check_first: false,
                    received_any: true,
                    opened: true,
                    pages: 1,
                    in_page: 0,
                    then: Then::Resume,
                });
            }
            other => {
                debug!(reply = ?other, "replay for the continuity check did not verify it");
                let restarted = match &other {
                    Input::Replayed(Ok((got, _))) => *got <= seq,
                    Input::ReplayEnd => opened,
                    _ => false,
                };
                self.resync(ResyncReason::ContinuityLost {
                    last_seq: seq,
                    restarted,
                });
                self.restart_tracking();
                self.start_fill(AfterStartup::Nothing);
            }
        }
    }

    fn on_fill(&mut self, mut fill: Fill, input: Input<'_>) {
        match input {
            Input::ReplayOpened => {
                fill.opened = true;
                fill.in_page = 0;
            }
            Input::ReplayFailed(error) => {
                return self.finish_fill(fill.then, FillEnd::Failed(error));
            }
            Input::ReplayEnd => {
                let end = if fill.received_any {
                    FillEnd::Complete
                } else {
                    FillEnd::Empty
                };
                return self.finish_fill(fill.then, end);
            }
            Input::Replayed(message) => {
                fill.received_any = true;
                fill.in_page += 1;
                match message {
                    Err(error) => self.skip(None, error),
                    Ok((seq, item)) => {
                        if std::mem::take(&mut fill.check_first) && seq > fill.from {
                            info!(
                                from = fill.from,
                                first = seq,
                                "replay buffer no longer reaches back far enough"
                            );
                            self.resync(ResyncReason::ReplayShort {
                                requested: fill.from,
                                first: Some(seq),
                            });
                            self.tracker.reset();
                        }
                        match self.place(seq) {
                            ReplayPlace::Next => {
                                // `place` said First or InOrder; the outcome is known
                                let _ = self.tracker.observe(seq);
                                self.floor = None;
                                self.deliver(seq, item, true);
                            }
                            ReplayPlace::Duplicate => self.drop_batch(seq, DropReason::Duplicate),
                            ReplayPlace::Hole => {
                                debug!(seq, "hole in the replay reply; asking again");
                                return self.next_page(fill);
                            }
                        }
                    }
                }
                if fill.in_page >= self.cfg.replay_max_batches.max(1) {
                    return self.next_page(fill);
                }
            }
            Input::Connected | Input::Live { .. } | Input::Unreadable(_) | Input::Idle => {}
        }
        self.mode = Mode::Filling(fill);
    }

    /// The current request ended early (capped, or a hole): ask again after the last batch
    /// delivered, up to [`MAX_REPLAY_PAGES`] requests.
    fn next_page(&mut self, mut fill: Fill) {
        if fill.pages >= MAX_REPLAY_PAGES {
            warn!(
                from = fill.from,
                "replay did not reach its end marker; giving up"
            );
            return self.finish_fill(fill.then, FillEnd::GaveUp);
        }
        fill.pages += 1;
        fill.start = self.tracker.expected().unwrap_or(fill.start);
        fill.opened = false;
        fill.in_page = 0;
        self.mode = Mode::Filling(fill);
    }

    /// Where a replayed number falls; within one reply an older number is always a duplicate.
    fn place(&self, seq: u64) -> ReplayPlace {
        match self.tracker.expected() {
            None => ReplayPlace::Next,
            Some(next) if seq == next => ReplayPlace::Next,
            Some(next) if seq < next => ReplayPlace::Duplicate,
            Some(_) => ReplayPlace::Hole,
        }
    }

    fn finish_fill(&mut self, then: Then, end: FillEnd) {
        self.mode = Mode::Live;
        match then {
            Then::Startup(after) => {
                match &end {
                    FillEnd::Failed(error) => debug!(%error, "start-up replay failed"),
                    FillEnd::GaveUp => debug!("start-up replay gave up"),
                    FillEnd::Complete | FillEnd::Empty => {}
                }
                if self.tracker.expected().is_none() {
                    // Empty or failed: the publisher's next batch should be 0.
                    self.floor = Some(0);
                }
                self.after_startup(after);
            }
            Then::Probe => match end {
                FillEnd::Failed(error) => debug!(%error, "idle replay probe failed"),
                FillEnd::Complete => debug!("idle replay probe found missed batches"),
                FillEnd::GaveUp | FillEnd::Empty => {}
            },
            Then::Resume => match end {
                FillEnd::Failed(error) => {
                    debug!(%error, "catching up after reconnect failed; a later gap retries");
                }
                FillEnd::GaveUp => debug!("catching up after reconnect gave up"),
                FillEnd::Complete | FillEnd::Empty => {}
            },
            Then::Gap {
                expected,
                got,
                batch,
            } => self.after_gap_fill(expected, got, batch, end),
        }
    }

    fn after_startup(&mut self, after: AfterStartup) {
        match after {
            AfterStartup::Nothing => {}
            AfterStartup::Restarted { got, batch } => {
                self.floor = None;
                self.after_fill(got, batch);
            }
            AfterStartup::Epoch { seq, batch } => self.sequence_live(seq, batch),
        }
    }

    fn after_gap_fill(&mut self, expected: u64, got: u64, batch: EventBatch, end: FillEnd) {
        match end {
            FillEnd::Complete => {
                // the replay reached the publisher's newest batch; if that is before `got`,
                // the publisher never sent `got` (it buffers each batch as it sends it)
                if let Some(next) = self.tracker.expected()
                    && next < got
                {
                    self.skip(Some(got), MessageError::NotFromPublisher { seq: got, next });
                    return;
                }
            }
            FillEnd::GaveUp => {}
            FillEnd::Empty => {
                // the publisher holds nothing from `expected` on, so it did not send `got`
                // either, unless it keeps no replay buffer: then consecutive numbers show
                // the stream really is there
                let run = match self.refused_ahead {
                    Some((last, n)) if last.checked_add(1) == Some(got) => n + 1,
                    _ => 1,
                };
                if run < REFUSALS_BEFORE_FOLLOWING {
                    self.refused_ahead = Some((got, run));
                    self.floor = Some(expected);
                    let error = MessageError::NotFromPublisher {
                        seq: got,
                        next: expected,
                    };
                    self.skip(Some(got), error);
                    return;
                }
                self.refused_ahead = None;
                self.resync(ResyncReason::ReplayShort {
                    requested: expected,
                    first: None,
                });
            }
            FillEnd::Failed(error) => {
                self.resync(ResyncReason::ReplayFailed {
                    requested: expected,
                    error,
                });
            }
        }
        self.after_fill(got, batch);
    }

    // ------------------------------------------------------------------------------------------
    // Actions
    // ------------------------------------------------------------------------------------------

    fn deliver(&mut self, seq: u64, item: Item, replayed: bool) {
        match item {
            Ok(batch) => {
                self.last = Some((seq, batch.ts.to_bits()));
                // a timestamp far in the future (a damaged batch) must not make every real
                // batch look stale
                let plausible = batch.ts.is_finite() && batch.ts <= self.now + 3_600.0;
                if plausible && self.newest_ts.is_none_or(|t| batch.ts > t) {
                    self.newest_ts = Some(batch.ts);
                }
                if seq == 0 {
                    self.zero_ts = Some(batch.ts.to_bits());
                }
                self.actions.push_back(Action::Deliver {
                    seq,
                    batch,
                    replayed,
                });
            }
            Err(error) => self.skip(Some(seq), error),
        }
    }

    fn skip(&mut self, seq: Option<u64>, error: MessageError) {
        self.actions.push_back(Action::Skip { seq, error });
    }

    fn drop_batch(&mut self, seq: u64, reason: DropReason) {
        self.actions.push_back(Action::Drop { seq, reason });
    }

    /// Queues a resync if the consumer holds anything delivered since the last one.
    fn resync(&mut self, reason: ResyncReason) {
        if self.last.take().is_none() {
            debug!(%reason, "view already empty; no resync needed");
            return;
        }
        self.actions.push_back(Action::Resync { reason });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine() -> Resequencer {
        Resequencer::new(ResequencerConfig {
            replay: true,
            replay_max_batches: 4,
            restart_window: 100,
        })
    }

    fn batch(ts: f64) -> EventBatch {
        EventBatch {
            ts,
            events: Vec::new(),
            data_parallel_rank: None,
            skipped_unknown: 0,
        }
    }

    fn drain(m: &mut Resequencer) -> Vec<Action> {
        std::iter::from_fn(|| m.next_action()).collect()
    }

    fn live(m: &mut Resequencer, seq: u64, ts: f64) {
        m.handle(
            Input::Live {
                seq,
                item: Ok(batch(ts)),
                epoch: None,
            },
            ts,
        );
    }

    /// Answers every replay the machine asks for with `history` from its number on.
    fn serve(m: &mut Resequencer, history: &[(u64, f64)]) {
        loop {
            match m.wants() {
                Wants::Live => return,
                Wants::OpenReplay { from } => {
                    m.handle(Input::ReplayOpened, 0.0);
                    for &(seq, ts) in history.iter().filter(|(s, _)| *s >= from) {
                        m.handle(Input::Replayed(Ok((seq, Ok(batch(ts))))), 0.0);
                        if m.wants() != Wants::ReadReplay {
                            break;
                        }
                    }
                    if m.wants() == Wants::ReadReplay {
                        m.handle(Input::ReplayEnd, 0.0);
                    }
                }
                Wants::ReadReplay => m.handle(Input::ReplayEnd, 0.0),
            }
        }
    }

    fn delivered(actions: &[Action]) -> Vec<u64> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Deliver { seq, .. } => Some(*seq),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn replay_placement() {
        let mut m = machine();
        assert!(matches!(m.place(5), ReplayPlace::Next));
        let _ = m.tracker.observe(5);
        assert!(matches!(m.place(6), ReplayPlace::Next));
        assert!(matches!(m.place(5), ReplayPlace::Duplicate));
        assert!(matches!(m.place(8), ReplayPlace::Hole));
    }

    #[test]
    fn start_up_fetches_the_buffer_then_follows_the_live_stream() {
        let mut m = machine();
        let history: Vec<(u64, f64)> = (0..6).map(|s| (s, 10.0 + s as f64)).collect();
        m.handle(Input::Connected, 0.0);
        assert_eq!(m.wants(), Wants::OpenReplay { from: 0 });
        serve(&mut m, &history);
        // six batches over pages of four
        assert_eq!(delivered(&drain(&mut m)), vec![0, 1, 2, 3, 4, 5]);
        live(&mut m, 5, 15.0);
        live(&mut m, 6, 16.0);
        let actions = drain(&mut m);
        assert_eq!(
            actions[0],
            Action::Drop {
                seq: 5,
                reason: DropReason::Duplicate
            }
        );
        assert_eq!(delivered(&actions), vec![6]);
    }

    #[test]
    fn a_gap_is_filled_before_the_batch_that_revealed_it() {
        let mut m = machine();
        m.handle(Input::Connected, 0.0);
        serve(&mut m, &[]);
        live(&mut m, 0, 1.0);
        live(&mut m, 3, 4.0);
        assert_eq!(m.wants(), Wants::OpenReplay { from: 1 });
        serve(&mut m, &[(1, 2.0), (2, 3.0), (3, 4.0)]);
        let actions = drain(&mut m);
        assert!(actions.contains(&Action::Gap {
            expected: 1,
            got: 3
        }));
        assert_eq!(delivered(&actions), vec![0, 1, 2, 3]);
        assert!(!actions.iter().any(|a| matches!(a, Action::Resync { .. })));
    }

    #[test]
    fn a_reconnect_to_a_restarted_publisher_resyncs() {
        let mut m = machine();
        m.handle(Input::Connected, 0.0);
        serve(&mut m, &[(0, 1.0), (1, 2.0)]);
        assert_eq!(delivered(&drain(&mut m)), vec![0, 1]);
        // same numbers, new process: the timestamps differ
        m.handle(Input::Connected, 0.0);
        assert_eq!(m.wants(), Wants::OpenReplay { from: 1 });
        serve(&mut m, &[(0, 5.0), (1, 6.0)]);
        let actions = drain(&mut m);
        assert_eq!(
            actions[0],
            Action::Resync {
                reason: ResyncReason::ContinuityLost {
                    last_seq: 1,
                    restarted: true
                }
            }
        );
        assert_eq!(delivered(&actions), vec![0, 1]);
    }

    #[test]
    fn inputs_out_of_turn_are_refused_in_debug_builds() {
        let mut m = machine();
        m.handle(Input::Connected, 0.0);
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            live(&mut m, 0, 1.0);
        }));
        assert_eq!(caught.is_err(), cfg!(debug_assertions));
    }
}
