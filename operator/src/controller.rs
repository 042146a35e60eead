//! The watch plumbing around [`crate::reconcile`]: caches of pods and owned objects, and a
//! `kube::runtime::Controller` for InferencePools triggered by the pools, the pods their
//! selectors match, and the objects they own.

use std::fmt::Debug;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service, ServiceAccount};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::Api;
use kube::runtime::controller::{self, Controller};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use kvroute_crds::contract;
use kvroute_crds::kvroute_pool::KVRoutePool;
use serde::de::DeserializeOwned;

use crate::eligibility::strip_pod;
use crate::reconcile::{Context, Stores, error_policy, reconcile};

fn api<K>(client: &Client, namespace: Option<&str>) -> Api<K>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// A cache of `K` and the stream of its watch events, which keeps the cache current as the
/// controller consumes it. Each stream backs off on its own errors (client-go's schedule), so
/// one failing watch delays only itself.
fn cached<K>(
    api: Api<K>,
    config: watcher::Config,
    mut trim: impl FnMut(&mut K) + Send + 'static,
) -> (
    Store<K>,
    impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
)
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    let (reader, writer) = reflector::store();
    let stream = watcher(api, config)
        .default_backoff()
        .modify(move |o: &mut K| {
            o.meta_mut().managed_fields = None;
            trim(o);
        })
        .reflect(writer);
    (reader, stream)
}

/// The controller's pause after an error on its merged trigger streams: none, because every
/// watch stream already backs off by itself ([`cached`]). kube-runtime's default pauses the
/// whole merge, so while it waits no watch is polled, and each further error (after an API
/// server restart every watch reports one `410 Expired` as it re-lists) lengthens the pause:
/// the operator was deaf for minutes after a restart that lasted seconds.
#[derive(Clone, Copy, Debug, Default)]
struct NoMergedPause;

impl Iterator for NoMergedPause {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        Some(Duration::ZERO)
    }
}

impl kube::runtime::utils::Backoff for NoMergedPause {
    fn reset(&mut self) {}
}

/// Pools a pod change may affect: those whose selector matches it now, and those whose
/// EndpointSlices still list it (its labels changed, or it was deleted).
pub fn pools_for_pod(
    pod: &Pod,
    pools: &Store<KVRoutePool>,
    slices: &Store<EndpointSlice>,
) -> Vec<ObjectRef<KVRoutePool>> {
    let Some(ns) = pod.namespace() else {
        return Vec::new();
    };
    let name = pod.name_any();
    let labels = pod.labels().clone();
    let mut out: Vec<ObjectRef<KVRoutePool>> = pools
        .state()
        .iter()
        .filter(|p| p.namespace().as_deref() == Some(ns.as_str()))
        // a pool naming a Gateway API InferencePool learns its selector when reconciled
        .filter(|p| p.spec.selector.as_ref().is_none_or(|s| s.matches(&labels)))
        .map(|p| ObjectRef::from_obj(p.as_ref()))
        .collect();
    for s in slices.state() {
        if s.namespace().as_deref() != Some(ns.as_str()) {
            continue;
        }
        let lists_pod = s.endpoints.iter().flatten().any(|e| {
            e.target_ref
                .as_ref()
                .is_some_and(|r| r.name.as_deref() == Some(name.as_str()))
        });
        if !lists_pod {
            continue;
        }
        if let Some(pool) = s.labels().get(contract::LABEL_POOL) {
            let r = ObjectRef::new(pool).within(&ns);
            if !out.contains(&r) {
                out.push(r);
            }
        }
    }
    out
}

/// Run the controller until `shutdown` resolves. `on_synced` is called once every cache has
/// its first full list.
pub async fn run(
    client: Client,
    namespace: Option<String>,
    make_context: impl FnOnce(Stores) -> Context,
    on_synced: impl FnOnce() + Send + 'static,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let ns = namespace.as_deref();
    let managed = watcher::Config::default().labels(&format!(
        "{}={}",
        contract::LABEL_MANAGED_BY,
        contract::MANAGED_BY
    ));
    let (pods, pod_stream) = cached(
        api::<Pod>(&client, ns),
        watcher::Config::default(),
        strip_pod,
    );
    let (slices, slice_stream) = cached(api::<EndpointSlice>(&client, ns), managed.clone(), |_| {});
    let (config_maps, cm_stream) = cached(api::<ConfigMap>(&client, ns), managed.clone(), |_| {});
    let (service_accounts, sa_stream) =
        cached(api::<ServiceAccount>(&client, ns), managed.clone(), |_| {});
    let (roles, role_stream) = cached(api::<Role>(&client, ns), managed.clone(), |_| {});
    let (role_bindings, rb_stream) =
        cached(api::<RoleBinding>(&client, ns), managed.clone(), |_| {});
    let (deployments, deploy_stream) =
        cached(api::<Deployment>(&client, ns), managed.clone(), |_| {});
    let (services, svc_stream) = cached(api::<Service>(&client, ns), managed, |_| {});
    let stores = Stores {
        pods,
        slices,
        config_maps,
        service_accounts,
        roles,
        role_bindings,
        deployments,
        services,
    };
    let ctx = Arc::new(make_context(stores.clone()));

    let (pools, pool_stream) = cached(
        api::<KVRoutePool>(&client, ns),
        watcher::Config::default().any_semantic(),
        |_| {},
    );
    let controller = Controller::for_stream(pool_stream.applied_objects(), pools)
        .trigger_backoff(NoMergedPause)
        .with_config(
            controller::Config::default()
                .debounce(Duration::from_millis(100))
                .concurrency(4),
        );
    let pools = controller.store();
    {
        let s = stores.clone();
        let pools = pools.clone();
        tokio::spawn(async move {
            let all = async {
                pools.wait_until_ready().await?;
                s.pods.wait_until_ready().await?;
                s.slices.wait_until_ready().await?;
                s.config_maps.wait_until_ready().await?;
                s.service_accounts.wait_until_ready().await?;
                s.roles.wait_until_ready().await?;
                s.role_bindings.wait_until_ready().await?;
                s.deployments.wait_until_ready().await?;
                s.services.wait_until_ready().await
            };
            if all.await.is_ok() {
                on_synced();
            }
        });
    }
    let slices_for_map = stores.slices.clone();
    controller
        .owns_stream(slice_stream.touched_objects())
        .owns_stream(cm_stream.touched_objects())
        .owns_stream(sa_stream.touched_objects())
        .owns_stream(role_stream.touched_objects())
        .owns_stream(rb_stream.touched_objects())
        .owns_stream(deploy_stream.touched_objects())
        .owns_stream(svc_stream.touched_objects())
        .watches_stream(pod_stream.touched_objects(), move |pod: Pod| {
            pools_for_pod(&pod, &pools, &slices_for_map)
        })
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|r| async move {
            match r {
                Ok((pool, _)) => {
                    tracing::debug!(pool = %pool.name, namespace = ?pool.namespace, "reconciled")
                }
                // a watch that fails (a KVRoutePool this operator cannot read, after a CRD
                // upgrade without the operator's, say) would otherwise leave pools unreconciled
                // without a word
                Err(controller::Error::QueueError(e)) => {
                    tracing::warn!(error = %e, "watching the pools and their objects failed")
                }
                Err(e) => tracing::debug!(error = %e, "reconcile not completed"),
            }
        })
        .await;
}
