//! The encoder: every engine wire shape the decoder reads, for the tests, the fuzz targets
//! and the simulator (the picker itself only decodes).

use rmp::encode::ByteBuf;

use super::{BlockPlace, EventBatch, ExtraKey, KvEvent, TAG_CLEARED, TAG_REMOVED, TAG_STORED};

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
    /// TensorRT-LLM: a bare list of `KVCacheEventSerializer` dicts (see the decoder's
    /// TensorRT-LLM module). `ts` is not written (the format has none); the group is written
    /// as `layer_group_id` and the window as `window_size` (the sliding window, or
    /// [`TRTLLM_FULL_WINDOW`]); a [`KvEvent::BlockMoved`] becomes one `updated` event per
    /// block. TensorRT-LLM has no clear event: [`KvEvent::AllBlocksCleared`] is left out.
    Trtllm,
}

/// The `window_size` the TensorRT-LLM encoding writes for a full-attention group (its
/// `max_attention_window`, the longest sequence the engine serves).
pub const TRTLLM_FULL_WINDOW: u32 = 131_072;

/// TensorRT-LLM's default block priority (`KvCacheRetentionConfig`'s default, 35).
const TRTLLM_DEFAULT_PRIORITY: u64 = 35;

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
        EventEncoding::Trtllm => w.trtllm_events(&batch.events, batch.data_parallel_rank),
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
            KvEvent::BlockRemoved { block_hashes, .. }
            | KvEvent::BlockMoved { block_hashes, .. } => 48 + 9 * block_hashes.len(),
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

    /// vLLM 0.32's group and tier fields in declaration order, each only when set (msgspec's
    /// `omit_defaults`).
    fn place(&mut self, place: &BlockPlace) {
        if let Some(g) = place.group_idx {
            self.str("group_idx");
            self.uint(u64::from(g));
        }
        self.opt_entry("kv_cache_spec_kind", place.spec_kind.as_deref());
        if let Some(w) = place.sliding_window {
            self.str("kv_cache_spec_sliding_window");
            self.uint(u64::from(w));
        }
        self.opt_entry("locality", place.locality.as_deref());
        self.opt_entry("ownership", place.ownership.as_deref());
        self.opt_entry("session_id", place.session_id.as_deref());
    }

    /// A string entry of a map, written only when set.
    fn opt_entry(&mut self, key: &str, v: Option<&str>) {
        if let Some(v) = v {
            self.str(key);
            self.str(v);
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
                place,
            } => {
                let grouped = place.group_idx.is_some()
                    || place.spec_kind.is_some()
                    || place.sliding_window.is_some();
                self.array_len(match (grouped, extra_keys.is_empty()) {
                    (true, _) => 12,
                    (false, true) => 8,
                    (false, false) => 9,
                });
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
                } else if grouped {
                    self.nil();
                }
                if grouped {
                    // the last array-era schema; locality and ownership came after it
                    self.opt_uint(place.group_idx.map(u64::from));
                    self.opt_str(place.spec_kind.as_deref());
                    self.opt_uint(place.sliding_window.map(u64::from));
                }
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
                place,
            } => {
                self.array_len(if place.group_idx.is_some() { 4 } else { 3 });
                self.str(TAG_REMOVED);
                self.list(block_hashes, |w, h| w.uint(h));
                self.opt_str(medium.as_deref());
                if let Some(g) = place.group_idx {
                    self.uint(u64::from(g));
                }
            }
            KvEvent::BlockMoved { .. } => self.array_event(&moved_as_removal(event)),
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
                place,
            } => {
                self.map_len(
                    8 + u32::from(!extra_keys.is_empty())
                        + u32::from(cache_salt.is_some())
                        + place.stored_fields(),
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
                self.place(place);
                if let Some(salt) = cache_salt {
                    self.str("cache_salt");
                    self.str(salt);
                }
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
                place,
            } => {
                self.map_len(3 + place.removed_fields());
                self.str("type");
                self.str(TAG_REMOVED);
                self.str("block_hashes");
                self.list(block_hashes, |w, h| w.uint(h));
                self.str("medium");
                self.opt_str(medium.as_deref());
                self.place(&BlockPlace {
                    spec_kind: None,
                    sliding_window: None,
                    session_id: None,
                    ..place.clone()
                });
            }
            KvEvent::BlockMoved { .. } => self.map_event(&moved_as_removal(event)),
            KvEvent::AllBlocksCleared => {
                self.map_len(1);
                self.str("type");
                self.str(TAG_CLEARED);
            }
        }
    }

    /// TensorRT-LLM's event list (see [`EventEncoding::Trtllm`]).
    fn trtllm_events(&mut self, events: &[KvEvent], rank: Option<u32>) {
        let count: usize = events
            .iter()
            .map(|e| match e {
                KvEvent::BlockMoved { block_hashes, .. } => block_hashes.len(),
                KvEvent::AllBlocksCleared => 0,
                _ => 1,
            })
            .sum();
        let len = u32::try_from(count).unwrap_or(u32::MAX);
        self.array_len(len);
        let mut id = 0u64;
        // an event's fields up to `data`, then the data map's header with `fields` entries of
        // which `type` is written; false once `len` events are written
        let mut begin = |w: &mut Self, place: &BlockPlace, fields: u32, kind: &str| {
            if id >= u64::from(len) {
                return false;
            }
            w.map_len(3 + u32::from(place.group_idx.is_some()) + u32::from(rank.is_some()));
            w.str("event_id");
            w.uint(id);
            id += 1;
            w.str("window_size");
            w.uint(u64::from(
                place.sliding_window.unwrap_or(TRTLLM_FULL_WINDOW),
            ));
            if let Some(g) = place.group_idx {
                w.str("layer_group_id");
                w.uint(u64::from(g));
            }
            if let Some(r) = rank {
                w.str("attention_dp_rank");
                w.uint(u64::from(r));
            }
            w.str("data");
            w.map_len(fields);
            w.str("type");
            w.str(kind);
            true
        };
        for event in events {
            match event {
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    lora_id,
                    medium,
                    place,
                    ..
                } => {
                    if !begin(self, place, 3, "stored") {
                        break;
                    }
                    self.str("parent_hash");
                    self.opt_uint(*parent_block_hash);
                    self.str("blocks");
                    let level = trtllm_level(medium.as_deref());
                    let per = (*block_size as usize).max(1);
                    self.array_len(u32::try_from(block_hashes.len()).unwrap_or(u32::MAX));
                    for (i, &h) in block_hashes.iter().enumerate().take(u32::MAX as usize) {
                        self.map_len(5 + u32::from(lora_id.is_some()));
                        self.str("type");
                        self.str("stored_block");
                        self.str("block_hash");
                        self.uint(h);
                        self.str("tokens");
                        let tokens = token_ids.get(i * per..(i + 1) * per).unwrap_or(&[]);
                        self.array_len(u32::try_from(tokens.len()).unwrap_or(u32::MAX));
                        for &t in tokens {
                            self.map_len(3);
                            self.str("type");
                            self.str("unique_token");
                            self.str("token_id");
                            self.uint(u64::from(t));
                            self.str("token_extra_id");
                            self.uint(0);
                        }
                        self.str("cache_level");
                        self.uint(level);
                        self.str("priority");
                        self.uint(TRTLLM_DEFAULT_PRIORITY);
                        if let Some(l) = lora_id {
                            self.str("lora_id");
                            self.sint(*l);
                        }
                    }
                }
                KvEvent::BlockRemoved {
                    block_hashes,
                    place,
                    ..
                } => {
                    if !begin(self, place, 2, "removed") {
                        break;
                    }
                    self.str("block_hashes");
                    self.list(block_hashes, |w, h| w.uint(h));
                }
                KvEvent::BlockMoved {
                    block_hashes,
                    from_medium,
                    to_medium,
                    place,
                } => {
                    for &h in block_hashes {
                        if !begin(self, place, 4, "updated") {
                            break;
                        }
                        self.str("block_hash");
                        self.uint(h);
                        self.str("cache_level");
                        self.map_len(3);
                        self.str("type");
                        self.str("event_diff");
                        self.str("new_value");
                        self.uint(trtllm_level(to_medium.as_deref()));
                        self.str("old_value");
                        self.uint(trtllm_level(from_medium.as_deref()));
                        self.str("priority");
                        self.nil();
                    }
                }
                KvEvent::AllBlocksCleared => {}
            }
        }
    }
}

/// TensorRT-LLM's cache level of a tier name: 0 the GPU, 1 host memory, 2 anything lower.
fn trtllm_level(medium: Option<&str>) -> u64 {
    match medium.map(str::to_ascii_uppercase).as_deref() {
        None | Some("GPU") => 0,
        Some("CPU") => 1,
        Some(_) => 2,
    }
}

/// A [`KvEvent::BlockMoved`] as vLLM's and SGLang's shapes can say it (they have no move):
/// a removal from the tier the blocks left.
fn moved_as_removal(event: &KvEvent) -> KvEvent {
    match event {
        KvEvent::BlockMoved {
            block_hashes,
            from_medium,
            place,
            ..
        } => KvEvent::BlockRemoved {
            block_hashes: block_hashes.clone(),
            medium: from_medium.clone(),
            place: place.clone(),
        },
        other => other.clone(),
    }
}
