//! The real-time simulator server: engines of [`Rank`]s behind vLLM's interfaces.
//!
//! One process runs one or more *engines* (a vLLM server each); an engine has `dp_size` ranks.
//! Per engine: HTTP on one port for all ranks (rank by `X-data-parallel-rank` header, SGLang's
//! `data_parallel_rank` body field, or least `4*waiting + running`), or one port per rank with
//! `dp_rank_ports`; per rank a ZMQ PUB socket for KV events on `kv_events + rank` and a ROUTER
//! replay socket on `kv_replay + rank`. Each rank's driver task steps its engine model and
//! sleeps each step's modelled duration divided by the speed-up.
//!
//! Ports: with `port = P`, engine `i` uses `P + i * stride` (and `+ rank` in rank-port mode);
//! the event ports likewise. Port 0 (and `PortSpec::Auto` for events) binds ephemeral ports;
//! [`SimHandle::ports_json`] tells which.

mod events;
pub mod fault;
mod http;
mod kv_transfer;
mod listen;
pub mod metrics;
mod rank;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use kvroute_routing::kv_events::EventEncoding;
use kvroute_routing::tokenize::{PromptTokenizer, PromptTokenizerOptions};
use parking_lot::Mutex;
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use zeromq::{PubSocket, RouterSocket, Socket};

use crate::engine::{EngineConfig, Rank};
use events::{DropPolicy, GarbagePolicy, PublisherConfig, PublisherState};
pub use fault::{CrashMode, Fault, FaultSpec, SeqMode};
pub use metrics::Flavor;
use rank::{Clock, RankState};

/// Where an optional ZMQ socket listens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PortSpec {
    /// Not published (an approximate-mode engine).
    #[default]
    Disabled,
    /// Ephemeral ports (tests).
    Auto,
    /// Base port; rank `k` of engine `i` uses `base + i * stride + k`.
    Base(u16),
}

impl FromStr for PortSpec {
    type Err = String;

    /// `0` or `off` = disabled, `auto` = ephemeral, else a port number.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "0" | "off" | "" => Ok(Self::Disabled),
            "auto" => Ok(Self::Auto),
            n => n
                .parse::<u16>()
                .map(Self::Base)
                .map_err(|_| format!("expected a port, 0/off or auto, got {n:?}")),
        }
    }
}

/// Configuration of a simulator process.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub host: IpAddr,
    /// HTTP port of engine 0 (0 = ephemeral).
    pub port: u16,
    pub engines: usize,
    /// Port distance between engines; `None` = `dp_size`.
    pub port_stride: Option<u16>,
    pub dp_size: u32,
    /// One HTTP port per rank (`port + rank`) instead of one for all ranks.
    pub dp_rank_ports: bool,
    /// Served model name.
    pub model: String,
    /// LoRA adapters served next to the base model (requests name them in `model`).
    pub lora_modules: Vec<String>,
    pub flavor: Flavor,
    /// Engine model of every rank; `hash_seed` is replaced per engine from `seed`.
    pub engine: EngineConfig,
    pub speedup: f64,
    pub seed: u64,
    pub kv_events: PortSpec,
    pub kv_replay: PortSpec,
    pub kv_topic: String,
    pub kv_encoding: EventEncoding,
    /// Serve `GET /kv_event_sources` (vLLM 0.32 and later; the `vllm` flavor only): each
    /// rank's bound publisher and replay endpoints.
    pub kv_event_sources: bool,
    /// Batches kept for replay per rank.
    pub replay_buffer: usize,
    /// Waiting requests per rank beyond which new ones get 429.
    pub max_waiting: usize,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// `max_tokens` when a request does not say.
    pub default_max_tokens: u32,
    /// Faults to apply (at `after_ms` from start).
    pub faults: Vec<FaultSpec>,
    /// Hugging Face tokenizer: a `tokenizer.json` file, or a directory holding it (and
    /// optionally `tokenizer_config.json` with the chat template). `None` = the picker's
    /// character fallback (one id per code point), which is what the router uses without a
    /// tokenizer, so both sides see the same ids.
    pub tokenizer: Option<PathBuf>,
    /// A NIXL-style KV connector (`kv_transfer_params`, see [`kv_transfer`]), and what a
    /// decode does when its KV cannot be pulled; `None`: no connector, the parameters are
    /// ignored as vLLM ignores them without one.
    pub kv_transfer: Option<KvLoadFailure>,
}

/// What a decode engine does when the remote KV named in its request cannot be pulled
/// (vLLM's `kv_load_failure_policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvLoadFailure {
    /// Prefill the prompt itself (`recompute`).
    Recompute,
    /// Fail the request before any output (`fail`, vLLM 0.32's default).
    Fail,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: 0,
            engines: 1,
            port_stride: None,
            dp_size: 1,
            dp_rank_ports: false,
            model: "sim-model".into(),
            lora_modules: Vec::new(),
            flavor: Flavor::Vllm,
            engine: EngineConfig::default(),
            speedup: 1.0,
            seed: 0,
            kv_events: PortSpec::Disabled,
            kv_replay: PortSpec::Disabled,
            kv_topic: String::new(),
            kv_encoding: EventEncoding::MapEvents,
            kv_event_sources: true,
            replay_buffer: 10_000,
            max_waiting: 4096,
            max_body_bytes: 64 << 20,
            default_max_tokens: 16,
            faults: Vec::new(),
            tokenizer: None,
            kv_transfer: None,
        }
    }
}

impl SimConfig {
    fn stride(&self) -> u16 {
        self.port_stride
            .unwrap_or(self.dp_size.clamp(1, u32::from(u16::MAX)) as u16)
            .max(1)
    }

    /// Checks values a command line could get wrong.
    ///
    /// # Errors
    /// A description of the first bad value.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.engines >= 1, "--engines must be at least 1");
        anyhow::ensure!(
            (1..=64).contains(&self.dp_size),
            "--dp-size must be within 1..=64"
        );
        anyhow::ensure!(
            self.speedup.is_finite() && self.speedup > 0.0,
            "--speedup must be a positive number"
        );
        anyhow::ensure!(
            self.engine.block_size >= 1 && self.engine.num_blocks >= 2,
            "--block-size must be at least 1 and --kv-blocks at least 2 (one is the null block)"
        );
        anyhow::ensure!(
            self.default_max_tokens >= 1,
            "default max_tokens must be >= 1"
        );
        for f in &self.faults {
            f.validate().map_err(anyhow::Error::msg)?;
        }
        Ok(())
    }
}

/// Addresses an engine listens on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineAddrs {
    /// The HTTP address (rank 0's in rank-port mode).
    pub http: SocketAddr,
    /// HTTP address per rank (all equal to `http` unless in rank-port mode).
    pub http_ranks: Vec<SocketAddr>,
    /// KV event PUB address per rank (empty when disabled).
    pub kv_events: Vec<SocketAddr>,
    /// Replay ROUTER address per rank (empty when disabled).
    pub replay: Vec<SocketAddr>,
}

/// One incarnation of an engine: its ranks and tasks. A crash cancels it; a restart after a
/// crash builds a new one on the same ports.
pub(crate) struct Runtime {
    pub cfg: Arc<SimConfig>,
    pub index: usize,
    pub ranks: Vec<Arc<RankState>>,
    pub clock: Clock,
    pub hang: watch::Sender<bool>,
    pub cancel: CancellationToken,
    pub next_id: AtomicU64,
    pub tokenizer: Arc<PromptTokenizer>,
}

/// An engine across its incarnations.
pub(crate) struct EngineSlot {
    pub cfg: Arc<SimConfig>,
    tokenizer: Arc<PromptTokenizer>,
    pub index: usize,
    addrs: Mutex<Option<EngineAddrs>>,
    current: Mutex<Option<Arc<Runtime>>>,
    generation: AtomicU64,
    process: CancellationToken,
}

/// A running simulator process (or an in-process instance for tests).
pub struct SimHandle {
    engines: Vec<Arc<EngineSlot>>,
    cancel: CancellationToken,
}

/// Starts every engine and schedules the configured faults.
///
/// # Errors
/// A bad configuration or a port that cannot be bound.
pub async fn start(config: SimConfig) -> anyhow::Result<SimHandle> {
    config.validate()?;
    let tokenizer = Arc::new(load_tokenizer(
        config.tokenizer.as_deref(),
        config.max_body_bytes,
    )?);
    let cfg = Arc::new(config);
    let cancel = CancellationToken::new();
    let mut engines = Vec::with_capacity(cfg.engines);
    for index in 0..cfg.engines {
        let slot = Arc::new(EngineSlot {
            cfg: cfg.clone(),
            tokenizer: tokenizer.clone(),
            index,
            addrs: Mutex::new(None),
            current: Mutex::new(None),
            generation: AtomicU64::new(0),
            process: cancel.clone(),
        });
        launch(&slot).await?;
        engines.push(slot);
    }
    let handle = SimHandle { engines, cancel };
    for spec in &cfg.faults {
        for slot in &handle.engines {
            if spec.engine.is_none_or(|e| e == slot.index) {
                schedule_fault(slot.clone(), spec.clone());
            }
        }
    }
    Ok(handle)
}

impl EngineSlot {
    /// The HTTP address of the engine now.
    pub(crate) fn http_addr(&self) -> Option<SocketAddr> {
        self.addrs.lock().as_ref().map(|a| a.http)
    }
}

impl SimHandle {
    /// Addresses of every engine, in engine order.
    pub fn addrs(&self) -> Vec<EngineAddrs> {
        self.engines
            .iter()
            .filter_map(|s| s.addrs.lock().clone())
            .collect()
    }

    /// The one-line JSON harnesses read from stdout:
    /// `{"engines":[{"http":"ip:port","http_ranks":[..],"kv_events":[..],"replay":[..]}]}`.
    pub fn ports_json(&self) -> serde_json::Value {
        let s = |v: &[SocketAddr]| v.iter().map(ToString::to_string).collect::<Vec<_>>();
        json!({
            "engines": self.addrs().iter().map(|a| json!({
                "http": a.http.to_string(),
                "http_ranks": s(&a.http_ranks),
                "kv_events": s(&a.kv_events),
                "replay": s(&a.replay),
            })).collect::<Vec<_>>()
        })
    }

    /// Applies a fault to engine `engine` now (or after its `after_ms`).
    ///
    /// # Errors
    /// An unknown engine or a fault with bad numbers.
    pub async fn inject(&self, engine: usize, spec: FaultSpec) -> anyhow::Result<()> {
        spec.validate().map_err(anyhow::Error::msg)?;
        let slot = self
            .engines
            .get(engine)
            .with_context(|| format!("no engine {engine}"))?;
        if spec.after_ms.is_none() {
            apply_fault(slot, &spec).await;
        } else {
            schedule_fault(slot.clone(), spec);
        }
        Ok(())
    }

    /// Stops every engine (listeners, connections, sockets, drivers).
    pub fn shutdown(&self) {
        self.cancel.cancel();
    }

    /// Resolves when [`Self::shutdown`] was called.
    pub async fn stopped(&self) {
        self.cancel.cancelled().await;
    }
}

impl Drop for SimHandle {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// The picker's tokenizer, so that router and simulator produce identical ids.
fn load_tokenizer(path: Option<&Path>, max_body_bytes: usize) -> anyhow::Result<PromptTokenizer> {
    let mut options = PromptTokenizerOptions::default();
    options.limits.max_prompt_bytes = options.limits.max_prompt_bytes.max(max_body_bytes);
    let Some(path) = path else {
        return PromptTokenizer::new(None, None, options).context("building the tokenizer");
    };
    let (json_path, dir) = if path.is_dir() {
        (path.join("tokenizer.json"), path.to_path_buf())
    } else {
        (
            path.to_path_buf(),
            path.parent().map_or_else(PathBuf::new, Path::to_path_buf),
        )
    };
    let json =
        std::fs::read(&json_path).with_context(|| format!("reading {}", json_path.display()))?;
    let config_path = dir.join("tokenizer_config.json");
    let config = match std::fs::read_to_string(&config_path) {
        Ok(c) => Some(c),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(e).with_context(|| format!("reading {}", config_path.display())),
    };
    PromptTokenizer::from_hf_files(Some(&json), config.as_deref(), options)
        .with_context(|| format!("loading the tokenizer from {}", path.display()))
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Ports of the first incarnation, from the configuration.
fn planned(base: u16, index: usize, stride: u16, rank: u32) -> anyhow::Result<u16> {
    if base == 0 {
        return Ok(0);
    }
    let p = u64::from(base) + index as u64 * u64::from(stride) + u64::from(rank);
    u16::try_from(p).with_context(|| format!("port {p} out of range"))
}

/// Builds and starts an incarnation of `slot`'s engine on its recorded ports (or the planned
/// ones the first time).
async fn launch(slot: &Arc<EngineSlot>) -> anyhow::Result<()> {
    let cfg = slot.cfg.clone();
    let index = slot.index;
    let stride = cfg.stride();
    let previous = slot.addrs.lock().clone();
    let generation = slot.generation.fetch_add(1, Ordering::Relaxed);
    let host = cfg.host;
    let zhost = match host {
        IpAddr::V4(a) => a.to_string(),
        IpAddr::V6(a) => format!("[{a}]"),
    };

    // HTTP listeners.
    let mut listeners = Vec::new();
    let http_ports: Vec<u16> = match &previous {
        Some(a) if cfg.dp_rank_ports => a.http_ranks.iter().map(SocketAddr::port).collect(),
        Some(a) => vec![a.http.port()],
        None if cfg.dp_rank_ports => (0..cfg.dp_size)
            .map(|k| planned(cfg.port, index, stride, k))
            .collect::<anyhow::Result<_>>()?,
        None => vec![planned(cfg.port, index, stride, 0)?],
    };
    for port in &http_ports {
        let l = TcpListener::bind(SocketAddr::new(host, *port))
            .await
            .with_context(|| format!("cannot bind HTTP on {host}:{port}"))?;
        listeners.push(l);
    }
    let bound_http: Vec<SocketAddr> = listeners
        .iter()
        .map(TcpListener::local_addr)
        .collect::<Result<_, _>>()?;

    let cancel = slot.process.child_token();
    let clock = Clock::new(cfg.speedup);
    let (hang_tx, _) = watch::channel(false);
    let mut ranks = Vec::new();
    let mut kv_addrs = Vec::new();
    let mut replay_addrs = Vec::new();
    for k in 0..cfg.dp_size {
        let port_for =
            |spec: PortSpec, prev: Option<&Vec<SocketAddr>>| -> anyhow::Result<Option<u16>> {
                Ok(match (spec, prev.and_then(|v| v.get(k as usize))) {
                    (PortSpec::Disabled, _) => None,
                    (_, Some(a)) => Some(a.port()),
                    (PortSpec::Auto, None) => Some(0),
                    (PortSpec::Base(b), None) => Some(planned(b, index, stride, k)?),
                })
            };
        let publisher = Arc::new(Mutex::new(PublisherState::default()));
        let mut events_tx = None;
        if let Some(port) = port_for(cfg.kv_events, previous.as_ref().map(|a| &a.kv_events))? {
            let mut pub_socket = PubSocket::new();
            let p = events::bind_port(&mut pub_socket, &zhost, port).await?;
            kv_addrs.push(SocketAddr::new(host, p));
            let replay = match port_for(cfg.kv_replay, previous.as_ref().map(|a| &a.replay))? {
                Some(port) => {
                    let mut router = RouterSocket::new();
                    let p = events::bind_port(&mut router, &zhost, port).await?;
                    replay_addrs.push(SocketAddr::new(host, p));
                    Some(router)
                }
                None => None,
            };
            let (tx, rx) = mpsc::channel(1024);
            events_tx = Some(tx);
            tokio::spawn(events::run_publisher(
                pub_socket,
                replay,
                PublisherConfig {
                    topic: Bytes::from(cfg.kv_topic.clone().into_bytes()),
                    encoding: cfg.kv_encoding,
                    buffer: cfg.replay_buffer,
                    seed: mix(cfg.seed ^ mix(index as u64) ^ u64::from(k) ^ generation),
                },
                publisher.clone(),
                rx,
                cancel.clone(),
            ));
        }
        let mut engine_cfg = cfg.engine.clone();
        engine_cfg.hash_seed = mix(cfg.seed ^ mix(index as u64 + 1) ^ mix(generation));
        let state = Arc::new(RankState::new(
            k,
            Rank::new(engine_cfg),
            events_tx,
            publisher,
            cfg.max_waiting,
            kv_transfer::new_engine_id(index, k),
        ));
        kv_transfer::register(&state);
        tokio::spawn(rank::drive(
            state.clone(),
            clock,
            hang_tx.subscribe(),
            cancel.clone(),
        ));
        tokio::spawn(rank::background(
            state.clone(),
            mix(cfg.seed ^ mix(index as u64) ^ u64::from(k) ^ generation ^ 0xb9),
            cancel.clone(),
        ));
        ranks.push(state);
    }

    let rt = Arc::new(Runtime {
        cfg: cfg.clone(),
        index,
        ranks,
        clock,
        hang: hang_tx,
        cancel: cancel.clone(),
        next_id: AtomicU64::new(1),
        tokenizer: slot.tokenizer.clone(),
    });
    for (k, listener) in listeners.into_iter().enumerate() {
        let fixed_rank = cfg.dp_rank_ports.then_some(k as u32);
        let router = http::router(rt.clone(), slot.clone(), fixed_rank);
        tokio::spawn(listen::serve(listener, router, cancel.clone()));
    }
    let addrs = EngineAddrs {
        http: bound_http[0],
        http_ranks: if cfg.dp_rank_ports {
            bound_http.clone()
        } else {
            vec![bound_http[0]; cfg.dp_size as usize]
        },
        kv_events: kv_addrs,
        replay: replay_addrs,
    };
    tracing::info!(
        engine = index,
        generation,
        http = %addrs.http,
        kv_events = ?addrs.kv_events,
        replay = ?addrs.replay,
        "engine started"
    );
    *slot.addrs.lock() = Some(addrs);
    *slot.current.lock() = Some(rt);
    Ok(())
}

fn schedule_fault(slot: Arc<EngineSlot>, spec: FaultSpec) {
    tokio::spawn(async move {
        if let Some(ms) = spec.after_ms {
            tokio::select! {
                () = slot.process.cancelled() => return,
                () = tokio::time::sleep(Duration::from_millis(ms)) => {}
            }
        }
        apply_fault(&slot, &spec).await;
    });
}

/// Applies a fault to the engine's current incarnation.
pub(crate) async fn apply_fault(slot: &Arc<EngineSlot>, spec: &FaultSpec) {
    let Some(rt) = slot.current.lock().clone() else {
        tracing::warn!(engine = slot.index, "fault ignored: the engine is down");
        return;
    };
    let ranks = rt
        .ranks
        .iter()
        .filter(|r| spec.rank.is_none_or(|k| k == r.rank));
    tracing::warn!(engine = slot.index, fault = ?spec.fault, rank = ?spec.rank, "injecting fault");
    match &spec.fault {
        Fault::Crash {
            mode,
            restart_after_ms,
        } => match mode {
            CrashMode::Exit => {
                tracing::error!("crash fault: exiting");
                std::process::exit(1);
            }
            CrashMode::Close => {
                rt.cancel.cancel();
                *slot.current.lock() = None;
                if let Some(ms) = *restart_after_ms {
                    let slot = slot.clone();
                    tokio::spawn(async move {
                        tokio::select! {
                            () = slot.process.cancelled() => return,
                            () = tokio::time::sleep(Duration::from_millis(ms)) => {}
                        }
                        if let Err(e) = launch(&slot).await {
                            tracing::error!(engine = slot.index, error = %e, "restart after crash failed");
                        }
                    });
                }
            }
        },
        Fault::Hang => {
            rt.hang.send_replace(true);
        }
        Fault::Slow { factor } => {
            for r in ranks {
                r.inner.lock().engine.set_slowdown(*factor);
            }
        }
        Fault::DropEvents {
            fraction,
            replayable,
        } => {
            for r in ranks {
                r.publisher.lock().drop = DropPolicy {
                    fraction: *fraction,
                    replayable: *replayable,
                };
            }
        }
        Fault::GarbageEvents {
            per_second,
            max_bytes,
        } => {
            for r in ranks {
                r.publisher.lock().garbage = Some(GarbagePolicy {
                    per_second: *per_second,
                    max_bytes: *max_bytes,
                });
            }
        }
        Fault::Restart { seq } => {
            for r in ranks {
                r.restart(*seq == SeqMode::Zero).await;
            }
        }
        Fault::BackgroundPrefill {
            tokens_per_second,
            prompt_tokens,
        } => {
            for r in ranks {
                r.background.send_replace(Some(rank::Background {
                    tokens_per_second: *tokens_per_second,
                    prompt_tokens: *prompt_tokens,
                }));
            }
        }
        Fault::Clear => {
            rt.hang.send_replace(false);
            for r in &rt.ranks {
                r.background.send_replace(None);
                r.inner.lock().engine.set_slowdown(1.0);
                let mut publisher = r.publisher.lock();
                publisher.drop = DropPolicy::default();
                publisher.garbage = None;
            }
        }
    }
}
