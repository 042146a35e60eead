//! Eligibility and DP expansion, on pods that flap, lose their IP, start terminating and
//! change labels.

mod common;

use common::*;
use k8s_openapi::api::core::v1::Pod;
use kvroute_crds::kvroute_pool::IneligibleReason;
use kvroute_operator::eligibility::{Conditions, ConfigEndpoints, resolve, strip_pod};
use serde_json::json;

fn resolve_one(pods: &[Pod]) -> ConfigEndpoints {
    let pool = mk_pool(base_spec());
    let mut r = resolve(&pool.spec, NS, pods);
    assert_eq!(r.len(), 1);
    r.remove(0)
}

fn reasons(c: &ConfigEndpoints) -> Vec<(String, IneligibleReason)> {
    c.ineligible
        .iter()
        .map(|p| (p.pod.clone(), p.reason))
        .collect()
}

const READY: Conditions = Conditions {
    ready: true,
    serving: true,
    terminating: false,
};

#[test]
fn ready_pods_with_an_ip_are_eligible_and_listed_by_name() {
    let c = resolve_one(&[
        mk_pod("vllm-1").ip("10.0.0.2").ready().build(),
        mk_pod("vllm-0").ip("10.0.0.1").ready().build(),
    ]);
    assert_eq!(c.eligible_pods, 2);
    assert!(c.ineligible.is_empty());
    let names: Vec<_> = c.listed.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["vllm-0", "vllm-1"]);
    assert_eq!(c.listed[0].conditions, READY);
    assert_eq!(c.listed[0].node_name.as_deref(), Some("node-a"));
    assert_eq!(c.listed[0].uid.as_deref(), Some("uid-vllm-0"));
}

#[test]
fn a_flapping_pod_stays_listed_but_is_only_eligible_while_ready() {
    let up = mk_pod("vllm-0").ip("10.0.0.1").ready();
    let down = up.clone().not_ready();
    for (pod, eligible) in [(up.clone(), true), (down, false), (up, true)] {
        let c = resolve_one(&[pod.build()]);
        assert_eq!(c.eligible_pods, u32::from(eligible));
        assert_eq!(c.listed.len(), 1, "listed while flapping: caches survive");
        assert_eq!(c.listed[0].conditions.ready, eligible);
        assert!(!c.listed[0].conditions.terminating);
        if !eligible {
            assert_eq!(reasons(&c), [("vllm-0".into(), IneligibleReason::NotReady)]);
            assert!(!c.listed[0].conditions.serving);
        }
    }
}

#[test]
fn a_pod_that_loses_its_ip_is_dropped() {
    let c = resolve_one(&[mk_pod("vllm-0").ip("10.0.0.1").ready().build()]);
    assert_eq!(c.listed.len(), 1);
    let c = resolve_one(&[mk_pod("vllm-0").no_ip().ready().build()]);
    assert!(c.listed.is_empty());
    assert_eq!(
        reasons(&c),
        [("vllm-0".into(), IneligibleReason::NoAddress)]
    );
    let c = resolve_one(&[mk_pod("vllm-0").ip("not-an-ip").ready().build()]);
    assert!(c.listed.is_empty());
    assert_eq!(
        reasons(&c),
        [("vllm-0".into(), IneligibleReason::NoAddress)]
    );
}

#[test]
fn a_terminating_pod_is_listed_as_terminating_until_it_goes() {
    let c = resolve_one(&[mk_pod("vllm-0")
        .ip("10.0.0.1")
        .ready()
        .terminating()
        .build()]);
    assert_eq!(c.eligible_pods, 0);
    assert_eq!(
        reasons(&c),
        [("vllm-0".into(), IneligibleReason::Terminating)]
    );
    assert_eq!(
        c.listed[0].conditions,
        Conditions {
            ready: false,
            serving: true,
            terminating: true
        }
    );
    let c = resolve_one(&[mk_pod("vllm-0")
        .ip("10.0.0.1")
        .not_ready()
        .terminating()
        .build()]);
    assert!(!c.listed[0].conditions.serving);
    // gone from the cache: gone from the set
    let c = resolve_one(&[]);
    assert!(c.listed.is_empty() && c.ineligible.is_empty());
}

#[test]
fn finished_pods_are_not_listed() {
    let c = resolve_one(&[mk_pod("job")
        .ip("10.0.0.1")
        .not_ready()
        .phase("Succeeded")
        .build()]);
    assert!(c.listed.is_empty());
    assert_eq!(reasons(&c), [("job".into(), IneligibleReason::NotReady)]);
}

#[test]
fn label_changes_move_pods_in_and_out_of_the_pool_and_its_configs() {
    let c = resolve_one(&[mk_pod("vllm-0")
        .ip("10.0.0.1")
        .ready()
        .without_label("app")
        .build()]);
    assert!(
        c.listed.is_empty() && c.ineligible.is_empty(),
        "not selected at all"
    );
    let c = resolve_one(&[mk_pod("vllm-0")
        .ip("10.0.0.1")
        .ready()
        .namespace("other")
        .build()]);
    assert!(c.listed.is_empty(), "other namespaces are not the pool's");

    let mut spec = base_spec();
    spec["modelConfigs"][0]["podSelector"] = json!({"tier": "a"});
    spec["modelConfigs"]
        .as_array_mut()
        .expect("array")
        .push(json!({"name": "mistral", "model": "mistral", "podSelector": {"tier": "b"}}));
    let pool = mk_pool(spec);
    let pods = [
        mk_pod("a-0")
            .ip("10.0.0.1")
            .ready()
            .label("tier", "a")
            .build(),
        mk_pod("b-0")
            .ip("10.0.0.2")
            .ready()
            .label("tier", "b")
            .build(),
    ];
    let r = resolve(&pool.spec, NS, &pods);
    assert_eq!(
        r[0].listed
            .iter()
            .map(|p| p.name.as_str())
            .collect::<Vec<_>>(),
        ["a-0"]
    );
    assert_eq!(
        r[1].listed
            .iter()
            .map(|p| p.name.as_str())
            .collect::<Vec<_>>(),
        ["b-0"]
    );
    // relabelled from tier a to tier b
    let pods = [mk_pod("a-0")
        .ip("10.0.0.1")
        .ready()
        .label("tier", "b")
        .build()];
    let r = resolve(&pool.spec, NS, &pods);
    assert!(r[0].listed.is_empty());
    assert_eq!(r[1].listed.len(), 1);
}

#[test]
fn declared_configurations_must_match() {
    let base = || mk_pod("vllm-0").ip("10.0.0.1").ready();
    let cases = [
        (
            base().annotation("kvroute.dev/model", "mistralai/Mistral-7B"),
            IneligibleReason::ModelMismatch,
            "expects \"meta-llama/Llama-3.1-8B-Instruct\"",
        ),
        (
            base().label("kvroute.dev/engine", "sglang"),
            IneligibleReason::EngineMismatch,
            "expects vllm",
        ),
        (
            base().label("kvroute.dev/engine", "ollama"),
            IneligibleReason::InvalidDeclaration,
            "not one of",
        ),
        (
            base().label("kvroute.dev/dp-size", "4"),
            IneligibleReason::DataParallelMismatch,
            "data-parallel size 4",
        ),
        (
            base().annotation("kvroute.dev/block-size", "32"),
            IneligibleReason::BlockSizeMismatch,
            "block size 32",
        ),
        (
            base().label("kvroute.dev/dp-size", "two"),
            IneligibleReason::InvalidDeclaration,
            "not a non-negative integer",
        ),
    ];
    for (pod, reason, needle) in cases {
        let c = resolve_one(&[pod.build()]);
        assert_eq!(c.eligible_pods, 0);
        assert!(c.listed.is_empty(), "incompatible pods are never listed");
        assert_eq!(c.ineligible[0].reason, reason);
        assert!(
            c.ineligible[0].message.contains(needle),
            "{}",
            c.ineligible[0].message
        );
    }
    // matching declarations, annotation winning over label
    let ok = base()
        .annotation("kvroute.dev/model", "meta-llama/Llama-3.1-8B-Instruct")
        .label("kvroute.dev/engine", "vllm")
        .label("kvroute.dev/dp-size", "2")
        .label("kvroute.dev/block-size", "8")
        .annotation("kvroute.dev/block-size", "16");
    assert_eq!(resolve_one(&[ok.build()]).eligible_pods, 1);
    // a misconfigured pod is reported even while it is not ready
    let c = resolve_one(&[base()
        .not_ready()
        .label("kvroute.dev/engine", "sglang")
        .build()]);
    assert_eq!(c.ineligible[0].reason, IneligibleReason::EngineMismatch);
}

#[test]
fn tenant_label_keys_are_projected_for_dedicated_endpoints() {
    let mut spec = base_spec();
    spec["tenancy"] = json!({
        "isolation": "DedicatedEndpoints",
        "header": "x-tenant",
        "tenants": [{"name": "a", "podSelector": {"tenant": "a"}}]
    });
    let pool = mk_pool(spec);
    let pods = [mk_pod("vllm-0")
        .ip("10.0.0.1")
        .ready()
        .label("tenant", "a")
        .label("unrelated", "x")
        .build()];
    let r = resolve(&pool.spec, NS, &pods);
    assert_eq!(
        r[0].listed[0].labels,
        [("tenant".to_owned(), "a".to_owned())].into()
    );
    let r = resolve(&mk_pool(base_spec()).spec, NS, &pods);
    assert!(r[0].listed[0].labels.is_empty());
}

#[test]
fn stripped_pods_keep_what_eligibility_reads() {
    let mut pod = mk_pod("vllm-0")
        .ip("10.0.0.1")
        .ready()
        .annotation("kvroute.dev/model", "m")
        .build();
    pod.spec.as_mut().expect("spec").containers = vec![Default::default()];
    let before = resolve_one(std::slice::from_ref(&pod));
    strip_pod(&mut pod);
    assert!(pod.spec.as_ref().expect("spec").containers.is_empty());
    assert_eq!(resolve_one(&[pod]), before);
}

#[test]
fn pod_events_map_to_the_pools_they_affect() {
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    use kube::runtime::reflector::ObjectRef;
    use kvroute_operator::controller::pools_for_pod;

    let pool = mk_pool(base_spec());
    let mut other = mk_pool(json!({
        "selector": {"matchLabels": {"app": "sglang"}},
        "modelConfigs": [{"name": "qwen", "model": "q"}]
    }));
    other.metadata.name = Some("qwen".into());
    let pools = store_of([pool.clone(), other]);
    let listed = mk_pod("vllm-0").ip("10.0.0.1").ready().build();
    let resolved = resolve(&pool.spec, NS, std::slice::from_ref(&listed));
    let desired =
        kvroute_operator::desired::build(&pool, &resolved, &Default::default()).expect("build");
    let slices = store_of::<EndpointSlice>(desired.slices);
    let llama = ObjectRef::new("llama").within(NS);

    assert_eq!(
        pools_for_pod(&listed, &pools, &slices),
        std::slice::from_ref(&llama)
    );
    // relabelled away from the pool: still maps there, through the slice that lists it
    let relabelled = mk_pod("vllm-0")
        .ip("10.0.0.1")
        .ready()
        .label("app", "sglang")
        .build();
    let mut got = pools_for_pod(&relabelled, &pools, &slices);
    got.sort_by_key(|r| r.name.clone());
    assert_eq!(got, [llama, ObjectRef::new("qwen").within(NS)]);
    // another namespace: nothing
    let elsewhere = mk_pod("vllm-0").ip("10.0.0.1").namespace("other").build();
    assert!(pools_for_pod(&elsewhere, &pools, &slices).is_empty());
}

#[test]
fn roles_come_from_either_label_are_counted_and_ride_along_for_the_pickers() {
    use kvroute_crds::Role;
    let c = resolve_one(&[
        mk_pod("p-0")
            .ip("10.0.0.1")
            .ready()
            .label("llm-d.ai/role", "prefill")
            .build(),
        mk_pod("d-0")
            .ip("10.0.0.2")
            .ready()
            .label("kvroute.dev/role", "decode")
            .label("llm-d.ai/role", "prefill")
            .build(),
        mk_pod("w-0").ip("10.0.0.3").ready().build(),
        // not ready: listed, not counted
        mk_pod("p-1")
            .ip("10.0.0.4")
            .not_ready()
            .label("llm-d.ai/role", "prefill")
            .build(),
    ]);
    assert_eq!(c.eligible_pods, 3);
    assert_eq!(
        (
            c.eligible_by_role.prefill,
            c.eligible_by_role.decode,
            c.eligible_by_role.both
        ),
        (1, 1, 1)
    );
    let role = |name: &str| c.listed.iter().find(|p| p.name == name).map(|p| p.role);
    assert_eq!(role("p-0"), Some(Role::Prefill));
    // kvroute's own label wins over llm-d's
    assert_eq!(role("d-0"), Some(Role::Decode));
    assert_eq!(role("w-0"), Some(Role::Both));
    let d = c.listed.iter().find(|p| p.name == "d-0").expect("listed");
    assert_eq!(
        d.labels.len(),
        2,
        "both role labels projected: {:?}",
        d.labels
    );
}

#[test]
fn a_role_label_with_another_value_makes_the_pod_ineligible_naming_the_label() {
    let c = resolve_one(&[mk_pod("p-0")
        .ip("10.0.0.1")
        .ready()
        .label("llm-d.ai/role", "prefil")
        .build()]);
    assert_eq!(c.eligible_pods, 0);
    assert_eq!(
        reasons(&c),
        [("p-0".into(), IneligibleReason::InvalidDeclaration)]
    );
    assert!(
        c.ineligible[0].message.contains("llm-d.ai/role"),
        "{}",
        c.ineligible[0].message
    );
}
