//! The index copy's bytes: what a picker writes to its snapshot file and serves to a peer.
//!
//! ```text
//! magic "KVRINDEX" | version u16 | flags u16 | header length u32 | blocks length u64 |
//! tag (32 bytes) | header (JSON) | blocks (per endpoint, in header order: engine hash u64,
//! chain key u64, little-endian)
//! ```
//!
//! The tag covers everything after it: SHA-256, or HMAC-SHA256 under the pool's peer key
//! (`peers.keyFile`, flag bit 0) when there is one. A reader with a key refuses an untagged
//! copy, and every reader refuses a copy that is torn (shorter or longer than its lengths
//! say), of another version, larger than its bound, or whose tag, header or block counts do
//! not check out: a refused copy changes nothing.

use std::net::IpAddr;

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::block_keys::BlockKey;
use crate::endpoint::EndpointId;

const MAGIC: &[u8; 8] = b"KVRINDEX";
/// The format this picker writes and reads.
pub const VERSION: u16 = 1;
const KEYED: u16 = 1;
/// Magic, version, flags, the two lengths and the tag.
const FIXED: usize = 8 + 2 + 2 + 4 + 8 + 32;
/// Largest header read (about 250 bytes per endpoint: room for the index's most endpoints).
pub const MAX_HEADER_BYTES: usize = 8 << 20;
const BLOCK_BYTES: usize = 16;

/// Which model configuration an endpoint's blocks were keyed for: a copy whose keys were
/// made for another model or block size would credit the wrong prefixes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigIdentity {
    pub name: String,
    pub model: String,
    pub block_size: u32,
}

/// One endpoint's part of a copy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointCopy {
    pub address: IpAddr,
    pub port: u16,
    pub rank: u32,
    /// Its model configuration's name (one of [`IndexCopy::configs`]).
    pub config: String,
    /// The KV-event publisher its view was built from (`tcp://host:port`).
    pub publisher: String,
    /// `(sequence number, timestamp bits)` of the last batch its view holds, when the view
    /// continues the publisher's stream exactly.
    pub position: Option<(u64, u64)>,
    /// `(engine hash, chain key)` of its blocks; carried in the blocks section, not the
    /// header.
    #[serde(skip)]
    pub blocks: Vec<(u64, BlockKey)>,
    /// How many blocks it has in the blocks section.
    #[serde(rename = "blocks")]
    pub count: u64,
}

impl EndpointCopy {
    pub fn id(&self) -> EndpointId {
        EndpointId::new(self.address, self.port, self.rank)
    }
}

/// A copy of a picker's KV index.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexCopy {
    /// The pool it was taken in (`namespace/name`, the peers' group).
    pub group: String,
    /// The random id of the picker replica that took it.
    pub replica: u64,
    /// When it was taken, ms since the Unix epoch.
    pub taken_unix_ms: u64,
    pub configs: Vec<ConfigIdentity>,
    pub endpoints: Vec<EndpointCopy>,
}

impl IndexCopy {
    /// Blocks over all endpoints.
    pub fn blocks(&self) -> usize {
        self.endpoints.iter().map(|e| e.blocks.len()).sum()
    }
}

/// Why a copy was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CopyError {
    #[error("not a kvroute index copy (no KVRINDEX header)")]
    NotACopy,
    #[error("index copy format {found}; this picker reads {VERSION}")]
    Version { found: u16 },
    #[error("torn index copy: {len} bytes where its header announces {announced}")]
    Torn { len: usize, announced: u128 },
    #[error("index copy of {announced} bytes exceeds the bound of {limit}")]
    TooLarge { announced: u128, limit: usize },
    #[error("index copy checksum does not match its contents")]
    Checksum,
    #[error("index copy is not signed with the pool's peer key")]
    Unsigned,
    #[error("index copy is signed, and this picker has no peer key to check it")]
    Unverifiable,
    #[error("index copy header: {0}")]
    Header(String),
}

type HmacSha256 = Hmac<Sha256>;

fn tag(key: Option<&[u8]>, covered: &[u8]) -> [u8; 32] {
    match key {
        Some(k) => {
            let mut mac = HmacSha256::new_from_slice(k).expect("HMAC takes any key length");
            mac.update(covered);
            mac.finalize().into_bytes().into()
        }
        None => Sha256::digest(covered).into(),
    }
}

/// The bytes of `copy`, tagged under `key` when there is one.
pub fn encode(copy: &IndexCopy, key: Option<&[u8]>) -> Vec<u8> {
    let mut header = copy.clone();
    for e in &mut header.endpoints {
        e.count = e.blocks.len() as u64;
    }
    let head = serde_json::to_vec(&header).expect("a copy's header serializes");
    let blocks = copy.blocks() * BLOCK_BYTES;
    let mut out = Vec::with_capacity(FIXED + head.len() + blocks);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(if key.is_some() { KEYED } else { 0 }).to_le_bytes());
    out.extend_from_slice(&(head.len() as u32).to_le_bytes());
    out.extend_from_slice(&(blocks as u64).to_le_bytes());
    out.extend_from_slice(&[0; 32]);
    out.extend_from_slice(&head);
    for e in &copy.endpoints {
        for &(eh, k) in &e.blocks {
            out.extend_from_slice(&eh.to_le_bytes());
            out.extend_from_slice(&k.to_le_bytes());
        }
    }
    let t = tag(key, &out[FIXED..]);
    out[FIXED - 32..FIXED].copy_from_slice(&t);
    out
}

fn le<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
    b[at..at + N].try_into().expect("in bounds")
}

/// Read a copy of at most `max_bytes`, checking it under `key` when there is one.
pub fn decode(bytes: &[u8], key: Option<&[u8]>, max_bytes: usize) -> Result<IndexCopy, CopyError> {
    if bytes.len() < 8 || &bytes[..8] != MAGIC {
        return Err(CopyError::NotACopy);
    }
    if bytes.len() < FIXED {
        return Err(CopyError::Torn {
            len: bytes.len(),
            announced: FIXED as u128,
        });
    }
    let version = u16::from_le_bytes(le(bytes, 8));
    if version != VERSION {
        return Err(CopyError::Version { found: version });
    }
    let flags = u16::from_le_bytes(le(bytes, 10));
    let head_len = u32::from_le_bytes(le(bytes, 12)) as usize;
    let blocks_len = u64::from_le_bytes(le(bytes, 16));
    let announced = FIXED as u128 + head_len as u128 + u128::from(blocks_len);
    if announced > max_bytes as u128 || head_len > MAX_HEADER_BYTES {
        return Err(CopyError::TooLarge {
            announced,
            limit: max_bytes,
        });
    }
    if bytes.len() as u128 != announced {
        return Err(CopyError::Torn {
            len: bytes.len(),
            announced,
        });
    }
    match (flags & KEYED != 0, key) {
        (false, Some(_)) => return Err(CopyError::Unsigned),
        (true, None) => return Err(CopyError::Unverifiable),
        _ => {}
    }
    let want = tag(key, &bytes[FIXED..]);
    // constant time: the tag may be a MAC
    let got = &bytes[FIXED - 32..FIXED];
    if got.iter().zip(want).fold(0u8, |acc, (a, b)| acc | (a ^ b)) != 0 {
        return Err(CopyError::Checksum);
    }
    let head = &bytes[FIXED..FIXED + head_len];
    let mut copy: IndexCopy =
        serde_json::from_slice(head).map_err(|e| CopyError::Header(e.to_string()))?;
    let total: u128 = copy.endpoints.iter().map(|e| u128::from(e.count)).sum();
    if total * BLOCK_BYTES as u128 != u128::from(blocks_len) {
        return Err(CopyError::Header(format!(
            "its endpoints announce {total} blocks, its blocks section holds {}",
            blocks_len / BLOCK_BYTES as u64
        )));
    }
    let mut at = FIXED + head_len;
    for e in &mut copy.endpoints {
        let n = e.count as usize;
        e.blocks = bytes[at..at + n * BLOCK_BYTES]
            .chunks_exact(BLOCK_BYTES)
            .map(|c| (u64::from_le_bytes(le(c, 0)), u64::from_le_bytes(le(c, 8))))
            .collect();
        at += n * BLOCK_BYTES;
    }
    Ok(copy)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn sample() -> IndexCopy {
        IndexCopy {
            group: "ns/pool".into(),
            replica: 7,
            taken_unix_ms: 1_700_000_000_000,
            configs: vec![ConfigIdentity {
                name: "a".into(),
                model: "m".into(),
                block_size: 16,
            }],
            endpoints: vec![
                EndpointCopy {
                    address: "10.0.0.1".parse().unwrap(),
                    port: 8000,
                    rank: 0,
                    config: "a".into(),
                    publisher: "tcp://10.0.0.1:5557".into(),
                    position: Some((41, 1.5f64.to_bits())),
                    blocks: vec![(1, 10), (2, 20), (3, 30)],
                    count: 0,
                },
                EndpointCopy {
                    address: "10.0.0.2".parse().unwrap(),
                    port: 8000,
                    rank: 1,
                    config: "a".into(),
                    publisher: "tcp://10.0.0.2:5558".into(),
                    position: None,
                    blocks: vec![(9, 90)],
                    count: 0,
                },
            ],
        }
    }

    fn counted(mut c: IndexCopy) -> IndexCopy {
        for e in &mut c.endpoints {
            e.count = e.blocks.len() as u64;
        }
        c
    }

    #[test]
    fn a_copy_reads_back_as_written_with_and_without_a_key() {
        let c = sample();
        let plain = encode(&c, None);
        assert_eq!(decode(&plain, None, 1 << 20).unwrap(), counted(c.clone()));
        let keyed = encode(&c, Some(b"0123456789abcdef"));
        assert_eq!(
            decode(&keyed, Some(b"0123456789abcdef"), 1 << 20).unwrap(),
            counted(c)
        );
    }

    #[test]
    fn torn_corrupt_foreign_oversized_and_unsigned_copies_are_refused() {
        let c = sample();
        let bytes = encode(&c, None);
        // torn: any cut
        for cut in [9, FIXED - 1, FIXED + 3, bytes.len() - 1] {
            let e = decode(&bytes[..cut], None, 1 << 20).unwrap_err();
            assert!(matches!(e, CopyError::Torn { .. }), "cut at {cut}: {e}");
        }
        // a longer file is torn too
        let mut long = bytes.clone();
        long.push(0);
        assert!(matches!(
            decode(&long, None, 1 << 20),
            Err(CopyError::Torn { .. })
        ));
        // any flipped byte after the fixed part fails the checksum
        for at in [FIXED, FIXED + 5, bytes.len() - 1] {
            let mut b = bytes.clone();
            b[at] ^= 0x40;
            assert_eq!(decode(&b, None, 1 << 20), Err(CopyError::Checksum));
        }
        // another file altogether, another version
        assert_eq!(
            decode(b"{\"group\":1}", None, 1 << 20),
            Err(CopyError::NotACopy)
        );
        let mut v = bytes.clone();
        v[8] = 9;
        assert_eq!(
            decode(&v, None, 1 << 20),
            Err(CopyError::Version { found: 9 })
        );
        // over the bound, whatever it announces (nothing is allocated for it)
        assert!(matches!(
            decode(&bytes, None, bytes.len() - 1),
            Err(CopyError::TooLarge { .. })
        ));
        let mut huge = bytes.clone();
        huge[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            decode(&huge, None, 1 << 20),
            Err(CopyError::TooLarge { .. })
        ));
        // keys: an unsigned copy where one is expected, the wrong key, no key to check
        assert_eq!(
            decode(&bytes, Some(b"0123456789abcdef"), 1 << 20),
            Err(CopyError::Unsigned)
        );
        let keyed = encode(&c, Some(b"0123456789abcdef"));
        assert_eq!(
            decode(&keyed, Some(b"fedcba9876543210"), 1 << 20),
            Err(CopyError::Checksum)
        );
        assert_eq!(decode(&keyed, None, 1 << 20), Err(CopyError::Unverifiable));
    }

    /// A header whose counts do not match the blocks section is refused even with a right
    /// tag (a writer's bug, or a hostile signer of a checksum-only copy).
    #[test]
    fn a_header_that_miscounts_its_blocks_is_refused() {
        let mut c = counted(sample());
        let head = serde_json::to_vec(&{
            let mut h = c.clone();
            h.endpoints[0].count = 4;
            h
        })
        .unwrap();
        c.endpoints[0].count = 3;
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&(head.len() as u32).to_le_bytes());
        out.extend_from_slice(&(4u64 * 16).to_le_bytes());
        out.extend_from_slice(&[0; 32]);
        out.extend_from_slice(&head);
        out.extend_from_slice(&[0; 64]);
        let t = tag(None, &out[FIXED..]);
        out[FIXED - 32..FIXED].copy_from_slice(&t);
        let e = decode(&out, None, 1 << 20).unwrap_err();
        assert!(matches!(e, CopyError::Header(_)), "{e}");
        assert!(e.to_string().contains("announce 5 blocks"), "{e}");
    }
}
