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
}
