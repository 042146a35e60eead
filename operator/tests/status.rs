//! Status computation: conditions, transition times, bounded lists, events on change only.

mod common;

use std::collections::BTreeMap;

use common::*;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kvroute_crds::kvroute_pool::{IneligibleReason, KVRoutePoolStatus, condition};
use kvroute_operator::eligibility::resolve;
use kvroute_operator::status::{
    GatewayState, Observed, PickerObserved, compute, new_misconfigurations, newly_invalid,
};

fn later() -> Time {
    Time(Timestamp::from_second(1_767_230_000).expect("time"))
}

fn picker(available: Option<i32>) -> PickerObserved {
    PickerObserved {
        service: "llama-picker".into(),
        desired_replicas: 1,
        available_replicas: available,
    }
}

fn status_with(
    pods: &[k8s_openapi::api::core::v1::Pod],
    previous: Option<KVRoutePoolStatus>,
    available: Option<i32>,
    now: &Time,
) -> KVRoutePoolStatus {
    let mut pool = mk_pool(base_spec());
    pool.status = previous;
    let resolved = resolve(&pool.spec, NS, pods);
    let names = BTreeMap::from([("llama".to_owned(), vec!["llama-llama-0".to_owned()])]);
    compute(
        &pool,
        &Observed {
            validity: Ok(()),
            resolved: &resolved,
            slice_names: &names,
            picker: picker(available),
            gateway: GatewayState::NotRequested,
        },
        now,
    )
}

#[test]
fn transition_times_move_only_when_a_condition_flips() {
    let up = [mk_pod("vllm-0").ip("10.0.0.1").ready().build()];
    let first = status_with(&up, None, Some(1), &fixed_time());
    assert_eq!(
        first.condition(condition::READY).map(|c| c.status.as_str()),
        Some("True")
    );
    let same = status_with(&up, Some(first.clone()), Some(1), &later());
    assert_eq!(
        same, first,
        "unchanged inputs, unchanged status: nothing to write"
    );
    let down = [mk_pod("vllm-0").ip("10.0.0.1").not_ready().build()];
    let flipped = status_with(&down, Some(first.clone()), Some(1), &later());
    let ready = flipped.condition(condition::READY).expect("ready");
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", "NoEligibleEndpoints")
    );
    assert_eq!(ready.last_transition_time, later());
    let valid = flipped.condition(condition::CONFIG_VALID).expect("valid");
    assert_eq!(valid.last_transition_time, fixed_time());
    assert_eq!(flipped.ready_endpoints, 0);
}

#[test]
fn picker_availability_is_reported() {
    let up = [mk_pod("vllm-0").ip("10.0.0.1").ready().build()];
    for (available, status, reason) in [
        (None, "False", "Pending"),
        (Some(0), "False", "Unavailable"),
        (Some(1), "True", "Available"),
    ] {
        let s = status_with(&up, None, available, &fixed_time());
        let c = s.condition(condition::PICKER_AVAILABLE).expect("picker");
        assert_eq!((c.status.as_str(), c.reason.as_str()), (status, reason));
    }
    // no in-cluster picker wanted: readiness does not wait for one
    let mut pool = mk_pool(base_spec());
    pool.spec.picker.replicas = 0;
    let resolved = resolve(&pool.spec, NS, &up);
    let s = compute(
        &pool,
        &Observed {
            validity: Ok(()),
            resolved: &resolved,
            slice_names: &BTreeMap::new(),
            picker: PickerObserved {
                desired_replicas: 0,
                ..picker(Some(0))
            },
            gateway: GatewayState::NotRequested,
        },
        &fixed_time(),
    );
    let c = s.condition(condition::PICKER_AVAILABLE).expect("picker");
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", "ScaledToZero")
    );
    let c = s.condition(condition::READY).expect("ready");
    assert_eq!((c.status.as_str(), c.reason.as_str()), ("True", "Ready"));
}

#[test]
fn ineligible_pods_are_counted_all_but_listed_at_most_32() {
    let pods: Vec<_> = (0..40)
        .map(|i| {
            mk_pod(&format!("p-{i:02}"))
                .ip("10.0.0.1")
                .not_ready()
                .build()
        })
        .collect();
    let s = status_with(&pods, None, Some(1), &fixed_time());
    let mc = &s.model_configs[0];
    assert_eq!(mc.ineligible_pods, 40);
    assert_eq!(mc.ineligible.len(), 32);
    assert_eq!(mc.ineligible[0].pod, "p-00");
}

#[test]
fn misconfigurations_are_announced_once() {
    let bad = [mk_pod("vllm-0")
        .ip("10.0.0.1")
        .ready()
        .label("kvroute.dev/engine", "sglang")
        .build()];
    let first = status_with(&bad, None, Some(1), &fixed_time());
    let news = new_misconfigurations(None, &first);
    assert_eq!(news.len(), 1);
    assert_eq!(news[0].1.reason, IneligibleReason::EngineMismatch);
    assert!(new_misconfigurations(Some(&first), &first).is_empty());
    // not-ready is a lifecycle state, not a misconfiguration
    let down = [mk_pod("vllm-0").ip("10.0.0.1").not_ready().build()];
    assert!(
        new_misconfigurations(None, &status_with(&down, None, Some(1), &fixed_time())).is_empty()
    );
}

#[test]
fn an_invalid_spec_keeps_the_last_counts() {
    let up = [mk_pod("vllm-0").ip("10.0.0.1").ready().build()];
    let good = status_with(&up, None, Some(1), &fixed_time());
    let mut pool = mk_pool(base_spec());
    pool.status = Some(good.clone());
    pool.metadata.generation = Some(2);
    let s = compute(
        &pool,
        &Observed {
            validity: Err("routing.weights: at least one weight must be positive".into()),
            resolved: &[],
            slice_names: &BTreeMap::new(),
            picker: picker(Some(1)),
            gateway: GatewayState::NotRequested,
        },
        &later(),
    );
    assert_eq!(s.model_configs, good.model_configs);
    assert_eq!(s.observed_generation, Some(2));
    assert!(newly_invalid(Some(&good), &s));
    assert!(!newly_invalid(Some(&s), &s));
    let names: Vec<&str> = s.conditions.iter().map(|c| c.type_.as_str()).collect();
    assert_eq!(
        names,
        [
            "Ready",
            "ConfigValid",
            "EndpointsResolved",
            "PickerAvailable"
        ]
    );
}
