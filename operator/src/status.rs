//! The pool's status from what the operator observed. Pure: the reconciler writes the result
//! only when it differs from the current status.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kvroute_crds::kvroute_pool::{
    IneligiblePod, KVRoutePool, KVRoutePoolStatus, MAX_LISTED_INELIGIBLE, ModelConfigStatus,
    PickerStatus, condition,
};

use crate::eligibility::ConfigEndpoints;

/// The picker Deployment as observed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PickerObserved {
    pub service: String,
    pub desired_replicas: i32,
    /// `None` while the Deployment does not exist yet.
    pub available_replicas: Option<i32>,
}

/// The outcome of the Gateway API Inference Extension export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GatewayState {
    NotRequested,
    /// Exported pools, by name.
    Exported(Vec<String>),
    /// The `inference.networking.k8s.io/v1` InferencePool CRD is not installed.
    CrdMissing,
}

/// Everything a status is computed from.
#[derive(Debug, Clone)]
pub struct Observed<'a> {
    /// `Err(message)`: the spec is invalid; nothing was applied.
    pub validity: Result<(), String>,
    pub resolved: &'a [ConfigEndpoints],
    pub slice_names: &'a BTreeMap<String, Vec<String>>,
    pub picker: PickerObserved,
    pub gateway: GatewayState,
}

struct Conditions<'a> {
    previous: Option<&'a KVRoutePoolStatus>,
    generation: Option<i64>,
    now: &'a Time,
    out: Vec<Condition>,
}

impl Conditions<'_> {
    /// Add a condition, keeping the previous transition time when its status is unchanged.
    fn set(&mut self, type_: &str, ok: bool, reason: &str, message: String) {
        let status = if ok { "True" } else { "False" };
        let last_transition_time = self
            .previous
            .and_then(|p| p.condition(type_))
            .filter(|c| c.status == status)
            .map_or_else(|| self.now.clone(), |c| c.last_transition_time.clone());
        self.out.push(Condition {
            type_: type_.to_owned(),
            status: status.to_owned(),
            reason: reason.to_owned(),
            message,
            observed_generation: self.generation,
            last_transition_time,
        });
    }
}

fn model_config_status(
    pool: &KVRoutePool,
    c: &ConfigEndpoints,
    slice_names: &BTreeMap<String, Vec<String>>,
) -> ModelConfigStatus {
    let dp = pool
        .spec
        .model_configs
        .iter()
        .find(|m| m.name == c.name)
        .map_or(1, |m| m.data_parallel.size);
    let mut ineligible: Vec<IneligiblePod> = c.ineligible.clone();
    ineligible.sort_by(|a, b| a.pod.cmp(&b.pod));
    ineligible.truncate(MAX_LISTED_INELIGIBLE);
    ModelConfigStatus {
        name: c.name.clone(),
        eligible_pods: c.eligible_pods,
        eligible_ranks: c.eligible_pods.saturating_mul(dp),
        eligible_pods_by_role: c.eligible_by_role,
        ineligible_pods: u32::try_from(c.ineligible.len()).unwrap_or(u32::MAX),
        ineligible,
        endpoint_slices: slice_names.get(&c.name).cloned().unwrap_or_default(),
    }
}

/// The status the pool should have.
pub fn compute(pool: &KVRoutePool, observed: &Observed<'_>, now: &Time) -> KVRoutePoolStatus {
    let previous = pool.status.as_ref();
    let generation = pool.metadata.generation;
    let mut conds = Conditions {
        previous,
        generation,
        now,
        out: Vec::new(),
    };
    if let Err(msg) = &observed.validity {
        // nothing was applied: keep what the last valid spec produced, flag the spec
        let mut status = previous.cloned().unwrap_or_default();
        conds.set(
            condition::READY,
            false,
            "ConfigInvalid",
            "the spec is invalid; the last valid configuration stays in force".into(),
        );
        conds.set(condition::CONFIG_VALID, false, "InvalidSpec", msg.clone());
        for keep in [
            condition::ENDPOINTS_RESOLVED,
            condition::PICKER_AVAILABLE,
            condition::GATEWAY_EXPORTED,
        ] {
            if let Some(c) = previous.and_then(|p| p.condition(keep)) {
                conds.out.push(c.clone());
            }
        }
        status.observed_generation = generation;
        status.conditions = conds.out;
        return status;
    }

    let model_configs: Vec<ModelConfigStatus> = observed
        .resolved
        .iter()
        .map(|c| model_config_status(pool, c, observed.slice_names))
        .collect();
    let ready_endpoints = model_configs
        .iter()
        .fold(0u32, |acc, m| acc.saturating_add(m.eligible_ranks));
    let empty: Vec<&str> = model_configs
        .iter()
        .filter(|m| m.eligible_pods == 0)
        .map(|m| m.name.as_str())
        .collect();
    let resolved_ok = empty.is_empty();
    let resolved_msg = if resolved_ok {
        format!(
            "{ready_endpoints} endpoints over {} model config(s)",
            model_configs.len()
        )
    } else {
        format!("no eligible pods for model config(s) {}", empty.join(", "))
    };
    let p = &observed.picker;
    let (picker_ok, picker_reason, picker_msg) = match p.available_replicas {
        _ if p.desired_replicas == 0 => (
            false,
            "ScaledToZero",
            "picker replicas is 0: no in-cluster picker".to_owned(),
        ),
        None => (
            false,
            "Pending",
            "the picker Deployment does not exist yet".to_owned(),
        ),
        Some(n) if n > 0 => (
            true,
            "Available",
            format!("{n}/{} picker replicas available", p.desired_replicas),
        ),
        Some(_) => (
            false,
            "Unavailable",
            format!("0/{} picker replicas available", p.desired_replicas),
        ),
    };
    // replicas 0: the pool's pickers run elsewhere (outside the cluster, or as local
    // processes in tests), so readiness does not wait for this Deployment
    let ready = resolved_ok && (picker_ok || p.desired_replicas == 0);
    let (ready_reason, ready_msg) = if ready {
        (
            "Ready",
            format!("{ready_endpoints} endpoints; {picker_msg}"),
        )
    } else if !resolved_ok {
        ("NoEligibleEndpoints", resolved_msg.clone())
    } else {
        ("PickerUnavailable", picker_msg.clone())
    };
    conds.set(condition::READY, ready, ready_reason, ready_msg);
    conds.set(
        condition::CONFIG_VALID,
        true,
        "Valid",
        "the spec is valid".into(),
    );
    conds.set(
        condition::ENDPOINTS_RESOLVED,
        resolved_ok,
        if resolved_ok {
            "Resolved"
        } else {
            "NoEligibleEndpoints"
        },
        resolved_msg,
    );
    conds.set(
        condition::PICKER_AVAILABLE,
        picker_ok,
        picker_reason,
        picker_msg,
    );
    match &observed.gateway {
        GatewayState::NotRequested => {}
        GatewayState::Exported(names) => conds.set(
            condition::GATEWAY_EXPORTED,
            true,
            "Exported",
            format!(
                "inference.networking.k8s.io/v1 InferencePool(s) {}",
                names.join(", ")
            ),
        ),
        GatewayState::CrdMissing => conds.set(
            condition::GATEWAY_EXPORTED,
            false,
            "NotSupported",
            "the inference.networking.k8s.io/v1 InferencePool CRD is not installed".into(),
        ),
    }
    KVRoutePoolStatus {
        observed_generation: generation,
        conditions: conds.out,
        ready_endpoints,
        model_configs,
        picker: Some(PickerStatus {
            service: p.service.clone(),
            replicas: p.desired_replicas,
            available_replicas: p.available_replicas.unwrap_or(0),
        }),
    }
}

/// Pods that became ineligible for a configuration reason since the previous status (one
/// Warning Event each, not one per reconcile): `(model config, pod)`.
pub fn new_misconfigurations<'a>(
    previous: Option<&KVRoutePoolStatus>,
    next: &'a KVRoutePoolStatus,
) -> Vec<(&'a str, &'a IneligiblePod)> {
    let mut out = Vec::new();
    for mc in &next.model_configs {
        let before = previous.and_then(|p| p.model_configs.iter().find(|m| m.name == mc.name));
        for pod in mc
            .ineligible
            .iter()
            .filter(|p| p.reason.is_misconfiguration())
        {
            let known = before.is_some_and(|b| {
                b.ineligible
                    .iter()
                    .any(|q| q.pod == pod.pod && q.reason == pod.reason && q.message == pod.message)
            });
            if !known {
                out.push((mc.name.as_str(), pod));
            }
        }
    }
    out
}

/// Whether the spec just became invalid (or its error changed): one Warning Event then.
pub fn newly_invalid(previous: Option<&KVRoutePoolStatus>, next: &KVRoutePoolStatus) -> bool {
    let invalid = |s: Option<&KVRoutePoolStatus>| {
        s.and_then(|s| s.condition(condition::CONFIG_VALID))
            .filter(|c| c.status == "False")
            .map(|c| c.message.clone())
    };
    let now = invalid(Some(next));
    now.is_some() && now != invalid(previous)
}
