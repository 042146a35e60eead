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

/// Failed scrapes in a row after which a server is scraped less often.
const BACKOFF_AFTER_FAILURES: u32 = 3;
/// The longest a server whose scrapes keep failing waits between two attempts.
const MAX_BACKOFF_MS: u64 = 10_000;

/// Servers whose scrapes keep failing are tried less often: after
/// [`BACKOFF_AFTER_FAILURES`] failures in a row, every interval doubles, up to
/// [`MAX_BACKOFF_MS`] and never more than half of how long it has been failing (so a server
/// that recovers is scraped again within a third of its outage), until one succeeds. A server that cannot be scraped is stale anyway;
/// scraping it on every tick only costs the picker (a page that takes a core to parse, a
/// connection that times out) without telling it anything new.
#[derive(Debug, Default)]
pub struct ScrapeBackoff {
    /// Per server URL: failures in a row, when it is next due and when the first of them was
    /// (ms).
    by_url: HashMap<String, (u32, u64, u64)>,
}

impl ScrapeBackoff {
    /// Whether `url` is to be scraped at `now_ms`.
    pub fn due(&self, url: &str, now_ms: u64) -> bool {
        self.by_url.get(url).is_none_or(|&(_, at, _)| now_ms >= at)
    }

    /// A scrape of `url` failed at `now_ms`; scrapes run every `interval_ms`.
    pub fn failed(&mut self, url: &str, now_ms: u64, interval_ms: u64) {
        let entry = self.by_url.entry(url.to_owned()).or_insert((0, 0, now_ms));
        entry.0 = entry.0.saturating_add(1);
        let over = entry.0.saturating_sub(BACKOFF_AFTER_FAILURES - 1);
        let wait = if over == 0 {
            0
        } else {
            interval_ms
                .saturating_mul(1u64 << over.min(20))
                .min(MAX_BACKOFF_MS)
                .min(now_ms.saturating_sub(entry.2) / 2)
        };
        entry.1 = now_ms.saturating_add(wait);
    }

    /// A scrape of `url` succeeded: back to every interval.
    pub fn succeeded(&mut self, url: &str) {
        self.by_url.remove(url);
    }

    /// Forget servers no longer scraped: those not among `urls` (read only when some server
    /// is backing off, which is rare).
    pub fn retain<'a>(&mut self, urls: impl IntoIterator<Item = &'a str>) {
        if self.by_url.is_empty() {
            return;
        }
        let keep: std::collections::HashSet<&str> = urls.into_iter().collect();
        self.by_url.retain(|url, _| keep.contains(url.as_str()));
    }
}

/// One HTTP server to scrape and the endpoints (ranks) it reports on.
#[derive(Debug, Clone)]
struct Target {
    url: String,
    engine: EngineKind,
    block_size: u32,
    endpoints: Vec<EndpointId>,
}

fn targets(picker: &PickerState, settings: &ScrapeSettings) -> Vec<Target> {
    let snap = picker.pool.state().endpoints();
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
    let limits = ParseLimits::default();
    let mut backoff = ScrapeBackoff::default();
    // model configs with a pool-saturation series
    let mut saturated_configs: Vec<String> = Vec::new();
    let interval_ms = u64::try_from(settings.interval.as_millis()).unwrap_or(u64::MAX);
    let mut ticker = tokio::time::interval(settings.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let all = targets(&picker, &settings);
        backoff.retain(all.iter().map(|t| t.url.as_str()));
        let started = picker.now_ms();
        let ts: Vec<Target> = all
            .into_iter()
            .filter(|t| backoff.due(&t.url, started))
            .collect();
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
            match &parsed {
                Ok(_) => backoff.succeeded(&t.url),
                Err(_) => backoff.failed(&t.url, now, interval_ms),
            }
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
                                full_block_sent: picker.pool.inflight().full_block_sent(id),
                            };
                            findings.push(diagnostics.engine_seen(*id, activity, now));
                        }
                        latencies.push((*id, *m.perf_for_rank(id.rank), sample.kv_usage));
                        samples.push((
                            *id,
                            EndpointLoad::from_sample(sample, t.engine, t.block_size, now),
                        ));
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
        // the loads (and the KV capacities they report, which bound the index per endpoint),
        // staleness marked and recovered by the pool's rule, approximate entries expired
        let outcome = picker.pool.observe_scrape(now, samples);
        picker.pool_changed();
        for finding in findings {
            picker.report(finding);
        }
        picker.observe_engines(&latencies);
        for change in outcome.changes {
            if change.stale {
                tracing::warn!(endpoint = %change.endpoint, dropped = change.dropped, "endpoint is stale: no good metrics scrape within the threshold (an approximate view is forgotten; a precise one is kept for its event feed to confirm)");
            } else {
                tracing::info!(endpoint = %change.endpoint, "endpoint recovered");
            }
        }
        let snap = picker.pool.state().endpoints();
        let stale = outcome.stale;
        picker.metrics.stale_endpoints.set(stale as i64);
        // the pool-saturation gauge: one series per model config that has endpoints
        let saturation = picker.pool.saturation(&picker.routing().saturation);
        let now_configs: Vec<String> = saturation.iter().map(|(c, _)| c.clone()).collect();
        for model_config in saturated_configs.drain(..) {
            if !now_configs.contains(&model_config) {
                picker
                    .metrics
                    .pool_saturation
                    .remove(&crate::service::metrics::ModelConfigLabels { model_config });
            }
        }
        for (model_config, value) in saturation {
            picker
                .metrics
                .pool_saturation
                .get_or_create(&crate::service::metrics::ModelConfigLabels { model_config })
                .set(value);
        }
        saturated_configs = now_configs;
        picker
            .metrics
            .index_blocks
            .set(picker.pool.state().live_blocks() as i64);
        if !snap.is_empty() {
            picker
                .first_metrics
                .send_if_modified(|seen| !std::mem::replace(seen, true));
        }
        // forget endpoints that left the set
        let gone = picker
            .diagnostics
            .lock()
            .retain(|id| snap.get(id).is_some());
        for finding in gone {
            picker.report(Some(finding));
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Finding 6 of issue 35: a server whose scrapes keep failing was scraped on every tick
    /// forever. After three failures in a row the waits double, up to 10 s; a success resets.
    #[test]
    fn failing_scrapes_back_off_and_a_success_resets() {
        let mut b = ScrapeBackoff::default();
        let url = "http://127.0.0.1:8000/metrics";
        let mut now = 0;
        let mut waits = Vec::new();
        for _ in 0..18 {
            assert!(b.due(url, now));
            b.failed(url, now, 100);
            let mut next = now;
            while !b.due(url, next) {
                next += 100;
            }
            // the next tick comes an interval later at the earliest
            let next = next.max(now + 100);
            waits.push(next - now);
            now = next;
        }
        // every tick for three failures, then doubling but held to half the outage so far
        // (each wait about half again the last), up to 10 s
        assert_eq!(
            waits,
            [
                100, 100, 100, 200, 300, 400, 600, 900, 1400, 2100, 3100, 4700, 7000, 10_000,
                10_000, 10_000, 10_000, 10_000
            ]
        );
        b.succeeded(url);
        assert!(b.due(url, now));
        b.failed(url, now, 100);
        assert!(b.due(url, now), "one failure after a success: no wait");
        b.retain(["http://127.0.0.1:9/metrics"]);
        assert!(b.by_url.is_empty());
    }

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
