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
//! Every sequencing decision is made by a state machine without I/O,
//! [`crate::kv_events::resequence::Resequencer`]; this task reads what it asks for and carries
//! out what it decides.
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

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use futures::channel::mpsc as fmpsc;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, warn};
use zeromq::{
    DealerSocket, Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqMessage,
};

use crate::kv_events::resequence::{Action, Input, Item, Resequencer, ResequencerConfig, Wants};
pub use crate::kv_events::resequence::{MAX_REPLAY_PAGES, MessageError, ReplayError, ResyncReason};
use crate::kv_events::{
    DecodeError, DecodeLimits, EventBatch, REPLAY_END_SEQ, SequenceTracker, decode_event_batch,
    is_replay_end, parse_seq, replay_frames, seq_frame, split_topic_epoch,
};

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
    /// The consumer already holds this endpoint's view up to batch `(seq, timestamp bits)`
    /// (an index copied from a snapshot or a peer): the subscriber starts as after a
    /// reconnect, proving continuity from that batch ([`SubscriberEvent::Continued`]) or
    /// resynchronizing.
    pub resume: Option<(u64, u64)>,
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
            resume: None,
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
    /// The replay showed that the stream continues the view held before a reconnect, or the
    /// one [`SubscriberConfig::resume`] named: batch `seq` with the same timestamp.
    Continued {
        /// The last batch of the view.
        seq: u64,
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

/// The subscriber task: the sockets and the sink around a [`Resequencer`], which makes every
/// sequencing decision; this only reads what it asks for and carries out its actions.
struct Feed {
    cfg: SubscriberConfig,
    stats: Arc<SubscriberStats>,
    sink: mpsc::Sender<SubscriberEvent>,
    cancel: CancellationToken,
    order: Resequencer,
}

impl Feed {
    fn new(
        cfg: SubscriberConfig,
        sink: mpsc::Sender<SubscriberEvent>,
        cancel: CancellationToken,
    ) -> Self {
        let machine = ResequencerConfig {
            replay: cfg.replay.is_some(),
            replay_max_batches: cfg.replay_max_batches,
            restart_window: cfg.restart_window,
        };
        let order = match cfg.resume {
            Some((seq, ts_bits)) => Resequencer::resuming(machine, seq, ts_bits),
            None => Resequencer::new(machine),
        };
        Self {
            stats: Arc::clone(&cfg.stats),
            cfg,
            sink,
            cancel,
            order,
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
        self.step(Input::Connected).await?;
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
                    self.step(Input::Idle).await?;
                    continue;
                }
            };
            match message {
                Ok(message) => self.on_live(&message).await?,
                Err(error) => return Ok(error.to_string()),
            }
        }
    }

    async fn on_live(&mut self, message: &ZmqMessage) -> Step {
        bump(&self.stats.messages);
        let frames: Vec<&[u8]> = message.iter().map(Bytes::as_ref).collect();
        let topic = frames.first().copied();
        if let Some(topic) = topic
            && !topic.starts_with(&self.cfg.topic)
        {
            bump(&self.stats.foreign_topic);
            return Ok(());
        }
        let input = match self.parse(&frames) {
            Ok((seq, item)) => Input::Live {
                seq,
                item,
                epoch: topic.and_then(|topic| split_topic_epoch(topic).1),
            },
            Err(error) => Input::Unreadable(error),
        };
        self.step(input).await
    }

    // --------------------------------------------------------------------------------------
    // Carrying out the resequencer's wishes
    // --------------------------------------------------------------------------------------

    /// Feeds `input`, carries out the actions, and serves the replay requests the machine
    /// asks for until it wants the live stream again. Each request gets a fresh DEALER, so
    /// a reply to an abandoned request can never be taken for the answer to the next one.
    async fn step(&mut self, input: Input<'_>) -> Step {
        self.feed(input).await?;
        let mut dealer: Option<DealerSocket> = None;
        loop {
            let input = match self.order.wants() {
                Wants::Live => return Ok(()),
                Wants::OpenReplay { from } => {
                    dealer = None;
                    bump(&self.stats.replay_requests);
                    match self.open_replay(from).await? {
                        Ok(socket) => {
                            dealer = Some(socket);
                            Input::ReplayOpened
                        }
                        Err(error) => Input::ReplayFailed(error),
                    }
                }
                Wants::ReadReplay => match dealer.as_mut() {
                    Some(socket) => match self.recv_replay(socket).await? {
                        Ok(message) => {
                            let frames: Vec<&[u8]> = message.iter().map(Bytes::as_ref).collect();
                            if is_replay_end(&frames) {
                                Input::ReplayEnd
                            } else {
                                Input::Replayed(self.parse_replay(&frames))
                            }
                        }
                        Err(error) => Input::ReplayFailed(error),
                    },
                    None => Input::ReplayFailed(ReplayError::NotOpen),
                },
            };
            if matches!(input, Input::ReplayFailed(_)) {
                bump(&self.stats.replay_failures);
            }
            self.feed(input).await?;
        }
    }

    /// Hands one input to the resequencer and carries out what it decided.
    async fn feed(&mut self, input: Input<'_>) -> Step {
        self.order.handle(input, crate::kv_events::unix_now());
        while let Some(action) = self.order.next_action() {
            match action {
                Action::Deliver {
                    seq,
                    batch,
                    replayed,
                } => {
                    bump(&self.stats.batches);
                    if replayed {
                        bump(&self.stats.replayed_batches);
                    }
                    self.emit(SubscriberEvent::Batch { seq, batch }).await?;
                }
                Action::Resync { reason } => {
                    bump(&self.stats.resyncs);
                    warn!(%reason, "resynchronizing the endpoint's KV view");
                    self.emit(SubscriberEvent::Resync { reason }).await?;
                }
                Action::Skip { seq, error } => {
                    let count = bump(&self.stats.decode_errors);
                    // power-of-two sampling keeps a garbage stream from flooding the log
                    if count.is_power_of_two() {
                        warn!(?seq, %error, count, "undecodable KV-event message skipped");
                    } else {
                        debug!(?seq, %error, "undecodable KV-event message skipped");
                    }
                    self.emit(SubscriberEvent::DecodeError { seq, error })
                        .await?;
                }
                Action::Drop { .. } => {
                    bump(&self.stats.duplicates);
                }
                Action::Gap { .. } => {
                    bump(&self.stats.gaps);
                }
                Action::Continued { seq } => {
                    self.emit(SubscriberEvent::Continued { seq }).await?;
                }
            }
        }
        Ok(())
    }

    /// Connects a fresh DEALER to the replay ROUTER and sends the request for `from` on.
    async fn open_replay(&self, from: u64) -> Step<Result<DealerSocket, ReplayError>> {
        let Some(endpoint) = self.cfg.replay.as_deref() else {
            return Ok(Err(ReplayError::NoEndpoint));
        };
        let mut options = SocketOptions::default();
        options.connect_timeout(self.cfg.replay_timeout);
        let mut dealer = DealerSocket::with_options(options);
        let timeout = self.cfg.replay_timeout;
        match self
            .guard(tokio::time::timeout(timeout, dealer.connect(endpoint)))
            .await?
        {
            Ok(Ok(())) => {}
            Ok(Err(error)) => return Ok(Err(ReplayError::Connect(error.to_string()))),
            Err(_) => return Ok(Err(ReplayError::ConnectTimeout)),
        }
        // The empty delimiter makes the ROUTER see (identity, "", start) as a REQ would send.
        let request = match ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&seq_frame(from)),
        ]) {
            Ok(request) => request,
            Err(error) => return Ok(Err(ReplayError::Request(format!("{error:?}")))),
        };
        match self
            .guard(tokio::time::timeout(timeout, dealer.send(request)))
            .await?
        {
            Ok(Ok(())) => Ok(Ok(dealer)),
            Ok(Err(error)) => Ok(Err(ReplayError::Send(error.to_string()))),
            Err(_) => Ok(Err(ReplayError::SendTimeout)),
        }
    }

    async fn recv_replay(
        &self,
        socket: &mut DealerSocket,
    ) -> Step<Result<ZmqMessage, ReplayError>> {
        Ok(
            match self
                .guard(tokio::time::timeout(self.cfg.replay_timeout, socket.recv()))
                .await?
            {
                Ok(Ok(message)) => Ok(message),
                Ok(Err(error)) => Err(ReplayError::Receive(error.to_string())),
                Err(_) => Err(ReplayError::ReceiveTimeout),
            },
        )
    }

    // --------------------------------------------------------------------------------------
    // Decoding
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
}
