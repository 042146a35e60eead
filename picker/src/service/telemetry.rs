//! OpenTelemetry tracing of the picker's requests, off unless configured.
//!
//! With `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT` set (OTLP over
//! gRPC, e.g. `http://otel-collector:4317`; `OTEL_SERVICE_NAME` names the service, default
//! `kvroute-picker`), every request gets a span (`kvroute.request`) under the caller's W3C
//! `traceparent`, with children for parsing, tokenizing, the decision (candidates, chosen
//! endpoint and rank, cached tokens, policy, whether it failed open) and forwarding; the
//! engine is sent the forward span's `traceparent`/`tracestate` (through ext_proc, as headers
//! the gateway sets), so its own spans join the trace.
//!
//! Off, no span is created: they are `tracing` spans of their own target, [`TARGET`], which
//! only the OpenTelemetry layer enables, so each call site costs one cached interest check; the
//! client's `traceparent` then reaches the engine as it came.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::Layer;
use tracing_subscriber::filter::{LevelFilter, Targets};

/// The `tracing` target of the request spans.
pub const TARGET: &str = "kvroute::trace";

static ENABLED: AtomicBool = AtomicBool::new(false);
/// Export calls that failed, in this process.
static EXPORT_FAILURES: AtomicU64 = AtomicU64::new(0);
/// When a failure was last logged (s since the epoch): at most one line per interval.
static LAST_LOGGED: AtomicU64 = AtomicU64::new(0);
const LOG_EVERY_SECS: u64 = 30;

/// Batches of spans the exporter could not deliver so far.
pub fn export_failures() -> u64 {
    EXPORT_FAILURES.load(Ordering::Relaxed)
}

/// An exporter that counts and logs its failures: the SDK's batch processor drops a batch
/// that fails without a word the operator would see.
#[derive(Debug)]
struct Counted<E>(E);

impl<E: opentelemetry_sdk::trace::SpanExporter> opentelemetry_sdk::trace::SpanExporter
    for Counted<E>
{
    async fn export(
        &self,
        batch: Vec<opentelemetry_sdk::trace::SpanData>,
    ) -> opentelemetry_sdk::error::OTelSdkResult {
        let spans = batch.len();
        let result = self.0.export(batch).await;
        if let Err(e) = &result {
            let n = EXPORT_FAILURES.fetch_add(1, Ordering::Relaxed) + 1;
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            let last = LAST_LOGGED.load(Ordering::Relaxed);
            if now.saturating_sub(last) >= LOG_EVERY_SECS
                && LAST_LOGGED
                    .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
            {
                tracing::warn!(error = %e, spans, failures = n, "exporting request trace spans failed; they are lost");
            }
        }
        result
    }

    fn shutdown_with_timeout(
        &self,
        timeout: std::time::Duration,
    ) -> opentelemetry_sdk::error::OTelSdkResult {
        self.0.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> opentelemetry_sdk::error::OTelSdkResult {
        self.0.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.0.set_resource(resource);
    }
}

/// Whether request tracing is on (spans are exported and `traceparent` is rewritten).
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// The tracer provider behind the layer: flush and shut it down at exit.
#[derive(Debug, Clone)]
pub struct Telemetry {
    provider: SdkTracerProvider,
}

impl Telemetry {
    /// Exports what is buffered now.
    pub fn flush(&self) {
        if let Err(e) = self.provider.force_flush() {
            tracing::warn!(error = %e, "exporting the buffered trace spans failed");
        }
    }

    pub fn shutdown(&self) {
        self.flush();
        let _ = self.provider.shutdown();
    }
}

/// A `tracing` layer exporting the request spans, boxed for any subscriber built on the
/// registry.
pub type OtelLayer = Box<dyn Layer<tracing_subscriber::Registry> + Send + Sync>;

/// The exporter from the standard environment variables, or `None` when no OTLP endpoint is
/// set.
pub fn from_env() -> anyhow::Result<Option<(OtelLayer, Telemetry)>> {
    let endpoint = [
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ]
    .iter()
    .find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty()));
    let Some(endpoint) = endpoint else {
        return Ok(None);
    };
    let service = std::env::var("OTEL_SERVICE_NAME")
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "kvroute-picker".into());
    with_endpoint(&endpoint, &service).map(Some)
}

/// An exporter to the OTLP/gRPC collector at `endpoint`, and request tracing turned on.
pub fn with_endpoint(endpoint: &str, service: &str) -> anyhow::Result<(OtelLayer, Telemetry)> {
    use opentelemetry_otlp::WithExportConfig as _;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .build()?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(Counted(exporter))
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name(service.to_owned())
                .build(),
        )
        .build();
    opentelemetry::global::set_text_map_propagator(
        opentelemetry_sdk::propagation::TraceContextPropagator::new(),
    );
    let layer = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("kvroute-picker"))
        .with_filter(Targets::new().with_target(TARGET, LevelFilter::INFO));
    ENABLED.store(true, Ordering::Relaxed);
    Ok((Box::new(layer), Telemetry { provider }))
}

/// The span of one request, under the W3C trace context the caller sent in `headers` (any
/// iterator of name/value pairs).
pub fn request_span<'a>(
    headers: impl IntoIterator<Item = (&'a str, &'a str)>,
    api: &str,
    path: &str,
) -> tracing::Span {
    let span = tracing::info_span!(
        target: TARGET,
        "kvroute.request",
        otel.kind = "server",
        api,
        http.route = path,
        model = tracing::field::Empty,
    );
    if enabled() {
        struct Pairs<'a>(Vec<(&'a str, &'a str)>);
        impl Extractor for Pairs<'_> {
            fn get(&self, key: &str) -> Option<&str> {
                self.0
                    .iter()
                    .find(|(k, _)| k.eq_ignore_ascii_case(key))
                    .map(|(_, v)| *v)
            }
            fn keys(&self) -> Vec<&str> {
                self.0.iter().map(|(k, _)| *k).collect()
            }
        }
        let pairs = Pairs(headers.into_iter().collect());
        let parent = opentelemetry::global::get_text_map_propagator(|p| p.extract(&pairs));
        let _ = span.set_parent(parent);
    }
    span
}

/// The W3C trace context of `span` as the headers to send on (`traceparent`, `tracestate`);
/// none while tracing is off.
pub fn context_headers(span: &tracing::Span) -> Vec<(&'static str, String)> {
    if !enabled() {
        return Vec::new();
    }
    struct Out(Vec<(&'static str, String)>);
    impl Injector for Out {
        fn set(&mut self, key: &str, value: String) {
            let key = match key {
                "traceparent" => "traceparent",
                "tracestate" => "tracestate",
                _ => return,
            };
            self.0.push((key, value));
        }
    }
    let mut out = Out(Vec::new());
    let cx = span.context();
    opentelemetry::global::get_text_map_propagator(|p| p.inject_context(&cx, &mut out));
    out.0
}
