#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use super::decode::hash_from_bytes;
use super::*;

macro_rules! fixture {
    ($name:literal) => {
        include_bytes!(concat!("../../tests/fixtures/kv_events/", $name, ".bin")).as_slice()
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
        place: Default::default(),
    }
}

fn removed(hashes: &[u64], medium: Option<String>) -> KvEvent {
    KvEvent::BlockRemoved {
        block_hashes: hashes.to_vec(),
        medium,
        place: Default::default(),
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
fn with_first_extra(mut events: Vec<KvEvent>, keys: Vec<Option<Vec<ExtraKey>>>) -> Vec<KvEvent> {
    if let Some(KvEvent::BlockStored { extra_keys, .. }) = events.first_mut() {
        *extra_keys = keys;
    }
    events
}

/// The group fields gen_fixtures.py adds to the first store and to the removal.
fn with_places(mut events: Vec<KvEvent>, stored: BlockPlace, removed: BlockPlace) -> Vec<KvEvent> {
    if let Some(KvEvent::BlockStored { place, .. }) = events.first_mut() {
        *place = stored;
    }
    for e in &mut events {
        if let KvEvent::BlockRemoved { place, .. } = e {
            *place = removed.clone();
        }
    }
    events
}

fn group(idx: u32) -> BlockPlace {
    BlockPlace {
        group_idx: Some(idx),
        ..BlockPlace::default()
    }
}

fn tenant_a_extra() -> Option<Vec<ExtraKey>> {
    Some(vec![ExtraKey::Str("tenant-a".into()), ExtraKey::Int(3)])
}

#[test]
fn vllm_array_extra_trailing_fields_are_ignored() {
    let events = with_first_extra(canonical_events(), vec![tenant_a_extra(), None, None]);
    let events = with_places(events, group(1), group(1));
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
    let stored = BlockPlace {
        spec_kind: Some("full_attention".into()),
        sliding_window: Some(4096),
        ..group(0)
    };
    let events = with_places(events, stored, group(0));
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
    let (topic, n, b) = decode_replay_message(&[b"", b"kv-events", &seq, VLLM_MAP], &l).unwrap();
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

#[test]
fn a_batch_costs_one_per_event_plus_one_per_block_it_names() {
    let stored =
        |n: u64| KvEvent::plain_stored((0..n).collect(), None, vec![0; (n * 16) as usize], 16);
    let batch = EventBatch {
        ts: 0.0,
        events: vec![
            stored(512),
            KvEvent::BlockRemoved {
                block_hashes: vec![1, 2, 3],
                medium: None,
                place: Default::default(),
            },
            KvEvent::AllBlocksCleared,
        ],
        data_parallel_rank: None,
        skipped_unknown: 0,
    };
    assert_eq!(batch.budget_cost(), 513 + 4 + 1);
}

/// Token ids of every msgpack width decode in place, and a list cut short is an error, not a
/// shorter list.
#[test]
fn token_ids_of_every_width_round_trip_and_a_cut_list_fails() {
    let tokens = vec![0, 1, 127, 128, 255, 256, 65_535, 65_536, u32::MAX, 42];
    let b = batch(
        1.5,
        vec![stored(&[1], None, tokens.clone(), None, None, None)],
        Some(0),
        0,
    );
    for enc in [EventEncoding::Array, EventEncoding::MapEvents] {
        let bytes = encode_event_batch(&b, enc);
        let back = decode(&bytes);
        let Some(KvEvent::BlockStored { token_ids, .. }) = back.events.first() else {
            panic!("{back:?}");
        };
        assert_eq!(token_ids, &tokens, "{enc:?}");
    }
    // the list ends inside its last id (a uint32 cut after two of its bytes)
    let bytes = encode_event_batch(
        &batch(
            1.5,
            vec![stored(&[1], None, vec![7, u32::MAX], None, None, None)],
            None,
            0,
        ),
        EventEncoding::Array,
    );
    let at = bytes
        .windows(5)
        .position(|w| w == [0xce, 0xff, 0xff, 0xff, 0xff])
        .expect("the uint32 id");
    let _ = decode_err(&bytes[..at + 3]);
}
