//! Workloads: what to send, and when.
//!
//! Every workload, whatever its source, is reduced to one shape: requests described by chained
//! prefix hash ids over blocks of `block_tokens` tokens (turned into token ids by [`tokens`]),
//! grouped into sessions. A session is a list of [`Node`]s: requests sent one after another,
//! each after the previous response plus a think time (closed loop), and sub-agents that run
//! beside their parent. An open-loop trace (Mooncake, Azure) is a list of one-request sessions
//! started at the trace's timestamps. The [`crate::driver::Driver`] plays a [`Plan`]
//! against either clock (virtual or real), so both benchmark modes replay exactly the same
//! thing.

pub mod azure;
pub mod generated;
pub mod mooncake;
pub mod tokens;
pub mod weka;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use thiserror::Error;

/// Why a workload could not be loaded. Messages name the file and the record.
#[derive(Debug, Error)]
pub enum WorkloadError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}: {message}")]
    Record {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("{0}")]
    Invalid(String),
}

impl WorkloadError {
    pub(crate) fn record(path: &Path, line: usize, message: impl Into<String>) -> Self {
        Self::Record {
            path: path.to_path_buf(),
            line,
            message: message.into(),
        }
    }

    pub(crate) fn file(path: &Path, message: impl Into<String>) -> Self {
        Self::File {
            path: path.to_path_buf(),
            message: message.into(),
        }
    }

    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        Self::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// The most records one trace may hold (a bound on memory for any input).
pub const MAX_RECORDS: usize = 5_000_000;
/// The longest prompt accepted from a trace, in tokens.
pub const MAX_INPUT_TOKENS: u32 = 1 << 21;
/// The longest output accepted from a trace, in tokens.
pub const MAX_OUTPUT_TOKENS: u32 = 1 << 20;

/// One request of a workload: its prompt as chained hash ids and its lengths.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceRequest {
    /// Chained prefix ids, one per `block_tokens` tokens of the prompt (the last block may be
    /// partial). In a session template they are local to the session; the driver makes them
    /// global.
    pub hash_ids: Arc<[u64]>,
    pub input_len: u32,
    pub output_len: u32,
}

impl TraceRequest {
    /// A request whose `hash_ids` cover exactly `input_len` tokens: extra ids are dropped and
    /// missing ones are filled with ids unique to this request (`unique_seed`), so that a
    /// slightly inconsistent record still replays instead of failing the run. Returns whether
    /// the record had to be adjusted.
    pub fn normalized(
        mut ids: Vec<u64>,
        block_tokens: u32,
        input_len: u32,
        output_len: u32,
        unique_seed: u64,
    ) -> (Self, bool) {
        let need = input_len.div_ceil(block_tokens.max(1)) as usize;
        let adjusted = ids.len() != need;
        ids.truncate(need);
        let mut k = 0u64;
        while ids.len() < need {
            ids.push(tokens::mix64(unique_seed ^ tokens::mix64(k)) | (1 << 63));
            k += 1;
        }
        (
            Self {
                hash_ids: ids.into(),
                input_len,
                output_len: output_len.max(1),
            },
            adjusted,
        )
    }
}

/// A step of a session.
#[derive(Debug, Clone, PartialEq)]
pub enum Node {
    /// Send `req` `think_ms` after the previous response of this session (or sub-agent) ended.
    Request { think_ms: f64, req: TraceRequest },
    /// A sub-agent: its own sequence of nodes, started when the parent reaches it and run
    /// beside the parent. The parent's next request waits until its sub-agents are done
    /// (it consumes their results).
    Subagent(Vec<Node>),
}

impl Node {
    /// Requests in this node, recursively.
    pub fn count_requests(nodes: &[Node]) -> usize {
        nodes
            .iter()
            .map(|n| match n {
                Node::Request { .. } => 1,
                Node::Subagent(c) => Self::count_requests(c),
            })
            .sum()
    }
}

/// A session that starts at a fixed time. Its hash ids are already global.
#[derive(Debug, Clone, PartialEq)]
pub struct TimedSession {
    pub start_ms: f64,
    pub nodes: Arc<[Node]>,
}

/// How sessions are started.
#[derive(Debug, Clone, PartialEq)]
pub enum Plan {
    /// Every session starts at its `start_ms` (sorted), whatever else is running.
    Timed(Vec<TimedSession>),
    /// `concurrency` sessions run at once; when one ends, the next template (cycling) starts
    /// as a new conversation with its own hash-id space. The first `concurrency` sessions
    /// start `stagger_ms` apart.
    Concurrent {
        templates: Vec<Arc<[Node]>>,
        concurrency: usize,
        stagger_ms: f64,
    },
}

/// A loaded workload.
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    /// Shown in reports: the source and its main parameters.
    pub name: String,
    /// Tokens per hash id block.
    pub block_tokens: u32,
    pub plan: Plan,
    /// Records whose hash ids did not cover their input length exactly and were adjusted.
    pub adjusted_records: usize,
}

impl Workload {
    /// A timed workload from one trace file's records: ordered by start time (a stable sort
    /// keeps the file order of equal timestamps) and shifted to start at 0.
    pub(crate) fn timed_from_file(
        kind: &str,
        path: &Path,
        mut sessions: Vec<TimedSession>,
        block_tokens: u32,
        adjusted_records: usize,
    ) -> Result<Self, WorkloadError> {
        let Some(first) = sessions.iter().map(|s| s.start_ms).reduce(f64::min) else {
            return Err(WorkloadError::file(path, "the trace holds no records"));
        };
        sessions.sort_by(|a, b| a.start_ms.total_cmp(&b.start_ms));
        for s in &mut sessions {
            s.start_ms -= first;
        }
        let file = path.file_name().map_or_else(
            || path.display().to_string(),
            |f| f.to_string_lossy().into_owned(),
        );
        Ok(Self {
            name: format!("{kind} {file}"),
            block_tokens,
            plan: Plan::Timed(sessions),
            adjusted_records,
        })
    }

    /// Requests the plan holds (for a concurrent plan: one pass over the templates).
    pub fn requests_per_pass(&self) -> usize {
        match &self.plan {
            Plan::Timed(s) => s.iter().map(|s| Node::count_requests(&s.nodes)).sum(),
            Plan::Concurrent { templates, .. } => {
                templates.iter().map(|t| Node::count_requests(t)).sum()
            }
        }
    }

    /// Shrink every prompt and output by `divisor` while keeping the prefix structure: a hash
    /// id then stands for `block_tokens / divisor` tokens, a prompt is `ceil(input / divisor)`
    /// tokens (still covered by the same ids) and an output `ceil(output / divisor)`. For engines
    /// far slower than the trace's (the real-engine bench's CPU engines). `divisor` must divide
    /// `block_tokens`.
    pub fn shrink_tokens(&mut self, divisor: u32) -> Result<(), WorkloadError> {
        if divisor <= 1 {
            return Ok(());
        }
        if !self.block_tokens.is_multiple_of(divisor) {
            return Err(WorkloadError::Invalid(format!(
                "--token-divisor {divisor} must divide the workload's {} tokens per hash id",
                self.block_tokens
            )));
        }
        fn shrink(nodes: &[Node], d: u32) -> Vec<Node> {
            nodes
                .iter()
                .map(|n| match n {
                    Node::Request { think_ms, req } => Node::Request {
                        think_ms: *think_ms,
                        req: TraceRequest {
                            hash_ids: req.hash_ids.clone(),
                            input_len: req.input_len.div_ceil(d).max(1),
                            output_len: req.output_len.div_ceil(d).max(1),
                        },
                    },
                    Node::Subagent(c) => Node::Subagent(shrink(c, d)),
                })
                .collect()
        }
        match &mut self.plan {
            Plan::Timed(sessions) => {
                for s in sessions.iter_mut() {
                    s.nodes = shrink(&s.nodes, divisor).into();
                }
            }
            Plan::Concurrent { templates, .. } => {
                for t in templates.iter_mut() {
                    *t = shrink(t, divisor).into();
                }
            }
        }
        self.block_tokens /= divisor;
        self.name = format!("{}, tokens ÷{divisor}", self.name);
        Ok(())
    }

    /// Compress (scale > 1) or stretch the client side's timing: session start times and
    /// think times are divided by `scale`, i.e. the arrival rate is multiplied by it.
    pub fn scale_arrivals(&mut self, scale: f64) {
        if !(scale.is_finite() && scale > 0.0) || (scale - 1.0).abs() < f64::EPSILON {
            return;
        }
        fn scale_nodes(nodes: &[Node], scale: f64) -> Vec<Node> {
            nodes
                .iter()
                .map(|n| match n {
                    Node::Request { think_ms, req } => Node::Request {
                        think_ms: think_ms / scale,
                        req: req.clone(),
                    },
                    Node::Subagent(c) => Node::Subagent(scale_nodes(c, scale)),
                })
                .collect()
        }
        match &mut self.plan {
            Plan::Timed(sessions) => {
                for s in sessions.iter_mut() {
                    s.start_ms /= scale;
                    s.nodes = scale_nodes(&s.nodes, scale).into();
                }
            }
            Plan::Concurrent {
                templates,
                stagger_ms,
                ..
            } => {
                for t in templates.iter_mut() {
                    *t = scale_nodes(t, scale).into();
                }
                *stagger_ms /= scale;
            }
        }
    }
}

/// The trace formats understood.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Mooncake,
    Weka,
    Azure,
    Generated,
}

impl Format {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "mooncake" => Ok(Self::Mooncake),
            "weka" | "agentic" | "kv-cache-tester" => Ok(Self::Weka),
            "azure" => Ok(Self::Azure),
            "generated" => Ok(Self::Generated),
            other => Err(format!(
                "unknown format {other:?}: expected mooncake, weka, azure or generated"
            )),
        }
    }

    /// Guess from a path: `.jsonl` Mooncake, `.csv` Azure, a directory or `.json` sessions.
    pub fn guess(path: &Path) -> Option<Self> {
        if path.is_dir() {
            return Some(Self::Weka);
        }
        match path.extension().and_then(|e| e.to_str()) {
            Some("jsonl") => Some(Self::Mooncake),
            Some("csv") => Some(Self::Azure),
            Some("json") => Some(Self::Weka),
            _ => None,
        }
    }

    /// The shared trace used when `--trace` is absent, relative to `../shared/traces`.
    pub fn default_trace(self) -> Option<&'static str> {
        match self {
            Self::Mooncake => Some("conversation_trace.jsonl"),
            Self::Weka => Some("kv-cache-tester"),
            Self::Azure => Some("azure-2023/AzureLLMInferenceTrace_conv.csv"),
            Self::Generated => None,
        }
    }
}

/// Options that shape how a trace file becomes a workload.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadOptions {
    /// Session format: sessions running at once.
    pub concurrency: usize,
    /// Session format: delay between the first sessions' starts.
    pub stagger_ms: f64,
    /// Session format: think times longer than this are cut to it (traces hold idle gaps of
    /// hours that a benchmark cannot replay).
    pub think_cap_ms: f64,
    /// Stop reading a trace after this many records (`None` = all).
    pub max_records: Option<usize>,
    pub seed: u64,
    pub generator: generated::GeneratorConfig,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            concurrency: 64,
            stagger_ms: 1_000.0,
            think_cap_ms: 60_000.0,
            max_records: None,
            seed: 0,
            generator: generated::GeneratorConfig::default(),
        }
    }
}

/// Find the shared traces folder: `$KVROUTE_TRACES`, else `../shared/traces` next to the
/// repository root (found from the current directory upwards, then from where this crate was
/// built).
pub fn shared_traces_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("KVROUTE_TRACES") {
        return Some(PathBuf::from(d));
    }
    let mut starts: Vec<PathBuf> = Vec::new();
    if let Ok(cwd) = std::env::current_dir() {
        starts.push(cwd);
    }
    starts.push(PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    for start in starts {
        for dir in start.ancestors() {
            let candidate = dir.join("../shared/traces");
            if dir.join("Cargo.toml").is_file() && candidate.is_dir() {
                return Some(candidate);
            }
        }
    }
    None
}

/// Resolve `--trace` for a format: the given path, or the format's default shared trace.
pub fn resolve_trace(format: Format, trace: Option<&Path>) -> Result<Option<PathBuf>, String> {
    if let Some(p) = trace {
        return Ok(Some(p.to_path_buf()));
    }
    let Some(rel) = format.default_trace() else {
        return Ok(None);
    };
    let dir = shared_traces_dir().ok_or_else(|| {
        "no --trace given and ../shared/traces was not found next to the repository \
         (set KVROUTE_TRACES to the traces folder)"
            .to_string()
    })?;
    Ok(Some(dir.join(rel)))
}

/// Load a workload.
pub fn load(
    format: Format,
    trace: Option<&Path>,
    opts: &LoadOptions,
) -> Result<Workload, WorkloadError> {
    match format {
        Format::Generated => Ok(generated::generate(&opts.generator, opts.seed)),
        _ => {
            let path = resolve_trace(format, trace)
                .map_err(WorkloadError::Invalid)?
                .ok_or_else(|| WorkloadError::Invalid("a trace file is required".into()))?;
            match format {
                Format::Mooncake => mooncake::load(&path, opts),
                Format::Azure => azure::load(&path, opts),
                Format::Weka => weka::load(&path, opts),
                Format::Generated => unreachable_generated(),
            }
        }
    }
}

fn unreachable_generated() -> Result<Workload, WorkloadError> {
    Err(WorkloadError::Invalid(
        "internal: generated handled above".into(),
    ))
}
