//! The KV-event subscriber feed: one task per engine publisher (endpoint and data-parallel
//! rank) that turns the engine's ZMQ stream (DESIGN.md §6) into an ordered sequence of
//! [`SubscriberEvent`]s for the service task that applies them to the index.
//!
//! # What the consumer sees
//!
//! Batches arrive in sequence order, each exactly once, across reconnects and replays. When the
//! subscriber can no longer vouch for the endpoint's view (a gap it could not replay, a
//! publisher restart, a reconnect it could not verify) it sends [`SubscriberEvent::Resync`]:
//! the consumer clears the endpoint's blocks, and the batches that follow rebuild them. A
//! partial view (blocks missing) only costs cache hits; a stale one (blocks the engine evicted)
//! sends requests to the wrong place, so every doubt resolves to a `Resync`.
//!
//! # Sequence numbers, gaps and replay
//!
//! A ZMQ PUB socket drops messages for a subscriber that does not keep up (its high-water
//! mark), so gaps are normal. The subscriber tracks numbers with [`SequenceTracker`]; on a gap
//! it asks the publisher's replay socket (a ROUTER; we connect a DEALER, send an empty delimiter
//! and the 8-byte big-endian start number, and read `("", topic, seq, payload)` messages from
//! vLLM 0.32, `("", seq, payload)` from older vLLM and SGLang, up to the end marker; see
//! [`crate::kv_events::replay_frames`]) for the missed batches and delivers them before the
//! batch that revealed the gap.
//! Each replay request uses a fresh DEALER connection, so a reply to an abandoned (timed-out or
//! capped) request can never be mistaken for the answer to the next one; replays are rare
//! enough that the extra handshake does not matter.
//!
//! The same mechanism covers start-up (the engine published before we connected: fetch from 0),
//! reconnects (the replay must still hold the last batch we delivered, with the same publisher
//! timestamp, to prove that the publisher did not restart in between) and idle streams (a
//! dropped batch followed by silence would never show up as a gap, so after
//! [`SubscriberConfig::idle_probe`] without traffic the subscriber asks for anything newer
//! than what it has).
//!
//! # Back-pressure
//!
//! The sink is a bounded channel and the subscriber awaits it. While it waits it does not read
//! the SUB socket, so the kernel's TCP buffers fill and the engine's PUB socket starts dropping
//! messages for us at its high-water mark: memory stays bounded on both sides and the engine
//! is never slowed down. The drops surface as a gap once the consumer catches up, and the
//! replay fills it (or, if the engine's buffer has moved on, a `Resync` follows). Routing never
//! waits on this task.
//!
//! # Bounds
//!
//! Payload bytes ([`SubscriberConfig::max_payload_bytes`]) and decoded sizes
//! ([`DecodeLimits`]) per message; batches per replay request
//! ([`SubscriberConfig::replay_max_batches`]) and requests per catch-up ([`MAX_REPLAY_PAGES`]);
//! every network wait has a timeout or is cancellable.
//!
//! # What the `zeromq` crate (0.7) does and does not do
//!
//! - Interoperates with libzmq (pyzmq 27 / libzmq 4.3 PUB and ROUTER; tested in
//!   `tests/zmq_interop.rs`): it greets as ZMTP 3.0 and sends subscriptions as messages, which
//!   libzmq accepts from 3.0 peers.
//! - `SubSocket::connect` retries a refused connection by itself (50 ms doubling to 30 s)
//!   until the socket's connect timeout, so a publisher that is not up yet is reached; after a
//!   disconnect it would also reconnect on its own with a fixed backoff. We use a fresh socket
//!   per connection instead, watch its monitor for the disconnect, and apply our own backoff.
//! - `subscribe` takes a `&str`, so a non-UTF-8 topic is subscribed as "" and filtered here.
//! - A SUB socket has no receive high-water mark: nothing is read until we poll, so
//!   back-pressure reaches the publisher through TCP, as intended above.
//! - No ZMTP heartbeats and no TCP keepalive: a peer that vanishes without closing its
//!   connection (node loss) is not noticed here; the endpoint set removing the engine (and
//!   cancelling this task) covers that.
//! - No maximum message size (libzmq's `ZMQ_MAXMSGSIZE`): the codec reserves the length a
//!   frame header announces before reading it, so a peer announcing an absurd frame makes
//!   the allocation fail and aborts the process. [`SubscriberConfig::max_payload_bytes`]
//!   only bounds what is decoded. The picker service therefore never points this subscriber
//!   at an engine directly: it connects through a frame-checking relay on loopback
//!   ([`crate::service::feeds::zmtp_guard`]) that cuts any connection announcing a frame above the
//!   limit. Use the relay too when embedding this subscriber elsewhere.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use futures::channel::mpsc as fmpsc;
use thiserror::Error;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, warn};
use zeromq::{
    DealerSocket, Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqMessage,
};

use crate::kv_events::{
    DecodeError, DecodeLimits, EventBatch, REPLAY_END_SEQ, SeqOutcome, SequenceTracker,
    decode_event_batch, is_replay_end, parse_seq, replay_frames, seq_frame, split_topic_epoch,
};

/// Replay requests one catch-up may issue before giving up. A request ends early when it
/// reaches [`SubscriberConfig::replay_max_batches`] or when the engine's ROUTER dropped part of
/// its answer (it drops, rather than blocks, at its high-water mark); the next request resumes
/// after the last batch delivered.
pub const MAX_REPLAY_PAGES: usize = 8;

/// Settings of one subscriber (one engine publisher).
#[derive(Debug, Clone)]
pub struct SubscriberConfig {
    /// The engine's PUB endpoint, `tcp://host:port` (vLLM default port 5557, plus the rank).
    pub publisher: String,
    /// The engine's replay ROUTER endpoint, if it has one. Without it every gap, restart or
    /// reconnect is a [`SubscriberEvent::Resync`].
    pub replay: Option<String>,
    /// Topic prefix to subscribe to (ZMQ prefix semantics; empty = everything, vLLM's default).
    pub topic: Vec<u8>,
    /// Bounds for decoding each payload.
    pub limits: DecodeLimits,
    /// Largest payload decoded; larger ones are a [`MessageError::PayloadTooLarge`].
    pub max_payload_bytes: usize,
    /// First delay before reconnecting, doubled after each failure up to `reconnect_max` (and
    /// back to this after a connection that lasted `reconnect_max`).
    pub reconnect_min: Duration,
    /// Longest delay between reconnection attempts.
    pub reconnect_max: Duration,
    /// How long one connection attempt may take. Within it the `zeromq` crate retries a
    /// refused TCP connection on its own (from 50 ms, doubling), then does the ZMTP handshake.
    pub connect_timeout: Duration,
    /// How long to wait for the replay socket to connect, and for each message of a replay.
    pub replay_timeout: Duration,
    /// Most batches read from one replay request (vLLM and SGLang buffer 10,000 by default).
    pub replay_max_batches: usize,
    /// After this long without a message, ask the replay socket for anything newer than the
    /// last batch seen (catches a dropped tail). `None` disables it.
    pub idle_probe: Option<Duration>,
    /// A sequence number more than this far below the expected one is a publisher restart
    /// rather than a duplicate (see [`SequenceTracker::with_restart_window`]).
    pub restart_window: u64,
    /// Capacity for the sink channel; [`SubscriberConfig::channel`] uses it.
    pub channel_capacity: usize,
    /// Counters the subscriber updates; share the `Arc` to export them as metrics.
    pub stats: Arc<SubscriberStats>,
}

impl SubscriberConfig {
    /// Defaults for everything but the endpoint.
    #[must_use]
    pub fn new(publisher: impl Into<String>) -> Self {
        Self {
            publisher: publisher.into(),
            replay: None,
            topic: Vec::new(),
            limits: DecodeLimits::default(),
            max_payload_bytes: 64 * 1024 * 1024,
            reconnect_min: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            replay_timeout: Duration::from_secs(2),
            replay_max_batches: 16_384,
            idle_probe: Some(Duration::from_secs(5)),
            restart_window: SequenceTracker::DEFAULT_RESTART_WINDOW,
            channel_capacity: 1024,
            stats: Arc::new(SubscriberStats::default()),
        }
    }

    /// A bounded sink channel of [`SubscriberConfig::channel_capacity`] (at least 1).
    #[must_use]
    pub fn channel(
        &self,
    ) -> (
        mpsc::Sender<SubscriberEvent>,
        mpsc::Receiver<SubscriberEvent>,
    ) {
        mpsc::channel(self.channel_capacity.max(1))
    }
}

/// What the subscriber tells its consumer, in stream order.
#[derive(Debug, Clone, PartialEq)]
pub enum SubscriberEvent {
    /// Connected (or reconnected) to the publisher. Informational: the view is kept.
    Connected,
    /// The connection to the publisher was lost; the subscriber reconnects with backoff. The
    /// view is kept for now: after reconnecting the subscriber either proves continuity or
    /// sends a `Resync`. A consumer may treat the endpoint's view as aging meanwhile.
    Disconnected {
        /// Why, for logs.
        error: String,
    },
    /// The next batch of this endpoint: apply it.
    Batch {
        /// Its sequence number.
        seq: u64,
        /// The decoded events.
        batch: EventBatch,
    },
    /// The endpoint's view can no longer be trusted: clear all its blocks now. The batches
    /// that follow rebuild it (from the replay buffer when there is one). Only sent when at
    /// least one batch was delivered since the last `Resync`, so there is something to clear.
    Resync {
        /// Why.
        reason: ResyncReason,
    },
    /// A message could not be decoded; it is skipped and counted. When its sequence number
    /// was readable, the events of that batch are lost to the view; the subscriber does not
    /// resynchronize for it, because a replay would return the same bytes and a publisher that
    /// keeps sending something undecodable would otherwise clear the endpoint over and over.
    DecodeError {
        /// The message's sequence number, when its frames got that far.
        seq: Option<u64>,
        /// What was wrong.
        error: MessageError,
    },
}

/// Why the subscriber asked for a [`SubscriberEvent::Resync`].
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
        error: String,
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
    },
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
            Self::ContinuityLost { last_seq } => {
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
    /// The payload is larger than [`SubscriberConfig::max_payload_bytes`].
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

/// Counters of one subscriber, updated with relaxed atomics (they feed metrics only).
#[derive(Debug, Default)]
pub struct SubscriberStats {
    messages: AtomicU64,
    batches: AtomicU64,
    replayed_batches: AtomicU64,
    duplicates: AtomicU64,
    gaps: AtomicU64,
    replay_requests: AtomicU64,
    replay_failures: AtomicU64,
    resyncs: AtomicU64,
    decode_errors: AtomicU64,
    connects: AtomicU64,
    disconnects: AtomicU64,
    foreign_topic: AtomicU64,
}

/// A copy of [`SubscriberStats`] at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SubscriberStatsSnapshot {
    /// Messages received on the SUB socket (live stream, before any filtering).
    pub messages: u64,
    /// Batches delivered (live and replayed).
    pub batches: u64,
    /// Of those, batches that came from a replay.
    pub replayed_batches: u64,
    /// Batches dropped as already delivered.
    pub duplicates: u64,
    /// Gaps detected in the live stream.
    pub gaps: u64,
    /// Replay requests sent.
    pub replay_requests: u64,
    /// Replay requests that failed (connect, timeout, socket error).
    pub replay_failures: u64,
    /// `Resync` events sent.
    pub resyncs: u64,
    /// Messages skipped as undecodable.
    pub decode_errors: u64,
    /// Successful connections to the publisher.
    pub connects: u64,
    /// Connections lost.
    pub disconnects: u64,
    /// Messages whose topic did not match (only when the topic is not UTF-8 and so is
    /// filtered locally, or the publisher ignores subscriptions).
    pub foreign_topic: u64,
}

impl SubscriberStats {
    /// Reads every counter.
    #[must_use]
    pub fn snapshot(&self) -> SubscriberStatsSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        SubscriberStatsSnapshot {
            messages: get(&self.messages),
            batches: get(&self.batches),
            replayed_batches: get(&self.replayed_batches),
            duplicates: get(&self.duplicates),
            gaps: get(&self.gaps),
            replay_requests: get(&self.replay_requests),
            replay_failures: get(&self.replay_failures),
            resyncs: get(&self.resyncs),
            decode_errors: get(&self.decode_errors),
            connects: get(&self.connects),
            disconnects: get(&self.disconnects),
            foreign_topic: get(&self.foreign_topic),
        }
    }
}

fn bump(counter: &AtomicU64) -> u64 {
    counter.fetch_add(1, Ordering::Relaxed) + 1
}

/// Starts the subscriber task. It runs until `cancel` fires or the sink's receiver is dropped,
/// reconnecting with backoff whenever the publisher goes away; it never fails otherwise.
///
/// The consumer starts with an empty view of this endpoint: a new subscriber sends no
/// `Resync` for state it did not deliver, so clear the endpoint before spawning a replacement.
#[must_use = "the task stops only through `cancel`; keep the handle to await it"]
pub fn spawn_subscriber(
    cfg: SubscriberConfig,
    sink: mpsc::Sender<SubscriberEvent>,
    cancel: CancellationToken,
) -> JoinHandle<()> {
    let span = tracing::info_span!("kv_subscriber", publisher = %cfg.publisher);
    tokio::spawn(
        async move {
            let mut feed = Feed::new(cfg, sink, cancel);
            // `Err(Stopped)` is the only way out of `run`: cancellation or a closed sink.
            let Err(Stopped) = feed.run().await;
            debug!("kv subscriber stopped");
        }
        .instrument(span),
    )
}

/// The task must stop: cancelled, or the consumer dropped the receiver.
#[derive(Debug)]
struct Stopped;

type Step<T = ()> = Result<T, Stopped>;

/// One decoded message: its sequence number and the batch (or why it did not decode).
type Item = Result<EventBatch, MessageError>;

/// How one replay request (page) ended.
enum PageEnd {
    /// The end marker arrived.
    End,
    /// [`SubscriberConfig::replay_max_batches`] messages were read.
    Capped,
    /// A number was skipped inside the reply (the ROUTER dropped part of it).
    Hole,
    /// Connect, send or receive failed or timed out.
    Failed(String),
}

/// How a whole catch-up (one or more pages) ended.
enum FillEnd {
    /// Reached the end marker after at least one batch.
    Complete,
    /// The first reply was just the end marker.
    Empty,
    /// Gave up after [`MAX_REPLAY_PAGES`] requests without reaching the end.
    GaveUp,
    /// A request failed.
    Failed(String),
}

/// Where a replayed number stands relative to what was delivered.
enum ReplayPlace {
    Next,
    Duplicate,
    Hole,
}

/// The subscriber's state; lives inside the task.
struct Feed {
    cfg: SubscriberConfig,
    stats: Arc<SubscriberStats>,
    sink: mpsc::Sender<SubscriberEvent>,
    cancel: CancellationToken,
    tracker: SequenceTracker,
    /// When the tracker is unset, the number we know must come next (0 after an empty or
    /// failed start-up replay), so that a first live batch above it is treated as a gap.
    floor: Option<u64>,
    /// Sequence number and timestamp bits of the last batch delivered since the last
    /// `Resync`; `None` when the consumer's view is empty. The timestamp identifies the
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

impl Feed {
    fn new(
        cfg: SubscriberConfig,
        sink: mpsc::Sender<SubscriberEvent>,
        cancel: CancellationToken,
    ) -> Self {
        Self {
            stats: Arc::clone(&cfg.stats),
            tracker: SequenceTracker::with_restart_window(cfg.restart_window),
            cfg,
            sink,
            cancel,
            floor: None,
            last: None,
            epoch: None,
            zero_ts: None,
            newest_ts: None,
            refused_ahead: None,
            undecoded: None,
        }
    }

    // --------------------------------------------------------------------------------------
    // Connection lifecycle
    // --------------------------------------------------------------------------------------

    async fn run(&mut self) -> Step<std::convert::Infallible> {
        let mut backoff = self.cfg.reconnect_min;
        loop {
            let (mut sub, mut monitor) = match self.connect().await? {
                Ok(connected) => connected,
                Err(error) => {
                    debug!(%error, ?backoff, "cannot connect to the KV-event publisher yet");
                    self.sleep(backoff).await?;
                    backoff = self.grow(backoff);
                    continue;
                }
            };
            bump(&self.stats.connects);
            info!("connected to the KV-event publisher");
            self.emit(SubscriberEvent::Connected).await?;
            let started = Instant::now();
            let error = self.session(&mut sub, &mut monitor).await?;
            drop(sub);
            bump(&self.stats.disconnects);
            warn!(%error, "lost the KV-event publisher; reconnecting");
            self.emit(SubscriberEvent::Disconnected { error }).await?;
            if started.elapsed() >= self.cfg.reconnect_max {
                backoff = self.cfg.reconnect_min;
            }
            self.sleep(backoff).await?;
            backoff = self.grow(backoff);
        }
    }

    fn grow(&self, backoff: Duration) -> Duration {
        backoff
            .saturating_mul(2)
            .min(self.cfg.reconnect_max)
            .max(self.cfg.reconnect_min)
    }

    /// One connection attempt with a fresh socket. A fresh socket per attempt (rather than
    /// the crate's own background reconnection) keeps the backoff ours and makes every
    /// reconnect visible, which the continuity check after it needs.
    async fn connect(&self) -> Step<Result<(SubSocket, fmpsc::Receiver<SocketEvent>), String>> {
        let mut options = SocketOptions::default();
        options.connect_timeout(self.cfg.connect_timeout);
        let mut sub = SubSocket::with_options(options);
        let monitor = sub.monitor();
        // `subscribe` takes a `&str`; a topic that is not UTF-8 is filtered locally instead.
        let subscription = std::str::from_utf8(&self.cfg.topic).unwrap_or("");
        // With no peer yet this only records the subscription, which the socket sends on
        // every (re)connection.
        if let Err(error) = sub.subscribe(subscription).await {
            return Ok(Err(format!("subscribe: {error}")));
        }
        let connected = self
            .guard(tokio::time::timeout(
                // the socket's own timeout covers the attempt; this one is a backstop
                self.cfg
                    .connect_timeout
                    .saturating_add(Duration::from_secs(1)),
                sub.connect(&self.cfg.publisher),
            ))
            .await?;
        Ok(match connected {
            Ok(Ok(())) => Ok((sub, monitor)),
            Ok(Err(error)) => Err(error.to_string()),
            Err(_) => Err("connect timed out".to_owned()),
        })
    }

    /// Reads the stream until the connection is lost; returns why.
    async fn session(
        &mut self,
        sub: &mut SubSocket,
        monitor: &mut fmpsc::Receiver<SocketEvent>,
    ) -> Step<String> {
        self.after_connect().await?;
        let probe = self.cfg.replay.as_ref().and(self.cfg.idle_probe);
        loop {
            // (a day stands in for "never" when probing is off; the branch is disabled anyway)
            let idle = tokio::time::sleep(probe.unwrap_or(Duration::from_secs(86_400)));
            let message = tokio::select! {
                biased;
                () = self.cancel.cancelled() => return Err(Stopped),
                event = monitor.next() => match event {
                    Some(SocketEvent::Disconnected(_)) => {
                        return Ok("publisher closed the connection".to_owned());
                    }
                    Some(_) => continue,
                    None => return Ok("socket monitor closed".to_owned()),
                },
                received = sub.recv() => received,
                () = idle, if probe.is_some() => {
                    self.probe().await?;
                    continue;
                }
            };
            match message {
                Ok(message) => self.on_live(&message).await?,
                Err(error) => return Ok(error.to_string()),
            }
        }
    }

    /// Brings the view up to date after a (re)connection.
    async fn after_connect(&mut self) -> Step {
        match self.last {
            Some((seq, ts_bits)) if self.cfg.replay.is_some() => self.resume(seq, ts_bits).await,
            Some((seq, _)) => {
                // Without a replay socket nothing shows whether the publisher restarted
                // while we were away; a restarted one would have its numbers misread as
                // duplicates, so start over.
                self.resync(ResyncReason::ContinuityLost { last_seq: seq })
                    .await?;
                self.restart_tracking();
                Ok(())
            }
            None => {
                self.restart_tracking();
                self.start_fill().await
            }
        }
    }

    /// Reconnected with a view: ask the replay for our last batch; the same number with the
    /// same publisher timestamp proves the same publisher process, and the rest of the reply
    /// is what we missed. Anything else starts over.
    async fn resume(&mut self, seq: u64, ts_bits: u64) -> Step {
        let Some(endpoint) = self.cfg.replay.clone() else {
            return Ok(());
        };
        bump(&self.stats.replay_requests);
        let mut dealer = match self.open_replay(&endpoint, seq).await? {
            Ok(dealer) => Some(dealer),
            Err(error) => {
                bump(&self.stats.replay_failures);
                debug!(%error, "replay for the continuity check failed");
                None
            }
        };
        let mut verified = false;
        if let Some(socket) = dealer.as_mut() {
            match self.recv_replay(socket).await? {
                Ok(message) => {
                    let frames: Vec<&[u8]> = message.iter().map(Bytes::as_ref).collect();
                    if let Ok((got, Ok(batch))) = self.parse_replay(&frames) {
                        verified = got == seq && batch.ts.to_bits() == ts_bits;
                    }
                }
                Err(error) => {
                    bump(&self.stats.replay_failures);
                    debug!(%error, "replay for the continuity check failed");
                }
            }
        }
        match dealer {
            Some(socket) if verified => {
                debug!(seq, "continuity verified after reconnect");
                match self
                    .fill_with(&endpoint, Some(socket), seq + 1, false)
                    .await?
                {
                    FillEnd::Failed(error) => {
                        debug!(%error, "catching up after reconnect failed; a later gap retries");
                    }
                    FillEnd::GaveUp => debug!("catching up after reconnect gave up"),
                    FillEnd::Complete | FillEnd::Empty => {}
                }
                Ok(())
            }
            _ => {
                self.resync(ResyncReason::ContinuityLost { last_seq: seq })
                    .await?;
                self.restart_tracking();
                self.start_fill().await
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
    /// reaches back that far). Failures are only logged: the view is empty, so nothing is
    /// wrong yet, and the first live batch retries.
    async fn start_fill(&mut self) -> Step {
        let Some(endpoint) = self.cfg.replay.clone() else {
            return Ok(());
        };
        match self.fill_with(&endpoint, None, 0, true).await? {
            FillEnd::Failed(error) => debug!(%error, "start-up replay failed"),
            FillEnd::GaveUp => debug!("start-up replay gave up"),
            FillEnd::Complete | FillEnd::Empty => {}
        }
        if self.tracker.expected().is_none() {
            // Empty or failed: the publisher's next batch should be 0.
            self.floor = Some(0);
        }
        Ok(())
    }

    /// No message for a while: ask for anything after the last batch seen.
    async fn probe(&mut self) -> Step {
        let Some(endpoint) = self.cfg.replay.clone() else {
            return Ok(());
        };
        match self.tracker.expected() {
            Some(next) => match self.fill_with(&endpoint, None, next, true).await? {
                FillEnd::Failed(error) => debug!(%error, "idle replay probe failed"),
                FillEnd::Complete => debug!(from = next, "idle replay probe found missed batches"),
                FillEnd::GaveUp | FillEnd::Empty => {}
            },
            None => {
                self.restart_tracking();
                self.start_fill().await?;
            }
        }
        Ok(())
    }

    // --------------------------------------------------------------------------------------
    // Live messages
    // --------------------------------------------------------------------------------------

    async fn on_live(&mut self, message: &ZmqMessage) -> Step {
        bump(&self.stats.messages);
        let frames: Vec<&[u8]> = message.iter().map(Bytes::as_ref).collect();
        if let Some(topic) = frames.first()
            && !topic.starts_with(&self.cfg.topic)
        {
            bump(&self.stats.foreign_topic);
            return Ok(());
        }
        let (seq, item) = match self.parse(&frames) {
            Ok(parsed) => parsed,
            Err(error) => return self.decode_error(None, error).await,
        };
        // An undecodable message shows nothing about the stream: a corrupt or foreign
        // message can carry any number (or topic), and one numbered far ahead would otherwise
        // open a gap that clears the view. It is dropped and counted, and moves nothing.
        let batch = match item {
            Ok(batch) => batch,
            Err(error) => {
                self.note_undecoded(seq);
                return self.decode_error(Some(seq), error).await;
            }
        };
        self.step_over_undecoded(seq);
        let item: Item = Ok(batch);
        if let Some(topic) = frames.first()
            && let (_, Some(epoch)) = split_topic_epoch(topic)
        {
            match &self.epoch {
                Some(known) if known.as_slice() != epoch => {
                    info!("publisher epoch changed: it restarted");
                    self.resync(ResyncReason::EpochChanged).await?;
                    self.restart_tracking();
                    self.epoch = Some(epoch.to_vec());
                    self.start_fill().await?;
                }
                Some(_) => {}
                None => self.epoch = Some(epoch.to_vec()),
            }
        }
        if seq == 0
            && self.tracker.expected().is_some_and(|next| next > 0)
            && let (Some(zero), Ok(batch)) = (self.zero_ts, &item)
            && batch.ts.to_bits() == zero
        {
            bump(&self.stats.duplicates);
            return Ok(());
        }
        let below = seq != 0
            && self
                .tracker
                .expected()
                .or(self.floor)
                .is_some_and(|next| seq < next);
        let item = match item {
            // older than what the view already holds: it waited in the socket's queue while
            // a replay moved past it
            Ok(batch) if below && self.newest_ts.is_some_and(|t| batch.ts < t) => {
                bump(&self.stats.duplicates);
                return Ok(());
            }
            other => other,
        };
        let floor = self.floor.take();
        match self.tracker.observe(seq) {
            SeqOutcome::First => match floor {
                Some(floor) if seq > floor => self.fill_gap(floor, seq, item).await,
                _ => self.deliver(seq, item, false).await,
            },
            SeqOutcome::InOrder => self.deliver(seq, item, false).await,
            SeqOutcome::Duplicate => {
                bump(&self.stats.duplicates);
                Ok(())
            }
            SeqOutcome::Gap { expected, got } => self.fill_gap(expected, got, item).await,
            SeqOutcome::Restart { expected, got } => {
                info!(expected, got, "sequence went back: the publisher restarted");
                self.resync(ResyncReason::PublisherRestarted { expected, got })
                    .await?;
                let epoch = self.epoch.take();
                self.restart_tracking();
                self.epoch = epoch;
                if got > 0 {
                    self.start_fill().await?;
                    self.floor = None;
                }
                self.after_fill(got, item).await
            }
        }
    }

    /// Remembers undecodable live number `seq` if it extends the run that starts at the
    /// number expected next (see [`Feed::undecoded`]); any other number is ignored.
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
    /// publisher's batches (lost to the view, as [`SubscriberEvent::DecodeError`] says), so
    /// the tracker steps over them and `seq` is in order rather than a gap.
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

    /// Batches `expected..got` were missed; `item` is batch `got`. Replays the missing ones,
    /// then delivers `got` in its place.
    async fn fill_gap(&mut self, expected: u64, got: u64, item: Item) -> Step {
        bump(&self.stats.gaps);
        debug!(expected, got, "sequence gap");
        let Some(endpoint) = self.cfg.replay.clone() else {
            self.resync(ResyncReason::NoReplayEndpoint {
                missing_from: expected,
            })
            .await?;
            // the tracker has already moved past `got`
            return self.deliver(got, item, false).await;
        };
        // Re-observe from `expected` so that the replayed batches count as in order.
        self.tracker.reset();
        match self.fill_with(&endpoint, None, expected, true).await? {
            FillEnd::Complete => {
                // the replay reached the publisher's newest batch; if that is before `got`,
                // the publisher never sent `got` (it buffers each batch as it sends it)
                if let Some(next) = self.tracker.expected()
                    && next < got
                {
                    return self
                        .decode_error(Some(got), MessageError::NotFromPublisher { seq: got, next })
                        .await;
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
                    return self
                        .decode_error(
                            Some(got),
                            MessageError::NotFromPublisher {
                                seq: got,
                                next: expected,
                            },
                        )
                        .await;
                }
                self.refused_ahead = None;
                self.resync(ResyncReason::ReplayShort {
                    requested: expected,
                    first: None,
                })
                .await?;
            }
            FillEnd::Failed(error) => {
                self.resync(ResyncReason::ReplayFailed {
                    requested: expected,
                    error,
                })
                .await?;
            }
        }
        self.after_fill(got, item).await
    }

    /// Places live batch `got` after a replay that should have delivered everything before
    /// it (and usually `got` itself).
    async fn after_fill(&mut self, got: u64, item: Item) -> Step {
        match self.tracker.observe(got) {
            SeqOutcome::First | SeqOutcome::InOrder => self.deliver(got, item, false).await,
            SeqOutcome::Duplicate => Ok(()),
            SeqOutcome::Gap { expected, got } => {
                self.resync(ResyncReason::ReplayIncomplete { expected, got })
                    .await?;
                self.deliver(got, item, false).await
            }
            SeqOutcome::Restart { expected, got } => {
                self.resync(ResyncReason::PublisherRestarted { expected, got })
                    .await?;
                self.deliver(got, item, false).await
            }
        }
    }

    // --------------------------------------------------------------------------------------
    // Replay
    // --------------------------------------------------------------------------------------

    /// Replays from `from`, delivering in order, over up to [`MAX_REPLAY_PAGES`] requests.
    /// `dealer` is an already-open request whose answer continues at `from`. With
    /// `check_first`, a reply starting after `from` means the batches before it are gone:
    /// `Resync`, then deliver what there is.
    async fn fill_with(
        &mut self,
        endpoint: &str,
        mut dealer: Option<DealerSocket>,
        from: u64,
        check_first: bool,
    ) -> Step<FillEnd> {
        let mut start = from;
        let mut check_first = check_first;
        let mut received_any = dealer.is_some();
        for _ in 0..MAX_REPLAY_PAGES {
            let mut socket = match dealer.take() {
                Some(socket) => socket,
                None => {
                    bump(&self.stats.replay_requests);
                    match self.open_replay(endpoint, start).await? {
                        Ok(socket) => socket,
                        Err(error) => {
                            bump(&self.stats.replay_failures);
                            return Ok(FillEnd::Failed(error));
                        }
                    }
                }
            };
            let (end, received) = self
                .drain_page(&mut socket, start, &mut check_first)
                .await?;
            received_any |= received;
            match end {
                PageEnd::End if received_any => return Ok(FillEnd::Complete),
                PageEnd::End => return Ok(FillEnd::Empty),
                PageEnd::Failed(error) => {
                    bump(&self.stats.replay_failures);
                    return Ok(FillEnd::Failed(error));
                }
                PageEnd::Capped | PageEnd::Hole => {
                    start = self.tracker.expected().unwrap_or(start);
                }
            }
        }
        warn!(from, "replay did not reach its end marker; giving up");
        Ok(FillEnd::GaveUp)
    }

    /// Reads one replay reply. Returns how it ended and whether any batch message came.
    async fn drain_page(
        &mut self,
        socket: &mut DealerSocket,
        from: u64,
        check_first: &mut bool,
    ) -> Step<(PageEnd, bool)> {
        let mut count = 0usize;
        let mut received = false;
        loop {
            let message = match self.recv_replay(socket).await? {
                Ok(message) => message,
                Err(error) => return Ok((PageEnd::Failed(error), received)),
            };
            let frames: Vec<&[u8]> = message.iter().map(Bytes::as_ref).collect();
            if is_replay_end(&frames) {
                return Ok((PageEnd::End, received));
            }
            received = true;
            count += 1;
            match self.parse_replay(&frames) {
                Err(error) => self.decode_error(None, error).await?,
                Ok((seq, item)) => {
                    if std::mem::take(check_first) && seq > from {
                        info!(
                            from,
                            first = seq,
                            "replay buffer no longer reaches back far enough"
                        );
                        self.resync(ResyncReason::ReplayShort {
                            requested: from,
                            first: Some(seq),
                        })
                        .await?;
                        self.tracker.reset();
                    }
                    match self.place(seq) {
                        ReplayPlace::Next => {
                            // `place` said First or InOrder; the outcome is known
                            let _ = self.tracker.observe(seq);
                            self.floor = None;
                            self.deliver(seq, item, true).await?;
                        }
                        ReplayPlace::Duplicate => {
                            bump(&self.stats.duplicates);
                        }
                        ReplayPlace::Hole => {
                            debug!(seq, "hole in the replay reply; asking again");
                            return Ok((PageEnd::Hole, received));
                        }
                    }
                }
            }
            if count >= self.cfg.replay_max_batches.max(1) {
                return Ok((PageEnd::Capped, received));
            }
        }
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

    /// Connects a fresh DEALER to the replay ROUTER and sends the request for `from` on.
    async fn open_replay(&self, endpoint: &str, from: u64) -> Step<Result<DealerSocket, String>> {
        let mut options = SocketOptions::default();
        options.connect_timeout(self.cfg.replay_timeout);
        let mut dealer = DealerSocket::with_options(options);
        let timeout = self.cfg.replay_timeout;
        match self
            .guard(tokio::time::timeout(timeout, dealer.connect(endpoint)))
            .await?
        {
            Ok(Ok(())) => {}
            Ok(Err(error)) => return Ok(Err(format!("connect: {error}"))),
            Err(_) => return Ok(Err("connect timed out".to_owned())),
        }
        // The empty delimiter makes the ROUTER see (identity, "", start) as a REQ would send.
        let request = match ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&seq_frame(from)),
        ]) {
            Ok(request) => request,
            Err(error) => return Ok(Err(format!("request: {error:?}"))),
        };
        match self
            .guard(tokio::time::timeout(timeout, dealer.send(request)))
            .await?
        {
            Ok(Ok(())) => Ok(Ok(dealer)),
            Ok(Err(error)) => Ok(Err(format!("send: {error}"))),
            Err(_) => Ok(Err("send timed out".to_owned())),
        }
    }

    async fn recv_replay(&self, socket: &mut DealerSocket) -> Step<Result<ZmqMessage, String>> {
        Ok(
            match self
                .guard(tokio::time::timeout(self.cfg.replay_timeout, socket.recv()))
                .await?
            {
                Ok(Ok(message)) => Ok(message),
                Ok(Err(error)) => Err(error.to_string()),
                Err(_) => Err("no reply within the replay timeout".to_owned()),
            },
        )
    }

    // --------------------------------------------------------------------------------------
    // Decoding and delivery
    // --------------------------------------------------------------------------------------

    /// Splits a live message `(topic, seq, payload)`. `Err` when the sequence number itself
    /// is unusable; a bad payload is an `Err` item with its number.
    fn parse(&self, frames: &[&[u8]]) -> Result<(u64, Item), MessageError> {
        let &[_, seq, payload] = frames else {
            return Err(DecodeError::WrongFrameCount { got: frames.len() }.into());
        };
        self.parse_parts(seq, payload)
    }

    /// [`Feed::parse`] for a replay reply, in any framing of [`replay_frames`] (vLLM 0.32's
    /// `("", topic, seq, payload)`, older `("", seq, payload)`).
    fn parse_replay(&self, frames: &[&[u8]]) -> Result<(u64, Item), MessageError> {
        let (_, seq, payload) = replay_frames(frames)?;
        self.parse_parts(seq, payload)
    }

    fn parse_parts(&self, seq: &[u8], payload: &[u8]) -> Result<(u64, Item), MessageError> {
        let seq = parse_seq(seq)?;
        if seq == REPLAY_END_SEQ {
            return Err(MessageError::ReservedSequence { seq });
        }
        if payload.len() > self.cfg.max_payload_bytes {
            let error = MessageError::PayloadTooLarge {
                len: payload.len(),
                limit: self.cfg.max_payload_bytes,
            };
            return Ok((seq, Err(error)));
        }
        Ok((
            seq,
            decode_event_batch(payload, &self.cfg.limits).map_err(MessageError::from),
        ))
    }

    async fn deliver(&mut self, seq: u64, item: Item, replayed: bool) -> Step {
        match item {
            Ok(batch) => {
                self.last = Some((seq, batch.ts.to_bits()));
                // a timestamp far in the future (a damaged batch) must not make every real
                // batch look stale
                let plausible =
                    batch.ts.is_finite() && batch.ts <= crate::kv_events::unix_now() + 3_600.0;
                if plausible && self.newest_ts.is_none_or(|t| batch.ts > t) {
                    self.newest_ts = Some(batch.ts);
                }
                if seq == 0 {
                    self.zero_ts = Some(batch.ts.to_bits());
                }
                bump(&self.stats.batches);
                if replayed {
                    bump(&self.stats.replayed_batches);
                }
                self.emit(SubscriberEvent::Batch { seq, batch }).await
            }
            Err(error) => self.decode_error(Some(seq), error).await,
        }
    }

    async fn decode_error(&mut self, seq: Option<u64>, error: MessageError) -> Step {
        let count = bump(&self.stats.decode_errors);
        // power-of-two sampling keeps a garbage stream from flooding the log
        if count.is_power_of_two() {
            warn!(?seq, %error, count, "undecodable KV-event message skipped");
        } else {
            debug!(?seq, %error, "undecodable KV-event message skipped");
        }
        self.emit(SubscriberEvent::DecodeError { seq, error }).await
    }

    /// Sends a `Resync` if the consumer holds anything delivered since the last one.
    async fn resync(&mut self, reason: ResyncReason) -> Step {
        if self.last.take().is_none() {
            debug!(%reason, "view already empty; no resync needed");
            return Ok(());
        }
        bump(&self.stats.resyncs);
        warn!(%reason, "resynchronizing the endpoint's KV view");
        self.emit(SubscriberEvent::Resync { reason }).await
    }

    // --------------------------------------------------------------------------------------
    // Plumbing
    // --------------------------------------------------------------------------------------

    /// Waits for the consumer (back-pressure, see the module docs), or stops.
    async fn emit(&self, event: SubscriberEvent) -> Step {
        tokio::select! {
            biased;
            () = self.cancel.cancelled() => Err(Stopped),
            sent = self.sink.send(event) => sent.map_err(|_| Stopped),
        }
    }

    async fn sleep(&self, duration: Duration) -> Step {
        self.guard(tokio::time::sleep(duration)).await
    }

    /// Runs `future` unless cancellation comes first.
    async fn guard<F: Future>(&self, future: F) -> Step<F::Output> {
        tokio::select! {
            biased;
            () = self.cancel.cancelled() => Err(Stopped),
            output = future => Ok(output),
        }
    }
}

/// Consecutive live numbers refused by empty replays (see [`MessageError::NotFromPublisher`])
/// after which the subscriber accepts that the publisher keeps no replay buffer and follows
/// it. Bogus numbers are rarely consecutive; a real stream always is.
const REFUSALS_BEFORE_FOLLOWING: u32 = 3;

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(cfg: SubscriberConfig) -> Feed {
        let (sink, _rx) = cfg.channel();
        Feed::new(cfg, sink, CancellationToken::new())
    }

    #[test]
    fn backoff_doubles_within_bounds() {
        let mut cfg = SubscriberConfig::new("tcp://127.0.0.1:1");
        cfg.reconnect_min = Duration::from_millis(100);
        cfg.reconnect_max = Duration::from_millis(350);
        let f = feed(cfg);
        let b1 = f.grow(Duration::from_millis(100));
        let b2 = f.grow(b1);
        let b3 = f.grow(b2);
        assert_eq!(
            [b1, b2, b3],
            [
                Duration::from_millis(200),
                Duration::from_millis(350),
                Duration::from_millis(350)
            ]
        );
    }

    #[test]
    fn parse_rejects_bad_frames_and_bounds_payloads() {
        let mut cfg = SubscriberConfig::new("tcp://127.0.0.1:1");
        cfg.max_payload_bytes = 4;
        let f = feed(cfg);
        assert!(matches!(
            f.parse(&[b"", b"12345678"]),
            Err(MessageError::Decode(DecodeError::WrongFrameCount {
                got: 2
            }))
        ));
        assert!(matches!(
            f.parse(&[b"", b"1234", b""]),
            Err(MessageError::Decode(DecodeError::BadSequenceFrame {
                len: 4
            }))
        ));
        assert!(matches!(
            f.parse(&[b"", &seq_frame(REPLAY_END_SEQ), b"x"]),
            Err(MessageError::ReservedSequence { .. })
        ));
        assert!(matches!(
            f.parse(&[b"", &seq_frame(7), b"too long"]),
            Ok((7, Err(MessageError::PayloadTooLarge { len: 8, limit: 4 })))
        ));
        assert!(matches!(
            f.parse(&[b"", &seq_frame(8), b"\xc1"]),
            Ok((8, Err(MessageError::Decode(_))))
        ));
        // a live message is never four frames
        assert!(matches!(
            f.parse(&[b"", b"", &seq_frame(7), b"\x90"]),
            Err(MessageError::Decode(DecodeError::WrongFrameCount {
                got: 4
            }))
        ));
    }

    #[test]
    fn replay_replies_parse_in_every_framing() {
        let f = feed(SubscriberConfig::new("tcp://127.0.0.1:1"));
        let bad = |r: Result<(u64, Item), MessageError>| match r {
            Ok((seq, Err(e))) => Some((seq, e)),
            _ => None,
        };
        // vLLM 0.32: ("", topic, seq, payload); the payload here is not a batch, which shows
        // that the number was read from the right frame
        assert_eq!(
            bad(f.parse_replay(&[b"", b"kv", &seq_frame(7), b"\xc1"])).map(|b| b.0),
            Some(7)
        );
        // older vLLM and SGLang: ("", seq, payload)
        assert_eq!(
            bad(f.parse_replay(&[b"", &seq_frame(8), b"\xc1"])).map(|b| b.0),
            Some(8)
        );
        assert!(matches!(
            f.parse_replay(&[b"x", b"", &seq_frame(7), b"\xc1"]),
            Err(MessageError::Decode(DecodeError::WrongFrameCount {
                got: 4
            }))
        ));
    }

    #[test]
    fn replay_placement() {
        let mut f = feed(SubscriberConfig::new("tcp://127.0.0.1:1"));
        assert!(matches!(f.place(5), ReplayPlace::Next));
        let _ = f.tracker.observe(5);
        assert!(matches!(f.place(6), ReplayPlace::Next));
        assert!(matches!(f.place(5), ReplayPlace::Duplicate));
        assert!(matches!(f.place(8), ReplayPlace::Hole));
    }
}
