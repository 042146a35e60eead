//! Serving an existing Gateway API InferencePool (`spec.inferencePoolRef`): the referenced
//! pool's selector and target ports resolve the KVRoutePool's endpoints
//! ([`KVRoutePoolSpec::resolve`]), and kvroute reports in the InferencePool's `status.parents`
//! under an entry of its own, leaving every other parent's entry as it is.
//!
//! `status.parents` is an atomic list, so the entry is written with a merge patch carrying the
//! resourceVersion read: a concurrent writer (the gateway's controller adding its entry) makes
//! it fail with a conflict, and the next reconcile writes it again over what is there.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kvroute_crds::contract;
use kvroute_crds::gateway_pool::{GatewayInferencePool, ParentReference, ParentStatus};
use kvroute_crds::kvroute_pool::KVRoutePool;
use serde_json::json;

use crate::error::{Error, Result};

/// How often a pool that serves a Gateway API InferencePool re-reads it (the operator does
/// not watch that resource, which may not be installed).
pub const GATEWAY_REF_RESYNC: std::time::Duration = std::time::Duration::from_secs(20);

/// At most this many parents are listed in an InferencePool's status.
const MAX_PARENTS: usize = 32;

/// The referenced InferencePool, or why there is none to serve.
pub async fn fetch(
    client: &kube::Client,
    namespace: &str,
    name: &str,
) -> Result<std::result::Result<GatewayInferencePool, String>> {
    let api: Api<GatewayInferencePool> = Api::namespaced(client.clone(), namespace);
    match api.get_opt(name).await {
        Ok(Some(gw)) => Ok(Ok(gw)),
        Ok(None) => Ok(Err(format!(
            "inferencePoolRef: InferencePool {name} (inference.networking.k8s.io/v1) not found in namespace {namespace}"
        ))),
        // the resource type itself is unknown
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(Err(
            "inferencePoolRef: the inference.networking.k8s.io/v1 InferencePool CRD is not installed"
                .into(),
        )),
        Err(source) => Err(Error::Read {
            what: format!("InferencePool {namespace}/{name}"),
            source,
        }),
    }
}

/// kvroute's parentRef in the InferencePool's status: the KVRoutePool serving it.
pub fn parent_ref(pool: &KVRoutePool, namespace: &str) -> ParentReference {
    ParentReference {
        group: Some(contract::GROUP.into()),
        kind: Some("KVRoutePool".into()),
        name: pool.name_any(),
        namespace: Some(namespace.into()),
    }
}

/// Whether the InferencePool's `endpointPickerRef` names this pool's picker Service and
/// ext_proc port.
pub fn picker_ref_resolves(
    gw: &GatewayInferencePool,
    pool: &KVRoutePool,
) -> std::result::Result<(), String> {
    let picker = contract::picker_name(&pool.name_any());
    let port = i32::from(contract::PICKER_EXT_PROC_PORT);
    let Some(r) = &gw.spec.endpoint_picker_ref else {
        return Err(format!(
            "endpointPickerRef is not set: point it at the picker Service {picker}, port {port}"
        ));
    };
    let kind = r.kind.as_deref().unwrap_or("Service");
    let group = r.group.as_deref().unwrap_or_default();
    if r.name == picker && kind == "Service" && group.is_empty() && r.port_number() == port {
        Ok(())
    } else {
        Err(format!(
            "endpointPickerRef names {kind} {} port {}, not this pool's picker Service {picker} port {port}",
            r.name,
            r.port_number()
        ))
    }
}

/// The entry kvroute keeps in the InferencePool's `status.parents`: `Accepted` (the
/// KVRoutePool resolved the InferencePool and its endpoints: `accepted`'s error otherwise)
/// and `ResolvedRefs` (the endpoint picker reference names this pool's picker). A condition
/// keeps its transition time while its status stays.
pub fn entry(
    gw: &GatewayInferencePool,
    pool: &KVRoutePool,
    namespace: &str,
    accepted: &std::result::Result<(), String>,
    now: &Time,
) -> ParentStatus {
    let ours = parent_ref(pool, namespace);
    let previous = gw
        .status
        .as_ref()
        .and_then(|s| s.parents.iter().find(|p| p.parent_ref == ours));
    let condition = |type_: &str,
                     ok: &std::result::Result<(), String>,
                     yes: &str,
                     no: &str,
                     yes_message: String| {
        let status = if ok.is_ok() { "True" } else { "False" };
        let last = previous
            .and_then(|p| p.conditions.iter().find(|c| c.type_ == type_))
            .filter(|c| c.status == status)
            .map_or_else(|| now.clone(), |c| c.last_transition_time.clone());
        Condition {
            type_: type_.into(),
            status: status.into(),
            reason: if ok.is_ok() { yes } else { no }.into(),
            message: match ok {
                Ok(()) => yes_message,
                Err(e) => e.clone(),
            },
            last_transition_time: last,
            observed_generation: gw.metadata.generation,
        }
    };
    let picker = contract::picker_name(&pool.name_any());
    ParentStatus {
        parent_ref: ours,
        conditions: vec![
            condition(
                "Accepted",
                accepted,
                "Accepted",
                "Invalid",
                format!(
                    "KVRoutePool {} serves this pool's endpoints",
                    pool.name_any()
                ),
            ),
            condition(
                "ResolvedRefs",
                &picker_ref_resolves(gw, pool),
                "ResolvedRefs",
                "InvalidExtensionRef",
                format!("the endpoint picker is kvroute's picker Service {picker}"),
            ),
        ],
    }
}

/// Writes kvroute's entry into the InferencePool's `status.parents` when it changed, keeping
/// the other parents' entries.
pub async fn write_entry(
    client: &kube::Client,
    gw: &GatewayInferencePool,
    mine: ParentStatus,
) -> Result<bool> {
    let current = gw
        .status
        .as_ref()
        .map(|s| s.parents.clone())
        .unwrap_or_default();
    let mut parents = current.clone();
    let full = parents.len() >= MAX_PARENTS;
    match parents.iter_mut().find(|p| p.parent_ref == mine.parent_ref) {
        Some(p) => *p = mine,
        None if full => {
            tracing::warn!(pool = %gw.name_any(), "the InferencePool lists {MAX_PARENTS} parents already: kvroute's entry is left out");
            return Ok(false);
        }
        None => parents.push(mine),
    }
    if parents == current {
        return Ok(false);
    }
    let namespace = gw.namespace().unwrap_or_default();
    let api: Api<GatewayInferencePool> = Api::namespaced(client.clone(), &namespace);
    let patch = json!({
        "metadata": {"resourceVersion": gw.metadata.resource_version},
        "status": {"parents": parents},
    });
    api.patch_status(
        &gw.name_any(),
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await
    .map_err(|source| Error::UpdateStatus {
        name: format!("InferencePool {namespace}/{}", gw.name_any()),
        source,
    })?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn gw(picker: serde_json::Value, parents: serde_json::Value) -> GatewayInferencePool {
        serde_json::from_value(json!({
            "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "llama", "namespace": "serving", "generation": 3},
            "spec": {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": 8000}],
                     "endpointPickerRef": picker},
            "status": {"parents": parents}
        }))
        .expect("pool")
    }

    fn pool() -> KVRoutePool {
        serde_json::from_value(json!({
            "apiVersion": "kvroute.dev/v1alpha1", "kind": "KVRoutePool",
            "metadata": {"name": "llama", "namespace": "serving"},
            "spec": {"inferencePoolRef": {"name": "llama"}, "modelConfigs": [{"name": "m", "model": "m"}]}
        }))
        .expect("pool")
    }

    fn time(s: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(s).expect("time"))
    }

    #[test]
    fn the_entry_says_whether_the_picker_ref_is_ours_and_keeps_transition_times() {
        let ours = gw(
            json!({"name": "llama-picker", "port": {"number": 9002}}),
            json!([]),
        );
        let e = entry(&ours, &pool(), "serving", &Ok(()), &time(10));
        assert_eq!(e.parent_ref.kind.as_deref(), Some("KVRoutePool"));
        let statuses: Vec<(&str, &str, &str)> = e
            .conditions
            .iter()
            .map(|c| (c.type_.as_str(), c.status.as_str(), c.reason.as_str()))
            .collect();
        assert_eq!(
            statuses,
            [
                ("Accepted", "True", "Accepted"),
                ("ResolvedRefs", "True", "ResolvedRefs")
            ]
        );
        assert_eq!(e.conditions[0].observed_generation, Some(3));

        // someone else's picker: ResolvedRefs False, naming both
        let other = gw(json!({"name": "epp", "port": {"number": 9002}}), json!([]));
        let e = entry(&other, &pool(), "serving", &Ok(()), &time(10));
        assert_eq!(e.conditions[1].reason, "InvalidExtensionRef");
        assert!(
            e.conditions[1].message.contains("llama-picker"),
            "{}",
            e.conditions[1].message
        );

        // an unchanged status keeps its time; a change takes now
        let listed = gw(
            json!({"name": "llama-picker", "port": {"number": 9002}}),
            json!([
                {"parentRef": {"name": "gw"}, "conditions": []},
                {"parentRef": {"group": "kvroute.dev", "kind": "KVRoutePool", "name": "llama", "namespace": "serving"},
                 "conditions": [
                    {"type": "Accepted", "status": "True", "reason": "Accepted", "message": "", "lastTransitionTime": "1970-01-01T00:00:05Z"},
                    {"type": "ResolvedRefs", "status": "False", "reason": "InvalidExtensionRef", "message": "", "lastTransitionTime": "1970-01-01T00:00:05Z"}
                 ]}
            ]),
        );
        let e = entry(&listed, &pool(), "serving", &Ok(()), &time(10));
        assert_eq!(e.conditions[0].last_transition_time, time(5));
        assert_eq!(e.conditions[1].last_transition_time, time(10));
        let e = entry(
            &listed,
            &pool(),
            "serving",
            &Err("no endpoints".into()),
            &time(10),
        );
        assert_eq!(
            (
                e.conditions[0].status.as_str(),
                e.conditions[0].message.as_str()
            ),
            ("False", "no endpoints")
        );
    }
}
