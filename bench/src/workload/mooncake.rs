//! Mooncake traces (FAST'25): JSON lines `{timestamp (ms), input_length, output_length,
//! hash_ids}` with chained hash ids of 512-token blocks. No sessions: an open-loop replay by
//! timestamp.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;

use super::{
    LoadOptions, MAX_INPUT_TOKENS, MAX_OUTPUT_TOKENS, MAX_RECORDS, Node, TimedSession,
    TraceRequest, Workload, WorkloadError,
};

/// Tokens per Mooncake hash id.
pub const BLOCK_TOKENS: u32 = 512;
/// Longest line accepted (a record with ~1M hash ids).
const MAX_LINE_BYTES: u64 = 16 << 20;

#[derive(Debug, Deserialize)]
struct Record {
    timestamp: f64,
    input_length: u32,
    output_length: u32,
    hash_ids: Vec<u64>,
}

/// Read one line of at most `MAX_LINE_BYTES` (without its newline); `None` at the end.
pub(crate) fn read_line_bounded(
    reader: &mut impl BufRead,
    buf: &mut String,
    path: &Path,
    line: usize,
) -> Result<Option<()>, WorkloadError> {
    buf.clear();
    let n = reader
        .by_ref()
        .take(MAX_LINE_BYTES + 1)
        .read_line(buf)
        .map_err(|e| WorkloadError::io(path, e))?;
    if n == 0 {
        return Ok(None);
    }
    if n as u64 > MAX_LINE_BYTES {
        return Err(WorkloadError::record(
            path,
            line,
            format!("line longer than {MAX_LINE_BYTES} bytes"),
        ));
    }
    Ok(Some(()))
}

/// Load a Mooncake JSONL file.
pub fn load(path: &Path, opts: &LoadOptions) -> Result<Workload, WorkloadError> {
    let file = std::fs::File::open(path).map_err(|e| WorkloadError::io(path, e))?;
    parse(BufReader::new(file), path, opts)
}

/// Parse Mooncake JSON lines from any reader (`path` only names the source in errors).
pub fn parse(
    mut reader: impl BufRead,
    path: &Path,
    opts: &LoadOptions,
) -> Result<Workload, WorkloadError> {
    let limit = opts.max_records.unwrap_or(MAX_RECORDS).min(MAX_RECORDS);
    let mut sessions: Vec<TimedSession> = Vec::new();
    let mut adjusted = 0;
    let mut buf = String::new();
    let mut line = 0;
    while sessions.len() < limit {
        line += 1;
        if read_line_bounded(&mut reader, &mut buf, path, line)?.is_none() {
            break;
        }
        let text = buf.trim();
        if text.is_empty() {
            continue;
        }
        let r: Record = serde_json::from_str(text).map_err(|e| {
            WorkloadError::record(
                path,
                line,
                format!("not a Mooncake record {{timestamp, input_length, output_length, hash_ids}}: {e}"),
            )
        })?;
        if !r.timestamp.is_finite() || r.timestamp < 0.0 {
            return Err(WorkloadError::record(
                path,
                line,
                format!(
                    "timestamp must be a non-negative number of ms, got {}",
                    r.timestamp
                ),
            ));
        }
        if r.input_length == 0 || r.input_length > MAX_INPUT_TOKENS {
            return Err(WorkloadError::record(
                path,
                line,
                format!(
                    "input_length must be within 1..={MAX_INPUT_TOKENS}, got {}",
                    r.input_length
                ),
            ));
        }
        if r.output_length > MAX_OUTPUT_TOKENS {
            return Err(WorkloadError::record(
                path,
                line,
                format!("output_length above {MAX_OUTPUT_TOKENS}"),
            ));
        }
        let (req, adj) = TraceRequest::normalized(
            r.hash_ids,
            BLOCK_TOKENS,
            r.input_length,
            r.output_length,
            line as u64,
        );
        adjusted += usize::from(adj);
        sessions.push(TimedSession {
            start_ms: r.timestamp,
            nodes: Arc::from(vec![Node::Request { think_ms: 0.0, req }]),
        });
    }
    Workload::timed_from_file("mooncake", path, sessions, BLOCK_TOKENS, adjusted)
}
