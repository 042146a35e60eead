//! Interop tests of the KV-event subscriber (`service::feeds::kv_subscriber`, built on the pure-Rust
//! `zeromq` crate) against libzmq, through a pyzmq publisher that behaves like vLLM's
//! (`routing/tests/fixtures/zmq/kv_publisher.py`), and against a `zeromq` PUB socket.
//!
//! Needs `python3` (or `$KVROUTE_PYTHON`) with `pyzmq` and `msgpack`
//! (`pip install pyzmq msgpack`). Without them the tests fail with that message; they never
//! skip. Everything binds 127.0.0.1 on ports the OS picks, and every wait has a deadline.

use std::net::TcpListener;
use std::process::Stdio;
use std::time::Duration;

use kvroute_picker::kv_events::{
    DecodeError, EventBatch, EventEncoding, KvEvent, encode_event_batch, seq_frame,
};
use kvroute_picker::service::feeds::kv_subscriber::{
    MessageError, ResyncReason, SubscriberConfig, SubscriberEvent, SubscriberStats,
    spawn_subscriber,
};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Longest wait for any single expected event or fixture answer.
const STEP: Duration = Duration::from_secs(15);

// ------------------------------------------------------------------------------------------
// The Python publisher
// ------------------------------------------------------------------------------------------

fn python() -> String {
    std::env::var("KVROUTE_PYTHON").unwrap_or_else(|_| "python3".to_owned())
}

/// Fails the test (never skips) when the Python side cannot run.
async fn require_pyzmq() {
    let out = Command::new(python())
        .args(["-c", "import zmq, msgpack"])
        .output()
        .await;
    match out {
        Ok(out) if out.status.success() => {}
        Ok(out) => panic!(
            "the ZMQ interop tests need Python's pyzmq and msgpack: run `pip install pyzmq \
             msgpack` (python: {}): {}",
            python(),
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(error) => panic!(
            "the ZMQ interop tests need `{}` with pyzmq and msgpack \
             (`pip install pyzmq msgpack`): {error}",
            python()
        ),
    }
}

struct PyPublisher {
    _child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
    pub_port: u16,
    replay_port: Option<u16>,
}

impl PyPublisher {
    async fn start(args: &[&str]) -> Self {
        require_pyzmq().await;
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../routing/tests/fixtures/zmq/kv_publisher.py"
        );
        let mut child = Command::new(python())
            .arg(script)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn the python publisher");
        let stdin = child.stdin.take().expect("stdin");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let hello = read_json(&mut lines).await;
        let port = |v: &Value| v.as_u64().map(|p| u16::try_from(p).expect("port"));
        Self {
            _child: child,
            stdin,
            lines,
            pub_port: port(&hello["pub"]).expect("pub port"),
            replay_port: port(&hello["replay"]),
        }
    }

    fn pub_endpoint(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.pub_port)
    }

    fn replay_endpoint(&self) -> Option<String> {
        self.replay_port.map(|p| format!("tcp://127.0.0.1:{p}"))
    }

    async fn cmd(&mut self, cmd: Value) -> Value {
        let mut line = cmd.to_string();
        line.push('\n');
        self.stdin
            .write_all(line.as_bytes())
            .await
            .expect("write to the python publisher");
        self.stdin.flush().await.expect("flush");
        let answer = read_json(&mut self.lines).await;
        assert_eq!(
            answer["ok"],
            json!(true),
            "fixture answered {answer} to {cmd}"
        );
        answer
    }

    async fn publish(&mut self, count: u64) {
        self.cmd(json!({"op": "publish", "count": count})).await;
    }

    async fn skip(&mut self, count: u64) {
        self.cmd(json!({"op": "skip", "count": count})).await;
    }

    /// Re-sends the last published batch until the subscriber has received a live message
    /// past `stats`' current count: proof that its subscription reached the publisher (ZMQ's
    /// "slow joiner": a PUB drops what it publishes before the subscription arrives).
    async fn warm_up(&mut self, stats: &SubscriberStats) {
        let before = stats.snapshot().messages;
        for _ in 0..200 {
            self.cmd(json!({"op": "resend"})).await;
            tokio::time::sleep(Duration::from_millis(25)).await;
            if stats.snapshot().messages > before {
                return;
            }
        }
        panic!("the subscriber never received a live message");
    }
}

async fn read_json(lines: &mut Lines<BufReader<ChildStdout>>) -> Value {
    let line = tokio::time::timeout(STEP, lines.next_line())
        .await
        .expect("the python publisher did not answer in time")
        .expect("read from the python publisher")
        .expect("the python publisher exited (see its stderr above)");
    serde_json::from_str(&line).expect("publisher output is JSON")
}

// ------------------------------------------------------------------------------------------
// Expected batches (mirror of make_payload in kv_publisher.py)
// ------------------------------------------------------------------------------------------

fn block_hash(seq: u64, i: u64) -> u64 {
    0x9E37_79B9_7F4A_7C15_u64.wrapping_mul(seq * 4 + i + 1)
}

fn expected(generation: u64, seq: u64) -> EventBatch {
    let mut events = vec![
        KvEvent::plain_stored(
            vec![block_hash(seq, 0), block_hash(seq, 1)],
            seq.checked_sub(1).map(|p| block_hash(p, 1)),
            (seq * 32..seq * 32 + 32)
                .map(|t| u32::try_from(t).expect("token"))
                .collect(),
            16,
        )
        .on_medium("GPU"),
    ];
    if seq % 2 == 1 {
        events.push(KvEvent::BlockRemoved {
            block_hashes: vec![block_hash(seq - 1, 0)],
            medium: Some("GPU".to_owned()),
            place: Default::default(),
        });
    }
    if seq % 7 == 6 {
        events.push(KvEvent::AllBlocksCleared);
    }
    EventBatch {
        ts: generation as f64 * 1_000_000.0 + seq as f64 + 0.25,
        events,
        data_parallel_rank: Some(0),
        skipped_unknown: 0,
    }
}

// ------------------------------------------------------------------------------------------
// The subscriber under test
// ------------------------------------------------------------------------------------------

/// A subscriber event reduced to what the assertions compare. Batches are checked against
/// [`expected`] on arrival and recorded as `(generation, seq)`.
#[derive(Debug, Clone, PartialEq)]
enum Ev {
    Batch(u64, u64),
    Continued(u64),
    Resync(ResyncReason),
    DecodeError(Option<u64>),
    Connected,
    Disconnected,
}

struct Harness {
    rx: mpsc::Receiver<SubscriberEvent>,
    seen: Vec<Ev>,
    cancel: CancellationToken,
    handle: Option<JoinHandle<()>>,
    stats: std::sync::Arc<SubscriberStats>,
    decode_errors: Vec<MessageError>,
}

fn test_config(publisher: String, replay: Option<String>) -> SubscriberConfig {
    let mut cfg = SubscriberConfig::new(publisher);
    cfg.replay = replay;
    cfg.reconnect_min = Duration::from_millis(50);
    cfg.reconnect_max = Duration::from_millis(500);
    cfg.connect_timeout = Duration::from_secs(2);
    cfg.replay_timeout = Duration::from_secs(2);
    // probes make recoveries timing-dependent; the tests that want one turn it on
    cfg.idle_probe = None;
    cfg.channel_capacity = 64;
    cfg
}

impl Harness {
    fn spawn(cfg: SubscriberConfig) -> Self {
        let (tx, rx) = cfg.channel();
        let stats = std::sync::Arc::clone(&cfg.stats);
        let cancel = CancellationToken::new();
        let handle = spawn_subscriber(cfg, tx, cancel.clone());
        Self {
            rx,
            seen: Vec::new(),
            cancel,
            handle: Some(handle),
            stats,
            decode_errors: Vec::new(),
        }
    }

    async fn next(&mut self) -> Ev {
        let event = match tokio::time::timeout(STEP, self.rx.recv()).await {
            Ok(Some(event)) => event,
            Ok(None) => panic!("subscriber stopped; events so far: {:?}", self.seen),
            Err(_) => panic!(
                "no subscriber event in time; events so far: {:?}",
                self.seen
            ),
        };
        let ev = match event {
            SubscriberEvent::Batch { seq, batch } => {
                let generation = (batch.ts / 1_000_000.0).floor() as u64;
                assert_eq!(
                    batch,
                    expected(generation, seq),
                    "batch {seq} decoded wrongly"
                );
                Ev::Batch(generation, seq)
            }
            SubscriberEvent::Resync { reason } => Ev::Resync(reason),
            SubscriberEvent::Continued { seq } => Ev::Continued(seq),
            SubscriberEvent::DecodeError { seq, error } => {
                self.decode_errors.push(error);
                Ev::DecodeError(seq)
            }
            SubscriberEvent::Connected => Ev::Connected,
            SubscriberEvent::Disconnected { .. } => Ev::Disconnected,
        };
        self.seen.push(ev.clone());
        ev
    }

    /// Reads events until `want` arrives; returns those before it.
    async fn until(&mut self, want: &Ev) -> Vec<Ev> {
        let mut before = Vec::new();
        loop {
            let ev = self.next().await;
            if &ev == want {
                return before;
            }
            before.push(ev);
        }
    }

    /// Reads until `last` and checks that the events on the way, connection events left
    /// out, are exactly `want` (which ends with `last`).
    async fn expect(&mut self, want: &[Ev]) {
        let last = want.last().expect("non-empty expectation").clone();
        let mut got: Vec<Ev> = self
            .until(&last)
            .await
            .into_iter()
            .filter(|e| !matches!(e, Ev::Connected | Ev::Disconnected))
            .collect();
        got.push(last);
        assert_eq!(got, want, "all events: {:?}", self.seen);
    }

    async fn stop(mut self) {
        self.cancel.cancel();
        let handle = self.handle.take().expect("handle");
        tokio::time::timeout(Duration::from_secs(5), handle)
            .await
            .expect("subscriber stops promptly on cancel")
            .expect("subscriber task did not panic");
    }
}

fn batches(generation: u64, seqs: std::ops::Range<u64>) -> Vec<Ev> {
    seqs.map(|s| Ev::Batch(generation, s)).collect()
}

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    listener.local_addr().expect("local addr").port()
}

async fn within<F: std::future::Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(60), f)
        .await
        .expect("test exceeded its 60 s budget")
}

// ------------------------------------------------------------------------------------------
// 1. In-order delivery, every wire format, including what was published before we connected
// ------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyzmq_batches_arrive_in_order_and_decode() {
    within(async {
        let mut py = PyPublisher::start(&[]).await;
        // published before anyone subscribed: only the replay buffer has them
        py.publish(5).await;
        let mut h = Harness::spawn(test_config(py.pub_endpoint(), py.replay_endpoint()));
        let mut want = vec![Ev::Connected];
        want.extend(batches(0, 0..5));
        let got = h.until(&Ev::Batch(0, 4)).await;
        assert_eq!(got, want[..5], "start-up replay");
        py.warm_up(&h.stats).await;
        py.publish(25).await;
        h.expect(&batches(0, 5..30)).await;
        let stats = h.stats.snapshot();
        assert_eq!(stats.resyncs, 0);
        assert_eq!(stats.decode_errors, 0);
        assert_eq!(stats.batches, 30);
        h.stop().await;
    })
    .await;
}

// ------------------------------------------------------------------------------------------
// 2. A gap is filled from the replay socket, in order, without a resync
// ------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyzmq_gap_is_replayed_in_order() {
    within(async {
        let mut py = PyPublisher::start(&[]).await;
        let mut h = Harness::spawn(test_config(py.pub_endpoint(), py.replay_endpoint()));
        h.until(&Ev::Connected).await;
        py.publish(1).await;
        py.warm_up(&h.stats).await;
        py.publish(2).await;
        py.skip(4).await; // 3..=6 only in the replay buffer
        py.publish(3).await;
        h.expect(&batches(0, 0..10)).await;
        let stats = h.stats.snapshot();
        assert!(stats.gaps >= 1, "{stats:?}");
        assert!(stats.replayed_batches >= 4, "{stats:?}");
        assert_eq!(stats.resyncs, 0);
        // every reply was understood up to its end marker (a misread end marker shows up as
        // a timed-out request)
        assert_eq!(stats.replay_failures, 0, "{stats:?}");
        assert_eq!(stats.decode_errors, 0, "{stats:?}");
        h.stop().await;
    })
    .await;
}

/// vLLM 0.32 puts the topic in its replay replies, `("", topic, seq, payload)`: with a
/// configured topic, a restarted subscriber recovers what was published before it came, and a
/// gap is replayed, both without a failed request or a resync.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyzmq_vllm_0_32_replay_with_a_topic_recovers_history_and_gaps() {
    within(async {
        let mut py =
            PyPublisher::start(&["--topic", "kv@engine", "--replay-format", "vllm-0.32"]).await;
        py.publish(3).await; // before the subscriber: only the replay buffer has them
        let mut cfg = test_config(py.pub_endpoint(), py.replay_endpoint());
        cfg.topic = b"kv@engine".to_vec();
        let mut h = Harness::spawn(cfg);
        h.expect(&batches(0, 0..3)).await;
        py.warm_up(&h.stats).await;
        py.skip(2).await;
        py.publish(2).await;
        h.expect(&batches(0, 3..7)).await;
        let stats = h.stats.snapshot();
        assert!(stats.replayed_batches >= 5, "{stats:?}");
        assert_eq!(
            (stats.resyncs, stats.replay_failures, stats.decode_errors),
            (0, 0, 0),
            "{stats:?}"
        );
        h.stop().await;
    })
    .await;
}

/// Older vLLM and SGLang answer a DEALER with `("", seq, payload)` and end with
/// `("", -1, "")`: still understood.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyzmq_legacy_replay_framing_recovers_history_and_gaps() {
    within(async {
        let mut py = PyPublisher::start(&["--replay-format", "legacy"]).await;
        py.publish(3).await;
        let mut h = Harness::spawn(test_config(py.pub_endpoint(), py.replay_endpoint()));
        h.expect(&batches(0, 0..3)).await;
        py.warm_up(&h.stats).await;
        py.skip(2).await;
        py.publish(2).await;
        h.expect(&batches(0, 3..7)).await;
        let stats = h.stats.snapshot();
        assert!(stats.replayed_batches >= 5, "{stats:?}");
        assert_eq!(
            (stats.resyncs, stats.replay_failures, stats.decode_errors),
            (0, 0, 0),
            "{stats:?}"
        );
        h.stop().await;
    })
    .await;
}

/// A gap followed by silence never shows up in the live stream; the idle probe finds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyzmq_dropped_tail_is_found_by_the_idle_probe() {
    within(async {
        let mut py = PyPublisher::start(&[]).await;
        let mut cfg = test_config(py.pub_endpoint(), py.replay_endpoint());
        cfg.idle_probe = Some(Duration::from_millis(200));
        let mut h = Harness::spawn(cfg);
        h.until(&Ev::Connected).await;
        py.publish(1).await;
        py.warm_up(&h.stats).await;
        py.publish(2).await;
        py.skip(3).await;
        h.expect(&batches(0, 0..6)).await;
        assert_eq!(h.stats.snapshot().resyncs, 0);
        h.stop().await;
    })
    .await;
}

// ------------------------------------------------------------------------------------------
// 3. Replay impossible → Resync
// ------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyzmq_gap_without_replay_socket_resyncs() {
    within(async {
        let mut py = PyPublisher::start(&["--no-replay"]).await;
        assert_eq!(py.replay_endpoint(), None);
        let mut h = Harness::spawn(test_config(py.pub_endpoint(), None));
        h.until(&Ev::Connected).await;
        py.publish(1).await;
        py.warm_up(&h.stats).await;
        py.publish(2).await;
        py.skip(2).await;
        py.publish(2).await;
        let mut want = batches(0, 0..3);
        want.push(Ev::Resync(ResyncReason::NoReplayEndpoint {
            missing_from: 3,
        }));
        want.extend(batches(0, 5..7));
        h.expect(&want).await;
        h.stop().await;
    })
    .await;
}

/// A replay that no longer reaches back far enough resyncs. Afterwards, live batches that
/// waited in the socket's queue (numbered below the replayed range, older timestamps) are
/// dropped: they are neither a publisher restart nor a reason to resync again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyzmq_replay_buffer_too_short_resyncs_and_stale_batches_after_it_are_dropped() {
    within(async {
        let mut py = PyPublisher::start(&["--buffer", "3"]).await;
        let mut h = Harness::spawn(test_config(py.pub_endpoint(), py.replay_endpoint()));
        h.until(&Ev::Connected).await;
        py.publish(1).await;
        py.warm_up(&h.stats).await;
        py.publish(2).await;
        py.skip(6).await; // 3..=8; the buffer keeps 6, 7, 8
        py.publish(1).await; // 9; the buffer keeps 7, 8, 9
        let mut want = batches(0, 0..3);
        want.push(Ev::Resync(ResyncReason::ReplayShort {
            requested: 3,
            first: Some(7),
        }));
        want.extend(batches(0, 7..10));
        h.expect(&want).await;
        // 4 and 5 arrive late, below the replayed range 7..=9
        py.cmd(json!({"op": "stale", "seq": 4})).await;
        py.cmd(json!({"op": "stale", "seq": 5})).await;
        py.publish(1).await;
        h.expect(&batches(0, 10..11)).await;
        let stats = h.stats.snapshot();
        assert_eq!(
            stats.resyncs, 1,
            "only the short replay resynced: {stats:?}"
        );
        assert!(stats.duplicates >= 2, "{stats:?}");
        h.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyzmq_unreachable_replay_socket_resyncs() {
    within(async {
        let mut py = PyPublisher::start(&["--no-replay"]).await;
        let dead = format!("tcp://127.0.0.1:{}", free_port());
        let mut cfg = test_config(py.pub_endpoint(), Some(dead));
        cfg.replay_timeout = Duration::from_millis(300);
        let mut h = Harness::spawn(cfg);
        h.until(&Ev::Connected).await;
        py.publish(1).await;
        py.warm_up(&h.stats).await;
        py.publish(2).await;
        py.skip(2).await;
        py.publish(1).await;
        let mut got = h.until(&Ev::Batch(0, 5)).await;
        got.retain(|e| !matches!(e, Ev::Connected));
        assert_eq!(got.len(), 4, "{got:?}");
        assert_eq!(got[..3], batches(0, 0..3)[..]);
        assert!(
            matches!(
                &got[3],
                Ev::Resync(ResyncReason::ReplayFailed { requested: 3, .. })
            ),
            "{got:?}"
        );
        assert!(h.stats.snapshot().replay_failures >= 1);
        h.stop().await;
    })
    .await;
}

// ------------------------------------------------------------------------------------------
// 4. Publisher restarts → Resync, then the new stream
// ------------------------------------------------------------------------------------------

/// A real restart: the engine's sockets close and come back on the same ports, numbering
/// from 0. The reconnect cannot be shown continuous, so the view is resynchronized.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyzmq_publisher_restart_resyncs_then_follows_new_stream() {
    within(async {
        let mut py = PyPublisher::start(&[]).await;
        let mut h = Harness::spawn(test_config(py.pub_endpoint(), py.replay_endpoint()));
        h.until(&Ev::Connected).await;
        py.publish(1).await;
        py.warm_up(&h.stats).await;
        py.publish(4).await;
        h.expect(&batches(0, 0..5)).await;
        py.cmd(json!({"op": "restart"})).await;
        assert_eq!(h.next().await, Ev::Disconnected);
        assert_eq!(h.next().await, Ev::Connected);
        py.publish(1).await;
        py.warm_up(&h.stats).await;
        py.publish(2).await;
        // the new process holds nothing from 4 on: that is a restart, not a moved buffer
        let mut want = vec![Ev::Resync(ResyncReason::ContinuityLost {
            last_seq: 4,
            restarted: true,
        })];
        want.extend(batches(1, 0..3));
        h.expect(&want).await;
        h.stop().await;
    })
    .await;
}

/// Issue 52: a subscriber for a view copied from a snapshot or a peer (taken at batch 2)
/// proves continuity through the replay and delivers only what came after; one whose batch
/// the publisher shows with another timestamp (another process) resynchronizes and rebuilds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_subscriber_continues_a_copied_view_or_resyncs() {
    within(async {
        let py = PyPublisher::start(&[]).await;
        let mut probe = Harness::spawn(test_config(py.pub_endpoint(), py.replay_endpoint()));
        probe.until(&Ev::Connected).await;
        let mut py = py;
        py.publish(1).await;
        py.warm_up(&probe.stats).await;
        py.publish(4).await;
        probe.expect(&batches(0, 0..5)).await;
        probe.stop().await;
        // the copy holds batches 0..=2
        let mut cfg = test_config(py.pub_endpoint(), py.replay_endpoint());
        cfg.resume = Some((2, expected(0, 2).ts.to_bits()));
        let mut h = Harness::spawn(cfg);
        let mut want = vec![Ev::Continued(2)];
        want.extend(batches(0, 3..5));
        h.expect(&want).await;
        h.stop().await;
        // a copy whose batch 2 had another timestamp came from another process
        let mut cfg = test_config(py.pub_endpoint(), py.replay_endpoint());
        cfg.resume = Some((2, expected(7, 2).ts.to_bits()));
        let mut h = Harness::spawn(cfg);
        let mut want = vec![Ev::Resync(ResyncReason::ContinuityLost {
            last_seq: 2,
            restarted: true,
        })];
        want.extend(batches(0, 0..5));
        h.expect(&want).await;
        h.stop().await;
    })
    .await;
}

/// A reconnect to the same publisher process is shown continuous through the replay, and
/// what was published meanwhile is delivered without a resync.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnect_to_same_publisher_keeps_the_view() {
    within(async {
        // The "publisher" restarts its sockets but keeps its numbering and buffer, which is
        // what a network blip looks like from the subscriber.
        let mut py = PyPublisher::start(&[]).await;
        let mut h = Harness::spawn(test_config(py.pub_endpoint(), py.replay_endpoint()));
        h.until(&Ev::Connected).await;
        py.publish(1).await;
        py.warm_up(&h.stats).await;
        py.publish(2).await;
        h.expect(&batches(0, 0..3)).await;
        py.skip(2).await; // lost on the way, as if published while we were away
        py.cmd(json!({"op": "blip"})).await;
        assert_eq!(h.next().await, Ev::Disconnected);
        assert_eq!(h.next().await, Ev::Connected);
        let mut want = vec![Ev::Continued(2)];
        want.extend(batches(0, 3..5));
        h.expect(&want).await;
        py.warm_up(&h.stats).await;
        py.publish(1).await;
        h.expect(&batches(0, 5..6)).await;
        assert_eq!(h.stats.snapshot().resyncs, 0);
        h.stop().await;
    })
    .await;
}

/// The numbering goes back to 0 on the same connection: `SeqOutcome::Restart`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyzmq_sequence_reset_resyncs() {
    within(async {
        let mut py = PyPublisher::start(&[]).await;
        let mut h = Harness::spawn(test_config(py.pub_endpoint(), py.replay_endpoint()));
        h.until(&Ev::Connected).await;
        py.publish(1).await;
        py.warm_up(&h.stats).await;
        py.publish(4).await;
        h.expect(&batches(0, 0..5)).await;
        py.cmd(json!({"op": "reset_seq"})).await;
        py.publish(3).await;
        let mut want = vec![Ev::Resync(ResyncReason::PublisherRestarted {
            expected: 5,
            got: 0,
        })];
        want.extend(batches(1, 0..3));
        h.expect(&want).await;
        h.stop().await;
    })
    .await;
}

/// SGLang appends an epoch to the topic; a new epoch is a restart even when the numbers
/// alone would not show it. Also checks prefix subscription to a topic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyzmq_sglang_epoch_change_resyncs() {
    within(async {
        let mut py = PyPublisher::start(&["--topic", "kv", "--epoch", "e1"]).await;
        let mut cfg = test_config(py.pub_endpoint(), py.replay_endpoint());
        cfg.topic = b"kv".to_vec();
        let mut h = Harness::spawn(cfg);
        h.until(&Ev::Connected).await;
        py.publish(1).await;
        py.warm_up(&h.stats).await;
        py.publish(7).await;
        h.expect(&batches(0, 0..8)).await;
        // new process, numbering restarted, and already past where we were
        py.cmd(json!({"op": "reset_seq", "epoch": "e2"})).await;
        py.skip(9).await;
        py.publish(1).await;
        let mut want = vec![Ev::Resync(ResyncReason::EpochChanged)];
        want.extend(batches(1, 0..10));
        h.expect(&want).await;
        h.stop().await;
    })
    .await;
}

// ------------------------------------------------------------------------------------------
// 5. Garbage never stops the stream
// ------------------------------------------------------------------------------------------

/// A well-formed, empty batch, `[1.0, [], nil]` in msgpack (hex): what a process other than
/// the engine could send with any number.
const BOGUS_BATCH: &str = "93cb3ff000000000000090c0";

/// A message numbered far ahead that the publisher never sent is skipped: the replay that
/// should fill the gap ends before it (publishers buffer every batch as they send it), so
/// the batches the replay returned are kept, no resync, and the live stream goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyzmq_a_number_past_the_publishers_history_is_skipped() {
    within(async {
        let mut py = PyPublisher::start(&[]).await;
        let mut h = Harness::spawn(test_config(py.pub_endpoint(), py.replay_endpoint()));
        h.until(&Ev::Connected).await;
        py.publish(1).await;
        py.warm_up(&h.stats).await;
        py.publish(1).await;
        py.skip(3).await; // 2..=4 in the replay buffer only
        // seq 5000 with a well-formed empty batch [1.0, [], nil], consuming no number (an
        // undecodable one would move nothing at all: see the test after these)
        py.cmd(json!({"op": "raw", "frames": ["", "0000000000001388", BOGUS_BATCH]}))
            .await;
        let mut want = batches(0, 0..5);
        want.push(Ev::DecodeError(Some(5000)));
        h.expect(&want).await;
        assert_eq!(
            h.decode_errors[0],
            MessageError::NotFromPublisher { seq: 5000, next: 5 }
        );
        py.publish(2).await;
        h.expect(&batches(0, 5..7)).await;
        let stats = h.stats.snapshot();
        assert_eq!(stats.resyncs, 0, "{stats:?}");
        h.stop().await;
    })
    .await;
}

/// The same when the publisher has nothing newer to replay at all: the empty replay shows it
/// never sent the number, so it is refused and the real batches after it are delivered in
/// order, with no resync.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyzmq_a_number_past_an_empty_replay_is_refused() {
    within(async {
        let mut py = PyPublisher::start(&[]).await;
        let mut h = Harness::spawn(test_config(py.pub_endpoint(), py.replay_endpoint()));
        h.until(&Ev::Connected).await;
        py.publish(1).await;
        py.warm_up(&h.stats).await;
        py.publish(1).await;
        py.cmd(json!({"op": "raw", "frames": ["", "0000000000001388", BOGUS_BATCH]}))
            .await;
        h.until(&Ev::DecodeError(Some(5000))).await;
        assert_eq!(
            h.decode_errors.last(),
            Some(&MessageError::NotFromPublisher { seq: 5000, next: 2 })
        );
        py.publish(3).await;
        h.expect(&batches(0, 2..5)).await;
        let stats = h.stats.snapshot();
        assert_eq!(stats.resyncs, 0, "{stats:?}");
        h.stop().await;
    })
    .await;
}

/// A publisher that keeps no replay buffer answers every replay empty: after a real gap its
/// first two batches are refused, the third in a row shows the stream is real, and the
/// subscriber resynchronizes and follows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyzmq_a_publisher_without_a_buffer_is_followed_after_a_gap() {
    within(async {
        let mut py = PyPublisher::start(&["--buffer", "0"]).await;
        let mut h = Harness::spawn(test_config(py.pub_endpoint(), py.replay_endpoint()));
        h.until(&Ev::Connected).await;
        py.publish(1).await;
        py.warm_up(&h.stats).await;
        py.publish(1).await;
        py.skip(2).await; // 2, 3 lost for good
        py.publish(4).await; // 4 and 5 refused, 6 accepted, 7
        let want = vec![
            Ev::Batch(0, 0),
            Ev::Batch(0, 1),
            Ev::DecodeError(Some(4)),
            Ev::DecodeError(Some(5)),
            Ev::Resync(ResyncReason::ReplayShort {
                requested: 2,
                first: None,
            }),
            Ev::Batch(0, 6),
            Ev::Batch(0, 7),
        ];
        h.expect(&want).await;
        h.stop().await;
    })
    .await;
}

/// Issue 12, finding 8: without a replay socket, one undecodable message numbered far ahead
/// (5,000,000) opened a gap that cleared the endpoint's view, and the real batches after it
/// then looked like a restart (a second clear). An undecodable message moves nothing, whatever
/// its number: not far ahead, not back to 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyzmq_an_undecodable_message_cannot_move_the_sequence() {
    within(async {
        let mut py = PyPublisher::start(&["--no-replay"]).await;
        let mut h = Harness::spawn(test_config(py.pub_endpoint(), None));
        h.until(&Ev::Connected).await;
        py.publish(1).await;
        py.warm_up(&h.stats).await;
        py.publish(1).await;
        // 5,000,000 and 0, each with a payload that is not msgpack; no number consumed
        py.cmd(json!({"op": "raw", "frames": ["", "00000000004c4b40", "c1"]}))
            .await;
        py.cmd(json!({"op": "raw", "frames": ["", "0000000000000000", "c1"]}))
            .await;
        py.publish(3).await;
        // the publisher's own batch 5 undecodable: batch 6 right after it shows that 5 was
        // the publisher's, so 6 is in order (its events are lost, the view is not cleared)
        py.cmd(json!({"op": "garbage"})).await;
        py.publish(1).await;
        let mut want = batches(0, 0..2);
        want.push(Ev::DecodeError(Some(5_000_000)));
        want.push(Ev::DecodeError(Some(0)));
        want.extend(batches(0, 2..5));
        want.push(Ev::DecodeError(Some(5)));
        want.push(Ev::Batch(0, 6));
        h.expect(&want).await;
        let stats = h.stats.snapshot();
        assert_eq!((stats.resyncs, stats.gaps), (0, 0), "{stats:?}");
        assert_eq!(stats.decode_errors, 3, "{stats:?}");
        h.stop().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyzmq_garbage_is_reported_and_skipped() {
    within(async {
        let mut py = PyPublisher::start(&[]).await;
        let mut h = Harness::spawn(test_config(py.pub_endpoint(), py.replay_endpoint()));
        h.until(&Ev::Connected).await;
        py.publish(1).await;
        py.warm_up(&h.stats).await;
        py.publish(1).await;
        py.cmd(json!({"op": "garbage"})).await; // seq 2
        // two frames only; then a 3-byte sequence frame; neither consumes a number
        py.cmd(json!({"op": "raw", "frames": ["", "0102"]})).await;
        py.cmd(json!({"op": "raw", "frames": ["", "010203", "90"]}))
            .await;
        py.publish(2).await;
        let want = vec![
            Ev::Batch(0, 0),
            Ev::Batch(0, 1),
            Ev::DecodeError(Some(2)),
            Ev::DecodeError(None),
            Ev::DecodeError(None),
            Ev::Batch(0, 3),
            Ev::Batch(0, 4),
        ];
        h.expect(&want).await;
        assert!(matches!(h.decode_errors[0], MessageError::Decode(_)));
        assert_eq!(
            h.decode_errors[1],
            MessageError::Decode(DecodeError::WrongFrameCount { got: 2 })
        );
        assert_eq!(
            h.decode_errors[2],
            MessageError::Decode(DecodeError::BadSequenceFrame { len: 3 })
        );
        let stats = h.stats.snapshot();
        assert_eq!(stats.decode_errors, 3);
        assert_eq!(stats.resyncs, 0);
        h.stop().await;
    })
    .await;
}

// ------------------------------------------------------------------------------------------
// 6. The publisher comes up after the subscriber
// ------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyzmq_publisher_started_late_is_reached() {
    within(async {
        require_pyzmq().await;
        let (pub_port, replay_port) = (free_port(), free_port());
        let mut h = Harness::spawn(test_config(
            format!("tcp://127.0.0.1:{pub_port}"),
            Some(format!("tcp://127.0.0.1:{replay_port}")),
        ));
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(h.rx.try_recv().is_err(), "nothing to connect to yet");
        let mut py = PyPublisher::start(&[
            "--pub-port",
            &pub_port.to_string(),
            "--replay-port",
            &replay_port.to_string(),
        ])
        .await;
        assert_eq!(h.next().await, Ev::Connected);
        py.publish(1).await;
        py.warm_up(&h.stats).await;
        py.publish(2).await;
        h.expect(&batches(0, 0..3)).await;
        h.stop().await;
    })
    .await;
}

/// Cancelling a subscriber that is still waiting for its publisher stops it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_a_subscriber_that_never_connected() {
    within(async {
        let h = Harness::spawn(test_config(
            format!("tcp://127.0.0.1:{}", free_port()),
            None,
        ));
        tokio::time::sleep(Duration::from_millis(300)).await;
        h.stop().await;
    })
    .await;
}

// ------------------------------------------------------------------------------------------
// 7. Rust zeromq PUB → subscriber
// ------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_pub_to_subscriber() {
    use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};
    within(async {
        let mut publisher = PubSocket::new();
        let endpoint = publisher
            .bind("tcp://127.0.0.1:0")
            .await
            .expect("bind the PUB socket");
        let mut h = Harness::spawn(test_config(endpoint.to_string(), None));
        h.until(&Ev::Connected).await;
        let encodings = [
            EventEncoding::Array,
            EventEncoding::MapEvents,
            EventEncoding::Map,
        ];
        let message = |seq: u64| {
            let payload = encode_event_batch(&expected(0, seq), encodings[(seq % 3) as usize]);
            ZmqMessage::try_from(vec![
                bytes::Bytes::new(),
                bytes::Bytes::copy_from_slice(&seq_frame(seq)),
                bytes::Bytes::from(payload),
            ])
            .expect("three frames")
        };
        // the subscription reaches the PUB asynchronously: repeat 0 until it arrives
        for _ in 0..200 {
            publisher.send(message(0)).await.expect("send");
            tokio::time::sleep(Duration::from_millis(25)).await;
            if h.stats.snapshot().messages > 0 {
                break;
            }
        }
        for seq in 1..12 {
            publisher.send(message(seq)).await.expect("send");
        }
        h.expect(&batches(0, 0..12)).await;
        assert_eq!(h.stats.snapshot().resyncs, 0);
        h.stop().await;
    })
    .await;
}

// ------------------------------------------------------------------------------------------
// A consumer that falls behind loses nothing: the publisher drops, the replay refills
// ------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyzmq_slow_consumer_gets_every_batch_in_order() {
    within(async {
        let mut py = PyPublisher::start(&["--sndhwm", "16"]).await;
        let mut cfg = test_config(py.pub_endpoint(), py.replay_endpoint());
        cfg.channel_capacity = 1;
        cfg.replay_max_batches = 500;
        let mut h = Harness::spawn(cfg);
        h.until(&Ev::Connected).await;
        py.publish(1).await;
        py.warm_up(&h.stats).await;
        assert_eq!(h.next().await, Ev::Batch(0, 0));
        // nobody reads for a while: the sink fills, the subscriber stops reading, the
        // kernel buffers fill and the PUB socket drops at its high-water mark
        py.publish(3000).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        h.expect(&batches(0, 1..3001)).await;
        let stats = h.stats.snapshot();
        assert_eq!(stats.resyncs, 0, "{stats:?}");
        eprintln!("slow consumer: {stats:?}");
        h.stop().await;
    })
    .await;
}
