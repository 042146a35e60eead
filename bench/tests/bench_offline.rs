//! Offline replay: deterministic, and cache-aware routing pays off on shared prefixes.

mod common;

use common::{small_options, small_workload};
use kvroute_bench::offline;
use kvroute_bench::workload::generated::{GeneratorConfig, generate};
use kvroute_picker::config::Strategy;

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

/// Issue 32: with the sessions' context beyond the engines' KV capacity, session admission
/// holds first turns (never longer than `maxWait`, in simulated time), every request still
/// completes, and the held turns' waits are in their TTFT.
#[test]
fn session_admission_holds_first_turns_within_max_wait() {
    let w = small_workload();
    let mut opts = small_options();
    opts.cluster.engines = 2;
    opts.cluster.engine.num_blocks = 1_500;
    let spec = |p: &str| kvroute_bench::parse_policies(p).expect("valid")[0];
    let run = |p: &str| {
        let p = spec(p);
        offline::run(&w, p, &p.options(&opts), &mut |_, _| {}).expect("runs")
    };
    let plain = run("sticky-cost-model");
    let held = run("cost-model+admit=5");
    assert!(plain.detail.admission.is_none());
    let a = held.detail.admission.clone().expect("admission on");
    assert!(a.held > 0, "{a:?}");
    assert!(a.wait_ms_max <= 5_001.0, "{a:?}");
    assert!(a.timeouts <= a.held);
    assert_eq!(held.summary.errors, 0, "{:?}", held.detail.error_samples);
    assert_eq!(held.summary.requests, plain.summary.requests);
    // a held turn's TTFT counts from its release: the slowest first token is no earlier
    // than the longest wait
    let slowest = held.detail.ttfts_sorted.last().copied().unwrap_or(0.0);
    assert!(slowest >= a.wait_ms_max, "{slowest} < {}", a.wait_ms_max);
}

/// `replay --sweep --report`: one page with the three figures against the concurrency and
/// every point's table.
#[test]
fn a_sweep_report_plots_every_policy_at_every_point() {
    let w = small_workload();
    let opts = small_options();
    let policies = kvroute_bench::parse_policies("cost-model,least-load").expect("valid");
    let points: Vec<(usize, Vec<kvroute_bench::PolicyRun>)> = [4, 8]
        .into_iter()
        .map(|c| {
            let runs = policies
                .iter()
                .map(|p| offline::run(&w, *p, &opts, &mut |_, _| {}).expect("runs"))
                .collect();
            (c, runs)
        })
        .collect();
    let dir = std::env::temp_dir().join(format!("kvroute-sweep-{}", std::process::id()));
    let info = kvroute_bench::report::RunInfo {
        mode: "offline sweep".into(),
        workload: "test".into(),
        cluster: "test".into(),
        command: "test".into(),
    };
    kvroute_bench::report::write_sweep_html(&dir, &info, &points).expect("written");
    let page = std::fs::read_to_string(dir.join("index.html")).expect("page");
    assert_eq!(page.matches("<svg").count(), 3, "hit rate, p90 TTFT, tok/s");
    for needle in [
        "4 sessions at once",
        "8 sessions at once",
        "cost-model",
        "least-load",
        "ideal with this capacity",
    ] {
        assert!(page.contains(needle), "{needle}");
    }
    let json = std::fs::read_to_string(dir.join("results.json")).expect("json");
    let json: Vec<serde_json::Value> = serde_json::from_str(&json).expect("a list");
    assert_eq!(json.len(), 4, "every run of every point");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Flow control offline: an overloaded pool (one small engine, many sessions) keeps the
/// critical band served while the sheddable band waits; every request is accounted for.
#[test]
fn flow_control_serves_the_critical_band_first_under_overload() {
    let w = generate(
        &GeneratorConfig {
            groups: 4,
            system_tokens: 1_500,
            session_rate: 40.0,
            duration_s: 10.0,
            turns: 2.0,
            user_tokens: 400,
            output_tokens: 64,
            think_ms: 500.0,
            ..GeneratorConfig::default()
        },
        5,
    );
    let mut opts = small_options();
    opts.cluster.engines = 1;
    // a small running batch: the engine's own queue grows without flow control
    opts.cluster.engine.max_num_seqs = 4;
    opts.critical_percent = 30;
    let plain = offline::run(&w, Strategy::CostModel, &opts, &mut |_, _| {}).expect("runs");
    opts.flow_control = true;
    opts.routing.saturation.queue_depth = 1;
    let flow = offline::run(&w, Strategy::CostModel, &opts, &mut |_, _| {}).expect("runs");
    let class = |run: &kvroute_bench::PolicyRun, name: &str| {
        run.detail
            .classes
            .iter()
            .find(|c| c.0 == name)
            .cloned()
            .unwrap_or_else(|| panic!("no {name} in {:?}", run.detail.classes))
    };
    let (crit_plain, crit_flow) = (class(&plain, "critical"), class(&flow, "critical"));
    let shed = class(&flow, "sheddable");
    // the same requests, all accounted for
    assert_eq!(crit_plain.1, crit_flow.1);
    assert_eq!(
        crit_flow.1 + shed.1,
        usize::try_from(flow.summary.requests).expect("fits")
    );
    // the critical band waits less with flow control, and less than the sheddable one
    assert!(
        crit_flow.4 < crit_plain.4,
        "{crit_flow:?} vs {crit_plain:?}"
    );
    assert!(crit_flow.4 < shed.4, "{crit_flow:?} vs {shed:?}");
}

/// Issue 19: prefill/decode disaggregation on the same engines. `Always` prefills every
/// prompt on the prefill engine and the decode engines only compute what the KV transfer
/// leaves (at most a block and a token per request); `Off` leaves the prefill engine idle;
/// every request completes either way, and the runs are deterministic.
#[test]
fn disaggregated_runs_prefill_on_the_prefill_engine_and_decode_elsewhere() {
    use kvroute_picker::config::DisaggregationMode;
    let w = small_workload();
    let mut opts = small_options();
    opts.cluster.prefill_engines = 1;
    opts.cluster.engine.kv_transfer_ms_per_block = 0.08;
    let run = |mode| {
        let mut opts = opts.clone();
        opts.routing.disaggregation.mode = mode;
        offline::run(&w, Strategy::CostModel, &opts, &mut |_, _| {}).expect("runs")
    };
    let aggregated =
        offline::run(&w, Strategy::CostModel, &small_options(), &mut |_, _| {}).expect("runs");
    let always = run(DisaggregationMode::Always);
    let off = run(DisaggregationMode::Off);
    for r in [&always, &off] {
        assert_eq!(r.summary.errors, 0, "{:?}", r.detail.error_samples);
        assert_eq!(r.summary.requests, aggregated.summary.requests);
    }
    let prefill = &always.detail.engine_prefill_tokens;
    let decode: f64 = prefill[1..].iter().sum();
    assert!(
        decode <= always.summary.requests as f64 * 17.0,
        "decode engines computed {decode} prompt tokens"
    );
    assert!(prefill[0] > 10.0 * decode, "{prefill:?}");
    assert_eq!(off.detail.engine_prefill_tokens[0], 0.0);
    let again = run(DisaggregationMode::Always);
    assert_eq!(
        serde_json::to_string(&always.summary).expect("json"),
        serde_json::to_string(&again.summary).expect("json")
    );
}
