//! `kvroute-bench scale` end to end on a tiny pool: every phase and step is measured from the
//! picker's `/proc` entries and metrics, with events flowing. Seconds, not minutes.

#![allow(clippy::unwrap_used)]

use std::path::Path;

use kvroute_bench::scale::{PromptKind, ScaleOptions, markdown, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tiny_scale_run_measures_every_phase_and_step() {
    let exe = Path::new(env!("CARGO_BIN_EXE_kvroute-bench"));
    let opts = ScaleOptions {
        servers: 2,
        dp_size: 2,
        block_size: 16,
        kv_blocks: 600,
        prefill_tokens_per_s: 2_000.0,
        fill_tokens_per_s: 20_000.0,
        prefill_prompt_tokens: 256,
        fill_fraction: 0.5,
        kinds: vec![PromptKind::Text, PromptKind::Ids],
        sizes: vec![512],
        rates: vec![20.0],
        step_secs: 1.0,
        phase_secs: 0.5,
        new_fraction: 0.1,
        // never stop on latency: this run is about what is measured, not how fast
        stop_added_p99_ms: 1e9,
        scrape_ms: 100,
        // the repository's fixture
        tokenizer: None,
        seed: 1,
        no_pin: true,
        min_step_requests: 10,
    };
    let r = tokio::time::timeout(std::time::Duration::from_secs(120), run(opts, exe))
        .await
        .expect("within two minutes")
        .unwrap();
    assert_eq!(r.endpoints, 4);
    assert_eq!(r.idle.index_blocks, 0.0, "no events before the fill");
    assert!(r.fill.index_blocks >= 0.5 * 4.0 * 599.0, "{:?}", r.fill);
    assert!(r.events.event_batches_per_s > 0.0, "{:?}", r.events);
    assert!(r.events.lag_p99_ms.is_some());
    assert!(r.events.rss_mib > 0.0 && r.events.picker_cores >= 0.0);
    assert_eq!(r.steps.len(), 2, "one rate per kind");
    for s in &r.steps {
        assert_eq!(s.errors, 0, "{:?}", s.first_error);
        assert!(s.requests >= 10, "both paths, at least the minimum: {s:?}");
        assert_eq!(s.tokens, 512);
        assert!(s.achieved_per_s > 0.0 && s.picker_p50_ms > 0.0 && s.direct_p50_ms > 0.0);
        assert!(s.decision_p99_ms.is_some(), "the picker decided: {s:?}");
    }
    assert!(r.knees.iter().all(|k| k.last_below_per_s == Some(20.0)));
    // one rate per size gives no slope
    assert!(r.knees.iter().all(|k| k.slope_cores_per_100_rps.is_none()));
    let md = markdown(&r);
    assert!(
        md.contains("| Text | 512 |") && md.contains("| Ids | 512 |"),
        "{md}"
    );
}
