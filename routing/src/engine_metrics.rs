//! Engine load from a `/metrics` scrape: the Prometheus text exposition an engine serves is
//! turned into one [`LoadSample`] per data-parallel rank plus an aggregate.
//!
//! # Why a parser of our own
//! The published Rust parsers did not fit: `prometheus-parse` 0.2.5 matches names with `\w+`
//! (so `vllm:num_requests_waiting` is not even recognised), splits label pairs on `,` and `=`
//! (so a quoted comma breaks the line) and silently drops lines it cannot read;
//! `openmetrics-parser` 0.5.1 is LGPL-3.0, builds an owned model of the whole scrape and has no
//! size limits. Scrapes come from pods we do not control and this parser is fuzzed, so it is a
//! small, strict, bounded line lexer that borrows from the input, keeps only the handful of
//! series the router reads and names the line of anything it rejects.
//!
//! # What is read (names confirmed against the engines' sources)
//! | | waiting | running | KV usage (0–1) | block size / capacity | prefix cache (tokens) |
//! |---|---|---|---|---|---|
//! | vLLM | `vllm:num_requests_waiting` | `vllm:num_requests_running` | `vllm:kv_cache_usage_perc`, else `vllm:gpu_cache_usage_perc` (v0 / before 0.9) | labels `block_size`, `num_gpu_blocks` of `vllm:cache_config_info` | `vllm:prefix_cache_{queries,hits}[_total]`, else the deprecated `vllm:gpu_prefix_cache_*` |
//! | SGLang | `sglang:num_queue_reqs` | `sglang:num_running_reqs` | `sglang:token_usage` | `sglang:max_total_num_tokens` (tokens) | `sglang:prompt_tokens_total`, `sglang:cached_tokens_total` (`cache_source="device"` only) |
//! | TRT-LLM | `trtllm_num_requests_waiting` | `trtllm_num_requests_running` | `trtllm_kv_cache_utilization`, else used/max blocks | `trtllm_kv_cache_tokens_per_block`, `trtllm_kv_cache_max_blocks` | `trtllm_prompt_tokens_total`, `trtllm_prompt_cached_tokens_total` |
//!
//! Latency histograms feed the cost model's calibration ([`crate::calibration`]); only their
//! `_sum` and `_count` series are read (per scrape, the deltas give mean values), never the
//! buckets:
//!
//! | | prefill time per request | TTFT, queue time | uncached tokens per request | inter-token latency |
//! |---|---|---|---|---|
//! | vLLM | `vllm:request_prefill_time_seconds` | `vllm:time_to_first_token_seconds`, `vllm:request_queue_time_seconds` | `vllm:request_prefill_kv_computed_tokens`, else Δ(queries − hits) | `vllm:inter_token_latency_seconds`, else `vllm:time_per_output_token_seconds` (before 0.11) |
//! | SGLang | — | `sglang:time_to_first_token_seconds`, `sglang:queue_time_seconds` | Δ(prompt − cached tokens) | `sglang:inter_token_latency_seconds`, else `sglang:time_per_output_token_seconds` |
//! | TRT-LLM | `trtllm_request_prefill_time_seconds` | `trtllm_time_to_first_token_seconds`, `trtllm_request_queue_time_seconds` | Δ(prompt − cached tokens) | `trtllm_time_per_output_token_seconds` |
//!
//! `vllm:iteration_tokens_total` (tokens per engine step) is not read: a step's size without
//! its duration gives no rate.
//!
//! `trtllm-serve` serves JSON iteration stats on `/metrics`; its Prometheus text is on
//! `/prometheus/metrics` and only exists with `return_perf_metrics` (the load gauges also need
//! `enable_iter_perf_stats`). Its stats task is woken when requests complete, so its gauges lag
//! arrivals, and — like SGLang's — it uses Python's multiprocess registry, where a labelled
//! gauge appears only once it has been set: a server that has not yet finished a request has
//! no load series, which reads as [`MetricsError::MissingMetric`]. `sglang:cache_hit_rate` is
//! a recent-window rate, not a pair of counters, so it is not mapped onto the prefix-cache
//! fields.
//!
//! # Ranks and repeated series
//! vLLM labels every series with `engine="<DP index>"` (the ranks its API server manages, so a
//! server started for one rank with `--data-parallel-rank k` reports `engine="k"`), SGLang with
//! `dp_rank` (only when data parallelism is on); TRT-LLM has no rank label. Within one rank, series that differ only in a
//! *replica* label describe the same scheduler state seen by several processes — SGLang's
//! `tp_rank`/`pp_rank`/`moe_ep_rank` (with `--enable-metrics-for-all-schedulers`) and the `pid`
//! that Python's multiprocess registry adds to gauges — so they are merged with `max`. Series
//! that differ in any other label (several `model_name` values, SGLang's `is_streaming`) are
//! parts of the whole: counts are summed, utilisation takes the max.
//!
//! A required metric (waiting, running, KV usage) that is absent is an error rather than a zero,
//! so that a scrape of the wrong engine kind, a disabled exporter or a renamed metric marks the
//! endpoint's scrape as failed instead of making it look idle.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::endpoint::EngineKind;

/// Bounds on what one scrape may cost. Every line is checked against them, also the lines that
/// are otherwise skipped, so the work and memory per scrape stay proportional to `max_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParseLimits {
    /// Size of the whole exposition.
    pub max_bytes: usize,
    /// Number of lines, comments and blank lines included.
    pub max_lines: usize,
    /// Labels on one series.
    pub max_labels_per_series: usize,
    /// Bytes in one label value, as written (escaped).
    pub max_label_value_len: usize,
    /// Distinct data-parallel ranks one server reports on.
    pub max_ranks: usize,
}

impl Default for ParseLimits {
    /// Room for a large engine: a vLLM server with 8 DP engines and its histograms is about
    /// 3,000 lines and 500 KB; `vllm:cache_config_info` carries one label per CacheConfig field
    /// (about 25 today); `vllm:lora_requests_info` joins adapter names into one label value.
    fn default() -> Self {
        Self {
            max_bytes: 16 << 20,
            max_lines: 250_000,
            max_labels_per_series: 128,
            max_label_value_len: 16 << 10,
            // the widest data-parallel deployments run a few hundred ranks per server
            max_ranks: 1024,
        }
    }
}

/// Load of one data-parallel rank (or of the whole server), as the engine reports it.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct LoadSample {
    /// Requests queued and not yet scheduled.
    pub waiting: f64,
    /// Requests in the running batch.
    pub running: f64,
    /// Fraction of the KV cache in use, clamped to `0..=1`.
    pub kv_usage: f64,
    /// Tokens per unit of `kv_capacity_blocks`. vLLM and TRT-LLM report their KV block size.
    /// SGLang exports its capacity in tokens and not its page size, so for SGLang this is
    /// `Some(1)` and the capacity is in tokens; divide by the configured page size to get pages.
    /// Either way `block_size * kv_capacity_blocks` is the capacity in tokens.
    pub block_size: Option<u32>,
    /// KV cache capacity in units of `block_size` tokens.
    pub kv_capacity_blocks: Option<u64>,
    /// Prompt tokens looked up in the prefix cache since the engine started (a counter).
    pub prefix_cache_queries: Option<f64>,
    /// Of those, tokens found in the cache on the GPU (a counter).
    pub prefix_cache_hits: Option<f64>,
    /// vLLM's `vllm:lora_requests_info`: the adapters its running requests use and
    /// `max_lora`. `None` when the engine serves no adapters (or does not say).
    pub lora: Option<LoraActivity>,
}

/// Most adapters [`LoraActivity`] keeps (vLLM's `max_loras` is typically 1-8).
pub const MAX_ACTIVE_LORAS: usize = 16;

/// The LoRA adapters an engine has in use: those of its running requests (loaded in its
/// `max_lora` GPU slots), from the newest series of `vllm:lora_requests_info` (vLLM writes a
/// new series, valued with the current time, on every logging interval).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct LoraActivity {
    /// xxh3 hashes of the running adapters' names, sorted; the first `running` are valid.
    #[serde(skip)]
    hashes: [u64; MAX_ACTIVE_LORAS],
    /// Adapters with running requests (at most [`MAX_ACTIVE_LORAS`] are kept).
    pub running: u8,
    /// Adapters with waiting requests.
    pub waiting: u8,
    /// The engine's `max_loras`: adapters it can hold in its GPU slots at once.
    pub max_lora: Option<u32>,
    /// Slots holding an adapter, busy or idle (SGLang's `lora_pool_slots_used`).
    pub slots_used: Option<u32>,
    /// Whether the engine names its adapters (vLLM does; SGLang reports only how full its
    /// adapter pool is, so `runs` is always false there).
    names_known: bool,
}

impl LoraActivity {
    /// From `lora_requests_info`'s labels: comma-separated adapter names and `max_lora`.
    pub fn new(running: &str, waiting: &str, max_lora: Option<u32>) -> Self {
        fn names(s: &str) -> BTreeSet<&str> {
            s.split(',')
                .map(str::trim)
                .filter(|n| !n.is_empty())
                .collect()
        }
        let run = names(running);
        let mut hashes = [0; MAX_ACTIVE_LORAS];
        let mut kept: Vec<u64> = run.iter().map(|n| lora_hash(n)).collect();
        kept.sort_unstable();
        kept.truncate(MAX_ACTIVE_LORAS);
        hashes[..kept.len()].copy_from_slice(&kept);
        Self {
            hashes,
            running: kept.len() as u8,
            waiting: names(waiting).len().min(255) as u8,
            max_lora,
            slots_used: None,
            names_known: true,
        }
    }

    /// SGLang's adapter pool: `used` of `total` slots hold an adapter, which ones unknown.
    fn pool(used: Option<f64>, total: f64) -> Self {
        let count = |v: f64| v.clamp(0.0, f64::from(u32::MAX)) as u32;
        Self {
            max_lora: Some(count(total)),
            slots_used: used.map(count),
            ..Self::default()
        }
    }

    /// Whether the engine names its adapters (so `runs` can answer).
    pub fn names_known(&self) -> bool {
        self.names_known
    }

    /// Whether adapter `name` has running requests, so is loaded.
    pub fn runs(&self, name: &str) -> bool {
        self.hashes[..usize::from(self.running)]
            .binary_search(&lora_hash(name))
            .is_ok()
    }

    /// Whether every GPU adapter slot holds an adapter with running requests: a request for
    /// another one waits until a slot frees. Unknown (false) when the engine does not name
    /// its adapters: a full pool may hold idle ones it can evict.
    pub fn slots_full(&self) -> bool {
        self.names_known
            && self
                .max_lora
                .is_some_and(|m| u32::from(self.running) >= m.max(1))
    }
}

/// The hash an adapter name is known by in [`LoraActivity`] and the picker's routing record.
pub fn lora_hash(name: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(name.as_bytes())
}

impl LoadSample {
    /// KV cache capacity in tokens, when the engine reports both factors.
    pub fn kv_capacity_tokens(&self) -> Option<u64> {
        self.kv_capacity_blocks?
            .checked_mul(u64::from(self.block_size?))
    }
}

/// What one scrape says about an engine server: a sample per data-parallel rank when the
/// exposition labels its series by rank, and an aggregate for the whole server.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EngineMetrics {
    engine: EngineKind,
    aggregate: LoadSample,
    ranks: BTreeMap<u32, LoadSample>,
    perf_aggregate: PerfCounters,
    perf_ranks: BTreeMap<u32, PerfCounters>,
}

impl EngineMetrics {
    /// The engine kind the scrape was read as.
    pub fn engine(&self) -> EngineKind {
        self.engine
    }

    /// The whole server: counts summed over ranks, KV usage the busiest rank's (a rank that is
    /// full rejects work even when its neighbours have room), capacity summed, block size when
    /// all ranks agree. Where the exposition also has a series without a rank label for a
    /// field, that series is the server-wide value and wins (SGLang's tokenizer counters are
    /// such series).
    pub fn aggregate(&self) -> &LoadSample {
        &self.aggregate
    }

    /// Per-rank samples, empty when the exposition has no rank label.
    pub fn ranks(&self) -> &BTreeMap<u32, LoadSample> {
        &self.ranks
    }

    /// The sample for a data-parallel rank. When the exposition has no per-rank series (one
    /// engine behind the server, or an engine that does not label ranks) every rank gets the
    /// aggregate; when it has them, a rank it does not list gets `None` rather than a guess.
    pub fn for_rank(&self, rank: u32) -> Option<&LoadSample> {
        if self.ranks.is_empty() {
            Some(&self.aggregate)
        } else {
            self.ranks.get(&rank)
        }
    }

    /// The latency counters for a data-parallel rank: the rank's own when it reports its
    /// timing (vLLM labels every histogram with `engine`), else the server's (SGLang's
    /// tokenizer reports TTFT once per server), so that the means derived from them always
    /// describe one consistent set of requests.
    pub fn perf_for_rank(&self, rank: u32) -> &PerfCounters {
        match self.perf_ranks.get(&rank) {
            Some(p) if p.has_timing() => p,
            _ => &self.perf_aggregate,
        }
    }

    /// The server's latency counters (summed over ranks where the series are per rank).
    pub fn perf_aggregate(&self) -> &PerfCounters {
        &self.perf_aggregate
    }
}

/// The `_sum` and `_count` of one histogram.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct SumCount {
    pub sum: f64,
    pub count: f64,
}

/// Cumulative latency and token counters an engine reports, as read from one scrape (each a
/// counter since the engine started; the calibration takes deltas between scrapes). Times in
/// seconds, as exported.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct PerfCounters {
    /// Time from a request's scheduling to its first token.
    pub prefill_time: Option<SumCount>,
    /// Time from a request's arrival to its first token.
    pub ttft: Option<SumCount>,
    /// Time requests waited before being scheduled.
    pub queue_time: Option<SumCount>,
    /// Tokens each request computed in prefill (its uncached prompt tokens).
    pub prefill_tokens: Option<SumCount>,
    /// Time between output tokens (the decode step as a request sees it).
    pub inter_token_latency: Option<SumCount>,
    /// Prompt tokens looked up in the prefix cache (a counter; see [`LoadSample`]).
    pub prompt_tokens: Option<f64>,
    /// Of those, tokens found cached.
    pub cached_tokens: Option<f64>,
}

impl PerfCounters {
    /// Whether a prefill duration can be derived: the prefill histogram, or TTFT and queue
    /// time.
    pub fn has_timing(&self) -> bool {
        self.prefill_time.is_some() || (self.ttft.is_some() && self.queue_time.is_some())
    }

    fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    fn read(folded: &Folded, rank: Option<u32>) -> Self {
        let get = |field| folded.get(&(field, rank)).copied();
        let pair = |sum, count| {
            Some(SumCount {
                sum: get(sum)?,
                count: get(count)?,
            })
        };
        use Field::*;
        Self {
            prefill_time: pair(PrefillTimeSum, PrefillTimeCount),
            ttft: pair(TtftSum, TtftCount),
            queue_time: pair(QueueTimeSum, QueueTimeCount),
            prefill_tokens: pair(PrefillTokensSum, PrefillTokensCount),
            inter_token_latency: pair(ItlSum, ItlCount)
                .or_else(|| pair(ItlFallbackSum, ItlFallbackCount)),
            prompt_tokens: get(Queries).or_else(|| get(QueriesFallback)),
            cached_tokens: get(Hits).or_else(|| get(HitsFallback)),
        }
    }

    /// Ranks combined into the server: every counter summed (present only when every rank
    /// has it).
    fn sum<'a>(parts: impl Iterator<Item = &'a PerfCounters> + Clone) -> Self {
        fn pairs(mut values: impl Iterator<Item = Option<SumCount>>) -> Option<SumCount> {
            values.try_fold(SumCount::default(), |acc, v| {
                let v = v?;
                Some(SumCount {
                    sum: acc.sum + v.sum,
                    count: acc.count + v.count,
                })
            })
        }
        let mut any = parts.clone().peekable();
        if any.peek().is_none() {
            return Self::default();
        }
        Self {
            prefill_time: pairs(parts.clone().map(|p| p.prefill_time)),
            ttft: pairs(parts.clone().map(|p| p.ttft)),
            queue_time: pairs(parts.clone().map(|p| p.queue_time)),
            prefill_tokens: pairs(parts.clone().map(|p| p.prefill_tokens)),
            inter_token_latency: pairs(parts.clone().map(|p| p.inter_token_latency)),
            prompt_tokens: parts.clone().map(|p| p.prompt_tokens).sum(),
            cached_tokens: parts.map(|p| p.cached_tokens).sum(),
        }
    }

    /// Field by field, `self` where it has a value, else `other`.
    fn or(self, other: Self) -> Self {
        Self {
            prefill_time: self.prefill_time.or(other.prefill_time),
            ttft: self.ttft.or(other.ttft),
            queue_time: self.queue_time.or(other.queue_time),
            prefill_tokens: self.prefill_tokens.or(other.prefill_tokens),
            inter_token_latency: self.inter_token_latency.or(other.inter_token_latency),
            prompt_tokens: self.prompt_tokens.or(other.prompt_tokens),
            cached_tokens: self.cached_tokens.or(other.cached_tokens),
        }
    }
}

/// Why a scrape could not be turned into load samples. Line numbers start at 1.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetricsError {
    #[error("exposition is {size} bytes, over the limit of {limit}")]
    TooLarge { size: usize, limit: usize },
    #[error("exposition has more than {limit} lines")]
    TooManyLines { limit: usize },
    #[error("line {line}: {reason}")]
    Syntax { line: usize, reason: &'static str },
    #[error("line {line}: more than {limit} labels on one series")]
    TooManyLabels { line: usize, limit: usize },
    #[error("line {line}: a label value is longer than {limit} bytes")]
    LabelValueTooLong { line: usize, limit: usize },
    #[error("line {line}: label {label} is not a data-parallel rank (an unsigned integer)")]
    BadRank { line: usize, label: &'static str },
    #[error("line {line}: more than {limit} data-parallel ranks")]
    TooManyRanks { line: usize, limit: usize },
    #[error("required metric {0} is missing")]
    MissingMetric(&'static str),
    #[error("required metric {metric} is missing for data-parallel rank {rank}")]
    IncompleteRank { metric: &'static str, rank: u32 },
}

/// Parses one scrape of `engine`'s metrics. Lines about other metrics are checked for syntax and
/// then skipped without being stored.
pub fn parse_engine_metrics(
    text: &str,
    engine: EngineKind,
    limits: &ParseLimits,
) -> Result<EngineMetrics, MetricsError> {
    if text.len() > limits.max_bytes {
        return Err(MetricsError::TooLarge {
            size: text.len(),
            limit: limits.max_bytes,
        });
    }
    let scheme = Scheme::for_engine(engine);
    let mut groups = Groups {
        max_ranks: limits.max_ranks,
        ..Groups::default()
    };
    let mut labels: Vec<(&str, &str)> = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let line_no = index.saturating_add(1);
        if line_no > limits.max_lines {
            return Err(MetricsError::TooManyLines {
                limit: limits.max_lines,
            });
        }
        labels.clear();
        let Some((name, value)) = lex_line(line, line_no, limits, &mut labels)? else {
            continue;
        };
        let Some(field) = scheme.classify(name) else {
            continue;
        };
        groups.add(&scheme, field, &labels, value, line_no)?;
    }
    let mut lora: BTreeMap<Option<u32>, LoraActivity> =
        groups.lora.iter().map(|(r, (_, a))| (*r, *a)).collect();
    let folded = groups.fold();
    // SGLang's adapter pool, per rank
    for ((field, rank), total) in &folded {
        if *field == Field::LoraSlotsTotal {
            let used = folded.get(&(Field::LoraSlotsUsed, *rank)).copied();
            lora.entry(*rank)
                .or_insert_with(|| LoraActivity::pool(used, *total));
        }
    }
    let mut metrics = build(engine, &folded)?;
    // a rank's own series, else the server's (vLLM's gauge carries no rank label)
    let global = lora.get(&None).copied();
    for (rank, sample) in &mut metrics.ranks {
        sample.lora = lora.get(&Some(*rank)).copied().or(global);
    }
    metrics.aggregate.lora = global.or_else(|| lora.values().next().copied());
    Ok(metrics)
}

/// One sample line of an exposition as the strict lexer reads it: the metric name, the
/// labels (values unescaped) and the value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    pub labels: Vec<(&'a str, Cow<'a, str>)>,
    pub value: f64,
}

impl Sample<'_> {
    /// The value of label `name`, if the sample has it.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_ref())
    }
}

/// Every sample of an exposition in order, read by the lexer [`parse_engine_metrics`] uses,
/// within the same limits. A text over `max_bytes` is refused whole; a line the lexer rejects
/// is an error naming it, and the lines after it are still read; past `max_lines` the last
/// item is a `TooManyLines` error.
pub fn samples<'a>(
    text: &'a str,
    limits: &'a ParseLimits,
) -> Result<impl Iterator<Item = Result<Sample<'a>, MetricsError>> + 'a, MetricsError> {
    if text.len() > limits.max_bytes {
        return Err(MetricsError::TooLarge {
            size: text.len(),
            limit: limits.max_bytes,
        });
    }
    Ok(text
        .lines()
        .enumerate()
        .take(limits.max_lines.saturating_add(1))
        .filter_map(move |(index, line)| {
            let line_no = index.saturating_add(1);
            if line_no > limits.max_lines {
                return Some(Err(MetricsError::TooManyLines {
                    limit: limits.max_lines,
                }));
            }
            let mut labels = Vec::new();
            match lex_line(line, line_no, limits, &mut labels) {
                Ok(None) => None,
                Ok(Some((name, value))) => Some(Ok(Sample {
                    name,
                    labels: labels.into_iter().map(|(k, v)| (k, unescape(v))).collect(),
                    value,
                })),
                Err(e) => Some(Err(e)),
            }
        }))
}

// ---------------------------------------------------------------------------------------------
// Lexer

/// Reads one line. Returns `None` for blank lines and comments (`# HELP`, `# TYPE`, `# EOF`…),
/// otherwise the metric name and value, with the raw (still escaped) label pairs in `labels`.
fn lex_line<'a>(
    line: &'a str,
    line_no: usize,
    limits: &ParseLimits,
    labels: &mut Vec<(&'a str, &'a str)>,
) -> Result<Option<(&'a str, f64)>, MetricsError> {
    let syntax = |reason| MetricsError::Syntax {
        line: line_no,
        reason,
    };
    let mut cur = Cursor::new(line);
    cur.skip_blanks();
    match cur.peek() {
        None | Some(b'#') => return Ok(None),
        _ => {}
    }
    let name = cur.take_while(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':');
    match name.as_bytes().first() {
        Some(b) if !b.is_ascii_digit() => {}
        _ => return Err(syntax("expected a metric name")),
    }
    let mut blank = cur.skip_blanks();
    if cur.eat(b'{') {
        lex_labels(&mut cur, line_no, limits, labels)?;
        blank = cur.skip_blanks();
    }
    if !blank {
        return Err(syntax("expected a space before the value"));
    }
    let value = cur.take_token();
    let value = parse_float(value).ok_or_else(|| syntax("invalid sample value"))?;
    if cur.skip_blanks() && !matches!(cur.peek(), None | Some(b'#')) {
        let timestamp = cur.take_token();
        if !parse_float(timestamp).is_some_and(f64::is_finite) {
            return Err(syntax("invalid timestamp"));
        }
        cur.skip_blanks();
    }
    // Anything left must be an OpenMetrics exemplar (`# {trace_id="…"} 1.0`); it is ignored.
    match cur.peek() {
        None | Some(b'#') => Ok(Some((name, value))),
        Some(_) => Err(syntax("unexpected text after the value")),
    }
}

/// Reads `name="value", …}` after the opening brace; a trailing comma is allowed.
fn lex_labels<'a>(
    cur: &mut Cursor<'a>,
    line_no: usize,
    limits: &ParseLimits,
    labels: &mut Vec<(&'a str, &'a str)>,
) -> Result<(), MetricsError> {
    let syntax = |reason| MetricsError::Syntax {
        line: line_no,
        reason,
    };
    loop {
        cur.skip_blanks();
        if cur.eat(b'}') {
            return Ok(());
        }
        let name = cur.take_while(|b| b.is_ascii_alphanumeric() || b == b'_');
        match name.as_bytes().first() {
            Some(b) if !b.is_ascii_digit() => {}
            _ => return Err(syntax("expected a label name")),
        }
        cur.skip_blanks();
        if !cur.eat(b'=') {
            return Err(syntax("expected '=' after a label name"));
        }
        cur.skip_blanks();
        if !cur.eat(b'"') {
            return Err(syntax("expected a quoted label value"));
        }
        let value = cur.take_label_value().map_err(syntax)?;
        if value.len() > limits.max_label_value_len {
            return Err(MetricsError::LabelValueTooLong {
                line: line_no,
                limit: limits.max_label_value_len,
            });
        }
        if labels.len() >= limits.max_labels_per_series {
            return Err(MetricsError::TooManyLabels {
                line: line_no,
                limit: limits.max_labels_per_series,
            });
        }
        labels.push((name, value));
        cur.skip_blanks();
        if cur.eat(b'}') {
            return Ok(());
        }
        if !cur.eat(b',') {
            return Err(syntax("expected ',' or '}' after a label"));
        }
    }
}

/// Go's `ParseFloat` spellings that exporters use (`NaN`, `+Inf`, `-Inf`, `1.5e+06`); Rust's
/// parser accepts those and a few more case variants, which is harmless.
fn parse_float(token: &str) -> Option<f64> {
    if token.is_empty() {
        return None;
    }
    token.parse::<f64>().ok()
}

/// A byte cursor over one line. Every token boundary it produces sits next to an ASCII byte, so
/// the `str::get` slices below are always on character boundaries; `get` keeps that panic-free
/// even if this reasoning were wrong.
struct Cursor<'a> {
    text: &'a str,
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn new(text: &'a str) -> Self {
        Self { text, pos: 0 }
    }

    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.pos).copied()
    }

    fn eat(&mut self, byte: u8) -> bool {
        if self.peek() == Some(byte) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    /// Skips spaces and tabs; tells whether there were any.
    fn skip_blanks(&mut self) -> bool {
        let start = self.pos;
        while matches!(self.peek(), Some(b' ' | b'\t')) {
            self.pos += 1;
        }
        self.pos > start
    }

    fn take_while(&mut self, keep: impl Fn(u8) -> bool) -> &'a str {
        let start = self.pos;
        while self.peek().is_some_and(&keep) {
            self.pos += 1;
        }
        self.text.get(start..self.pos).unwrap_or("")
    }

    /// A run of non-blank bytes.
    fn take_token(&mut self) -> &'a str {
        self.take_while(|b| b != b' ' && b != b'\t')
    }

    /// The raw text of a label value up to its closing quote (consumed). Only the escapes the
    /// format defines — `\\`, `\"`, `\n` — are accepted, as Prometheus' own parser does.
    fn take_label_value(&mut self) -> Result<&'a str, &'static str> {
        const UNTERMINATED: &str = "unterminated label value";
        let start = self.pos;
        loop {
            match self.peek().ok_or(UNTERMINATED)? {
                b'"' => break,
                b'\\' => {
                    self.pos += 1;
                    match self.peek().ok_or(UNTERMINATED)? {
                        b'\\' | b'"' | b'n' => self.pos += 1,
                        _ => return Err("invalid escape in a label value"),
                    }
                }
                _ => self.pos += 1,
            }
        }
        let value = self.text.get(start..self.pos).ok_or(UNTERMINATED)?;
        self.pos += 1;
        Ok(value)
    }
}

/// Decodes a raw label value; borrows when there is nothing to decode.
fn unescape(raw: &str) -> Cow<'_, str> {
    if !raw.contains('\\') {
        return Cow::Borrowed(raw);
    }
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            match chars.next() {
                Some('n') => out.push('\n'),
                Some(other) => out.push(other),
                None => {}
            }
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

// ---------------------------------------------------------------------------------------------
// Which series mean what, per engine

/// The quantities a series can feed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Field {
    Waiting,
    Running,
    KvUsage,
    /// Read only when `KvUsage` is absent (vLLM's pre-0.9 name).
    KvUsageFallback,
    BlockSize,
    CapacityBlocks,
    /// Capacity in tokens (SGLang), reported with a block size of 1.
    CapacityTokens,
    /// Used blocks, to compute KV usage when the engine gives no ratio (TRT-LLM).
    UsedBlocks,
    Queries,
    Hits,
    QueriesFallback,
    HitsFallback,
    /// vLLM's info gauge; its labels carry `BlockSize` and `CapacityBlocks`.
    CacheConfig,
    /// vLLM's `lora_requests_info`: labels `running_lora_adapters`, `waiting_lora_adapters`,
    /// `max_lora`; the value is the time it was written (the newest series counts).
    LoraInfo,
    /// SGLang's `lora_pool_slots_used` and `lora_pool_slots_total`.
    LoraSlotsUsed,
    LoraSlotsTotal,
    /// `_sum` and `_count` of the latency histograms (see [`PerfCounters`]).
    PrefillTimeSum,
    PrefillTimeCount,
    TtftSum,
    TtftCount,
    QueueTimeSum,
    QueueTimeCount,
    PrefillTokensSum,
    PrefillTokensCount,
    ItlSum,
    ItlCount,
    /// Read only when `ItlSum`/`ItlCount` are absent (the older `time_per_output_token` name).
    ItlFallbackSum,
    ItlFallbackCount,
}

impl Field {
    /// Counts of separate things add up; ratios and configuration do not.
    fn sums(self) -> bool {
        matches!(
            self,
            Self::Waiting
                | Self::Running
                | Self::Queries
                | Self::Hits
                | Self::QueriesFallback
                | Self::HitsFallback
                | Self::PrefillTimeSum
                | Self::PrefillTimeCount
                | Self::TtftSum
                | Self::TtftCount
                | Self::QueueTimeSum
                | Self::QueueTimeCount
                | Self::PrefillTokensSum
                | Self::PrefillTokensCount
                | Self::ItlSum
                | Self::ItlCount
                | Self::ItlFallbackSum
                | Self::ItlFallbackCount
        )
    }
}

struct Scheme {
    engine: EngineKind,
    /// Label holding the data-parallel rank, if the engine has one.
    rank_label: Option<&'static str>,
    /// Labels whose values only name another process reporting the same state.
    replica_labels: &'static [&'static str],
}

impl Scheme {
    fn for_engine(engine: EngineKind) -> Self {
        match engine {
            EngineKind::Vllm => Self {
                engine,
                rank_label: Some("engine"),
                replica_labels: &["pid"],
            },
            EngineKind::Sglang => Self {
                engine,
                rank_label: Some("dp_rank"),
                replica_labels: &["pid", "tp_rank", "pp_rank", "moe_ep_rank"],
            },
            EngineKind::Trtllm => Self {
                engine,
                rank_label: None,
                replica_labels: &["pid"],
            },
        }
    }

    /// Maps a sample name to a field. Counters are matched with and without `_total`: the text
    /// format of `prometheus_client` appends it, other exporters write the family name.
    fn classify(&self, name: &str) -> Option<Field> {
        use Field::*;
        Some(match self.engine {
            EngineKind::Vllm => match name {
                "vllm:num_requests_waiting" => Waiting,
                "vllm:num_requests_running" => Running,
                "vllm:kv_cache_usage_perc" => KvUsage,
                "vllm:gpu_cache_usage_perc" => KvUsageFallback,
                "vllm:cache_config_info" => CacheConfig,
                "vllm:lora_requests_info" => LoraInfo,
                "vllm:prefix_cache_queries_total" | "vllm:prefix_cache_queries" => Queries,
                "vllm:prefix_cache_hits_total" | "vllm:prefix_cache_hits" => Hits,
                "vllm:gpu_prefix_cache_queries_total" | "vllm:gpu_prefix_cache_queries" => {
                    QueriesFallback
                }
                "vllm:gpu_prefix_cache_hits_total" | "vllm:gpu_prefix_cache_hits" => HitsFallback,
                "vllm:request_prefill_time_seconds_sum" => PrefillTimeSum,
                "vllm:request_prefill_time_seconds_count" => PrefillTimeCount,
                "vllm:time_to_first_token_seconds_sum" => TtftSum,
                "vllm:time_to_first_token_seconds_count" => TtftCount,
                "vllm:request_queue_time_seconds_sum" => QueueTimeSum,
                "vllm:request_queue_time_seconds_count" => QueueTimeCount,
                "vllm:request_prefill_kv_computed_tokens_sum" => PrefillTokensSum,
                "vllm:request_prefill_kv_computed_tokens_count" => PrefillTokensCount,
                "vllm:inter_token_latency_seconds_sum" => ItlSum,
                "vllm:inter_token_latency_seconds_count" => ItlCount,
                "vllm:time_per_output_token_seconds_sum" => ItlFallbackSum,
                "vllm:time_per_output_token_seconds_count" => ItlFallbackCount,
                _ => return None,
            },
            EngineKind::Sglang => match name {
                "sglang:num_queue_reqs" => Waiting,
                "sglang:lora_pool_slots_used" => LoraSlotsUsed,
                "sglang:lora_pool_slots_total" => LoraSlotsTotal,
                "sglang:num_running_reqs" => Running,
                "sglang:token_usage" => KvUsage,
                "sglang:max_total_num_tokens" => CapacityTokens,
                "sglang:prompt_tokens_total" | "sglang:prompt_tokens" => Queries,
                "sglang:cached_tokens_total" | "sglang:cached_tokens" => Hits,
                "sglang:time_to_first_token_seconds_sum" => TtftSum,
                "sglang:time_to_first_token_seconds_count" => TtftCount,
                "sglang:queue_time_seconds_sum" => QueueTimeSum,
                "sglang:queue_time_seconds_count" => QueueTimeCount,
                "sglang:inter_token_latency_seconds_sum" => ItlSum,
                "sglang:inter_token_latency_seconds_count" => ItlCount,
                "sglang:time_per_output_token_seconds_sum" => ItlFallbackSum,
                "sglang:time_per_output_token_seconds_count" => ItlFallbackCount,
                _ => return None,
            },
            EngineKind::Trtllm => match name {
                "trtllm_num_requests_waiting" => Waiting,
                "trtllm_num_requests_running" => Running,
                "trtllm_kv_cache_utilization" => KvUsage,
                "trtllm_kv_cache_tokens_per_block" => BlockSize,
                "trtllm_kv_cache_max_blocks" => CapacityBlocks,
                "trtllm_kv_cache_used_blocks" => UsedBlocks,
                "trtllm_prompt_tokens_total" | "trtllm_prompt_tokens" => Queries,
                "trtllm_prompt_cached_tokens_total" | "trtllm_prompt_cached_tokens" => Hits,
                "trtllm_request_prefill_time_seconds_sum" => PrefillTimeSum,
                "trtllm_request_prefill_time_seconds_count" => PrefillTimeCount,
                "trtllm_time_to_first_token_seconds_sum" => TtftSum,
                "trtllm_time_to_first_token_seconds_count" => TtftCount,
                "trtllm_request_queue_time_seconds_sum" => QueueTimeSum,
                "trtllm_request_queue_time_seconds_count" => QueueTimeCount,
                "trtllm_time_per_output_token_seconds_sum" => ItlSum,
                "trtllm_time_per_output_token_seconds_count" => ItlCount,
                _ => return None,
            },
        })
    }

    /// The name reported when a required field is missing.
    fn metric_name(&self, field: Field) -> &'static str {
        match (self.engine, field) {
            (EngineKind::Vllm, Field::Waiting) => "vllm:num_requests_waiting",
            (EngineKind::Vllm, Field::Running) => "vllm:num_requests_running",
            (EngineKind::Vllm, _) => "vllm:kv_cache_usage_perc",
            (EngineKind::Sglang, Field::Waiting) => "sglang:num_queue_reqs",
            (EngineKind::Sglang, Field::Running) => "sglang:num_running_reqs",
            (EngineKind::Sglang, _) => "sglang:token_usage",
            (EngineKind::Trtllm, Field::Waiting) => "trtllm_num_requests_waiting",
            (EngineKind::Trtllm, Field::Running) => "trtllm_num_requests_running",
            (EngineKind::Trtllm, _) => "trtllm_kv_cache_utilization",
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Grouping

/// Values per (field, rank, group), where the group is the series' labels minus the rank and
/// replica labels: replicas of one group are merged with `max` as they arrive.
#[derive(Default)]
struct Groups {
    values: BTreeMap<(Field, Option<u32>, String), f64>,
    /// Distinct ranks seen, bounded by [`ParseLimits::max_ranks`].
    ranks: std::collections::BTreeSet<u32>,
    max_ranks: usize,
    /// The newest `lora_requests_info` series per rank: (its value, the activity).
    lora: BTreeMap<Option<u32>, (f64, LoraActivity)>,
}

/// Values per (field, rank) once groups are combined.
type Folded = BTreeMap<(Field, Option<u32>), f64>;

impl Groups {
    fn add(
        &mut self,
        scheme: &Scheme,
        field: Field,
        labels: &[(&str, &str)],
        value: f64,
        line_no: usize,
    ) -> Result<(), MetricsError> {
        // Only the series kept are checked for repeated label names, so skipped lines cost no
        // quadratic work.
        for (i, (name, _)) in labels.iter().enumerate() {
            if labels.iter().skip(i + 1).any(|(other, _)| other == name) {
                return Err(MetricsError::Syntax {
                    line: line_no,
                    reason: "repeated label name",
                });
            }
        }
        let rank = match scheme.rank_label {
            Some(rank_label) => rank_of(labels, rank_label, line_no)?,
            None => None,
        };
        if let Some(r) = rank
            && self.ranks.insert(r)
            && self.ranks.len() > self.max_ranks
        {
            return Err(MetricsError::TooManyRanks {
                line: line_no,
                limit: self.max_ranks,
            });
        }
        if field == Field::LoraInfo {
            if value.is_finite() && self.lora.get(&rank).is_none_or(|(t, _)| value >= *t) {
                let get = |l| label_value(labels, l).unwrap_or_default();
                let activity = LoraActivity::new(
                    &get("running_lora_adapters"),
                    &get("waiting_lora_adapters"),
                    get("max_lora").parse().ok(),
                );
                self.lora.insert(rank, (value, activity));
            }
            return Ok(());
        }
        if field == Field::CacheConfig {
            // An info gauge: the data is in the labels; its value is always 1.
            for (label, target) in [
                ("block_size", Field::BlockSize),
                ("num_gpu_blocks", Field::CapacityBlocks),
            ] {
                let parsed = label_value(labels, label).and_then(|v| v.parse::<u64>().ok());
                if let Some(n) = parsed {
                    self.merge(target, rank, String::new(), n as f64);
                }
            }
            return Ok(());
        }
        // Negative or non-finite load is meaningless; dropping it makes a metric that only has
        // such values count as missing.
        if !value.is_finite() || value < 0.0 {
            return Ok(());
        }
        // SGLang splits cached tokens by where they were found; only the GPU's count matches
        // what the router predicts (and vLLM's `prefix_cache_hits`).
        if scheme.engine == EngineKind::Sglang
            && field == Field::Hits
            && label_value(labels, "cache_source").is_some_and(|s| s != "device")
        {
            return Ok(());
        }
        let mut key: Vec<(&str, &str)> = labels
            .iter()
            .filter(|(name, _)| {
                Some(*name) != scheme.rank_label && !scheme.replica_labels.iter().any(|r| r == name)
            })
            .copied()
            .collect();
        key.sort_unstable();
        // Raw values cannot hold an unescaped quote, so this encoding is unambiguous.
        let mut group = String::new();
        for (name, raw) in key {
            group.push_str(name);
            group.push_str("=\"");
            group.push_str(raw);
            group.push_str("\",");
        }
        self.merge(field, rank, group, value);
        Ok(())
    }

    fn merge(&mut self, field: Field, rank: Option<u32>, group: String, value: f64) {
        self.values
            .entry((field, rank, group))
            .and_modify(|v| *v = v.max(value))
            .or_insert(value);
    }

    fn fold(&self) -> Folded {
        let mut folded = Folded::new();
        for ((field, rank, _), value) in &self.values {
            folded
                .entry((*field, *rank))
                .and_modify(|v| {
                    *v = if field.sums() {
                        *v + value
                    } else {
                        v.max(*value)
                    }
                })
                .or_insert(*value);
        }
        folded
    }
}

/// The rank a series belongs to; `None` when it has no rank label (an empty value counts as
/// absent, as in Prometheus).
fn rank_of(
    labels: &[(&str, &str)],
    rank_label: &'static str,
    line_no: usize,
) -> Result<Option<u32>, MetricsError> {
    let Some(raw) = labels
        .iter()
        .find(|(name, _)| *name == rank_label)
        .map(|(_, raw)| *raw)
    else {
        return Ok(None);
    };
    if raw.is_empty() {
        return Ok(None);
    }
    if !raw.bytes().all(|b| b.is_ascii_digit()) {
        return Err(MetricsError::BadRank {
            line: line_no,
            label: rank_label,
        });
    }
    raw.parse::<u32>()
        .map(Some)
        .map_err(|_| MetricsError::BadRank {
            line: line_no,
            label: rank_label,
        })
}

fn label_value<'a>(labels: &[(&str, &'a str)], name: &str) -> Option<Cow<'a, str>> {
    labels
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, raw)| unescape(raw))
}

// ---------------------------------------------------------------------------------------------
// Samples

/// A sample whose fields may still be missing.
#[derive(Debug, Clone, Default)]
struct Partial {
    waiting: Option<f64>,
    running: Option<f64>,
    kv_usage: Option<f64>,
    block_size: Option<u32>,
    capacity: Option<u64>,
    queries: Option<f64>,
    hits: Option<f64>,
}

impl Partial {
    /// The fields of one rank (or of the rank-less series), with each engine's fallbacks.
    fn read(folded: &Folded, rank: Option<u32>) -> Self {
        let get = |field| folded.get(&(field, rank)).copied();
        let mut block_size = get(Field::BlockSize).and_then(to_u32);
        let mut capacity = get(Field::CapacityBlocks).and_then(to_u64);
        if let Some(tokens) = get(Field::CapacityTokens).and_then(to_u64) {
            block_size = Some(1);
            capacity = Some(tokens);
        }
        let kv_from_blocks = match (get(Field::UsedBlocks), capacity) {
            (Some(used), Some(total)) if total > 0 => Some(used / total as f64),
            _ => None,
        };
        let kv_usage = get(Field::KvUsage)
            .or_else(|| get(Field::KvUsageFallback))
            .or(kv_from_blocks)
            .map(|u| u.clamp(0.0, 1.0));
        Self {
            waiting: get(Field::Waiting),
            running: get(Field::Running),
            kv_usage,
            block_size,
            capacity,
            queries: get(Field::Queries).or_else(|| get(Field::QueriesFallback)),
            hits: get(Field::Hits).or_else(|| get(Field::HitsFallback)),
        }
    }

    /// Whether this rank reports load at all (as opposed to only configuration or counters).
    fn has_load(&self) -> bool {
        self.waiting.is_some() || self.running.is_some() || self.kv_usage.is_some()
    }

    /// Combines ranks into the server: see [`EngineMetrics::aggregate`].
    fn combine<'a>(parts: impl Iterator<Item = &'a Partial> + Clone) -> Self {
        fn sum(values: impl Iterator<Item = Option<f64>>) -> Option<f64> {
            values.sum()
        }
        let block_size = {
            let mut sizes = parts.clone().map(|p| p.block_size);
            let first = sizes.next().flatten();
            if sizes.all(|s| s == first) {
                first
            } else {
                None
            }
        };
        Self {
            waiting: sum(parts.clone().map(|p| p.waiting)),
            running: sum(parts.clone().map(|p| p.running)),
            kv_usage: parts
                .clone()
                .map(|p| p.kv_usage)
                .reduce(|a, b| Some(a?.max(b?)))
                .flatten(),
            block_size,
            capacity: parts
                .clone()
                .map(|p| p.capacity)
                .try_fold(0u64, |acc, c| acc.checked_add(c?)),
            queries: sum(parts.clone().map(|p| p.queries)),
            hits: sum(parts.map(|p| p.hits)),
        }
    }

    /// Field by field, `self` where it has a value, else `other`.
    fn or(self, other: Self) -> Self {
        Self {
            waiting: self.waiting.or(other.waiting),
            running: self.running.or(other.running),
            kv_usage: self.kv_usage.or(other.kv_usage),
            block_size: self.block_size.or(other.block_size),
            capacity: self.capacity.or(other.capacity),
            queries: self.queries.or(other.queries),
            hits: self.hits.or(other.hits),
        }
    }

    /// The finished sample, or the first required field it lacks.
    fn complete(self) -> Result<LoadSample, Field> {
        Ok(LoadSample {
            waiting: self.waiting.ok_or(Field::Waiting)?,
            running: self.running.ok_or(Field::Running)?,
            kv_usage: self.kv_usage.ok_or(Field::KvUsage)?,
            block_size: self.block_size,
            kv_capacity_blocks: self.capacity,
            prefix_cache_queries: self.queries,
            prefix_cache_hits: self.hits,
            lora: None,
        })
    }
}

fn build(engine: EngineKind, folded: &Folded) -> Result<EngineMetrics, MetricsError> {
    let scheme = Scheme::for_engine(engine);
    let rank_ids: BTreeSet<u32> = folded.keys().filter_map(|(_, rank)| *rank).collect();
    let global = Partial::read(folded, None);
    let mut partials = BTreeMap::new();
    for &rank in &rank_ids {
        let partial = Partial::read(folded, Some(rank));
        // A rank named only by configuration or counters has no load to route on.
        if partial.has_load() {
            partials.insert(rank, partial);
        }
    }
    let mut ranks = BTreeMap::new();
    for (rank, partial) in &partials {
        let sample = partial
            .clone()
            .complete()
            .map_err(|field| MetricsError::IncompleteRank {
                metric: scheme.metric_name(field),
                rank: *rank,
            })?;
        ranks.insert(*rank, sample);
    }
    let aggregate = if partials.is_empty() {
        global
    } else {
        global.or(Partial::combine(partials.values()))
    };
    let aggregate = aggregate
        .complete()
        .map_err(|field| MetricsError::MissingMetric(scheme.metric_name(field)))?;
    let mut perf_ranks = BTreeMap::new();
    for &rank in &rank_ids {
        let perf = PerfCounters::read(folded, Some(rank));
        if !perf.is_empty() {
            perf_ranks.insert(rank, perf);
        }
    }
    let perf_aggregate =
        PerfCounters::read(folded, None).or(PerfCounters::sum(perf_ranks.values()));
    Ok(EngineMetrics {
        engine,
        aggregate,
        ranks,
        perf_aggregate,
        perf_ranks,
    })
}

/// Exporters print integers as floats (`4096.0`); only exact, representable ones are accepted.
fn to_u64(value: f64) -> Option<u64> {
    const MAX_EXACT: f64 = 9_007_199_254_740_992.0; // 2^53
    ((0.0..=MAX_EXACT).contains(&value) && value.fract() == 0.0).then_some(value as u64)
}

fn to_u32(value: f64) -> Option<u32> {
    to_u64(value).and_then(|v| u32::try_from(v).ok())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const VLLM: &str = include_str!("../tests/fixtures/metrics/vllm.txt");
    const VLLM_OLD: &str = include_str!("../tests/fixtures/metrics/vllm-old.txt");
    const SGLANG: &str = include_str!("../tests/fixtures/metrics/sglang.txt");
    const TRTLLM: &str = include_str!("../tests/fixtures/metrics/trtllm.txt");

    #[test]
    fn samples_read_every_line_with_the_strict_lexer_and_its_limits() {
        let limits = ParseLimits::default();
        let all: Vec<_> = samples(VLLM, &limits).unwrap().collect();
        assert!(all.iter().all(Result::is_ok));
        let info = all
            .iter()
            .flatten()
            .find(|s| s.name == "vllm:cache_config_info")
            .expect("the fixture has cache_config_info");
        assert!(info.label("block_size").is_some());
        // a bad line is an error naming it, and reading goes on
        let text = "a 1\nb{x=\"1\" 2\nc{x=\"q\\\"\"} 3\n";
        let got: Vec<_> = samples(text, &limits).unwrap().collect();
        assert_eq!(got.len(), 3);
        assert!(matches!(got[1], Err(MetricsError::Syntax { line: 2, .. })));
        let c = got[2].as_ref().unwrap();
        assert_eq!((c.name, c.label("x"), c.value), ("c", Some("q\""), 3.0));
        // the size and line limits hold
        let small = ParseLimits {
            max_bytes: 4,
            ..limits
        };
        assert!(matches!(
            samples(text, &small).err(),
            Some(MetricsError::TooLarge { .. })
        ));
        let short = ParseLimits {
            max_lines: 1,
            ..limits
        };
        let cut: Vec<_> = samples(text, &short).unwrap().collect();
        assert_eq!(cut.len(), 2);
        assert!(matches!(
            cut[1],
            Err(MetricsError::TooManyLines { limit: 1 })
        ));
    }

    fn parse(text: &str, engine: EngineKind) -> Result<EngineMetrics, MetricsError> {
        parse_engine_metrics(text, engine, &ParseLimits::default())
    }

    fn vllm(text: &str) -> Result<EngineMetrics, MetricsError> {
        parse(text, EngineKind::Vllm)
    }

    fn load(waiting: f64, running: f64, kv_usage: f64) -> LoadSample {
        LoadSample {
            waiting,
            running,
            kv_usage,
            ..LoadSample::default()
        }
    }

    #[test]
    fn vllm_v1_fixture_per_engine() {
        let m = vllm(VLLM).unwrap();
        assert_eq!(m.engine(), EngineKind::Vllm);
        let rank0 = LoadSample {
            waiting: 3.0,
            running: 12.0,
            kv_usage: 0.4375,
            block_size: Some(16),
            kv_capacity_blocks: Some(27713),
            prefix_cache_queries: Some(1_048_576.0),
            prefix_cache_hits: Some(524_288.0),
            lora: None,
        };
        let rank1 = LoadSample {
            waiting: 0.0,
            running: 9.0,
            kv_usage: 0.3125,
            block_size: Some(16),
            kv_capacity_blocks: Some(27713),
            prefix_cache_queries: Some(917_504.0),
            prefix_cache_hits: Some(393_216.0),
            lora: None,
        };
        assert_eq!(m.ranks().len(), 2);
        assert_eq!(m.for_rank(0), Some(&rank0));
        assert_eq!(m.for_rank(1), Some(&rank1));
        assert_eq!(m.for_rank(2), None);
        assert_eq!(
            m.aggregate(),
            &LoadSample {
                waiting: 3.0,
                running: 21.0,
                kv_usage: 0.4375,
                block_size: Some(16),
                kv_capacity_blocks: Some(55426),
                prefix_cache_queries: Some(1_966_080.0),
                prefix_cache_hits: Some(917_504.0),
                lora: None,
            }
        );
        assert_eq!(rank0.kv_capacity_tokens(), Some(27713 * 16));
    }

    #[test]
    fn vllm_v0_fixture_uses_old_names_and_the_aggregate() {
        let m = vllm(VLLM_OLD).unwrap();
        let expected = LoadSample {
            waiting: 2.0,
            running: 7.0,
            kv_usage: 0.6234720505424,
            block_size: Some(16),
            kv_capacity_blocks: Some(7281),
            prefix_cache_queries: None,
            prefix_cache_hits: None,
            lora: None,
        };
        assert!(m.ranks().is_empty());
        assert_eq!(m.aggregate(), &expected);
        assert_eq!(m.for_rank(0), Some(&expected));
        assert_eq!(m.for_rank(3), Some(&expected));
    }

    #[test]
    fn sglang_fixture_per_dp_rank() {
        let m = parse(SGLANG, EngineKind::Sglang).unwrap();
        let rank = |waiting, running, kv_usage| LoadSample {
            waiting,
            running,
            kv_usage,
            block_size: Some(1),
            kv_capacity_blocks: Some(412_000),
            prefix_cache_queries: None,
            prefix_cache_hits: None,
            lora: None,
        };
        assert_eq!(m.for_rank(0), Some(&rank(5.0, 14.0, 0.52)));
        assert_eq!(m.for_rank(1), Some(&rank(1.0, 11.0, 0.47)));
        assert_eq!(m.for_rank(2), None);
        // The tokenizer's counters have no dp_rank: they are the server's; host hits excluded.
        assert_eq!(
            m.aggregate(),
            &LoadSample {
                waiting: 6.0,
                running: 25.0,
                kv_usage: 0.52,
                block_size: Some(1),
                kv_capacity_blocks: Some(824_000),
                prefix_cache_queries: Some(2_346_800.0),
                prefix_cache_hits: Some(1_200_000.0),
                lora: None,
            }
        );
        assert_eq!(m.aggregate().kv_capacity_tokens(), Some(824_000));
    }

    #[test]
    fn trtllm_fixture() {
        let m = parse(TRTLLM, EngineKind::Trtllm).unwrap();
        let expected = LoadSample {
            waiting: 4.0,
            running: 32.0,
            kv_usage: 0.6875,
            block_size: Some(32),
            kv_capacity_blocks: Some(4096),
            prefix_cache_queries: Some(473_088.0),
            prefix_cache_hits: Some(190_464.0),
            lora: None,
        };
        assert!(m.ranks().is_empty());
        assert_eq!(m.for_rank(0), Some(&expected));
        assert_eq!(m.aggregate().kv_capacity_tokens(), Some(4096 * 32));
    }

    #[test]
    fn fixtures_read_as_the_wrong_engine_fail() {
        assert_eq!(
            parse(VLLM, EngineKind::Sglang),
            Err(MetricsError::MissingMetric("sglang:num_queue_reqs"))
        );
        assert_eq!(
            parse(SGLANG, EngineKind::Trtllm),
            Err(MetricsError::MissingMetric("trtllm_num_requests_waiting"))
        );
        assert_eq!(
            vllm(TRTLLM),
            Err(MetricsError::MissingMetric("vllm:num_requests_waiting"))
        );
    }

    #[test]
    fn missing_kv_usage_is_an_error_not_a_zero() {
        let text = "vllm:num_requests_waiting 1\nvllm:num_requests_running 2\n";
        assert_eq!(
            vllm(text),
            Err(MetricsError::MissingMetric("vllm:kv_cache_usage_perc"))
        );
        // Declared but without samples is missing too.
        let text = "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_running 2\n\
                    vllm:kv_cache_usage_perc 0.1\n";
        assert_eq!(
            vllm(text),
            Err(MetricsError::MissingMetric("vllm:num_requests_waiting"))
        );
    }

    #[test]
    fn new_kv_name_wins_over_the_deprecated_one() {
        let text = "vllm:num_requests_waiting 1\nvllm:num_requests_running 2\n\
                    vllm:gpu_cache_usage_perc 0.9\nvllm:kv_cache_usage_perc 0.25\n";
        assert_eq!(vllm(text).unwrap().aggregate(), &load(1.0, 2.0, 0.25));
    }

    #[test]
    fn prefix_counters_with_and_without_total_and_deprecated_names() {
        let base = "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n\
                    vllm:kv_cache_usage_perc 0\n";
        let bare = format!("{base}vllm:prefix_cache_queries 10\nvllm:prefix_cache_hits 4\n");
        let agg = vllm(&bare).unwrap().aggregate().clone();
        assert_eq!(
            (agg.prefix_cache_queries, agg.prefix_cache_hits),
            (Some(10.0), Some(4.0))
        );
        let old = format!(
            "{base}vllm:gpu_prefix_cache_queries_total 7\nvllm:gpu_prefix_cache_hits_total 3\n"
        );
        let agg = vllm(&old).unwrap().aggregate().clone();
        assert_eq!(
            (agg.prefix_cache_queries, agg.prefix_cache_hits),
            (Some(7.0), Some(3.0))
        );
        let both = format!("{bare}vllm:gpu_prefix_cache_queries_total 7\n");
        assert_eq!(
            vllm(&both).unwrap().aggregate().prefix_cache_queries,
            Some(10.0)
        );
        // `_created` is not the counter.
        let created = format!("{base}vllm:prefix_cache_queries_created 1.7e+09\n");
        assert_eq!(
            vllm(&created).unwrap().aggregate().prefix_cache_queries,
            None
        );
    }

    #[test]
    fn several_series_in_one_rank_sum_counts_and_max_utilisation() {
        let text = r#"
vllm:num_requests_waiting{engine="0",model_name="a"} 2
vllm:num_requests_waiting{engine="0",model_name="b"} 3
vllm:num_requests_running{engine="0",model_name="a"} 1
vllm:num_requests_running{engine="0",model_name="b"} 4
vllm:kv_cache_usage_perc{engine="0",model_name="a"} 0.2
vllm:kv_cache_usage_perc{engine="0",model_name="b"} 0.7
vllm:prefix_cache_hits_total{engine="0",model_name="a"} 5
vllm:prefix_cache_hits_total{engine="0",model_name="b"} 6
"#;
        let m = vllm(text).unwrap();
        let rank0 = m.for_rank(0).unwrap();
        assert_eq!(
            (rank0.waiting, rank0.running, rank0.kv_usage),
            (5.0, 5.0, 0.7)
        );
        assert_eq!(rank0.prefix_cache_hits, Some(11.0));
    }

    #[test]
    fn replicas_of_one_rank_are_not_double_counted() {
        // --enable-metrics-for-all-schedulers: every TP worker of DP rank 0 reports the same
        // scheduler state; multiprocess gauges also carry a pid.
        let text = r#"
sglang:num_queue_reqs{dp_rank="0",tp_rank="0",pid="10"} 4
sglang:num_queue_reqs{dp_rank="0",tp_rank="1",pid="11"} 4
sglang:num_running_reqs{dp_rank="0",tp_rank="0"} 9
sglang:num_running_reqs{dp_rank="0",tp_rank="1"} 9
sglang:token_usage{dp_rank="0",tp_rank="0"} 0.3
sglang:token_usage{dp_rank="0",tp_rank="1"} 0.3
"#;
        let m = parse(text, EngineKind::Sglang).unwrap();
        assert_eq!(m.for_rank(0), Some(&load(4.0, 9.0, 0.3)));
        assert_eq!(m.aggregate(), &load(4.0, 9.0, 0.3));
    }

    #[test]
    fn rank_missing_a_required_metric_is_an_error() {
        let text = r#"
vllm:num_requests_waiting{engine="0"} 1
vllm:num_requests_waiting{engine="1"} 1
vllm:num_requests_running{engine="0"} 1
vllm:kv_cache_usage_perc{engine="0"} 0.5
vllm:kv_cache_usage_perc{engine="1"} 0.5
"#;
        assert_eq!(
            vllm(text),
            Err(MetricsError::IncompleteRank {
                metric: "vllm:num_requests_running",
                rank: 1
            })
        );
    }

    #[test]
    fn rank_named_only_by_configuration_is_ignored() {
        let text = r#"
vllm:num_requests_waiting{engine="0"} 1
vllm:num_requests_running{engine="0"} 2
vllm:kv_cache_usage_perc{engine="0"} 0.5
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1
vllm:cache_config_info{block_size="16",engine="7",num_gpu_blocks="100"} 1
"#;
        let m = vllm(text).unwrap();
        assert_eq!(m.ranks().keys().copied().collect::<Vec<_>>(), vec![0]);
        assert_eq!(m.for_rank(7), None);
    }

    #[test]
    fn unlabelled_cache_config_and_unparsable_block_counts() {
        // Before profiling vLLM prints num_gpu_blocks="None".
        let text = r#"
vllm:num_requests_waiting 0
vllm:num_requests_running 0
vllm:kv_cache_usage_perc 0
vllm:cache_config_info{block_size="32",num_gpu_blocks="None"} 1.0
"#;
        let agg = vllm(text).unwrap().aggregate().clone();
        assert_eq!((agg.block_size, agg.kv_capacity_blocks), (Some(32), None));
        assert_eq!(agg.kv_capacity_tokens(), None);
    }

    #[test]
    fn empty_rank_label_means_no_rank_and_bad_rank_names_the_line() {
        let text = "vllm:num_requests_waiting{engine=\"\"} 1\nvllm:num_requests_running 2\n\
                    vllm:kv_cache_usage_perc 0.5\n";
        let m = vllm(text).unwrap();
        assert!(m.ranks().is_empty());
        assert_eq!(m.aggregate(), &load(1.0, 2.0, 0.5));

        let text =
            "vllm:num_requests_running 2\n\n# x\nvllm:num_requests_waiting{engine=\"a\"} 1\n";
        let err = vllm(text).unwrap_err();
        assert_eq!(
            err,
            MetricsError::BadRank {
                line: 4,
                label: "engine"
            }
        );
        assert!(err.to_string().starts_with("line 4:"));
        let text = "vllm:num_requests_waiting{engine=\"99999999999\"} 1\n";
        assert!(matches!(
            vllm(text),
            Err(MetricsError::BadRank { line: 1, .. })
        ));
    }

    #[test]
    fn trtllm_kv_usage_from_blocks_and_clamping() {
        let text = "trtllm_num_requests_waiting 0\ntrtllm_num_requests_running 1\n\
                    trtllm_kv_cache_used_blocks 300\ntrtllm_kv_cache_max_blocks 1200\n\
                    trtllm_kv_cache_tokens_per_block 64\n";
        let agg = parse(text, EngineKind::Trtllm).unwrap().aggregate().clone();
        assert_eq!(agg.kv_usage, 0.25);
        assert_eq!(agg.kv_capacity_tokens(), Some(1200 * 64));

        let text = "vllm:num_requests_waiting 0\nvllm:num_requests_running 1\n\
                    vllm:kv_cache_usage_perc 1.02\n";
        assert_eq!(vllm(text).unwrap().aggregate().kv_usage, 1.0);
    }

    #[test]
    fn non_finite_and_negative_values_count_as_missing() {
        let text = "vllm:num_requests_waiting NaN\nvllm:num_requests_running +Inf\n\
                    vllm:kv_cache_usage_perc -1\n";
        assert_eq!(
            vllm(text),
            Err(MetricsError::MissingMetric("vllm:num_requests_waiting"))
        );
        // ... but they are valid syntax, also on skipped series.
        let text = "other NaN\nother2 -Inf\nother3{le=\"+Inf\"} +Inf\n\
                    vllm:num_requests_waiting 1\nvllm:num_requests_running 1\n\
                    vllm:kv_cache_usage_perc 0.5\n";
        assert_eq!(vllm(text).unwrap().aggregate(), &load(1.0, 1.0, 0.5));
    }

    #[test]
    fn escapes_in_label_values() {
        let text = r#"
vllm:num_requests_waiting{model_name="we\"ird} 9, \\ and\nnew",engine="0"} 2
vllm:num_requests_running{engine="0",model_name="a,b=c}"} 3
vllm:kv_cache_usage_perc{engine="0",model_name="é\\"} 0.5
vllm:cache_config_info{engine="0",model_name="x\"y",block_size="16",num_gpu_blocks="64"} 1
"#;
        let m = vllm(text).unwrap();
        let rank0 = m.for_rank(0).unwrap();
        assert_eq!(
            (rank0.waiting, rank0.running, rank0.kv_usage),
            (2.0, 3.0, 0.5)
        );
        assert_eq!(
            (rank0.block_size, rank0.kv_capacity_blocks),
            (Some(16), Some(64))
        );
        assert_eq!(unescape(r#"a\"b\\c\nd"#), "a\"b\\c\nd");
        assert!(matches!(unescape("plain"), Cow::Borrowed("plain")));
    }

    #[test]
    fn invalid_escape_names_the_line() {
        let text = "vllm:num_requests_waiting 1\nfoo{a=\"x\\ty\"} 1\n";
        let err = vllm(text).unwrap_err();
        assert_eq!(
            err,
            MetricsError::Syntax {
                line: 2,
                reason: "invalid escape in a label value"
            }
        );
        assert_eq!(err.to_string(), "line 2: invalid escape in a label value");
        let err = vllm("foo{a=\"x\\\"} 1\n").unwrap_err();
        assert_eq!(err.to_string(), "line 1: unterminated label value");
    }

    #[test]
    fn garbage_is_rejected_with_its_line() {
        let cases: &[(&str, usize)] = &[
            ("ok 1\n<html>\n", 2),
            ("ok 1\nok 2\nfoo\n", 3),
            ("foo{a=\"b\"\n", 1),
            ("foo{a=\"b\" c=\"d\"} 1\n", 1),
            ("foo{a=b} 1\n", 1),
            ("foo{=\"b\"} 1\n", 1),
            ("foo{1a=\"b\"} 1\n", 1),
            ("foo{a=\"unterminated} 1\n", 1),
            ("9foo 1\n", 1),
            ("foo 1 2 3\n", 1),
            ("foo one\n", 1),
            ("foo 1 12abc\n", 1),
            ("foo 1 NaN\n", 1),
            ("foo{a=\"b\"}1\n", 1),
            ("\n\nfoo{a=\"1\",a=\"2\"} 1\n", 3),
            ("foo.bar 1\n", 1),
            ("{a=\"b\"} 1\n", 1),
        ];
        for (text, line) in cases {
            // Repeated labels are only checked on series the parser keeps.
            let text = text.replace("foo{a=\"1\"", "vllm:num_requests_waiting{a=\"1\"");
            match vllm(&text) {
                Err(MetricsError::Syntax { line: l, .. }) => assert_eq!(l, *line, "{text:?}"),
                other => panic!("{text:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn accepted_variations_of_the_format() {
        let text = "# HELP vllm:num_requests_waiting Number of requests.\r\n\
                    # TYPE vllm:num_requests_waiting gauge\r\n\
                    # some other comment\r\n\
                    \r\n\
                    \t vllm:num_requests_waiting { engine = \"0\" , } 3 1712345678000\r\n\
                    vllm:num_requests_running{} 4\t\r\n\
                    vllm:kv_cache_usage_perc{engine=\"0\"} 5e-01 # {trace_id=\"abc\"} 1.0\r\n\
                    vllm:num_requests_running{engine=\"0\",} 1.5e+00 -12\r\n\
                    process_virtual_memory_bytes 5.4462660608e+010\r\n\
                    # EOF\r\n";
        let m = vllm(text).unwrap();
        assert_eq!(m.for_rank(0), Some(&load(3.0, 1.5, 0.5)));
        // The rank-less running series is the server-wide value.
        assert_eq!(m.aggregate(), &load(3.0, 4.0, 0.5));
    }

    #[test]
    fn limits_are_enforced() {
        let limits = ParseLimits {
            max_bytes: 64,
            ..ParseLimits::default()
        };
        assert_eq!(
            parse_engine_metrics(VLLM, EngineKind::Vllm, &limits),
            Err(MetricsError::TooLarge {
                size: VLLM.len(),
                limit: 64
            })
        );
        let limits = ParseLimits {
            max_lines: 10,
            ..ParseLimits::default()
        };
        assert_eq!(
            parse_engine_metrics(VLLM, EngineKind::Vllm, &limits),
            Err(MetricsError::TooManyLines { limit: 10 })
        );
        // vllm:cache_config_info has 21 labels.
        let limits = ParseLimits {
            max_labels_per_series: 20,
            ..ParseLimits::default()
        };
        let err = parse_engine_metrics(VLLM, EngineKind::Vllm, &limits).unwrap_err();
        let line = 1 + VLLM
            .lines()
            .position(|l| l.starts_with("vllm:cache_config_info"))
            .unwrap();
        assert_eq!(err, MetricsError::TooManyLabels { line, limit: 20 });
        // The longest label value in the fixture is the model name (32 bytes).
        let limits = ParseLimits {
            max_label_value_len: 31,
            ..ParseLimits::default()
        };
        let err = parse_engine_metrics(VLLM, EngineKind::Vllm, &limits).unwrap_err();
        let line = 1 + VLLM.lines().position(|l| l.contains("Llama")).unwrap();
        assert_eq!(err, MetricsError::LabelValueTooLong { line, limit: 31 });
        let limits = ParseLimits {
            max_label_value_len: 32,
            ..ParseLimits::default()
        };
        assert!(parse_engine_metrics(VLLM, EngineKind::Vllm, &limits).is_ok());
        // a page naming more ranks than any server runs (finding 6 of issue 35: 128k of them
        // cost a core on every scrape) is refused at the first rank too many
        let many: String = (0..5)
            .map(|r| format!("vllm:num_requests_waiting{{engine=\"{r}\"}} 0\n"))
            .collect();
        let limits = ParseLimits {
            max_ranks: 4,
            ..ParseLimits::default()
        };
        assert_eq!(
            parse_engine_metrics(&many, EngineKind::Vllm, &limits).unwrap_err(),
            MetricsError::TooManyRanks { line: 5, limit: 4 }
        );
    }

    #[test]
    fn serializes() {
        let s = load(1.0, 2.0, 0.5);
        let json = serde_json::to_string(&s).unwrap();
        assert!(json.contains("\"kv_usage\":0.5"), "{json}");
        assert!(json.contains("\"block_size\":null"), "{json}");
        let m = vllm(VLLM).unwrap();
        assert!(
            serde_json::to_string(&m)
                .unwrap()
                .contains("\"engine\":\"vllm\"")
        );
    }

    fn sc(sum: f64, count: f64) -> Option<SumCount> {
        Some(SumCount { sum, count })
    }

    #[test]
    fn latency_counters_of_real_vllm_0_32() {
        let text = include_str!("../tests/fixtures/vllm-0.32/metrics_after.txt");
        let m = vllm(text).unwrap();
        let expected = PerfCounters {
            prefill_time: sc(0.7772683109994887, 14.0),
            ttft: sc(0.8451347351074219, 14.0),
            queue_time: sc(0.0005056230004356621, 14.0),
            prefill_tokens: sc(9895.0, 14.0),
            inter_token_latency: sc(0.0, 0.0),
            prompt_tokens: Some(10471.0),
            cached_tokens: Some(576.0),
        };
        assert_eq!(m.perf_for_rank(0), &expected);
        assert!(expected.has_timing());
        // one rank: the server is that rank
        assert_eq!(m.perf_aggregate(), &expected);
    }

    #[test]
    fn latency_counters_per_rank_and_summed() {
        let m = vllm(VLLM).unwrap();
        let server = m.perf_aggregate();
        assert_eq!(
            server.ttft,
            sc(97.41283416748047 + 80.03511333465576, 911.0 + 794.0)
        );
        assert_eq!(server.cached_tokens, Some(524_288.0 + 393_216.0));
        // no prefill histogram nor queue time (vLLM before 0.10): no prefill duration to
        // derive, per rank or for the server
        assert!(!server.has_timing());
        assert_eq!(m.perf_for_rank(0), server);
        // a rank with its own timing reads its own
        let text = r#"
vllm:num_requests_waiting{engine="0"} 0
vllm:num_requests_running{engine="0"} 0
vllm:kv_cache_usage_perc{engine="0"} 0
vllm:num_requests_waiting{engine="1"} 0
vllm:num_requests_running{engine="1"} 0
vllm:kv_cache_usage_perc{engine="1"} 0
vllm:request_prefill_time_seconds_sum{engine="0"} 1.5
vllm:request_prefill_time_seconds_count{engine="0"} 3
vllm:request_prefill_time_seconds_sum{engine="1"} 4
vllm:request_prefill_time_seconds_count{engine="1"} 8
"#;
        let m = vllm(text).unwrap();
        assert_eq!(m.perf_for_rank(1).prefill_time, sc(4.0, 8.0));
        assert_eq!(m.perf_for_rank(0).prefill_time, sc(1.5, 3.0));
        assert_eq!(m.perf_aggregate().prefill_time, sc(5.5, 11.0));
        assert_eq!(
            m.perf_for_rank(7),
            m.perf_aggregate(),
            "unknown rank: the server"
        );
    }

    #[test]
    fn sglang_ranks_read_the_servers_ttft() {
        let m = parse(SGLANG, EngineKind::Sglang).unwrap();
        // TTFT is the tokenizer's (no dp_rank), queue time the schedulers' (per dp_rank): a
        // rank takes the server's counters so that both describe the same requests
        let p = m.perf_for_rank(1);
        assert_eq!(p, m.perf_aggregate());
        assert_eq!(p.ttft, sc(1201.667221069336, 2934.0));
        assert_eq!(p.queue_time, sc(311.4185 + 254.0917, 1502.0 + 1433.0));
        assert_eq!(p.prompt_tokens, Some(2_346_800.0));
        assert_eq!(p.cached_tokens, Some(1_200_000.0), "host hits excluded");
        assert!(p.has_timing());
    }

    #[test]
    fn trtllm_and_fallback_names() {
        let m = parse(TRTLLM, EngineKind::Trtllm).unwrap();
        let p = m.perf_for_rank(0);
        assert_eq!(p.ttft, sc(402.1187334060669, 1509.0));
        assert_eq!(
            p.queue_time, None,
            "this trtllm-serve exports no queue time"
        );
        assert!(!p.has_timing());
        let text = "trtllm_num_requests_waiting 0\ntrtllm_num_requests_running 1\n\
                    trtllm_kv_cache_utilization 0.5\n\
                    trtllm_request_prefill_time_seconds_sum 2.5\n\
                    trtllm_request_prefill_time_seconds_count 10\n\
                    trtllm_time_per_output_token_seconds_sum 0.4\n\
                    trtllm_time_per_output_token_seconds_count 20\n";
        let p = *parse(text, EngineKind::Trtllm).unwrap().perf_aggregate();
        assert_eq!(p.prefill_time, sc(2.5, 10.0));
        assert_eq!(p.inter_token_latency, sc(0.4, 20.0));
        // vLLM before 0.11 named its inter-token histogram time_per_output_token
        let text = "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n\
                    vllm:kv_cache_usage_perc 0\n\
                    vllm:time_per_output_token_seconds_sum 3\n\
                    vllm:time_per_output_token_seconds_count 100\n\
                    vllm:request_time_per_output_token_seconds_sum 9\n\
                    vllm:request_time_per_output_token_seconds_count 9\n";
        let p = *vllm(text).unwrap().perf_aggregate();
        assert_eq!(p.inter_token_latency, sc(3.0, 100.0));
        // a histogram missing its count is not half-read
        let text = "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n\
                    vllm:kv_cache_usage_perc 0\nvllm:request_prefill_time_seconds_sum 3\n";
        assert_eq!(vllm(text).unwrap().perf_aggregate().prefill_time, None);
    }

    /// Prefixes of every fixture, read as every engine: errors are fine, panics are not.
    #[test]
    fn truncated_fixtures_never_panic() {
        let engines = [EngineKind::Vllm, EngineKind::Sglang, EngineKind::Trtllm];
        for text in [VLLM, VLLM_OLD, SGLANG, TRTLLM] {
            // Cut around every line end and every 29 bytes elsewhere (every byte would be
            // quadratic in the fixture size).
            let near_newline = |i: usize| {
                text.as_bytes()
                    .get(i.saturating_sub(2)..(i + 2).min(text.len()))
                    .is_some_and(|w| w.contains(&b'\n'))
            };
            let cuts = (0..=text.len())
                .filter(|&i| text.is_char_boundary(i) && (i % 29 == 0 || near_newline(i)));
            for end in cuts {
                for engine in engines {
                    let _ = parse(&text[..end], engine);
                }
            }
        }
    }

    fn any_engine() -> impl Strategy<Value = EngineKind> {
        prop_oneof![
            Just(EngineKind::Vllm),
            Just(EngineKind::Sglang),
            Just(EngineKind::Trtllm)
        ]
    }

    proptest! {
        #[test]
        fn arbitrary_text_never_panics(text in "\\PC{0,400}", engine in any_engine()) {
            let _ = parse(&text, engine);
        }

        #[test]
        fn format_alphabet_never_panics(
            text in "[a-z_:{}=\",\\\\ \t\n0-9.eE+#NaIf-]{0,300}",
            engine in any_engine(),
        ) {
            let _ = parse(&text, engine);
        }

        #[test]
        fn mutated_fixtures_never_panic(
            which in 0usize..4,
            edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
            engine in any_engine(),
        ) {
            let mut bytes = [VLLM, VLLM_OLD, SGLANG, TRTLLM][which].as_bytes().to_vec();
            for (at, byte) in edits {
                let i = at.index(bytes.len());
                bytes[i] = byte;
            }
            let text = String::from_utf8_lossy(&bytes);
            let _ = parse(&text, engine);
        }
    }

    /// vLLM writes a new `lora_requests_info` series on every logging interval, valued with
    /// the time; the newest is the state.
    #[test]
    fn lora_activity_is_the_newest_lora_requests_info_series() {
        let text = "\
vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 0.0
vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.1
vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"a\",waiting_lora_adapters=\"\"} 1.7649e+09
vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"sql,b\",waiting_lora_adapters=\"c\"} 1.7649000005e+09
vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} 1.76489e+09
";
        let m = parse(text, EngineKind::Vllm).unwrap();
        let lora = m.aggregate().lora.expect("reported");
        assert!(lora.runs("sql") && lora.runs("b") && !lora.runs("a"));
        assert_eq!((lora.running, lora.waiting, lora.max_lora), (2, 1, Some(2)));
        assert!(lora.slots_full());
        // the gauge has no rank label: each rank gets the server's
        assert_eq!(m.for_rank(0).and_then(|s| s.lora), Some(lora));
        // an engine serving no adapters has no such gauge
        let plain = text.lines().take(3).collect::<Vec<_>>().join("\n");
        assert_eq!(
            parse(&plain, EngineKind::Vllm).unwrap().aggregate().lora,
            None
        );
    }
}
