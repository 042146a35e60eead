//! Property test of the pool's two steps (`place::Pool`): over random pools (members precise
//! or approximate, cached prefixes, loads, in-flight requests, pinned sessions, ejections,
//! learned costs, every strategy) and random requests (documents, sessions, tenants, gateway
//! subsets, explanations), `place` changes nothing a later decision could see — the index,
//! the loads, the in-flight counts, the pins and working sets, the turn, calibration,
//! ejections — and asking
//! twice gives the same answer; `record` and `served` then change exactly what they commit.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;

use kvroute_routing::block_keys::{BlockHasher, BlockKey, ChainRoot};
use kvroute_routing::calibration::TtftBasis;
use kvroute_routing::config::{RoutingConfig, Strategy as Policy};
use kvroute_routing::endpoint::{Endpoint, EndpointId, ModelConfig};
use kvroute_routing::index::PrefixMatch;
use kvroute_routing::inflight::InflightGuard;
use kvroute_routing::kv_events::ingest::IngestKeys;
use kvroute_routing::kv_events::{EventBatch, KvEvent};
use kvroute_routing::load::EndpointLoad;
use kvroute_routing::outlier::Outcome;
use kvroute_routing::place::{Placement, Pool, PoolSettings};
use kvroute_routing::pool_state::PoolMember;
use kvroute_routing::router::{RouteRequest, Router};
use proptest::prelude::*;

const BLOCK_SIZE: u32 = 4;
const BLOCKS: u32 = 8;
const DOCS: u8 = 3;
const MODEL: &str = "m";
const SESSIONS: [&str; 3] = ["a", "b", "c"];
const TENANTS: [Option<&str>; 2] = [None, Some("t")];

fn id(n: u8) -> EndpointId {
    EndpointId::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, n)), 8000, 0)
}

fn tokens(d: u8, blocks: u32) -> Vec<u32> {
    (0..blocks * BLOCK_SIZE)
        .map(|t| 1000 * (u32::from(d) + 1) + t)
        .collect()
}

fn doc_keys(d: u8) -> Vec<BlockKey> {
    BlockHasher::new(BLOCK_SIZE).keys(ChainRoot::new(MODEL, None, None), &tokens(d, BLOCKS))
}

#[derive(Debug, Clone)]
struct Member {
    precise: bool,
    /// Leading blocks of each document cached there.
    cached: [u32; DOCS as usize],
    waiting: u8,
    running: u8,
    inflight: u8,
    /// 5xx answers in a row (five eject it).
    failures: u8,
    /// TTFT observations that teach calibration (ms each).
    ttft_ms: Vec<u16>,
}

fn member() -> impl Strategy<Value = Member> {
    (
        any::<bool>(),
        prop::array::uniform3(0..=BLOCKS),
        0u8..6,
        0u8..6,
        0u8..4,
        prop_oneof![Just(0u8), 0u8..7],
        prop::collection::vec(1u16..4000, 0..12),
    )
        .prop_map(
            |(precise, cached, waiting, running, inflight, failures, ttft_ms)| Member {
                precise,
                cached,
                waiting,
                running,
                inflight,
                failures,
                ttft_ms,
            },
        )
}

#[derive(Debug, Clone)]
struct Request {
    doc: u8,
    blocks: u32,
    session: Option<usize>,
    tenant: usize,
    /// Members the gateway offers (bit i: member i); `None`: every one.
    subset: Option<u8>,
    explain: bool,
}

fn request() -> impl Strategy<Value = Request> {
    (
        0..DOCS,
        0..=BLOCKS,
        prop::option::of(0..SESSIONS.len()),
        0..TENANTS.len(),
        prop::option::of(any::<u8>()),
        any::<bool>(),
    )
        .prop_map(|(doc, blocks, session, tenant, subset, explain)| Request {
            doc,
            blocks,
            session,
            tenant,
            subset,
            explain,
        })
}

fn policy() -> impl Strategy<Value = Policy> {
    prop_oneof![
        Just(Policy::CostModel),
        Just(Policy::Weighted),
        Just(Policy::KvCost),
        Just(Policy::CacheAware),
        Just(Policy::LeastLoad),
        Just(Policy::RoundRobin),
        Just(Policy::Random),
    ]
}

/// The pool built from `members`; the guards keep its in-flight requests open.
fn build(
    members: &[Member],
    strategy: Policy,
    balance: bool,
    pins: &[(usize, usize, u8)],
    mc: &Arc<ModelConfig>,
) -> (Pool, Vec<InflightGuard>) {
    let mut routing = RoutingConfig {
        strategy,
        ..RoutingConfig::default()
    };
    // cache balance's working sets and session admission's gate are read too
    if balance {
        routing.cost_model.displacement_weight = 4.0;
        routing.admission.enabled = true;
    }
    let pool = Pool::new(PoolSettings::default(), Router::new(routing));
    let view = members
        .iter()
        .enumerate()
        .map(|(i, m)| PoolMember {
            endpoint: Endpoint::new(id(i as u8 + 1), mc.clone()),
            precise: m.precise,
            kv_capacity_blocks: Some(1000),
        })
        .collect();
    pool.apply_view(view, || {}).expect("view");
    let keys = IngestKeys {
        hasher: BlockHasher::new(BLOCK_SIZE),
        model: MODEL,
    };
    let mut guards = Vec::new();
    for (i, m) in members.iter().enumerate() {
        let e = id(i as u8 + 1);
        for d in 0..DOCS {
            let blocks = m.cached[d as usize];
            if blocks == 0 {
                continue;
            }
            if m.precise {
                let batch = EventBatch {
                    ts: 0.0,
                    events: vec![KvEvent::plain_stored(
                        (0..u64::from(blocks))
                            .map(|b| 1 + u64::from(d) * 64 + b)
                            .collect(),
                        None,
                        tokens(d, blocks),
                        BLOCK_SIZE,
                    )],
                    data_parallel_rank: Some(0),
                    skipped_unknown: 0,
                };
                pool.state().apply_batch(&e, keys, &batch);
            } else {
                pool.state()
                    .record_routed(&e, &doc_keys(d)[..blocks as usize], 0);
            }
        }
        for _ in 0..m.inflight {
            guards.push(pool.begin(e, 64, 32, true));
        }
        for _ in 0..m.failures {
            pool.outliers().lock().on_result(e, Outcome::ServerError, 0);
        }
        let mut calibration = pool.calibration().write();
        for &ms in &m.ttft_ms {
            let basis = TtftBasis {
                work_tokens: 512.0,
                decode_ms: f64::from(m.running),
            };
            calibration.observe_ttft(&e, basis, f64::from(ms));
        }
    }
    pool.state()
        .learn_loads(members.iter().enumerate().map(|(i, m)| {
            (
                id(i as u8 + 1),
                EndpointLoad {
                    waiting: f64::from(m.waiting),
                    running: f64::from(m.running),
                    kv_usage: 0.5,
                    kv_capacity_blocks: Some(1000),
                    sampled_at_ms: 0,
                    lora: None,
                },
            )
        }));
    for &(s, t, m) in pins {
        if let Some(key) = Router::session_key(TENANTS[t], Some(SESSIONS[s])) {
            pool.pin(key, id(m % members.len() as u8 + 1), 64, 1);
        }
    }
    (pool, guards)
}

/// Everything a later decision could read from the pool.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    turn: u64,
    matches: Vec<Vec<PrefixMatch>>,
    blocks: Vec<usize>,
    loads: Vec<Option<EndpointLoad>>,
    inflight: Vec<String>,
    pins: Vec<Option<EndpointId>>,
    calibration: BTreeMap<EndpointId, String>,
    ejected: Vec<EndpointId>,
    working_sets: BTreeMap<EndpointId, u64>,
    horizon_ms: u64,
    /// Session admission's queue: turns waiting, tokens reserved.
    admission: (usize, u64),
}

fn seen(pool: &Pool, n: usize) -> Seen {
    let read = pool.state().read();
    let mut matches = Vec::new();
    for d in 0..DOCS {
        let mut out = Vec::new();
        read.index().longest_prefix(&doc_keys(d), &mut out);
        matches.push(out);
    }
    let ids: Vec<EndpointId> = (1..=n as u8).map(id).collect();
    Seen {
        turn: pool.turn(),
        matches,
        blocks: ids
            .iter()
            .map(|e| {
                read.index()
                    .slot(e)
                    .map_or(0, |s| read.index().endpoint_blocks(s))
            })
            .collect(),
        loads: ids.iter().map(|e| read.loads().get(e).copied()).collect(),
        inflight: ids
            .iter()
            .map(|e| format!("{:?}", pool.inflight().get(e)))
            .collect(),
        pins: TENANTS
            .iter()
            .flat_map(|t| SESSIONS.iter().map(move |s| (t, s)))
            .map(|(t, s)| Router::session_key(*t, Some(s)).and_then(|k| pool.pinned(k)))
            .collect(),
        calibration: pool
            .calibration()
            .read()
            .statuses()
            .map(|(e, s)| (e, format!("{s:?}")))
            .collect(),
        ejected: pool.outliers().lock().ejected(0),
        working_sets: pool.working_sets(10).into_iter().collect(),
        horizon_ms: pool.reuse_horizon_ms(),
        admission: {
            let w = pool.waiting().lock();
            (w.len(), w.reserved(0))
        },
    }
}

fn place(pool: &Pool, mc: &ModelConfig, r: &Request, n: usize) -> (Vec<BlockKey>, Placement) {
    let keys = doc_keys(r.doc)[..r.blocks as usize].to_vec();
    let subset: Option<Vec<SocketAddr>> = r.subset.map(|bits| {
        (0..n)
            .filter(|i| bits & (1 << i) != 0)
            .map(|i| SocketAddr::new(id(i as u8 + 1).address, 8000))
            .collect()
    });
    let req = RouteRequest {
        session: r.session.map(|s| SESSIONS[s]),
        tenant: TENANTS[r.tenant],
        subset: subset.as_deref(),
        fallback_hash: u64::from(r.doc),
        stage: kvroute_routing::router::Stage::Whole,
        explain: r.explain,
        ..RouteRequest::whole(mc, &keys, r.blocks * BLOCK_SIZE + 1)
    };
    let _ = pool.gate(&req, 0);
    let placement = pool.place(&req, 0);
    (keys, placement.unwrap_or_else(|e| panic!("{e}")))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn placing_changes_nothing_and_recording_commits_exactly_the_placement(
        members in prop::collection::vec(member(), 1..6),
        strategy in policy(),
        balance in any::<bool>(),
        pins in prop::collection::vec((0..SESSIONS.len(), 0..TENANTS.len(), any::<u8>()), 0..5),
        requests in prop::collection::vec(request(), 1..8),
    ) {
        let mc = Arc::new(ModelConfig::new("c", MODEL));
        let n = members.len();
        let (pool, _guards) = build(&members, strategy, balance, &pins, &mc);
        for r in &requests {
            // a subset naming no member has nothing to place on
            if r.subset.is_some_and(|bits| (0..n).all(|i| bits & (1 << i) == 0)) {
                continue;
            }
            let before = seen(&pool, n);
            let (keys, first) = place(&pool, &mc, r, n);
            prop_assert_eq!(&seen(&pool, n), &before, "place changed the pool");
            let (_, again) = place(&pool, &mc, r, n);
            prop_assert_eq!(&again, &first, "the same question, another answer");
            if r.explain {
                continue;
            }
            pool.record(&first, &keys, 0);
            let served = first.decision.fallbacks.first().copied().unwrap_or(first.decision.endpoint);
            pool.settle(first.session_key, u64::from(first.prompt_tokens), served, None, 2);
            let after = seen(&pool, n);
            prop_assert_eq!(after.turn, before.turn + 1, "a recorded placement takes one turn");
            if let Some(key) = first.session_key {
                prop_assert_eq!(pool.pinned(key), Some(served), "pinned where served");
                prop_assert!(
                    after.working_sets.get(&served).copied().unwrap_or(0) >= u64::from(first.prompt_tokens),
                    "the served endpoint's working set holds the session's prompt"
                );
            }
            let chosen = usize::from(match first.decision.endpoint.address {
                IpAddr::V4(a) => a.octets()[3],
                IpAddr::V6(_) => unreachable!(),
            }) - 1;
            if !members[chosen].precise && !keys.is_empty() {
                let mut out = Vec::new();
                pool.state().read().index().longest_prefix(&keys, &mut out);
                let slot = pool.state().read().index().slot(&first.decision.endpoint);
                prop_assert!(
                    out.iter().any(|m| Some(m.slot) == slot && m.blocks as usize == keys.len()),
                    "an approximate endpoint is credited with the prompt it was sent"
                );
            } else {
                prop_assert_eq!(&after.matches, &before.matches, "a precise index learns only from events");
            }
            prop_assert_eq!(&after.inflight, &before.inflight, "in-flight counts begin at send");
        }
    }
}
