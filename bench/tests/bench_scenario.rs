//! Scenario events in the offline replay: each kind does what it says to the engines, the
//! picker's view and its inputs, and the per-phase report counts what it cost.

mod common;

use common::{small_options, small_workload};
use kvroute_bench::scenario::Scenario;
use kvroute_bench::{BenchOptions, PolicyRun, offline};
use kvroute_picker::config::Strategy;

fn options(scenario: &str) -> BenchOptions {
    BenchOptions {
        scenario: Scenario::parse(scenario).expect("scenario"),
        ..small_options()
    }
}

fn workload() -> kvroute_bench::workload::Workload {
    small_workload()
}

fn run(strategy: Strategy, scenario: &str) -> PolicyRun {
    offline::run(&workload(), strategy, &options(scenario), &mut |_, _| {}).expect("runs")
}

fn errors_saying(r: &PolicyRun, what: &str) -> usize {
    r.detail
        .error_samples
        .iter()
        .filter(|e| e.contains(what))
        .count()
}

#[test]
fn no_scenario_no_phases_and_an_event_after_the_run_changes_nothing() {
    let plain = run(Strategy::CostModel, "");
    assert!(plain.detail.phases.is_empty());
    let late = run(
        Strategy::CostModel,
        "stale-metrics@5000:for=10; event-loss@5000:fraction=1,for=10",
    );
    assert_eq!(plain.summary, late.summary);
    assert_eq!(late.detail.phases.len(), 1, "{:?}", late.detail.phases);
    assert_eq!(late.detail.phases[0].requests as u64, late.summary.requests);
}

#[test]
fn scale_out_keeps_the_last_engines_out_until_they_join() {
    let never = run(Strategy::LeastLoad, "scale-out@5000:n=1");
    let p = &never.detail.engine_prefill_tokens;
    assert_eq!(p.len(), 4);
    assert_eq!(p[3], 0.0, "out of the pool for the whole run: {p:?}");
    assert!(p[..3].iter().all(|&t| t > 0.0), "{p:?}");
    let joins = run(Strategy::LeastLoad, "scale-out@10:n=2");
    let p = &joins.detail.engine_prefill_tokens;
    assert!(p.iter().all(|&t| t > 0.0), "both joined at 10 s: {p:?}");
    assert!(
        p[2] < p[0] && p[3] < p[0],
        "they missed the first half: {p:?}"
    );
    assert_eq!(joins.summary.errors, 0);
    let labels: Vec<&str> = joins
        .detail
        .phases
        .iter()
        .map(|p| p.label.as_str())
        .collect();
    assert_eq!(labels, vec!["start", "scale-out@10:n=2"]);
}

#[test]
fn replace_fails_the_dead_engines_requests_and_a_new_endpoint_takes_over() {
    // least-load: the cold replacement gets its share at once (the cost model may keep the
    // sessions where their prefixes went in the meantime)
    let r = run(Strategy::LeastLoad, "replace@8:engine=1,after=2");
    let p = &r.detail.engine_prefill_tokens;
    assert_eq!(p.len(), 5, "the replacement is a fifth endpoint: {p:?}");
    assert!(p[4] > 0.0, "the replacement served: {p:?}");
    assert!(p[1] < p[0], "engine 1 served until 8 s only: {p:?}");
    assert!(r.summary.errors > 0, "requests were on engine 1 at 8 s");
    assert_eq!(
        errors_saying(&r, "the engine died"),
        r.detail.error_samples.len()
    );
    let phases = &r.detail.phases;
    assert_eq!(phases.len(), 3, "{phases:?}");
    // only requests released before the death can have been on the dead engine
    assert_eq!(phases[1].errors + phases[2].errors, 0, "{phases:?}");
    assert_eq!(phases[0].errors as u64, r.summary.errors);
    assert_eq!(
        phases.iter().map(|p| p.requests as u64).sum::<u64>(),
        r.summary.requests
    );
}

#[test]
fn restart_fails_its_requests_and_the_engine_comes_back_empty() {
    let plain = run(Strategy::CostModel, "");
    let total = |r: &PolicyRun| r.detail.engine_prefill_tokens.iter().sum::<f64>();
    // each engine in turn: the ones that had requests in flight at 8 s lose them
    let mut restarted_busy = 0;
    for engine in 0..4 {
        let r = run(
            Strategy::CostModel,
            &format!("restart@8:engine={engine},down=2"),
        );
        assert_eq!(r.detail.engine_prefill_tokens.len(), 4, "same endpoint");
        assert_eq!(
            errors_saying(&r, "the engine restarted"),
            r.detail.error_samples.len()
        );
        assert_eq!(r.summary.requests, plain.summary.requests);
        assert!(r.detail.engine_prefill_tokens[engine] > 0.0, "it served");
        assert!(total(&r) > 0.0);
        if r.summary.errors == 0 {
            continue;
        }
        restarted_busy += 1;
        // its cache is gone: more prompt tokens are prefilled again
        assert!(
            r.summary.hit_rate < plain.summary.hit_rate,
            "engine {engine}: {} vs {}",
            r.summary.hit_rate,
            plain.summary.hit_rate
        );
    }
    assert!(
        restarted_busy > 0,
        "no engine had a request in flight at 8 s"
    );
}

#[test]
fn lost_or_late_events_cost_the_cache_aware_policy_its_hits() {
    let plain = run(Strategy::CostModel, "");
    let lost = run(Strategy::CostModel, "event-loss@0:fraction=1,for=1000");
    let late = run(Strategy::CostModel, "event-delay@0:ms=100000,for=1000");
    let none_lost = run(Strategy::CostModel, "event-loss@0:fraction=0,for=1000");
    assert_eq!(
        none_lost.summary, plain.summary,
        "a fraction of 0 loses nothing"
    );
    for (what, r) in [("lost", &lost), ("late", &late)] {
        assert_eq!(r.summary.errors, 0);
        // (session pins and provisional credit keep most of it on this small workload)
        assert!(
            r.summary.hit_rate < plain.summary.hit_rate,
            "{what}: hit {} vs {}",
            r.summary.hit_rate,
            plain.summary.hit_rate
        );
    }
    // a short delay only postpones: most hits stay
    let short = run(Strategy::CostModel, "event-delay@0:ms=50,for=1000");
    assert!(
        short.summary.hit_rate > lost.summary.hit_rate,
        "{} vs {}",
        short.summary.hit_rate,
        lost.summary.hit_rate
    );
}

#[test]
fn stale_metrics_change_load_decisions_only_while_they_last() {
    let plain = run(Strategy::LeastLoad, "");
    let stale = run(Strategy::LeastLoad, "stale-metrics@2:for=15");
    assert_ne!(plain.summary, stale.summary, "least-load reads the scrapes");
    assert_eq!(stale.summary.errors, 0);
    let phases = &stale.detail.phases;
    assert_eq!(phases.len(), 3, "{phases:?}");
    assert_eq!(phases[1].label, "stale-metrics@2:for=15");
    assert_eq!(phases[2].label, "end of stale-metrics");
}

#[test]
fn a_picker_restart_fails_what_it_held_and_replay_brings_back_hits() {
    let none = run(Strategy::CostModel, "picker-restart@10");
    let replayed = run(Strategy::CostModel, "picker-restart@10:replay=1000");
    for r in [&none, &replayed] {
        assert!(r.summary.errors > 0, "requests were in flight at 10 s");
        assert_eq!(
            errors_saying(r, "the picker restarted"),
            r.detail.error_samples.len()
        );
        let phases = &r.detail.phases;
        assert_eq!(phases.len(), 2);
        assert_eq!(phases[1].errors, 0, "nothing released after it fails");
    }
    // the same requests were cut off; the replayed index credits the engines' caches at once
    assert_eq!(none.summary.errors, replayed.summary.errors);
    let after = |r: &PolicyRun| r.detail.phases[1].hit_rate;
    assert!(
        after(&replayed) > after(&none),
        "hit after the restart: replayed {} vs none {}",
        after(&replayed),
        after(&none)
    );
}

fn run_pickers(strategy: Strategy, pickers: usize, scenario: &str) -> PolicyRun {
    let opts = BenchOptions {
        pickers,
        ..options(scenario)
    };
    offline::run(&workload(), strategy, &opts, &mut |_, _| {}).expect("runs")
}

#[test]
fn several_pickers_share_the_requests_and_each_indexes_every_engine() {
    let one = run_pickers(Strategy::CostModel, 1, "");
    let four = run_pickers(Strategy::CostModel, 4, "");
    assert_eq!(four.summary.requests, one.summary.requests);
    assert_eq!(four.summary.errors, 0);
    assert_ne!(four.summary, one.summary, "four pickers decide apart");
    // a picker that saw no events would route its share blind to the caches
    let blind = run_pickers(Strategy::CostModel, 4, "event-loss@0:fraction=1,for=1000");
    assert!(four.summary.hit_rate > blind.summary.hit_rate);
    // a restart of one of two pickers cuts off only the requests that one held
    let restart_one = run_pickers(Strategy::CostModel, 1, "picker-restart@10");
    let restart_two = run_pickers(Strategy::CostModel, 2, "picker-restart@10");
    assert!(restart_two.summary.errors > 0);
    assert!(restart_two.summary.errors < restart_one.summary.errors);
}
