//! TensorRT-LLM's KV-cache events.
//!
//! TensorRT-LLM turns each `KVCacheEvent` into a dict with `KVCacheEventSerializer`
//! (`tensorrt_llm/_utils.py`); that dict is what `LLM.get_kv_cache_events()` returns, what
//! `trtllm-serve` answers on `/kv_cache_events`, and what its ZMQ publisher
//! (`KvCacheConfig.kv_events_config`, a `KVEventsConfig` modelled on vLLM's: same endpoint,
//! replay endpoint, topic and three-frame messages) sends, msgpack-encoded:
//!
//! ```text
//! {"event_id": 7, "window_size": 4096, ("attention_dp_rank": 1), ("layer_group_id": 0),
//!  "data": {"type": "stored", "parent_hash": 42 | nil,
//!           "blocks": [{"type": "stored_block", "block_hash": 43,
//!                       "tokens": [{"type": "unique_token", "token_id": 1, "token_extra_id": 0}, ...],
//!                       "cache_level": 0, "priority": 35, ("lora_id": 3), ("mm_keys": [...])}]}}
//! {"data": {"type": "removed", "block_hashes": [43, 44]}, ...}
//! {"data": {"type": "updated", "block_hash": 43,
//!           "cache_level": {"type": "event_diff", "old_value": 0, "new_value": 1} | nil,
//!           "priority": {...} | nil}, ...}
//! {"data": {"type": "created", "num_blocks_per_cache_level": [gpu, host]}, ...}
//! ```
//!
//! A payload is either a bare list of such events or a map with an `"events"` list (and
//! optionally `"ts"`); the event maps may also sit in a vLLM-shaped batch. Mapping:
//!
//! - `stored` → [`KvEvent::BlockStored`]: the blocks' hashes, their tokens concatenated, the
//!   block size from the first block's token count, the tier from the first block's
//!   `cache_level` (0 GPU, 1 host memory `CPU`, 2 and up `DISK`). A block whose tokens carry
//!   a nonzero `token_extra_id` (prompt-tuning or multimodal ids), that has `mm_keys`, or
//!   that has a `lora_id` (a task id the engine folds into the hash, where requests name
//!   adapters) depends on what the picker does not hash: it gets an opaque extra key, so no
//!   request matches it.
//! - `removed` → [`KvEvent::BlockRemoved`] from whichever tier holds the blocks
//!   ([`BlockPlace::any_tier`]): TensorRT-LLM keeps a block in one tier at a time.
//! - `updated` with a `cache_level` change → [`KvEvent::BlockMoved`]; a priority-only update
//!   and `created` change nothing the picker models.
//! - The KV-cache group is `layer_group_id` when present, else `window_size` (each attention
//!   window has its own block manager, and the same tokens have the same hash in each).
//!   Every group is credited as a chain from the prompt's start: TensorRT-LLM finds reusable
//!   blocks by walking each window's radix tree from its root, so a window that dropped an
//!   early block reuses nothing past it. Where that is stricter than the engine, the picker
//!   under-credits; it never over-credits.
//! - Hashes are integers (signed ones reinterpreted), bytes, or hex digests (the newer block
//!   manager may send one): a digest's low 64 bits.
//! - The rank is the events' `attention_dp_rank` (the first one given), unless the batch names
//!   one. A bare list has no timestamp: the time of decoding stands in.

use rmp::Marker;
use xxhash_rust::xxh3::xxh3_64;

use super::{DEPTH_EVENT, DEPTH_FIELD, Reader, ValueHead};
use crate::kv_events::{BlockPlace, DecodeError, ExtraKey, KvEvent, Result, at_most};

/// What one event decoded to.
// returned once per event and moved straight into the batch: boxing would add an allocation
#[allow(clippy::large_enum_variant)]
pub(super) enum Decoded {
    /// An event the index applies.
    Event(KvEvent),
    /// A known event that changes nothing the picker models (`created`, a priority update).
    Ignored,
    /// An event type this decoder does not know.
    Unknown,
}

/// The event types of `KVCacheEventSerializer`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Type {
    Stored,
    Removed,
    Updated,
    Created,
}

impl Type {
    fn from_tag(tag: &[u8]) -> Option<Self> {
        match tag {
            b"stored" => Some(Self::Stored),
            b"removed" => Some(Self::Removed),
            b"updated" => Some(Self::Updated),
            b"created" => Some(Self::Created),
            _ => None,
        }
    }
}

/// The `data` map of one event, any key order.
#[derive(Default)]
struct Data {
    tag: Option<Option<Type>>,
    parent: Option<u64>,
    hashes: Vec<u64>,
    tokens: Vec<u32>,
    block_size: Option<u32>,
    first_level: Option<u32>,
    lora_id: Option<i64>,
    extra: Vec<Option<Vec<ExtraKey>>>,
    /// `updated`: the `cache_level` change, `(old, new)`.
    moved: Option<(u32, u32)>,
}

/// The tier name of a TensorRT-LLM cache level.
fn medium_of(level: u32) -> &'static str {
    match level {
        0 => "GPU",
        1 => "CPU",
        _ => "DISK",
    }
}

/// The opaque extra key of a block that depends on inputs the picker does not hash: a msgpack
/// `bin` (what [`ExtraKey::Other`] holds is msgpack, re-encoded verbatim).
fn opaque_extra() -> Vec<ExtraKey> {
    const TAG: &[u8] = b"trtllm:unhashed-inputs";
    let mut raw = vec![0xc4, TAG.len() as u8];
    raw.extend_from_slice(TAG);
    vec![ExtraKey::Other(raw)]
}

impl<'a> Reader<'a> {
    /// A hash: an integer, bytes, or a string (a hex digest's low 64 bits; any other string
    /// is hashed whole).
    fn trt_hash(&mut self, what: &'static str) -> Result<u64> {
        match self.peek_byte().map(Marker::from_u8) {
            Some(Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32) => {
                let s = self.str_bytes(what)?;
                let tail = &s[s.len().saturating_sub(16)..];
                Ok(std::str::from_utf8(tail)
                    .ok()
                    .filter(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_hexdigit()))
                    .and_then(|t| u64::from_str_radix(t, 16).ok())
                    .unwrap_or_else(|| xxh3_64(s)))
            }
            _ => self.hash(what),
        }
    }

    fn opt_trt_hash(&mut self, what: &'static str) -> Result<Option<u64>> {
        if self.peek_byte() == Some(super::NIL) {
            self.pos += 1;
            return Ok(None);
        }
        self.trt_hash(what).map(Some)
    }

    /// Reads a map header at `depth`; `None` (after consuming a nil) for nil.
    fn opt_map(&mut self, what: &'static str, depth: u32) -> Result<Option<u32>> {
        let offset = self.pos;
        match self.head(what)? {
            ValueHead::Nil => Ok(None),
            ValueHead::Map(n) => {
                self.enter(depth, offset)?;
                Ok(Some(n))
            }
            other => Err(Self::unexpected(what, "map or nil", other, offset)),
        }
    }

    fn array_at(&mut self, what: &'static str, depth: u32) -> Result<u32> {
        let offset = self.pos;
        match self.head(what)? {
            ValueHead::Array(n) => {
                self.enter(depth, offset)?;
                Ok(n)
            }
            other => Err(Self::unexpected(what, "array", other, offset)),
        }
    }

    /// One event map of `n` entries whose header was read.
    pub(super) fn trtllm_event(&mut self, n: u32) -> Result<Decoded> {
        let mut data = None;
        let mut window = None;
        let mut layer_group = None;
        for _ in 0..n {
            match self.key(DEPTH_FIELD)? {
                Some(b"data") => data = Some(self.trt_data()?),
                Some(b"window_size") => window = self.opt_u32("window_size")?,
                Some(b"layer_group_id") => layer_group = self.opt_u32("layer_group_id")?,
                Some(b"attention_dp_rank") => {
                    let rank = self.opt_u32("attention_dp_rank")?;
                    self.event_rank = self.event_rank.or(rank);
                }
                _ => self.skip(DEPTH_FIELD)?,
            }
        }
        let data = data.ok_or(DecodeError::MissingField {
            event: "TensorRT-LLM event",
            field: "data",
        })?;
        let Some(tag) = data.tag else {
            return Err(DecodeError::MissingField {
                event: "TensorRT-LLM event data",
                field: "type",
            });
        };
        let group = BlockPlace {
            group_idx: layer_group.or(window).or(Some(0)),
            ..BlockPlace::default()
        };
        Ok(match tag {
            None => Decoded::Unknown,
            Some(Type::Created) => Decoded::Ignored,
            Some(Type::Stored) => Decoded::Event(KvEvent::BlockStored {
                block_hashes: data.hashes,
                parent_block_hash: data.parent,
                token_ids: data.tokens,
                block_size: data.block_size.unwrap_or(0),
                lora_id: data.lora_id,
                medium: data.first_level.map(|l| medium_of(l).to_owned()),
                lora_name: None,
                extra_keys: data.extra,
                cache_salt: None,
                place: BlockPlace {
                    spec_kind: Some("full_attention".to_owned()),
                    ..group
                },
            }),
            Some(Type::Removed) => Decoded::Event(KvEvent::BlockRemoved {
                block_hashes: data.hashes,
                medium: None,
                place: BlockPlace {
                    any_tier: true,
                    ..group
                },
            }),
            Some(Type::Updated) => match data.moved {
                Some((old, new)) if old != new && !data.hashes.is_empty() => {
                    Decoded::Event(KvEvent::BlockMoved {
                        block_hashes: data.hashes,
                        from_medium: Some(medium_of(old).to_owned()),
                        to_medium: Some(medium_of(new).to_owned()),
                        place: group,
                    })
                }
                _ => Decoded::Ignored,
            },
        })
    }

    /// The `data` map of an event.
    fn trt_data(&mut self) -> Result<Data> {
        let depth = DEPTH_FIELD + 1;
        let offset = self.pos;
        let n = match self.head("event data")? {
            ValueHead::Map(n) => n,
            other => return Err(Self::unexpected("event data", "map", other, offset)),
        };
        self.enter(DEPTH_FIELD, offset)?;
        let mut d = Data::default();
        for _ in 0..n {
            match self.key(depth)? {
                Some(b"type") => {
                    d.tag = Some(Type::from_tag(self.str_bytes("event data type")?));
                }
                Some(b"parent_hash") => d.parent = self.opt_trt_hash("parent_hash")?,
                Some(b"blocks") => self.trt_blocks(&mut d)?,
                Some(b"block_hashes") => {
                    let (n, cap) =
                        self.list_header("block_hashes", self.limits.max_hashes_per_event)?;
                    d.hashes = Vec::with_capacity(cap);
                    for _ in 0..n {
                        d.hashes.push(self.trt_hash("block_hashes")?);
                    }
                }
                Some(b"block_hash") => d.hashes = vec![self.trt_hash("block_hash")?],
                Some(b"cache_level") => d.moved = self.trt_level_diff()?,
                _ => self.skip(depth)?,
            }
        }
        Ok(d)
    }

    /// `updated`'s `cache_level`: nil, or `{"old_value", "new_value"}`.
    fn trt_level_diff(&mut self) -> Result<Option<(u32, u32)>> {
        let depth = DEPTH_FIELD + 2;
        let Some(n) = self.opt_map("cache_level", depth)? else {
            return Ok(None);
        };
        let (mut old, mut new) = (None, None);
        for _ in 0..n {
            match self.key(depth)? {
                Some(b"old_value") => old = self.opt_u32("cache_level old_value")?,
                Some(b"new_value") => new = self.opt_u32("cache_level new_value")?,
                _ => self.skip(depth)?,
            }
        }
        Ok(old.zip(new))
    }

    /// `stored`'s `blocks`, appended to `d`.
    fn trt_blocks(&mut self, d: &mut Data) -> Result<()> {
        let n = self.array_at("blocks", DEPTH_FIELD + 1)?;
        let len = at_most("blocks", u64::from(n), self.limits.max_hashes_per_event)?;
        d.hashes = Vec::with_capacity(len.min(self.remaining()));
        let depth = DEPTH_EVENT + 3;
        let mut any_extra = false;
        for i in 0..n as usize {
            let offset = self.pos;
            let m = match self.head("stored block")? {
                ValueHead::Map(m) => m,
                other => return Err(Self::unexpected("stored block", "map", other, offset)),
            };
            self.enter(depth, offset)?;
            let mut hash = None;
            let mut extra = false;
            let before = d.tokens.len();
            for _ in 0..m {
                match self.key(depth + 1)? {
                    Some(b"block_hash") => hash = Some(self.trt_hash("block_hash")?),
                    Some(b"tokens") => extra |= self.trt_tokens(&mut d.tokens)?,
                    Some(b"cache_level") => {
                        let level = self.opt_u32("cache_level")?;
                        if i == 0 {
                            d.first_level = level;
                        }
                    }
                    Some(b"lora_id") => {
                        // the engine folds its adapter task id into the hash; requests name
                        // adapters, not task ids
                        let id = self.opt_i64("lora_id")?;
                        d.lora_id = d.lora_id.or(id);
                        extra |= id.is_some();
                    }
                    Some(b"mm_keys") => {
                        // multimodal keys: any entry makes the block's content unhashable here
                        let offset = self.pos;
                        match self.head("mm_keys")? {
                            ValueHead::Nil => {}
                            ValueHead::Array(k) => {
                                self.enter(depth + 1, offset)?;
                                extra |= k > 0;
                                self.skip_n(u64::from(k), depth + 2)?;
                            }
                            other => {
                                return Err(Self::unexpected(
                                    "mm_keys",
                                    "array or nil",
                                    other,
                                    offset,
                                ));
                            }
                        }
                    }
                    _ => self.skip(depth + 1)?,
                }
            }
            d.hashes.push(hash.ok_or(DecodeError::MissingField {
                event: "TensorRT-LLM stored block",
                field: "block_hash",
            })?);
            if i == 0 {
                d.block_size = u32::try_from(d.tokens.len() - before).ok();
            }
            if extra && !any_extra {
                any_extra = true;
                d.extra = vec![None; i];
            }
            if any_extra {
                d.extra.push(extra.then(opaque_extra));
            }
        }
        Ok(())
    }

    /// A block's `tokens`: `{"token_id", "token_extra_id"}` maps (or plain ids), appended to
    /// `out`. Returns whether any carries a nonzero extra id.
    fn trt_tokens(&mut self, out: &mut Vec<u32>) -> Result<bool> {
        let depth = DEPTH_EVENT + 5;
        let n = self.array_at("tokens", depth)?;
        let limit = self.limits.max_tokens_per_event;
        if out.len().saturating_add(n as usize) > limit {
            return Err(DecodeError::TooMany {
                what: "tokens",
                len: out.len() as u64 + u64::from(n),
                limit,
            });
        }
        out.reserve((n as usize).min(self.remaining()));
        let mut extra = false;
        for _ in 0..n {
            let offset = self.pos;
            let ValueHead::Map(m) = self.head("token")? else {
                // a plain token id
                self.pos = offset;
                out.push(self.u32("token_id")?);
                continue;
            };
            self.enter(depth + 1, offset)?;
            let mut id = None;
            for _ in 0..m {
                match self.key(depth + 2)? {
                    Some(b"token_id") => id = Some(self.u32("token_id")?),
                    Some(b"token_extra_id") => {
                        extra |= self.opt_i64("token_extra_id")?.is_some_and(|v| v != 0);
                    }
                    _ => self.skip(depth + 2)?,
                }
            }
            out.push(id.ok_or(DecodeError::MissingField {
                event: "TensorRT-LLM token",
                field: "token_id",
            })?);
        }
        Ok(extra)
    }

    /// A batch that is a bare list of `n` events (its header read).
    pub(super) fn trtllm_list(&mut self, n: u32) -> Result<(Vec<KvEvent>, u32)> {
        let len = at_most("events", u64::from(n), self.limits.max_events_per_batch)?;
        let mut events = Vec::with_capacity(len.min(self.remaining()));
        let mut skipped = 0u32;
        for _ in 0..n {
            let offset = self.pos;
            let m = match self.head("event")? {
                ValueHead::Map(m) => m,
                other => return Err(Self::unexpected("event", "map", other, offset)),
            };
            self.enter(DEPTH_EVENT, offset)?;
            match self.trtllm_event(m)? {
                Decoded::Event(e) => events.push(e),
                Decoded::Ignored => {}
                Decoded::Unknown => skipped = skipped.saturating_add(1),
            }
        }
        Ok((events, skipped))
    }
}
