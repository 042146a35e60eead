//! The in-flight exchange with the pool's other picker replicas (`peers`).
//!
//! Every `peers.interval` a replica sends each peer, over UDP, its own in-flight counts per
//! endpoint (zeros included, so a drained endpoint goes back to zero at the peers); what it
//! receives from a peer replaces that peer's previous counts and adds to its own in placement
//! ([`crate::inflight::InflightTracker::apply_peer`]). The state is the whole message, not a
//! change, so a lost datagram costs one interval; a peer silent for
//! [`crate::inflight::peer_ttl_ms`] is forgotten.
//!
//! A datagram is JSON: `{"v":1,"group":"ns/pool","replica":ID,"seq":N,"ts":MS,"counts":[[ip,
//! port,rank,requests,tokens,pending_requests,pending_tokens,pending_prompt_tokens],...]}`, at
//! most [`ENTRIES_PER_DATAGRAM`] entries (a replica with more endpoints sends several). With
//! `peers.keyFile` (the operator renders one key into every picker of a pool) the JSON is
//! preceded by its HMAC-SHA256 under the key (32 bytes), and a datagram counts only when the
//! tag is right, its `ts` (the sender's clock, ms since the epoch) is within the peer TTL of
//! this replica's clock, and its `seq` is past the last one heard from that replica (a
//! captured datagram cannot be sent again). Whatever the key, a datagram counts only from a
//! peer's exact address (IP and port: peers send from the port they listen on), of this
//! replica's group, and its counts are clamped to what one replica could hold on an endpoint
//! ([`crate::inflight::PeerBound`]). The replica's own datagrams (a DNS name that lists every
//! replica lists this one too) are recognised by its random id and skipped.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use tokio::net::UdpSocket;
use tokio_util::sync::CancellationToken;

use crate::endpoint::EndpointId;
use crate::inflight::{InflightCounts, MAX_PEERS, PeerBound, peer_ttl_ms};
use crate::service::metrics::KindLabels;
use crate::service::settings::{MAX_PEER_ADDRESSES, PeerSettings};
use crate::service::state::PickerState;
use crate::session::{SessionNews, SharedTurn};

/// Entries per datagram at most (about 4 KB of JSON).
pub const ENTRIES_PER_DATAGRAM: usize = 48;
/// Largest datagram read; longer ones are cut and fail to decode.
const MAX_DATAGRAM: usize = 16 << 10;
const VERSION: u8 = 1;
/// Bytes of the HMAC-SHA256 tag in front of a keyed datagram.
const TAG: usize = 32;
/// Clock difference between two replicas' nodes tolerated on top of the peer TTL.
const CLOCK_SKEW_MS: u64 = 2_000;

type Entry = (IpAddr, u16, u32, u64, u64, u64, u64, u64);
/// A served session turn: `(key, ip, port, rank, tokens, age_ms)`.
type SessionEntry = (u64, IpAddr, u16, u32, u64, u64);

/// Session turns per datagram at most (about 4 KB of JSON).
pub const SESSIONS_PER_DATAGRAM: usize = 64;

#[derive(Debug, Serialize, Deserialize)]
struct Message<'a> {
    v: u8,
    #[serde(borrow)]
    group: &'a str,
    replica: u64,
    /// The sender's datagram number (one more for each datagram it sends).
    #[serde(default)]
    seq: u64,
    /// The sender's clock when it sent the datagram, ms since the Unix epoch.
    #[serde(default)]
    ts: u64,
    counts: Vec<Entry>,
    /// Turns the sender served since its last datagrams.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    sessions: Vec<SessionEntry>,
    /// Tokens its session admission reserved for turns admitted and not yet served.
    #[serde(default)]
    reserved: u64,
    /// How long the first turn in its admission line has waited (ms), when one waits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    first_waiting_ms: Option<u64>,
}

/// What one peer datagram says.
#[derive(Debug, Default, PartialEq)]
struct Said {
    counts: Vec<(EndpointId, InflightCounts)>,
    sessions: SessionNews,
}

/// The pool's shared key (`peers.keyFile`), or none.
#[derive(Clone, Default)]
pub struct PeerKey(Option<Vec<u8>>);

impl std::fmt::Debug for PeerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("PeerKey")
            .field(&self.0.as_ref().map(Vec::len))
            .finish()
    }
}

impl PeerKey {
    /// Read `peers.keyFile` (at least 16 bytes once surrounding whitespace is trimmed).
    pub fn load(settings: &PeerSettings) -> Result<Self, crate::error::PickerError> {
        let Some(p) = &settings.key_file else {
            return Ok(Self(None));
        };
        let s = std::fs::read(p)
            .map_err(|e| crate::error::PickerError::read_file("peers.keyFile", p, e))?;
        let key = s.trim_ascii().to_vec();
        if key.len() < 16 {
            return Err(crate::error::PickerError::Invalid(format!(
                "peers.keyFile {p}: the key must be at least 16 bytes"
            )));
        }
        Ok(Self(Some(key)))
    }

    /// The key's bytes, when there is one.
    pub fn bytes(&self) -> Option<&[u8]> {
        self.0.as_deref()
    }

    #[cfg(test)]
    fn of(key: &[u8]) -> Self {
        Self(Some(key.to_vec()))
    }

    fn mac(key: &[u8]) -> Hmac<Sha256> {
        // HMAC takes a key of any length
        <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable!())
    }

    /// `json` as it goes on the wire: behind its tag when keyed.
    fn seal(&self, json: Vec<u8>) -> Vec<u8> {
        let Some(key) = &self.0 else { return json };
        let mut mac = Self::mac(key);
        mac.update(&json);
        let mut out = mac.finalize().into_bytes().to_vec();
        out.extend_from_slice(&json);
        out
    }

    /// The JSON of a datagram whose tag is right (all of it when unkeyed).
    fn open<'a>(&self, bytes: &'a [u8]) -> Result<&'a [u8], Rejected> {
        let Some(key) = &self.0 else { return Ok(bytes) };
        if bytes.len() < TAG {
            return Err(Rejected::Unauthenticated);
        }
        let (tag, json) = bytes.split_at(TAG);
        let mut mac = Self::mac(key);
        mac.update(json);
        mac.verify_slice(tag)
            .map_err(|_| Rejected::Unauthenticated)?;
        Ok(json)
    }

    fn is_set(&self) -> bool {
        self.0.is_some()
    }
}

/// What a replica knows of its own sending: its id and the next datagram number.
#[derive(Debug)]
struct Sender {
    replica: u64,
    seq: u64,
}

/// The last datagram number heard from each replica (a keyed datagram must be past it), at
/// most [`MAX_PEERS`] × 4 replicas, the least recently heard forgotten first.
#[derive(Debug, Default)]
struct Heard {
    last: HashMap<u64, (u64, u64)>,
}

impl Heard {
    /// Whether `seq` of `replica` is new; records it when it is.
    fn fresh(&mut self, replica: u64, seq: u64, now_ms: u64) -> bool {
        if let Some(&(last, _)) = self.last.get(&replica)
            && seq <= last
        {
            return false;
        }
        if !self.last.contains_key(&replica)
            && self.last.len() >= MAX_PEERS * 4
            && let Some((&old, _)) = self.last.iter().min_by_key(|(_, (_, at))| *at)
        {
            self.last.remove(&old);
        }
        self.last.insert(replica, (seq, now_ms));
        true
    }
}

/// The datagrams that carry `said` from `sender` of `group` at `ts` (ms since the epoch):
/// the counts, then the session turns, in as many datagrams as they need; each says what the
/// sender reserved.
fn encode(group: &str, sender: &mut Sender, ts: u64, key: &PeerKey, said: &Said) -> Vec<Vec<u8>> {
    let counts = said.counts.chunks(ENTRIES_PER_DATAGRAM).map(|chunk| {
        let entries = chunk
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
            .collect();
        (entries, Vec::new())
    });
    let turns = said
        .sessions
        .turns
        .chunks(SESSIONS_PER_DATAGRAM)
        .map(|chunk| {
            let entries = chunk
                .iter()
                .map(|t| {
                    let e = t.endpoint;
                    (t.key, e.address, e.port, e.rank, t.tokens, t.age_ms)
                })
                .collect();
            (Vec::new(), entries)
        });
    counts
        .chain(turns)
        .map(|(counts, sessions)| {
            sender.seq += 1;
            let m = Message {
                v: VERSION,
                group,
                replica: sender.replica,
                seq: sender.seq,
                ts,
                counts,
                sessions,
                reserved: said.sessions.reserved,
                first_waiting_ms: said.sessions.first_waiting_ms,
            };
            key.seal(serde_json::to_vec(&m).unwrap_or_default())
        })
        .collect()
}

/// Why a datagram did not count.
#[derive(Debug, PartialEq, Eq)]
enum Rejected {
    Malformed,
    OtherGroup,
    Own,
    /// Keyed: no tag, or not this pool's key.
    Unauthenticated,
    /// Keyed: sent too long ago (or in the future), or a number already heard.
    Stale,
}

impl Rejected {
    fn kind(&self) -> &'static str {
        match self {
            Rejected::Malformed => "malformed",
            Rejected::OtherGroup => "other_group",
            Rejected::Own => "own",
            Rejected::Unauthenticated => "unauthenticated",
            Rejected::Stale => "stale",
        }
    }
}

/// What a receiver checks a datagram against.
struct Receiver<'a> {
    group: &'a str,
    own: u64,
    key: &'a PeerKey,
    /// How far the sender's `ts` may be from this replica's clock (keyed only).
    window_ms: u64,
}

impl Receiver<'_> {
    /// A datagram's sender and what it says, checked; `now_ms` is this replica's clock (ms
    /// since the epoch).
    fn decode(
        &self,
        bytes: &[u8],
        heard: &mut Heard,
        now_ms: u64,
    ) -> Result<(u64, Said), Rejected> {
        let json = self.key.open(bytes)?;
        let m: Message<'_> = serde_json::from_slice(json).map_err(|_| Rejected::Malformed)?;
        if m.v != VERSION
            || m.counts.len() > ENTRIES_PER_DATAGRAM
            || m.sessions.len() > SESSIONS_PER_DATAGRAM
        {
            return Err(Rejected::Malformed);
        }
        if m.group != self.group {
            return Err(Rejected::OtherGroup);
        }
        if m.replica == self.own {
            return Err(Rejected::Own);
        }
        if self.key.is_set()
            && (m.ts.abs_diff(now_ms) > self.window_ms || !heard.fresh(m.replica, m.seq, now_ms))
        {
            return Err(Rejected::Stale);
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
        let turns = m
            .sessions
            .into_iter()
            .map(|(key, ip, port, rank, tokens, age_ms)| SharedTurn {
                key,
                endpoint: EndpointId::new(ip, port, rank),
                tokens,
                age_ms,
            })
            .collect();
        Ok((
            m.replica,
            Said {
                counts,
                sessions: SessionNews {
                    turns,
                    reserved: m.reserved,
                    first_waiting_ms: m.first_waiting_ms,
                },
            },
        ))
    }
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The peers' addresses: the listed ones and what the DNS name returns now (the last good
/// answer is kept when a lookup fails).
pub(crate) async fn resolve(settings: &PeerSettings, last: &[SocketAddr]) -> Vec<SocketAddr> {
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

/// Run the exchange on `socket` (bound to `peers.listen`) until `cancel`; `key` is the pool's
/// (`peers.keyFile`) and `bound` what one replica may claim per endpoint.
pub async fn run_peers(
    picker: Arc<PickerState>,
    settings: PeerSettings,
    key: PeerKey,
    bound: PeerBound,
    socket: UdpSocket,
    cancel: CancellationToken,
) {
    let mut sender = Sender {
        replica: rand::random(),
        seq: 0,
    };
    let ttl = peer_ttl_ms(u64::try_from(settings.interval.as_millis()).unwrap_or(u64::MAX));
    let replica = sender.replica;
    let receiver = Receiver {
        group: &settings.group,
        own: replica,
        key: &key,
        window_ms: ttl + CLOCK_SKEW_MS,
    };
    let mut heard = Heard::default();
    // a session live at one replica is live at all
    picker.pool.share_sessions();
    let count = |kind: &str| {
        picker
            .metrics
            .peer_datagrams
            .get_or_create(&KindLabels { kind: kind.into() })
            .inc();
    };
    let mut peers = resolve(&settings, &[]).await;
    let mut peer_addrs: HashSet<SocketAddr> = peers.iter().copied().collect();
    let mut publish = tokio::time::interval(settings.interval);
    publish.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut refresh = tokio::time::interval(settings.resolve_interval);
    refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    refresh.tick().await;
    let mut buf = vec![0u8; MAX_DATAGRAM];
    if !key.is_set() {
        tracing::warn!(
            "peers.keyFile is not set: peer datagrams are trusted on their source address alone"
        );
    }
    tracing::info!(
        replica,
        peers = peers.len(),
        keyed = key.is_set(),
        "peer in-flight exchange started"
    );
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = publish.tick() => {
                let inflight = picker.pool.inflight();
                let said = Said {
                    counts: inflight.own_counts(),
                    sessions: picker.pool.take_shared(picker.now_ms()),
                };
                let datagrams = encode(&settings.group, &mut sender, unix_ms(), &key, &said);
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
                picker.pool.expire_peers(picker.now_ms().saturating_sub(ttl));
                picker.metrics.peer_replicas.set(
                    i64::try_from(inflight.peer_count()).unwrap_or(i64::MAX),
                );
            }
            _ = refresh.tick(), if settings.dns.is_some() => {
                peers = resolve(&settings, &peers).await;
                peer_addrs = peers.iter().copied().collect();
            }
            got = socket.recv_from(&mut buf) => {
                let Ok((n, from)) = got else { continue };
                // peers send from the port they listen on: any other port is not a peer
                if !peer_addrs.contains(&from) {
                    count("unknown_source");
                    continue;
                }
                match receiver.decode(&buf[..n], &mut heard, unix_ms()) {
                    Ok((peer, said)) => {
                        let now = picker.now_ms();
                        let applied = picker
                            .pool
                            .inflight()
                            .apply_peer(peer, &said.counts, now, bound);
                        picker.pool.apply_shared(peer, &said.sessions, now);
                        // the room, or who is first in admission's line, may have changed
                        picker.waiters.poke();
                        let refused = applied == 0 && !said.counts.is_empty();
                        count(if refused { "refused" } else { "received" });
                    }
                    Err(Rejected::Own) => {}
                    Err(e) => count(e.kind()),
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

    fn counts(n: u16) -> Said {
        let counts = (0..n)
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
            .collect();
        Said {
            counts,
            ..Said::default()
        }
    }

    fn sender(replica: u64) -> Sender {
        Sender { replica, seq: 0 }
    }

    fn receiver<'a>(own: u64, key: &'a PeerKey) -> Receiver<'a> {
        Receiver {
            group: "ns/pool",
            own,
            key,
            window_ms: 2_500,
        }
    }

    #[test]
    fn counts_and_session_turns_round_trip_in_datagrams_of_bounded_size() {
        for key in [
            PeerKey::default(),
            PeerKey::of(b"0123456789abcdef-pool-key"),
        ] {
            let mut said = counts(100);
            said.sessions.turns = (0..70u64)
                .map(|i| SharedTurn {
                    key: u64::MAX - i,
                    endpoint: said.counts[i as usize % 3].0,
                    tokens: 90_000 + i,
                    age_ms: i,
                })
                .collect();
            said.sessions.reserved = 12_345;
            said.sessions.first_waiting_ms = Some(250);
            let datagrams = encode("ns/pool", &mut sender(7), 10_000, &key, &said);
            assert_eq!(datagrams.len(), 5, "48 + 48 + 4 entries, then 64 + 6 turns");
            let mut back = Said::default();
            let mut heard = Heard::default();
            for d in &datagrams {
                assert!(d.len() < MAX_DATAGRAM, "{}", d.len());
                let (peer, part) = receiver(9, &key)
                    .decode(d, &mut heard, 10_100)
                    .expect("decodes");
                assert_eq!(peer, 7);
                assert_eq!(part.sessions.reserved, 12_345, "every datagram says it");
                assert_eq!(part.sessions.first_waiting_ms, Some(250));
                back.counts.extend(part.counts);
                back.sessions.turns.extend(part.sessions.turns);
                back.sessions.reserved = part.sessions.reserved;
                back.sessions.first_waiting_ms = part.sessions.first_waiting_ms;
            }
            assert_eq!(back, said);
        }
    }

    #[test]
    fn a_keyed_exchange_refuses_forged_replayed_and_old_datagrams() {
        let key = PeerKey::of(b"0123456789abcdef-pool-key");
        let other = PeerKey::of(b"another-pool-key-0123456789");
        let r = receiver(9, &key);
        let mut heard = Heard::default();
        let mut s7 = sender(7);
        let good = encode("ns/pool", &mut s7, 10_000, &key, &counts(2)).remove(0);
        // no tag (an unkeyed sender, or a forger without the key), or another key's tag
        let plain = encode(
            "ns/pool",
            &mut sender(8),
            10_000,
            &PeerKey::default(),
            &counts(2),
        );
        assert_eq!(
            r.decode(&plain[0], &mut heard, 10_000),
            Err(Rejected::Unauthenticated)
        );
        let foreign = encode("ns/pool", &mut sender(8), 10_000, &other, &counts(2));
        assert_eq!(
            r.decode(&foreign[0], &mut heard, 10_000),
            Err(Rejected::Unauthenticated)
        );
        // a tag over other bytes: one count changed after sealing
        let mut tampered = good.clone();
        let at = tampered.len() - 3;
        tampered[at] = if tampered[at] == b'1' { b'2' } else { b'1' };
        assert_eq!(
            r.decode(&tampered, &mut heard, 10_000),
            Err(Rejected::Unauthenticated)
        );
        assert_eq!(
            r.decode(&[1, 2, 3], &mut heard, 10_000),
            Err(Rejected::Unauthenticated)
        );
        // the real one counts once; sent again, it is refused
        assert!(r.decode(&good, &mut heard, 10_050).is_ok());
        assert_eq!(r.decode(&good, &mut heard, 10_060), Err(Rejected::Stale));
        // a later one counts; one sent long ago (or far ahead of this clock) does not
        let next = encode("ns/pool", &mut s7, 10_020, &key, &counts(2)).remove(0);
        assert!(r.decode(&next, &mut heard, 10_070).is_ok());
        let old = encode("ns/pool", &mut s7, 1_000, &key, &counts(2)).remove(0);
        assert_eq!(r.decode(&old, &mut heard, 10_080), Err(Rejected::Stale));
        let ahead = encode("ns/pool", &mut s7, 20_000, &key, &counts(2)).remove(0);
        assert_eq!(r.decode(&ahead, &mut heard, 10_080), Err(Rejected::Stale));
    }

    #[test]
    fn replicas_heard_are_bounded() {
        let mut heard = Heard::default();
        for r in 0..(MAX_PEERS as u64 * 4 + 10) {
            assert!(heard.fresh(r, 1, r));
        }
        assert_eq!(heard.last.len(), MAX_PEERS * 4);
        // the most recently heard are kept
        assert!(!heard.fresh(MAX_PEERS as u64 * 4 + 9, 1, 10_000));
    }

    #[test]
    fn foreign_own_and_malformed_datagrams_do_not_count() {
        let none = PeerKey::default();
        let mut heard = Heard::default();
        let d = encode("ns/pool", &mut sender(7), 0, &none, &counts(2)).remove(0);
        let other_group = Receiver {
            group: "ns/other",
            ..receiver(9, &none)
        };
        assert_eq!(
            other_group.decode(&d, &mut heard, 0),
            Err(Rejected::OtherGroup)
        );
        assert_eq!(
            receiver(7, &none).decode(&d, &mut heard, 0),
            Err(Rejected::Own)
        );
        for bad in [
            &b"not json"[..],
            br#"{"v":2,"group":"ns/pool","replica":1,"counts":[]}"#,
            br#"{"v":1,"group":"ns/pool","replica":1,"counts":[["10.0.0.1",1,0,1,1,1,1]]}"#,
            br#"{"v":1,"group":"ns/pool","replica":1,"counts":[["10.0.0.1",1,0,-1,1,1,1,1]]}"#,
        ] {
            assert_eq!(
                receiver(9, &none).decode(bad, &mut heard, 0),
                Err(Rejected::Malformed)
            );
        }
        let too_many = encode("ns/pool", &mut sender(1), 0, &none, &counts(49)).remove(0);
        // a sender may not pack more than the bound into one datagram
        let mut m: serde_json::Value = serde_json::from_slice(&too_many).unwrap();
        let extra = m["counts"][0].clone();
        m["counts"].as_array_mut().unwrap().push(extra);
        let bytes = serde_json::to_vec(&m).unwrap();
        assert_eq!(
            receiver(9, &none).decode(&bytes, &mut heard, 0),
            Err(Rejected::Malformed)
        );
    }
}
