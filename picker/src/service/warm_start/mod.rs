//! Warm start: a picker that starts (or restarts) loads a copy of the KV index from a warm
//! peer replica of its pool, or from its own snapshot file, instead of learning every
//! engine's cache back from events that only name what changes (issue 52).
//!
//! - **Copies.** [`take_copy`] copies every precise endpoint's blocks out of the index, each
//!   with the publisher it was built from and the position (sequence number and timestamp of
//!   the last batch) its view stands at ([`codec`] has the bytes).
//! - **Snapshot.** With `warmStart.snapshotPath` the picker writes a copy every
//!   `snapshotInterval` and once more when it stops, atomically (a temporary file renamed
//!   over the last one); the chart mounts an `emptyDir` there, which outlives a container
//!   restart in its pod.
//! - **Peers.** Each picker serves its copy on the metrics listener (`GET
//!   /internal/index-copy`) to requests signed with the pool's peer key, and signs the copy
//!   with it (without a key, only with `servePeers: Always`); a starting picker asks every
//!   peer the in-flight exchange knows (`peers.addresses`, `peers.dns`) for one, within
//!   `peerTimeout`, and loads the largest. A peer's copy is fresher than the picker's own
//!   snapshot, which is the fallback.
//! - **Loading** ([`load_copy`]): a copy of another pool is refused whole; an endpoint that is
//!   not a member, is of another model configuration, or whose configuration keys blocks
//!   differently (model, block size) is skipped. What is loaded is *unconfirmed*
//!   (`routing`'s `KvIndex::seed_endpoint`): the engine's events confirm or remove it block
//!   by block, and the subscription starts from the copy's position when it was taken from
//!   the same publisher: if the engine's replay still holds that batch with the same
//!   timestamp, the whole copy is confirmed at once and only what followed is applied;
//!   otherwise (the replay window has passed) the copy stays unconfirmed, its view is
//!   marked as having a gap, and what no event confirms is dropped after `unconfirmedTtl`.
//!   An engine that restarted meanwhile (the replay shows another process) clears it.

pub mod codec;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use serde::Serialize;
use sha2::Sha256;
use tokio_util::sync::CancellationToken;

use self::codec::{ConfigIdentity, CopyError, EndpointCopy, IndexCopy};
use crate::endpoint::EndpointId;
use crate::index::SeedOutcome;
use crate::pool_state::Position;
use crate::service::feeds::peers::PeerKey;
use crate::service::feeds::subscriptions::subscription_for;
use crate::service::settings::{PeerSettings, ServePeers, WarmStartSettings};
use crate::service::state::PickerState;

/// The header that signs a peer's request for a copy: `<unix ms>.<hex HMAC-SHA256>` of
/// `kvroute-index-copy\n<group>\n<unix ms>` under the pool's peer key.
pub const AUTH_HEADER: &str = "x-kvroute-copy-auth";
/// How far a signed request's clock may be from this replica's.
const AUTH_WINDOW_MS: u64 = 30_000;
/// The path peers serve their copy on (the metrics listener).
pub const COPY_PATH: &str = "/internal/index-copy";

/// Where the index a picker started with came from, and what became of it
/// (`/debug/endpoints`' `warm_start`).
#[derive(Debug, Clone, Default, Serialize)]
pub struct WarmStatus {
    /// `peer <address>` or `snapshot <path>`; absent when it started cold.
    pub source: Option<String>,
    /// When the copy was taken, ms since the Unix epoch.
    pub taken_unix_ms: Option<u64>,
    pub endpoints_seeded: usize,
    pub blocks_seeded: usize,
    /// Why copies, or endpoints of the one loaded, were not used.
    pub refused: Vec<String>,
    /// Per seeded endpoint: what its subscription made of the copy.
    pub endpoints: BTreeMap<String, EndpointWarmth>,
    pub snapshots_written: u64,
    pub last_snapshot_error: Option<String>,
    /// What the copies this picker serves are taken for (set at start).
    #[serde(skip)]
    serve: Option<Serving>,
    #[serde(skip)]
    /// The publisher each seeded endpoint's copy was built from (its position is the
    /// index's, `PoolState::take_seed`).
    publishers: BTreeMap<EndpointId, String>,
}

/// One seeded endpoint's state.
#[derive(Debug, Clone, Serialize)]
pub struct EndpointWarmth {
    pub blocks: usize,
    /// `unconfirmed` (waiting for its subscription), `continuing` (resumed from the copy's
    /// position: the replay decides), `confirmed` (the replay continued it), `unproven` (no
    /// position to continue from, or the replay no longer holds it: the engine's events
    /// settle it block by block), or `cleared` (the engine restarted meanwhile).
    pub state: &'static str,
}

/// Refusals kept in [`WarmStatus::refused`] at most.
const MAX_REFUSALS: usize = 32;

impl WarmStatus {
    fn refuse(&mut self, why: String) {
        tracing::warn!("warm start: {why}");
        if self.refused.len() < MAX_REFUSALS {
            self.refused.push(why);
        }
    }

    /// The subscription of `id` (to `publisher`) starts on a seeded view taken at `position`:
    /// where it resumes from, if anywhere. Only a copy of this publisher's stream can be
    /// continued, and without a replay socket to ask nothing can prove continuity.
    pub fn resume_for(
        &mut self,
        id: EndpointId,
        publisher: &str,
        replay: bool,
        position: Option<Position>,
    ) -> Option<Position> {
        let same = self.publishers.remove(&id).as_deref() == Some(publisher);
        let resume = position.filter(|_| replay && same);
        if let Some(e) = self.endpoints.get_mut(&id.to_string()) {
            e.state = if resume.is_some() {
                "continuing"
            } else {
                "unproven"
            };
        }
        resume
    }

    /// The replay continued `id`'s copied view.
    pub fn confirmed(&mut self, id: EndpointId) {
        self.set_state(id, "confirmed");
    }

    /// The replay could not show that the stream continues `id`'s copied view; it was kept
    /// as unconfirmed credit (`true`) or cleared.
    pub fn not_continued(&mut self, id: EndpointId, kept: bool) {
        self.set_state(id, if kept { "unproven" } else { "cleared" });
    }

    fn set_state(&mut self, id: EndpointId, state: &'static str) {
        if let Some(e) = self.endpoints.get_mut(&id.to_string()) {
            e.state = state;
        }
    }
}

/// What a copy this picker serves or writes is taken for.
#[derive(Debug, Clone)]
struct Serving {
    group: String,
    replica: u64,
    key: Option<Vec<u8>>,
    max_bytes: usize,
    mode: ServePeers,
}

/// The model configurations of the pool, as a copy names them.
fn identities(picker: &PickerState) -> Vec<ConfigIdentity> {
    picker
        .catalog()
        .values()
        .map(|e| ConfigIdentity {
            name: e.config.name.to_string(),
            model: e.config.model.to_string(),
            block_size: e.config.block_size,
        })
        .collect()
}

/// A copy of the picker's index: every precise endpoint it can copy (see
/// `KvIndex::export_endpoint`), with its publisher and position.
pub fn take_copy(picker: &PickerState, group: &str, replica: u64, now_unix_ms: u64) -> IndexCopy {
    let snap = picker.pool.state().endpoints();
    let catalog = picker.catalog();
    let mut endpoints = Vec::new();
    for e in snap.endpoints() {
        let Some(sub) = subscription_for(picker, &catalog, e) else {
            continue;
        };
        let Some((exported, position)) = picker.pool.state().export_endpoint(&e.id) else {
            continue;
        };
        if exported.blocks.is_empty() {
            continue;
        }
        endpoints.push(EndpointCopy {
            address: e.id.address,
            port: e.id.port,
            rank: e.id.rank,
            config: e.model_config.name.to_string(),
            publisher: sub.publisher,
            position: position.filter(|_| !exported.unproven),
            count: exported.blocks.len() as u64,
            blocks: exported.blocks,
        });
    }
    IndexCopy {
        group: group.to_owned(),
        replica,
        taken_unix_ms: now_unix_ms,
        configs: identities(picker),
        endpoints,
    }
}

/// What [`load_copy`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Loaded {
    pub endpoints: usize,
    pub blocks: usize,
}

/// Load `copy` into the picker's index as unconfirmed blocks kept until `until_ms` (picker
/// clock) unless events confirm them; refused whole when it is of another pool.
pub fn load_copy(
    picker: &PickerState,
    copy: &IndexCopy,
    group: &str,
    source: &str,
    until_ms: u64,
) -> Result<Loaded, String> {
    if copy.group != group {
        return Err(format!(
            "{source}: a copy of pool {:?}, and this picker serves {group:?}",
            copy.group
        ));
    }
    let ours = identities(picker);
    let snap = picker.pool.state().endpoints();
    let catalog = picker.catalog();
    let mut loaded = Loaded::default();
    // (the status is locked once the index is done with: never under the pool's lock)
    let mut refused = Vec::new();
    let mut seeded = Vec::new();
    for ec in &copy.endpoints {
        let id = ec.id();
        let Some(e) = snap.get(&id) else {
            continue; // not a member any more: nothing to say
        };
        let theirs = copy.configs.iter().find(|c| c.name == ec.config);
        let mine = ours.iter().find(|c| *c.name == *e.model_config.name);
        if ec.config != *e.model_config.name || theirs.is_none() || theirs != mine {
            refused.push(format!(
                "{source}: endpoint {id} was copied for model config {:?} ({}), and here it \
                 serves {:?} ({})",
                ec.config,
                theirs.map_or("undeclared".to_owned(), |c| format!(
                    "{} at block size {}",
                    c.model, c.block_size
                )),
                &*e.model_config.name,
                mine.map_or("undeclared".to_owned(), |c| format!(
                    "{} at block size {}",
                    c.model, c.block_size
                )),
            ));
            continue;
        }
        let publisher = subscription_for(picker, &catalog, e).map(|s| s.publisher);
        let position = ec
            .position
            .filter(|_| publisher.as_deref() == Some(ec.publisher.as_str()));
        match picker
            .pool
            .state()
            .seed_endpoint(&id, &ec.blocks, until_ms, position)
        {
            Some(SeedOutcome::Seeded { blocks }) if blocks > 0 => {
                loaded.endpoints += 1;
                loaded.blocks += blocks;
                seeded.push((id, ec.publisher.clone(), blocks));
            }
            _ => {}
        }
    }
    let mut warm = picker.warm.lock();
    for why in refused {
        warm.refuse(why);
    }
    for (id, publisher, blocks) in seeded {
        warm.publishers.insert(id, publisher);
        warm.endpoints.insert(
            id.to_string(),
            EndpointWarmth {
                blocks,
                state: "unconfirmed",
            },
        );
    }
    warm.source = Some(source.to_owned());
    warm.taken_unix_ms = Some(copy.taken_unix_ms);
    warm.endpoints_seeded = loaded.endpoints;
    warm.blocks_seeded = loaded.blocks;
    Ok(loaded)
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

type HmacSha256 = Hmac<Sha256>;

fn sign(key: &[u8], group: &str, ts: u64) -> String {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes any key length");
    mac.update(format!("kvroute-index-copy\n{group}\n{ts}").as_bytes());
    let tag: [u8; 32] = mac.finalize().into_bytes().into();
    format!("{ts}.{}", hex(&tag))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Whether a request's [`AUTH_HEADER`] is signed with `key` for `group` within the window.
fn authorized(header: Option<&str>, key: &[u8], group: &str, now: u64) -> bool {
    let Some((ts, _)) = header.and_then(|h| h.split_once('.')) else {
        return false;
    };
    let Ok(ts) = ts.parse::<u64>() else {
        return false;
    };
    if ts.abs_diff(now) > AUTH_WINDOW_MS {
        return false;
    }
    let want = sign(key, group, ts);
    let got = header.unwrap_or_default();
    want.len() == got.len()
        && want
            .bytes()
            .zip(got.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// The answer to a peer's `GET /internal/index-copy`: the copy's bytes, or why not.
pub fn serve_copy(picker: &PickerState, auth: Option<&str>) -> Result<Vec<u8>, (u16, String)> {
    let Some(s) = picker.warm.lock().serve.clone() else {
        return Err((404, "this picker serves no index copy".into()));
    };
    match (s.mode, &s.key) {
        (ServePeers::Off, _) => return Err((404, "warmStart.servePeers is Off".into())),
        (ServePeers::Signed, None) => {
            return Err((
                404,
                "without peers.keyFile no copy is served (warmStart.servePeers: Always serves \
                 one unsigned)"
                    .into(),
            ));
        }
        (_, Some(key)) if !authorized(auth, key, &s.group, unix_ms()) => {
            return Err((
                401,
                format!(
                    "a copy is served to requests signed with the pool's peer key ({AUTH_HEADER})"
                ),
            ));
        }
        _ => {}
    }
    let copy = take_copy(picker, &s.group, s.replica, unix_ms());
    let bytes = codec::encode(&copy, s.key.as_deref());
    if bytes.len() > s.max_bytes {
        return Err((
            507,
            format!(
                "the index copy is {} bytes, over warmStart.maxBytes ({})",
                bytes.len(),
                s.max_bytes
            ),
        ));
    }
    Ok(bytes)
}

/// Ask one peer for its copy.
async fn ask_peer(
    picker: &PickerState,
    url: &str,
    auth: Option<String>,
    key: Option<&[u8]>,
    max_bytes: usize,
) -> Result<IndexCopy, String> {
    let mut req = picker.http.get(url);
    if let Some(a) = auth {
        req = req.header(AUTH_HEADER, a);
    }
    let mut resp = req.send().await.map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        return Err(format!(
            "{status}: {}",
            text.chars().take(200).collect::<String>()
        ));
    }
    if resp.content_length().is_some_and(|n| n > max_bytes as u64) {
        return Err(format!("a copy over warmStart.maxBytes ({max_bytes})"));
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| e.to_string())? {
        if body.len() + chunk.len() > max_bytes {
            return Err(format!("a copy over warmStart.maxBytes ({max_bytes})"));
        }
        body.extend_from_slice(&chunk);
    }
    codec::decode(&body, key, max_bytes).map_err(|e| e.to_string())
}

/// Read the snapshot file at `path`.
pub fn read_snapshot(
    path: &Path,
    key: Option<&[u8]>,
    max_bytes: usize,
) -> Result<IndexCopy, String> {
    let meta = std::fs::metadata(path).map_err(|e| e.to_string())?;
    if meta.len() > max_bytes as u64 {
        return Err(CopyError::TooLarge {
            announced: u128::from(meta.len()),
            limit: max_bytes,
        }
        .to_string());
    }
    let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    codec::decode(&bytes, key, max_bytes).map_err(|e| e.to_string())
}

/// Write `bytes` to `path` through a temporary file renamed over it, so that a reader never
/// sees half a snapshot.
fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)
}

/// Everything warm start needs from the configuration.
#[derive(Debug, Clone)]
pub struct WarmStart {
    pub settings: WarmStartSettings,
    pub peers: PeerSettings,
    pub key: Option<Vec<u8>>,
    /// The port peers serve copies on when `peerPort` is not set: this picker's metrics port.
    pub metrics_port: u16,
}

impl WarmStart {
    fn group(&self) -> &str {
        &self.peers.group
    }

    /// Before the KV-event subscriptions start: load a copy from the peers, else from the
    /// snapshot file. Bounded by `peerTimeout`; never fails the start.
    pub async fn load(&self, picker: &PickerState) {
        let replica = picker.replica;
        picker.warm.lock().serve = Some(Serving {
            group: self.group().to_owned(),
            replica,
            key: self.key.clone(),
            max_bytes: self.settings.max_bytes,
            mode: self.settings.serve_peers,
        });
        let until = picker.now_ms() + self.settings.unconfirmed_ttl.as_millis() as u64;
        let mut best: Option<(IndexCopy, String)> = None;
        if self.settings.from_peers
            && (self.peers.dns.is_some() || !self.peers.addresses.is_empty())
        {
            let port = self.settings.peer_port.unwrap_or(self.metrics_port);
            let addrs = crate::service::feeds::peers::resolve(&self.peers, &[]).await;
            let mut ips: Vec<std::net::IpAddr> = addrs.iter().map(|a| a.ip()).collect();
            ips.sort_unstable();
            ips.dedup();
            let asks = ips.into_iter().map(|ip| {
                let host = match ip {
                    std::net::IpAddr::V4(a) => a.to_string(),
                    std::net::IpAddr::V6(a) => format!("[{a}]"),
                };
                let url = format!("http://{host}:{port}{COPY_PATH}");
                let auth = self
                    .key
                    .as_deref()
                    .map(|k| sign(k, self.group(), unix_ms()));
                async move {
                    let r = tokio::time::timeout(
                        self.settings.peer_timeout,
                        ask_peer(
                            picker,
                            &url,
                            auth,
                            self.key.as_deref(),
                            self.settings.max_bytes,
                        ),
                    )
                    .await
                    .unwrap_or_else(|_| {
                        Err(format!("no copy within {:?}", self.settings.peer_timeout))
                    });
                    (format!("peer {host}:{port}"), r)
                }
            });
            for (source, r) in futures::future::join_all(asks).await {
                match r {
                    Ok(copy) if copy.replica == replica => {}
                    Ok(copy) if copy.group != self.group() => picker.warm.lock().refuse(format!(
                        "{source}: a copy of pool {:?}, and this picker serves {:?}",
                        copy.group,
                        self.group()
                    )),
                    Ok(copy) => {
                        if best
                            .as_ref()
                            .is_none_or(|(b, _)| copy.blocks() > b.blocks())
                        {
                            best = Some((copy, source));
                        }
                    }
                    Err(e) => picker.warm.lock().refuse(format!("{source}: {e}")),
                }
            }
        }
        if best.as_ref().is_none_or(|(b, _)| b.blocks() == 0)
            && let Some(path) = &self.settings.snapshot_path
        {
            let source = format!("snapshot {path}");
            match read_snapshot(
                Path::new(path),
                self.key.as_deref(),
                self.settings.max_bytes,
            ) {
                Ok(copy) => best = Some((copy, source)),
                Err(e) if Path::new(path).exists() => {
                    picker.warm.lock().refuse(format!("{source}: {e}"));
                }
                Err(_) => {}
            }
        }
        let Some((copy, source)) = best else {
            return;
        };
        let age_ms = unix_ms().saturating_sub(copy.taken_unix_ms);
        if age_ms > self.settings.max_age.as_millis() as u64 {
            picker.warm.lock().refuse(format!(
                "{source}: taken {} s ago, longer than warmStart.maxAge ({:?})",
                age_ms / 1000,
                self.settings.max_age
            ));
            return;
        }
        match load_copy(picker, &copy, self.group(), &source, until) {
            Ok(l) => tracing::info!(
                %source,
                endpoints = l.endpoints,
                blocks = l.blocks,
                age_ms = unix_ms().saturating_sub(copy.taken_unix_ms),
                "warm start: loaded the index copy (unconfirmed until the engines' events settle it)"
            ),
            Err(e) => picker.warm.lock().refuse(e),
        }
    }

    /// Write the snapshot every `snapshotInterval`, and once more when cancelled.
    pub async fn run_snapshots(self, picker: Arc<PickerState>, cancel: CancellationToken) {
        let Some(path) = self.settings.snapshot_path.clone() else {
            return;
        };
        let mut tick = tokio::time::interval(self.settings.snapshot_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            let last = tokio::select! {
                () = cancel.cancelled() => true,
                _ = tick.tick() => false,
            };
            let (p, path2, ws) = (picker.clone(), path.clone(), self.clone());
            let written = tokio::task::spawn_blocking(move || {
                let copy = take_copy(&p, ws.group(), p.replica, unix_ms());
                let bytes = codec::encode(&copy, ws.key.as_deref());
                if bytes.len() > ws.settings.max_bytes {
                    return Err(format!(
                        "a snapshot of {} bytes is over warmStart.maxBytes ({})",
                        bytes.len(),
                        ws.settings.max_bytes
                    ));
                }
                write_atomically(Path::new(&path2), &bytes).map_err(|e| format!("{path2}: {e}"))
            })
            .await
            .unwrap_or_else(|e| Err(e.to_string()));
            {
                let mut w = picker.warm.lock();
                match written {
                    Ok(()) => {
                        w.snapshots_written += 1;
                        w.last_snapshot_error = None;
                    }
                    Err(e) => {
                        if w.last_snapshot_error.as_deref() != Some(e.as_str()) {
                            tracing::warn!(error = %e, "cannot write the index snapshot");
                        }
                        w.last_snapshot_error = Some(e);
                    }
                }
            }
            if last {
                return;
            }
        }
    }
}

/// The pool's peer key's bytes, if any.
pub fn key_bytes(key: &PeerKey) -> Option<Vec<u8>> {
    key.bytes().map(<[u8]>::to_vec)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::service::settings::{IndexSettings, Limits, PickerConfig};
    use crate::service::source::view_from_config;

    /// A pool of two model configs with KV events: `a` (model m, blocks of 16) on 127.0.0.2,
    /// `b` (model m, blocks of `b_block`) on 127.0.0.3.
    fn pool(b_block: u32) -> PickerState {
        let picker = PickerState::new(Limits::default(), IndexSettings::default()).unwrap();
        let config = PickerConfig::from_yaml(&format!(
            "modelConfigs:\n  - {{name: a, model: m, port: 8000, blockSize: 16, kvEvents: {{port: 5557}}}}\n  \
             - {{name: b, model: m, port: 8000, blockSize: {b_block}, kvEvents: {{port: 5557}}}}\n\
             endpoints:\n  - {{address: 127.0.0.2, modelConfig: a}}\n  - {{address: 127.0.0.3, modelConfig: b}}\n"
        ))
        .unwrap();
        picker.apply_pool(&view_from_config(&config)).unwrap();
        picker
    }

    fn stored(picker: &PickerState, ip: &str, blocks: &[(u64, u64)]) {
        let id = EndpointId::new(ip.parse().unwrap(), 8000, 0);
        let state = picker.pool.state();
        // (through the seed path: the index's own store is not reachable from here)
        assert!(matches!(
            state.seed_endpoint(&id, blocks, u64::MAX, Some((7, 1.0f64.to_bits()))),
            Some(SeedOutcome::Seeded { .. })
        ));
        state.confirm_seed(&id);
    }

    #[test]
    fn a_copy_loads_where_the_configs_match_and_nowhere_else() {
        let warm = pool(16);
        stored(&warm, "127.0.0.2", &[(1, 10), (2, 20)]);
        stored(&warm, "127.0.0.3", &[(3, 30)]);
        let copy = take_copy(&warm, "ns/pool", 1, 5);
        assert_eq!(copy.endpoints.len(), 2);
        // the copy carries each endpoint's publisher (no position: these views came from a
        // seed, not from events applied in order)
        assert_eq!(copy.endpoints[0].publisher, "tcp://127.0.0.2:5557");

        // another pool: refused whole, nothing loaded
        let other = pool(16);
        let e = load_copy(&other, &copy, "ns/other", "peer x", 1_000).unwrap_err();
        assert!(e.contains("a copy of pool \"ns/pool\""), "{e}");
        assert_eq!(other.pool.state().live_blocks(), 0);

        // config b keys blocks of 32 tokens here: its endpoint is refused, a's is loaded
        let differs = pool(32);
        let loaded = load_copy(&differs, &copy, "ns/pool", "peer x", 1_000).unwrap();
        assert_eq!(
            loaded,
            Loaded {
                endpoints: 1,
                blocks: 2
            }
        );
        assert_eq!(differs.pool.state().live_blocks(), 2);
        let w = differs.warm.lock();
        assert_eq!(w.refused.len(), 1);
        assert!(
            w.refused[0].contains("127.0.0.3")
                && w.refused[0].contains("block size 16")
                && w.refused[0].contains("block size 32"),
            "{:?}",
            w.refused
        );
        assert_eq!(w.endpoints.len(), 1);
    }

    /// A snapshot older than `maxAge` is refused with a message and loads nothing; a fresh
    /// one of the same contents loads.
    #[tokio::test]
    async fn a_snapshot_older_than_max_age_is_refused() {
        let warm = pool(16);
        stored(&warm, "127.0.0.2", &[(1, 10), (2, 20)]);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("index.snapshot");
        let ws = WarmStart {
            settings: WarmStartSettings {
                snapshot_path: Some(path.display().to_string()),
                ..WarmStartSettings::default()
            },
            peers: PeerSettings::default(),
            key: None,
            metrics_port: 0,
        };
        let mut copy = take_copy(&warm, "", 1, unix_ms() - 3_600_000);
        std::fs::write(&path, codec::encode(&copy, None)).unwrap();
        let cold = pool(16);
        ws.load(&cold).await;
        assert_eq!(cold.pool.state().live_blocks(), 0);
        let refused = cold.warm.lock().refused.clone();
        assert!(
            refused.len() == 1 && refused[0].contains("maxAge"),
            "{refused:?}"
        );
        copy.taken_unix_ms = unix_ms();
        std::fs::write(&path, codec::encode(&copy, None)).unwrap();
        let fresh = pool(16);
        ws.load(&fresh).await;
        assert_eq!(fresh.pool.state().live_blocks(), 2);
        assert!(fresh.warm.lock().refused.is_empty());
    }

    #[test]
    fn a_signed_request_is_checked_for_key_group_and_time() {
        let key = b"0123456789abcdef";
        let now = 1_700_000_000_000;
        let h = sign(key, "ns/pool", now);
        assert!(authorized(Some(&h), key, "ns/pool", now + 1_000));
        assert!(!authorized(Some(&h), key, "ns/other", now));
        assert!(!authorized(Some(&h), b"fedcba9876543210", "ns/pool", now));
        assert!(!authorized(
            Some(&h),
            key,
            "ns/pool",
            now + AUTH_WINDOW_MS + 1
        ));
        assert!(!authorized(None, key, "ns/pool", now));
        assert!(!authorized(Some("garbage"), key, "ns/pool", now));
        let mut forged = h.clone();
        let last = forged.pop().unwrap();
        forged.push(if last == '0' { '1' } else { '0' });
        assert!(!authorized(Some(&forged), key, "ns/pool", now));
    }
}
