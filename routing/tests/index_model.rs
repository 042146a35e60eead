//! Model-based property test of the KV index: random operation sequences run against the real
//! index and a naive reference model, compared after every step.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr};

use kvroute_routing::endpoint::EndpointId;
use kvroute_routing::index::{IndexMode, KvIndex, PrefixMatch, StoreOutcome};
use proptest::prelude::*;

const PRECISE: u8 = 3; // endpoints 0..3 are precise, 3..5 approximate
const ENDPOINTS: u8 = 5;
const MAX_BLOCKS: usize = 12;
const TTL_MS: u64 = 50;

fn id(n: u8) -> EndpointId {
    EndpointId::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, n)), 8000, 0)
}

fn mode(n: u8) -> IndexMode {
    if n < PRECISE {
        IndexMode::Precise
    } else {
        IndexMode::Approximate { ttl_ms: TTL_MS }
    }
}

#[derive(Debug, Clone)]
enum Op {
    Store(u8, Vec<(u64, u64)>),
    Remove(u8, Vec<u64>),
    Clear(u8),
    RemoveEndpoint(u8),
    AddEndpoint(u8),
    Routed(u8, Vec<u64>),
    Advance(u64),
    Query(Vec<u64>),
}

fn op() -> impl Strategy<Value = Op> {
    // small domains so that blocks collide across endpoints and hashes
    let key = 0u64..16;
    let eh = 0u64..24;
    prop_oneof![
        6 => (0..PRECISE, prop::collection::vec((eh.clone(), key.clone()), 0..6)).prop_map(|(e, b)| Op::Store(e, b)),
        3 => (0..PRECISE, prop::collection::vec(eh, 0..5)).prop_map(|(e, h)| Op::Remove(e, h)),
        1 => (0..ENDPOINTS).prop_map(Op::Clear),
        1 => (0..ENDPOINTS).prop_map(Op::RemoveEndpoint),
        2 => (0..ENDPOINTS).prop_map(Op::AddEndpoint),
        4 => (PRECISE..ENDPOINTS, prop::collection::vec(key.clone(), 0..16)).prop_map(|(e, k)| Op::Routed(e, k)),
        1 => (0u64..40).prop_map(Op::Advance),
        4 => prop::collection::vec(key, 0..8).prop_map(Op::Query),
    ]
}

#[derive(Debug, Default)]
struct ModelEndpoint {
    /// engine hash → (key, extra physical copies the engine reported)
    precise: HashMap<u64, (u64, u32)>,
    /// approximate LRU, least recently used first: (key, touched)
    lru: Vec<(u64, u64)>,
}

impl ModelEndpoint {
    fn holds(&self, key: u64) -> bool {
        self.precise.values().any(|&(k, _)| k == key) || self.lru.iter().any(|&(k, _)| k == key)
    }
    fn len(&self) -> usize {
        self.precise.len() + self.lru.len()
    }
}

#[derive(Debug, Default)]
struct Model {
    endpoints: BTreeMap<u8, ModelEndpoint>,
    now: u64,
}

impl Model {
    fn expire(lru: &mut Vec<(u64, u64)>, now: u64) {
        while lru.first().is_some_and(|&(_, t)| now - t >= TTL_MS) {
            lru.remove(0);
        }
    }

    fn longest_prefix(&self, keys: &[u64]) -> BTreeMap<u8, u32> {
        let mut out = BTreeMap::new();
        for (&n, e) in &self.endpoints {
            let run = keys.iter().take_while(|&&k| e.holds(k)).count() as u32;
            if run > 0 {
                out.insert(n, run);
            }
        }
        out
    }
}

fn real_prefix(ix: &KvIndex, keys: &[u64]) -> BTreeMap<u8, u32> {
    let mut out: Vec<PrefixMatch> = Vec::new();
    ix.longest_prefix(keys, &mut out);
    let mut m = BTreeMap::new();
    for pm in out {
        let id = ix.endpoint_id(pm.slot).expect("slot of a match is live");
        let n = match id.address {
            IpAddr::V4(a) => a.octets()[3],
            IpAddr::V6(_) => unreachable!(),
        };
        assert!(m.insert(n, pm.blocks).is_none(), "endpoint reported twice");
    }
    m
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn index_matches_reference_model(ops in prop::collection::vec(op(), 1..80)) {
        let mut ix = KvIndex::default();
        let mut model = Model::default();
        for n in 0..ENDPOINTS {
            ix.add_endpoint(id(n), mode(n), MAX_BLOCKS).expect("add");
            model.endpoints.insert(n, ModelEndpoint::default());
        }
        let probes: Vec<Vec<u64>> = vec![(0..8).collect(), vec![0, 1], vec![1, 2, 3], vec![5]];
        for op in ops {
            match op {
                Op::Store(n, blocks) => {
                    let Some(slot) = ix.slot(&id(n)) else {
                        prop_assert!(!model.endpoints.contains_key(&n));
                        continue;
                    };
                    let out = ix.store(slot, &blocks).expect("store");
                    let e = model.endpoints.get_mut(&n).expect("tracked");
                    for (eh, k) in blocks {
                        let tracked = e.precise.values().filter(|&&(_, c)| c > 0).count();
                        match e.precise.get_mut(&eh) {
                            // a second copy of a held block (counted up to the budget)
                            Some((key, copies)) if *key == k => {
                                if tracked < MAX_BLOCKS || *copies > 0 {
                                    *copies += 1;
                                }
                            }
                            _ => {
                                e.precise.insert(eh, (k, 0));
                            }
                        }
                    }
                    if e.precise.len() > MAX_BLOCKS {
                        e.precise.clear();
                        prop_assert_eq!(out, StoreOutcome::Overflowed);
                    } else {
                        prop_assert_eq!(out, StoreOutcome::Stored);
                    }
                }
                Op::Remove(n, hashes) => {
                    let removed = ix.slot(&id(n)).map_or(0, |s| ix.remove(s, &hashes));
                    let mut expect = 0;
                    if let Some(e) = model.endpoints.get_mut(&n) {
                        for h in hashes {
                            match e.precise.get_mut(&h) {
                                Some((_, copies)) if *copies > 0 => *copies -= 1,
                                Some(_) => {
                                    e.precise.remove(&h);
                                    expect += 1;
                                }
                                None => {}
                            }
                        }
                    }
                    prop_assert_eq!(removed, expect);
                }
                Op::Clear(n) => {
                    if let Some(s) = ix.slot(&id(n)) {
                        ix.clear_endpoint(s);
                    }
                    if let Some(e) = model.endpoints.get_mut(&n) {
                        *e = ModelEndpoint::default();
                    }
                }
                Op::RemoveEndpoint(n) => {
                    let dropped = ix.remove_endpoint(&id(n));
                    let expect = model.endpoints.remove(&n).map_or(0, |e| e.len());
                    prop_assert_eq!(dropped, expect);
                }
                Op::AddEndpoint(n) => {
                    ix.add_endpoint(id(n), mode(n), MAX_BLOCKS).expect("add");
                    model.endpoints.entry(n).or_default();
                }
                Op::Routed(n, keys) => {
                    if let Some(s) = ix.slot(&id(n)) {
                        ix.record_routed(s, &keys, model.now);
                    }
                    if let Some(e) = model.endpoints.get_mut(&n) {
                        let keep = keys.len().min(MAX_BLOCKS);
                        for &k in keys[..keep].iter().rev() {
                            e.lru.retain(|&(x, _)| x != k);
                            e.lru.push((k, model.now));
                        }
                        while e.lru.len() > MAX_BLOCKS {
                            e.lru.remove(0);
                        }
                        Model::expire(&mut e.lru, model.now);
                    }
                }
                Op::Advance(dt) => {
                    model.now += dt;
                    ix.expire(model.now);
                    for e in model.endpoints.values_mut() {
                        Model::expire(&mut e.lru, model.now);
                    }
                }
                Op::Query(keys) => {
                    prop_assert_eq!(real_prefix(&ix, &keys), model.longest_prefix(&keys));
                }
            }
            // invariants after every step
            for p in &probes {
                prop_assert_eq!(real_prefix(&ix, p), model.longest_prefix(p));
            }
            let live: usize = model.endpoints.values().map(ModelEndpoint::len).sum();
            prop_assert_eq!(ix.live_blocks(), live);
            let mut distinct: Vec<u64> = model
                .endpoints
                .values()
                .flat_map(|e| e.precise.values().map(|&(k, _)| k).chain(e.lru.iter().map(|&(k, _)| k)))
                .collect();
            distinct.sort_unstable();
            distinct.dedup();
            prop_assert_eq!(ix.distinct_blocks(), distinct.len());
            for (&n, e) in &model.endpoints {
                let s = ix.slot(&id(n)).expect("tracked");
                prop_assert_eq!(ix.endpoint_blocks(s), e.len());
            }
        }
    }
}
