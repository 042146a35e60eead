//! TensorRT-LLM's KV-cache events (`tests/fixtures/trtllm/gen_events.py`, written from the
//! engine's documented serializer format): decoded, applied to the index and credited.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::{IpAddr, Ipv4Addr};

use kvroute_routing::block_keys::BlockHasher;
use kvroute_routing::endpoint::EndpointId;
use kvroute_routing::index::{IndexMode, KvIndex, Slot, TierBlocks};
use kvroute_routing::kv_events::ingest::{IngestKeys, IngestStats, apply_batch};
use kvroute_routing::kv_events::{
    BlockPlace, DecodeLimits, EventBatch, EventEncoding, KvEvent, decode_event_batch,
    encode_event_batch,
};

mod support;
use support::{BS, credit};

macro_rules! fixture {
    ($name:literal) => {
        include_bytes!(concat!("fixtures/trtllm/events/", $name, ".bin")).as_slice()
    };
}

fn decode(payload: &[u8]) -> EventBatch {
    decode_event_batch(payload, &DecodeLimits::default()).unwrap()
}

fn endpoint() -> (KvIndex, Slot) {
    let mut ix = KvIndex::default();
    let id = EndpointId::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 8000, 1);
    let slot = ix.add_endpoint(id, IndexMode::Precise, 1000).unwrap();
    (ix, slot)
}

fn apply(ix: &mut KvIndex, slot: Slot, payload: &[u8]) -> IngestStats {
    let keys = IngestKeys {
        hasher: BlockHasher::new(BS),
        model: "m",
    };
    apply_batch(ix, slot, keys, &decode(payload))
}

fn cpu(n: u32) -> TierBlocks {
    TierBlocks {
        cpu: n,
        ..TierBlocks::default()
    }
}

#[test]
fn stored_events_decode_to_the_engines_blocks_rank_and_window() {
    let b = decode(fixture!("stored"));
    // `created` changes nothing the picker models and is not an unknown kind
    assert_eq!((b.events.len(), b.skipped_unknown), (2, 0));
    assert_eq!(b.data_parallel_rank, Some(1));
    let KvEvent::BlockStored {
        block_hashes,
        parent_block_hash,
        token_ids,
        block_size,
        medium,
        place,
        extra_keys,
        ..
    } = &b.events[0]
    else {
        panic!("{:?}", b.events[0]);
    };
    assert_eq!(block_hashes, &[101, 102]);
    assert_eq!(*parent_block_hash, None);
    assert_eq!(token_ids, &(0..32).collect::<Vec<u32>>());
    assert_eq!((*block_size, medium.as_deref()), (16, Some("GPU")));
    assert!(extra_keys.is_empty());
    assert_eq!(
        *place,
        BlockPlace {
            group_idx: Some(4096),
            spec_kind: Some("full_attention".into()),
            ..BlockPlace::default()
        }
    );
    let KvEvent::BlockStored {
        parent_block_hash, ..
    } = &b.events[1]
    else {
        panic!("{:?}", b.events[1]);
    };
    assert_eq!(*parent_block_hash, Some(102));
}

#[test]
fn an_offloaded_block_is_credited_in_host_memory_and_back_on_the_gpu() {
    let (mut ix, slot) = endpoint();
    let s = apply(&mut ix, slot, fixture!("stored"));
    assert_eq!((s.stored_blocks, s.orphan_blocks), (3, 0));
    assert_eq!(credit(&ix, 3), (3, TierBlocks::default()));

    let moves = decode(fixture!("offload"));
    // only the cache-level change is a move; the priority update is not an event
    assert_eq!(moves.events.len(), 1);
    let KvEvent::BlockMoved {
        block_hashes,
        from_medium,
        to_medium,
        ..
    } = &moves.events[0]
    else {
        panic!("{:?}", moves.events[0]);
    };
    assert_eq!(block_hashes, &[103]);
    assert_eq!(
        (from_medium.as_deref(), to_medium.as_deref()),
        (Some("GPU"), Some("CPU"))
    );
    let s = apply(&mut ix, slot, fixture!("offload"));
    assert_eq!((s.moved_blocks, s.unknown_moved_blocks), (1, 0));
    // two blocks on the GPU, the third to be loaded from host memory
    assert_eq!(credit(&ix, 3), (2, cpu(1)));

    let s = apply(&mut ix, slot, fixture!("evict"));
    // the removal named no tier and found block 102 on the GPU; 103 came back
    assert_eq!((s.removed_blocks, s.moved_blocks), (1, 1));
    // without 102 the engine reuses only 101, and 103 cannot be reached
    assert_eq!(credit(&ix, 3), (1, TierBlocks::default()));
}

#[test]
fn a_removal_names_no_tier_and_finds_the_block_in_host_memory() {
    let (mut ix, slot) = endpoint();
    apply(&mut ix, slot, fixture!("stored"));
    apply(&mut ix, slot, fixture!("offload"));
    assert_eq!(credit(&ix, 3), (2, cpu(1)));
    let remove = EventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockRemoved {
            block_hashes: vec![103],
            medium: None,
            place: BlockPlace {
                group_idx: Some(4096),
                any_tier: true,
                ..BlockPlace::default()
            },
        }],
        data_parallel_rank: Some(1),
        skipped_unknown: 0,
    };
    let payload = encode_event_batch(&remove, EventEncoding::Trtllm);
    let s = apply(&mut ix, slot, &payload);
    assert_eq!(s.removed_blocks, 1);
    assert_eq!(credit(&ix, 3), (2, TierBlocks::default()));
}

#[test]
fn each_attention_window_is_its_own_group_walked_from_the_root() {
    let b = decode(fixture!("vswa"));
    let groups: Vec<Option<u32>> = b
        .events
        .iter()
        .map(|e| match e {
            KvEvent::BlockStored { place, .. } | KvEvent::BlockRemoved { place, .. } => {
                place.group_idx
            }
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(groups, [Some(32), Some(4096), Some(32)]);

    let (mut ix, slot) = endpoint();
    let mut first_two = b.clone();
    first_two.events.truncate(2);
    let keys = IngestKeys {
        hasher: BlockHasher::new(BS),
        model: "m",
    };
    let s = apply_batch(&mut ix, slot, keys, &first_two);
    // the same hashes in two windows are two sets of blocks
    assert_eq!(s.stored_blocks, 6);
    assert_eq!(credit(&ix, 3).0, 3);
    let mut removal = b.clone();
    removal.events.drain(..2);
    let s = apply_batch(&mut ix, slot, keys, &removal);
    assert_eq!(s.removed_blocks, 1);
    // the 32-token window dropped its first block: its tree has no root to walk from, so
    // the engine reuses nothing, although the 4096-token window holds all three
    assert_eq!(credit(&ix, 3).0, 0);
}

#[test]
fn blocks_built_from_inputs_the_picker_cannot_hash_never_match() {
    let b = decode(fixture!("extras"));
    assert_eq!(b.skipped_unknown, 1);
    assert_eq!(b.data_parallel_rank, None);
    let KvEvent::BlockStored {
        extra_keys, place, ..
    } = &b.events[0]
    else {
        panic!("{:?}", b.events[0]);
    };
    // the layer group wins over the window as the group
    assert_eq!(place.group_idx, Some(0));
    assert_eq!(extra_keys.len(), 2);
    assert!(extra_keys[0].is_none() && extra_keys[1].is_some());
    // the hex digest is named by its low 64 bits, in the store and in the removal
    let digest_low = 0xd15d_6c15_b0f0_0a08_u64;
    let hashes: Vec<&[u64]> = b
        .events
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored { block_hashes, .. }
            | KvEvent::BlockRemoved { block_hashes, .. } => Some(block_hashes.as_slice()),
            _ => None,
        })
        .collect();
    assert_eq!(hashes[3], &[digest_low]);
    assert_eq!(hashes[4], &[digest_low]);

    let (mut ix, slot) = endpoint();
    let s = apply(&mut ix, slot, fixture!("extras"));
    // 202 (a prompt-tuning token), 302 (an image) and 401 (an adapter's task id)
    assert_eq!(
        (s.stored_blocks, s.opaque_blocks, s.removed_blocks),
        (6, 3, 1)
    );
    // only the plain first block matches a plain prompt
    assert_eq!(credit(&ix, 2).0, 1);
}

#[test]
fn the_encoder_writes_what_the_decoder_reads() {
    let stored = decode(fixture!("stored"));
    let offload = decode(fixture!("offload"));
    for batch in [stored, offload] {
        let again = decode(&encode_event_batch(&batch, EventEncoding::Trtllm));
        assert_eq!(again.events, batch.events);
        assert_eq!(again.data_parallel_rank, batch.data_parallel_rank);
    }
}

#[test]
fn malformed_events_are_errors_not_panics() {
    use rmp::encode::{write_array_len, write_map_len, write_str, write_uint};
    // an event without `data`
    let mut p = Vec::new();
    write_array_len(&mut p, 1).unwrap();
    write_map_len(&mut p, 1).unwrap();
    write_str(&mut p, "event_id").unwrap();
    write_uint(&mut p, 1).unwrap();
    assert!(decode_event_batch(&p, &DecodeLimits::default()).is_err());
    // a stored block without a hash
    let mut p = Vec::new();
    write_array_len(&mut p, 1).unwrap();
    write_map_len(&mut p, 1).unwrap();
    write_str(&mut p, "data").unwrap();
    write_map_len(&mut p, 2).unwrap();
    write_str(&mut p, "type").unwrap();
    write_str(&mut p, "stored").unwrap();
    write_str(&mut p, "blocks").unwrap();
    write_array_len(&mut p, 1).unwrap();
    write_map_len(&mut p, 0).unwrap();
    let err = decode_event_batch(&p, &DecodeLimits::default()).unwrap_err();
    assert!(err.to_string().contains("block_hash"), "{err}");
    // every truncation of a real payload fails cleanly
    let full = fixture!("stored");
    for cut in 0..full.len() {
        assert!(decode_event_batch(&full[..cut], &DecodeLimits::default()).is_err());
    }
}
