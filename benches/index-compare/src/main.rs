//! Side-by-side benchmark of kvroute's KV block index against published Rust peers:
//! `kv-index` (SGLang gateway's `ChainIndex`) and `dynamo-kv-router` (NVIDIA Dynamo's
//! `RadixTree`), fed the same Mooncake-derived event stream in one process.
//!
//! ```text
//! cargo run --release -- --trace /path/to/conversation_trace.jsonl [--json out.json]
//!     [--reps 5] [--queries 2000] [--passes 5] [--workers 64] [--capacity 8192] [--only NAME]
//!     [--mixed]
//! cargo run --release -- --synthetic-context 1000000 [--sessions 24] --workers 8
//!     --capacity 32768 --queries 200 [...]
//! ```
//!
//! Per index and repetition: ingestion rate (stored + removed blocks per second, one thread),
//! longest-prefix-match latency (each query timed alone), and memory per live (worker, block)
//! pair (net bytes the build left allocated, and the RSS change). Figures are medians over the
//! repetitions; the indexes run one after another, in a rotating order.
//!
//! `--synthetic-context` replaces the trace with agentic sessions whose transcripts grow to
//! that many tokens (the long-context case: 15.6k block hashes per request at 1M tokens).
//! `--mixed` adds the two-thread case: ingestion on one thread while a second matches queries
//! against the same index, as the service runs them (kvroute behind its `HandoffLock`, kv-index
//! shared as the SGLang gateway shares it; Dynamo's tree is single-threaded and sits it out),
//! and `kvr-apart`: kvroute's reader on an index of its own while the writer fills another,
//! the floor for any read path that never waits for a writer.

mod alloc;
mod contenders;
mod workload;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use serde::Serialize;

#[global_allocator]
static GLOBAL: alloc::Counting = alloc::Counting;

struct Args {
    trace: PathBuf,
    synthetic_context: Option<u64>,
    sessions: u32,
    mixed: bool,
    json: Option<PathBuf>,
    reps: usize,
    queries: usize,
    passes: usize,
    workers: u32,
    capacity: usize,
    only: Option<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        trace: PathBuf::new(),
        synthetic_context: None,
        sessions: 24,
        mixed: false,
        json: None,
        reps: 5,
        queries: 2000,
        passes: 5,
        workers: 64,
        capacity: 8192,
        only: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        let number = |v: String| v.parse::<usize>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--trace" => args.trace = PathBuf::from(value()?),
            "--synthetic-context" => {
                args.synthetic_context = Some(number(value()?)?.max(512) as u64);
            }
            "--sessions" => args.sessions = number(value()?)?.clamp(1, 100_000) as u32,
            "--mixed" => args.mixed = true,
            "--json" => args.json = Some(PathBuf::from(value()?)),
            "--reps" => args.reps = number(value()?)?.max(1),
            "--queries" => args.queries = number(value()?)?.max(1),
            "--passes" => args.passes = number(value()?)?.max(1),
            "--workers" => args.workers = number(value()?)?.clamp(1, 1024) as u32,
            "--capacity" => args.capacity = number(value()?)?.max(1),
            "--only" => args.only = Some(value()?),
            "-h" | "--help" => {
                return Err(
                    "usage: index-compare (--trace FILE | --synthetic-context TOKENS \
                            [--sessions N]) [--json FILE] [--reps N] [--queries N] \
                            [--passes N] [--workers N] [--capacity N] \
                            [--only kvroute|kvr-apart|kv-index|dynamo] [--mixed]"
                        .into(),
                );
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if args.trace.as_os_str().is_empty() == args.synthetic_context.is_none() {
        return Err("give one of --trace FILE and --synthetic-context TOKENS".into());
    }
    Ok(args)
}

type Contender = (
    &'static str,
    fn(&workload::Workload, usize) -> contenders::Run,
);

const CONTENDERS: [Contender; 3] = [
    ("kvroute", contenders::kvroute),
    ("kv-index", contenders::kv_index),
    ("dynamo", contenders::dynamo),
];

#[derive(Serialize, Default, Clone)]
struct Figures {
    index: String,
    ingest_blocks_per_sec: f64,
    /// The same, over the replaying thread's CPU time.
    ingest_blocks_per_cpu_sec: f64,
    match_p50_us: f64,
    match_p99_us: f64,
    match_mean_us: f64,
    alloc_bytes_per_live_block: f64,
    rss_bytes_per_live_block: f64,
    rss_trimmed_bytes_per_live_block: f64,
    live_reported: usize,
    errors: usize,
    /// Queries whose per-worker overlaps differ from kvroute's.
    mismatched_queries: usize,
}

/// Nearest-rank percentile of sorted samples.
fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn figures(name: &str, run: &contenders::Run, w: &workload::Workload) -> Figures {
    let mut ns = run.query_ns.clone();
    ns.sort_unstable();
    let live = w.live_pairs.max(1) as f64;
    Figures {
        index: name.to_string(),
        ingest_blocks_per_sec: (w.stored_blocks + w.removed_blocks) as f64 / run.ingest_secs,
        ingest_blocks_per_cpu_sec: (w.stored_blocks + w.removed_blocks) as f64
            / run.ingest_cpu_secs.max(0.01),
        match_p50_us: percentile(&ns, 50.0) as f64 / 1e3,
        match_p99_us: percentile(&ns, 99.0) as f64 / 1e3,
        match_mean_us: ns.iter().sum::<u64>() as f64 / ns.len().max(1) as f64 / 1e3,
        alloc_bytes_per_live_block: run.alloc_bytes as f64 / live,
        rss_bytes_per_live_block: run.rss_bytes as f64 / live,
        rss_trimmed_bytes_per_live_block: run.rss_trimmed_bytes as f64 / live,
        live_reported: run.live_reported,
        errors: run.errors,
        mismatched_queries: 0,
    }
}

#[derive(Serialize)]
struct Report {
    trace: String,
    workers: u32,
    capacity_blocks: usize,
    block_tokens: u64,
    requests: usize,
    events: usize,
    stored_blocks: usize,
    removed_blocks: usize,
    live_pairs: usize,
    distinct_live_blocks: usize,
    queries: usize,
    passes: usize,
    reps: usize,
    mean_query_blocks: f64,
    /// Median over the repetitions, per index.
    results: Vec<Figures>,
    /// Every repetition, per index.
    runs: Vec<Vec<Figures>>,
    /// The two-thread case (`--mixed`), medians over the repetitions.
    mixed: Vec<MixedFigures>,
}

#[derive(Serialize, Default, Clone)]
struct MixedFigures {
    index: String,
    ingest_blocks_per_sec: f64,
    match_p50_us: f64,
    match_p99_us: f64,
    queries_during_ingest: f64,
    errors: usize,
}

type MixedContender = (&'static str, fn(&workload::Workload) -> contenders::Mixed);

const MIXED: [MixedContender; 3] = [
    ("kvroute", contenders::kvroute_mixed),
    ("kvr-apart", contenders::kvroute_apart_mixed),
    ("kv-index", contenders::kv_index_mixed),
];

/// The two-thread case for every index that shares one between threads, in rotating order.
fn run_mixed(w: &workload::Workload, args: &Args) -> Vec<MixedFigures> {
    let chosen: Vec<MixedContender> = MIXED
        .iter()
        .copied()
        .filter(|(name, _)| args.only.as_deref().is_none_or(|o| o == *name))
        .collect();
    let mut runs: Vec<Vec<MixedFigures>> = vec![Vec::new(); chosen.len()];
    for rep in 0..args.reps {
        for k in 0..chosen.len() {
            let c = (k + rep) % chosen.len();
            let (name, run_fn) = chosen[c];
            let run = run_fn(w);
            let mut ns = run.query_ns;
            ns.sort_unstable();
            let f = MixedFigures {
                index: name.to_string(),
                ingest_blocks_per_sec: (w.stored_blocks + w.removed_blocks) as f64
                    / run.ingest_secs,
                match_p50_us: percentile(&ns, 50.0) as f64 / 1e3,
                match_p99_us: percentile(&ns, 99.0) as f64 / 1e3,
                queries_during_ingest: ns.len() as f64,
                errors: run.errors,
            };
            eprintln!(
                "mixed rep {rep} {name:>9}: {:>6.2} M blocks/s while {} queries ran, p50 {:>6.2} us, p99 {:>6.2} us",
                f.ingest_blocks_per_sec / 1e6,
                ns.len(),
                f.match_p50_us,
                f.match_p99_us
            );
            runs[c].push(f);
        }
    }
    let results: Vec<MixedFigures> = runs
        .iter()
        .map(|rs| {
            let m = |get: fn(&MixedFigures) -> f64| median(rs.iter().map(get).collect());
            MixedFigures {
                index: rs[0].index.clone(),
                ingest_blocks_per_sec: m(|f| f.ingest_blocks_per_sec),
                match_p50_us: m(|f| f.match_p50_us),
                match_p99_us: m(|f| f.match_p99_us),
                queries_during_ingest: m(|f| f.queries_during_ingest),
                errors: rs.iter().map(|f| f.errors).max().unwrap_or(0),
            }
        })
        .collect();
    println!();
    println!(
        "{:<10} {:>14} {:>10} {:>10} {:>9} {:>7}   (mixed: ingest and queries on two threads)",
        "index", "ingest Mblk/s", "p50 us", "p99 us", "queries", "errors"
    );
    for f in &results {
        println!(
            "{:<10} {:>14.2} {:>10.2} {:>10.2} {:>9.0} {:>7}",
            f.index,
            f.ingest_blocks_per_sec / 1e6,
            f.match_p50_us,
            f.match_p99_us,
            f.queries_during_ingest,
            f.errors
        );
    }
    results
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let t = Instant::now();
    let records = match args.synthetic_context {
        Some(tokens) => workload::synthetic_sessions(tokens, args.sessions, args.workers),
        None => match workload::read_trace(&args.trace) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("cannot read {}: {e}", args.trace.display());
                return ExitCode::FAILURE;
            }
        },
    };
    let w = workload::load(&records, args.workers, args.capacity, args.queries);
    drop(records);
    let query_blocks: usize = w.queries.iter().map(|&q| w.requests[q].len).sum();
    let mean_query_blocks = query_blocks as f64 / w.queries.len().max(1) as f64;
    println!(
        "workload: {} requests -> {} events ({} stored + {} removed blocks), {} workers x {} \
         blocks, {} live pairs / {} distinct blocks at the end; {} queries of {:.0} blocks on \
         average x {} passes  [prepared in {:.1}s]",
        w.requests.len(),
        w.events.len(),
        w.stored_blocks,
        w.removed_blocks,
        w.workers,
        w.capacity,
        w.live_pairs,
        w.distinct_live,
        w.queries.len(),
        mean_query_blocks,
        args.passes,
        t.elapsed().as_secs_f64()
    );

    let chosen: Vec<Contender> = CONTENDERS
        .iter()
        .copied()
        .filter(|(name, _)| args.only.as_deref().is_none_or(|o| o == *name))
        .collect();
    let mixed_only = args.mixed && MIXED.iter().any(|(n, _)| args.only.as_deref() == Some(*n));
    if chosen.is_empty() && !mixed_only {
        eprintln!("--only must name one of kvroute, kv-index, dynamo (or kvr-apart with --mixed)");
        return ExitCode::from(2);
    }
    let mut runs: Vec<Vec<Figures>> = vec![Vec::new(); chosen.len()];
    let mut reference: Option<contenders::Matches> = None;
    for rep in 0..args.reps {
        for k in 0..chosen.len() {
            // Rotate the order so that no index always runs on a freshly trimmed heap.
            let c = (k + rep) % chosen.len();
            let (name, run_fn) = chosen[c];
            let run = run_fn(&w, args.passes);
            let mut f = figures(name, &run, &w);
            // Cross-check results against the first index's (kvroute's when it runs).
            match &reference {
                None if c == 0 => reference = Some(run.matches),
                Some(r) if c != 0 => {
                    f.mismatched_queries =
                        r.iter().zip(&run.matches).filter(|(a, b)| a != b).count();
                }
                _ => {}
            }
            eprintln!(
                "rep {rep} {name:>9}: {:>6.2} M blocks/s ({:>6.2} per CPU s), p50 {:>6.2} us, p99 {:>6.2} us, \
                 {:>6.1} B/block alloc, {:>6.1} B/block RSS",
                f.ingest_blocks_per_sec / 1e6,
                f.ingest_blocks_per_cpu_sec / 1e6,
                f.match_p50_us,
                f.match_p99_us,
                f.alloc_bytes_per_live_block,
                f.rss_bytes_per_live_block
            );
            runs[c].push(f);
        }
    }

    let results: Vec<Figures> = runs
        .iter()
        .map(|rs| {
            let m = |get: fn(&Figures) -> f64| median(rs.iter().map(get).collect());
            Figures {
                index: rs[0].index.clone(),
                ingest_blocks_per_sec: m(|f| f.ingest_blocks_per_sec),
                ingest_blocks_per_cpu_sec: m(|f| f.ingest_blocks_per_cpu_sec),
                match_p50_us: m(|f| f.match_p50_us),
                match_p99_us: m(|f| f.match_p99_us),
                match_mean_us: m(|f| f.match_mean_us),
                alloc_bytes_per_live_block: m(|f| f.alloc_bytes_per_live_block),
                rss_bytes_per_live_block: m(|f| f.rss_bytes_per_live_block),
                rss_trimmed_bytes_per_live_block: m(|f| f.rss_trimmed_bytes_per_live_block),
                live_reported: rs[rs.len() - 1].live_reported,
                errors: rs.iter().map(|f| f.errors).max().unwrap_or(0),
                mismatched_queries: rs.iter().map(|f| f.mismatched_queries).max().unwrap_or(0),
            }
        })
        .collect();

    println!();
    println!(
        "{:<10} {:>14} {:>12} {:>10} {:>10} {:>10} {:>13} {:>10} {:>12} {:>10} {:>7} {:>9}",
        "index",
        "ingest Mblk/s",
        "(CPU) Mblk/s",
        "p50 us",
        "p99 us",
        "mean us",
        "alloc B/blk",
        "RSS B/blk",
        "trimmed RSS",
        "live",
        "errors",
        "mismatch"
    );
    for f in &results {
        println!(
            "{:<10} {:>14.2} {:>12.2} {:>10.2} {:>10.2} {:>10.2} {:>13.1} {:>10.1} {:>12.1} {:>10} {:>7} {:>9}",
            f.index,
            f.ingest_blocks_per_sec / 1e6,
            f.ingest_blocks_per_cpu_sec / 1e6,
            f.match_p50_us,
            f.match_p99_us,
            f.match_mean_us,
            f.alloc_bytes_per_live_block,
            f.rss_bytes_per_live_block,
            f.rss_trimmed_bytes_per_live_block,
            f.live_reported,
            f.errors,
            f.mismatched_queries
        );
    }
    println!(
        "(medians of {} repetitions; live pairs expected {}; total {:.1}s)",
        args.reps,
        w.live_pairs,
        t.elapsed().as_secs_f64()
    );

    let mixed = if args.mixed {
        run_mixed(&w, &args)
    } else {
        Vec::new()
    };

    if let Some(path) = &args.json {
        let report = Report {
            trace: match args.synthetic_context {
                Some(tokens) => format!("synthetic: {} sessions to {tokens} tokens", args.sessions),
                None => args.trace.display().to_string(),
            },
            workers: w.workers,
            capacity_blocks: w.capacity,
            block_tokens: workload::BLOCK_TOKENS,
            requests: w.requests.len(),
            events: w.events.len(),
            stored_blocks: w.stored_blocks,
            removed_blocks: w.removed_blocks,
            live_pairs: w.live_pairs,
            distinct_live_blocks: w.distinct_live,
            queries: w.queries.len(),
            passes: args.passes,
            reps: args.reps,
            mean_query_blocks,
            results,
            runs,
            mixed,
        };
        let text = match serde_json::to_string_pretty(&report) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("cannot encode the report: {e}");
                return ExitCode::FAILURE;
            }
        };
        if let Err(e) = std::fs::write(path, text + "\n") {
            eprintln!("cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
