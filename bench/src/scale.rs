//! `kvroute-bench scale`: one picker in front of a large simulated pool, measured as its
//! operator would size it.
//!
//! One simulator process stands for `servers` vLLM servers of `dp_size` data-parallel ranks
//! each (512 endpoints by default), every rank with its own KV cache and event stream. Its
//! ranks answer requests at once (a huge speed-up, one output token), so what a request
//! waits for is the picker and the loopback hop, and they carry a synthetic prefill load
//! besides (the simulator's `background_prefill` fault: the events of a GPU busy with traffic
//! from elsewhere). One picker process runs the default policy in front of them.
//!
//! Phases, each measured from the picker's `/proc` entries (CPU, RSS) and its `/metrics`:
//! 1. **idle**: no events, no requests: what scraping the pool costs;
//! 2. **fill**: every rank's cache filled at a high prefill rate, until the index holds
//!    `fill_fraction` of the pool's blocks (the RSS of a full index);
//! 3. **events**: the steady prefill load alone (ingest cost and lag);
//! 4. **sweep**: per prompt kind (text, token ids) and size, open-loop Poisson requests at
//!    increasing rates, each sent through the picker and, as many again, straight to an
//!    engine (the null router); added latency is the difference of the two paths'
//!    percentiles in the same step. A size's sweep stops at the first rate whose added p99
//!    passes `stop_added_p99_ms`, whose errors pass 1%, or that the client cannot offer.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use kvroute_picker::config::RoutingConfig;
use kvroute_picker::pool::TokenizerSpec;
use kvroute_sim::engine::EngineConfig;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use serde_json::json;
use tokio::task::JoinSet;
use tokio_util::bytes::Bytes;

use crate::live::{self, EnginesInfo, prom};
use crate::{ClusterConfig, stats};

/// `/proc/<pid>/stat` counts CPU time in these ticks (`USER_HZ`, 100 on every Linux ABI).
const USER_HZ: f64 = 100.0;
/// Requests in flight from the client at most; beyond, an arrival counts as not offered.
const MAX_INFLIGHT: usize = 4096;
/// Longest one request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// Distinct shared prefixes per prompt size (sessions or documents resent with a new end).
const DOCUMENTS: usize = 16;
const LAG_HISTOGRAM: &str = "kvroute_picker_kv_event_lag_seconds";
const DECISION_HISTOGRAM: &str = "kvroute_picker_decision_seconds";
const INDEX_BLOCKS: &str = "kvroute_picker_index_blocks";
const EVENT_BATCHES: &str = "kvroute_picker_kv_event_batches_total";

/// Prompt kinds of the sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum PromptKind {
    /// `/v1/completions` with a text prompt: the picker tokenizes it.
    Text,
    /// `/v1/completions` with token ids.
    Ids,
}

/// What `kvroute-bench scale` runs (see the module docs); its command line.
#[derive(Debug, Clone, Serialize, clap::Args)]
pub struct ScaleOptions {
    #[arg(long, default_value_t = 64)]
    pub servers: usize,
    #[arg(long, default_value_t = 8)]
    pub dp_size: u32,
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// KV blocks per rank (31,200: an 80 GB GPU's cache for an 8B model at 16 tokens a block).
    #[arg(long, default_value_t = 31_200)]
    pub kv_blocks: u32,
    /// Newly computed prompt tokens per second per rank besides the benchmark's requests.
    #[arg(long, default_value_t = 4096.0)]
    pub prefill_tokens_per_s: f64,
    /// The same while filling the caches before the sweep.
    #[arg(long, default_value_t = 32_768.0)]
    pub fill_tokens_per_s: f64,
    /// Tokens per synthetic prompt (one `BlockStored` each).
    #[arg(long, default_value_t = 2048)]
    pub prefill_prompt_tokens: u32,
    /// Fraction of the pool's KV blocks the index holds before the sweep starts.
    #[arg(long, default_value_t = 0.95)]
    pub fill_fraction: f64,
    #[arg(long, value_delimiter = ',', default_value = "text,ids")]
    pub kinds: Vec<PromptKind>,
    /// Prompt sizes in tokens.
    #[arg(long, value_delimiter = ',', default_value = "8192,32768,131072")]
    pub sizes: Vec<u32>,
    /// Requests per second through the picker, in order (as many again go straight to an
    /// engine); a size stops at the first rate past --stop-added-p99-ms.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "10,25,50,100,200,400,800"
    )]
    pub rates: Vec<f64>,
    #[arg(long, default_value_t = 8.0)]
    pub step_secs: f64,
    /// Seconds of the idle and events-only phases.
    #[arg(long, default_value_t = 10.0)]
    pub phase_secs: f64,
    /// Fraction of each prompt that is new (the rest one of 16 shared prefixes).
    #[arg(long, default_value_t = 0.1)]
    pub new_fraction: f64,
    #[arg(long, default_value_t = 10.0)]
    pub stop_added_p99_ms: f64,
    /// Picker scrape interval.
    #[arg(long, default_value_t = 100)]
    pub scrape_ms: u64,
    /// Tokenizer directory of the picker (default: the repository's test fixture).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Let the picker share every CPU with the engines and the client (default: the last CPU
    /// is its own, with `taskset`, and the engines and this process run on the others).
    #[arg(long)]
    pub no_pin: bool,
    /// Each step runs until at least this many requests went through the picker.
    #[arg(long, default_value_t = 400)]
    pub min_step_requests: u32,
}

impl ScaleOptions {
    /// The picker's tokenizer directory.
    pub fn tokenizer_dir(&self) -> PathBuf {
        self.tokenizer.clone().unwrap_or_else(|| {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../routing/tests/fixtures/tokenizer"
            ))
        })
    }
}

/// A phase without requests.
#[derive(Debug, Clone, Serialize)]
pub struct Phase {
    pub name: &'static str,
    pub secs: f64,
    pub picker_cores: f64,
    pub rss_mib: f64,
    pub index_blocks: f64,
    pub event_batches_per_s: f64,
    pub lag_p50_ms: Option<f64>,
    pub lag_p99_ms: Option<f64>,
}

/// One rate of one prompt kind and size.
#[derive(Debug, Clone, Serialize)]
pub struct Step {
    pub kind: PromptKind,
    pub tokens: u32,
    pub offered_per_s: f64,
    /// Completed through the picker, per second.
    pub achieved_per_s: f64,
    pub direct_p50_ms: f64,
    pub direct_p99_ms: f64,
    pub picker_p50_ms: f64,
    pub picker_p99_ms: f64,
    pub added_p50_ms: f64,
    pub added_p99_ms: f64,
    /// Requests that ended, both paths.
    pub requests: u64,
    pub errors: u64,
    pub first_error: Option<String>,
    pub not_offered: u64,
    pub picker_cores: f64,
    /// Cores above the events-only phase per 100 requests/s through the picker.
    pub cores_per_100_rps: f64,
    pub rss_mib: f64,
    pub lag_p99_ms: Option<f64>,
    pub decision_p99_ms: Option<f64>,
}

/// Where a size's sweep ended.
#[derive(Debug, Clone, Serialize)]
pub struct Knee {
    pub kind: PromptKind,
    pub tokens: u32,
    /// The first rate whose added p99 passed the threshold (`None`: none of those run).
    pub passes_at_per_s: Option<f64>,
    /// The highest rate run below the threshold.
    pub last_below_per_s: Option<f64>,
    pub stopped_by: String,
    /// The picker's cores per 100 requests/s: the least-squares slope of its cores over the
    /// rates run below the threshold (at least two), which leaves out the events and scrapes
    /// it carries at any rate.
    pub slope_cores_per_100_rps: Option<f64>,
}

/// Least-squares slope of `y` over `x`, per 100 units of `x`; `None` under two points or
/// without spread in `x`.
fn slope_per_100(points: &[(f64, f64)]) -> Option<f64> {
    if points.len() < 2 {
        return None;
    }
    let n = points.len() as f64;
    let (mx, my) = points
        .iter()
        .fold((0.0, 0.0), |(a, b), (x, y)| (a + x / n, b + y / n));
    let sxx: f64 = points.iter().map(|(x, _)| (x - mx) * (x - mx)).sum();
    let sxy: f64 = points.iter().map(|(x, y)| (x - mx) * (y - my)).sum();
    (sxx > 0.0).then(|| sxy / sxx * 100.0)
}

#[derive(Debug, Clone, Serialize)]
pub struct ScaleReport {
    pub options: ScaleOptions,
    pub endpoints: usize,
    /// CPUs the picker could run on.
    pub picker_cpus: usize,
    /// Time from the steady load's start until the ingest lag's p99 over two seconds was
    /// under 100 ms (the fill's backlog drained).
    pub settle_secs: f64,
    pub metrics_bytes_per_server: usize,
    pub scrapes_per_s: f64,
    pub idle: Phase,
    pub fill: Phase,
    pub fill_blocks_per_s: f64,
    pub events: Phase,
    pub steps: Vec<Step>,
    pub knees: Vec<Knee>,
}

/// CPU seconds and resident bytes of a process.
#[derive(Debug, Clone, Copy)]
struct ProcSample {
    at: Instant,
    cpu_s: f64,
    rss: u64,
}

fn proc_sample(pid: u32) -> anyhow::Result<ProcSample> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    // fields after the command name in parentheses; utime and stime are fields 14 and 15
    let rest = stat
        .rfind(')')
        .map(|i| &stat[i + 1..])
        .context("no command name in /proc/<pid>/stat")?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| -> anyhow::Result<f64> {
        f.get(i)
            .and_then(|s| s.parse::<f64>().ok())
            .context("short /proc/<pid>/stat")
    };
    let cpu_s = (tick(11)? + tick(12)?) / USER_HZ;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    let rss_kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .context("no VmRSS in /proc/<pid>/status")?;
    Ok(ProcSample {
        at: Instant::now(),
        cpu_s,
        rss: rss_kib * 1024,
    })
}

/// The picker's process figures and metrics at one instant.
struct Sample {
    proc: ProcSample,
    metrics: String,
}

struct Ctx {
    http: reqwest::Client,
    engines: EnginesInfo,
    picker_pid: u32,
    picker_url: String,
    picker_metrics: SocketAddr,
}

impl Ctx {
    async fn sample(&self) -> anyhow::Result<Sample> {
        // a pooled connection the server closed while idle fails once: ask again
        let url = format!("http://{}/metrics", self.picker_metrics);
        let mut metrics = None;
        for _ in 0..3 {
            metrics = live::fetch(&self.http, &url).await;
            if metrics.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(Sample {
            proc: proc_sample(self.picker_pid)?,
            metrics: metrics.with_context(|| format!("reading {url} three times"))?,
        })
    }

    /// Sets the background prefill of every rank of every engine to `(tokens per second,
    /// tokens per prompt)`, or with `None` clears it.
    async fn background(&self, load: Option<(f64, u32)>) -> anyhow::Result<()> {
        let body = match load {
            Some((t, prompt)) => {
                json!({"kind": "background_prefill", "tokens_per_second": t, "prompt_tokens": prompt})
            }
            None => json!({"kind": "clear"}),
        };
        for e in &self.engines.engines {
            let r = self
                .http
                .post(format!("http://{}/admin/fault", e.http))
                .json(&body)
                .send()
                .await?;
            anyhow::ensure!(
                r.status().is_success(),
                "engine {} refused the background load: {}",
                e.http,
                r.text().await.unwrap_or_default()
            );
        }
        Ok(())
    }
}

/// Runs every thread of `pid` on `cpus` (a `taskset` list such as `0-2`).
fn pin(pid: u32, cpus: &str) -> anyhow::Result<()> {
    let out = std::process::Command::new("taskset")
        .args(["-a", "-p", "-c", cpus, &pid.to_string()])
        .output()
        .context("running taskset (util-linux) to pin the processes; --no-pin runs without")?;
    anyhow::ensure!(
        out.status.success(),
        "taskset -a -p -c {cpus} {pid}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

fn gauge(text: &str, name: &str) -> f64 {
    prom::counter_sum(text, name, &[])
}

fn phase(name: &'static str, a: &Sample, b: &Sample) -> Phase {
    let secs = b.proc.at.duration_since(a.proc.at).as_secs_f64().max(1e-9);
    let (ha, hb) = (
        prom::histogram(&a.metrics, LAG_HISTOGRAM),
        prom::histogram(&b.metrics, LAG_HISTOGRAM),
    );
    Phase {
        name,
        secs,
        picker_cores: (b.proc.cpu_s - a.proc.cpu_s) / secs,
        rss_mib: b.proc.rss as f64 / (1 << 20) as f64,
        index_blocks: gauge(&b.metrics, INDEX_BLOCKS),
        event_batches_per_s: (gauge(&b.metrics, EVENT_BATCHES) - gauge(&a.metrics, EVENT_BATCHES))
            / secs,
        lag_p50_ms: prom::histogram_quantile(&ha, &hb, 0.5).map(|s| s * 1e3),
        lag_p99_ms: prom::histogram_quantile(&ha, &hb, 0.99).map(|s| s * 1e3),
    }
}

/// Words of the text prompts: short, lowercase, so the fixture tokenizer makes about one
/// token per two characters and nothing needs JSON escaping.
const WORDS: &[&str] = &[
    "kv", "cache", "aware", "routing", "sends", "each", "request", "to", "the", "replica", "that",
    "holds", "its", "prefix", "unless", "queue", "there", "costs", "more", "than", "prefill", "it",
    "saves", "picker", "scrapes", "engine", "metrics", "ingests", "block", "events", "and",
    "scores", "every", "endpoint", "of", "pool",
];

/// Prompt bodies of one kind and size: 16 shared prefixes, each request one of them plus a
/// new end of its own.
struct Prompts {
    kind: PromptKind,
    /// Tokens of a whole prompt.
    tokens: u32,
    /// JSON fragments: the text (without quotes) or the comma-separated ids.
    shared: Vec<String>,
    /// Units of the new end: characters of text or ids.
    new_units: usize,
}

impl Prompts {
    fn new(
        kind: PromptKind,
        tokens: u32,
        new_fraction: f64,
        chars_per_token: f64,
        seed: u64,
    ) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ u64::from(tokens) ^ kind as u64);
        let shared_tokens = (f64::from(tokens) * (1.0 - new_fraction)).round() as usize;
        let new_tokens = f64::from(tokens) as usize - shared_tokens;
        let units = |t: usize| match kind {
            PromptKind::Text => (t as f64 * chars_per_token).round() as usize,
            PromptKind::Ids => t,
        };
        let mut p = Self {
            kind,
            tokens,
            shared: Vec::new(),
            new_units: units(new_tokens).max(1),
        };
        p.shared = (0..DOCUMENTS)
            .map(|_| p.fragment(&mut rng, units(shared_tokens)))
            .collect();
        p
    }

    /// `units` characters of words, or ids, drawn from `rng`.
    fn fragment(&self, rng: &mut ChaCha8Rng, units: usize) -> String {
        use std::fmt::Write as _;
        let mut s = String::with_capacity(units * 2);
        match self.kind {
            PromptKind::Text => {
                while s.len() < units {
                    s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
                    let _ = write!(s, "{}", rng.random_range(0..97u32));
                    s.push(' ');
                }
                s.truncate(units);
            }
            PromptKind::Ids => {
                for i in 0..units {
                    if i > 0 {
                        s.push(',');
                    }
                    // inside the fixture tokenizer's 420-token vocabulary, clear of its special tokens
                    let _ = write!(s, "{}", rng.random_range(20..400u32));
                }
            }
        }
        s
    }

    fn body(&self, rng: &mut ChaCha8Rng, n: u64) -> Bytes {
        let shared = &self.shared[(n as usize) % self.shared.len()];
        let end = self.fragment(rng, self.new_units);
        let body = match self.kind {
            PromptKind::Text => format!(
                "{{\"model\":\"{}\",\"max_tokens\":1,\"prompt\":\"{shared} {end}\"}}",
                crate::MODEL
            ),
            PromptKind::Ids => format!(
                "{{\"model\":\"{}\",\"max_tokens\":1,\"prompt\":[{shared},{end}]}}",
                crate::MODEL
            ),
        };
        Bytes::from(body)
    }
}

/// Characters per token of the text prompts under the picker's tokenizer.
fn chars_per_token(tokenizer: &Path) -> anyhow::Result<f64> {
    use kvroute_picker::tokenize::{PromptInput, PromptTokenizer, PromptTokenizerOptions};
    let json = std::fs::read(tokenizer.join("tokenizer.json"))
        .with_context(|| format!("reading {}/tokenizer.json", tokenizer.display()))?;
    let t = PromptTokenizer::from_hf_files(Some(&json), None, PromptTokenizerOptions::default())
        .context("loading the tokenizer")?;
    let p = Prompts::new(PromptKind::Text, 20_000, 0.0, 2.0, 1);
    let sample = &p.shared[0];
    let ids = t
        .tokenize(PromptInput::Text(sample))
        .map_err(|e| anyhow::anyhow!("tokenizing the sample: {e}"))?
        .ids;
    Ok(sample.len() as f64 / ids.len().max(1) as f64)
}

fn truncate(s: &str, n: usize) -> &str {
    match s.char_indices().nth(n) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// One open-loop step: Poisson arrivals at `2 * rate`, alternately through the picker and
/// straight to an engine (round robin over the servers).
async fn run_step(
    ctx: &Ctx,
    prompts: &Prompts,
    rate: f64,
    secs: f64,
    min_requests: u32,
    seed: u64,
    baseline_cores: f64,
) -> anyhow::Result<Step> {
    let before = ctx.sample().await?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let secs = secs.max(f64::from(min_requests) / rate);
    let start = tokio::time::Instant::now();
    let end = start + Duration::from_secs_f64(secs);
    let mut next = start;
    let mut n: u64 = 0;
    let mut set: JoinSet<(bool, f64, Result<(), String>)> = JoinSet::new();
    let mut results: Vec<(bool, f64, Result<(), String>)> = Vec::new();
    let mut not_offered = 0u64;
    let servers = ctx.engines.engines.len() as u64;
    while next < end {
        tokio::time::sleep_until(next).await;
        while let Some(r) = set.try_join_next() {
            results.push(r.context("a request task")?);
        }
        let direct = n % 2 == 1;
        if set.len() >= MAX_INFLIGHT {
            not_offered += 1;
        } else {
            let body = prompts.body(&mut rng, n / 2);
            let url = if direct {
                let e = &ctx.engines.engines[((n / 2) % servers) as usize];
                format!("http://{}/v1/completions", e.http)
            } else {
                format!("{}/v1/completions", ctx.picker_url)
            };
            let http = ctx.http.clone();
            set.spawn(async move {
                let t = Instant::now();
                let outcome = match tokio::time::timeout(
                    REQUEST_TIMEOUT,
                    http.post(url)
                        .header("content-type", "application/json")
                        .body(body)
                        .send(),
                )
                .await
                {
                    Ok(Ok(r)) => {
                        let status = r.status();
                        match r.bytes().await {
                            Ok(_) if status.is_success() => Ok(()),
                            Ok(b) => Err(format!("{status}: {}", String::from_utf8_lossy(&b))),
                            Err(e) => Err(e.to_string()),
                        }
                    }
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err("timed out".into()),
                };
                (direct, t.elapsed().as_secs_f64() * 1e3, outcome)
            });
        }
        n += 1;
        let u: f64 = rng.random_range(f64::EPSILON..1.0);
        next += Duration::from_secs_f64(-u.ln() / (2.0 * rate));
    }
    let sent_secs = start.elapsed().as_secs_f64();
    while let Some(r) = set.join_next().await {
        results.push(r.context("a request task")?);
    }
    let after = ctx.sample().await?;
    let p = phase("step", &before, &after);
    let lat = |direct: bool| {
        stats::sorted(
            results
                .iter()
                .filter(|r| r.0 == direct && r.2.is_ok())
                .map(|r| r.1)
                .collect(),
        )
    };
    let (d, k) = (lat(true), lat(false));
    let (d50, d99) = (stats::percentile(&d, 50.0), stats::percentile(&d, 99.0));
    let (k50, k99) = (stats::percentile(&k, 50.0), stats::percentile(&k, 99.0));
    let errors = results.iter().filter(|r| r.2.is_err()).count() as u64;
    let first_error = results.iter().find_map(|r| {
        r.2.as_ref().err().map(|e| {
            format!(
                "{}: {}",
                if r.0 { "direct" } else { "picker" },
                truncate(e, 300)
            )
        })
    });
    let achieved = k.len() as f64 / sent_secs;
    let (hd_a, hd_b) = (
        prom::histogram(&before.metrics, DECISION_HISTOGRAM),
        prom::histogram(&after.metrics, DECISION_HISTOGRAM),
    );
    Ok(Step {
        kind: prompts.kind,
        tokens: prompts.tokens,
        offered_per_s: rate,
        achieved_per_s: achieved,
        direct_p50_ms: d50,
        direct_p99_ms: d99,
        picker_p50_ms: k50,
        picker_p99_ms: k99,
        added_p50_ms: k50 - d50,
        added_p99_ms: k99 - d99,
        requests: results.len() as u64,
        errors,
        first_error,
        not_offered,
        picker_cores: p.picker_cores,
        cores_per_100_rps: (p.picker_cores - baseline_cores) / achieved.max(1e-9) * 100.0,
        rss_mib: p.rss_mib,
        lag_p99_ms: p.lag_p99_ms,
        decision_p99_ms: prom::histogram_quantile(&hd_a, &hd_b, 0.99).map(|s| s * 1e3),
    })
}

/// Sends each shared prefix through the picker once, untimed.
async fn warm_up(ctx: &Ctx, prompts: &Prompts) -> anyhow::Result<()> {
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    for n in 0..prompts.shared.len() as u64 {
        let r = ctx
            .http
            .post(format!("{}/v1/completions", ctx.picker_url))
            .header("content-type", "application/json")
            .body(prompts.body(&mut rng, n))
            .send()
            .await?;
        let status = r.status();
        let text = r.text().await.unwrap_or_default();
        anyhow::ensure!(
            status.is_success(),
            "warm-up request refused: {status}: {}",
            truncate(&text, 300)
        );
    }
    Ok(())
}

async fn measure_phase(ctx: &Ctx, name: &'static str, secs: f64) -> anyhow::Result<Phase> {
    let a = ctx.sample().await?;
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    let b = ctx.sample().await?;
    Ok(phase(name, &a, &b))
}

/// Runs the benchmark with `exe` (the `kvroute-bench` binary) for the engine and picker
/// processes; progress on stderr.
pub async fn run(opts: ScaleOptions, exe: &Path) -> anyhow::Result<ScaleReport> {
    anyhow::ensure!(!opts.rates.is_empty(), "--rates names no rate");
    anyhow::ensure!(
        opts.rates.iter().all(|r| r.is_finite() && *r > 0.0),
        "--rates must be positive numbers"
    );
    anyhow::ensure!(
        (0.0..1.0).contains(&opts.new_fraction),
        "--new-fraction must be within [0, 1)"
    );
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(MAX_INFLIGHT)
        .build()
        .context("building the HTTP client")?;
    let cluster = ClusterConfig {
        engines: opts.servers,
        dp_size: opts.dp_size,
        engine: EngineConfig {
            block_size: opts.block_size,
            num_blocks: opts.kv_blocks,
            max_num_seqs: 1024,
            max_num_batched_tokens: 1 << 20,
            ..EngineConfig::default()
        },
        // requests are answered at once: what is left is the router and the hop
        speedup: 1e6,
        prefill_engines: 0,
    };
    let endpoints = opts.servers * opts.dp_size as usize;
    eprintln!(
        "scale: starting {} servers x {} ranks = {endpoints} endpoints",
        opts.servers, opts.dp_size
    );
    let (engines_guard, engines) = live::start_engines(exe, &cluster, opts.seed, "scale").await?;
    let tokenizer_dir = opts.tokenizer_dir();
    let tokenizer = TokenizerSpec {
        path: Some(tokenizer_dir.join("tokenizer.json").display().to_string()),
        config_path: Some(tokenizer_dir.join("tokenizer_config.json"))
            .filter(|p| p.exists())
            .map(|p| p.display().to_string()),
        ..TokenizerSpec::default()
    };
    let mut cfg = live::picker_config(
        &engines,
        &cluster,
        &RoutingConfig::default(),
        opts.scrape_ms as f64,
        Some(tokenizer),
    )?;
    cfg.limits.max_prompt_tokens = 1 << 20;
    cfg.limits.upstream_timeout = REQUEST_TIMEOUT;
    cfg.limits.idle_timeout = REQUEST_TIMEOUT;
    let picker = live::spawn_picker(exe, &cfg, "scale", &http).await?;
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    let picker_pid = picker.guard.pid().context("the picker has no pid")?;
    let picker_cpus = if !opts.no_pin && cpus >= 2 {
        let last = (cpus - 1).to_string();
        let rest = if cpus == 2 {
            "0".to_string()
        } else {
            format!("0-{}", cpus - 2)
        };
        pin(picker_pid, &last)?;
        pin(std::process::id(), &rest)?;
        if let Some(p) = engines_guard.pid() {
            pin(p, &rest)?;
        }
        1
    } else {
        cpus
    };
    let ctx = Ctx {
        http: http.clone(),
        engines,
        picker_pid,
        picker_url: format!("http://{}", picker.http),
        picker_metrics: picker.metrics,
    };
    let first = format!("http://{}/metrics", ctx.engines.engines[0].http);
    let metrics_bytes_per_server = live::fetch(&http, &first)
        .await
        .with_context(|| format!("reading {first}"))?
        .len();
    let scrapes_per_s = opts.servers as f64 * 1000.0 / opts.scrape_ms as f64;

    eprintln!("scale: idle (scrapes only) for {} s", opts.phase_secs);
    let idle = measure_phase(&ctx, "idle", opts.phase_secs).await?;

    let target = opts.fill_fraction * endpoints as f64 * f64::from(opts.kv_blocks - 1);
    eprintln!("scale: filling the caches to {target:.0} blocks");
    let fill_start = ctx.sample().await?;
    ctx.background(Some((opts.fill_tokens_per_s, opts.prefill_prompt_tokens)))
        .await?;
    let deadline = Instant::now() + Duration::from_secs(600);
    let fill_end = loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let s = ctx.sample().await?;
        let blocks = gauge(&s.metrics, INDEX_BLOCKS);
        eprint!("\r  index: {blocks:.0} blocks   ");
        if blocks >= target {
            break s;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the index did not reach {target:.0} blocks within 600 s ({blocks:.0})"
        );
    };
    eprintln!();
    let fill = phase("fill", &fill_start, &fill_end);
    let fill_blocks_per_s = fill.index_blocks / fill.secs;

    ctx.background(Some((
        opts.prefill_tokens_per_s,
        opts.prefill_prompt_tokens,
    )))
    .await?;
    let settle_start = Instant::now();
    let mut before = ctx.sample().await?;
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let now = ctx.sample().await?;
        let lag = phase("settle", &before, &now).lag_p99_ms;
        eprint!("\r  settling: lag p99 {lag:?} ms   ");
        // no batch in the window (no background load): nothing to drain
        if lag.is_none_or(|l| l < 100.0) || settle_start.elapsed() > Duration::from_secs(180) {
            break;
        }
        before = now;
    }
    eprintln!();
    let settle_secs = settle_start.elapsed().as_secs_f64();
    eprintln!("scale: events only for {} s", opts.phase_secs);
    let events = measure_phase(&ctx, "events", opts.phase_secs).await?;

    let cpt = chars_per_token(&tokenizer_dir)?;
    let mut steps = Vec::new();
    let mut knees = Vec::new();
    for &kind in &opts.kinds {
        for &tokens in &opts.sizes {
            let prompts = Prompts::new(kind, tokens, opts.new_fraction, cpt, opts.seed);
            // the shared prefixes have been seen before, as a session's earlier turns have
            warm_up(&ctx, &prompts).await?;
            let mut knee = Knee {
                kind,
                tokens,
                passes_at_per_s: None,
                last_below_per_s: None,
                stopped_by: "the last rate".into(),
                slope_cores_per_100_rps: None,
            };
            let mut below = Vec::new();
            for (i, &rate) in opts.rates.iter().enumerate() {
                let step = run_step(
                    &ctx,
                    &prompts,
                    rate,
                    opts.step_secs,
                    opts.min_step_requests,
                    opts.seed ^ (i as u64) << 32 ^ u64::from(tokens),
                    events.picker_cores,
                )
                .await?;
                eprintln!(
                    "  {kind:?} {tokens}: {rate}/s -> {:.1}/s, added p50 {:.2} p99 {:.2} ms, \
                     picker {:.2} cores, lag p99 {:?} ms, errors {} {}",
                    step.achieved_per_s,
                    step.added_p50_ms,
                    step.added_p99_ms,
                    step.picker_cores,
                    step.lag_p99_ms,
                    step.errors,
                    step.first_error.as_deref().unwrap_or("")
                );
                let stop = if step.added_p99_ms > opts.stop_added_p99_ms {
                    knee.passes_at_per_s = Some(rate);
                    Some(format!("added p99 over {} ms", opts.stop_added_p99_ms))
                } else if step.errors as f64 > 0.01 * step.requests as f64 {
                    Some("errors over 1%".into())
                } else if step.achieved_per_s < 0.8 * rate || step.not_offered > 0 {
                    Some("the client could not offer the rate".into())
                } else {
                    knee.last_below_per_s = Some(rate);
                    below.push((step.achieved_per_s, step.picker_cores));
                    None
                };
                steps.push(step);
                if let Some(why) = stop {
                    knee.stopped_by = why;
                    break;
                }
            }
            knee.slope_cores_per_100_rps = slope_per_100(&below);
            knees.push(knee);
        }
    }
    ctx.background(None).await?;
    picker.guard.stop().await;
    engines_guard.stop().await;
    Ok(ScaleReport {
        options: opts,
        endpoints,
        picker_cpus,
        settle_secs,
        metrics_bytes_per_server,
        scrapes_per_s,
        idle,
        fill,
        fill_blocks_per_s,
        events,
        steps,
        knees,
    })
}

fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |x| format!("{x:.1}"))
}

/// The report as markdown tables.
pub fn markdown(r: &ScaleReport) -> String {
    use std::fmt::Write as _;
    let o = &r.options;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{} servers x {} ranks = {} endpoints, {} KV blocks of {} tokens per rank; background \
         prefill {} tokens/s per rank in prompts of {} tokens; scrape every {} ms ({:.0} \
         scrapes/s of {} KB); the picker on {} CPU(s){}; {:.0}% of each prompt new; fill \
         backlog drained {:.0} s after the steady load started\n",
        o.servers,
        o.dp_size,
        r.endpoints,
        o.kv_blocks,
        o.block_size,
        o.prefill_tokens_per_s,
        o.prefill_prompt_tokens,
        o.scrape_ms,
        r.scrapes_per_s,
        r.metrics_bytes_per_server / 1024,
        r.picker_cpus,
        if o.no_pin { "" } else { " of its own" },
        o.new_fraction * 100.0,
        r.settle_secs
    );
    let _ = writeln!(
        s,
        "| phase | secs | picker cores | RSS MiB | index blocks | event batches/s | lag p50 / p99 ms |"
    );
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|");
    for p in [&r.idle, &r.fill, &r.events] {
        let _ = writeln!(
            s,
            "| {} | {:.0} | {:.2} | {:.0} | {:.0} | {:.0} | {} / {} |",
            p.name,
            p.secs,
            p.picker_cores,
            p.rss_mib,
            p.index_blocks,
            p.event_batches_per_s,
            ms(p.lag_p50_ms),
            ms(p.lag_p99_ms)
        );
    }
    let _ = writeln!(
        s,
        "\nFill: {:.2} M blocks/s into the index.\n",
        r.fill_blocks_per_s / 1e6
    );
    let _ = writeln!(
        s,
        "| prompt | tokens | req/s | direct p50 / p99 ms | picker p50 / p99 ms | added p50 / p99 ms | picker cores | cores per 100 req/s | RSS MiB | lag p99 ms | decision p99 ms | errors |"
    );
    let _ = writeln!(
        s,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for t in &r.steps {
        let _ = writeln!(
            s,
            "| {:?} | {} | {:.0} | {:.2} / {:.2} | {:.2} / {:.2} | {:.2} / {:.2} | {:.2} | {:.2} | {:.0} | {} | {} | {} |",
            t.kind,
            t.tokens,
            t.achieved_per_s,
            t.direct_p50_ms,
            t.direct_p99_ms,
            t.picker_p50_ms,
            t.picker_p99_ms,
            t.added_p50_ms,
            t.added_p99_ms,
            t.picker_cores,
            t.cores_per_100_rps,
            t.rss_mib,
            ms(t.lag_p99_ms),
            ms(t.decision_p99_ms),
            t.errors
        );
    }
    let _ = writeln!(
        s,
        "\n| prompt | tokens | added p99 > {} ms at | last rate below | stopped by | picker cores per 100 req/s (slope below it) |",
        o.stop_added_p99_ms
    );
    let _ = writeln!(s, "|---|---:|---:|---:|---|---:|");
    for k in &r.knees {
        let _ = writeln!(
            s,
            "| {:?} | {} | {} | {} | {} | {} |",
            k.kind,
            k.tokens,
            k.passes_at_per_s
                .map_or_else(|| "-".into(), |x| format!("{x:.0}/s")),
            k.last_below_per_s
                .map_or_else(|| "-".into(), |x| format!("{x:.0}/s")),
            k.stopped_by,
            k.slope_cores_per_100_rps
                .map_or_else(|| "-".into(), |x| format!("{x:.2}"))
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::slope_per_100;

    #[test]
    fn the_slope_leaves_out_the_intercept() {
        // 0.3 cores of events at any rate, 0.2 more per 100 req/s
        let pts = [(25.0, 0.35), (100.0, 0.5), (200.0, 0.7)];
        let s = slope_per_100(&pts).expect("a slope");
        assert!((s - 0.2).abs() < 1e-9, "{s}");
        assert_eq!(slope_per_100(&pts[..1]), None);
        assert_eq!(slope_per_100(&[(10.0, 0.1), (10.0, 0.2)]), None);
    }
}
