//! One reconcile of one pool: validate → build → apply → update status.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service, ServiceAccount};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, Resource, ResourceExt};
use kvroute_crds::contract;
use kvroute_crds::kvroute_pool::{KVRoutePool, KVRoutePoolStatus};
use serde_json::json;
use tokio::sync::Mutex;

use crate::apply;
use crate::desired::{self, BuildSettings, Desired};
use crate::eligibility;
use crate::error::{Error, Result};
use crate::gateway_ref;
use crate::metrics::Metrics;
use crate::status::{self, GatewayState, Observed, PickerObserved};

/// How often a pool is reconciled without any change (drift repair).
pub const RESYNC: Duration = Duration::from_secs(300);

/// Caches of the objects reconciles read: pods (stripped), and what the operator owns.
#[derive(Clone)]
pub struct Stores {
    pub pods: Store<Pod>,
    pub slices: Store<EndpointSlice>,
    pub config_maps: Store<ConfigMap>,
    pub service_accounts: Store<ServiceAccount>,
    pub roles: Store<Role>,
    pub role_bindings: Store<RoleBinding>,
    pub deployments: Store<Deployment>,
    pub services: Store<Service>,
}

/// Whether the Gateway API Inference Extension CRD is installed, re-checked at most once per
/// interval.
#[derive(Debug)]
pub struct GatewayDiscovery {
    checked: Mutex<Option<(Instant, bool)>>,
    ttl: Duration,
}

impl GatewayDiscovery {
    pub fn new(ttl: Duration) -> Self {
        Self {
            checked: Mutex::new(None),
            ttl,
        }
    }

    /// A fixed answer (tests).
    pub fn fixed(installed: bool) -> Self {
        Self {
            checked: Mutex::new(Some((Instant::now(), installed))),
            ttl: Duration::MAX,
        }
    }

    pub async fn installed(&self, client: &Client) -> Result<bool> {
        let mut checked = self.checked.lock().await;
        if let Some((at, v)) = *checked
            && at.elapsed() < self.ttl
        {
            return Ok(v);
        }
        let ar = desired::gateway_pool_resource();
        let installed = match client.list_api_group_resources(&ar.api_version).await {
            Ok(list) => list.resources.iter().any(|r| r.name == ar.plural),
            Err(kube::Error::Api(e)) if e.code == 404 => false,
            Err(source) => {
                return Err(Error::Read {
                    what: format!("API group {}", ar.api_version),
                    source,
                });
            }
        };
        *checked = Some((Instant::now(), installed));
        Ok(installed)
    }
}

/// Everything a reconcile needs.
pub struct Context {
    pub client: Client,
    pub stores: Stores,
    pub settings: BuildSettings,
    pub metrics: Arc<Metrics>,
    pub recorder: Recorder,
    pub gateway: GatewayDiscovery,
    /// The clock of condition transition times.
    pub now: Box<dyn Fn() -> Time + Send + Sync>,
}

impl Context {
    pub fn new(
        client: Client,
        stores: Stores,
        settings: BuildSettings,
        metrics: Arc<Metrics>,
        instance: String,
    ) -> Self {
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: contract::FIELD_MANAGER.into(),
                instance: Some(instance),
            },
        );
        Self {
            client,
            stores,
            settings,
            metrics,
            recorder,
            gateway: GatewayDiscovery::new(Duration::from_secs(60)),
            now: Box::new(now_seconds),
        }
    }
}

/// Now, at the seconds precision the API server keeps (so a re-read status compares equal).
pub fn now_seconds() -> Time {
    let now = k8s_openapi::jiff::Timestamp::now();
    Time(k8s_openapi::jiff::Timestamp::from_second(now.as_second()).unwrap_or(now))
}

/// The controller's reconcile function.
pub async fn reconcile(pool: Arc<KVRoutePool>, ctx: Arc<Context>) -> Result<Action> {
    let started = Instant::now();
    let result = reconcile_pool(&pool, &ctx).await;
    ctx.metrics
        .reconciled(result.as_ref().map(|_| ()), started.elapsed());
    result
}

/// Retry failed reconciles with a delay (the controller adds its own backoff on top).
pub fn error_policy(pool: Arc<KVRoutePool>, error: &Error, _ctx: Arc<Context>) -> Action {
    tracing::warn!(pool = %pool.name_any(), namespace = ?pool.namespace(), error = %error, kind = error.metric_label(), "reconcile failed");
    Action::requeue(Duration::from_secs(15))
}

pub async fn reconcile_pool(pool: &KVRoutePool, ctx: &Context) -> Result<Action> {
    if pool.metadata.deletion_timestamp.is_some() {
        // owned objects go by garbage collection (owner references): nothing to clean here
        return Ok(Action::await_change());
    }
    let namespace = pool
        .namespace()
        .ok_or(Error::MissingObjectKey("metadata.namespace"))?;
    let name = pool.name_any();
    let now = (ctx.now)();

    // validate
    if let Err(msg) = pool.spec.validate(&name) {
        invalid(ctx, pool, &namespace, msg, &now).await?;
        return Ok(Action::await_change());
    }

    // a referenced Gateway API InferencePool supplies the selector and the ports
    let referenced = match &pool.spec.inference_pool_ref {
        Some(r) => Some(gateway_ref::fetch(&ctx.client, &namespace, &r.name).await?),
        None => None,
    };
    let resolved_pool;
    let effective = match &referenced {
        None => pool,
        Some(Err(msg)) => {
            invalid(ctx, pool, &namespace, msg.clone(), &now).await?;
            return Ok(Action::requeue(gateway_ref::GATEWAY_REF_RESYNC));
        }
        Some(Ok(gw)) => match pool.spec.resolve(&gw.spec) {
            Ok(spec) => {
                resolved_pool = KVRoutePool {
                    spec,
                    ..pool.clone()
                };
                &resolved_pool
            }
            Err(msg) => {
                let msg = format!("inferencePoolRef: {msg}");
                let mine = gateway_ref::entry(gw, pool, &namespace, &Err(msg.clone()), &now);
                gateway_ref::write_entry(&ctx.client, gw, mine).await?;
                invalid(ctx, pool, &namespace, msg, &now).await?;
                return Ok(Action::requeue(gateway_ref::GATEWAY_REF_RESYNC));
            }
        },
    };

    // build
    let pods = ctx.stores.pods.state();
    let resolved =
        eligibility::resolve(&effective.spec, &namespace, pods.iter().map(|p| p.as_ref()));
    let desired = desired::build(effective, &resolved, &ctx.settings)?;

    // apply
    let gateway = apply_desired(ctx, effective, &namespace, &desired).await?;

    // update status
    let observed = Observed {
        validity: Ok(()),
        resolved: &resolved,
        slice_names: &desired.slice_names,
        picker: observe_picker(pool, &namespace, &ctx.stores.deployments),
        gateway,
    };
    let next = status::compute(effective, &observed, &now);
    if let Some(Ok(gw)) = &referenced {
        let endpoints = if next.ready_endpoints > 0 {
            Ok(())
        } else {
            Err("no eligible endpoint yet: see the KVRoutePool's status".to_owned())
        };
        let mine = gateway_ref::entry(gw, pool, &namespace, &endpoints, &now);
        gateway_ref::write_entry(&ctx.client, gw, mine).await?;
    }
    let events: Vec<(String, String, String)> =
        status::new_misconfigurations(pool.status.as_ref(), &next)
            .into_iter()
            .map(|(mc, p)| {
                (
                    p.reason.as_str().to_owned(),
                    format!(
                        "pod {} is not eligible for model config {mc}: {}",
                        p.pod, p.message
                    ),
                    p.pod.clone(),
                )
            })
            .collect();
    write_status(ctx, pool, &namespace, next).await?;
    for (reason, note, _) in events {
        publish(ctx, pool, EventType::Warning, &reason, note).await;
    }
    Ok(Action::requeue(if referenced.is_some() {
        gateway_ref::GATEWAY_REF_RESYNC
    } else {
        RESYNC
    }))
}

/// Reports an invalid spec (or an unresolvable reference): `ConfigValid=False` with `msg`, and
/// a Warning Event when it newly became so.
async fn invalid(
    ctx: &Context,
    pool: &KVRoutePool,
    namespace: &str,
    msg: String,
    now: &Time,
) -> Result<()> {
    let observed = Observed {
        validity: Err(msg.clone()),
        resolved: &[],
        slice_names: &Default::default(),
        picker: observe_picker(pool, namespace, &ctx.stores.deployments),
        gateway: GatewayState::NotRequested,
    };
    let next = status::compute(pool, &observed, now);
    let announce = status::newly_invalid(pool.status.as_ref(), &next);
    write_status(ctx, pool, namespace, next).await?;
    if announce {
        publish(ctx, pool, EventType::Warning, "InvalidSpec", msg).await;
    }
    Ok(())
}

fn observe_picker(
    pool: &KVRoutePool,
    namespace: &str,
    deployments: &Store<Deployment>,
) -> PickerObserved {
    let name = contract::picker_name(&pool.name_any());
    let live = deployments.get(&ObjectRef::new(&name).within(namespace));
    PickerObserved {
        service: name,
        desired_replicas: pool.spec.picker.replicas,
        available_replicas: live.map(|d| {
            d.status
                .as_ref()
                .and_then(|s| s.available_replicas)
                .unwrap_or(0)
        }),
    }
}

fn names<K: Resource>(objs: &[K]) -> Vec<String> {
    objs.iter()
        .map(|o| o.meta().name.clone().unwrap_or_default())
        .collect()
}

/// Apply everything, then prune what is no longer wanted. Returns the gateway export state.
async fn apply_desired(
    ctx: &Context,
    pool: &KVRoutePool,
    namespace: &str,
    d: &Desired,
) -> Result<GatewayState> {
    let client = &ctx.client;
    let s = &ctx.stores;
    let uid = pool
        .metadata
        .uid
        .clone()
        .ok_or(Error::MissingObjectKey("metadata.uid"))?;
    let m = &ctx.metrics;
    if let Some((sa, role, binding)) = &d.rbac {
        m.wrote(
            "ServiceAccount",
            usize::from(apply::apply(client, &s.service_accounts, sa).await?),
        );
        m.wrote(
            "Role",
            usize::from(apply::apply(client, &s.roles, role).await?),
        );
        m.wrote(
            "RoleBinding",
            usize::from(apply::apply(client, &s.role_bindings, binding).await?),
        );
    }
    m.wrote(
        "ConfigMap",
        usize::from(apply::apply(client, &s.config_maps, &d.config_map).await?),
    );
    m.wrote(
        "Service",
        usize::from(apply::apply(client, &s.services, &d.service).await?)
            + usize::from(apply::apply(client, &s.services, &d.peer_service).await?),
    );
    if let Some(secret) = &d.peer_secret {
        // before the Deployment: a picker mounting it must find it
        m.wrote(
            "Secret",
            usize::from(apply::apply_uncached(client, secret).await?),
        );
    }
    m.wrote(
        "Deployment",
        usize::from(apply::apply(client, &s.deployments, &d.deployment).await?),
    );
    let mut slices_written = 0;
    for slice in &d.slices {
        slices_written += usize::from(apply::apply(client, &s.slices, slice).await?);
    }
    m.wrote("EndpointSlice", slices_written);

    // prune: slices of removed model configs or chunks, and the per-pool RBAC when the pool
    // switched to its own ServiceAccount
    let pruned = apply::prune(client, &s.slices, namespace, &uid, &names(&d.slices)).await?;
    m.wrote("EndpointSlice", pruned.len());
    if d.rbac.is_none() {
        let pruned = apply::prune(client, &s.role_bindings, namespace, &uid, &[])
            .await?
            .len()
            + apply::prune(client, &s.roles, namespace, &uid, &[])
                .await?
                .len()
            + apply::prune(client, &s.service_accounts, namespace, &uid, &[])
                .await?
                .len();
        m.wrote("RBAC", pruned);
    }

    // Gateway API Inference Extension export
    let requested = pool.spec.gateway.is_some_and(|g| g.export_inference_pool);
    let installed = if requested
        || pool.status.as_ref().is_some_and(|st| {
            st.condition(kvroute_crds::kvroute_pool::condition::GATEWAY_EXPORTED)
                .is_some()
        }) {
        ctx.gateway.installed(client).await?
    } else {
        false
    };
    if !installed {
        return Ok(if requested {
            GatewayState::CrdMissing
        } else {
            GatewayState::NotRequested
        });
    }
    let mut written = 0;
    for gp in &d.gateway_pools {
        written += usize::from(apply::apply_dynamic(client, gp).await?);
    }
    let keep: Vec<String> = d.gateway_pools.iter().map(|o| o.name_any()).collect();
    written += apply::prune_dynamic(client, namespace, &pool.name_any(), &uid, &keep)
        .await?
        .len();
    m.wrote("InferencePool.inference.networking.k8s.io", written);
    Ok(if requested {
        GatewayState::Exported(keep)
    } else {
        GatewayState::NotRequested
    })
}

/// Write the status when it differs from the pool's current one.
async fn write_status(
    ctx: &Context,
    pool: &KVRoutePool,
    namespace: &str,
    next: KVRoutePoolStatus,
) -> Result<()> {
    if pool.status.as_ref() == Some(&next) {
        return Ok(());
    }
    let name = pool.name_any();
    let api: Api<KVRoutePool> = Api::namespaced(ctx.client.clone(), namespace);
    let body = json!({
        "apiVersion": KVRoutePool::api_version(&()),
        "kind": KVRoutePool::kind(&()),
        "status": next,
    });
    api.patch_status(
        &name,
        &PatchParams::apply(contract::FIELD_MANAGER).force(),
        &Patch::Apply(&body),
    )
    .await
    .map_err(|source| Error::UpdateStatus {
        name: name.clone(),
        source,
    })?;
    ctx.metrics.status_written();
    Ok(())
}

/// Publish an Event about the pool; failures are logged, never fatal.
async fn publish(ctx: &Context, pool: &KVRoutePool, type_: EventType, reason: &str, note: String) {
    let ev = Event {
        type_,
        reason: reason.to_owned(),
        note: Some(note),
        action: "Reconcile".into(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&ev, &pool.object_ref(&())).await {
        tracing::warn!(pool = %pool.name_any(), error = %e, "cannot publish event");
    }
}
