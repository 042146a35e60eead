//! The Gateway API Inference Extension's `InferencePool` (`inference.networking.k8s.io/v1`,
//! short name `infpool`), as kvroute reads and writes it, written from the published v1 API:
//! the pods (`selector`), the ports that are each an endpoint (`targetPorts`, 1-8, unique; a
//! data-parallel rank per port), their protocol (`appProtocol`), the endpoint picker the
//! gateway calls (`endpointPickerRef`), and per parent (usually a Gateway) the conditions its
//! controllers report (`status.parents`).
//!
//! The tests install its CRD ([`gateway_crd_yaml`]) beside kvroute's to check that the two
//! resources stay apart.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, CustomResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The desired state of a Gateway API InferencePool.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "inference.networking.k8s.io",
    version = "v1",
    kind = "InferencePool",
    root = "GatewayInferencePool",
    plural = "inferencepools",
    shortname = "infpool",
    namespaced,
    status = "GatewayInferencePoolStatus",
    derive = "PartialEq",
    doc = "A Gateway API Inference Extension InferencePool: a group of model-server pods and the endpoint picker a gateway asks which of them serves a request."
)]
#[serde(rename_all = "camelCase")]
pub struct GatewayInferencePoolSpec {
    /// The pool's pods, by label, in the pool's namespace.
    pub selector: GatewayLabelSelector,
    /// The ports of each pod that are endpoints, each addressed as `podIP:number`.
    #[schemars(
        length(min = 1, max = 8),
        extend("x-kubernetes-list-type" = "atomic", "x-kubernetes-validations" = [
            {"rule": "self.all(p1, self.exists_one(p2, p1.number == p2.number))", "message": "port number must be unique"}
        ])
    )]
    pub target_ports: Vec<GatewayPort>,
    /// The application protocol of every target port: `http` (HTTP/1.1, the default) or
    /// `kubernetes.io/h2c`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub app_protocol: Option<AppProtocol>,
    /// The endpoint picker the gateway calls for this pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint_picker_ref: Option<EndpointPickerRef>,
}

/// Labels every pod of the pool carries.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GatewayLabelSelector {
    #[schemars(extend("minProperties" = 1, "maxProperties" = 64))]
    pub match_labels: BTreeMap<String, String>,
}

/// A port of the pool's pods.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct GatewayPort {
    #[schemars(range(min = 1, max = 65535))]
    pub number: i32,
}

/// How the gateway speaks to the pods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum AppProtocol {
    #[serde(rename = "http")]
    Http,
    #[serde(rename = "kubernetes.io/h2c")]
    H2c,
}

/// The endpoint picker a gateway calls (a Service's port by default).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EndpointPickerRef {
    /// API group of the referent; empty (the default) is the core group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Kind of the referent, `Service` by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The picker's port (a Service port; required for a Service).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<GatewayPort>,
    /// `FailOpen` or `FailClose` (the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_mode: Option<String>,
}

impl EndpointPickerRef {
    /// The port the gateway dials: `port.number`, else the conventional 9002.
    pub fn port_number(&self) -> i32 {
        self.port.as_ref().map_or(9002, |p| p.number)
    }
}

/// What the pool's controllers report, per parent.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GatewayInferencePoolStatus {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), extend("x-kubernetes-list-type" = "atomic"))]
    pub parents: Vec<ParentStatus>,
}

/// The pool as one parent sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ParentStatus {
    /// `Accepted`, `ResolvedRefs`, or a controller's own types.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = 8),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"])
    )]
    pub conditions: Vec<Condition>,
    pub parent_ref: ParentReference,
}

/// The parent a status entry belongs to (a Gateway unless said otherwise).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ParentReference {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

/// The API review that approved the v1 API: a `*.k8s.io` group's CRD must name one in its
/// `api-approved.kubernetes.io` annotation, or the API server refuses it.
pub const API_APPROVAL: &str =
    "https://github.com/kubernetes-sigs/gateway-api-inference-extension/pull/1173";

/// The Gateway API `InferencePool` CustomResourceDefinition as YAML.
pub fn gateway_crd_yaml() -> Result<String, serde_yaml_ng::Error> {
    let mut crd = GatewayInferencePool::crd();
    crd.metadata.annotations = Some(BTreeMap::from([(
        "api-approved.kubernetes.io".to_owned(),
        API_APPROVAL.to_owned(),
    )]));
    serde_yaml_ng::to_string(&crd)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_published_pool_reads_and_its_crd_names_the_gateway_resource() {
        let pool: GatewayInferencePool = serde_json::from_value(json!({
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": "llama", "namespace": "serving"},
            "spec": {
                "selector": {"matchLabels": {"app": "vllm-llama"}},
                "targetPorts": [{"number": 8000}, {"number": 8001}],
                "appProtocol": "kubernetes.io/h2c",
                "endpointPickerRef": {"name": "llama-epp", "port": {"number": 9003}, "failureMode": "FailOpen"}
            },
            "status": {"parents": [{
                "parentRef": {"name": "gw"},
                "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted",
                                "message": "", "lastTransitionTime": "2026-12-05T00:00:00Z"}]
            }]}
        }))
        .expect("a v1 pool");
        assert_eq!(pool.spec.target_ports.len(), 2);
        assert_eq!(pool.spec.app_protocol, Some(AppProtocol::H2c));
        assert_eq!(
            pool.spec
                .endpoint_picker_ref
                .as_ref()
                .map(EndpointPickerRef::port_number),
            Some(9003)
        );
        let status = pool.status.expect("status");
        assert_eq!(status.parents[0].parent_ref.name, "gw");
        let crd = gateway_crd_yaml().expect("yaml");
        for want in [
            "name: inferencepools.inference.networking.k8s.io",
            "kind: InferencePool",
            "- infpool",
            "port number must be unique",
        ] {
            assert!(crd.contains(want), "{want} in\n{crd}");
        }
    }

    #[test]
    fn inference_objectives_become_flow_control_objectives_for_the_pools_they_name() {
        let obj = |name: &str, pool: &str, kind: Option<&str>, priority: Option<i64>| {
            let mut pool_ref = json!({"name": pool});
            if let Some(k) = kind {
                pool_ref["kind"] = json!(k);
            }
            let mut spec = json!({"poolRef": pool_ref});
            if let Some(p) = priority {
                spec["priority"] = json!(p);
            }
            serde_json::from_value::<InferenceObjective>(json!({
                "apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferenceObjective",
                "metadata": {"name": name}, "spec": spec
            }))
            .expect("objective")
        };
        let got = objectives_for(
            &["llama".into(), "llama-export".into()],
            &[
                obj("interactive", "llama", None, Some(10)),
                obj("batch", "llama-export", Some("InferencePool"), Some(-5)),
                obj("default", "llama", None, None),
                obj("huge", "llama", None, Some(50_000)),
                obj("elsewhere", "qwen", None, Some(3)),
                obj("other-kind", "llama", Some("Service"), Some(3)),
            ],
        );
        let got: Vec<(&str, i32)> = got.iter().map(|o| (o.name.as_str(), o.priority)).collect();
        assert_eq!(
            got,
            [
                ("batch", -5),
                ("default", 0),
                ("huge", 1000),
                ("interactive", 10)
            ],
            "only this pool's, unset is 0, clamped, in name order"
        );
        assert!(
            objective_crd_yaml()
                .expect("crd")
                .contains("inferenceobjectives.inference.networking.x-k8s.io")
        );
    }

    #[test]
    fn llm_d_rewrites_become_model_rewrites_for_the_pools_they_name() {
        let rw = |name: &str,
                  created: &str,
                  pool: &str,
                  rules: serde_json::Value|
         -> InferenceModelRewrite {
            serde_json::from_value(json!({
                "apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferenceModelRewrite",
                "metadata": {"name": name, "creationTimestamp": created},
                "spec": {"poolRef": {"name": pool}, "rules": rules}
            }))
            .expect("rewrite")
        };
        let old = rw(
            "canary",
            "2026-01-01T00:00:00Z",
            "llama",
            json!([
                {"matches": [{"model": {"value": "sql"}}],
                 "targets": [{"modelRewrite": "sql-v1", "weight": 90}, {"modelRewrite": "sql-v2", "weight": 10}]},
                {"targets": [{"modelRewrite": "sql-v1"}]},
                {"matches": [{"model": {"value": "chat"}}], "targets": [{"modelRewrite": "gone"}]}
            ]),
        );
        let newer = rw(
            "later",
            "2026-02-01T00:00:00Z",
            "llama",
            json!([
                {"matches": [{"model": {"value": "sql"}}, {"model": {"value": "code"}}],
                 "targets": [{"modelRewrite": "sql-v2"}, {"modelRewrite": "sql-v1"}]}
            ]),
        );
        let elsewhere = rw(
            "other",
            "2025-01-01T00:00:00Z",
            "qwen",
            json!([
                {"matches": [{"model": {"value": "sql"}}], "targets": [{"modelRewrite": "sql-v2"}]}
            ]),
        );
        let served = |m: &str| m.starts_with("sql-");
        let (rules, skipped) = rewrites_for(&["llama".into()], &[newer, elsewhere, old], &served);
        let got: Vec<(&str, Vec<(&str, u32)>)> = rules
            .iter()
            .map(|r| {
                (
                    r.model.as_str(),
                    r.targets
                        .iter()
                        .map(|t| (t.model.as_str(), t.weight))
                        .collect(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("sql", vec![("sql-v1", 90), ("sql-v2", 10)]),
                ("code", vec![("sql-v2", 1), ("sql-v1", 1)]),
            ],
            "the oldest resource's rule wins; unweighted targets share equally"
        );
        assert_eq!(skipped.len(), 2, "{skipped:?}");
        assert!(
            model_rewrite_crd_yaml()
                .expect("crd")
                .contains("inferencemodelrewrites.inference.networking.x-k8s.io")
        );
    }
}

/// llm-d's / the Gateway API Inference Extension's `InferenceModelRewrite`
/// (`inference.networking.x-k8s.io/v1alpha2`): ordered rules that send requests naming a
/// model to other models by weight, for the InferencePool named in `poolRef`. kvroute honours
/// it as extra `routing.modelRewrites` of the KVRoutePool serving (or exporting) that pool
/// ([`rewrites_for`]).
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "inference.networking.x-k8s.io",
    version = "v1alpha2",
    kind = "InferenceModelRewrite",
    plural = "inferencemodelrewrites",
    namespaced,
    derive = "PartialEq",
    doc = "Rules rewriting the model of an InferencePool's requests, with weighted targets."
)]
#[serde(rename_all = "camelCase")]
pub struct InferenceModelRewriteSpec {
    pub pool_ref: PoolObjectReference,
    /// The first rule that matches a request applies.
    pub rules: Vec<InferenceModelRewriteRule>,
}

/// The InferencePool a rewrite applies to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolObjectReference {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub name: String,
}

/// Matches (any of them; none matches every request) and where matching requests go.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InferenceModelRewriteRule {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub matches: Vec<RewriteMatch>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub targets: Vec<TargetModel>,
}

/// A request whose `model` is `model.value` (`Exact`, the only type).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RewriteMatch {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<ModelMatch>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelMatch {
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub type_: Option<String>,
    pub value: String,
}

/// A weighted destination model (weights all set, or none: equal shares).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TargetModel {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<i32>,
    pub model_rewrite: String,
}

/// The `InferenceModelRewrite` CustomResourceDefinition as YAML (tests install it).
pub fn model_rewrite_crd_yaml() -> Result<String, serde_yaml_ng::Error> {
    serde_yaml_ng::to_string(&InferenceModelRewrite::crd())
}

/// The Gateway API Inference Extension's `InferenceObjective`
/// (`inference.networking.x-k8s.io/v1alpha2`): a named priority for the requests of the
/// InferencePool in `poolRef` that name it (in `routing.flowControl.objectiveHeader`). kvroute
/// honours it as an extra `routing.flowControl.objectives` entry of the KVRoutePool serving (or
/// exporting) that pool ([`objectives_for`]).
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "inference.networking.x-k8s.io",
    version = "v1alpha2",
    kind = "InferenceObjective",
    plural = "inferenceobjectives",
    namespaced,
    derive = "PartialEq",
    doc = "A named priority for the requests of an InferencePool."
)]
#[serde(rename_all = "camelCase")]
pub struct InferenceObjectiveSpec {
    /// Higher is served first; unset is 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    pub pool_ref: PoolObjectReference,
}

/// The `InferenceObjective` CustomResourceDefinition as YAML (tests install it).
pub fn objective_crd_yaml() -> Result<String, serde_yaml_ng::Error> {
    serde_yaml_ng::to_string(&InferenceObjective::crd())
}

/// The `routing.flowControl.objectives` the `InferenceObjective`s naming one of `pools` add: one
/// per resource name, its priority clamped to kvroute's range (-1000 to 1000), in name order;
/// at most 64.
pub fn objectives_for(
    pools: &[String],
    objectives: &[InferenceObjective],
) -> Vec<crate::routing::Objective> {
    let mut out: Vec<crate::routing::Objective> = objectives
        .iter()
        .filter(|o| {
            pools.contains(&o.spec.pool_ref.name)
                && o.spec.pool_ref.kind.as_deref().unwrap_or("InferencePool") == "InferencePool"
        })
        .filter_map(|o| {
            let name = o.metadata.name.clone()?;
            Some(crate::routing::Objective {
                name,
                priority: o.spec.priority.unwrap_or(0).clamp(-1000, 1000),
                ttft_slo_ms: None,
            })
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out.dedup_by(|a, b| a.name == b.name);
    out.truncate(64);
    out
}

/// The `routing.modelRewrites` rules the `InferenceModelRewrite`s naming one of `pools` add,
/// for models `served` says the pool serves, in precedence order: rules matching models
/// exactly, from the oldest resource first, then each resource's rules in order; the first
/// rule for a model wins. Rules without matches (every model) and rules with a target the pool
/// does not serve are left out, each with the reason in the second list.
pub fn rewrites_for(
    pools: &[String],
    rewrites: &[InferenceModelRewrite],
    served: &dyn Fn(&str) -> bool,
) -> (Vec<crate::routing::ModelRewrite>, Vec<String>) {
    use crate::routing::{ModelRewrite, RewriteTarget};
    let mut mine: Vec<&InferenceModelRewrite> = rewrites
        .iter()
        .filter(|r| {
            pools.contains(&r.spec.pool_ref.name)
                && r.spec.pool_ref.kind.as_deref().unwrap_or("InferencePool") == "InferencePool"
        })
        .collect();
    mine.sort_by(|a, b| {
        (&a.metadata.creation_timestamp, &a.metadata.name)
            .cmp(&(&b.metadata.creation_timestamp, &b.metadata.name))
    });
    let mut out: Vec<ModelRewrite> = Vec::new();
    let mut skipped = Vec::new();
    for r in mine {
        let name = r.metadata.name.clone().unwrap_or_default();
        for (i, rule) in r.spec.rules.iter().enumerate() {
            let at = format!("InferenceModelRewrite {name} rules[{i}]");
            if rule.matches.is_empty() {
                skipped.push(format!("{at}: a rule for every model is not supported"));
                continue;
            }
            let weighted = rule.targets.iter().any(|t| t.weight.is_some());
            let targets: Vec<RewriteTarget> = rule
                .targets
                .iter()
                .map(|t| RewriteTarget {
                    model: t.model_rewrite.clone(),
                    weight: if weighted {
                        u32::try_from(t.weight.unwrap_or(0))
                            .unwrap_or(0)
                            .min(1_000_000)
                    } else {
                        1
                    },
                })
                .collect();
            if targets.is_empty() || targets.iter().all(|t| t.weight == 0) {
                skipped.push(format!("{at}: no target with a positive weight"));
                continue;
            }
            if let Some(t) = targets.iter().find(|t| !served(&t.model)) {
                skipped.push(format!(
                    "{at}: target {:?} is not served by the pool",
                    t.model
                ));
                continue;
            }
            for m in &rule.matches {
                let Some(model) = m.model.as_ref().map(|m| m.value.clone()) else {
                    continue;
                };
                if !out.iter().any(|o| o.model == model) && out.len() < 64 {
                    out.push(ModelRewrite {
                        model,
                        targets: targets.clone(),
                    });
                }
            }
        }
    }
    (out, skipped)
}
