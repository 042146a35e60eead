//! Offline replay: deterministic, and cache-aware routing pays off on shared prefixes.

use kvroute_bench::workload::generated::{GeneratorConfig, generate};
use kvroute_bench::{BenchOptions, ClusterConfig, offline};
use kvroute_picker::config::Strategy;

fn small_options() -> BenchOptions {
    let mut cluster = ClusterConfig {
        engines: 4,
        ..ClusterConfig::default()
    };
    cluster.engine.num_blocks = 20_000;
    BenchOptions {
        cluster,
        time_decisions: false,
        seed: 3,
        ..BenchOptions::default()
    }
}

fn small_workload() -> kvroute_bench::workload::Workload {
    generate(
        &GeneratorConfig {
            groups: 4,
            system_tokens: 1_500,
            session_rate: 6.0,
            duration_s: 20.0,
            turns: 4.0,
            user_tokens: 400,
            output_tokens: 24,
            think_ms: 1_000.0,
            ..GeneratorConfig::default()
        },
        11,
    )
}

#[test]
fn same_seed_same_json() {
    let w = small_workload();
    let opts = small_options();
    let run = |s| {
        let r = offline::run(&w, s, &opts, &mut |_, _| {}).expect("runs");
        serde_json::to_string(&r.summary).expect("json")
    };
    for s in [Strategy::CostModel, Strategy::RoundRobin] {
        let a = run(s);
        assert_eq!(a, run(s), "{s:?} is deterministic");
        assert!(a.contains("\"decision_us_p99\":null"), "{a}");
    }
}

#[test]
fn cost_model_beats_round_robin_on_hit_rate() {
    let w = small_workload();
    let opts = small_options();
    let cm = offline::run(&w, Strategy::CostModel, &opts, &mut |_, _| {}).expect("runs");
    let rr = offline::run(&w, Strategy::RoundRobin, &opts, &mut |_, _| {}).expect("runs");
    let (cm, rr) = (cm.summary, rr.summary);
    assert_eq!(cm.errors + rr.errors, 0);
    assert_eq!(cm.requests, rr.requests);
    assert!(cm.requests > 100, "{}", cm.requests);
    assert!(
        cm.hit_rate > rr.hit_rate + 0.1,
        "cost-model {:.3} vs round-robin {:.3}",
        cm.hit_rate,
        rr.hit_rate
    );
    assert!(
        cm.hit_rate <= cm.hit_rate_ceiling + 1e-9,
        "never above the ceiling"
    );
    assert!(
        cm.ttft_ms_p90 <= rr.ttft_ms_p90,
        "{} vs {}",
        cm.ttft_ms_p90,
        rr.ttft_ms_p90
    );
    assert!(cm.prefill_util > 0.0 && cm.prefill_util < 1.0);
}
