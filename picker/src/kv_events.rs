//! Decoding (and encoding) of the KV-cache event stream that vLLM and SGLang publish over ZMQ.
//!
//! The picker learns which prefixes each engine holds from these events (DESIGN.md §6). The
//! stream is untrusted network input arriving at thousands of batches per second, so this
//! module is a hand-written streaming msgpack reader over the payload slice (markers are
//! classified by the `rmp` crate): it never builds an intermediate value tree, never recurses,
//! never trusts a length prefix for an allocation larger than the bytes actually left, and
//! bounds every list by [`DecodeLimits`]. Malformed input is a [`DecodeError`], never a panic.
//!
//! # Wire formats accepted
//!
//! The engines serialize `msgspec` structs; the struct options decide the msgpack shape, and
//! they changed across releases (facts checked against the engines' sources):
//!
//! | source | batch | events |
//! |---|---|---|
//! | vLLM v0.9 (first release with events) | `[ts, events]` | `["BlockStored", hashes, parent, tokens, block_size, lora_id]`, `["BlockRemoved", hashes]`, `["AllBlocksCleared"]` |
//! | vLLM array era (up to vllm-project/vllm#42892) | `[ts, events, data_parallel_rank]` | `["BlockStored", hashes, parent, tokens, block_size, lora_id, medium, lora_name, (extra_keys, group_idx, ...)]`, `["BlockRemoved", hashes, medium, (group_idx)]` |
//! | vLLM v0.26 (after #42892) | `[ts, events, data_parallel_rank]` | maps: `{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", (extra_keys, group_idx, kv_cache_spec_kind, ...)}` |
//! | vLLM main (commit 0181ea31) | map `{"ts", "events", "data_parallel_rank"}` | maps, as above |
//! | SGLang (`srt/disaggregation/kv_events.py`) | `[ts, events, attn_dp_rank]` (older: `[ts, events]`) | `["BlockStored", hashes, parent, tokens, block_size, lora_id, (medium), (metadata)]`, `["BlockRemoved", hashes, (medium)]` |
//!
//! Field order of `BlockStored` in every version: `block_hashes, parent_block_hash, token_ids,
//! block_size, lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
//! kv_cache_spec_sliding_window` (vLLM); SGLang stops after `medium` and its newer
//! `BlockStoredWithMetadata` puts a `{"cache_salt": ...}` map in the slot where vLLM has
//! `lora_name`, so that slot is read as `lora_name` only when it holds a string.
//!
//! msgspec ignores `omit_defaults` for array-like structs (jcrist/msgspec#720): positional
//! events carry every field of their schema (nil when unset) and are short only when the
//! publisher's schema is older than ours. Map-encoded structs do omit defaulted fields.
//!
//! Block hashes are `int` (u64; SGLang's may be negative) or `bytes` (vLLM with
//! `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0` sends the raw digest); see [`decode_event_batch`].

use rmp::Marker;
use rmp::encode::ByteBuf;
use std::collections::VecDeque;
use thiserror::Error;

/// Sequence number of the replay end marker: vLLM/SGLang send `(-1).to_bytes(8, "big",
/// signed=True)`, i.e. all ones, followed by an empty payload.
pub const REPLAY_END_SEQ: u64 = u64::MAX;

/// One published payload: the events of one scheduler step, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Publisher wall-clock time (seconds since the Unix epoch) when the batch was built.
    pub ts: f64,
    /// Known events, in wire order. Unknown event kinds are left out (see `skipped_unknown`).
    pub events: Vec<KvEvent>,
    /// Data-parallel rank that owns these blocks: vLLM's `data_parallel_rank` or SGLang's
    /// `attn_dp_rank`. `None` when the publisher did not say (old schemas, or nil).
    pub data_parallel_rank: Option<u32>,
    /// How many events had a tag this decoder does not know. They are dropped rather than
    /// failing the batch so that a newer engine adding an event kind does not stop ingestion;
    /// a caller may log or count them. Not encoded by [`encode_event_batch`].
    pub skipped_unknown: u32,
}

/// A KV-cache event, as the engine reports it.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Full blocks became resident (and reusable) in the engine's prefix cache.
    BlockStored {
        /// Engine hashes of the stored blocks, in prefix order. Opaque to the picker: they are
        /// only used to map a later `BlockRemoved` back to the picker's own keys.
        block_hashes: Vec<u64>,
        /// Engine hash of the block preceding the first stored one; `None` for a prefix start.
        parent_block_hash: Option<u64>,
        /// Token ids of all stored blocks concatenated (`block_size` per block).
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// vLLM's numeric LoRA id (deprecated upstream in favour of `lora_name`).
        lora_id: Option<i64>,
        /// Storage tier, e.g. `"GPU"`, `"CPU"`, `"DISK"`; `None` when not reported.
        medium: Option<String>,
        /// LoRA adapter name; part of the engine's block key when set.
        lora_name: Option<String>,
        /// vLLM's per-block extra keys (empty when not reported): what the engine folded into
        /// each block's hash besides its tokens — the LoRA name, multimodal input hashes, the
        /// request's `cache_salt` (first block of a prefix only) and prompt-embedding hashes.
        extra_keys: Vec<Option<Vec<ExtraKey>>>,
        /// SGLang's `cache_salt` (from `BlockStoredWithMetadata`'s metadata map).
        cache_salt: Option<String>,
    },
    /// Blocks were evicted from the given tier.
    BlockRemoved {
        /// Engine hashes of the evicted blocks.
        block_hashes: Vec<u64>,
        /// Storage tier the blocks left; `None` when not reported.
        medium: Option<String>,
    },
    /// The engine dropped its whole prefix cache (e.g. `reset_prefix_cache`).
    AllBlocksCleared,
}

/// One element of a block's extra keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtraKey {
    /// A string: a LoRA name, a cache salt or a multimodal hash.
    Str(String),
    /// An integer (older vLLM folds the numeric LoRA id).
    Int(i64),
    /// Anything else (bytes, tuples, non-UTF-8 strings): its msgpack encoding, verbatim.
    Other(Vec<u8>),
}

/// Most extra keys one block may carry (vLLM has a handful: adapter, salt, one per image).
pub const MAX_EXTRA_KEYS_PER_BLOCK: usize = 256;

/// Bounds applied while decoding, so that a hostile or corrupt payload cannot make the picker
/// allocate or loop without limit. Exceeding one is a [`DecodeError`], not a truncation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeLimits {
    /// Events (known or not) in one batch.
    pub max_events_per_batch: usize,
    /// Block hashes in one event.
    pub max_hashes_per_event: usize,
    /// Token ids in one `BlockStored`.
    pub max_tokens_per_event: usize,
    /// Nesting depth of msgpack containers, counting the batch itself as 1. Known structure
    /// needs 4 (batch, event list, event, field list); the rest is for unknown fields that
    /// are skipped. Values above [`MAX_SUPPORTED_DEPTH`] act as that value.
    pub max_depth: u32,
}

/// Hard ceiling on [`DecodeLimits::max_depth`]: the skipper keeps its container stack in a
/// fixed array of this size, so skipping never allocates.
pub const MAX_SUPPORTED_DEPTH: u32 = 64;

impl Default for DecodeLimits {
    /// Generous for real traffic, small enough to bound memory per batch: one `BlockStored`
    /// for a 1M-token prompt at block size 16 is 65,536 hashes and 1,048,576 tokens.
    fn default() -> Self {
        Self {
            max_events_per_batch: 65_536,
            max_hashes_per_event: 262_144,
            max_tokens_per_event: 4 * 1024 * 1024,
            max_depth: 32,
        }
    }
}

/// Why a payload or message could not be decoded. Offsets are byte offsets into the payload.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DecodeError {
    /// The payload ended in the middle of a value.
    #[error("payload truncated at byte {offset} while reading {what}")]
    Truncated {
        /// What was being read.
        what: &'static str,
        /// Where the read started.
        offset: usize,
    },
    /// Byte 0xc1, which msgpack never uses.
    #[error("invalid msgpack marker 0x{byte:02x} at byte {offset} (reading {what})")]
    InvalidMarker {
        /// The offending byte.
        byte: u8,
        /// What was being read.
        what: &'static str,
        /// Where it is.
        offset: usize,
    },
    /// A value of the wrong msgpack type.
    #[error("{what} at byte {offset}: expected {expected}, found {found}")]
    UnexpectedType {
        /// What was being read.
        what: &'static str,
        /// The accepted types.
        expected: &'static str,
        /// The type found.
        found: &'static str,
        /// Where it is.
        offset: usize,
    },
    /// An integer that does not fit the field (e.g. a negative token id).
    #[error("{what} at byte {offset}: integer {value} out of range")]
    IntegerOutOfRange {
        /// What was being read.
        what: &'static str,
        /// The value.
        value: i128,
        /// Where it is.
        offset: usize,
    },
    /// A string that is not UTF-8.
    #[error("{what} at byte {offset}: string is not valid UTF-8")]
    InvalidUtf8 {
        /// What was being read.
        what: &'static str,
        /// Where it is.
        offset: usize,
    },
    /// A required field is absent (map) or the array is too short to hold it.
    #[error("{event}: missing required field `{field}`")]
    MissingField {
        /// The struct being decoded (`"batch"`, `"BlockStored"`, ...).
        event: &'static str,
        /// The field.
        field: &'static str,
    },
    /// A map-encoded event without a `"type"` key, or an empty event array.
    #[error("event at byte {offset} has no type tag")]
    MissingTag {
        /// Where the event starts.
        offset: usize,
    },
    /// A list longer than its [`DecodeLimits`] bound.
    #[error("{what}: {len} elements exceed the limit of {limit}")]
    TooMany {
        /// Which list.
        what: &'static str,
        /// Length announced on the wire.
        len: u64,
        /// The limit.
        limit: usize,
    },
    /// Containers nested deeper than [`DecodeLimits::max_depth`].
    #[error("msgpack nesting deeper than {limit} at byte {offset}")]
    TooDeep {
        /// The effective limit.
        limit: u32,
        /// Where the container that crossed it starts.
        offset: usize,
    },
    /// Bytes left over after the batch: a concatenated or corrupt payload.
    #[error("{count} trailing bytes after the batch")]
    TrailingBytes {
        /// How many.
        count: usize,
    },
    /// A ZMQ message with a frame count that no publisher sends: a live message has three
    /// (topic, sequence, payload); a replay reply has four, three or two (see
    /// [`replay_frames`]).
    #[error("expected 3 frames (topic, sequence, payload), or 4, 3 or 2 from a replay, got {got}")]
    WrongFrameCount {
        /// Frames received.
        got: usize,
    },
    /// A sequence frame that is not 8 bytes.
    #[error("sequence frame must be 8 bytes (big-endian u64), got {len}")]
    BadSequenceFrame {
        /// Its length.
        len: usize,
    },
    /// The replay end marker was passed where a batch was expected; check
    /// [`is_replay_end`] first.
    #[error("replay end marker (sequence -1, empty payload), not an event batch")]
    ReplayEndMarker,
}

/// Result alias for this module.
pub type Result<T, E = DecodeError> = std::result::Result<T, E>;

// ------------------------------------------------------------------------------------------
// Public decoding entry points
// ------------------------------------------------------------------------------------------

/// Decodes one msgpack payload into an [`EventBatch`].
///
/// Accepts every shape in the module docs: the batch as an array `[ts, events, rank?, ...]` or
/// as a map with `ts`, `events` and `data_parallel_rank` / `attn_dp_rank` (the former wins when
/// both are non-nil); each event as a tagged array or as a map tagged by `"type"` (in any key
/// position). Unknown keys and extra trailing array elements are skipped; unknown event tags
/// are counted in [`EventBatch::skipped_unknown`].
///
/// Block hashes: unsigned integers as is; signed integers reinterpreted as their 64-bit two's
/// complement (so `-1` is `u64::MAX`, matching an engine that masks to 64 bits); `bin` values
/// as their last 8 bytes big-endian, left-padded with zeros when shorter (vLLM's own
/// bytes-to-int conversion keeps the low 64 bits the same way).
///
/// # Errors
///
/// Any [`DecodeError`] about the payload: truncation, a wrong type or range, a missing
/// required field or tag, a [`DecodeLimits`] bound exceeded, or bytes after the batch.
pub fn decode_event_batch(payload: &[u8], limits: &DecodeLimits) -> Result<EventBatch> {
    let mut r = Reader::new(payload, limits);
    let batch = r.batch()?;
    let count = r.remaining();
    if count != 0 {
        return Err(DecodeError::TrailingBytes { count });
    }
    Ok(batch)
}

/// Decodes one ZMQ message: frames `(topic, sequence, payload)` as the PUB socket sends them
/// (and as a DEALER replay client receives them, with the empty delimiter in the topic slot).
///
/// Returns the topic (borrowed), the sequence number and the batch. The replay end marker is
/// reported as [`DecodeError::ReplayEndMarker`]; test with [`is_replay_end`] first.
///
/// # Errors
///
/// [`DecodeError::WrongFrameCount`], [`DecodeError::BadSequenceFrame`],
/// [`DecodeError::ReplayEndMarker`], or any payload error of [`decode_event_batch`].
pub fn decode_message<'a>(
    frames: &[&'a [u8]],
    limits: &DecodeLimits,
) -> Result<(&'a [u8], u64, EventBatch)> {
    let &[topic, seq, payload] = frames else {
        return Err(DecodeError::WrongFrameCount { got: frames.len() });
    };
    let seq = parse_seq(seq)?;
    if seq == REPLAY_END_SEQ && payload.is_empty() {
        return Err(DecodeError::ReplayEndMarker);
    }
    let batch = decode_event_batch(payload, limits)?;
    Ok((topic, seq, batch))
}

/// Decodes one replay reply, in any of the framings of [`replay_frames`]. Returns the topic
/// (empty when the reply has none), the sequence number and the batch.
///
/// # Errors
///
/// As [`decode_message`].
pub fn decode_replay_message<'a>(
    frames: &[&'a [u8]],
    limits: &DecodeLimits,
) -> Result<(&'a [u8], u64, EventBatch)> {
    let (topic, seq, payload) = replay_frames(frames)?;
    decode_message(&[topic, seq, payload], limits)
}

/// Splits one replay reply into `(topic, sequence, payload)`, whichever publisher sent it.
///
/// The publisher's ROUTER prefixes every reply with the client's identity and an empty
/// delimiter; the identity never reaches the client, the delimiter does unless the client is
/// a REQ socket. What follows changed across releases (checked against a real vLLM 0.32):
///
/// | publisher | reply (after the identity) | a DEALER receives | a REQ receives |
/// |---|---|---|---|
/// | vLLM 0.32 | `("", topic, seq, payload)`, end `("", "", -1, "")` | 4 frames | 3 frames |
/// | older vLLM, SGLang | `("", seq, payload)`, end `("", -1, "")` | 3 frames | 2 frames |
///
/// So four frames are the delimiter, the topic, the number and the payload; three are
/// `(delimiter or topic, seq, payload)`, read like a live message; two are `(seq, payload)`
/// without a topic.
///
/// # Errors
///
/// [`DecodeError::WrongFrameCount`] for any other count, or four frames whose first (the
/// delimiter) is not empty.
pub fn replay_frames<'a>(frames: &[&'a [u8]]) -> Result<(&'a [u8], &'a [u8], &'a [u8])> {
    match *frames {
        // the empty delimiter first
        [[], topic, seq, payload] => Ok((topic, seq, payload)),
        [topic, seq, payload] => Ok((topic, seq, payload)),
        [seq, payload] => Ok((&[], seq, payload)),
        _ => Err(DecodeError::WrongFrameCount { got: frames.len() }),
    }
}

/// Parses an 8-byte big-endian sequence frame.
///
/// # Errors
///
/// [`DecodeError::BadSequenceFrame`] when the frame is not exactly 8 bytes.
pub fn parse_seq(frame: &[u8]) -> Result<u64> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| DecodeError::BadSequenceFrame { len: frame.len() })?;
    Ok(u64::from_be_bytes(bytes))
}

/// The 8-byte big-endian frame for `seq`: the sequence frame of a published message, and also
/// the body of a replay request ("send me everything from `seq` on").
#[must_use]
pub fn seq_frame(seq: u64) -> [u8; 8] {
    seq.to_be_bytes()
}

/// True for the replay end marker: sequence all ones and an empty payload, in any framing of
/// [`replay_frames`]: vLLM 0.32's `("", "", -1, "")` to a DEALER (`("", -1, "")` to a REQ),
/// older vLLM's and SGLang's `("", -1, "")` to a DEALER (`(-1, "")` to a REQ).
#[must_use]
pub fn is_replay_end(frames: &[&[u8]]) -> bool {
    replay_frames(frames)
        .is_ok_and(|(_, seq, payload)| payload.is_empty() && parse_seq(seq) == Ok(REPLAY_END_SEQ))
}

/// Splits the epoch that newer SGLang publishers append to the topic frame when their snapshot
/// endpoint is enabled (`topic + b"\0sgl-kv-epoch=" + epoch`, possibly followed by
/// `b"\0sgl-kv-snapshot=" + id` on barrier messages). Returns the configured topic and the
/// epoch, if any. A new epoch means the publisher restarted and its sequence numbers began
/// again, so a caller should [`SequenceTracker::reset`] and resynchronize that endpoint.
#[must_use]
pub fn split_topic_epoch(topic: &[u8]) -> (&[u8], Option<&[u8]>) {
    const MARKER: &[u8] = b"\0sgl-kv-epoch=";
    let Some(at) = find(topic, MARKER) else {
        return (topic, None);
    };
    let base = topic.get(..at).unwrap_or(topic);
    let rest = topic.get(at + MARKER.len()..).unwrap_or_default();
    let epoch_end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
    (base, rest.get(..epoch_end))
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Seconds since the Unix epoch now: the unit and clock of [`EventBatch::ts`].
#[must_use]
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

// ------------------------------------------------------------------------------------------
// Sequence tracking
// ------------------------------------------------------------------------------------------

/// What [`SequenceTracker::observe`] concluded about a sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqOutcome {
    /// First number seen since creation or [`SequenceTracker::reset`]: nothing to compare.
    First,
    /// Exactly the next expected number.
    InOrder,
    /// Already seen (or older): drop the batch, its events were applied.
    Duplicate,
    /// Numbers `expected..got` were missed (ZMQ PUB drops under back-pressure). The tracker
    /// has moved past `got`; the caller may request a replay from `expected` and apply the
    /// replayed batches below `got` itself, or resynchronize the endpoint from scratch.
    Gap {
        /// First missing number.
        expected: u64,
        /// The number received.
        got: u64,
    },
    /// The number went back to 0, or further back than the restart window: the publisher
    /// restarted (the engine's cache is new). The tracker now follows the new stream; the
    /// caller should drop what it knew about this endpoint.
    Restart {
        /// What was expected from the old stream.
        expected: u64,
        /// The number received.
        got: u64,
    },
}

/// Per-publisher sequence bookkeeping (one per engine endpoint and rank).
///
/// Publishers number batches 0, 1, 2, ... from process start. Since an engine restart also
/// restarts the numbering, a number far below the expected one is a restart, not a duplicate:
/// duplicates only come from overlapping a replay with the live stream, and a replay reaches
/// back at most the publisher's buffer (10,000 batches by default), hence the default window.
///
/// A duplicate must also be a number this tracker has seen: it keeps the numbers it accepted
/// as a few ranges ([`SequenceTracker::SEEN_RANGES`]). A lower number it never saw means the
/// stream is below where the tracker thinks it is (a message numbered far ahead that the
/// publisher never sent moved it, or the publisher restarted): that is a
/// [`SeqOutcome::Restart`], so the tracker follows the stream again instead of taking every
/// real batch up to the bogus number for a duplicate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SequenceTracker {
    next: Option<u64>,
    restart_window: u64,
    /// Accepted numbers as inclusive ranges, oldest first, at most `SEEN_RANGES`.
    seen: VecDeque<(u64, u64)>,
}

impl Default for SequenceTracker {
    fn default() -> Self {
        Self::new()
    }
}

impl SequenceTracker {
    /// Default restart window: vLLM's and SGLang's default replay buffer (`buffer_steps`).
    pub const DEFAULT_RESTART_WINDOW: u64 = 10_000;

    /// Ranges of accepted numbers remembered. A healthy stream needs one; each gap starts
    /// another until a replay or a reset.
    pub const SEEN_RANGES: usize = 16;

    /// A tracker that has seen nothing yet.
    #[must_use]
    pub fn new() -> Self {
        Self::with_restart_window(Self::DEFAULT_RESTART_WINDOW)
    }

    /// A tracker treating a number more than `window` below the expected one as a restart.
    #[must_use]
    pub fn with_restart_window(window: u64) -> Self {
        Self {
            next: None,
            restart_window: window,
            seen: VecDeque::new(),
        }
    }

    fn accept(&mut self, seq: u64) {
        self.next = Some(seq.saturating_add(1));
        match self.seen.back_mut() {
            Some((_, hi)) if hi.saturating_add(1) == seq => *hi = seq,
            Some(&mut (lo, hi)) if (lo..=hi).contains(&seq) => {}
            _ => {
                if self.seen.len() == Self::SEEN_RANGES {
                    self.seen.pop_front();
                }
                self.seen.push_back((seq, seq));
            }
        }
    }

    fn was_seen(&self, seq: u64) -> bool {
        self.seen.iter().any(|&(lo, hi)| (lo..=hi).contains(&seq))
    }

    /// Classifies `seq` and advances. Do not pass [`REPLAY_END_SEQ`]; it is not a batch.
    #[must_use = "a Duplicate must be dropped and a Gap or Restart handled"]
    pub fn observe(&mut self, seq: u64) -> SeqOutcome {
        let Some(expected) = self.next else {
            self.accept(seq);
            return SeqOutcome::First;
        };
        if seq == expected {
            self.accept(seq);
            SeqOutcome::InOrder
        } else if seq > expected {
            self.accept(seq);
            SeqOutcome::Gap { expected, got: seq }
        } else if seq == 0 || expected - seq > self.restart_window || !self.was_seen(seq) {
            self.seen.clear();
            self.accept(seq);
            SeqOutcome::Restart { expected, got: seq }
        } else {
            SeqOutcome::Duplicate
        }
    }

    /// The next number expected, if any was seen.
    #[must_use]
    pub fn expected(&self) -> Option<u64> {
        self.next
    }

    /// Forgets everything: the next number observed is [`SeqOutcome::First`]. Use after a
    /// reconnect, an epoch change or a full resynchronization.
    pub fn reset(&mut self) {
        self.next = None;
        self.seen.clear();
    }
}

// ------------------------------------------------------------------------------------------
// Encoding
// ------------------------------------------------------------------------------------------

/// Which engine wire shape [`encode_event_batch`] produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventEncoding {
    /// Everything positional, as vLLM before #42892 (and SGLang) publish:
    /// `[ts, [["BlockStored", hashes, parent, tokens, block_size, lora_id, medium, lora_name],
    /// ["BlockRemoved", hashes, medium], ["AllBlocksCleared"]], rank]`. Every field is
    /// written (nil when unset) because msgspec writes all fields of array-like structs; the
    /// rank is left out when `None`.
    Array,
    /// vLLM v0.26: positional batch `[ts, events, rank]`, each event a map whose first key is
    /// `"type"`, then the fields in declaration order (nil when unset).
    MapEvents,
    /// vLLM main: the batch too is a map `{"ts", "events", "data_parallel_rank"}` (rank
    /// omitted when `None`), events as in [`EventEncoding::MapEvents`].
    Map,
}

/// Encodes a batch exactly as the engine's msgspec encoder would (smallest integer forms,
/// `ts` as float64), for the engine simulator and for tests. `skipped_unknown` is not encoded.
/// Lists longer than `u32::MAX` elements (not representable in msgpack) are cut at that length.
#[must_use]
pub fn encode_event_batch(batch: &EventBatch, encoding: EventEncoding) -> Vec<u8> {
    let mut w = Writer::with_capacity(estimate_size(batch));
    let map_events = encoding != EventEncoding::Array;
    match encoding {
        EventEncoding::Array | EventEncoding::MapEvents => {
            w.array_len(if batch.data_parallel_rank.is_some() {
                3
            } else {
                2
            });
            w.f64(batch.ts);
            w.events(&batch.events, map_events);
            if let Some(rank) = batch.data_parallel_rank {
                w.uint(u64::from(rank));
            }
        }
        EventEncoding::Map => {
            w.map_len(if batch.data_parallel_rank.is_some() {
                3
            } else {
                2
            });
            w.str("ts");
            w.f64(batch.ts);
            w.str("events");
            w.events(&batch.events, map_events);
            if let Some(rank) = batch.data_parallel_rank {
                w.str("data_parallel_rank");
                w.uint(u64::from(rank));
            }
        }
    }
    w.finish()
}

fn estimate_size(batch: &EventBatch) -> usize {
    batch
        .events
        .iter()
        .map(|e| match e {
            KvEvent::BlockStored {
                block_hashes,
                token_ids,
                ..
            } => 96 + 9 * block_hashes.len() + 5 * token_ids.len(),
            KvEvent::BlockRemoved { block_hashes, .. } => 48 + 9 * block_hashes.len(),
            KvEvent::AllBlocksCleared => 24,
        })
        .sum::<usize>()
        + 48
}

/// Thin wrapper over `rmp::encode` writing into an infallible buffer.
struct Writer {
    buf: ByteBuf,
}

/// `rmp` reports errors of the sink; a `ByteBuf` cannot fail, so its error type is
/// uninhabited and these destructurings are irrefutable.
impl Writer {
    fn with_capacity(cap: usize) -> Self {
        Self {
            buf: ByteBuf::with_capacity(cap),
        }
    }

    fn finish(self) -> Vec<u8> {
        self.buf.into_vec()
    }

    fn array_len(&mut self, len: u32) {
        let Ok(_) = rmp::encode::write_array_len(&mut self.buf, len);
    }

    fn map_len(&mut self, len: u32) {
        let Ok(_) = rmp::encode::write_map_len(&mut self.buf, len);
    }

    fn f64(&mut self, v: f64) {
        let Ok(()) = rmp::encode::write_f64(&mut self.buf, v);
    }

    fn uint(&mut self, v: u64) {
        let Ok(_) = rmp::encode::write_uint(&mut self.buf, v);
    }

    fn sint(&mut self, v: i64) {
        let Ok(_) = rmp::encode::write_sint(&mut self.buf, v);
    }

    fn nil(&mut self) {
        let Ok(()) = rmp::encode::write_nil(&mut self.buf);
    }

    fn str(&mut self, s: &str) {
        let Ok(()) = rmp::encode::write_str(&mut self.buf, s);
    }

    fn opt_str(&mut self, s: Option<&str>) {
        match s {
            Some(s) => self.str(s),
            None => self.nil(),
        }
    }

    fn opt_uint(&mut self, v: Option<u64>) {
        match v {
            Some(v) => self.uint(v),
            None => self.nil(),
        }
    }

    fn opt_sint(&mut self, v: Option<i64>) {
        match v {
            Some(v) => self.sint(v),
            None => self.nil(),
        }
    }

    /// Extra keys as vLLM writes them: a list (one entry per block) of nil or tuples.
    fn extra_keys(&mut self, keys: &[Option<Vec<ExtraKey>>]) {
        let len = u32::try_from(keys.len()).unwrap_or(u32::MAX);
        self.array_len(len);
        for block in keys.iter().take(len as usize) {
            match block {
                None => self.nil(),
                Some(items) => {
                    let n = u32::try_from(items.len()).unwrap_or(u32::MAX);
                    self.array_len(n);
                    for k in items.iter().take(n as usize) {
                        match k {
                            ExtraKey::Str(v) => self.str(v),
                            ExtraKey::Int(v) => self.sint(*v),
                            ExtraKey::Other(raw) => self.buf.as_mut_vec().extend_from_slice(raw),
                        }
                    }
                }
            }
        }
    }

    /// Writes the length prefix and at most `u32::MAX` elements, keeping the output valid.
    fn list<T: Copy>(&mut self, items: &[T], mut each: impl FnMut(&mut Self, T)) {
        let len = u32::try_from(items.len()).unwrap_or(u32::MAX);
        self.array_len(len);
        for &item in items.iter().take(len as usize) {
            each(self, item);
        }
    }

    fn events(&mut self, events: &[KvEvent], as_maps: bool) {
        let len = u32::try_from(events.len()).unwrap_or(u32::MAX);
        self.array_len(len);
        for event in events.iter().take(len as usize) {
            if as_maps {
                self.map_event(event);
            } else {
                self.array_event(event);
            }
        }
    }

    fn array_event(&mut self, event: &KvEvent) {
        match event {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
                lora_name,
                extra_keys,
                cache_salt,
            } => {
                self.array_len(if extra_keys.is_empty() { 8 } else { 9 });
                self.str(TAG_STORED);
                self.list(block_hashes, |w, h| w.uint(h));
                self.opt_uint(*parent_block_hash);
                self.list(token_ids, |w, t| w.uint(u64::from(t)));
                self.uint(u64::from(*block_size));
                self.opt_sint(*lora_id);
                self.opt_str(medium.as_deref());
                // SGLang's `BlockStoredWithMetadata` puts `{cache_salt}` in the `lora_name` slot
                match (lora_name, cache_salt) {
                    (None, Some(salt)) => {
                        self.map_len(1);
                        self.str("cache_salt");
                        self.str(salt);
                    }
                    _ => self.opt_str(lora_name.as_deref()),
                }
                if !extra_keys.is_empty() {
                    self.extra_keys(extra_keys);
                }
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
            } => {
                self.array_len(3);
                self.str(TAG_REMOVED);
                self.list(block_hashes, |w, h| w.uint(h));
                self.opt_str(medium.as_deref());
            }
            KvEvent::AllBlocksCleared => {
                self.array_len(1);
                self.str(TAG_CLEARED);
            }
        }
    }

    fn map_event(&mut self, event: &KvEvent) {
        match event {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
                lora_name,
                extra_keys,
                cache_salt,
            } => {
                self.map_len(
                    8 + u32::from(!extra_keys.is_empty()) + u32::from(cache_salt.is_some()),
                );
                self.str("type");
                self.str(TAG_STORED);
                self.str("block_hashes");
                self.list(block_hashes, |w, h| w.uint(h));
                self.str("parent_block_hash");
                self.opt_uint(*parent_block_hash);
                self.str("token_ids");
                self.list(token_ids, |w, t| w.uint(u64::from(t)));
                self.str("block_size");
                self.uint(u64::from(*block_size));
                self.str("lora_id");
                self.opt_sint(*lora_id);
                self.str("medium");
                self.opt_str(medium.as_deref());
                self.str("lora_name");
                self.opt_str(lora_name.as_deref());
                if !extra_keys.is_empty() {
                    self.str("extra_keys");
                    self.extra_keys(extra_keys);
                }
                if let Some(salt) = cache_salt {
                    self.str("cache_salt");
                    self.str(salt);
                }
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
            } => {
                self.map_len(3);
                self.str("type");
                self.str(TAG_REMOVED);
                self.str("block_hashes");
                self.list(block_hashes, |w, h| w.uint(h));
                self.str("medium");
                self.opt_str(medium.as_deref());
            }
            KvEvent::AllBlocksCleared => {
                self.map_len(1);
                self.str("type");
                self.str(TAG_CLEARED);
            }
        }
    }
}

const TAG_STORED: &str = "BlockStored";
const TAG_REMOVED: &str = "BlockRemoved";
const TAG_CLEARED: &str = "AllBlocksCleared";

// ------------------------------------------------------------------------------------------
// The reader
// ------------------------------------------------------------------------------------------

/// Nesting levels of the known structure (the batch is level 1).
const DEPTH_BATCH: u32 = 1;
const DEPTH_EVENTS: u32 = 2;
const DEPTH_EVENT: u32 = 3;
const DEPTH_FIELD: u32 = 4;

/// One msgpack value header. Scalars are complete (strings and binaries borrow the payload);
/// containers carry their element count, and their elements follow in the input.
#[derive(Debug, Clone, Copy)]
enum Head<'a> {
    Nil,
    Bool,
    /// A non-negative integer (positive fixint or uint8..uint64).
    Uint(u64),
    /// An integer written with a signed marker (negative fixint or int8..int64); may be >= 0.
    Int(i64),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Array(u32),
    Map(u32),
    Ext,
}

impl Head<'_> {
    fn kind(&self) -> &'static str {
        match self {
            Head::Nil => "nil",
            Head::Bool => "bool",
            Head::Uint(_) | Head::Int(_) => "integer",
            Head::Float(_) => "float",
            Head::Str(_) => "string",
            Head::Bin(_) => "binary",
            Head::Array(_) => "array",
            Head::Map(_) => "map",
            Head::Ext => "ext",
        }
    }
}

/// Cursor over a payload. `pos <= buf.len()` always holds.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    limits: &'a DecodeLimits,
}

/// Event kinds this decoder knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Stored,
    Removed,
    Cleared,
}

impl Kind {
    fn from_tag(tag: &[u8]) -> Option<Self> {
        match tag {
            b"BlockStored" => Some(Kind::Stored),
            b"BlockRemoved" => Some(Kind::Removed),
            b"AllBlocksCleared" => Some(Kind::Cleared),
            _ => None,
        }
    }
}

/// Fields of a `BlockStored` / `BlockRemoved` being assembled from a map in any key order.
#[derive(Default)]
struct Fields {
    block_hashes: Option<Vec<u64>>,
    parent_block_hash: Option<u64>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    lora_id: Option<i64>,
    medium: Option<String>,
    lora_name: Option<String>,
    extra_keys: Vec<Option<Vec<ExtraKey>>>,
    cache_salt: Option<String>,
}

impl Fields {
    fn build(self, kind: Kind) -> Result<KvEvent> {
        Ok(match kind {
            Kind::Stored => KvEvent::BlockStored {
                block_hashes: self.block_hashes.ok_or(DecodeError::MissingField {
                    event: TAG_STORED,
                    field: "block_hashes",
                })?,
                parent_block_hash: self.parent_block_hash,
                token_ids: self.token_ids.ok_or(DecodeError::MissingField {
                    event: TAG_STORED,
                    field: "token_ids",
                })?,
                block_size: self.block_size.ok_or(DecodeError::MissingField {
                    event: TAG_STORED,
                    field: "block_size",
                })?,
                lora_id: self.lora_id,
                medium: self.medium,
                lora_name: self.lora_name,
                extra_keys: self.extra_keys,
                cache_salt: self.cache_salt,
            },
            Kind::Removed => KvEvent::BlockRemoved {
                block_hashes: self.block_hashes.ok_or(DecodeError::MissingField {
                    event: TAG_REMOVED,
                    field: "block_hashes",
                })?,
                medium: self.medium,
            },
            Kind::Cleared => KvEvent::AllBlocksCleared,
        })
    }
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8], limits: &'a DecodeLimits) -> Self {
        Self {
            buf,
            pos: 0,
            limits,
        }
    }

    fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    fn max_depth(&self) -> u32 {
        self.limits.max_depth.min(MAX_SUPPORTED_DEPTH)
    }

    /// Fails when a container at `depth` would exceed the depth limit.
    fn enter(&self, depth: u32, offset: usize) -> Result<()> {
        if depth > self.max_depth() {
            return Err(DecodeError::TooDeep {
                limit: self.max_depth(),
                offset,
            });
        }
        Ok(())
    }

    fn take(&mut self, n: usize, what: &'static str, offset: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .ok_or(DecodeError::Truncated { what, offset })?;
        let bytes = self
            .buf
            .get(self.pos..end)
            .ok_or(DecodeError::Truncated { what, offset })?;
        self.pos = end;
        Ok(bytes)
    }

    fn fixed<const N: usize>(&mut self, what: &'static str, offset: usize) -> Result<[u8; N]> {
        let bytes = self.take(N, what, offset)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn len8(&mut self, what: &'static str, offset: usize) -> Result<usize> {
        Ok(usize::from(self.fixed::<1>(what, offset)?[0]))
    }

    fn len16(&mut self, what: &'static str, offset: usize) -> Result<usize> {
        Ok(usize::from(u16::from_be_bytes(self.fixed(what, offset)?)))
    }

    fn len32(&mut self, what: &'static str, offset: usize) -> Result<u32> {
        Ok(u32::from_be_bytes(self.fixed(what, offset)?))
    }

    fn peek_byte(&self) -> Option<u8> {
        self.buf.get(self.pos).copied()
    }

    /// Reads one value header; string/binary/ext payloads are consumed, container elements
    /// are not.
    fn head(&mut self, what: &'static str) -> Result<Head<'a>> {
        let offset = self.pos;
        let byte = self.fixed::<1>(what, offset)?[0];
        let usize_of = |n: u32| usize::try_from(n).unwrap_or(usize::MAX);
        Ok(match Marker::from_u8(byte) {
            Marker::FixPos(v) => Head::Uint(u64::from(v)),
            Marker::FixNeg(v) => Head::Int(i64::from(v)),
            Marker::Null => Head::Nil,
            Marker::True | Marker::False => Head::Bool,
            Marker::U8 => Head::Uint(u64::from(u8::from_be_bytes(self.fixed(what, offset)?))),
            Marker::U16 => Head::Uint(u64::from(u16::from_be_bytes(self.fixed(what, offset)?))),
            Marker::U32 => Head::Uint(u64::from(u32::from_be_bytes(self.fixed(what, offset)?))),
            Marker::U64 => Head::Uint(u64::from_be_bytes(self.fixed(what, offset)?)),
            Marker::I8 => Head::Int(i64::from(i8::from_be_bytes(self.fixed(what, offset)?))),
            Marker::I16 => Head::Int(i64::from(i16::from_be_bytes(self.fixed(what, offset)?))),
            Marker::I32 => Head::Int(i64::from(i32::from_be_bytes(self.fixed(what, offset)?))),
            Marker::I64 => Head::Int(i64::from_be_bytes(self.fixed(what, offset)?)),
            Marker::F32 => Head::Float(f64::from(f32::from_be_bytes(self.fixed(what, offset)?))),
            Marker::F64 => Head::Float(f64::from_be_bytes(self.fixed(what, offset)?)),
            Marker::FixStr(n) => Head::Str(self.take(usize::from(n), what, offset)?),
            Marker::Str8 => {
                let n = self.len8(what, offset)?;
                Head::Str(self.take(n, what, offset)?)
            }
            Marker::Str16 => {
                let n = self.len16(what, offset)?;
                Head::Str(self.take(n, what, offset)?)
            }
            Marker::Str32 => {
                let n = self.len32(what, offset)?;
                Head::Str(self.take(usize_of(n), what, offset)?)
            }
            Marker::Bin8 => {
                let n = self.len8(what, offset)?;
                Head::Bin(self.take(n, what, offset)?)
            }
            Marker::Bin16 => {
                let n = self.len16(what, offset)?;
                Head::Bin(self.take(n, what, offset)?)
            }
            Marker::Bin32 => {
                let n = self.len32(what, offset)?;
                Head::Bin(self.take(usize_of(n), what, offset)?)
            }
            Marker::FixArray(n) => Head::Array(u32::from(n)),
            Marker::Array16 => {
                Head::Array(u32::from(u16::from_be_bytes(self.fixed(what, offset)?)))
            }
            Marker::Array32 => Head::Array(self.len32(what, offset)?),
            Marker::FixMap(n) => Head::Map(u32::from(n)),
            Marker::Map16 => Head::Map(u32::from(u16::from_be_bytes(self.fixed(what, offset)?))),
            Marker::Map32 => Head::Map(self.len32(what, offset)?),
            Marker::FixExt1 => self.ext(1, what, offset)?,
            Marker::FixExt2 => self.ext(2, what, offset)?,
            Marker::FixExt4 => self.ext(4, what, offset)?,
            Marker::FixExt8 => self.ext(8, what, offset)?,
            Marker::FixExt16 => self.ext(16, what, offset)?,
            Marker::Ext8 => {
                let n = self.len8(what, offset)?;
                self.ext(n, what, offset)?
            }
            Marker::Ext16 => {
                let n = self.len16(what, offset)?;
                self.ext(n, what, offset)?
            }
            Marker::Ext32 => {
                let n = self.len32(what, offset)?;
                self.ext(usize_of(n), what, offset)?
            }
            Marker::Reserved => {
                return Err(DecodeError::InvalidMarker { byte, what, offset });
            }
        })
    }

    /// Consumes an ext value's type byte and `len` data bytes.
    fn ext(&mut self, len: usize, what: &'static str, offset: usize) -> Result<Head<'a>> {
        self.take(len.saturating_add(1), what, offset)?;
        Ok(Head::Ext)
    }

    fn unexpected(
        what: &'static str,
        expected: &'static str,
        found: Head<'_>,
        offset: usize,
    ) -> DecodeError {
        DecodeError::UnexpectedType {
            what,
            expected,
            found: found.kind(),
            offset,
        }
    }

    /// Skips one complete value whose own nesting level is `depth`, without recursion or
    /// allocation: a fixed stack holds the element counts still to skip per open container.
    /// Every element costs at least one input byte, so the loop is bounded by the input size.
    fn skip(&mut self, depth: u32) -> Result<()> {
        const STACK: usize = MAX_SUPPORTED_DEPTH as usize;
        let mut stack = [0u64; STACK];
        let mut open = 0usize;
        loop {
            let offset = self.pos;
            let head = self.head("skipped value")?;
            let children = match head {
                Head::Array(n) => Some(u64::from(n)),
                Head::Map(n) => Some(2 * u64::from(n)),
                _ => None,
            };
            if let Some(children) = children {
                // Level of this container: `depth` plus the containers it sits in.
                let level = depth.saturating_add(u32::try_from(open).unwrap_or(u32::MAX));
                self.enter(level, offset)?;
                if children > 0 {
                    let slot = stack.get_mut(open).ok_or(DecodeError::TooDeep {
                        limit: self.max_depth(),
                        offset,
                    })?;
                    *slot = children;
                    open += 1;
                    continue;
                }
            }
            // A value just ended: count it against the enclosing containers, closing those
            // that are complete.
            loop {
                let Some(top) = open.checked_sub(1) else {
                    return Ok(());
                };
                let Some(left) = stack.get_mut(top) else {
                    return Ok(());
                };
                *left = left.saturating_sub(1);
                if *left > 0 {
                    break;
                }
                open = top;
            }
        }
    }

    /// Skips `n` consecutive values at `depth`.
    fn skip_n(&mut self, n: u64, depth: u32) -> Result<()> {
        for _ in 0..n {
            self.skip(depth)?;
        }
        Ok(())
    }

    // ---- typed reads -----------------------------------------------------------------------

    fn f64(&mut self, what: &'static str) -> Result<f64> {
        let offset = self.pos;
        match self.head(what)? {
            Head::Float(v) => Ok(v),
            // Integral timestamps: an encoder may write 1718000000.0 as an integer.
            Head::Uint(v) => Ok(v as f64),
            Head::Int(v) => Ok(v as f64),
            other => Err(Self::unexpected(what, "float", other, offset)),
        }
    }

    fn u64(&mut self, what: &'static str) -> Result<u64> {
        let offset = self.pos;
        match self.head(what)? {
            Head::Uint(v) => Ok(v),
            Head::Int(v) => u64::try_from(v).map_err(|_| DecodeError::IntegerOutOfRange {
                what,
                value: i128::from(v),
                offset,
            }),
            other => Err(Self::unexpected(
                what,
                "non-negative integer",
                other,
                offset,
            )),
        }
    }

    fn u32(&mut self, what: &'static str) -> Result<u32> {
        let offset = self.pos;
        let v = self.u64(what)?;
        u32::try_from(v).map_err(|_| DecodeError::IntegerOutOfRange {
            what,
            value: i128::from(v),
            offset,
        })
    }

    fn opt_u32(&mut self, what: &'static str) -> Result<Option<u32>> {
        if self.peek_byte() == Some(NIL) {
            self.pos += 1;
            return Ok(None);
        }
        self.u32(what).map(Some)
    }

    fn opt_i64(&mut self, what: &'static str) -> Result<Option<i64>> {
        let offset = self.pos;
        match self.head(what)? {
            Head::Nil => Ok(None),
            Head::Int(v) => Ok(Some(v)),
            Head::Uint(v) => {
                i64::try_from(v)
                    .map(Some)
                    .map_err(|_| DecodeError::IntegerOutOfRange {
                        what,
                        value: i128::from(v),
                        offset,
                    })
            }
            other => Err(Self::unexpected(what, "integer or nil", other, offset)),
        }
    }

    fn str_bytes(&mut self, what: &'static str) -> Result<&'a [u8]> {
        let offset = self.pos;
        match self.head(what)? {
            Head::Str(s) => Ok(s),
            other => Err(Self::unexpected(what, "string", other, offset)),
        }
    }

    fn opt_string(&mut self, what: &'static str) -> Result<Option<String>> {
        let offset = self.pos;
        match self.head(what)? {
            Head::Nil => Ok(None),
            Head::Str(s) => std::str::from_utf8(s)
                .map(|s| Some(s.to_owned()))
                .map_err(|_| DecodeError::InvalidUtf8 { what, offset }),
            other => Err(Self::unexpected(what, "string or nil", other, offset)),
        }
    }

    /// The `lora_name` slot of a positional `BlockStored`: a string or nil for vLLM, but
    /// SGLang's `BlockStoredWithMetadata` puts a metadata map there (`{cache_salt}`). Returns
    /// `(lora_name, cache_salt)`; anything else in the slot is skipped.
    fn lora_name_or_metadata(&mut self) -> Result<(Option<String>, Option<String>)> {
        match self.peek_byte().map(Marker::from_u8) {
            Some(
                Marker::Null | Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32,
            ) => Ok((self.opt_string("lora_name")?, None)),
            Some(Marker::FixMap(_) | Marker::Map16 | Marker::Map32) => {
                let offset = self.pos;
                let Head::Map(n) = self.head("metadata")? else {
                    return Ok((None, None));
                };
                self.enter(DEPTH_FIELD, offset)?;
                let mut salt = None;
                for _ in 0..n {
                    let key = self.key(DEPTH_FIELD + 1)?;
                    let is_str = matches!(
                        self.peek_byte().map(Marker::from_u8),
                        Some(Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32)
                    );
                    if key == Some(b"cache_salt") && is_str {
                        salt = self.opt_string("cache_salt")?;
                    } else {
                        self.skip(DEPTH_FIELD + 1)?;
                    }
                }
                Ok((None, salt))
            }
            _ => {
                self.skip(DEPTH_FIELD)?;
                Ok((None, None))
            }
        }
    }

    /// vLLM's `extra_keys`: nil, or a list with one entry per block, each nil or a tuple.
    fn extra_keys(&mut self) -> Result<Vec<Option<Vec<ExtraKey>>>> {
        if self.peek_byte() == Some(NIL) {
            self.pos += 1;
            return Ok(Vec::new());
        }
        let (n, cap) = self.list_header("extra_keys", self.limits.max_hashes_per_event)?;
        let mut out = Vec::with_capacity(cap);
        for _ in 0..n {
            let offset = self.pos;
            match self.head("extra_keys")? {
                Head::Nil => out.push(None),
                Head::Array(k) => {
                    self.enter(DEPTH_FIELD + 1, offset)?;
                    let len = usize::try_from(k).unwrap_or(usize::MAX);
                    if len > MAX_EXTRA_KEYS_PER_BLOCK {
                        return Err(DecodeError::TooMany {
                            what: "extra_keys",
                            len: u64::from(k),
                            limit: MAX_EXTRA_KEYS_PER_BLOCK,
                        });
                    }
                    let mut keys = Vec::with_capacity(len.min(self.remaining()));
                    for _ in 0..k {
                        keys.push(self.extra_key()?);
                    }
                    out.push(Some(keys));
                }
                other => {
                    return Err(Self::unexpected(
                        "extra_keys",
                        "array or nil",
                        other,
                        offset,
                    ));
                }
            }
        }
        Ok(out)
    }

    fn extra_key(&mut self) -> Result<ExtraKey> {
        let start = self.pos;
        let key = match self.peek_byte().map(Marker::from_u8) {
            Some(Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32) => {
                match std::str::from_utf8(self.str_bytes("extra key")?) {
                    Ok(v) => ExtraKey::Str(v.to_owned()),
                    Err(_) => {
                        ExtraKey::Other(self.buf.get(start..self.pos).unwrap_or_default().to_vec())
                    }
                }
            }
            _ => match self.head("extra key")? {
                Head::Int(v) => ExtraKey::Int(v),
                Head::Uint(v) if i64::try_from(v).is_ok() => ExtraKey::Int(v as i64),
                _ => {
                    // rewind and skip the whole value (it may be a container)
                    self.pos = start;
                    self.skip(DEPTH_FIELD + 2)?;
                    ExtraKey::Other(self.buf.get(start..self.pos).unwrap_or_default().to_vec())
                }
            },
        };
        Ok(key)
    }

    fn hash(&mut self, what: &'static str) -> Result<u64> {
        let offset = self.pos;
        match self.head(what)? {
            Head::Uint(v) => Ok(v),
            // Two's complement reinterpretation: SGLang and some engines emit signed 64-bit
            // hashes; the bit pattern is the identity, the sign is an artifact.
            Head::Int(v) => Ok(v as u64),
            Head::Bin(b) => Ok(hash_from_bytes(b)),
            other => Err(Self::unexpected(what, "integer or binary", other, offset)),
        }
    }

    fn opt_hash(&mut self, what: &'static str) -> Result<Option<u64>> {
        if self.peek_byte() == Some(NIL) {
            self.pos += 1;
            return Ok(None);
        }
        self.hash(what).map(Some)
    }

    /// Reads an array header for a known list at `DEPTH_FIELD` and checks it against `limit`.
    /// The returned capacity never exceeds the bytes left (each element takes at least one),
    /// so a forged length cannot trigger a large allocation.
    fn list_header(&mut self, what: &'static str, limit: usize) -> Result<(u32, usize)> {
        let offset = self.pos;
        let n = match self.head(what)? {
            Head::Array(n) => n,
            other => return Err(Self::unexpected(what, "array", other, offset)),
        };
        self.enter(DEPTH_FIELD, offset)?;
        let len = usize::try_from(n).unwrap_or(usize::MAX);
        if len > limit {
            return Err(DecodeError::TooMany {
                what,
                len: u64::from(n),
                limit,
            });
        }
        Ok((n, len.min(self.remaining())))
    }

    fn hash_list(&mut self, what: &'static str) -> Result<Vec<u64>> {
        let (n, cap) = self.list_header(what, self.limits.max_hashes_per_event)?;
        let mut out = Vec::with_capacity(cap);
        for _ in 0..n {
            out.push(self.hash(what)?);
        }
        Ok(out)
    }

    fn token_list(&mut self, what: &'static str) -> Result<Vec<u32>> {
        let (n, cap) = self.list_header(what, self.limits.max_tokens_per_event)?;
        let mut out = Vec::with_capacity(cap);
        for _ in 0..n {
            out.push(self.u32(what)?);
        }
        Ok(out)
    }

    // ---- structure -------------------------------------------------------------------------

    fn batch(&mut self) -> Result<EventBatch> {
        let offset = self.pos;
        match self.head("batch")? {
            Head::Array(n) => {
                self.enter(DEPTH_BATCH, offset)?;
                if n < 1 {
                    return Err(DecodeError::MissingField {
                        event: "batch",
                        field: "ts",
                    });
                }
                let ts = self.f64("batch ts")?;
                if n < 2 {
                    return Err(DecodeError::MissingField {
                        event: "batch",
                        field: "events",
                    });
                }
                let (events, skipped_unknown) = self.events()?;
                let data_parallel_rank = if n >= 3 {
                    self.opt_u32("batch data_parallel_rank")?
                } else {
                    None
                };
                self.skip_n(u64::from(n.saturating_sub(3)), DEPTH_EVENTS)?;
                Ok(EventBatch {
                    ts,
                    events,
                    data_parallel_rank,
                    skipped_unknown,
                })
            }
            Head::Map(n) => {
                self.enter(DEPTH_BATCH, offset)?;
                let mut ts = None;
                let mut events = None;
                let mut dp_rank = None;
                let mut attn_rank = None;
                for _ in 0..n {
                    match self.key(DEPTH_EVENTS)? {
                        Some(b"ts") => ts = Some(self.f64("batch ts")?),
                        Some(b"events") => events = Some(self.events()?),
                        Some(b"data_parallel_rank") => {
                            dp_rank = self.opt_u32("batch data_parallel_rank")?;
                        }
                        Some(b"attn_dp_rank") => {
                            attn_rank = self.opt_u32("batch attn_dp_rank")?;
                        }
                        _ => self.skip(DEPTH_EVENTS)?,
                    }
                }
                let ts = ts.ok_or(DecodeError::MissingField {
                    event: "batch",
                    field: "ts",
                })?;
                let (events, skipped_unknown) = events.ok_or(DecodeError::MissingField {
                    event: "batch",
                    field: "events",
                })?;
                Ok(EventBatch {
                    ts,
                    events,
                    data_parallel_rank: dp_rank.or(attn_rank),
                    skipped_unknown,
                })
            }
            other => Err(Self::unexpected("batch", "array or map", other, offset)),
        }
    }

    /// Reads a map key at `depth`. Returns `None` (after skipping it) for a non-string key,
    /// which no known field uses.
    fn key(&mut self, depth: u32) -> Result<Option<&'a [u8]>> {
        match self.peek_byte().map(Marker::from_u8) {
            Some(Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32) => {
                self.str_bytes("map key").map(Some)
            }
            _ => {
                self.skip(depth)?;
                Ok(None)
            }
        }
    }

    fn events(&mut self) -> Result<(Vec<KvEvent>, u32)> {
        let offset = self.pos;
        let n = match self.head("events")? {
            Head::Array(n) => n,
            other => return Err(Self::unexpected("events", "array", other, offset)),
        };
        self.enter(DEPTH_EVENTS, offset)?;
        let len = usize::try_from(n).unwrap_or(usize::MAX);
        let limit = self.limits.max_events_per_batch;
        if len > limit {
            return Err(DecodeError::TooMany {
                what: "events",
                len: u64::from(n),
                limit,
            });
        }
        let mut events = Vec::with_capacity(len.min(self.remaining()));
        let mut skipped = 0u32;
        for _ in 0..n {
            match self.event()? {
                Some(event) => events.push(event),
                None => skipped = skipped.saturating_add(1),
            }
        }
        Ok((events, skipped))
    }

    /// Reads one event; `None` for an unknown tag (fully skipped).
    fn event(&mut self) -> Result<Option<KvEvent>> {
        let offset = self.pos;
        match self.head("event")? {
            Head::Array(n) => {
                self.enter(DEPTH_EVENT, offset)?;
                self.array_event(n, offset)
            }
            Head::Map(n) => {
                self.enter(DEPTH_EVENT, offset)?;
                self.map_event(n, offset)
            }
            other => Err(Self::unexpected("event", "array or map", other, offset)),
        }
    }

    fn array_event(&mut self, n: u32, offset: usize) -> Result<Option<KvEvent>> {
        if n == 0 {
            return Err(DecodeError::MissingTag { offset });
        }
        let tag = self.str_bytes("event tag")?;
        let fields = u64::from(n - 1);
        let Some(kind) = Kind::from_tag(tag) else {
            self.skip_n(fields, DEPTH_FIELD)?;
            return Ok(None);
        };
        // `have` = positional fields present; `used` = fields consumed so far.
        let have = fields;
        let need = |used: u64, field: &'static str, event: &'static str| {
            if have > used {
                Ok(())
            } else {
                Err(DecodeError::MissingField { event, field })
            }
        };
        let (event, used) = match kind {
            Kind::Stored => {
                need(0, "block_hashes", TAG_STORED)?;
                let block_hashes = self.hash_list("block_hashes")?;
                need(1, "parent_block_hash", TAG_STORED)?;
                let parent_block_hash = self.opt_hash("parent_block_hash")?;
                need(2, "token_ids", TAG_STORED)?;
                let token_ids = self.token_list("token_ids")?;
                need(3, "block_size", TAG_STORED)?;
                let block_size = self.u32("block_size")?;
                let lora_id = if have > 4 {
                    self.opt_i64("lora_id")?
                } else {
                    None
                };
                let medium = if have > 5 {
                    self.opt_string("medium")?
                } else {
                    None
                };
                let (lora_name, cache_salt) = if have > 6 {
                    self.lora_name_or_metadata()?
                } else {
                    (None, None)
                };
                let extra_keys = if have > 7 {
                    self.extra_keys()?
                } else {
                    Vec::new()
                };
                let event = KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    lora_id,
                    medium,
                    lora_name,
                    extra_keys,
                    cache_salt,
                };
                (event, have.min(8))
            }
            Kind::Removed => {
                need(0, "block_hashes", TAG_REMOVED)?;
                let block_hashes = self.hash_list("block_hashes")?;
                let medium = if have > 1 {
                    self.opt_string("medium")?
                } else {
                    None
                };
                let event = KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                };
                (event, have.min(2))
            }
            Kind::Cleared => (KvEvent::AllBlocksCleared, 0),
        };
        // Trailing fields from a newer schema (extra_keys, group_idx, ...).
        self.skip_n(have - used, DEPTH_FIELD)?;
        Ok(Some(event))
    }

    fn map_event(&mut self, n: u32, offset: usize) -> Result<Option<KvEvent>> {
        if n == 0 {
            return Err(DecodeError::MissingTag { offset });
        }
        let start = self.pos;
        // msgspec writes the tag first; otherwise find it, then read the fields from the start.
        let (tag, first_is_tag) = match self.key(DEPTH_FIELD)? {
            Some(b"type") => (self.str_bytes("event type")?, true),
            _ => {
                self.pos = start;
                let tag = self.find_type(n, offset)?;
                self.pos = start;
                (tag, false)
            }
        };
        let remaining = if first_is_tag { n - 1 } else { n };
        let Some(kind) = Kind::from_tag(tag) else {
            self.skip_n(2 * u64::from(remaining), DEPTH_FIELD)?;
            return Ok(None);
        };
        let mut f = Fields::default();
        for _ in 0..remaining {
            let key = self.key(DEPTH_FIELD)?;
            match (kind, key) {
                (Kind::Stored | Kind::Removed, Some(b"block_hashes")) => {
                    f.block_hashes = Some(self.hash_list("block_hashes")?);
                }
                (Kind::Stored | Kind::Removed, Some(b"medium")) => {
                    f.medium = self.opt_string("medium")?;
                }
                (Kind::Stored, Some(b"parent_block_hash")) => {
                    f.parent_block_hash = self.opt_hash("parent_block_hash")?;
                }
                (Kind::Stored, Some(b"token_ids")) => {
                    f.token_ids = Some(self.token_list("token_ids")?);
                }
                (Kind::Stored, Some(b"block_size")) => {
                    f.block_size = Some(self.u32("block_size")?);
                }
                (Kind::Stored, Some(b"lora_id")) => f.lora_id = self.opt_i64("lora_id")?,
                (Kind::Stored, Some(b"lora_name")) => {
                    f.lora_name = self.opt_string("lora_name")?;
                }
                (Kind::Stored, Some(b"extra_keys")) => {
                    f.extra_keys = self.extra_keys()?;
                }
                (Kind::Stored, Some(b"cache_salt")) => {
                    f.cache_salt = self.lora_name_or_metadata()?.0;
                }
                // "type" again (when it was not first) and every unknown key.
                _ => self.skip(DEPTH_FIELD)?,
            }
        }
        f.build(kind).map(Some)
    }

    /// Scans a map's `n` entries for the `"type"` key and returns its value, leaving the
    /// cursor wherever the scan stopped (the caller rewinds).
    fn find_type(&mut self, n: u32, offset: usize) -> Result<&'a [u8]> {
        for _ in 0..n {
            if self.key(DEPTH_FIELD)? == Some(b"type") {
                return self.str_bytes("event type");
            }
            self.skip(DEPTH_FIELD)?;
        }
        Err(DecodeError::MissingTag { offset })
    }
}

const NIL: u8 = 0xc0;

/// Low 64 bits of a big-endian byte string: its last 8 bytes, left-padded with zeros.
fn hash_from_bytes(bytes: &[u8]) -> u64 {
    let tail = bytes.get(bytes.len().saturating_sub(8)..).unwrap_or(bytes);
    let mut buf = [0u8; 8];
    let pad = 8 - tail.len();
    if let Some(dst) = buf.get_mut(pad..) {
        dst.copy_from_slice(tail);
    }
    u64::from_be_bytes(buf)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    macro_rules! fixture {
        ($name:literal) => {
            include_bytes!(concat!("../tests/fixtures/kv_events/", $name, ".bin")).as_slice()
        };
    }

    const VLLM_ARRAY: &[u8] = fixture!("vllm_array");
    const VLLM_ARRAY_EXTRA_TRAILING: &[u8] = fixture!("vllm_array_extra_trailing");
    const VLLM_MAP_EVENTS: &[u8] = fixture!("vllm_map_events");
    const VLLM_MAP: &[u8] = fixture!("vllm_map");
    const VLLM_MAP_EXTRA_KEYS: &[u8] = fixture!("vllm_map_extra_keys");
    const VLLM_V0_9: &[u8] = fixture!("vllm_v0_9_legacy");
    const SHORT_TRAILING: &[u8] = fixture!("short_trailing_fields");
    const SGLANG_ATTN_DP: &[u8] = fixture!("sglang_attn_dp_rank");
    const SGLANG_METADATA: &[u8] = fixture!("sglang_metadata");
    const SGLANG_MAP_BATCH: &[u8] = fixture!("sglang_map_batch");
    const HASHES_NEG_BYTES: &[u8] = fixture!("hashes_negative_and_bytes");
    const UNKNOWN_TAG: &[u8] = fixture!("unknown_event_tag");
    const MAP_UNKNOWN_KEYS: &[u8] = fixture!("map_unknown_keys_msgpack");
    const RANK_NIL: &[u8] = fixture!("batch_rank_nil");

    const ALL_FIXTURES: &[&[u8]] = &[
        VLLM_ARRAY,
        VLLM_ARRAY_EXTRA_TRAILING,
        VLLM_MAP_EVENTS,
        VLLM_MAP,
        VLLM_MAP_EXTRA_KEYS,
        VLLM_V0_9,
        SHORT_TRAILING,
        SGLANG_ATTN_DP,
        SGLANG_METADATA,
        SGLANG_MAP_BATCH,
        HASHES_NEG_BYTES,
        UNKNOWN_TAG,
        MAP_UNKNOWN_KEYS,
        RANK_NIL,
    ];

    const H_REAL: u64 = 15_760_518_052_499_183_552;

    fn decode(bytes: &[u8]) -> EventBatch {
        decode_event_batch(bytes, &DecodeLimits::default()).unwrap()
    }

    fn decode_err(bytes: &[u8]) -> DecodeError {
        decode_event_batch(bytes, &DecodeLimits::default()).unwrap_err()
    }

    /// Same values as `TOKENS_A` in gen_fixtures.py.
    fn tokens_a() -> Vec<u32> {
        let mut t = vec![
            0,
            1,
            127,
            128,
            255,
            256,
            65_535,
            65_536,
            151_644,
            872,
            198,
            9064,
            374,
            279,
            1 << 31,
            u32::MAX,
        ];
        t.extend(1000..1032);
        t
    }

    fn tokens_b() -> Vec<u32> {
        (5000..5016).collect()
    }

    fn s(v: &str) -> Option<String> {
        Some(v.to_owned())
    }

    fn stored(
        hashes: &[u64],
        parent: Option<u64>,
        tokens: Vec<u32>,
        lora_id: Option<i64>,
        medium: Option<String>,
        lora_name: Option<String>,
    ) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent,
            token_ids: tokens,
            block_size: 16,
            lora_id,
            medium,
            lora_name,
            extra_keys: Vec::new(),
            cache_salt: None,
        }
    }

    fn removed(hashes: &[u64], medium: Option<String>) -> KvEvent {
        KvEvent::BlockRemoved {
            block_hashes: hashes.to_vec(),
            medium,
        }
    }

    /// `vllm_events()` in gen_fixtures.py.
    fn canonical_events() -> Vec<KvEvent> {
        vec![
            stored(
                &[1, u64::MAX, H_REAL],
                None,
                tokens_a(),
                None,
                s("GPU"),
                None,
            ),
            stored(
                &[42],
                Some(H_REAL),
                tokens_b(),
                Some(7),
                s("GPU"),
                s("sql-adapter"),
            ),
            removed(&[1, 2], s("GPU")),
            KvEvent::AllBlocksCleared,
        ]
    }

    fn batch(ts: f64, events: Vec<KvEvent>, rank: Option<u32>, skipped: u32) -> EventBatch {
        EventBatch {
            ts,
            events,
            data_parallel_rank: rank,
            skipped_unknown: skipped,
        }
    }

    // ---- golden fixtures -------------------------------------------------------------------

    #[test]
    fn vllm_array_era_all_kinds() {
        let want = batch(1_718_000_000.25, canonical_events(), Some(1), 0);
        assert_eq!(decode(VLLM_ARRAY), want);
    }

    /// `canonical_events()` with the extra keys gen_fixtures.py adds to the first event.
    fn with_first_extra(
        mut events: Vec<KvEvent>,
        keys: Vec<Option<Vec<ExtraKey>>>,
    ) -> Vec<KvEvent> {
        if let Some(KvEvent::BlockStored { extra_keys, .. }) = events.first_mut() {
            *extra_keys = keys;
        }
        events
    }

    fn tenant_a_extra() -> Option<Vec<ExtraKey>> {
        Some(vec![ExtraKey::Str("tenant-a".into()), ExtraKey::Int(3)])
    }

    #[test]
    fn vllm_array_extra_trailing_fields_are_ignored() {
        let events = with_first_extra(canonical_events(), vec![tenant_a_extra(), None, None]);
        let want = batch(1_718_000_001.5, events, Some(0), 0);
        assert_eq!(decode(VLLM_ARRAY_EXTRA_TRAILING), want);
    }

    #[test]
    fn vllm_map_events_in_array_batch() {
        let want = batch(1_718_000_002.75, canonical_events(), Some(0), 0);
        assert_eq!(decode(VLLM_MAP_EVENTS), want);
    }

    #[test]
    fn vllm_map_batch_with_map_events() {
        let want = batch(1_718_000_003.125, canonical_events(), Some(2), 0);
        assert_eq!(decode(VLLM_MAP), want);
    }

    #[test]
    fn vllm_map_events_with_unknown_keys() {
        // `("img", b"\x00\x01")`: the bytes are kept as their msgpack encoding
        let img = Some(vec![
            ExtraKey::Str("img".into()),
            ExtraKey::Other(vec![0xc4, 2, 0, 1]),
        ]);
        let events = with_first_extra(canonical_events(), vec![tenant_a_extra(), None, img]);
        let want = batch(1_718_000_004.0, events, Some(0), 0);
        assert_eq!(decode(VLLM_MAP_EXTRA_KEYS), want);
    }

    #[test]
    fn vllm_v0_9_short_events_and_no_rank() {
        let want = batch(
            1_718_000_005.5,
            vec![
                stored(
                    &[11, 12],
                    Some(10),
                    tokens_a()[..32].to_vec(),
                    None,
                    None,
                    None,
                ),
                removed(&[11], None),
                KvEvent::AllBlocksCleared,
            ],
            None,
            0,
        );
        assert_eq!(decode(VLLM_V0_9), want);
    }

    #[test]
    fn missing_trailing_optional_fields() {
        let want = batch(
            1_718_000_006.0,
            vec![
                stored(&[21], None, tokens_b(), None, None, None),
                stored(&[22], Some(21), tokens_b(), None, s("CPU"), None),
                removed(&[21, 22], None),
            ],
            None,
            0,
        );
        assert_eq!(decode(SHORT_TRAILING), want);
    }

    #[test]
    fn sglang_attn_dp_rank_and_negative_hashes() {
        let want = batch(
            1_718_000_007.0,
            vec![
                stored(
                    &[(-5i64) as u64, 9_000_000_000],
                    Some(i64::MIN as u64),
                    tokens_a()[..32].to_vec(),
                    None,
                    None,
                    None,
                ),
                removed(&[u64::MAX - 4], s("GPU")),
                KvEvent::AllBlocksCleared,
            ],
            Some(3),
            0,
        );
        assert_eq!(decode(SGLANG_ATTN_DP), want);
    }

    #[test]
    fn sglang_metadata_map_in_lora_name_slot_gives_the_cache_salt() {
        let mut salted = stored(&[32], Some(31), tokens_b(), None, s("GPU"), None);
        if let KvEvent::BlockStored { cache_salt, .. } = &mut salted {
            *cache_salt = s("tenant-a");
        }
        let want = batch(
            1_718_000_008.0,
            vec![
                stored(&[31], None, tokens_b(), None, None, None),
                salted,
                removed(&[31], None),
            ],
            Some(0),
            0,
        );
        assert_eq!(decode(SGLANG_METADATA), want);
    }

    #[test]
    fn sglang_map_batch_attn_dp_rank() {
        let want = batch(1_718_000_009.0, vec![removed(&[7, 8], None)], Some(5), 0);
        assert_eq!(decode(SGLANG_MAP_BATCH), want);
    }

    #[test]
    fn hashes_as_negative_ints_and_bytes() {
        // Expected byte-hash values printed by gen_fixtures.py (last 8 bytes, big-endian).
        let digest_a = 15_101_989_507_086_180_695;
        let digest_b = 12_272_066_916_627_784_615;
        let digest_b_16 = 15_737_071_119_072_826_218;
        let mut tokens = Vec::new();
        for _ in 0..5 {
            tokens.extend_from_slice(&tokens_a()[..16]);
        }
        let want = batch(
            1_718_000_010.0,
            vec![
                stored(
                    &[digest_a, u64::MAX, 1 << 63, 0x0102_0304, digest_b_16],
                    Some(digest_b),
                    tokens,
                    Some(-3),
                    None,
                    None,
                ),
                removed(&[digest_a, u64::MAX - 1], None),
            ],
            Some(0),
            0,
        );
        assert_eq!(decode(HASHES_NEG_BYTES), want);
    }

    #[test]
    fn unknown_event_tags_are_skipped_and_counted() {
        let want = batch(
            1_718_000_011.0,
            vec![
                stored(&[51], None, tokens_b(), None, s("GPU"), None),
                removed(&[51], s("GPU")),
                KvEvent::AllBlocksCleared,
            ],
            Some(4),
            2,
        );
        assert_eq!(decode(UNKNOWN_TAG), want);
    }

    #[test]
    fn map_events_type_not_first_nested_unknown_keys_and_ext() {
        let want = batch(
            1_718_000_012.5,
            vec![
                stored(
                    &[61, 62],
                    Some(60),
                    tokens_a()[..32].to_vec(),
                    None,
                    None,
                    s("chat-lora"),
                ),
                removed(&[61], s("DISK")),
                KvEvent::AllBlocksCleared,
            ],
            // data_parallel_rank is nil, so SGLang's attn_dp_rank is used.
            Some(6),
            0,
        );
        assert_eq!(decode(MAP_UNKNOWN_KEYS), want);
    }

    #[test]
    fn explicit_nil_rank() {
        let want = batch(1_718_000_013.0, vec![KvEvent::AllBlocksCleared], None, 0);
        assert_eq!(decode(RANK_NIL), want);
    }

    // ---- encoding --------------------------------------------------------------------------

    #[test]
    fn encoder_matches_msgspec_byte_for_byte() {
        let b = decode(VLLM_ARRAY);
        assert_eq!(encode_event_batch(&b, EventEncoding::Array), VLLM_ARRAY);
        let b = decode(VLLM_MAP_EVENTS);
        assert_eq!(
            encode_event_batch(&b, EventEncoding::MapEvents),
            VLLM_MAP_EVENTS
        );
        let b = decode(VLLM_MAP);
        assert_eq!(encode_event_batch(&b, EventEncoding::Map), VLLM_MAP);
    }

    const ENCODINGS: [EventEncoding; 3] = [
        EventEncoding::Array,
        EventEncoding::MapEvents,
        EventEncoding::Map,
    ];

    #[test]
    fn round_trip_every_fixture_in_every_encoding() {
        for (i, bytes) in ALL_FIXTURES.iter().enumerate() {
            let mut b = decode(bytes);
            b.skipped_unknown = 0;
            for enc in ENCODINGS {
                let again = decode(&encode_event_batch(&b, enc));
                assert_eq!(again, b, "fixture {i}, {enc:?}");
            }
        }
    }

    #[test]
    fn round_trip_edge_values() {
        let b = batch(
            -0.5,
            vec![
                stored(
                    &[0, u64::MAX],
                    Some(0),
                    vec![u32::MAX, 0],
                    Some(i64::MIN),
                    s(""),
                    s("é"),
                ),
                stored(&[], None, vec![], Some(i64::MAX), None, None),
                removed(&[], None),
            ],
            Some(u32::MAX),
            0,
        );
        for enc in ENCODINGS {
            assert_eq!(decode(&encode_event_batch(&b, enc)), b, "{enc:?}");
        }
        let empty = batch(0.0, vec![], None, 0);
        for enc in ENCODINGS {
            assert_eq!(decode(&encode_event_batch(&empty, enc)), empty, "{enc:?}");
        }
        // Rank None: the positional batch has two elements, the map batch two keys.
        assert_eq!(
            encode_event_batch(&empty, EventEncoding::Array),
            [0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x90]
        );
        assert_eq!(encode_event_batch(&empty, EventEncoding::Map)[0], 0x82);
    }

    // ---- malformed input -------------------------------------------------------------------

    #[test]
    fn every_strict_prefix_is_an_error() {
        for (i, bytes) in ALL_FIXTURES.iter().enumerate() {
            for cut in 0..bytes.len() {
                let r = decode_event_batch(&bytes[..cut], &DecodeLimits::default());
                assert!(r.is_err(), "fixture {i} prefix {cut} decoded: {r:?}");
            }
        }
    }

    /// Tiny deterministic generator so the fuzz loops are reproducible without a dependency.
    struct XorShift(u64);
    impl XorShift {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    #[test]
    fn random_bytes_never_panic() {
        let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
        let limits = DecodeLimits::default();
        for _ in 0..20_000 {
            let len = (rng.next() % 96) as usize;
            let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            let _ = decode_event_batch(&bytes, &limits);
            // Also start with a plausible batch header so the inner paths get exercised.
            let mut framed = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91];
            framed.extend_from_slice(&bytes);
            let _ = decode_event_batch(&framed, &limits);
        }
    }

    #[test]
    fn mutated_fixtures_never_panic_and_reencode_consistently() {
        let mut rng = XorShift(0x1234_5678_9abc_def1);
        let limits = DecodeLimits::default();
        for bytes in ALL_FIXTURES {
            for _ in 0..1_500 {
                let mut m = bytes.to_vec();
                for _ in 0..(1 + rng.next() % 3) {
                    let at = (rng.next() as usize) % m.len();
                    m[at] = rng.next() as u8;
                }
                if let Ok(mut b) = decode_event_batch(&m, &limits) {
                    b.skipped_unknown = 0;
                    // NaN timestamps are not equal to themselves; compare the bits instead.
                    let again = decode(&encode_event_batch(&b, EventEncoding::Map));
                    assert_eq!(again.ts.to_bits(), b.ts.to_bits());
                    assert_eq!(again.events, b.events);
                    assert_eq!(again.data_parallel_rank, b.data_parallel_rank);
                }
            }
        }
    }

    #[test]
    fn huge_announced_lengths_are_rejected_without_allocating() {
        // 2^32-1 events.
        let mut p = vec![0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff];
        assert!(matches!(
            decode_err(&p),
            DecodeError::TooMany { what: "events", .. }
        ));
        // 65535 events announced, none present: truncated, not an allocation of 65535.
        p = vec![0x92, 0x00, 0xdc, 0xff, 0xff];
        assert!(matches!(decode_err(&p), DecodeError::Truncated { .. }));
        // A BlockStored whose hash list announces 2^32-1 elements.
        p = vec![0x92, 0x00, 0x91, 0x95, 0xab];
        p.extend_from_slice(b"BlockStored");
        p.extend_from_slice(&[0xdd, 0xff, 0xff, 0xff, 0xff]);
        assert!(matches!(
            decode_err(&p),
            DecodeError::TooMany {
                what: "block_hashes",
                len: 4_294_967_295,
                ..
            }
        ));
        // str32 / bin32 / map32 lengths far beyond the payload.
        for tail in [
            vec![0xdb, 0xff, 0xff, 0xff, 0xff, b'x'],
            vec![0xc6, 0xff, 0xff, 0xff, 0xff, 0x00],
            vec![0xdf, 0xff, 0xff, 0xff, 0xff, 0x00],
            vec![0xc9, 0xff, 0xff, 0xff, 0xff, 0x01],
        ] {
            // As the value of an unknown key in a map batch.
            let mut p = vec![0x81, 0xa3, b'z', b'z', b'z'];
            p.extend_from_slice(&tail);
            assert!(
                matches!(decode_err(&p), DecodeError::Truncated { .. }),
                "{tail:?}"
            );
        }
    }

    #[test]
    fn deep_nesting_is_rejected_without_recursion() {
        // {"zzz": [[[[...]]]]} 100_000 levels deep.
        let mut p = vec![0x81, 0xa3, b'z', b'z', b'z'];
        p.extend(std::iter::repeat_n(0x91u8, 100_000));
        p.push(0xc0);
        assert!(matches!(
            decode_err(&p),
            DecodeError::TooDeep { limit: 32, .. }
        ));
        // Within the limit it is fine.
        let mut p = vec![0x83, 0xa2, b't', b's', 0x00, 0xa6];
        p.extend_from_slice(b"events");
        p.push(0x90);
        p.extend_from_slice(&[0xa3, b'z', b'z', b'z']);
        p.extend(std::iter::repeat_n(0x91u8, 20));
        p.push(0xc0);
        assert_eq!(decode(&p), batch(0.0, vec![], None, 0));
    }

    #[test]
    fn limits_are_enforced() {
        let tight = |f: fn(&mut DecodeLimits)| {
            let mut l = DecodeLimits::default();
            f(&mut l);
            decode_event_batch(VLLM_ARRAY, &l).unwrap_err()
        };
        assert!(matches!(
            tight(|l| l.max_events_per_batch = 3),
            DecodeError::TooMany {
                what: "events",
                len: 4,
                limit: 3
            }
        ));
        assert!(matches!(
            tight(|l| l.max_hashes_per_event = 2),
            DecodeError::TooMany {
                what: "block_hashes",
                len: 3,
                limit: 2
            }
        ));
        assert!(matches!(
            tight(|l| l.max_tokens_per_event = 47),
            DecodeError::TooMany {
                what: "token_ids",
                len: 48,
                limit: 47
            }
        ));
        assert!(matches!(
            tight(|l| l.max_depth = 3),
            DecodeError::TooDeep { limit: 3, .. }
        ));
        // Exactly at the limits passes.
        let exact = DecodeLimits {
            max_events_per_batch: 4,
            max_hashes_per_event: 3,
            max_tokens_per_event: 48,
            max_depth: 4,
        };
        assert!(decode_event_batch(VLLM_ARRAY, &exact).is_ok());
    }

    /// `[0, [event]]` around one hand-written event.
    fn one_event(event: &[u8]) -> Vec<u8> {
        let mut p = vec![0x92, 0x00, 0x91];
        p.extend_from_slice(event);
        p
    }

    fn fixstr(s: &str) -> Vec<u8> {
        let mut v = vec![0xa0 | s.len() as u8];
        v.extend_from_slice(s.as_bytes());
        v
    }

    #[test]
    fn malformed_values_name_the_problem() {
        // Top level is neither array nor map.
        assert_eq!(
            decode_err(&[0x05]).to_string(),
            "batch at byte 0: expected array or map, found integer"
        );
        // Reserved marker.
        assert!(matches!(
            decode_err(&[0x92, 0xc1]),
            DecodeError::InvalidMarker {
                byte: 0xc1,
                offset: 1,
                ..
            }
        ));
        // Trailing bytes.
        let mut p = RANK_NIL.to_vec();
        p.push(0x00);
        assert_eq!(decode_err(&p), DecodeError::TrailingBytes { count: 1 });
        // Batch array too short.
        assert_eq!(
            decode_err(&[0x91, 0x00]),
            DecodeError::MissingField {
                event: "batch",
                field: "events"
            }
        );
        // Map batch without events.
        let mut p = vec![0x81];
        p.extend(fixstr("ts"));
        p.push(0x00);
        assert_eq!(
            decode_err(&p).to_string(),
            "batch: missing required field `events`"
        );
        // Event that is an integer.
        assert!(matches!(
            decode_err(&one_event(&[0x07])),
            DecodeError::UnexpectedType { what: "event", .. }
        ));
        // Empty event array / map: no tag.
        assert!(matches!(
            decode_err(&one_event(&[0x90])),
            DecodeError::MissingTag { .. }
        ));
        assert!(matches!(
            decode_err(&one_event(&[0x80])),
            DecodeError::MissingTag { .. }
        ));
        // Map event without "type".
        let mut e = vec![0x81];
        e.extend(fixstr("block_hashes"));
        e.push(0x90);
        assert!(matches!(
            decode_err(&one_event(&e)),
            DecodeError::MissingTag { .. }
        ));
        // Tag that is not a string.
        assert!(matches!(
            decode_err(&one_event(&[0x91, 0x01])),
            DecodeError::UnexpectedType {
                what: "event tag",
                ..
            }
        ));
        // BlockStored array without block_size.
        let mut e = vec![0x94];
        e.extend(fixstr("BlockStored"));
        e.extend_from_slice(&[0x90, 0xc0, 0x90]);
        assert_eq!(
            decode_err(&one_event(&e)),
            DecodeError::MissingField {
                event: "BlockStored",
                field: "block_size"
            }
        );
        // Map BlockStored without token_ids.
        let mut e = vec![0x83];
        e.extend(fixstr("type"));
        e.extend(fixstr("BlockStored"));
        e.extend(fixstr("block_hashes"));
        e.push(0x90);
        e.extend(fixstr("block_size"));
        e.push(0x10);
        assert_eq!(
            decode_err(&one_event(&e)).to_string(),
            "BlockStored: missing required field `token_ids`"
        );
        // Negative token id.
        let mut e = vec![0x95];
        e.extend(fixstr("BlockStored"));
        e.extend_from_slice(&[0x91, 0x01, 0xc0, 0x91, 0xff, 0x10]);
        assert!(matches!(
            decode_err(&one_event(&e)),
            DecodeError::IntegerOutOfRange {
                what: "token_ids",
                value: -1,
                ..
            }
        ));
        // Token id above u32.
        let mut e = vec![0x95];
        e.extend(fixstr("BlockStored"));
        e.extend_from_slice(&[0x91, 0x01, 0xc0, 0x91, 0xcf, 0, 0, 0, 1, 0, 0, 0, 0, 0x10]);
        assert!(matches!(
            decode_err(&one_event(&e)),
            DecodeError::IntegerOutOfRange {
                what: "token_ids",
                value: 4_294_967_296,
                ..
            }
        ));
        // block_size as a string.
        let mut e = vec![0x95];
        e.extend(fixstr("BlockStored"));
        e.extend_from_slice(&[0x91, 0x01, 0xc0, 0x90]);
        e.extend(fixstr("16"));
        let err = decode_err(&one_event(&e));
        assert!(err.to_string().starts_with("block_size at byte"), "{err}");
        assert!(
            err.to_string()
                .ends_with("expected non-negative integer, found string")
        );
        // Hash as a float, and as nil inside the list.
        let mut e = vec![0x92];
        e.extend(fixstr("BlockRemoved"));
        e.extend_from_slice(&[0x91, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert!(matches!(
            decode_err(&one_event(&e)),
            DecodeError::UnexpectedType {
                what: "block_hashes",
                found: "float",
                ..
            }
        ));
        // medium that is not UTF-8.
        let mut e = vec![0x93];
        e.extend(fixstr("BlockRemoved"));
        e.extend_from_slice(&[0x90, 0xa2, 0xff, 0xfe]);
        assert!(matches!(
            decode_err(&one_event(&e)),
            DecodeError::InvalidUtf8 { what: "medium", .. }
        ));
        // Negative rank.
        assert!(matches!(
            decode_err(&[0x93, 0x00, 0x90, 0xff]),
            DecodeError::IntegerOutOfRange {
                what: "batch data_parallel_rank",
                ..
            }
        ));
        // lora_id above i64::MAX.
        let mut e = vec![0x96];
        e.extend(fixstr("BlockStored"));
        e.extend_from_slice(&[0x90, 0xc0, 0x90, 0x10, 0xcf, 0xff, 0, 0, 0, 0, 0, 0, 0]);
        assert!(matches!(
            decode_err(&one_event(&e)),
            DecodeError::IntegerOutOfRange {
                what: "lora_id",
                ..
            }
        ));
    }

    #[test]
    fn tolerant_shapes() {
        // Integer timestamp, extra trailing batch elements, non-string map keys,
        // a duplicate "type" key, and an unknown tag only.
        let mut p = vec![0x94, 0x05, 0x92];
        let mut e = vec![0x83, 0x01, 0x02];
        e.extend(fixstr("type"));
        e.extend(fixstr("AllBlocksCleared"));
        e.extend(fixstr("type"));
        e.extend(fixstr("AllBlocksCleared"));
        p.extend(e);
        p.push(0x91);
        p.extend(fixstr("Future"));
        p.extend_from_slice(&[0x02, 0x81, 0xc0, 0xc0]);
        assert_eq!(
            decode(&p),
            batch(5.0, vec![KvEvent::AllBlocksCleared], Some(2), 1)
        );
    }

    #[test]
    fn hash_bytes_take_last_eight_big_endian() {
        assert_eq!(hash_from_bytes(&[]), 0);
        assert_eq!(hash_from_bytes(&[0xab]), 0xab);
        assert_eq!(
            hash_from_bytes(&[1, 2, 3, 4, 5, 6, 7, 8]),
            0x0102_0304_0506_0708
        );
        let mut long = vec![0xee; 24];
        long.extend_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(hash_from_bytes(&long), 0x0102_0304_0506_0708);
    }

    // ---- framing ---------------------------------------------------------------------------

    #[test]
    fn decode_message_frames() {
        let seq = seq_frame(41);
        let frames: [&[u8]; 3] = [b"kv-events", &seq, VLLM_MAP];
        let (topic, n, b) = decode_message(&frames, &DecodeLimits::default()).unwrap();
        assert_eq!((topic, n), (&b"kv-events"[..], 41));
        assert_eq!(b, decode(VLLM_MAP));
        // Empty topic is fine.
        let frames: [&[u8]; 3] = [b"", &seq, RANK_NIL];
        assert!(decode_message(&frames, &DecodeLimits::default()).is_ok());

        let l = DecodeLimits::default();
        assert_eq!(
            decode_message(&[&seq[..], VLLM_MAP], &l).unwrap_err(),
            DecodeError::WrongFrameCount { got: 2 }
        );
        assert_eq!(
            decode_message(&[b"", &seq[..], VLLM_MAP, b""], &l).unwrap_err(),
            DecodeError::WrongFrameCount { got: 4 }
        );
        assert_eq!(
            decode_message(&[b"", &seq[..7], VLLM_MAP], &l).unwrap_err(),
            DecodeError::BadSequenceFrame { len: 7 }
        );
        let end = seq_frame(REPLAY_END_SEQ);
        assert_eq!(
            decode_message(&[b"", &end[..], b""], &l).unwrap_err(),
            DecodeError::ReplayEndMarker
        );
        // Payload errors pass through.
        assert!(matches!(
            decode_message(&[b"", &seq[..], &VLLM_MAP[..10]], &l).unwrap_err(),
            DecodeError::Truncated { .. }
        ));
    }

    #[test]
    fn replay_end_marker() {
        // Python: (-1).to_bytes(8, "big", signed=True)
        let end = [0xffu8; 8];
        assert_eq!(parse_seq(&end), Ok(u64::MAX));
        assert_eq!(REPLAY_END_SEQ, -1i64 as u64);
        // vLLM 0.32 to a DEALER: delimiter, empty topic, -1, empty payload
        assert!(is_replay_end(&[b"", b"", &end, b""]));
        // older vLLM and SGLang to a DEALER, and vLLM 0.32 to a REQ
        assert!(is_replay_end(&[b"", &end, b""]));
        // older vLLM and SGLang to a REQ
        assert!(is_replay_end(&[&end, b""]));
        assert!(!is_replay_end(&[b"", &end, b"x"]));
        assert!(!is_replay_end(&[b"", b"", &end, b"x"]));
        assert!(!is_replay_end(&[b"", &seq_frame(3), b""]));
        assert!(!is_replay_end(&[b"", b"", &seq_frame(3), b""]));
        assert!(!is_replay_end(&[b"", &end[..7], b""]));
        // four frames need the empty delimiter first
        assert!(!is_replay_end(&[b"x", b"", &end, b""]));
        assert!(!is_replay_end(&[&end]));
        assert!(!is_replay_end(&[b"", b"", b"", &end, b""]));
    }

    #[test]
    fn replay_replies_in_every_framing() {
        let l = DecodeLimits::default();
        let seq = seq_frame(41);
        let want = decode(VLLM_MAP);
        // vLLM 0.32 to a DEALER: ("", topic, seq, payload)
        let (topic, n, b) =
            decode_replay_message(&[b"", b"kv-events", &seq, VLLM_MAP], &l).unwrap();
        assert_eq!((topic, n, &b), (&b"kv-events"[..], 41, &want));
        let (topic, n, b) = decode_replay_message(&[b"", b"", &seq, VLLM_MAP], &l).unwrap();
        assert_eq!((topic, n, &b), (&b""[..], 41, &want));
        // older vLLM and SGLang to a DEALER: ("", seq, payload); vLLM 0.32 to a REQ:
        // (topic, seq, payload)
        let (topic, n, b) = decode_replay_message(&[b"", &seq, VLLM_MAP], &l).unwrap();
        assert_eq!((topic, n, &b), (&b""[..], 41, &want));
        let (topic, n, _) = decode_replay_message(&[b"kv", &seq, VLLM_MAP], &l).unwrap();
        assert_eq!((topic, n), (&b"kv"[..], 41));
        // older vLLM and SGLang to a REQ: (seq, payload)
        let (topic, n, b) = decode_replay_message(&[&seq, VLLM_MAP], &l).unwrap();
        assert_eq!((topic, n, &b), (&b""[..], 41, &want));
        // anything else
        assert_eq!(
            decode_replay_message(&[b"x", b"", &seq, VLLM_MAP], &l).unwrap_err(),
            DecodeError::WrongFrameCount { got: 4 }
        );
        assert_eq!(
            decode_replay_message(&[b"", b"", b"", &seq, VLLM_MAP], &l).unwrap_err(),
            DecodeError::WrongFrameCount { got: 5 }
        );
        assert_eq!(
            decode_replay_message(&[&seq], &l).unwrap_err(),
            DecodeError::WrongFrameCount { got: 1 }
        );
        let end = seq_frame(REPLAY_END_SEQ);
        assert_eq!(
            decode_replay_message(&[b"", b"", &end, b""], &l).unwrap_err(),
            DecodeError::ReplayEndMarker
        );
        // a live message stays three frames
        assert_eq!(
            decode_message(&[b"", b"", &seq, VLLM_MAP], &l).unwrap_err(),
            DecodeError::WrongFrameCount { got: 4 }
        );
    }

    #[test]
    fn sglang_topic_epoch() {
        assert_eq!(split_topic_epoch(b"kv"), (&b"kv"[..], None));
        assert_eq!(split_topic_epoch(b""), (&b""[..], None));
        assert_eq!(
            split_topic_epoch(b"kv\0sgl-kv-epoch=abc123"),
            (&b"kv"[..], Some(&b"abc123"[..]))
        );
        assert_eq!(
            split_topic_epoch(b"\0sgl-kv-epoch=e1\0sgl-kv-snapshot=b7"),
            (&b""[..], Some(&b"e1"[..]))
        );
    }

    // ---- sequence tracking -----------------------------------------------------------------

    #[test]
    fn sequence_tracker() {
        let mut t = SequenceTracker::new();
        assert_eq!(t.expected(), None);
        assert_eq!(t.observe(5), SeqOutcome::First);
        assert_eq!(t.observe(6), SeqOutcome::InOrder);
        assert_eq!(t.observe(6), SeqOutcome::Duplicate);
        assert_eq!(t.observe(5), SeqOutcome::Duplicate);
        assert_eq!(
            t.observe(9),
            SeqOutcome::Gap {
                expected: 7,
                got: 9
            }
        );
        assert_eq!(t.expected(), Some(10));
        assert_eq!(t.observe(10), SeqOutcome::InOrder);
        assert_eq!(t.observe(9), SeqOutcome::Duplicate);
        assert_eq!(t.observe(6), SeqOutcome::Duplicate);
        // Back to 0: the publisher restarted.
        assert_eq!(
            t.observe(0),
            SeqOutcome::Restart {
                expected: 11,
                got: 0
            }
        );
        assert_eq!(t.observe(1), SeqOutcome::InOrder);
        t.reset();
        assert_eq!(t.observe(1), SeqOutcome::First);
        // Far behind the window is a restart too (slow joiner missed seq 0).
        let mut t = SequenceTracker::with_restart_window(100);
        assert_eq!(t.observe(950), SeqOutcome::First);
        assert_eq!(
            t.observe(1_000),
            SeqOutcome::Gap {
                expected: 951,
                got: 1_000
            }
        );
        assert_eq!(t.observe(950), SeqOutcome::Duplicate);
        assert_eq!(
            t.observe(3),
            SeqOutcome::Restart {
                expected: 1_001,
                got: 3
            }
        );
        assert_eq!(t.observe(4), SeqOutcome::InOrder);
        // No overflow at the top of the range.
        let mut t = SequenceTracker::default();
        assert_eq!(t.observe(u64::MAX - 1), SeqOutcome::First);
        assert_eq!(t.observe(u64::MAX), SeqOutcome::InOrder);
        assert_eq!(t.observe(u64::MAX), SeqOutcome::InOrder);
    }

    #[test]
    fn a_number_never_seen_below_the_expected_one_restarts_tracking() {
        // a message numbered far ahead moved the tracker; the real stream continues below it
        let mut t = SequenceTracker::new();
        for seq in 0..4 {
            let _ = t.observe(seq);
        }
        assert_eq!(
            t.observe(5_000),
            SeqOutcome::Gap {
                expected: 4,
                got: 5_000
            }
        );
        assert_eq!(
            t.observe(4),
            SeqOutcome::Restart {
                expected: 5_001,
                got: 4
            }
        );
        assert_eq!(t.observe(5), SeqOutcome::InOrder);
        // what came before the restart is forgotten: not a duplicate any more
        assert_eq!(
            t.observe(2),
            SeqOutcome::Restart {
                expected: 6,
                got: 2
            }
        );
    }

    proptest::proptest! {
        /// Whatever numbers arrive: the tracker never claims a duplicate it did not accept
        /// (since its last restart or reset), moves to `seq + 1` on everything else, keeps
        /// its bounded ranges, and reads a contiguous run as in order.
        #[test]
        fn the_sequence_tracker_is_sound_on_any_stream(
            seqs in proptest::collection::vec(
                proptest::prop_oneof![0u64..64, 0u64..20_000, proptest::prelude::any::<u64>()],
                1..200,
            ),
            window in 1u64..20_000,
        ) {
            let mut t = SequenceTracker::with_restart_window(window);
            let mut accepted = std::collections::BTreeSet::new();
            for seq in seqs {
                let before = t.expected();
                let outcome = t.observe(seq);
                proptest::prop_assert!(t.seen.len() <= SequenceTracker::SEEN_RANGES);
                match outcome {
                    SeqOutcome::Duplicate => {
                        proptest::prop_assert!(accepted.contains(&seq), "{seq} never accepted");
                        proptest::prop_assert_eq!(t.expected(), before);
                    }
                    SeqOutcome::InOrder => {
                        proptest::prop_assert_eq!(before, Some(seq));
                    }
                    SeqOutcome::Restart { .. } => {
                        accepted.clear();
                    }
                    SeqOutcome::First | SeqOutcome::Gap { .. } => {}
                }
                if outcome != SeqOutcome::Duplicate {
                    accepted.insert(seq);
                    proptest::prop_assert_eq!(t.expected(), Some(seq.saturating_add(1)));
                }
            }
            // then a contiguous run from where it stands is in order all the way
            let next = t.expected().unwrap_or(0);
            if next < u64::MAX - 100 {
                for seq in next..next + 100 {
                    proptest::prop_assert_eq!(t.observe(seq), SeqOutcome::InOrder);
                }
            }
        }
    }

    #[test]
    fn seen_ranges_are_bounded() {
        let mut t = SequenceTracker::new();
        // every other number: each one a gap and a range of its own
        for i in 0..100 {
            let _ = t.observe(i * 2);
        }
        assert_eq!(t.seen.len(), SequenceTracker::SEEN_RANGES);
        assert_eq!(t.observe(198), SeqOutcome::Duplicate);
        // an old range fell out: its number is no longer a known duplicate
        assert!(matches!(t.observe(2), SeqOutcome::Restart { .. }));
    }
}
