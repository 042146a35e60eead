//! Which pods serve which model config, and as which endpoints. Pure: pods in, decisions out.
//!
//! A pod is **eligible** for a model config when it matches the pool selector and the
//! config's pod subset, is Ready and not terminating, has an IP, and declares (if it declares
//! anything) a configuration compatible with the model config. Compatible pods with an IP that
//! are not ready or are terminating are still **listed** in the EndpointSlice, with conditions
//! saying so, so pickers drain them (finish in-flight work, keep what they know of the pod's
//! cache while readiness flaps) instead of forgetting them. See `kvroute_crds::contract`.

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::Pod;
use kvroute_crds::contract::pod as declared;
use kvroute_crds::kvroute_pool::{
    IneligiblePod, IneligibleReason, KVRoutePoolSpec, RoleCounts, labels_match,
};
use kvroute_crds::pool::{EngineKind, Isolation, ModelConfigSpec};
use kvroute_crds::{ROLE_LABELS, Role};

/// Readiness of a listed pod, as EndpointSlice conditions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conditions {
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
}

/// A pod listed in a model config's EndpointSlice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedPod {
    pub name: String,
    pub uid: Option<String>,
    pub ip: IpAddr,
    pub node_name: Option<String>,
    pub conditions: Conditions,
    /// The pod's values of the label keys pickers read: tenant selectors' keys and the
    /// role labels ([`Role::from_labels`]).
    pub labels: BTreeMap<String, String>,
    /// Its role under prefill/decode disaggregation.
    pub role: Role,
}

/// The endpoints of one model config.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConfigEndpoints {
    pub name: String,
    /// Eligible and draining pods, by name.
    pub listed: Vec<ListedPod>,
    pub eligible_pods: u32,
    /// Eligible pods by role.
    pub eligible_by_role: RoleCounts,
    /// Selected pods that are not eligible, by name.
    pub ineligible: Vec<IneligiblePod>,
}

impl ConfigEndpoints {
    pub fn eligible(&self) -> impl Iterator<Item = &ListedPod> {
        self.listed.iter().filter(|p| p.conditions.ready)
    }
}

/// What one pod is to one model config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// `None`: eligible.
    pub ineligible: Option<(IneligibleReason, String)>,
    /// Listed in the slice, with these conditions (eligible, or compatible but draining).
    pub listed: Option<(IpAddr, Conditions)>,
}

fn pod_labels(pod: &Pod) -> BTreeMap<String, String> {
    pod.metadata.labels.clone().unwrap_or_default()
}

/// Whether the pod's Ready condition is True.
pub fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn has_finished(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|p| p == "Succeeded" || p == "Failed")
}

/// The pod's IP: `None` when absent; an error message when unparsable.
fn pod_ip(pod: &Pod) -> Result<Option<IpAddr>, String> {
    match pod.status.as_ref().and_then(|s| s.pod_ip.as_deref()) {
        None | Some("") => Ok(None),
        Some(ip) => ip
            .parse()
            .map(Some)
            .map_err(|_| format!("pod IP {ip:?} is not an IP address")),
    }
}

/// A declaration from the pod's annotations, else its labels.
fn declaration<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    let from = |m: &'a Option<BTreeMap<String, String>>| m.as_ref()?.get(key).map(String::as_str);
    from(&pod.metadata.annotations).or_else(|| from(&pod.metadata.labels))
}

/// The first incompatibility between what the pod declares and the model config.
pub fn declared_mismatch(mc: &ModelConfigSpec, pod: &Pod) -> Option<(IneligibleReason, String)> {
    if let Err(message) = Role::from_labels(&pod_labels(pod)) {
        return Some((IneligibleReason::InvalidDeclaration, message));
    }
    if let Some(model) = declaration(pod, declared::MODEL)
        && model != mc.model
    {
        return Some((
            IneligibleReason::ModelMismatch,
            format!(
                "pod serves model {model:?} ({}), model config {:?} expects {:?}",
                declared::MODEL,
                mc.name,
                mc.model
            ),
        ));
    }
    if let Some(engine) = declaration(pod, declared::ENGINE) {
        let known = [EngineKind::Vllm, EngineKind::Sglang, EngineKind::Trtllm]
            .into_iter()
            .find(|e| e.as_str() == engine);
        match known {
            None => {
                return Some((
                    IneligibleReason::InvalidDeclaration,
                    format!(
                        "{} {engine:?} is not one of vllm, sglang, trtllm",
                        declared::ENGINE
                    ),
                ));
            }
            Some(e) if e != mc.engine => {
                return Some((
                    IneligibleReason::EngineMismatch,
                    format!(
                        "pod runs engine {engine} ({}), model config {:?} expects {}",
                        declared::ENGINE,
                        mc.name,
                        mc.engine.as_str()
                    ),
                ));
            }
            Some(_) => {}
        }
    }
    let numbers = [
        (
            declared::DP_SIZE,
            mc.data_parallel.size,
            IneligibleReason::DataParallelMismatch,
            "data-parallel size",
        ),
        (
            declared::BLOCK_SIZE,
            mc.block_size,
            IneligibleReason::BlockSizeMismatch,
            "block size",
        ),
    ];
    for (key, expected, reason, what) in numbers {
        let Some(raw) = declaration(pod, key) else {
            continue;
        };
        match raw.trim().parse::<u32>() {
            Err(_) => {
                return Some((
                    IneligibleReason::InvalidDeclaration,
                    format!("{key} {raw:?} is not a non-negative integer"),
                ));
            }
            Ok(v) if v != expected => {
                return Some((
                    reason,
                    format!(
                        "pod declares {what} {v} ({key}), model config {:?} expects {expected}",
                        mc.name
                    ),
                ));
            }
            Ok(_) => {}
        }
    }
    None
}

/// What `pod` is to `mc` (the pod is known to match the selectors).
pub fn judge(mc: &ModelConfigSpec, pod: &Pod) -> Verdict {
    if let Some(mismatch) = declared_mismatch(mc, pod) {
        return Verdict {
            ineligible: Some(mismatch),
            listed: None,
        };
    }
    let terminating = pod.metadata.deletion_timestamp.is_some();
    let ready = is_ready(pod);
    let ip = match pod_ip(pod) {
        Ok(ip) => ip,
        Err(msg) => {
            return Verdict {
                ineligible: Some((IneligibleReason::NoAddress, msg)),
                listed: None,
            };
        }
    };
    if has_finished(pod) {
        return Verdict {
            ineligible: Some((IneligibleReason::NotReady, "pod has finished".into())),
            listed: None,
        };
    }
    match (terminating, ip) {
        (true, ip) => Verdict {
            ineligible: Some((IneligibleReason::Terminating, "pod is being deleted".into())),
            listed: ip.map(|ip| {
                (
                    ip,
                    Conditions {
                        ready: false,
                        serving: ready,
                        terminating: true,
                    },
                )
            }),
        },
        (false, None) => Verdict {
            ineligible: Some((IneligibleReason::NoAddress, "pod has no IP yet".into())),
            listed: None,
        },
        (false, Some(ip)) if !ready => Verdict {
            ineligible: Some((
                IneligibleReason::NotReady,
                "pod's Ready condition is not True".into(),
            )),
            listed: Some((
                ip,
                Conditions {
                    ready: false,
                    serving: false,
                    terminating: false,
                },
            )),
        },
        (false, Some(ip)) => Verdict {
            ineligible: None,
            listed: Some((
                ip,
                Conditions {
                    ready: true,
                    serving: true,
                    terminating: false,
                },
            )),
        },
    }
}

/// Label keys the pool's tenant selectors read (projected into slices for pickers).
pub fn tenant_label_keys(spec: &KVRoutePoolSpec) -> Vec<String> {
    if spec.tenancy.isolation != Isolation::DedicatedEndpoints {
        return Vec::new();
    }
    let mut keys: Vec<String> = spec
        .tenancy
        .tenants
        .iter()
        .flat_map(|t| t.pod_selector.keys().cloned())
        .collect();
    keys.sort();
    keys.dedup();
    keys
}

/// Every model config's endpoints from the pods of the pool's namespace (`pods` may hold
/// other namespaces' pods: they are skipped).
pub fn resolve<'a>(
    spec: &KVRoutePoolSpec,
    namespace: &str,
    pods: impl IntoIterator<Item = &'a Pod>,
) -> Vec<ConfigEndpoints> {
    let mut selected: Vec<&Pod> = pods
        .into_iter()
        .filter(|p| p.metadata.namespace.as_deref() == Some(namespace))
        .filter(|p| {
            spec.selector
                .as_ref()
                .is_some_and(|s| s.matches(&pod_labels(p)))
        })
        .collect();
    selected.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    let keys = tenant_label_keys(spec);
    spec.model_configs
        .iter()
        .map(|mc| {
            let mut out = ConfigEndpoints {
                name: mc.name.clone(),
                ..ConfigEndpoints::default()
            };
            for pod in &selected {
                let labels = pod_labels(pod);
                if !labels_match(&mc.pod_selector, &labels) {
                    continue;
                }
                let Some(name) = pod.metadata.name.clone() else {
                    continue;
                };
                let verdict = judge(mc, pod);
                // a role label that does not parse made the pod ineligible
                let role = Role::from_labels(&labels).unwrap_or_default();
                if verdict.ineligible.is_none() {
                    out.eligible_pods += 1;
                    out.eligible_by_role.count(role);
                }
                if let Some((reason, message)) = verdict.ineligible {
                    out.ineligible.push(IneligiblePod {
                        pod: name.clone(),
                        reason,
                        message,
                    });
                }
                if let Some((ip, conditions)) = verdict.listed {
                    out.listed.push(ListedPod {
                        name,
                        uid: pod.metadata.uid.clone(),
                        ip,
                        node_name: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
                        conditions,
                        labels: keys
                            .iter()
                            .map(String::as_str)
                            .chain(ROLE_LABELS)
                            .filter_map(|k| labels.get(k).map(|v| (k.to_owned(), v.clone())))
                            .collect(),
                        role,
                    });
                }
            }
            out
        })
        .collect()
}

/// Keep only what eligibility reads from a pod, so the operator's pod cache stays small:
/// metadata without managed fields, the node name, phase, IP and conditions.
pub fn strip_pod(pod: &mut Pod) {
    pod.metadata.managed_fields = None;
    if let Some(spec) = pod.spec.as_mut() {
        let node_name = spec.node_name.take();
        *spec = Default::default();
        spec.node_name = node_name;
    }
    if let Some(status) = pod.status.as_mut() {
        let keep = k8s_openapi::api::core::v1::PodStatus {
            phase: status.phase.take(),
            pod_ip: status.pod_ip.take(),
            conditions: status
                .conditions
                .take()
                .map(|cs| cs.into_iter().filter(|c| c.type_ == "Ready").collect()),
            ..Default::default()
        };
        *status = keep;
    }
}
