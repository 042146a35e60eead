//! Agentic session traces (`kv-cache-tester/trace_*.json`, the "Weka" schema of captured
//! Claude Code sessions): one session per file, `{id, block_size, hash_id_scope: "local",
//! requests: [{t, type, in, out, hash_ids, think_time, ...} | {type: "subagent", requests:
//! [...]}]}`. Hash ids are local to a file; the driver gives every replayed copy of a session
//! its own id space, so copies are distinct conversations.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;

use super::{
    LoadOptions, MAX_INPUT_TOKENS, MAX_OUTPUT_TOKENS, Node, Plan, TraceRequest, Workload,
    WorkloadError,
};

/// Largest session file accepted.
const MAX_FILE_BYTES: u64 = 256 << 20;
/// Most session files read from a directory.
const MAX_FILES: usize = 100_000;
/// Local hash ids must stay below this so that a copy number fits above them.
pub const LOCAL_ID_LIMIT: u64 = 1 << 40;

#[derive(Debug, Deserialize)]
struct SessionFile {
    #[serde(default)]
    id: Option<String>,
    block_size: u32,
    #[serde(default)]
    hash_id_scope: Option<String>,
    requests: Vec<RawEntry>,
}

#[derive(Debug, Deserialize)]
struct RawEntry {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(rename = "in", default)]
    input: Option<u32>,
    #[serde(default)]
    out: Option<u32>,
    #[serde(default)]
    hash_ids: Option<Vec<u64>>,
    #[serde(default)]
    think_time: Option<f64>,
    #[serde(default)]
    requests: Option<Vec<RawEntry>>,
}

struct Ctx<'a> {
    path: &'a Path,
    block: u32,
    think_cap_ms: f64,
    adjusted: usize,
    counter: u64,
}

fn convert(
    entries: Vec<RawEntry>,
    ctx: &mut Ctx<'_>,
    where_: &str,
) -> Result<Vec<Node>, WorkloadError> {
    let mut nodes = Vec::with_capacity(entries.len());
    for (i, e) in entries.into_iter().enumerate() {
        let at = format!("{where_}[{i}]");
        if e.kind.as_deref() == Some("subagent") {
            let children = e.requests.ok_or_else(|| {
                WorkloadError::file(ctx.path, format!("{at}: a subagent entry needs `requests`"))
            })?;
            let c = convert(children, ctx, &format!("{at}.requests"))?;
            if !c.is_empty() {
                nodes.push(Node::Subagent(c));
            }
            continue;
        }
        let input = e
            .input
            .filter(|v| (1..=MAX_INPUT_TOKENS).contains(v))
            .ok_or_else(|| {
                WorkloadError::file(
                    ctx.path,
                    format!("{at}: `in` must be an integer within 1..={MAX_INPUT_TOKENS}"),
                )
            })?;
        let out = e.out.unwrap_or(1).min(MAX_OUTPUT_TOKENS);
        let ids = e.hash_ids.ok_or_else(|| {
            WorkloadError::file(ctx.path, format!("{at}: a request needs `hash_ids`"))
        })?;
        if let Some(bad) = ids.iter().find(|&&h| h >= LOCAL_ID_LIMIT) {
            return Err(WorkloadError::file(
                ctx.path,
                format!("{at}: hash id {bad} is not a local id (must be below 2^40)"),
            ));
        }
        let think_s = e.think_time.unwrap_or(0.0);
        if !think_s.is_finite() || think_s < 0.0 {
            return Err(WorkloadError::file(
                ctx.path,
                format!("{at}: think_time must be a non-negative number of seconds"),
            ));
        }
        ctx.counter += 1;
        let (req, adj) =
            TraceRequest::normalized(ids, ctx.block, input, out, LOCAL_ID_LIMIT + ctx.counter);
        ctx.adjusted += usize::from(adj);
        nodes.push(Node::Request {
            think_ms: (think_s * 1000.0).min(ctx.think_cap_ms),
            req,
        });
    }
    Ok(nodes)
}

/// One session file: its block size and nodes.
pub fn parse_session(
    text: &str,
    path: &Path,
    think_cap_ms: f64,
) -> Result<(u32, Vec<Node>, usize), WorkloadError> {
    let f: SessionFile = serde_json::from_str(text).map_err(|e| {
        WorkloadError::file(
            path,
            format!("not a session trace {{id, block_size, requests: [...]}}: {e}"),
        )
    })?;
    if f.block_size == 0 || f.block_size > 1 << 16 {
        return Err(WorkloadError::file(
            path,
            format!("block_size must be within 1..=65536, got {}", f.block_size),
        ));
    }
    if let Some(scope) = f.hash_id_scope.as_deref()
        && scope != "local"
    {
        tracing::debug!(path = %path.display(), scope, "hash_id_scope is not local; offsetting anyway");
    }
    let _ = f.id;
    let mut ctx = Ctx {
        path,
        block: f.block_size,
        think_cap_ms,
        adjusted: 0,
        counter: 0,
    };
    let nodes = convert(f.requests, &mut ctx, "requests")?;
    Ok((f.block_size, nodes, ctx.adjusted))
}

fn session_files(path: &Path) -> Result<Vec<PathBuf>, WorkloadError> {
    if !path.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path).map_err(|e| WorkloadError::io(path, e))? {
        let entry = entry.map_err(|e| WorkloadError::io(path, e))?;
        let p = entry.path();
        if p.is_file() && p.extension().and_then(|e| e.to_str()) == Some("json") {
            files.push(p);
            if files.len() > MAX_FILES {
                return Err(WorkloadError::file(
                    path,
                    format!("more than {MAX_FILES} session files"),
                ));
            }
        }
    }
    files.sort();
    if files.is_empty() {
        return Err(WorkloadError::file(
            path,
            "no *.json session files in this directory",
        ));
    }
    Ok(files)
}

/// Load a session file or a directory of them.
pub fn load(path: &Path, opts: &LoadOptions) -> Result<Workload, WorkloadError> {
    let mut texts = Vec::new();
    for f in session_files(path)? {
        let len = std::fs::metadata(&f)
            .map_err(|e| WorkloadError::io(&f, e))?
            .len();
        if len > MAX_FILE_BYTES {
            return Err(WorkloadError::file(
                &f,
                format!("larger than {MAX_FILE_BYTES} bytes"),
            ));
        }
        let text = std::fs::read_to_string(&f).map_err(|e| WorkloadError::io(&f, e))?;
        texts.push((f, text));
    }
    let refs: Vec<(&Path, &str)> = texts
        .iter()
        .map(|(p, t)| (p.as_path(), t.as_str()))
        .collect();
    let mut w = from_texts(&refs, opts)?;
    w.name = format!(
        "agentic sessions {} ({} files, concurrency {})",
        path.file_name().map_or_else(
            || path.display().to_string(),
            |f| f.to_string_lossy().into_owned()
        ),
        texts.len(),
        opts.concurrency
    );
    Ok(w)
}

/// Build the workload from session texts (`(name, text)`, in cycling order).
pub fn from_texts(files: &[(&Path, &str)], opts: &LoadOptions) -> Result<Workload, WorkloadError> {
    let mut templates: Vec<Arc<[Node]>> = Vec::new();
    let mut block = None;
    let mut adjusted = 0;
    for (path, text) in files {
        let (bs, nodes, adj) = parse_session(text, path, opts.think_cap_ms)?;
        match block {
            None => block = Some(bs),
            Some(b) if b != bs => {
                return Err(WorkloadError::file(
                    path,
                    format!("block_size {bs} differs from the other sessions' {b}"),
                ));
            }
            Some(_) => {}
        }
        adjusted += adj;
        if Node::count_requests(&nodes) > 0 {
            templates.push(nodes.into());
        }
    }
    let block_tokens = block.ok_or_else(|| WorkloadError::Invalid("no session files".into()))?;
    if templates.is_empty() {
        return Err(WorkloadError::Invalid(
            "the session files hold no requests".into(),
        ));
    }
    Ok(Workload {
        name: "agentic sessions".into(),
        block_tokens,
        plan: Plan::Concurrent {
            templates,
            concurrency: opts.concurrency.max(1),
            stagger_ms: opts.stagger_ms.max(0.0),
        },
        adjusted_records: adjusted,
    })
}
