//! Publisher discovery: where an engine serves `GET /kv_event_sources` (vLLM 0.32 and later),
//! the picker subscribes to the publisher and replay endpoints each data-parallel rank lists
//! there, and follows them when they change; where it does not (older vLLM, SGLang), the
//! ports computed from the pool's settings stay.
//!
//! vLLM answers with each ready engine's resolved `KVEventsConfig`, keyed by DP rank:
//! `{"0": {"publisher": "zmq", "endpoint": "tcp://10.0.0.5:41234", "replay_endpoint":
//! "tcp://10.0.0.5:41235", "topic": "", ...}}`. An engine configured with `tcp://*:0` binds
//! ephemeral ports on its node IP and lists them; one configured with a fixed port lists
//! `tcp://*:<port + rank>`, read here as the engine's own address. An endpoint naming any
//! other host (or `ipc://`) is not followed: the picker connects only to the engine itself.
//!
//! Each server is asked when it joins the pool, then every [`ASK_INTERVAL`], sooner when a
//! subscription to it drops (an engine restarted on new ports), and one that does not serve
//! the path every [`UNSUPPORTED_INTERVAL`]. Answers are bounded ([`MAX_ANSWER_BYTES`],
//! [`MAX_RANKS`]) and asked within [`ASK_TIMEOUT`].

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::endpoint::EndpointId;
use crate::service::state::PickerState;

pub const ASK_INTERVAL: Duration = Duration::from_secs(30);
pub const UNSUPPORTED_INTERVAL: Duration = Duration::from_secs(300);
pub const ASK_TIMEOUT: Duration = Duration::from_secs(2);
pub const MAX_ANSWER_BYTES: usize = 256 << 10;
pub const MAX_RANKS: usize = 1024;
/// How often the loop looks for servers that are due.
const TICK: Duration = Duration::from_secs(2);

/// One rank's publisher, as the engine lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RankSource {
    pub publisher: String,
    pub replay: Option<String>,
    pub topic: String,
}

#[derive(Debug, Clone, Default)]
struct Server {
    /// What it listed; `None` when it does not serve the path (or has not answered yet).
    ranks: Option<BTreeMap<u32, RankSource>>,
    asked: Option<Instant>,
    /// Asked again at the next tick (a subscription to it dropped).
    nudged: bool,
}

/// What the engines listed, per server (address and HTTP port).
#[derive(Debug, Default)]
pub struct EventSources {
    servers: parking_lot::Mutex<HashMap<(IpAddr, u16), Server>>,
    /// Moves when any server's list changes (the event manager wakes on it).
    version: tokio::sync::watch::Sender<u64>,
}

impl EventSources {
    /// The publisher `id`'s engine lists for its rank, if it lists one.
    pub fn get(&self, id: &EndpointId) -> Option<RankSource> {
        self.servers
            .lock()
            .get(&(id.address, id.port))?
            .ranks
            .as_ref()?
            .get(&id.rank)
            .cloned()
    }

    pub fn watch(&self) -> tokio::sync::watch::Receiver<u64> {
        self.version.subscribe()
    }

    pub fn version(&self) -> u64 {
        *self.version.borrow()
    }

    /// A subscription to `id`'s engine dropped: ask it again soon.
    pub fn nudge(&self, id: &EndpointId) {
        if let Some(s) = self.servers.lock().get_mut(&(id.address, id.port)) {
            s.nudged = true;
        }
    }

    /// Record that `server` was asked and, when it answered, what it lists (`Some(None)`: it
    /// does not serve the path); `true` when that changed. A server that did not answer keeps
    /// what it listed last: an engine that is down or slow has not moved its publishers.
    fn record(
        &self,
        server: (IpAddr, u16),
        answer: Option<Option<BTreeMap<u32, RankSource>>>,
    ) -> bool {
        let mut servers = self.servers.lock();
        let s = servers.entry(server).or_default();
        s.asked = Some(Instant::now());
        s.nudged = false;
        match answer {
            Some(ranks) if s.ranks != ranks => {
                s.ranks = ranks;
                true
            }
            _ => false,
        }
    }
}

/// The host of `tcp://host:port` (IPv6 in brackets), and its port.
fn split_tcp(endpoint: &str) -> Option<(&str, u16)> {
    let rest = endpoint.strip_prefix("tcp://")?;
    let (host, port) = rest.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    (port != 0).then_some((host.trim_start_matches('[').trim_end_matches(']'), port))
}

/// `endpoint` as the picker connects to it on `engine`: a wildcard host is the engine's own
/// address; another host than the engine's is refused.
fn resolve(endpoint: &str, engine: IpAddr) -> Result<String, String> {
    let (host, port) =
        split_tcp(endpoint).ok_or_else(|| format!("{endpoint:?} is not tcp://host:port"))?;
    let ip = match host {
        "*" | "0.0.0.0" | "::" => engine,
        h => match h.parse::<IpAddr>() {
            Ok(ip) if ip == engine => ip,
            _ => {
                return Err(format!(
                    "{endpoint:?} names another host than the engine ({engine})"
                ));
            }
        },
    };
    Ok(match ip {
        IpAddr::V4(a) => format!("tcp://{a}:{port}"),
        IpAddr::V6(a) => format!("tcp://[{a}]:{port}"),
    })
}

/// Read an answer of `engine`: each rank's source, or why it cannot be used. Ranks whose
/// publisher is not ZMQ (events off) are left out; a bad rank fails the whole answer (an
/// engine that lists nonsense is followed nowhere, and its computed ports stay).
pub fn parse(body: &[u8], engine: IpAddr) -> Result<BTreeMap<u32, RankSource>, String> {
    let v: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    let map = v.as_object().ok_or("not an object keyed by rank")?;
    if map.len() > MAX_RANKS {
        return Err(format!("{} ranks, more than {MAX_RANKS}", map.len()));
    }
    let mut out = BTreeMap::new();
    for (k, cfg) in map {
        let rank: u32 = k
            .parse()
            .map_err(|_| format!("rank {k:?} is not a number"))?;
        let text = |f: &str| cfg.get(f).and_then(serde_json::Value::as_str);
        if text("publisher").is_some_and(|p| p != "zmq")
            || cfg.get("enable_kv_cache_events") == Some(&serde_json::Value::Bool(false))
        {
            continue;
        }
        let endpoint = text("endpoint").ok_or(format!("rank {rank}: no endpoint"))?;
        let publisher = resolve(endpoint, engine).map_err(|e| format!("rank {rank}: {e}"))?;
        let replay = match text("replay_endpoint") {
            Some(r) => Some(resolve(r, engine).map_err(|e| format!("rank {rank}: {e}"))?),
            None => None,
        };
        out.insert(
            rank,
            RankSource {
                publisher,
                replay,
                topic: text("topic").unwrap_or_default().to_owned(),
            },
        );
    }
    Ok(out)
}

/// Ask one server; `Ok(None)` when it does not serve the path.
async fn ask(
    picker: &PickerState,
    server: (IpAddr, u16),
) -> Result<Option<BTreeMap<u32, RankSource>>, String> {
    let host = match server.0 {
        IpAddr::V4(a) => a.to_string(),
        IpAddr::V6(a) => format!("[{a}]"),
    };
    let url = format!("http://{host}:{}/kv_event_sources", server.1);
    let mut resp = picker
        .http
        .get(&url)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if matches!(resp.status().as_u16(), 404 | 405) {
        return Ok(None);
    }
    if !resp.status().is_success() {
        return Err(format!("{url}: {}", resp.status()));
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| e.to_string())? {
        if body.len() + chunk.len() > MAX_ANSWER_BYTES {
            return Err(format!("{url}: an answer over {MAX_ANSWER_BYTES} bytes"));
        }
        body.extend_from_slice(&chunk);
    }
    parse(&body, server.0)
        .map(Some)
        .map_err(|e| format!("{url}: {e}"))
}

/// One round: ask every server that is due; `true` when what any lists changed (the event
/// manager has been told).
pub async fn round(picker: &PickerState) -> bool {
    let snap = picker.pool.state().endpoints();
    let catalog = picker.catalog();
    let mut members: Vec<(IpAddr, u16)> = snap
        .endpoints()
        .iter()
        .filter(|e| {
            catalog
                .get(&*e.model_config.name)
                .is_some_and(|m| m.spec.kv_events.is_some())
        })
        .map(|e| (e.id.address, e.id.port))
        .collect();
    members.sort_unstable();
    members.dedup();
    let due: Vec<(IpAddr, u16)> = {
        let mut servers = picker.event_sources.servers.lock();
        servers.retain(|k, _| members.binary_search(k).is_ok());
        members
            .iter()
            .filter(|k| match servers.get(k) {
                None => true,
                Some(s) => {
                    let every = if s.ranks.is_some() {
                        ASK_INTERVAL
                    } else {
                        UNSUPPORTED_INTERVAL
                    };
                    s.nudged || s.asked.is_none_or(|t| t.elapsed() >= every)
                }
            })
            .copied()
            .collect()
    };
    let asks = due.iter().map(|&server| async move {
        let r = tokio::time::timeout(ASK_TIMEOUT, ask(picker, server))
            .await
            .unwrap_or_else(|_| Err(format!("no answer within {ASK_TIMEOUT:?}")));
        (server, r)
    });
    let mut changed = false;
    for (server, r) in futures::future::join_all(asks).await {
        let ranks = match r {
            Ok(ranks) => ranks,
            Err(e) => {
                tracing::debug!(server = ?server, error = %e, "cannot read /kv_event_sources");
                picker.event_sources.record(server, None);
                continue;
            }
        };
        if picker.event_sources.record(server, Some(ranks.clone())) {
            changed = true;
            match &ranks {
                Some(r) => {
                    tracing::info!(server = ?server, ranks = r.len(), "KV event publishers from /kv_event_sources")
                }
                None => {
                    tracing::info!(server = ?server, "no /kv_event_sources: KV event ports computed from the pool's settings")
                }
            }
        }
    }
    if changed {
        picker.event_sources.version.send_modify(|v| *v += 1);
    }
    changed
}

/// Ask the pool's engines for their publishers until cancelled (see the module docs).
pub async fn run_discovery(picker: Arc<PickerState>, cancel: CancellationToken) {
    let mut changes = picker.watch_pool();
    loop {
        round(&picker).await;
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(TICK) => {}
            r = changes.changed() => if r.is_err() { return },
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn vllm_answers_are_read_and_foreign_hosts_refused() {
        let engine: IpAddr = "10.0.0.5".parse().unwrap();
        // port 0 resolved by the engine, a fixed port bound on the wildcard, events off
        let body = br#"{
            "0": {"enable_kv_cache_events": true, "publisher": "zmq",
                  "endpoint": "tcp://10.0.0.5:41234", "replay_endpoint": "tcp://10.0.0.5:41235",
                  "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000, "topic": "kv"},
            "1": {"enable_kv_cache_events": true, "publisher": "zmq",
                  "endpoint": "tcp://*:5558", "replay_endpoint": null, "topic": ""},
            "2": {"enable_kv_cache_events": false, "publisher": "null", "endpoint": "tcp://*:5559"}
        }"#;
        let got = parse(body, engine).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(
            got[&0],
            RankSource {
                publisher: "tcp://10.0.0.5:41234".into(),
                replay: Some("tcp://10.0.0.5:41235".into()),
                topic: "kv".into()
            }
        );
        assert_eq!(got[&1].publisher, "tcp://10.0.0.5:5558");
        assert_eq!(got[&1].replay, None);
        // an empty answer (a render-only server, or no engine ready yet) lists nothing
        assert!(parse(b"{}", engine).unwrap().is_empty());
        // another host, ipc, port 0 left unresolved, nonsense: refused whole
        for bad in [
            r#"{"0": {"endpoint": "tcp://10.0.0.9:5557"}}"#,
            r#"{"0": {"endpoint": "ipc:///tmp/kv"}}"#,
            r#"{"0": {"endpoint": "tcp://*:0"}}"#,
            r#"{"0": {"endpoint": "tcp://10.0.0.5:5557", "replay_endpoint": "tcp://1.2.3.4:1"}}"#,
            r#"{"x": {"endpoint": "tcp://*:5557"}}"#,
            r#"[1, 2]"#,
            r#"{"0": {}}"#,
        ] {
            assert!(parse(bad.as_bytes(), engine).is_err(), "{bad}");
        }
        // IPv6 engines
        let v6: IpAddr = "fd00::5".parse().unwrap();
        let got = parse(br#"{"0": {"endpoint": "tcp://[fd00::5]:41234"}}"#, v6).unwrap();
        assert_eq!(got[&0].publisher, "tcp://[fd00::5]:41234");
    }
}
