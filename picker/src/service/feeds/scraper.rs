//! The metrics feed: scrape every engine server's Prometheus endpoint on an interval,
//! concurrently, and keep each endpoint's load and staleness current.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use crate::endpoint::{EndpointId, EngineKind};
use crate::engine_metrics::{ParseLimits, parse_engine_metrics};
use crate::load::EndpointLoad;
use crate::service::diagnostics::{BlockSizeSource, EngineActivity};
use crate::service::metrics::KindLabels;
use crate::service::settings::ScrapeSettings;
use crate::service::state::PickerState;

/// Concurrent scrapes at most.
const MAX_CONCURRENT_SCRAPES: usize = 64;
/// Scrape bodies larger than this are refused (a vLLM scrape is ~100 KB).
const MAX_SCRAPE_BYTES: usize = 8 << 20;

/// One HTTP server to scrape and the endpoints (ranks) it reports on.
#[derive(Debug, Clone)]
struct Target {
    url: String,
    engine: EngineKind,
    block_size: u32,
    endpoints: Vec<EndpointId>,
}

fn targets(picker: &PickerState, settings: &ScrapeSettings) -> Vec<Target> {
    let snap = picker.pool.endpoints();
    let mut by_server: BTreeMap<(String, u16), Target> = BTreeMap::new();
    for e in snap.endpoints() {
        let path = settings
            .path
            .clone()
            .unwrap_or_else(|| match e.model_config.engine {
                EngineKind::Trtllm => "/prometheus/metrics".into(),
                _ => "/metrics".into(),
            });
        let host = e.id.host_port();
        by_server
            .entry((host.clone(), e.id.port))
            .or_insert_with(|| Target {
                url: format!("http://{host}{path}"),
                engine: e.model_config.engine,
                block_size: e.model_config.block_size,
                endpoints: Vec::new(),
            })
            .endpoints
            .push(e.id);
    }
    by_server.into_values().collect()
}

/// Why a scrape produced no load sample; [`ScrapeError::kind`] labels
/// `kvroute_picker_scrape_failures_total`.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    #[error("request failed: {0}")]
    Request(#[source] reqwest::Error),
    #[error("HTTP {0}")]
    Status(reqwest::StatusCode),
    #[error("scrape larger than {MAX_SCRAPE_BYTES} bytes")]
    TooLarge,
    #[error("scrape is not UTF-8")]
    NotUtf8,
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("unreadable exposition: {0}")]
    Parse(#[from] crate::engine_metrics::MetricsError),
}

impl ScrapeError {
    /// Stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Request(_) => "request",
            Self::Status(_) => "http_status",
            Self::TooLarge => "too_large",
            Self::NotUtf8 => "not_utf8",
            Self::Timeout(_) => "timeout",
            Self::Parse(_) => "parse",
        }
    }
}

/// GET one exposition, bounded in size and time.
async fn scrape(
    http: &reqwest::Client,
    url: &str,
    timeout: Duration,
) -> Result<String, ScrapeError> {
    let fut = async {
        let resp = http
            .get(url)
            .header("accept", "text/plain; version=0.0.4")
            .send()
            .await
            .map_err(ScrapeError::Request)?;
        if !resp.status().is_success() {
            return Err(ScrapeError::Status(resp.status()));
        }
        if resp
            .content_length()
            .is_some_and(|n| n as usize > MAX_SCRAPE_BYTES)
        {
            return Err(ScrapeError::TooLarge);
        }
        let mut body = Vec::new();
        let mut stream = resp.bytes_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(ScrapeError::Request)?;
            if body.len() + chunk.len() > MAX_SCRAPE_BYTES {
                return Err(ScrapeError::TooLarge);
            }
            body.extend_from_slice(&chunk);
        }
        String::from_utf8(body).map_err(|_| ScrapeError::NotUtf8)
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| ScrapeError::Timeout(timeout))?
}

/// Run until cancelled.
pub async fn run_scraper(
    picker: Arc<PickerState>,
    settings: ScrapeSettings,
    cancel: CancellationToken,
) {
    let mut last_ok: HashMap<EndpointId, u64> = HashMap::new();
    let mut first_seen: HashMap<EndpointId, u64> = HashMap::new();
    let limits = ParseLimits::default();
    let mut ticker = tokio::time::interval(settings.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let ts = targets(&picker, &settings);
        let results: Vec<(Target, Result<String, ScrapeError>)> = futures::stream::iter(ts)
            .map(|t| {
                let http = &picker.http;
                async move {
                    let r = scrape(http, &t.url, settings.timeout).await;
                    (t, r)
                }
            })
            .buffer_unordered(MAX_CONCURRENT_SCRAPES)
            .collect()
            .await;
        let now = picker.now_ms();
        let mut samples = Vec::new();
        let mut findings = Vec::new();
        let mut latencies = Vec::new();
        for (t, r) in results {
            let parsed = r.and_then(|text| {
                parse_engine_metrics(&text, t.engine, &limits).map_err(ScrapeError::from)
            });
            match parsed {
                Ok(m) => {
                    for id in &t.endpoints {
                        let Some(sample) = m.for_rank(id.rank).or_else(|| Some(m.aggregate()))
                        else {
                            continue;
                        };
                        {
                            let mut diagnostics = picker.diagnostics.lock();
                            // SGLang reports no page size (its `block_size` is 1 token)
                            if matches!(t.engine, EngineKind::Vllm | EngineKind::Trtllm)
                                && let Some(engine) = sample.block_size
                            {
                                findings.push(diagnostics.block_size_seen(
                                    *id,
                                    t.block_size,
                                    engine,
                                    BlockSizeSource::Metrics,
                                ));
                            }
                            let activity = EngineActivity {
                                requests: sample.waiting + sample.running,
                                prefix_cache_queries: sample.prefix_cache_queries,
                            };
                            findings.push(diagnostics.engine_seen(*id, activity, now));
                        }
                        latencies.push((*id, *m.perf_for_rank(id.rank), sample.kv_usage));
                        samples.push((
                            *id,
                            EndpointLoad::from_sample(sample, t.engine, t.block_size, now),
                        ));
                        last_ok.insert(*id, now);
                    }
                }
                Err(e) => {
                    picker
                        .metrics
                        .scrape_failures
                        .get_or_create(&KindLabels {
                            kind: e.kind().into(),
                        })
                        .inc();
                    tracing::debug!(url = %t.url, error = %e, "scrape failed");
                }
            }
        }
        // the loads, and the KV capacities they report (which bound the index per endpoint)
        picker.pool.learn_loads(samples);
        for finding in findings {
            picker.report(finding);
        }
        picker.observe_engines(&latencies);
        // staleness: marked and recovered automatically
        let threshold = picker.routing().staleness_threshold.as_millis() as u64;
        let snap = picker.pool.endpoints();
        let mut marks = Vec::with_capacity(snap.len());
        let mut stale = 0;
        for e in snap.endpoints() {
            let seen = *first_seen.entry(e.id).or_insert(now);
            let fresh_since = last_ok.get(&e.id).copied().unwrap_or(seen);
            let is_stale = now.saturating_sub(fresh_since) > threshold
                || (!last_ok.contains_key(&e.id) && now.saturating_sub(seen) > threshold);
            stale += usize::from(is_stale);
            marks.push((e.id, is_stale));
        }
        for change in picker.pool.set_stale(&marks) {
            if change.stale {
                tracing::warn!(endpoint = %change.endpoint, dropped = change.dropped, "endpoint is stale: no good metrics scrape within the threshold; its cached blocks are forgotten");
            } else {
                tracing::info!(endpoint = %change.endpoint, "endpoint recovered");
            }
        }
        picker.metrics.stale_endpoints.set(stale as i64);
        picker
            .metrics
            .index_blocks
            .set(picker.pool.live_blocks() as i64);
        if !snap.is_empty() {
            picker
                .first_metrics
                .send_if_modified(|seen| !std::mem::replace(seen, true));
        }
        // forget endpoints that left the set
        last_ok.retain(|id, _| snap.get(id).is_some());
        first_seen.retain(|id, _| snap.get(id).is_some());
        let gone = picker
            .diagnostics
            .lock()
            .retain(|id| snap.get(id).is_some());
        for finding in gone {
            picker.report(Some(finding));
        }
        // approximate entries past their TTL
        picker.pool.expire(now);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A one-shot HTTP server on 127.0.0.1:0 that answers every connection with `response`
    /// (or, with `None`, accepts and never answers).
    async fn serve(response: Option<Vec<u8>>) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let response = response.clone();
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    let _ = conn.read(&mut buf).await;
                    match response {
                        Some(r) => {
                            let _ = conn.write_all(&r).await;
                        }
                        None => tokio::time::sleep(Duration::from_secs(30)).await,
                    }
                });
            }
        });
        format!("http://{addr}/metrics")
    }

    fn reply(status: &str, body: &[u8]) -> Option<Vec<u8>> {
        let mut r = format!(
            "HTTP/1.1 {status}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        )
        .into_bytes();
        r.extend_from_slice(body);
        Some(r)
    }

    #[tokio::test]
    async fn every_failure_has_its_own_kind() {
        let http = reqwest::Client::new();
        let t = Duration::from_secs(5);
        let ok = serve(reply("200 OK", b"vllm:num_requests_running 1\n")).await;
        assert_eq!(
            scrape(&http, &ok, t).await.unwrap(),
            "vllm:num_requests_running 1\n"
        );
        let kind = |r: Result<String, ScrapeError>| r.unwrap_err().kind();
        let status = serve(reply("503 Service Unavailable", b"")).await;
        assert_eq!(kind(scrape(&http, &status, t).await), "http_status");
        let binary = serve(reply("200 OK", &[0xff, 0xfe, 0x00])).await;
        assert_eq!(kind(scrape(&http, &binary, t).await), "not_utf8");
        let mut huge = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n",
            MAX_SCRAPE_BYTES + 1
        )
        .into_bytes();
        huge.extend_from_slice(b"x");
        let large = serve(Some(huge)).await;
        assert_eq!(kind(scrape(&http, &large, t).await), "too_large");
        let silent = serve(None).await;
        assert_eq!(
            kind(scrape(&http, &silent, Duration::from_millis(200)).await),
            "timeout"
        );
        // a port nothing listens on: bind one, note it, close it
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            format!("http://{}/metrics", l.local_addr().unwrap())
        };
        assert_eq!(kind(scrape(&http, &closed, t).await), "request");
        let bad = crate::engine_metrics::parse_engine_metrics(
            "x{ 1",
            EngineKind::Vllm,
            &ParseLimits::default(),
        )
        .unwrap_err();
        assert_eq!(ScrapeError::from(bad).kind(), "parse");
    }
}
