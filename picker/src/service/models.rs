//! `GET /v1/models`: the engines' own model lists, merged per model, with the pool's routing
//! facts added.
//!
//! A client sizes its prompts from `max_model_len` and shows `created` and `owned_by`; those
//! are the engines' to say, not the picker's. So the picker asks up to
//! [`ASKED_PER_CONFIG`] Ready endpoints of each model config for their list (in parallel,
//! within [`ASK_TIMEOUT`], at most [`MAX_LIST_BYTES`] each) and merges the entries of the
//! models the pool serves (a config's model and its LoRA adapters) by id: the first answer's
//! fields, `max_model_len` the least any endpoint reports (a prompt must fit wherever it is
//! routed) and `created` the earliest. Each entry gains a `kvroute` object: the model configs
//! that serve it and how many of their endpoints are Ready. A model no endpoint answered for
//! (none Ready, or none answering in time) is listed from the pool's declaration alone, as
//! before: `owned_by: kvroute`, no `max_model_len`.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value, json};

use super::state::PickerState;
use crate::endpoint::EndpointState;

/// Ready endpoints of one model config asked for their model list.
pub const ASKED_PER_CONFIG: usize = 2;
/// How long an endpoint has to answer.
pub const ASK_TIMEOUT: Duration = Duration::from_secs(2);
/// The largest model list read from one endpoint.
pub const MAX_LIST_BYTES: usize = 1 << 20;

/// One model the pool serves, as the answer builds it.
struct Listed {
    entry: Option<Map<String, Value>>,
    /// The pool's own entry, when no endpoint describes the model.
    declared: Map<String, Value>,
    configs: Vec<String>,
    ready: usize,
}

/// The merged list, in the order the pool declares its models.
pub async fn list(picker: &PickerState) -> Value {
    let catalog = picker.catalog();
    let snapshot = picker.pool.state().endpoints();
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut order: Vec<String> = Vec::new();
    let mut listed: BTreeMap<String, Listed> = BTreeMap::new();
    let mut asks = Vec::new();
    for (name, entry) in catalog.iter() {
        let base = entry.spec.model.clone();
        let ready: Vec<_> = snapshot
            .endpoints()
            .iter()
            .filter(|e| &*e.model_config.name == name && e.state == EndpointState::Ready)
            .collect();
        let mut hosts: Vec<String> = ready.iter().map(|e| e.id.host_port()).collect();
        hosts.sort_unstable();
        hosts.dedup(); // the ranks of one server answer once
        let ids = std::iter::once((base.clone(), None))
            .chain(
                entry
                    .spec
                    .lora_adapters
                    .iter()
                    .map(|a| (a.clone(), Some(base.clone()))),
            )
            .collect::<Vec<_>>();
        for (id, parent) in &ids {
            let item = listed.entry(id.clone()).or_insert_with(|| {
                order.push(id.clone());
                let mut declared = Map::new();
                declared.insert("id".into(), id.as_str().into());
                declared.insert("object".into(), "model".into());
                declared.insert("created".into(), created.into());
                declared.insert("owned_by".into(), "kvroute".into());
                declared.insert("root".into(), id.as_str().into());
                declared.insert("parent".into(), parent.clone().into());
                Listed {
                    entry: None,
                    declared,
                    configs: Vec::new(),
                    ready: 0,
                }
            });
            item.configs.push(name.clone());
            item.ready += ready.len();
        }
        for host in hosts.into_iter().take(ASKED_PER_CONFIG) {
            let ids: Vec<String> = ids.iter().map(|(id, _)| id.clone()).collect();
            asks.push(async move { (ids, ask(picker, &host).await) });
        }
    }
    for (ids, answer) in futures::future::join_all(asks).await {
        let Some(data) = answer else { continue };
        for model in data {
            let Some(id) = model.get("id").and_then(Value::as_str) else {
                continue;
            };
            if !ids.iter().any(|i| i == id) {
                continue; // not a model this config routes
            }
            if let Some(item) = listed.get_mut(id) {
                merge(&mut item.entry, model);
            }
        }
    }
    let data: Vec<Value> = order
        .iter()
        .filter_map(|id| listed.remove(id))
        .map(|item| {
            let mut entry = item.entry.unwrap_or(item.declared);
            entry.insert(
                "kvroute".into(),
                json!({"model_configs": item.configs, "ready_endpoints": item.ready}),
            );
            Value::Object(entry)
        })
        .collect();
    json!({"object": "list", "data": data})
}

/// The entries of one endpoint's `/v1/models`, or `None` when it does not answer with one.
async fn ask(picker: &PickerState, host: &str) -> Option<Vec<Map<String, Value>>> {
    let timeout = ASK_TIMEOUT.min(picker.limits.upstream_timeout);
    let resp = tokio::time::timeout(
        timeout,
        picker.http.get(format!("http://{host}/v1/models")).send(),
    )
    .await
    .ok()?
    .ok()?;
    if !resp.status().is_success() {
        return None;
    }
    let body = super::disagg::read_bounded(resp, MAX_LIST_BYTES, timeout, "a model list")
        .await
        .ok()?;
    let list: Value = serde_json::from_slice(&body).ok()?;
    let Value::Array(data) = list.get("data")?.clone() else {
        return None;
    };
    Some(
        data.into_iter()
            .filter_map(|m| match m {
                Value::Object(m) => Some(m),
                _ => None,
            })
            .collect(),
    )
}

/// Folds one endpoint's entry into the merged one: the first answer's fields, the least
/// `max_model_len`, the earliest `created`.
fn merge(merged: &mut Option<Map<String, Value>>, model: Map<String, Value>) {
    let Some(have) = merged else {
        *merged = Some(model);
        return;
    };
    for key in ["max_model_len", "created"] {
        if let Some(theirs) = model.get(key).and_then(Value::as_u64) {
            let least = have
                .get(key)
                .and_then(Value::as_u64)
                .map_or(theirs, |ours| ours.min(theirs));
            have.insert(key.into(), least.into());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => unreachable!("an object"),
        }
    }

    #[test]
    fn entries_merge_to_the_least_length_and_the_earliest_creation() {
        let mut merged = None;
        merge(
            &mut merged,
            entry(json!({"id": "m", "created": 20, "max_model_len": 8192, "owned_by": "vllm"})),
        );
        merge(
            &mut merged,
            entry(json!({"id": "m", "created": 10, "max_model_len": 4096, "owned_by": "x"})),
        );
        merge(&mut merged, entry(json!({"id": "m", "created": 30})));
        assert_eq!(
            Value::Object(merged.expect("merged")),
            json!({"id": "m", "created": 10, "max_model_len": 4096, "owned_by": "vllm"})
        );
    }
}
