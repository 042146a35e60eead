//! Azure LLM inference traces (Splitwise, 2023): CSV `TIMESTAMP, ContextTokens,
//! GeneratedTokens`. Arrivals and lengths only: no prefix information, so every prompt is
//! unique (no reuse is possible; a control for the cache-aware policies).

use std::path::Path;
use std::sync::Arc;

use super::tokens::mix64;
use super::{
    LoadOptions, MAX_INPUT_TOKENS, MAX_OUTPUT_TOKENS, MAX_RECORDS, Node, TimedSession,
    TraceRequest, Workload, WorkloadError,
};

/// Tokens per (unique) hash id for Azure prompts.
pub const BLOCK_TOKENS: u32 = 64;

/// Parse `2023-11-16 18:17:03.9799600` into milliseconds since midnight (the trace spans one
/// day; arrivals are made relative to the first one anyway).
fn parse_timestamp(s: &str) -> Option<f64> {
    let s = s.trim();
    let time = s.rsplit(' ').next()?;
    let mut parts = time.split(':');
    let h: f64 = parts.next()?.parse().ok()?;
    let m: f64 = parts.next()?.parse().ok()?;
    let sec: f64 = parts.next()?.parse().ok()?;
    if parts.next().is_some() || !(0.0..24.0).contains(&h) || !(0.0..60.0).contains(&m) {
        return None;
    }
    // the date matters only across midnight: fold it in as days since an arbitrary epoch
    let date = s.split(' ').next().filter(|d| d.len() == 10 && d != &time);
    let days = date
        .and_then(|d| {
            let mut p = d.split('-');
            let y: i64 = p.next()?.parse().ok()?;
            let mo: i64 = p.next()?.parse().ok()?;
            let da: i64 = p.next()?.parse().ok()?;
            Some((y * 372 + mo * 31 + da) as f64)
        })
        .unwrap_or(0.0);
    Some(((days * 24.0 + h) * 60.0 + m) * 60_000.0 + sec * 1000.0)
}

/// Load an Azure CSV file.
pub fn load(path: &Path, opts: &LoadOptions) -> Result<Workload, WorkloadError> {
    let file = std::fs::File::open(path).map_err(|e| WorkloadError::io(path, e))?;
    parse(file, path, opts)
}

/// Parse Azure CSV from any reader (`path` only names the source in errors).
pub fn parse(
    reader: impl std::io::Read,
    path: &Path,
    opts: &LoadOptions,
) -> Result<Workload, WorkloadError> {
    let limit = opts.max_records.unwrap_or(MAX_RECORDS).min(MAX_RECORDS);
    let mut rdr = csv::ReaderBuilder::new()
        .has_headers(true)
        .trim(csv::Trim::All)
        .from_reader(reader);
    let headers = rdr
        .headers()
        .map_err(|e| WorkloadError::file(path, format!("cannot read the CSV header: {e}")))?
        .clone();
    let col = |name: &str| {
        headers
            .iter()
            .position(|h| h.eq_ignore_ascii_case(name))
            .ok_or_else(|| {
                WorkloadError::file(
                    path,
                    format!(
                        "missing column {name:?} (expected TIMESTAMP, ContextTokens, GeneratedTokens)"
                    ),
                )
            })
    };
    let (ts_col, ctx_col, gen_col) = (
        col("TIMESTAMP")?,
        col("ContextTokens")?,
        col("GeneratedTokens")?,
    );
    let mut sessions = Vec::new();
    for (i, rec) in rdr.records().enumerate() {
        if sessions.len() >= limit {
            break;
        }
        let line = i + 2;
        let rec = rec.map_err(|e| WorkloadError::record(path, line, e.to_string()))?;
        let field = |c: usize| rec.get(c).unwrap_or("");
        let ts = parse_timestamp(field(ts_col)).ok_or_else(|| {
            WorkloadError::record(
                path,
                line,
                format!(
                    "bad TIMESTAMP {:?} (expected YYYY-MM-DD HH:MM:SS.fff)",
                    field(ts_col)
                ),
            )
        })?;
        let num = |c: usize, name: &str, max: u32| -> Result<u32, WorkloadError> {
            field(c)
                .parse::<u32>()
                .ok()
                .filter(|v| *v <= max)
                .ok_or_else(|| {
                    WorkloadError::record(
                        path,
                        line,
                        format!(
                            "{name} must be an integer within 0..={max}, got {:?}",
                            field(c)
                        ),
                    )
                })
        };
        let input = num(ctx_col, "ContextTokens", MAX_INPUT_TOKENS)?.max(1);
        let output = num(gen_col, "GeneratedTokens", MAX_OUTPUT_TOKENS)?.max(1);
        let ids: Vec<u64> = (0..input.div_ceil(BLOCK_TOKENS))
            .map(|k| mix64(opts.seed ^ mix64(line as u64) ^ mix64(u64::from(k) << 32)))
            .collect();
        let (req, _) = TraceRequest::normalized(ids, BLOCK_TOKENS, input, output, line as u64);
        sessions.push(TimedSession {
            start_ms: ts,
            nodes: Arc::from(vec![Node::Request { think_ms: 0.0, req }]),
        });
    }
    Workload::timed_from_file("azure", path, sessions, BLOCK_TOKENS, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_parse_to_ms() {
        let a = parse_timestamp("2023-11-16 18:17:03.9799600").unwrap_or(-1.0);
        let b = parse_timestamp("2023-11-16 18:17:04.0319600").unwrap_or(-1.0);
        assert!((b - a - 52.0).abs() < 1e-6, "{a} {b}");
        assert!(parse_timestamp("yesterday").is_none());
    }
}
