//! Session affinity: which endpoint (and rank) a session's blocks live on.

use hashlink::LruCache;
use rustc_hash::FxBuildHasher;
use xxhash_rust::xxh3::xxh3_64;

use crate::endpoint::EndpointId;

/// A bounded LRU from session to endpoint. Keys are hashes of `(tenant, session)` so that two
/// tenants using the same session id never share an entry, and so that memory per entry does
/// not depend on what clients send.
#[derive(Debug)]
pub struct SessionTable {
    map: LruCache<u64, EndpointId, FxBuildHasher>,
}

impl SessionTable {
    /// `capacity` sessions at most (least recently used forgotten first); at least 1.
    pub fn new(capacity: usize) -> Self {
        Self {
            map: LruCache::with_hasher(capacity.max(1), FxBuildHasher),
        }
    }

    pub fn key(tenant: Option<&str>, session: &str) -> u64 {
        let t = tenant.unwrap_or("");
        let mut buf = Vec::with_capacity(t.len() + session.len() + 9);
        buf.extend_from_slice(&(t.len() as u64).to_le_bytes());
        buf.extend_from_slice(t.as_bytes());
        buf.push(0);
        buf.extend_from_slice(session.as_bytes());
        xxh3_64(&buf)
    }

    pub fn get(&mut self, key: u64) -> Option<EndpointId> {
        self.map.get(&key).copied()
    }

    /// The endpoint `key` is pinned to, without touching its place in the LRU order.
    pub fn peek(&self, key: u64) -> Option<EndpointId> {
        self.map.peek(&key).copied()
    }

    pub fn set(&mut self, key: u64, endpoint: EndpointId) {
        self.map.insert(key, endpoint);
    }

    /// Forget every session pinned to an endpoint that left the set.
    pub fn remove_endpoint(&mut self, endpoint: &EndpointId) {
        let stale: Vec<u64> = self
            .map
            .iter()
            .filter(|(_, e)| *e == endpoint)
            .map(|(k, _)| *k)
            .collect();
        for k in stale {
            self.map.remove(&k);
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{IpAddr, Ipv4Addr};

    #[test]
    fn bounded_and_tenant_scoped() {
        let e = |n| EndpointId::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, n)), 1, 0);
        let mut t = SessionTable::new(2);
        let (a, b, c) = (
            SessionTable::key(None, "s1"),
            SessionTable::key(Some("t"), "s1"),
            SessionTable::key(None, "s3"),
        );
        assert_ne!(a, b);
        t.set(a, e(1));
        t.set(b, e(2));
        t.set(c, e(3));
        assert_eq!(t.len(), 2);
        assert_eq!(t.get(a), None, "least recently used evicted");
        assert_eq!(t.get(b), Some(e(2)));
        t.remove_endpoint(&e(2));
        assert_eq!(t.get(b), None);
        assert_eq!(t.get(c), Some(e(3)));
    }
}
