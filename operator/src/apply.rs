//! Server-side apply of owned objects, skipped when the cached live object already matches,
//! and pruning of owned objects that are no longer wanted.
//!
//! An object is up to date when the live copy carries the hash of the desired object
//! ([`contract::ANNOTATION_APPLIED_HASH`], so a field removed from the desired object is
//! removed from the live one too) and still contains every desired field (so a hand edit of
//! a field the operator owns is reverted on the next reconcile). A re-apply that changes
//! nothing costs one request and triggers no watch event.

use std::fmt::Debug;

use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, Resource, ResourceExt};
use kvroute_crds::contract;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::{Error, Result};

/// Whether every field of `desired` is in `live` with the same value. Arrays must have the
/// same length and match element-wise; numbers compare by value; an empty or null desired
/// value matches an absent live one.
pub fn json_subset(desired: &Value, live: &Value) -> bool {
    match (desired, live) {
        (Value::Object(d), Value::Object(l)) => d.iter().all(|(k, dv)| match l.get(k) {
            Some(lv) => json_subset(dv, lv),
            None => is_empty(dv),
        }),
        (Value::Array(d), Value::Array(l)) => {
            d.len() == l.len() && d.iter().zip(l).all(|(a, b)| json_subset(a, b))
        }
        (Value::Number(a), Value::Number(b)) => a.as_f64() == b.as_f64(),
        (d, Value::Null) => is_empty(d),
        (d, l) => d == l,
    }
}

fn is_empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => false,
    }
}

fn applied_hash<K: Resource>(obj: &K) -> Option<&String> {
    obj.meta()
        .annotations
        .as_ref()
        .and_then(|a| a.get(contract::ANNOTATION_APPLIED_HASH))
}

/// Whether `live` already is what applying `desired` would make it.
pub fn up_to_date<K: Resource + Serialize>(desired: &K, live: &K) -> bool {
    if applied_hash(desired).is_none() || applied_hash(desired) != applied_hash(live) {
        return false;
    }
    match (serde_json::to_value(desired), serde_json::to_value(live)) {
        (Ok(d), Ok(l)) => json_subset(&d, &l),
        _ => false,
    }
}

fn params() -> PatchParams {
    PatchParams::apply(contract::FIELD_MANAGER).force()
}

/// Apply `obj` unless the cached live copy is up to date. Returns whether a request was sent.
pub async fn apply<K>(client: &Client, store: &Store<K>, obj: &K) -> Result<bool>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + Serialize
        + DeserializeOwned
        + Debug,
{
    let (ns, name) = namespaced_name(obj)?;
    let live = store.get(&ObjectRef::new(&name).within(&ns));
    patch_unless_current(
        Api::namespaced(client.clone(), &ns),
        &name,
        obj,
        live.as_deref(),
    )
    .await
}

/// Apply `obj` of a kind the operator does not watch (Secrets: it keeps no cache of them and
/// may not list them), reading the one object first. Returns whether a write was sent.
pub async fn apply_uncached<K>(client: &Client, obj: &K) -> Result<bool>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + Serialize
        + DeserializeOwned
        + Debug,
{
    let (ns, name) = namespaced_name(obj)?;
    let api: Api<K> = Api::namespaced(client.clone(), &ns);
    let live = api.get_opt(&name).await.map_err(|source| Error::Read {
        what: format!("{} {name}", K::kind(&())),
        source,
    })?;
    patch_unless_current(api, &name, obj, live.as_ref()).await
}

fn namespaced_name<K: Resource>(obj: &K) -> Result<(String, String)> {
    let ns = obj
        .namespace()
        .ok_or(Error::MissingObjectKey("metadata.namespace"))?;
    Ok((ns, obj.name_any()))
}

/// Server-side apply `obj` as `name` unless `live` is already what that would make it.
async fn patch_unless_current<K>(api: Api<K>, name: &str, obj: &K, live: Option<&K>) -> Result<bool>
where
    K: Resource<DynamicType = ()> + Clone + Serialize + DeserializeOwned + Debug,
{
    if live.is_some_and(|l| up_to_date(obj, l)) {
        return Ok(false);
    }
    api.patch(name, &params(), &Patch::Apply(obj))
        .await
        .map_err(|source| Error::Apply {
            kind: K::kind(&()).into_owned(),
            name: name.to_owned(),
            source,
        })?;
    Ok(true)
}

/// Apply a dynamic object (no cache: read it first). Returns whether a write was sent.
pub async fn apply_dynamic(client: &Client, obj: &DynamicObject) -> Result<bool> {
    let ar = crate::desired::gateway_pool_resource();
    let (ns, name) = namespaced_name(obj)?;
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &ar);
    let live = api.get_opt(&name).await.map_err(|source| Error::Read {
        what: format!("{} {name}", ar.kind),
        source,
    })?;
    if live.as_ref().is_some_and(|l| up_to_date(obj, l)) {
        return Ok(false);
    }
    let mut body = obj.clone();
    body.types = Some(kube::api::TypeMeta {
        api_version: ar.api_version.clone(),
        kind: ar.kind.clone(),
    });
    api.patch(&name, &params(), &Patch::Apply(&body))
        .await
        .map_err(|source| Error::Apply {
            kind: ar.kind.clone(),
            name: name.clone(),
            source,
        })?;
    Ok(true)
}

/// Whether `obj` is controlled by the object with `owner_uid`.
pub fn owned_by<K: Resource>(obj: &K, owner_uid: &str) -> bool {
    obj.meta().owner_references.as_ref().is_some_and(|refs| {
        refs.iter()
            .any(|r| r.uid == owner_uid && r.controller == Some(true))
    })
}

/// Delete the cached objects of `namespace` controlled by `owner_uid` whose names are not in
/// `keep`. Returns the deleted names.
pub async fn prune<K>(
    client: &Client,
    store: &Store<K>,
    namespace: &str,
    owner_uid: &str,
    keep: &[String],
) -> Result<Vec<String>>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + Debug,
{
    let mut stale: Vec<String> = store
        .state()
        .iter()
        .filter(|o| o.namespace().as_deref() == Some(namespace))
        .filter(|o| owned_by(o.as_ref(), owner_uid))
        .map(|o| o.name_any())
        .filter(|n| !keep.contains(n))
        .collect();
    stale.sort();
    let api: Api<K> = Api::namespaced(client.clone(), namespace);
    for name in &stale {
        match api.delete(name, &DeleteParams::background()).await {
            Ok(_) => {}
            // already gone: the cache was behind
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(source) => {
                return Err(Error::Delete {
                    kind: K::kind(&()).into_owned(),
                    name: name.clone(),
                    source,
                });
            }
        }
    }
    Ok(stale)
}

/// Delete exported gateway pools of this pool that are no longer wanted (no cache: list them
/// by label).
pub async fn prune_dynamic(
    client: &Client,
    namespace: &str,
    pool: &str,
    owner_uid: &str,
    keep: &[String],
) -> Result<Vec<String>> {
    let ar = crate::desired::gateway_pool_resource();
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, &ar);
    let lp = kube::api::ListParams::default().labels(&format!("{}={pool}", contract::LABEL_POOL));
    let list = api.list(&lp).await.map_err(|source| Error::Read {
        what: format!("{} list", ar.kind),
        source,
    })?;
    let mut deleted = Vec::new();
    for o in list.items {
        let name = o.name_any();
        if keep.contains(&name) || !owned_by(&o, owner_uid) {
            continue;
        }
        match api.delete(&name, &DeleteParams::background()).await {
            Ok(_) => deleted.push(name),
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(source) => {
                return Err(Error::Delete {
                    kind: ar.kind.clone(),
                    name,
                    source,
                });
            }
        }
    }
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn subset_ignores_fields_the_server_adds() {
        let desired =
            json!({"spec": {"ports": [{"port": 8080, "name": "http"}], "type": "ClusterIP"}});
        let live = json!({"spec": {"ports": [{"port": 8080, "name": "http", "protocol": "TCP"}], "type": "ClusterIP", "clusterIP": "10.0.0.1"}});
        assert!(json_subset(&desired, &live));
    }

    #[test]
    fn subset_sees_changed_values_and_list_lengths() {
        let desired = json!({"spec": {"replicas": 2}});
        assert!(!json_subset(&desired, &json!({"spec": {"replicas": 1}})));
        assert!(json_subset(&desired, &json!({"spec": {"replicas": 2.0}})));
        let desired = json!({"endpoints": [{"addresses": ["10.0.0.1"]}]});
        assert!(!json_subset(&desired, &json!({"endpoints": []})));
        assert!(json_subset(&json!({"endpoints": []}), &json!({})));
        assert!(!json_subset(&json!({"a": "x"}), &json!({})));
    }
}
