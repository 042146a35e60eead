//! One short live replay: two simulated engines in a child process, the picker in another,
//! streaming requests over loopback. Seconds, not minutes.

#![allow(clippy::unwrap_used)]

use kvroute_bench::cli::{Mode, run_policies_with};
use kvroute_bench::live;
use kvroute_bench::workload::generated::{GeneratorConfig, generate};
use kvroute_bench::{BenchOptions, ClusterConfig};
use kvroute_picker::config::Strategy;

fn small_workload() -> kvroute_bench::workload::Workload {
    generate(
        &GeneratorConfig {
            groups: 2,
            system_tokens: 600,
            session_rate: 8.0,
            duration_s: 3.0,
            turns: 3.0,
            user_tokens: 120,
            output_tokens: 8,
            think_ms: 200.0,
            ..GeneratorConfig::default()
        },
        5,
    )
}

/// Two engines, fast enough for a test.
fn small_cluster() -> ClusterConfig {
    let mut cluster = ClusterConfig {
        engines: 2,
        speedup: 2.0,
        ..ClusterConfig::default()
    };
    cluster.engine.num_blocks = 4_096;
    cluster
}

/// One live run of the cost model over `w`, within two minutes.
async fn live_cost_model(
    w: &kvroute_bench::workload::Workload,
    opts: &BenchOptions,
) -> Vec<kvroute_bench::PolicyRun> {
    let exe = std::path::Path::new(env!("CARGO_BIN_EXE_kvroute-bench"));
    tokio::time::timeout(
        std::time::Duration::from_secs(120),
        run_policies_with(
            exe,
            w,
            Mode::Live,
            &[Strategy::CostModel.into()],
            opts,
            true,
        ),
    )
    .await
    .expect("finishes in time")
    .expect("runs")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_live_replay_has_no_errors_and_a_sane_report() {
    let w = small_workload();
    let cluster = small_cluster();
    let opts = BenchOptions {
        cluster,
        max_requests: Some(50),
        ..BenchOptions::default()
    };
    let runs = live_cost_model(&w, &opts).await;
    let s = &runs[0].summary;
    assert_eq!(s.errors, 0, "{:?}", runs[0].detail.error_samples);
    assert!(s.requests >= 40 && s.requests <= 50, "{}", s.requests);
    assert!(s.ttft_ms_p50 > 0.0 && s.ttft_ms_p50 <= s.ttft_ms_p99);
    assert!(s.e2e_ms_p50 >= s.ttft_ms_p50);
    assert!(s.output_tok_s > 0.0);
    assert!(
        s.hit_rate > 0.0 && s.hit_rate <= 1.0,
        "engines reported their cache hits: {}",
        s.hit_rate
    );
    assert!(s.hit_rate_ceiling > 0.0);
    assert!(
        s.decision_us_p99.is_some_and(|d| d > 0.0),
        "the picker's histogram was read"
    );
}

/// The null router (`--router direct`): requests go straight to the engines, round robin,
/// with no router process and no decision timing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_replay_spreads_requests_over_the_engines_without_a_router() {
    let w = small_workload();
    let cluster = small_cluster();
    let opts = BenchOptions {
        cluster: cluster.clone(),
        max_requests: Some(40),
        ..BenchOptions::default()
    };
    let exe = std::path::Path::new(env!("CARGO_BIN_EXE_kvroute-bench"));
    let (guard, engines) = live::start_engines(exe, &cluster, 7, "direct")
        .await
        .expect("engines start");
    let target = live::Target {
        router: live::DIRECT.into(),
        pickers: None,
        name: "direct".into(),
        picker_metrics: None,
        engines: engines.engines.clone(),
    };
    let http = live::http_client().unwrap();
    let run = tokio::time::timeout(
        std::time::Duration::from_secs(120),
        live::replay(&w, &target, &opts, &http, &|_, _, _| {}),
    )
    .await
    .expect("finishes in time")
    .expect("runs");
    // round robin by request id: each engine received prompts
    for e in &engines.engines {
        let text = kvroute_testkit::get_text(&http, format!("http://{}/metrics", e.http)).await;
        let prompt_tokens: f64 = live::prom::engine_counters(&text)
            .values()
            .map(|c| c.prompt_tokens)
            .sum();
        assert!(prompt_tokens > 0.0, "engine {} got no request", e.http);
    }
    guard.stop().await;
    let s = &run.summary;
    assert_eq!(s.errors, 0, "{:?}", run.detail.error_samples);
    assert!(s.requests >= 30 && s.requests <= 40, "{}", s.requests);
    assert!(s.decision_us_p99.is_none(), "no router, no decisions");
}

/// The overload scenario's classes in live mode: each request carries its band and tenant in
/// the picker's flow-control headers (flow control on), and the report has per-class figures
/// that add up to the run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_replay_reports_bands_and_tenants_through_flow_control() {
    let w = small_workload();
    let mut opts = BenchOptions {
        cluster: small_cluster(),
        max_requests: Some(40),
        flow_control: true,
        critical_percent: 30,
        two_tenants: true,
        ..BenchOptions::default()
    };
    opts.routing.flow_control.enabled = true;
    let runs = live_cost_model(&w, &opts).await;
    let run = &runs[0];
    assert_eq!(run.summary.errors, 0, "{:?}", run.detail.error_samples);
    let classes = &run.detail.classes;
    assert!(!classes.is_empty());
    assert_eq!(
        classes.iter().map(|c| c.1 as u64).sum::<u64>(),
        run.summary.requests,
        "{classes:?}"
    );
    assert!(
        classes.iter().all(
            |c| (c.0.starts_with("critical") || c.0.starts_with("sheddable"))
                && c.0.ends_with("tenant")
        ),
        "{classes:?}"
    );
}

/// A live timeline: two pickers, the first killed and started again with an empty state (no
/// replay), then an engine closed and back empty. The run goes on through both, every item
/// is played (a fault the engines refuse or a picker that does not come back fails the run),
/// and the report cuts the run at the items.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_timeline_restarts_a_picker_and_an_engine_and_reports_each_phase() {
    let w = small_workload();
    let scenario =
        kvroute_bench::scenario::Scenario::parse("picker-restart@1; restart@2:engine=1,down=1")
            .unwrap();
    let opts = BenchOptions {
        cluster: small_cluster(),
        max_requests: Some(60),
        pickers: 2,
        scenario,
        ..BenchOptions::default()
    };
    let runs = live_cost_model(&w, &opts).await;
    let d = &runs[0].detail;
    let labels: Vec<&str> = d.phases.iter().map(|p| p.label.as_str()).collect();
    assert_eq!(
        labels,
        vec![
            "start",
            "picker-restart@1",
            "restart@2:engine=1,down=1",
            "end of restart"
        ],
        "{:?}",
        d.phases
    );
    let released: usize = d.phases.iter().map(|p| p.requests).sum();
    let released = released as u64;
    assert_eq!(released, runs[0].summary.requests);
    // after the restarts the cluster serves again, from caches the new picker learns anew
    let last = d.phases.last().unwrap();
    assert!(last.requests > last.errors, "{last:?}");
    assert!(last.hit_rate > 0.0, "{last:?}");
    assert_eq!(d.recoveries.len(), 2);
    assert!(
        runs[0].summary.errors * 2 < runs[0].summary.requests,
        "only what was in flight fails: {:?}",
        d.error_samples
    );
}

/// A picker restart kills the process and starts another: a new address, metrics from zero,
/// and it serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_picker_is_a_new_process_that_serves() {
    let exe = std::path::Path::new(env!("CARGO_BIN_EXE_kvroute-bench"));
    let cluster = small_cluster();
    let opts = BenchOptions {
        cluster: cluster.clone(),
        ..BenchOptions::default()
    };
    let (guard, engines) = live::start_engines(exe, &cluster, 3, "restart")
        .await
        .expect("engines start");
    let http = live::http_client().unwrap();
    let pickers = live::pickers::LivePickers::start(
        exe.to_path_buf(),
        &opts,
        Strategy::CostModel.into(),
        engines,
        &http,
        1,
    )
    .await
    .expect("picker starts");
    let complete = |base: std::sync::Arc<str>| {
        let http = http.clone();
        async move {
            http.post(format!("{base}/v1/completions"))
                .json(&serde_json::json!({"model": kvroute_bench::MODEL, "prompt": [1, 2, 3], "max_tokens": 2}))
                .send()
                .await
                .map(|r| r.status())
        }
    };
    let decisions = |m: std::net::SocketAddr| {
        let http = http.clone();
        async move {
            let text = kvroute_testkit::get_text(&http, format!("http://{m}/metrics")).await;
            kvroute_testkit::metric_sum(&text, "kvroute_picker_decisions_total", &[])
        }
    };
    let before = pickers.url(0).await.expect("up");
    let (m, restarted) = pickers.metrics(0).await.expect("running");
    assert!(!restarted);
    assert!(complete(before.clone()).await.unwrap().is_success());
    assert_eq!(
        decisions(m).await,
        1.0,
        "the first picker placed the request"
    );
    pickers.restart(0, false).await.expect("restarts");
    let after = pickers.url(0).await.expect("up again");
    let (m, restarted) = pickers.metrics(0).await.expect("running again");
    assert!(restarted);
    // a new process, whatever port it got: it has placed nothing yet, then it serves
    assert_eq!(decisions(m).await, 0.0, "a fresh picker's counters");
    assert!(complete(after).await.unwrap().is_success());
    assert_eq!(decisions(m).await, 1.0);
    pickers.stop().await;
    guard.stop().await;
}
