//! The in-flight exchange with the pool's other picker replicas (`peers`).
//!
//! Every `peers.interval` a replica sends each peer, over UDP, its own in-flight counts per
//! endpoint (zeros included, so a drained endpoint goes back to zero at the peers); what it
//! receives from a peer replaces that peer's previous counts and adds to its own in placement
//! ([`crate::inflight::InflightTracker::apply_peer`]). The state is the whole message, not a
//! change, so a lost datagram costs one interval; a peer silent for
//! [`crate::inflight::peer_ttl_ms`] is forgotten.
//!
//! A datagram is JSON: `{"v":1,"group":"ns/pool","replica":ID,"counts":[[ip,port,rank,
//! requests,tokens,pending_requests,pending_tokens,pending_prompt_tokens],...]}`, at most
//! [`ENTRIES_PER_DATAGRAM`] entries (a replica with more endpoints sends several). Only
//! datagrams from a peer's address (its IP) and of this replica's group count; the replica's
//! own (a DNS name that lists every replica lists this one too) are recognised by its random
//! id and skipped.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::net::UdpSocket;
use tokio_util::sync::CancellationToken;

use crate::endpoint::EndpointId;
use crate::inflight::{InflightCounts, peer_ttl_ms};
use crate::service::metrics::KindLabels;
use crate::service::settings::{MAX_PEER_ADDRESSES, PeerSettings};
use crate::service::state::PickerState;

/// Entries per datagram at most (about 4 KB of JSON).
pub const ENTRIES_PER_DATAGRAM: usize = 48;
/// Largest datagram read; longer ones are cut and fail to decode.
const MAX_DATAGRAM: usize = 16 << 10;
const VERSION: u8 = 1;

type Entry = (IpAddr, u16, u32, u64, u64, u64, u64, u64);

#[derive(Debug, Serialize, Deserialize)]
struct Message<'a> {
    v: u8,
    #[serde(borrow)]
    group: &'a str,
    replica: u64,
    counts: Vec<Entry>,
}

/// The datagrams that carry `counts` from `replica` of `group`.
fn encode(group: &str, replica: u64, counts: &[(EndpointId, InflightCounts)]) -> Vec<Vec<u8>> {
    counts
        .chunks(ENTRIES_PER_DATAGRAM)
        .map(|chunk| {
            let m = Message {
                v: VERSION,
                group,
                replica,
                counts: chunk
                    .iter()
                    .map(|(id, c)| {
                        (
                            id.address,
                            id.port,
                            id.rank,
                            c.requests,
                            c.tokens,
                            c.pending_requests,
                            c.pending_tokens,
                            c.pending_prompt_tokens,
                        )
                    })
                    .collect(),
            };
            serde_json::to_vec(&m).unwrap_or_default()
        })
        .collect()
}

/// Why a datagram did not count.
#[derive(Debug, PartialEq, Eq)]
enum Rejected {
    Malformed,
    OtherGroup,
    Own,
}

/// A datagram's sender and counts.
fn decode(
    bytes: &[u8],
    group: &str,
    own: u64,
) -> Result<(u64, Vec<(EndpointId, InflightCounts)>), Rejected> {
    let m: Message<'_> = serde_json::from_slice(bytes).map_err(|_| Rejected::Malformed)?;
    if m.v != VERSION || m.counts.len() > ENTRIES_PER_DATAGRAM {
        return Err(Rejected::Malformed);
    }
    if m.group != group {
        return Err(Rejected::OtherGroup);
    }
    if m.replica == own {
        return Err(Rejected::Own);
    }
    let counts = m
        .counts
        .into_iter()
        .map(|(ip, port, rank, r, t, pr, pt, ppt)| {
            (
                EndpointId::new(ip, port, rank),
                InflightCounts {
                    requests: r,
                    tokens: t,
                    pending_requests: pr,
                    pending_tokens: pt,
                    pending_prompt_tokens: ppt,
                },
            )
        })
        .collect();
    Ok((m.replica, counts))
}

/// The peers' addresses: the listed ones and what the DNS name returns now (the last good
/// answer is kept when a lookup fails).
async fn resolve(settings: &PeerSettings, last: &[SocketAddr]) -> Vec<SocketAddr> {
    let mut out: Vec<SocketAddr> = settings.addresses.clone();
    if let Some(name) = &settings.dns {
        match tokio::time::timeout(Duration::from_secs(2), tokio::net::lookup_host(name)).await {
            Ok(Ok(addrs)) => out.extend(addrs),
            Ok(Err(e)) => {
                tracing::warn!(dns = %name, error = %e, "cannot resolve peers.dns; keeping the last answer");
                out.extend(last.iter().filter(|a| !settings.addresses.contains(a)));
            }
            Err(_) => {
                tracing::warn!(dns = %name, "peers.dns lookup timed out; keeping the last answer");
                out.extend(last.iter().filter(|a| !settings.addresses.contains(a)));
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    out.truncate(MAX_PEER_ADDRESSES);
    out
}

/// Run the exchange on `socket` (bound to `peers.listen`) until `cancel`.
pub async fn run_peers(
    picker: Arc<PickerState>,
    settings: PeerSettings,
    socket: UdpSocket,
    cancel: CancellationToken,
) {
    let replica: u64 = rand::random();
    let ttl = peer_ttl_ms(u64::try_from(settings.interval.as_millis()).unwrap_or(u64::MAX));
    let count = |kind: &str| {
        picker
            .metrics
            .peer_datagrams
            .get_or_create(&KindLabels { kind: kind.into() })
            .inc();
    };
    let mut peers = resolve(&settings, &[]).await;
    let mut peer_ips: HashSet<IpAddr> = peers.iter().map(SocketAddr::ip).collect();
    let mut publish = tokio::time::interval(settings.interval);
    publish.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut refresh = tokio::time::interval(settings.resolve_interval);
    refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    refresh.tick().await;
    let mut buf = vec![0u8; MAX_DATAGRAM];
    tracing::info!(
        replica,
        peers = peers.len(),
        "peer in-flight exchange started"
    );
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = publish.tick() => {
                let inflight = picker.pool.inflight();
                let datagrams = encode(&settings.group, replica, &inflight.own_counts());
                for to in &peers {
                    for d in &datagrams {
                        match socket.send_to(d, to).await {
                            Ok(_) => count("sent"),
                            Err(e) => {
                                count("send_failed");
                                tracing::debug!(peer = %to, error = %e, "peer datagram not sent");
                            }
                        }
                    }
                }
                inflight.expire_peers(picker.now_ms().saturating_sub(ttl));
                picker.metrics.peer_replicas.set(
                    i64::try_from(inflight.peer_count()).unwrap_or(i64::MAX),
                );
            }
            _ = refresh.tick(), if settings.dns.is_some() => {
                peers = resolve(&settings, &peers).await;
                peer_ips = peers.iter().map(SocketAddr::ip).collect();
            }
            got = socket.recv_from(&mut buf) => {
                let Ok((n, from)) = got else { continue };
                if !peer_ips.contains(&from.ip()) {
                    count("unknown_source");
                    continue;
                }
                match decode(&buf[..n], &settings.group, replica) {
                    Ok((peer, counts)) => {
                        count("received");
                        picker.pool.inflight().apply_peer(peer, &counts, picker.now_ms());
                    }
                    Err(Rejected::Own) => {}
                    Err(Rejected::OtherGroup) => count("other_group"),
                    Err(Rejected::Malformed) => count("malformed"),
                }
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn counts(n: u16) -> Vec<(EndpointId, InflightCounts)> {
        (0..n)
            .map(|p| {
                (
                    EndpointId::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)), 8000 + p, 1),
                    InflightCounts {
                        requests: u64::from(p),
                        tokens: 1000,
                        pending_requests: 1,
                        pending_tokens: 600,
                        pending_prompt_tokens: 1000,
                    },
                )
            })
            .collect()
    }

    #[test]
    fn counts_round_trip_in_datagrams_of_bounded_size() {
        let c = counts(100);
        let datagrams = encode("ns/pool", 7, &c);
        assert_eq!(datagrams.len(), 3, "48 + 48 + 4 entries");
        let mut back = Vec::new();
        for d in &datagrams {
            assert!(d.len() < MAX_DATAGRAM, "{}", d.len());
            let (peer, part) = decode(d, "ns/pool", 9).expect("decodes");
            assert_eq!(peer, 7);
            back.extend(part);
        }
        assert_eq!(back, c);
    }

    #[test]
    fn foreign_own_and_malformed_datagrams_do_not_count() {
        let d = encode("ns/pool", 7, &counts(2)).remove(0);
        assert_eq!(decode(&d, "ns/other", 9), Err(Rejected::OtherGroup));
        assert_eq!(decode(&d, "ns/pool", 7), Err(Rejected::Own));
        for bad in [
            &b"not json"[..],
            br#"{"v":2,"group":"ns/pool","replica":1,"counts":[]}"#,
            br#"{"v":1,"group":"ns/pool","replica":1,"counts":[["10.0.0.1",1,0,1,1,1,1]]}"#,
            br#"{"v":1,"group":"ns/pool","replica":1,"counts":[["10.0.0.1",1,0,-1,1,1,1,1]]}"#,
        ] {
            assert_eq!(decode(bad, "ns/pool", 9), Err(Rejected::Malformed));
        }
        let too_many = encode("ns/pool", 1, &counts(49)).remove(0);
        // a sender may not pack more than the bound into one datagram
        let mut m: serde_json::Value = serde_json::from_slice(&too_many).unwrap();
        let extra = m["counts"][0].clone();
        m["counts"].as_array_mut().unwrap().push(extra);
        let bytes = serde_json::to_vec(&m).unwrap();
        assert_eq!(decode(&bytes, "ns/pool", 9), Err(Rejected::Malformed));
    }
}
