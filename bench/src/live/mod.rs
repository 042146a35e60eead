//! Live mode: real processes and sockets on loopback.
//!
//! Per policy, on a fresh cluster: the simulated engines run in a child process (this binary's
//! `engines` subcommand: vLLM's HTTP API, `/metrics` and ZMQ KV events), the kvroute picker in
//! another (`picker`, i.e. `kvroute_picker::cli::run`), configured with the policy and every
//! engine's ports, and the runner replays the workload through the picker's OpenAI proxy with
//! streaming requests, in real time scaled by the speed-up. With `--router URL` it replays
//! through a router that is already running instead (any OpenAI-compatible one).
//!
//! Figures come from where a user would take them: latencies from the client's stream, the
//! hit rate and prefill work from the engines' `/metrics` counters, the decision latency from
//! the picker's `/metrics` histogram.

pub mod chat;
pub mod client;
pub mod events;
pub mod pickers;
pub mod procs;
pub mod prom;
pub mod vllm;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use kvroute_picker::config::{CostModelCalibration, RoutingConfig};
use kvroute_picker::pool::{
    DataParallel, KvEventsSpec, ModelConfigSpec, RankSelection, TokenizerSpec,
};
use kvroute_picker::service::settings::{
    IndexSettings, Limits, Listen, PeerSettings, PickerConfig, ScrapeSettings, StaticEndpoint,
};
use kvroute_sim::server::{PortSpec, SimConfig};
use serde::Deserialize;
use tokio::sync::{Semaphore, mpsc};

use super::ceiling::Ceilings;
use super::classes;
use super::driver::{Driver, Issue};
use super::stats::{self, EngineFigures, RequestRecord, RunDetail};
use super::workload::Workload;
use super::workload::tokens::prompt_tokens;
use super::{BenchOptions, ClusterConfig, MODEL, PolicyRun, PolicySpec};
use client::SimClock;
use pickers::LivePickers;
use procs::ChildGuard;

/// Requests in flight from the runner at most (beyond, releases wait).
const MAX_CLIENT_INFLIGHT: usize = 4096;
/// Longest a single request may take (wall time).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(900);
/// How often engine loads are sampled for the report (wall time).
const LOAD_SAMPLE_EVERY: Duration = Duration::from_millis(500);
/// Load samples kept per endpoint.
const MAX_SERIES_POINTS: usize = 2_000;

/// One engine as the `engines` subcommand reports it.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct EngineAddrs {
    pub http: SocketAddr,
    pub http_ranks: Vec<SocketAddr>,
    pub kv_events: Vec<SocketAddr>,
    pub replay: Vec<SocketAddr>,
}

/// The line the `engines` subcommand prints.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct EnginesInfo {
    pub engines: Vec<EngineAddrs>,
}

impl EnginesInfo {
    pub fn from_json(v: serde_json::Value) -> anyhow::Result<Self> {
        let info: Self = serde_json::from_value(v).context("the engines' address JSON")?;
        anyhow::ensure!(!info.engines.is_empty(), "no engines reported");
        Ok(info)
    }
}

/// The simulator configuration of the `engines` subcommand.
pub fn sim_config(cluster: &ClusterConfig, seed: u64, kv_base: Option<u16>) -> SimConfig {
    let (events, replay) = match kv_base {
        Some(b) => {
            let span = (cluster.engines * cluster.dp_size as usize) as u16;
            (PortSpec::Base(b), PortSpec::Base(b.saturating_add(span)))
        }
        None => (PortSpec::Auto, PortSpec::Auto),
    };
    SimConfig {
        port: 0,
        engines: cluster.engines,
        dp_size: cluster.dp_size,
        model: MODEL.into(),
        engine: cluster.engine.clone(),
        speedup: cluster.speedup,
        seed,
        kv_events: events,
        kv_replay: replay,
        // the benchmark's open-loop traces can queue deep at high load: never shed
        max_waiting: 1 << 20,
        max_body_bytes: 64 << 20,
        ..SimConfig::default()
    }
}

/// Arguments that make the `engines` subcommand reproduce `cluster`.
pub fn engines_args(cluster: &ClusterConfig, seed: u64, kv_base: Option<u16>) -> Vec<String> {
    let mut a = vec![
        "engines".into(),
        "--engines".into(),
        cluster.engines.to_string(),
        "--dp-size".into(),
        cluster.dp_size.to_string(),
        "--block-size".into(),
        cluster.engine.block_size.to_string(),
        "--kv-blocks".into(),
        cluster.engine.num_blocks.to_string(),
        "--max-num-seqs".into(),
        cluster.engine.max_num_seqs.to_string(),
        "--max-batched-tokens".into(),
        cluster.engine.max_num_batched_tokens.to_string(),
        "--speedup".into(),
        cluster.speedup.to_string(),
        "--seed".into(),
        seed.to_string(),
        "--exit-on-stdin-close".into(),
    ];
    if let Some(b) = kv_base {
        a.push("--kv-events-port".into());
        a.push(b.to_string());
    }
    a
}

/// The picker's configuration for a cluster and a policy (written as JSON, which is YAML).
pub fn picker_config(
    info: &EnginesInfo,
    cluster: &ClusterConfig,
    routing: &RoutingConfig,
    scrape_ms: f64,
    tokenizer: Option<TokenizerSpec>,
) -> anyhow::Result<PickerConfig> {
    let first = &info.engines[0];
    let port0 = |v: &[SocketAddr]| v.first().map(SocketAddr::port);
    let kv_events = match (port0(&first.kv_events), port0(&first.replay)) {
        (Some(p), replay) => Some(KvEventsSpec {
            port: p,
            topic: String::new(),
            replay_port: replay,
        }),
        (None, _) => None,
    };
    let spec = ModelConfigSpec {
        name: "sim".into(),
        model: MODEL.into(),
        engine: kvroute_picker::pool::EngineKind::Vllm,
        port: first.http.port(),
        block_size: cluster.engine.block_size,
        data_parallel: DataParallel {
            size: cluster.dp_size,
            rank_selection: RankSelection::Header,
        },
        kv_events,
        tokenizer,
        lora_adapters: Vec::new(),
        pod_selector: BTreeMap::new(),
        kv_capacity_blocks: Some(u64::from(cluster.engine.num_blocks)),
        kv_offload: None,
        lora_load_ms: None,
        lora_slot_wait_ms: None,
    };
    let endpoints = info
        .engines
        .iter()
        .map(|e| StaticEndpoint {
            address: e.http.ip(),
            model_config: "sim".into(),
            port: Some(e.http.port()),
            labels: BTreeMap::new(),
            role: None,
            kv_events_port: port0(&e.kv_events),
            kv_replay_port: port0(&e.replay),
        })
        .collect();
    let lo = |p| SocketAddr::from(([127, 0, 0, 1], p));
    let cfg = PickerConfig {
        listen: Listen {
            http: lo(0),
            metrics: lo(0),
            admin: lo(0),
            ext_proc: None,
            ext_proc_tls: None,
            admin_token_file: None,
        },
        model_configs: vec![spec],
        endpoints,
        routing: RoutingConfig {
            cost_model: CostModelCalibration {
                max_batched_tokens: cluster.engine.max_num_batched_tokens,
                ..routing.cost_model
            },
            ..routing.clone()
        },
        tenancy: Default::default(),
        limits: Limits {
            upstream_timeout: REQUEST_TIMEOUT,
            idle_timeout: REQUEST_TIMEOUT,
            max_inflight_per_endpoint: 1 << 20,
            max_inflight_total: 1 << 20,
            max_body_bytes: 64 << 20,
            ..Limits::default()
        },
        scrape: ScrapeSettings {
            interval: Duration::from_millis(scrape_ms.max(10.0) as u64),
            ..ScrapeSettings::default()
        },
        index: IndexSettings {
            default_kv_capacity_blocks: u64::from(cluster.engine.num_blocks),
            ..IndexSettings::default()
        },
        peers: PeerSettings::default(),
        warm_start: Default::default(),
    };
    cfg.validate()
        .map_err(|e| anyhow::anyhow!("generated picker config: {e}"))?;
    Ok(cfg)
}

/// Where to send requests and what to scrape.
#[derive(Clone)]
pub struct Target {
    /// Base URL of the router (`http://127.0.0.1:8080`), or [`DIRECT`]: no router, each
    /// request goes straight to one of `engines`, round robin by request id (the baseline
    /// for the latency a router adds). Ignored when `pickers` is set.
    pub router: String,
    /// Our own pickers: requests go to them in turn, and a scenario can restart them.
    pub pickers: Option<Arc<LivePickers>>,
    /// Name in the report.
    pub name: String,
    /// The picker's metrics address, for its decision latency (with `pickers`: the last
    /// picker's).
    pub picker_metrics: Option<SocketAddr>,
    /// The engines behind it, for their counters (may be empty).
    pub engines: Vec<EngineAddrs>,
}

/// A running cluster of child processes for one policy.
pub struct Cluster {
    pub engines: EnginesInfo,
    pub pickers: Arc<LivePickers>,
    guards: Vec<ChildGuard>,
}

impl Cluster {
    /// Engines that run elsewhere (real ones) and `opts.pickers` pickers of ours.
    pub async fn with_pickers(
        exe: &Path,
        opts: &BenchOptions,
        policy: &PolicySpec,
        engines: EnginesInfo,
        http: &reqwest::Client,
    ) -> anyhow::Result<Self> {
        let pickers = LivePickers::start(
            exe.to_path_buf(),
            opts,
            *policy,
            engines.clone(),
            http,
            opts.pickers,
        )
        .await?;
        Ok(Self {
            engines,
            pickers: Arc::new(pickers),
            guards: Vec::new(),
        })
    }

    /// Where the replay sends requests: through these pickers.
    pub fn target(&self, name: String) -> Target {
        Target {
            router: String::new(),
            pickers: Some(self.pickers.clone()),
            name,
            picker_metrics: None,
            engines: self.engines.engines.clone(),
        }
    }

    pub async fn stop(self) {
        self.pickers.stop().await;
        for g in self.guards {
            g.stop().await;
        }
    }
}

/// This executable (children are its own subcommands).
pub fn self_exe() -> anyhow::Result<PathBuf> {
    std::env::current_exe().context("locating the kvroute-bench executable")
}

/// Start the engines child process.
pub async fn start_engines(
    exe: &Path,
    cluster: &ClusterConfig,
    seed: u64,
    tag: &str,
) -> anyhow::Result<(ChildGuard, EnginesInfo)> {
    // one publisher port per rank must be contiguous for the picker's `port + rank` rule;
    // ephemeral ports are not, so multi-rank engines take a random base and retry on clashes
    let mut last_err = None;
    for attempt in 0..6u64 {
        let base = (cluster.dp_size > 1).then(|| {
            let r = super::workload::tokens::mix64(seed ^ attempt ^ u64::from(std::process::id()));
            20_000 + (r % 30_000) as u16
        });
        let args = engines_args(cluster, seed, base);
        match procs::spawn_with_json(
            exe,
            &args,
            &format!("engines-{tag}"),
            Duration::from_secs(30),
        )
        .await
        {
            Ok((guard, v)) => return Ok((guard, EnginesInfo::from_json(v)?)),
            Err(e) => last_err = Some(e),
        }
        if base.is_none() {
            break;
        }
    }
    Err(last_err.unwrap_or_else(|| anyhow::anyhow!("engines did not start")))
}

/// Start engines and `opts.pickers` pickers running `policy`, and wait until they are ready.
pub async fn start_cluster(
    exe: &Path,
    opts: &BenchOptions,
    policy: &PolicySpec,
    http: &reqwest::Client,
) -> anyhow::Result<Cluster> {
    let tag = policy.name().replace(':', "-");
    let (eng_guard, engines) = start_engines(exe, &opts.cluster, opts.seed, &tag).await?;
    let mut cluster = Cluster::with_pickers(exe, opts, policy, engines, http).await?;
    cluster.guards.push(eng_guard);
    Ok(cluster)
}

/// A picker child process.
pub struct Picker {
    pub guard: ChildGuard,
    pub http: SocketAddr,
    pub metrics: SocketAddr,
}

/// Start a picker running `policy` in front of `engines`, exchanging in-flight counts with
/// `peers`, and wait until it is ready. `suffix` tells its config and log apart from the
/// other pickers'.
pub async fn start_picker_with(
    exe: &Path,
    opts: &BenchOptions,
    policy: &PolicySpec,
    engines: &EnginesInfo,
    http: &reqwest::Client,
    suffix: &str,
    configure: &(dyn Fn(&mut PickerConfig) + Send + Sync),
) -> anyhow::Result<Picker> {
    // unique in this process: runs side by side (tests, `--jobs`) must not share a config file
    static STARTED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tag = format!("{}-{suffix}-{n}", policy.name().replace(':', "-"));
    let routing = policy.routing(&opts.routing);
    // chat mode: the picker tokenizes conversations as the engines do
    let tokenizer = opts.chat_tokenizer.as_ref().map(|dir| TokenizerSpec {
        path: Some(dir.join("tokenizer.json").display().to_string()),
        config_path: Some(dir.join("tokenizer_config.json").display().to_string()),
        ..TokenizerSpec::default()
    });
    let mut cfg = picker_config(engines, &opts.cluster, &routing, opts.scrape_ms, tokenizer)?;
    cfg.index.provisional_ttl = opts.index_settings().provisional_ttl;
    configure(&mut cfg);
    spawn_picker(exe, &cfg, &tag, http).await
}

/// Start a picker with configuration `cfg` (its config file and log named by `tag`) and wait
/// until it is ready: endpoints loaded and scraped, subscriptions given time to connect.
pub async fn spawn_picker(
    exe: &Path,
    cfg: &PickerConfig,
    tag: &str,
    http: &reqwest::Client,
) -> anyhow::Result<Picker> {
    cfg.validate()
        .map_err(|e| anyhow::anyhow!("generated picker config: {e}"))?;
    let path = procs::work_dir()?.join(format!("picker-{tag}.yaml"));
    std::fs::write(&path, serde_json::to_string_pretty(cfg)?)
        .with_context(|| format!("writing {}", path.display()))?;
    let args = vec![
        "picker".to_string(),
        "--config".into(),
        path.display().to_string(),
        "--print-addresses".into(),
        "--exit-on-stdin-close".into(),
    ];
    let (picker_guard, v) = procs::spawn_with_json(
        exe,
        &args,
        &format!("picker-{tag}"),
        Duration::from_secs(30),
    )
    .await?;
    let addr = |k: &str| -> anyhow::Result<SocketAddr> {
        v.get(k)
            .and_then(|x| x.as_str())
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("the picker's address line has no {k}: {v}"))
    };
    let http_addr = addr("http")?;
    let metrics = addr("metrics")?;
    // ready: endpoints loaded and scraped
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ok = http
            .get(format!("http://{metrics}/readyz"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if ok {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the picker did not become ready within 30 s (log: {})",
            picker_guard.log.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // let the KV event subscriptions connect (ZMQ drops what is published before)
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok(Picker {
        guard: picker_guard,
        http: http_addr,
        metrics,
    })
}

/// GET `url` as text, within 5 s and [`prom::MAX_BYTES`]; `None` on any failure.
pub(crate) async fn fetch(http: &reqwest::Client, url: &str) -> Option<String> {
    let resp = tokio::time::timeout(Duration::from_secs(5), http.get(url).send())
        .await
        .ok()?
        .ok()?;
    if !resp.status().is_success() {
        return None;
    }
    let bytes = tokio::time::timeout(Duration::from_secs(5), resp.bytes())
        .await
        .ok()?
        .ok()?;
    if bytes.len() > prom::MAX_BYTES {
        return None;
    }
    String::from_utf8(bytes.to_vec()).ok()
}

/// Counters of every engine rank: `(engine index, rank) → counters`.
async fn engine_counters(
    http: &reqwest::Client,
    engines: &[EngineAddrs],
) -> BTreeMap<(usize, u32), prom::RankCounters> {
    let mut out = BTreeMap::new();
    for (i, e) in engines.iter().enumerate() {
        if let Some(text) = fetch(http, &format!("http://{}/metrics", e.http)).await {
            for (rank, c) in prom::engine_counters(&text) {
                out.insert((i, rank), c);
            }
        }
    }
    out
}

const DECISION_HISTOGRAM: &str = "kvroute_picker_decision_seconds";

/// [`Target::router`] value for "no router".
pub const DIRECT: &str = "direct";

/// Replay `workload` through `target`, recording as it goes. `progress(done, total, errors)`.
pub async fn replay(
    workload: &Workload,
    target: &Target,
    opts: &BenchOptions,
    http: &reqwest::Client,
    progress: &(dyn Fn(usize, usize, usize) + Sync),
) -> anyhow::Result<PolicyRun> {
    let speedup = opts.cluster.speedup;
    anyhow::ensure!(
        speedup.is_finite() && speedup > 0.0,
        "--speedup must be positive"
    );
    let api = if opts.chat {
        "v1/chat/completions"
    } else {
        "v1/completions"
    };
    let urls: Vec<Arc<str>> = if target.pickers.is_some() {
        Vec::new()
    } else if target.router == DIRECT {
        anyhow::ensure!(
            !target.engines.is_empty(),
            "--router direct needs the engines (--engines-json)"
        );
        target
            .engines
            .iter()
            .map(|e| Arc::from(format!("http://{}/{api}", e.http)))
            .collect()
    } else {
        vec![Arc::from(format!(
            "{}/{api}",
            target.router.trim_end_matches('/')
        ))]
    };
    let before = engine_counters(http, &target.engines).await;
    // with our pickers: the last one's (a scenario restarts the first)
    let metrics_of = |pickers: Option<Arc<LivePickers>>| async move {
        match pickers {
            Some(p) => p.metrics(p.len().saturating_sub(1)).await,
            None => None,
        }
    };
    let picker_metrics = match metrics_of(target.pickers.clone()).await {
        Some((m, _)) => Some(m),
        None => target.picker_metrics,
    };
    let picker_before = match picker_metrics {
        Some(m) => fetch(http, &format!("http://{m}/metrics")).await,
        None => None,
    };
    let hist_before = picker_before
        .as_deref()
        .map(|t| prom::histogram(t, DECISION_HISTOGRAM))
        .unwrap_or_default();

    let clock = SimClock {
        start: Instant::now(),
        speedup,
    };
    let scenario = (!opts.scenario.is_empty()).then(|| {
        tokio::spawn(events::play(
            opts.scenario.clone(),
            target.engines.clone(),
            target.pickers.clone(),
            clock,
            http.clone(),
        ))
    });
    // per-engine load samples for the report
    let sampler_stop = tokio_util::sync::CancellationToken::new();
    let sampler = {
        let http = http.clone();
        let engines = target.engines.clone();
        let stop = sampler_stop.clone();
        tokio::spawn(async move {
            let mut series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
            loop {
                let t = clock.now_ms() / 1000.0;
                for e in &engines {
                    if let Some(text) = fetch(&http, &format!("http://{}/metrics", e.http)).await {
                        for (rank, c) in prom::engine_counters(&text) {
                            let s = series.entry(format!("{}#{rank}", e.http)).or_default();
                            if s.len() < 200_000 {
                                s.push((t, c.waiting + c.running));
                            }
                        }
                    }
                }
                tokio::select! {
                    () = stop.cancelled() => break,
                    () = tokio::time::sleep(LOAD_SAMPLE_EVERY) => {}
                }
            }
            series
        })
    };

    let mut driver = Driver::new(workload, opts.max_requests).with_deadline(opts.max_duration_ms);
    let total = driver.total_requests();
    let mut ceilings = Ceilings::new(
        workload.block_tokens,
        opts.cluster.engine.block_size,
        opts.cluster.capacity_tokens(),
    );
    let (tx, mut rx) = mpsc::channel::<(u64, usize, RequestRecord)>(MAX_CLIENT_INFLIGHT);
    let slots = Arc::new(Semaphore::new(MAX_CLIENT_INFLIGHT));
    let session_header: Option<Arc<str>> = opts
        .session_header
        .then(|| Arc::from(opts.routing.session_header.as_str()));
    let mut records: Vec<RequestRecord> = Vec::with_capacity(total.min(1 << 20));
    let mut record_class: Vec<usize> = Vec::with_capacity(total.min(1 << 20));
    let mut record_ids: Vec<u64> = Vec::with_capacity(total.min(1 << 20));
    let mut issues: Vec<Issue> = Vec::new();
    let mut errors = 0usize;
    let block_tokens = workload.block_tokens;
    let vocab = opts.token_vocab;
    let chats = opts
        .chat
        .then(|| Arc::new(parking_lot::Mutex::new(chat::ChatSessions::default())));
    loop {
        for issue in issues.drain(..) {
            ceilings.observe(&issue.hash_ids, issue.input_len);
            let permit = slots
                .clone()
                .acquire_owned()
                .await
                .context("client slots closed")?;
            let tx = tx.clone();
            let http = http.clone();
            let fixed_url =
                (!urls.is_empty()).then(|| urls[(issue.id % urls.len() as u64) as usize].clone());
            let pickers = target.pickers.clone();
            let class = classes::of(opts, issue.session);
            let class_headers = classes::headers(opts, class);
            let session_header = session_header.clone();
            let chats = chats.clone();
            tokio::spawn(async move {
                let mut prompt = prompt_tokens(&issue.hash_ids, block_tokens, issue.input_len);
                if let Some(v) = vocab {
                    for t in &mut prompt {
                        *t = super::workload::tokens::fold_into_vocab(*t, v);
                    }
                }
                let messages = chats.as_ref().map(|c| {
                    c.lock()
                        .next(issue.session, &prompt, issue.output_len, block_tokens)
                });
                let mut headers: Vec<(&str, String)> = class_headers;
                if let Some(h) = session_header.as_deref() {
                    headers.push((h, format!("s{}", issue.session)));
                }
                let input = match &messages {
                    Some(m) => client::Input::Messages(m),
                    None => client::Input::Prompt(&prompt),
                };
                // our pickers: the one whose turn it is, waiting while it restarts
                let url = match (fixed_url, &pickers) {
                    (Some(u), _) => Some(u),
                    (None, Some(p)) => p
                        .url((issue.id % p.len().max(1) as u64) as usize)
                        .await
                        .map(|base| Arc::from(format!("{base}/{api}"))),
                    (None, None) => None,
                };
                let send = client::Send {
                    url: url.as_deref().unwrap_or(""),
                    model: MODEL,
                    input,
                    prompt_tokens: prompt.len() as u32,
                    max_tokens: issue.output_len,
                    headers,
                    release_ms: issue.release_ms,
                    timeout: REQUEST_TIMEOUT,
                };
                let (rec, reply) = if url.is_some() {
                    client::send(&http, send, clock).await
                } else {
                    let error = format!(
                        "no picker to send to within {} s",
                        pickers::WAIT_FOR_PICKER.as_secs()
                    );
                    (client::failed(&send, &clock, error), None)
                };
                if let Some(c) = &chats {
                    c.lock().reply(issue.session, reply);
                }
                drop(permit);
                let _ = tx.send((issue.id, class, rec)).await;
            });
        }
        if driver.finished() {
            break;
        }
        let due = driver.next_due();
        let wait = due.map(|d| {
            let ms = (d - clock.now_ms()) / speedup;
            Duration::from_secs_f64((ms / 1000.0).clamp(0.0, 86_400.0))
        });
        tokio::select! {
            got = rx.recv() => {
                let Some((id, class, rec)) = got else { break };
                if rec.error.is_some() {
                    errors += 1;
                }
                records.push(rec);
                record_class.push(class);
                record_ids.push(id);
                let now = clock.now_ms();
                driver.complete(id, now, &mut issues);
                progress(records.len(), total, errors);
            }
            () = async {
                match wait {
                    Some(w) => tokio::time::sleep(w).await,
                    None => std::future::pending::<()>().await,
                }
            } => {
                driver.release_due(clock.now_ms(), &mut issues);
            }
        }
    }
    progress(records.len(), total, errors);
    sampler_stop.cancel();
    if let Some(task) = scenario {
        if task.is_finished() {
            let failures = task.await.context("the scenario's task")?;
            anyhow::ensure!(
                failures.is_empty(),
                "scenario items failed, so the figures would not show them: {}",
                failures.join("; ")
            );
        } else {
            task.abort();
            tracing::warn!("the run ended before the scenario's last item");
        }
    }
    let series = sampler.await.unwrap_or_default();

    // the engines' own accounting
    let after = engine_counters(http, &target.engines).await;
    let mut per_rank_prefill: Vec<f64> = Vec::new();
    let mut per_rank_prompt: Vec<f64> = Vec::new();
    let (mut hits, mut queries) = (0.0, 0.0);
    for (k, a) in &after {
        let b = before.get(k).copied().unwrap_or_default();
        hits += a.prefix_hits - b.prefix_hits;
        queries += a.prefix_queries - b.prefix_queries;
        per_rank_prompt.push((a.prompt_tokens - b.prompt_tokens).max(0.0));
        per_rank_prefill
            .push(((a.prompt_tokens - b.prompt_tokens) - (a.prefix_hits - b.prefix_hits)).max(0.0));
    }
    let start = records
        .iter()
        .map(|r| r.release_ms)
        .fold(f64::INFINITY, f64::min);
    let end = records.iter().map(|r| r.end_ms).fold(0.0, f64::max);
    let span = if end > start { end - start } else { 0.0 };
    // estimated: each rank's prefilled tokens at the step model's full-chunk rate
    let cal = CostModelCalibration {
        max_batched_tokens: opts.cluster.engine.max_num_batched_tokens,
        prefill_quadratic_ms: opts.cluster.engine.step_time.prefill_a,
        prefill_linear_ms: opts.cluster.engine.step_time.prefill_b,
        prefill_constant_ms: opts.cluster.engine.step_time.prefill_c,
        ..CostModelCalibration::default()
    };
    let prefill_util = if span > 0.0 && !per_rank_prefill.is_empty() {
        per_rank_prefill
            .iter()
            .map(|&t| (kvroute_picker::policy::prefill_ms(&cal, t) / span).min(1.0))
            .sum::<f64>()
            / per_rank_prefill.len() as f64
    } else {
        0.0
    };
    let (picker_metrics, picker_restarted) = match metrics_of(target.pickers.clone()).await {
        Some((m, restarted)) => (Some(m), restarted),
        None => (target.picker_metrics, false),
    };
    // a restarted picker's histograms start from zero
    let (picker_before, hist_before) = if picker_restarted {
        (None, Default::default())
    } else {
        (picker_before, hist_before)
    };
    let picker_after = match picker_metrics {
        Some(m) => fetch(http, &format!("http://{m}/metrics")).await,
        None => None,
    };
    let decision_us_p99 = picker_after
        .as_deref()
        .map(|t| prom::histogram(t, DECISION_HISTOGRAM))
        .and_then(|h| prom::histogram_quantile(&hist_before, &h, 0.99))
        .map(|s| (s * 1e6 * 10.0).round() / 10.0);
    let picker = picker_after
        .as_deref()
        .map(|a| stats::PickerFigures::from_metrics(picker_before.as_deref().unwrap_or(""), a));
    let figures = EngineFigures {
        hit_rate: (queries > 0.0).then(|| hits / queries),
        load_cv: stats::coefficient_of_variation(&per_rank_prefill),
        prefill_util,
        decision_us_p99,
    };
    let classes = classes::figures(opts, &records, &record_class);
    let (summary, ttfts, errs) = stats::summarize(
        &target.name,
        &records,
        ceilings.ceiling(),
        figures,
        opts.slo,
    );
    let load_series = series
        .into_iter()
        .map(|(k, s)| (k, super::offline::downsample(&s, MAX_SERIES_POINTS)))
        .collect();
    Ok(PolicyRun {
        summary,
        detail: RunDetail {
            ttfts_sorted: ttfts,
            load_series,
            hit_rate_ideal: ceilings.ideal(),
            error_samples: errs,
            picker,
            engine_prefill_tokens: per_rank_prefill,
            engine_prompt_tokens: per_rank_prompt,
            admission: None,
            lora: None,
            classes,
            phases: if opts.scenario.is_empty() {
                Vec::new()
            } else {
                crate::scenario::phases(&opts.scenario, &records, opts.slo)
            },
            recoveries: crate::scenario::recoveries(&opts.scenario, &records),
            restarted_picker: crate::scenario::restarted_picker(
                &opts.scenario,
                &records,
                &record_ids,
                target.pickers.as_ref().map_or(0, |p| p.len()),
            ),
        },
    })
}

/// An HTTP client for the runner: no proxy, no overall timeout (requests carry their own).
pub fn http_client() -> anyhow::Result<reqwest::Client> {
    reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(MAX_CLIENT_INFLIGHT)
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .build()
        .context("building the HTTP client")
}

/// The `engines` subcommand: start the simulated engines, print their addresses as one JSON
/// line (`{"engines":[{"http","http_ranks","kv_events","replay"}]}`), run until SIGINT,
/// SIGTERM or (with `exit_on_stdin_close`) the end of stdin.
pub async fn run_engines(
    cluster: &ClusterConfig,
    seed: u64,
    kv_base: Option<u16>,
    exit_on_stdin_close: bool,
) -> anyhow::Result<()> {
    use std::io::Write as _;
    let handle = kvroute_sim::server::start(sim_config(cluster, seed, kv_base)).await?;
    {
        // the simulator's own address JSON, plus ready-made URLs for other routers
        let mut v = handle.ports_json();
        if let Some(list) = v.get_mut("engines").and_then(|e| e.as_array_mut()) {
            for e in list.iter_mut() {
                let url = e
                    .get("http")
                    .and_then(|h| h.as_str())
                    .map(|h| format!("http://{h}"));
                let zmq = |key: &str| -> Vec<String> {
                    e.get(key)
                        .and_then(|k| k.as_array())
                        .map(|a| {
                            a.iter()
                                .filter_map(|x| x.as_str())
                                .map(|x| format!("tcp://{x}"))
                                .collect()
                        })
                        .unwrap_or_default()
                };
                let (events, replay) = (zmq("kv_events"), zmq("replay"));
                if let Some(obj) = e.as_object_mut() {
                    obj.insert("url".into(), serde_json::json!(url));
                    obj.insert("kv_event_endpoints".into(), serde_json::json!(events));
                    obj.insert("kv_replay_endpoints".into(), serde_json::json!(replay));
                }
            }
        }
        let mut out = std::io::stdout().lock();
        writeln!(out, "{v}")?;
        out.flush()?;
    }
    tokio::select! {
        () = kvroute_process::shutdown_signal() => {}
        () = handle.stopped() => {}
        () = async {
            if exit_on_stdin_close {
                procs::stdin_closed().await
            } else {
                std::future::pending::<()>().await
            }
        } => {}
    }
    handle.shutdown();
    Ok(())
}
