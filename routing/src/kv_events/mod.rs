//! Decoding (and encoding) of the KV-cache event stream that vLLM, SGLang and TensorRT-LLM
//! publish over ZMQ.
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
//! | TensorRT-LLM (`KVCacheEventSerializer`) | a bare list of events, or a map with `events` | maps `{"event_id", "window_size", "data": {"type": "stored" \| "removed" \| "updated" \| "created", ...}}` (see the decoder's TensorRT-LLM module) |
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

use thiserror::Error;

pub mod budget;
mod decode;
mod encode;
mod framing;
pub mod ingest;
pub mod resequence;
mod sequence;
#[cfg(test)]
mod tests;

pub use decode::decode_event_batch;
pub use encode::{EventEncoding, TRTLLM_FULL_WINDOW, encode_event_batch};
pub use framing::{
    decode_message, decode_replay_message, is_replay_end, parse_seq, replay_frames, seq_frame,
    split_topic_epoch, unix_now,
};
pub use sequence::{SeqOutcome, SequenceTracker};

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

impl EventBatch {
    /// A batch of `events` published at `ts`, naming no rank.
    pub fn new(ts: f64, events: Vec<KvEvent>) -> Self {
        Self {
            ts,
            events,
            data_parallel_rank: None,
            skipped_unknown: 0,
        }
    }

    /// What the batch costs against a publisher's event budget: one per event, plus one per
    /// block it stores or removes (a batch of one event naming 512 blocks does the index work
    /// of 512 events).
    pub fn budget_cost(&self) -> usize {
        self.events
            .iter()
            .map(|e| match e {
                KvEvent::BlockStored { block_hashes, .. }
                | KvEvent::BlockRemoved { block_hashes, .. }
                | KvEvent::BlockMoved { block_hashes, .. } => 1 + block_hashes.len(),
                KvEvent::AllBlocksCleared => 1,
            })
            .sum()
    }
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
        /// vLLM's KV-cache group, its kind and the tier beyond `medium` (0.32 on).
        place: BlockPlace,
    },
    /// Blocks were evicted from the given tier.
    BlockRemoved {
        /// Engine hashes of the evicted blocks.
        block_hashes: Vec<u64>,
        /// Storage tier the blocks left; `None` when not reported.
        medium: Option<String>,
        /// The group and tier the blocks left (`spec_kind`, `sliding_window` and `session_id`
        /// are never set on a removal).
        place: BlockPlace,
    },
    /// Blocks the engine moved between tiers, content and hash unchanged: TensorRT-LLM's
    /// `updated` event with a `cache_level` change (offloaded from GPU to host memory when
    /// evicted from the GPU, or loaded back for a hit). They leave `from_medium` and are held
    /// in `to_medium`.
    BlockMoved {
        /// Engine hashes of the moved blocks.
        block_hashes: Vec<u64>,
        /// The tier they left.
        from_medium: Option<String>,
        /// The tier that holds them now.
        to_medium: Option<String>,
        /// Their group (tier fields unset: the media say it).
        place: BlockPlace,
    },
    /// The engine dropped its whole prefix cache (e.g. `reset_prefix_cache`).
    AllBlocksCleared,
}

impl KvEvent {
    /// A plain `BlockStored`: no adapter, tier, extra keys, salt or group, as an engine
    /// without those features reports it.
    pub fn plain_stored(
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
    ) -> Self {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id: None,
            medium: None,
            lora_name: None,
            extra_keys: Vec::new(),
            cache_salt: None,
            place: BlockPlace::default(),
        }
    }

    /// The same event reported on storage tier `tier` (a `BlockStored` or `BlockRemoved`;
    /// any other event as it is).
    #[must_use]
    pub fn on_medium(mut self, tier: &str) -> Self {
        if let KvEvent::BlockStored { medium, .. } | KvEvent::BlockRemoved { medium, .. } =
            &mut self
        {
            *medium = Some(tier.to_owned());
        }
        self
    }
}

/// Where stored or removed blocks live beyond their `medium`, as vLLM 0.32 reports it: the
/// KV-cache group (a hybrid model has one per layer kind), the group's kind, and the tier's
/// locality and secondary owner. All `None` on older engines and on SGLang.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockPlace {
    /// `group_idx`: index of the engine's KV-cache group. Engine block hashes are unique per
    /// group only: the same hash names a block of each group.
    pub group_idx: Option<u32>,
    /// `kv_cache_spec_kind`, e.g. `"full_attention"`, `"sliding_window"`, `"mamba"`.
    pub spec_kind: Option<String>,
    /// `kv_cache_spec_sliding_window`: the window in tokens of a sliding-window group.
    pub sliding_window: Option<u32>,
    /// `locality`: `"LOCAL"` or `"REMOTE"` relative to the publisher.
    pub locality: Option<String>,
    /// `ownership`: the secondary offloading tier that produced the event, if one did.
    pub ownership: Option<String>,
    /// `session_id`: the request context that caused a store (informational).
    pub session_id: Option<String>,
    /// A removal that names no tier because the engine keeps each block in one tier at a
    /// time (TensorRT-LLM): the blocks leave whichever tier of their group holds them. Never
    /// on the wire of vLLM or SGLang.
    pub any_tier: bool,
}

impl BlockPlace {
    /// Map entries a `BlockStored` encodes for these fields (the set ones).
    fn stored_fields(&self) -> u32 {
        u32::from(self.group_idx.is_some())
            + u32::from(self.spec_kind.is_some())
            + u32::from(self.sliding_window.is_some())
            + self.tier_fields()
            + u32::from(self.session_id.is_some())
    }

    /// Map entries a `BlockRemoved` encodes (group and tier only).
    fn removed_fields(&self) -> u32 {
        u32::from(self.group_idx.is_some()) + self.tier_fields()
    }

    fn tier_fields(&self) -> u32 {
        u32::from(self.locality.is_some()) + u32::from(self.ownership.is_some())
    }
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

/// `len` elements of the list `what` as a `usize`, or [`DecodeError::TooMany`] past `limit`.
pub(crate) fn at_most(what: &'static str, len: u64, limit: usize) -> Result<usize> {
    match usize::try_from(len) {
        Ok(n) if n <= limit => Ok(n),
        _ => Err(DecodeError::TooMany { what, len, limit }),
    }
}

const TAG_STORED: &str = "BlockStored";
const TAG_REMOVED: &str = "BlockRemoved";
const TAG_CLEARED: &str = "AllBlocksCleared";
