//! KV event payloads (msgpack, any vLLM/SGLang/TensorRT-LLM shape): decode with the default
//! bounds, and when a batch decodes, apply it to an index (extra keys, salts, parents, tiers)
//! and re-encode it.
#![no_main]

use kvroute_routing::block_keys::BlockHasher;
use kvroute_routing::endpoint::EndpointId;
use kvroute_routing::index::{IndexConfig, IndexMode, KvIndex};
use kvroute_routing::kv_events::ingest::{IngestKeys, apply_batch};
use kvroute_routing::kv_events::{
    DecodeLimits, EventEncoding, KvEvent, decode_event_batch, encode_event_batch,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(batch) = decode_event_batch(data, &DecodeLimits::default()) else {
        return;
    };
    let mut index = KvIndex::new(IndexConfig { max_endpoints: 4 });
    let id = EndpointId::new(std::net::IpAddr::from([127, 0, 0, 1]), 8000, 0);
    let Ok(slot) = index.add_endpoint(id, IndexMode::Precise, 4096) else {
        return;
    };
    for bs in [1u32, 16] {
        let keys = IngestKeys {
            hasher: BlockHasher::new(bs),
            model: "m",
        };
        let _ = apply_batch(&mut index, slot, keys, &batch);
    }
    // what we encode, we decode to the same events; moves and tier-less removals exist in
    // TensorRT-LLM's shape only
    let trtllm_only = batch.events.iter().any(|e| match e {
        KvEvent::BlockMoved { .. } => true,
        KvEvent::BlockRemoved { place, .. } => place.any_tier,
        _ => false,
    });
    if trtllm_only {
        return;
    }
    for enc in [
        EventEncoding::Array,
        EventEncoding::MapEvents,
        EventEncoding::Map,
    ] {
        let bytes = encode_event_batch(&batch, enc);
        let again = decode_event_batch(&bytes, &DecodeLimits::default()).expect("re-decode");
        assert_eq!(again.events, batch.events);
    }
});
