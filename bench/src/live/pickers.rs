//! The pickers of a live run (`--pickers N`), each its own process subscribed to every
//! engine, and what starts one again when a scenario's `picker-restart` kills it.
//!
//! The client spreads requests over the pickers by request id, as a load balancer in front
//! of picker replicas would. While a picker is down its requests wait for it (a gateway
//! retrying a refused connection) for at most [`WAIT_FOR_PICKER`]; the requests it held when
//! it was killed fail. With `--peer-sync-ms` above 0 (the default) the pickers exchange
//! their in-flight counts over UDP on loopback (`peers`), as the service's replicas do.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::watch;

use kvroute_picker::service::settings::{PeerSettings, PickerConfig, WarmStartSettings};

use super::{EnginesInfo, Picker, start_picker_with};
use crate::{BenchOptions, PolicySpec};

/// Longest a request waits for a restarting picker before it counts as failed.
pub const WAIT_FOR_PICKER: Duration = Duration::from_secs(60);

/// What starts a picker: the same configuration every time.
struct Spawner {
    exe: PathBuf,
    opts: BenchOptions,
    policy: PolicySpec,
    engines: EnginesInfo,
    http: reqwest::Client,
    /// Each picker's UDP port for the peer exchange (empty: no exchange).
    peer_ports: Vec<u16>,
    /// `--warm-start peer`: picker `i` listens on `127.0.0.(20 + i)`, its metrics on this
    /// port (one port for all, as in a pod's fixed ports), where the others ask it for its
    /// index; the pool's key signs the copies.
    copy_port: Option<(u16, PathBuf)>,
}

/// The loopback address of picker `i` when the pickers copy each other's index.
fn picker_ip(i: usize) -> std::net::Ipv4Addr {
    std::net::Ipv4Addr::new(127, 0, 0, 20 + (i % 200) as u8)
}

/// `n` free UDP ports on loopback (bound and released: a picker binds its own a moment
/// later).
fn free_udp_ports(n: usize) -> anyhow::Result<Vec<u16>> {
    let sockets = (0..n)
        .map(|_| std::net::UdpSocket::bind((std::net::Ipv4Addr::LOCALHOST, 0)))
        .collect::<std::io::Result<Vec<_>>>()?;
    Ok(sockets
        .iter()
        .map(|s| s.local_addr().map(|a| a.port()))
        .collect::<std::io::Result<Vec<_>>>()?)
}

/// See the module documentation.
pub struct LivePickers {
    spawner: Spawner,
    /// Each picker's base URL (`http://host:port`); `None` while it restarts.
    urls: Vec<watch::Sender<Option<Arc<str>>>>,
    running: tokio::sync::Mutex<Vec<Option<Picker>>>,
    /// Picker `i` was restarted (its metrics start from zero again).
    restarted: Vec<AtomicBool>,
}

impl LivePickers {
    /// Start `n` pickers running `policy` in front of `engines`, each ready before it returns.
    pub async fn start(
        exe: PathBuf,
        opts: &BenchOptions,
        policy: PolicySpec,
        engines: EnginesInfo,
        http: &reqwest::Client,
        n: usize,
    ) -> anyhow::Result<Self> {
        // several pickers exchange their in-flight counts, as the service's replicas do
        let peer_ports = if n > 1 && opts.peer_sync_ms > 0.0 {
            free_udp_ports(n)?
        } else {
            Vec::new()
        };
        let copy_port = if opts.warm_start == crate::WarmStartSource::Peer {
            let port = std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0))?
                .local_addr()?
                .port();
            let key = super::procs::work_dir()?.join("peer.key");
            std::fs::write(
                &key,
                format!("bench-pool-key-{:032x}", rand::random::<u128>()),
            )?;
            Some((port, key))
        } else {
            None
        };
        let spawner = Spawner {
            exe,
            opts: opts.clone(),
            policy,
            engines,
            http: http.clone(),
            peer_ports,
            copy_port,
        };
        let mut running = Vec::new();
        let mut urls = Vec::new();
        for i in 0..n.max(1) {
            let p = spawner.start(i, true).await?;
            urls.push(watch::Sender::new(Some(Arc::from(format!(
                "http://{}",
                p.http
            )))));
            running.push(Some(p));
        }
        Ok(Self {
            restarted: (0..running.len()).map(|_| AtomicBool::new(false)).collect(),
            spawner,
            urls,
            running: tokio::sync::Mutex::new(running),
        })
    }

    pub fn len(&self) -> usize {
        self.urls.len()
    }

    pub fn is_empty(&self) -> bool {
        self.urls.is_empty()
    }

    /// The base URL of picker `i`, waiting while it restarts (`None` after
    /// [`WAIT_FOR_PICKER`]).
    pub async fn url(&self, i: usize) -> Option<Arc<str>> {
        let mut rx = self.urls.get(i)?.subscribe();
        let got = tokio::time::timeout(WAIT_FOR_PICKER, rx.wait_for(Option::is_some)).await;
        match got {
            Ok(Ok(u)) => u.clone(),
            _ => None,
        }
    }

    /// Picker `i`'s metrics address, and whether it restarted during the run.
    pub async fn metrics(&self, i: usize) -> Option<(SocketAddr, bool)> {
        let running = self.running.lock().await;
        let p = running.get(i)?.as_ref()?;
        Some((p.metrics, self.restarted[i].load(Ordering::Relaxed)))
    }

    /// Kill picker `i` (the requests it holds fail) and start it again with an empty state.
    /// `replay`: the new picker asks the engines for their buffered events; without it the
    /// replay window has passed.
    pub async fn restart(&self, i: usize, replay: bool) -> anyhow::Result<()> {
        let mut running = self.running.lock().await;
        let slot = running
            .get_mut(i)
            .ok_or_else(|| anyhow::anyhow!("there is no picker {i}"))?;
        self.urls[i].send_replace(None);
        if let Some(old) = slot.take() {
            old.guard.stop().await;
        }
        self.restarted[i].store(true, Ordering::Relaxed);
        let p = self.spawner.start(i, replay).await?;
        self.urls[i].send_replace(Some(Arc::from(format!("http://{}", p.http))));
        *slot = Some(p);
        Ok(())
    }

    /// Stop every picker.
    pub async fn stop(&self) {
        let mut running = self.running.lock().await;
        for p in running.iter_mut().filter_map(Option::take) {
            p.guard.stop().await;
        }
    }
}

impl Spawner {
    async fn start(&self, i: usize, replay: bool) -> anyhow::Result<Picker> {
        let mut engines = self.engines.clone();
        if !replay {
            for e in &mut engines.engines {
                e.replay.clear();
            }
        }
        let ip = match self.copy_port {
            Some(_) => picker_ip(i),
            None => std::net::Ipv4Addr::LOCALHOST,
        };
        let peers = match self.peer_ports.get(i) {
            Some(&own) => PeerSettings {
                listen: Some(SocketAddr::from((ip, own))),
                addresses: (self.peer_ports.iter().enumerate())
                    .filter(|&(j, _)| j != i)
                    .map(|(j, &p)| match self.copy_port {
                        Some(_) => SocketAddr::from((picker_ip(j), p)),
                        None => SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, p)),
                    })
                    .collect(),
                interval: Duration::from_millis(self.opts.peer_sync_ms.round().max(5.0) as u64),
                group: "bench".into(),
                key_file: self
                    .copy_port
                    .as_ref()
                    .map(|(_, k)| k.display().to_string()),
                ..PeerSettings::default()
            },
            None => PeerSettings::default(),
        };
        let warm = match self.opts.warm_start {
            crate::WarmStartSource::None => WarmStartSettings {
                from_peers: false,
                ..WarmStartSettings::default()
            },
            crate::WarmStartSource::Snapshot => WarmStartSettings {
                snapshot_path: Some(
                    super::procs::work_dir()?
                        .join(format!("picker-{i}.snapshot"))
                        .display()
                        .to_string(),
                ),
                from_peers: false,
                ..WarmStartSettings::default()
            },
            crate::WarmStartSource::Peer => WarmStartSettings {
                peer_port: self.copy_port.as_ref().map(|(p, _)| *p),
                ..WarmStartSettings::default()
            },
        };
        let copy_port = self.copy_port.as_ref().map(|(p, _)| *p);
        let configure = move |cfg: &mut PickerConfig| {
            cfg.peers = peers.clone();
            cfg.warm_start = warm.clone();
            // past the replay window: the engines' lists would name their replay sockets
            cfg.scrape.event_sources = replay;
            if let Some(port) = copy_port {
                cfg.listen.http = SocketAddr::from((ip, 0));
                cfg.listen.admin = SocketAddr::from((ip, 0));
                cfg.listen.metrics = SocketAddr::from((ip, port));
            }
        };
        start_picker_with(
            &self.exe,
            &self.opts,
            &self.policy,
            &engines,
            &self.http,
            &format!("{i}"),
            &configure,
        )
        .await
    }
}
