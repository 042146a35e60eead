//! From wire bytes to a routing decision: a KV event published by one endpoint (in each of
//! vLLM's encodings) moves the decision for a request sharing that prefix to it, and its
//! removal moves it back.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use kvroute_routing::block_keys::{BlockHasher, ChainRoot};
use kvroute_routing::config::{RoutingConfig, Strategy};
use kvroute_routing::endpoint::{Endpoint, EndpointId, ModelConfig};
use kvroute_routing::kv_events::ingest::IngestKeys;
use kvroute_routing::kv_events::{
    DecodeLimits, EventBatch, EventEncoding, KvEvent, decode_message, encode_event_batch, seq_frame,
};
use kvroute_routing::place::{Pool, PoolSettings};
use kvroute_routing::pool_state::PoolMember;
use kvroute_routing::router::{RouteRequest, Router};

fn id(n: u8) -> EndpointId {
    EndpointId::new(IpAddr::V4(Ipv4Addr::new(127, 0, 0, n)), 8000, 0)
}

/// Where the pool places `prompt`.
fn place(pool: &Pool, mc: &ModelConfig, prompt: &[u32]) -> EndpointId {
    let keys = BlockHasher::new(16).keys(ChainRoot::new("llama", None, None), prompt);
    let req = RouteRequest {
        stage: kvroute_routing::router::Stage::Whole,
        ..RouteRequest::whole(mc, &keys, prompt.len() as u32)
    };
    pool.place(&req, 0).expect("placement").decision.endpoint
}

#[test]
fn a_published_prefix_attracts_the_request_and_its_removal_releases_it() {
    for encoding in [
        EventEncoding::Array,
        EventEncoding::MapEvents,
        EventEncoding::Map,
    ] {
        let mc = Arc::new(ModelConfig::new("default", "llama"));
        let ids: Vec<_> = (1..=4).map(id).collect();
        let pool = Pool::new(
            PoolSettings::default(),
            Router::new(RoutingConfig {
                strategy: Strategy::CostModel,
                ..RoutingConfig::default()
            }),
        );
        let members = ids
            .iter()
            .map(|i| PoolMember {
                endpoint: Endpoint::new(*i, mc.clone()),
                precise: true,
                kv_capacity_blocks: Some(50_000),
            })
            .collect();
        pool.apply_view(members, || {}).expect("view");
        let prompt: Vec<u32> = (0..4096).map(|i| (i * 7 + 3) % 30_000).collect();
        let cold = place(&pool, &mc, &prompt);
        let target = *ids.iter().find(|i| **i != cold).expect("another endpoint");

        let hashes: Vec<u64> = (0..256).map(|i| 0xfeed_0000 + i).collect();
        let batch = EventBatch {
            ts: 1.5,
            events: vec![
                KvEvent::plain_stored(hashes.clone(), None, prompt.clone(), 16).on_medium("GPU"),
            ],
            data_parallel_rank: Some(0),
            skipped_unknown: 0,
        };
        let payload = encode_event_batch(&batch, encoding);
        let seq = seq_frame(7);
        let frames: [&[u8]; 3] = [b"kv-events", &seq, &payload];
        let (topic, seq, decoded) =
            decode_message(&frames, &DecodeLimits::default()).expect("decode");
        assert_eq!((topic, seq), (&b"kv-events"[..], 7));
        let keys = IngestKeys {
            hasher: BlockHasher::new(16),
            model: "llama",
        };
        let stats = pool
            .state()
            .apply_batch(&target, keys, &decoded)
            .expect("a precise member");
        assert_eq!(stats.stored_blocks, 256, "{encoding:?}");
        assert_eq!(place(&pool, &mc, &prompt), target, "{encoding:?}");

        let removal = EventBatch {
            ts: 2.0,
            events: vec![KvEvent::BlockRemoved {
                block_hashes: hashes[..1].to_vec(),
                medium: None,
                place: Default::default(),
            }],
            data_parallel_rank: Some(0),
            skipped_unknown: 0,
        };
        let payload = encode_event_batch(&removal, encoding);
        let frames: [&[u8]; 3] = [b"kv-events", &seq_frame(8), &payload];
        let (_, _, decoded) = decode_message(&frames, &DecodeLimits::default()).expect("decode");
        pool.state().apply_batch(&target, keys, &decoded);
        assert_eq!(
            place(&pool, &mc, &prompt),
            cold,
            "{encoding:?}: block 0 gone, no prefix left"
        );
    }
}
