//! KV event publishing for one rank: a ZMQ PUB socket and an optional ROUTER replay socket, as
//! vLLM's `ZmqEventPublisher` has.
//!
//! Every batch gets the next sequence number and goes out as three frames `(topic, seq as
//! 8-byte big-endian, msgpack payload)`. The last `buffer` batches are kept for replay: a
//! client (DEALER sending an empty delimiter first, or REQ) sends `("", start_seq)` and the
//! ROUTER answers, as vLLM 0.32 does, `(identity, "", topic, seq, payload)` for every buffered
//! batch at or after `start_seq`, then the end marker `(identity, "", "", -1 as 8 bytes, "")`:
//! a DEALER receives four frames `("", topic, seq, payload)` and `("", "", -1, "")`. Like vLLM,
//! a request that is not exactly `(identity, "", start_seq)` is ignored with a warning.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvroute_routing::kv_events::{
    EventBatch, EventEncoding, REPLAY_END_SEQ, encode_event_batch, seq_frame,
};
use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use zeromq::{
    Endpoint, PubSocket, RouterRecvHalf, RouterSendHalf, RouterSocket, Socket, SocketRecv,
    SocketSend, ZmqMessage,
};

/// Commands from the rank driver.
#[derive(Debug)]
pub(crate) enum PublishCmd {
    Batch(EventBatch),
    /// Start sequence numbers again at 0 and empty the replay buffer (a restarted process).
    ResetSeq,
}

/// The drop-events fault, read by the publisher for every batch.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct DropPolicy {
    pub fraction: f64,
    pub replayable: bool,
}

/// The garbage-events fault, read by the publisher every flood tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GarbagePolicy {
    pub per_second: u32,
    pub max_bytes: usize,
}

/// How often the flood sends its share of garbage.
const FLOOD_TICK: Duration = Duration::from_millis(10);

/// Publishing statistics (for logs and tests).
#[derive(Debug, Default)]
pub(crate) struct PublisherState {
    pub drop: DropPolicy,
    pub garbage: Option<GarbagePolicy>,
    pub published: u64,
    /// Garbage messages sent under the `garbage_events` fault.
    pub garbage_sent: u64,
    pub dropped: u64,
    pub next_seq: u64,
}

pub(crate) struct PublisherConfig {
    pub topic: Bytes,
    pub encoding: EventEncoding,
    pub buffer: usize,
    pub seed: u64,
}

/// Binds `tcp://host:port` for a socket and returns the port actually bound.
pub(crate) async fn bind_port<S: Socket>(
    socket: &mut S,
    host: &str,
    port: u16,
) -> anyhow::Result<u16> {
    let endpoint = socket
        .bind(&format!("tcp://{host}:{port}"))
        .await
        .map_err(|e| anyhow::anyhow!("cannot bind ZMQ socket on {host}:{port}: {e}"))?;
    match endpoint {
        Endpoint::Tcp(_, p) => Ok(p),
        other => anyhow::bail!("unexpected ZMQ endpoint {other}"),
    }
}

/// Runs the publisher until `cancel` fires or the driver goes away; the sockets close on
/// return, which frees their ports.
pub(crate) async fn run_publisher(
    mut pub_socket: PubSocket,
    replay: Option<RouterSocket>,
    cfg: PublisherConfig,
    state: Arc<Mutex<PublisherState>>,
    mut rx: mpsc::Receiver<PublishCmd>,
    cancel: CancellationToken,
) {
    let mut buffer: VecDeque<(u64, Bytes)> = VecDeque::with_capacity(cfg.buffer.min(4096));
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
    let (mut replay_tx, mut replay_rx): (Option<RouterSendHalf>, Option<RouterRecvHalf>) =
        match replay {
            Some(r) => {
                let (tx, rx) = r.split();
                (Some(tx), Some(rx))
            }
            None => (None, None),
        };
    // the last real payload, which garbage mutates into near-valid msgpack
    let mut last_payload = Bytes::new();
    let mut flood = tokio::time::interval(FLOOD_TICK);
    flood.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut flood_credit = 0.0_f64;
    loop {
        let garbage = state.lock().garbage;
        let flood_tick = async {
            match garbage {
                Some(_) => {
                    flood.tick().await;
                }
                None => std::future::pending().await,
            }
        };
        let replay_req = async {
            match replay_rx.as_mut() {
                Some(r) => r.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = cancel.cancelled() => break,
            cmd = rx.recv() => match cmd {
                None => break,
                Some(PublishCmd::ResetSeq) => {
                    buffer.clear();
                    state.lock().next_seq = 0;
                }
                Some(PublishCmd::Batch(batch)) => {
                    let payload = Bytes::from(encode_event_batch(&batch, cfg.encoding));
                    last_payload = payload.clone();
                    let (seq, drop, keep) = {
                        let mut st = state.lock();
                        let seq = st.next_seq;
                        st.next_seq += 1;
                        let drop = st.drop.fraction > 0.0 && rng.random::<f64>() < st.drop.fraction;
                        if drop {
                            st.dropped += 1;
                        } else {
                            st.published += 1;
                        }
                        (seq, drop, !drop || st.drop.replayable)
                    };
                    if !drop {
                        let frames = vec![
                            cfg.topic.clone(),
                            Bytes::copy_from_slice(&seq_frame(seq)),
                            payload.clone(),
                        ];
                        if let Ok(msg) = ZmqMessage::try_from(frames)
                            && let Err(e) = pub_socket.send(msg).await
                        {
                            tracing::warn!(seq, error = %e, "KV event batch not published");
                        }
                    } else {
                        tracing::debug!(seq, "KV event batch dropped by fault injection");
                    }
                    if keep && cfg.buffer > 0 {
                        if buffer.len() >= cfg.buffer {
                            buffer.pop_front();
                        }
                        buffer.push_back((seq, payload));
                    }
                }
            },
            () = flood_tick => {
                let Some(policy) = garbage else { continue };
                flood_credit += f64::from(policy.per_second) * FLOOD_TICK.as_secs_f64();
                let next_seq = state.lock().next_seq;
                let mut sent = 0;
                while flood_credit >= 1.0 {
                    flood_credit -= 1.0;
                    let frames = garbage_frames(&mut rng, &cfg.topic, next_seq, &last_payload, policy.max_bytes);
                    if let Ok(msg) = ZmqMessage::try_from(frames)
                        && pub_socket.send(msg).await.is_ok()
                    {
                        sent += 1;
                    }
                }
                state.lock().garbage_sent += sent;
            }
            req = replay_req => match req {
                Ok(msg) => {
                    if let Some(tx) = replay_tx.as_mut() {
                        serve_replay(tx, msg, &cfg.topic, &buffer).await;
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "replay socket receive failed");
                }
            },
        }
    }
    // Release the ports now, so that a restarted engine can bind them again.
    let _ = pub_socket.unbind_all().await;
}

/// One hostile message: what a buggy or malicious process on the engine's port might send.
fn garbage_frames(
    rng: &mut ChaCha8Rng,
    topic: &Bytes,
    next_seq: u64,
    last_payload: &[u8],
    max_bytes: usize,
) -> Vec<Bytes> {
    let random = |rng: &mut ChaCha8Rng| {
        let mut b = vec![0_u8; rng.random_range(0..=max_bytes)];
        rng.fill(&mut b[..]);
        Bytes::from(b)
    };
    let seq = |s: u64| Bytes::copy_from_slice(&seq_frame(s));
    match rng.random_range(0..6_u8) {
        // random bytes under the next sequence number
        0 => vec![topic.clone(), seq(next_seq), random(rng)],
        // a real payload with flipped bytes or cut short, under a number far ahead (a gap)
        1 | 2 => {
            let mut p = last_payload.to_vec();
            if p.is_empty() || rng.random_bool(0.5) {
                p.truncate(rng.random_range(0..=p.len()));
            } else {
                for _ in 0..rng.random_range(1..=8) {
                    let i = rng.random_range(0..p.len());
                    p[i] = rng.random();
                }
            }
            vec![
                topic.clone(),
                seq(next_seq + rng.random_range(1..10_000)),
                Bytes::from(p),
            ]
        }
        // a number from the past (a restart, or a replay of old traffic)
        3 => vec![topic.clone(), seq(next_seq / 2), random(rng)],
        // a malformed sequence frame
        4 => vec![topic.clone(), Bytes::from_static(b"seq"), random(rng)],
        // the wrong number of frames
        _ => {
            if rng.random_bool(0.5) {
                vec![topic.clone()]
            } else {
                vec![topic.clone(), seq(next_seq), random(rng), random(rng)]
            }
        }
    }
}

async fn serve_replay(
    tx: &mut RouterSendHalf,
    msg: ZmqMessage,
    topic: &Bytes,
    buffer: &VecDeque<(u64, Bytes)>,
) {
    let frames = msg.into_vec();
    // vLLM 0.32 (`ZmqEventPublisher._service_replay`): exactly `(identity, "", start)`.
    let [identity, _, start] = frames.as_slice() else {
        tracing::warn!(frames = frames.len(), "invalid KV event replay request");
        return;
    };
    let Ok(start) = <[u8; 8]>::try_from(start.as_ref()).map(u64::from_be_bytes) else {
        tracing::warn!(len = start.len(), "replay start sequence must be 8 bytes");
        return;
    };
    let reply = |topic: &Bytes, seq: u64, payload: Bytes| {
        ZmqMessage::try_from(vec![
            identity.clone(),
            Bytes::new(),
            topic.clone(),
            Bytes::copy_from_slice(&seq_frame(seq)),
            payload,
        ])
    };
    let mut sent = 0usize;
    for (seq, payload) in buffer.iter().filter(|(s, _)| *s >= start) {
        if let Ok(m) = reply(topic, *seq, payload.clone()) {
            if tx.send(m).await.is_err() {
                return;
            }
            sent += 1;
        }
    }
    // the end marker carries an empty topic
    if let Ok(m) = reply(&Bytes::new(), REPLAY_END_SEQ, Bytes::new()) {
        let _ = tx.send(m).await;
    }
    tracing::debug!(start, sent, "served KV event replay");
}
