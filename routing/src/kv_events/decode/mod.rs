//! The streaming msgpack reader behind [`decode_event_batch`] (the module docs list the shapes
//! it accepts).

use rmp::Marker;

use self::trtllm::Decoded;
use super::{
    BlockPlace, DecodeError, DecodeLimits, EventBatch, ExtraKey, KvEvent, MAX_EXTRA_KEYS_PER_BLOCK,
    MAX_SUPPORTED_DEPTH, Result, TAG_REMOVED, TAG_STORED, at_most,
};

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

mod trtllm;

/// Nesting levels of the known structure (the batch is level 1).
const DEPTH_BATCH: u32 = 1;
const DEPTH_EVENTS: u32 = 2;
const DEPTH_EVENT: u32 = 3;
const DEPTH_FIELD: u32 = 4;

/// One msgpack value header. Scalars are complete (strings and binaries borrow the payload);
/// containers carry their element count, and their elements follow in the input.
#[derive(Debug, Clone, Copy)]
enum ValueHead<'a> {
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

impl ValueHead<'_> {
    fn kind(&self) -> &'static str {
        match self {
            ValueHead::Nil => "nil",
            ValueHead::Bool => "bool",
            ValueHead::Uint(_) | ValueHead::Int(_) => "integer",
            ValueHead::Float(_) => "float",
            ValueHead::Str(_) => "string",
            ValueHead::Bin(_) => "binary",
            ValueHead::Array(_) => "array",
            ValueHead::Map(_) => "map",
            ValueHead::Ext => "ext",
        }
    }
}

/// Cursor over a payload. `pos <= buf.len()` always holds.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    limits: &'a DecodeLimits,
    /// The first `attention_dp_rank` a TensorRT-LLM event named (its rank is per event).
    event_rank: Option<u32>,
    /// Whether a TensorRT-LLM event was read (its envelope may lack a timestamp).
    saw_trtllm: bool,
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
    place: BlockPlace,
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
                place: self.place,
            },
            Kind::Removed => KvEvent::BlockRemoved {
                block_hashes: self.block_hashes.ok_or(DecodeError::MissingField {
                    event: TAG_REMOVED,
                    field: "block_hashes",
                })?,
                medium: self.medium,
                place: BlockPlace {
                    spec_kind: None,
                    sliding_window: None,
                    session_id: None,
                    ..self.place
                },
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
            event_rank: None,
            saw_trtllm: false,
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
    fn head(&mut self, what: &'static str) -> Result<ValueHead<'a>> {
        let offset = self.pos;
        let byte = self.fixed::<1>(what, offset)?[0];
        let usize_of = |n: u32| usize::try_from(n).unwrap_or(usize::MAX);
        Ok(match Marker::from_u8(byte) {
            Marker::FixPos(v) => ValueHead::Uint(u64::from(v)),
            Marker::FixNeg(v) => ValueHead::Int(i64::from(v)),
            Marker::Null => ValueHead::Nil,
            Marker::True | Marker::False => ValueHead::Bool,
            Marker::U8 => ValueHead::Uint(u64::from(u8::from_be_bytes(self.fixed(what, offset)?))),
            Marker::U16 => {
                ValueHead::Uint(u64::from(u16::from_be_bytes(self.fixed(what, offset)?)))
            }
            Marker::U32 => {
                ValueHead::Uint(u64::from(u32::from_be_bytes(self.fixed(what, offset)?)))
            }
            Marker::U64 => ValueHead::Uint(u64::from_be_bytes(self.fixed(what, offset)?)),
            Marker::I8 => ValueHead::Int(i64::from(i8::from_be_bytes(self.fixed(what, offset)?))),
            Marker::I16 => ValueHead::Int(i64::from(i16::from_be_bytes(self.fixed(what, offset)?))),
            Marker::I32 => ValueHead::Int(i64::from(i32::from_be_bytes(self.fixed(what, offset)?))),
            Marker::I64 => ValueHead::Int(i64::from_be_bytes(self.fixed(what, offset)?)),
            Marker::F32 => {
                ValueHead::Float(f64::from(f32::from_be_bytes(self.fixed(what, offset)?)))
            }
            Marker::F64 => ValueHead::Float(f64::from_be_bytes(self.fixed(what, offset)?)),
            Marker::FixStr(n) => ValueHead::Str(self.take(usize::from(n), what, offset)?),
            Marker::Str8 => {
                let n = self.len8(what, offset)?;
                ValueHead::Str(self.take(n, what, offset)?)
            }
            Marker::Str16 => {
                let n = self.len16(what, offset)?;
                ValueHead::Str(self.take(n, what, offset)?)
            }
            Marker::Str32 => {
                let n = self.len32(what, offset)?;
                ValueHead::Str(self.take(usize_of(n), what, offset)?)
            }
            Marker::Bin8 => {
                let n = self.len8(what, offset)?;
                ValueHead::Bin(self.take(n, what, offset)?)
            }
            Marker::Bin16 => {
                let n = self.len16(what, offset)?;
                ValueHead::Bin(self.take(n, what, offset)?)
            }
            Marker::Bin32 => {
                let n = self.len32(what, offset)?;
                ValueHead::Bin(self.take(usize_of(n), what, offset)?)
            }
            Marker::FixArray(n) => ValueHead::Array(u32::from(n)),
            Marker::Array16 => {
                ValueHead::Array(u32::from(u16::from_be_bytes(self.fixed(what, offset)?)))
            }
            Marker::Array32 => ValueHead::Array(self.len32(what, offset)?),
            Marker::FixMap(n) => ValueHead::Map(u32::from(n)),
            Marker::Map16 => {
                ValueHead::Map(u32::from(u16::from_be_bytes(self.fixed(what, offset)?)))
            }
            Marker::Map32 => ValueHead::Map(self.len32(what, offset)?),
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
    fn ext(&mut self, len: usize, what: &'static str, offset: usize) -> Result<ValueHead<'a>> {
        self.take(len.saturating_add(1), what, offset)?;
        Ok(ValueHead::Ext)
    }

    fn unexpected(
        what: &'static str,
        expected: &'static str,
        found: ValueHead<'_>,
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
                ValueHead::Array(n) => Some(u64::from(n)),
                ValueHead::Map(n) => Some(2 * u64::from(n)),
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
            ValueHead::Float(v) => Ok(v),
            // Integral timestamps: an encoder may write 1718000000.0 as an integer.
            ValueHead::Uint(v) => Ok(v as f64),
            ValueHead::Int(v) => Ok(v as f64),
            other => Err(Self::unexpected(what, "float", other, offset)),
        }
    }

    fn u64(&mut self, what: &'static str) -> Result<u64> {
        let offset = self.pos;
        match self.head(what)? {
            ValueHead::Uint(v) => Ok(v),
            ValueHead::Int(v) => u64::try_from(v).map_err(|_| DecodeError::IntegerOutOfRange {
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
            ValueHead::Nil => Ok(None),
            ValueHead::Int(v) => Ok(Some(v)),
            ValueHead::Uint(v) => {
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
            ValueHead::Str(s) => Ok(s),
            other => Err(Self::unexpected(what, "string", other, offset)),
        }
    }

    fn opt_string(&mut self, what: &'static str) -> Result<Option<String>> {
        let offset = self.pos;
        match self.head(what)? {
            ValueHead::Nil => Ok(None),
            ValueHead::Str(s) => std::str::from_utf8(s)
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
                let ValueHead::Map(n) = self.head("metadata")? else {
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
                ValueHead::Nil => out.push(None),
                ValueHead::Array(k) => {
                    self.enter(DEPTH_FIELD + 1, offset)?;
                    let len = at_most("extra_keys", u64::from(k), MAX_EXTRA_KEYS_PER_BLOCK)?;
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
                ValueHead::Int(v) => ExtraKey::Int(v),
                ValueHead::Uint(v) if i64::try_from(v).is_ok() => ExtraKey::Int(v as i64),
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
            ValueHead::Uint(v) => Ok(v),
            // Two's complement reinterpretation: SGLang and some engines emit signed 64-bit
            // hashes; the bit pattern is the identity, the sign is an artifact.
            ValueHead::Int(v) => Ok(v as u64),
            ValueHead::Bin(b) => Ok(hash_from_bytes(b)),
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
            ValueHead::Array(n) => n,
            other => return Err(Self::unexpected(what, "array", other, offset)),
        };
        self.enter(DEPTH_FIELD, offset)?;
        let len = at_most(what, u64::from(n), limit)?;
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
            // token ids are positive fixints, uint8, uint16 or uint32: read those in place
            // (the general head decode costs a third of a busy picker's event time); anything
            // else, and every error, goes the general way
            let rest = &self.buf[self.pos..];
            let (v, len) = match rest {
                [b @ 0x00..=0x7f, ..] => (u32::from(*b), 1),
                [0xcc, b, ..] => (u32::from(*b), 2),
                [0xcd, b0, b1, ..] => (u32::from(u16::from_be_bytes([*b0, *b1])), 3),
                [0xce, b0, b1, b2, b3, ..] => (u32::from_be_bytes([*b0, *b1, *b2, *b3]), 5),
                _ => {
                    out.push(self.u32(what)?);
                    continue;
                }
            };
            self.pos += len;
            out.push(v);
        }
        Ok(out)
    }

    // ---- structure -------------------------------------------------------------------------

    fn batch(&mut self) -> Result<EventBatch> {
        let offset = self.pos;
        match self.head("batch")? {
            ValueHead::Array(n) => {
                self.enter(DEPTH_BATCH, offset)?;
                if n >= 1
                    && matches!(
                        self.peek_byte().map(Marker::from_u8),
                        Some(Marker::FixMap(_) | Marker::Map16 | Marker::Map32)
                    )
                {
                    // TensorRT-LLM: a bare list of events, no timestamp
                    let (events, skipped_unknown) = self.trtllm_list(n)?;
                    return Ok(EventBatch {
                        ts: super::unix_now(),
                        events,
                        data_parallel_rank: self.event_rank,
                        skipped_unknown,
                    });
                }
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
                    data_parallel_rank: data_parallel_rank.or(self.event_rank),
                    skipped_unknown,
                })
            }
            ValueHead::Map(n) => {
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
                let (events, skipped_unknown) = events.ok_or(DecodeError::MissingField {
                    event: "batch",
                    field: "events",
                })?;
                let ts = match ts {
                    Some(ts) => ts,
                    None if self.saw_trtllm => super::unix_now(),
                    None => {
                        return Err(DecodeError::MissingField {
                            event: "batch",
                            field: "ts",
                        });
                    }
                };
                Ok(EventBatch {
                    ts,
                    events,
                    data_parallel_rank: dp_rank.or(attn_rank).or(self.event_rank),
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
            ValueHead::Array(n) => n,
            other => return Err(Self::unexpected("events", "array", other, offset)),
        };
        self.enter(DEPTH_EVENTS, offset)?;
        let len = at_most("events", u64::from(n), self.limits.max_events_per_batch)?;
        let mut events = Vec::with_capacity(len.min(self.remaining()));
        let mut skipped = 0u32;
        for _ in 0..n {
            match self.event()? {
                Decoded::Event(event) => events.push(event),
                Decoded::Ignored => {}
                Decoded::Unknown => skipped = skipped.saturating_add(1),
            }
        }
        Ok((events, skipped))
    }

    /// Reads one event (an unknown tag is fully skipped).
    fn event(&mut self) -> Result<Decoded> {
        let offset = self.pos;
        match self.head("event")? {
            ValueHead::Array(n) => {
                self.enter(DEPTH_EVENT, offset)?;
                Ok(self
                    .array_event(n, offset)?
                    .map_or(Decoded::Unknown, Decoded::Event))
            }
            ValueHead::Map(n) => {
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
                // the last array-era schemas appended `group_idx, kv_cache_spec_kind,
                // kv_cache_spec_sliding_window`
                let mut place = BlockPlace::default();
                if have > 8 {
                    place.group_idx = self.opt_u32("group_idx")?;
                }
                if have > 9 {
                    place.spec_kind = self.opt_string("kv_cache_spec_kind")?;
                }
                if have > 10 {
                    place.sliding_window = self.opt_u32("kv_cache_spec_sliding_window")?;
                }
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
                    place,
                };
                (event, have.min(11))
            }
            Kind::Removed => {
                need(0, "block_hashes", TAG_REMOVED)?;
                let block_hashes = self.hash_list("block_hashes")?;
                let medium = if have > 1 {
                    self.opt_string("medium")?
                } else {
                    None
                };
                let mut place = BlockPlace::default();
                if have > 2 {
                    place.group_idx = self.opt_u32("group_idx")?;
                }
                let event = KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                    place,
                };
                (event, have.min(3))
            }
            Kind::Cleared => (KvEvent::AllBlocksCleared, 0),
        };
        // Trailing fields from a newer schema (extra_keys, group_idx, ...).
        self.skip_n(have - used, DEPTH_FIELD)?;
        Ok(Some(event))
    }

    fn map_event(&mut self, n: u32, offset: usize) -> Result<Decoded> {
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
                match tag {
                    Tag::Type(tag) => (tag, false),
                    Tag::Trtllm => {
                        self.saw_trtllm = true;
                        return self.trtllm_event(n);
                    }
                }
            }
        };
        let remaining = if first_is_tag { n - 1 } else { n };
        let Some(kind) = Kind::from_tag(tag) else {
            self.skip_n(2 * u64::from(remaining), DEPTH_FIELD)?;
            return Ok(Decoded::Unknown);
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
                (Kind::Stored | Kind::Removed, Some(b"group_idx")) => {
                    f.place.group_idx = self.opt_u32("group_idx")?;
                }
                (Kind::Stored | Kind::Removed, Some(b"locality")) => {
                    f.place.locality = self.opt_string("locality")?;
                }
                (Kind::Stored | Kind::Removed, Some(b"ownership")) => {
                    f.place.ownership = self.opt_string("ownership")?;
                }
                (Kind::Stored, Some(b"kv_cache_spec_kind")) => {
                    f.place.spec_kind = self.opt_string("kv_cache_spec_kind")?;
                }
                (Kind::Stored, Some(b"kv_cache_spec_sliding_window")) => {
                    f.place.sliding_window = self.opt_u32("kv_cache_spec_sliding_window")?;
                }
                (Kind::Stored, Some(b"session_id")) => {
                    f.place.session_id = self.opt_string("session_id")?;
                }
                (Kind::Stored, Some(b"cache_salt")) => {
                    f.cache_salt = self.lora_name_or_metadata()?.0;
                }
                // "type" again (when it was not first) and every unknown key.
                _ => self.skip(DEPTH_FIELD)?,
            }
        }
        f.build(kind).map(Decoded::Event)
    }

    /// Scans a map's `n` entries for the `"type"` key and returns its value, or recognises a
    /// TensorRT-LLM event (a `"data"` map and no `"type"`), leaving the cursor wherever the
    /// scan stopped (the caller rewinds).
    fn find_type(&mut self, n: u32, offset: usize) -> Result<Tag<'a>> {
        let mut data = false;
        for _ in 0..n {
            match self.key(DEPTH_FIELD)? {
                Some(b"type") => return self.str_bytes("event type").map(Tag::Type),
                Some(b"data") => data = true,
                _ => {}
            }
            self.skip(DEPTH_FIELD)?;
        }
        if data {
            Ok(Tag::Trtllm)
        } else {
            Err(DecodeError::MissingTag { offset })
        }
    }
}

/// What tags an event map.
enum Tag<'a> {
    /// vLLM's and SGLang's `"type"`.
    Type(&'a [u8]),
    /// A TensorRT-LLM event: its type sits inside `"data"`.
    Trtllm,
}

const NIL: u8 = 0xc0;

/// Low 64 bits of a big-endian byte string: its last 8 bytes, left-padded with zeros.
pub(super) fn hash_from_bytes(bytes: &[u8]) -> u64 {
    let tail = bytes.get(bytes.len().saturating_sub(8)..).unwrap_or(bytes);
    let mut buf = [0u8; 8];
    let pad = 8 - tail.len();
    if let Some(dst) = buf.get_mut(pad..) {
        dst.copy_from_slice(tail);
    }
    u64::from_be_bytes(buf)
}
