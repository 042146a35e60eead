//! What request tracing costs while it is off: the spans a request opens (request, parse,
//! tokenize, decide with its attributes, forward) and the trace-context check, under the
//! binary's own subscriber (the log, which excludes the `kvroute::trace` target) and no
//! OpenTelemetry layer. Compare with the decision itself (~14 µs, picker/BENCHMARKS.md §2).
//!
//! `cargo bench -p kvroute-picker --bench telemetry_off`

use criterion::{Criterion, criterion_group, criterion_main};
use kvroute_picker::service::telemetry;
use std::hint::black_box;

fn bench(c: &mut Criterion) {
    kvroute_process::init_logging_with(false, "warn", None);
    let headers = [
        (
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ),
        ("content-type", "application/json"),
    ];
    c.bench_function("telemetry_off/one_request", |b| {
        b.iter(|| {
            let span = telemetry::request_span(
                black_box(headers.iter().copied()),
                "chat_completions",
                "/v1/chat/completions",
            );
            let _in = span.enter();
            span.record("model", "llama");
            drop(tracing::info_span!(target: telemetry::TARGET, "parse").entered());
            let tokenize = tracing::info_span!(
                target: telemetry::TARGET,
                "tokenize",
                tokens = tracing::field::Empty,
            );
            tokenize.record("tokens", 8192);
            let decide = tracing::info_span!(
                target: telemetry::TARGET,
                "decide",
                endpoint = tracing::field::Empty,
                cached_tokens = tracing::field::Empty,
            );
            decide.record("endpoint", "10.0.0.1:8000");
            decide.record("cached_tokens", 4096);
            let forward = tracing::info_span!(target: telemetry::TARGET, "forward", attempt = 0);
            black_box(telemetry::context_headers(&forward))
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
