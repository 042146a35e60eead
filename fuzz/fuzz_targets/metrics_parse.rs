//! Prometheus text from an engine's /metrics, for every engine flavour.
#![no_main]

use kvroute_routing::endpoint::EngineKind;
use kvroute_routing::engine_metrics::{ParseLimits, parse_engine_metrics};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    for engine in [EngineKind::Vllm, EngineKind::Sglang, EngineKind::Trtllm] {
        let _ = parse_engine_metrics(text, engine, &ParseLimits::default());
    }
});
