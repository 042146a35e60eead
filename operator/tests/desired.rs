//! The desired objects: EndpointSlices with ranks as named ports, the picker's objects, and
//! the rendered picker config (parsed by the picker itself).

mod common;

use common::*;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::ResourceExt;
use kvroute_crds::contract;
use kvroute_operator::desired::{BuildSettings, Desired, build, render_picker_config};
use kvroute_operator::eligibility::resolve;
use serde_json::{Value, json};

fn desired_for(spec: Value, pods: &[Pod]) -> Desired {
    let pool = mk_pool(spec);
    let resolved = resolve(&pool.spec, NS, pods);
    build(&pool, &resolved, &BuildSettings::default()).expect("build")
}

fn ports(s: &EndpointSlice) -> Vec<(String, i32)> {
    s.ports
        .iter()
        .flatten()
        .map(|p| {
            (
                p.name.clone().unwrap_or_default(),
                p.port.unwrap_or_default(),
            )
        })
        .collect()
}

fn addresses(s: &EndpointSlice) -> Vec<String> {
    s.endpoints
        .iter()
        .flatten()
        .map(|e| e.addresses[0].clone())
        .collect()
}

fn two_pods() -> Vec<Pod> {
    vec![
        mk_pod("vllm-0").ip("10.0.0.1").ready().build(),
        mk_pod("vllm-1").ip("10.0.0.2").not_ready().build(),
    ]
}

#[test]
fn header_ranks_share_the_port_as_named_ports() {
    let d = desired_for(base_spec(), &two_pods());
    assert_eq!(d.slices.len(), 1);
    let s = &d.slices[0];
    assert_eq!(s.name_any(), "llama-llama-0");
    assert_eq!(s.address_type, "IPv4");
    assert_eq!(
        ports(s),
        [("rank-0".to_owned(), 8000), ("rank-1".to_owned(), 8000)]
    );
    assert_eq!(addresses(s), ["10.0.0.1", "10.0.0.2"]);
    let eps = s.endpoints.as_ref().expect("endpoints");
    let c = eps[1].conditions.as_ref().expect("conditions");
    assert_eq!(
        (c.ready, c.serving, c.terminating),
        (Some(false), Some(false), Some(false))
    );
    let target = eps[0].target_ref.as_ref().expect("targetRef");
    assert_eq!(
        (
            target.kind.as_deref(),
            target.name.as_deref(),
            target.uid.as_deref()
        ),
        (Some("Pod"), Some("vllm-0"), Some("uid-vllm-0"))
    );
    assert_eq!(eps[0].node_name.as_deref(), Some("node-a"));
    let labels = s.labels();
    assert_eq!(labels[contract::LABEL_POOL], "llama");
    assert_eq!(labels[contract::LABEL_MODEL_CONFIG], "llama");
    assert_eq!(
        labels[contract::LABEL_SLICE_MANAGED_BY],
        contract::SLICE_MANAGED_BY
    );
    assert!(
        !labels.contains_key("kubernetes.io/service-name"),
        "no Service may adopt these"
    );
    let owner = &s.owner_references()[0];
    assert_eq!(
        (
            owner.kind.as_str(),
            owner.uid.as_str(),
            owner.controller,
            owner.block_owner_deletion
        ),
        ("KVRoutePool", POOL_UID, Some(true), Some(true))
    );
}

#[test]
fn port_ranks_use_port_plus_rank() {
    let mut spec = base_spec();
    spec["modelConfigs"][0]["dataParallel"] = json!({"size": 4, "rankSelection": "Port"});
    let d = desired_for(spec, &two_pods());
    assert_eq!(
        ports(&d.slices[0]),
        [
            ("rank-0".to_owned(), 8000),
            ("rank-1".to_owned(), 8001),
            ("rank-2".to_owned(), 8002),
            ("rank-3".to_owned(), 8003)
        ]
    );
}

#[test]
fn large_sets_span_several_slices() {
    let mut spec = base_spec();
    spec["modelConfigs"][0]["dataParallel"] = json!({"size": 150, "rankSelection": "Header"});
    let pods: Vec<Pod> = (0..1001)
        .map(|i| {
            mk_pod(&format!("vllm-{i:04}"))
                .ip(&format!("10.0.{}.{}", i / 250, i % 250 + 1))
                .ready()
                .build()
        })
        .chain([mk_pod("v6").ip("fd00::1").ready().build()])
        .collect();
    let d = desired_for(spec, &pods);
    // (1000 + 1) IPv4 pods x 2 rank chunks + 1 IPv6 pod x 2 rank chunks
    assert_eq!(d.slices.len(), 6);
    for s in &d.slices {
        assert!(ports(s).len() <= 100);
        assert!(s.endpoints.as_ref().map_or(0, Vec::len) <= 1000);
    }
    assert_eq!(ports(&d.slices[0]).len(), 100);
    assert_eq!(ports(&d.slices[1])[0].0, "rank-100");
    assert_eq!(d.slices[5].address_type, "IPv6");
    let total: usize = d
        .slices
        .iter()
        .map(|s| s.endpoints.as_ref().map_or(0, Vec::len) * ports(s).len())
        .sum();
    assert_eq!(total, 1002 * 150, "every (pod, rank) exactly once");
    assert_eq!(d.slice_names["llama"].len(), 6);
}

#[test]
fn a_config_without_pods_still_has_an_empty_slice() {
    let d = desired_for(base_spec(), &[]);
    assert_eq!(d.slices.len(), 1);
    assert!(addresses(&d.slices[0]).is_empty());
    assert_eq!(ports(&d.slices[0]).len(), 2);
}

#[test]
fn rendered_config_is_a_valid_picker_config() {
    let mut spec = base_spec();
    spec["modelConfigs"][0]["tokenizer"] = json!({"configMap": "llama-tok"});
    spec["tenancy"] = json!({"isolation": "SaltedCache", "header": "x-tenant"});
    spec["picker"] = json!({"saltSecretRef": {"name": "salt"}});
    let pool = mk_pool(spec);
    let (text, _) = render_picker_config(&pool, true).expect("render");
    let c = kvroute_picker::service::settings::PickerConfig::from_yaml(&text)
        .unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(c.model_configs, {
        let (mcs, _) = pool.spec.for_picker(
            std::path::Path::new(contract::TOKENIZER_MOUNT_ROOT),
            std::path::Path::new(contract::SALT_MOUNT_DIR),
            &|_| false,
        );
        mcs
    });
    assert_eq!(
        c.model_configs[0]
            .tokenizer
            .as_ref()
            .and_then(|t| t.path.as_deref()),
        Some("/var/lib/kvroute/tokenizers/llama-tok/tokenizer.json")
    );
    assert_eq!(c.routing, pool.spec.routing);
    assert_eq!(
        c.tenancy.salt_secret_file.as_deref(),
        Some("/var/run/secrets/kvroute/salt/salt")
    );
    assert_eq!(c.listen.http.port(), contract::PICKER_HTTP_PORT);
    assert_eq!(
        c.listen.ext_proc.map(|a| a.port()),
        Some(contract::PICKER_EXT_PROC_PORT)
    );
    assert!(
        c.endpoints.is_empty(),
        "endpoints come from the EndpointSlices"
    );
    // replicas exchange their in-flight counts through the headless Service of their pods
    assert_eq!(
        c.peers.listen.map(|a| a.port()),
        Some(contract::PICKER_PEER_PORT)
    );
    assert_eq!(
        c.peers.dns.as_deref(),
        Some(format!("llama-peers.{NS}.svc:9190").as_str())
    );
    assert_eq!(c.peers.group, format!("{NS}/llama"));
    assert_eq!(
        c.peers.key_file.as_deref(),
        Some("/var/run/secrets/kvroute/peers/key")
    );
}

/// The operator's default picker resources (the chart's sizing rule) apply to a pool that
/// sets none; a pool's own win.
#[test]
fn a_pool_without_picker_resources_gets_the_operators_default() {
    let settings = BuildSettings {
        picker_resources: Some(
            serde_json::from_value(json!({
                "requests": {"cpu": "1", "memory": "1Gi"},
                "limits": {"memory": "3Gi"}
            }))
            .expect("resources"),
        ),
        ..BuildSettings::default()
    };
    let container = |spec: Value| {
        let pool = mk_pool(spec);
        let d = build(&pool, &resolve(&pool.spec, NS, &[]), &settings).expect("build");
        serde_json::to_value(&d.deployment).expect("json")["spec"]["template"]["spec"]["containers"]
            [0]
        .clone()
    };
    let c = container(base_spec());
    assert_eq!(c["resources"]["requests"]["memory"], "1Gi");
    assert_eq!(c["resources"]["limits"]["memory"], "3Gi");
    let mut own = base_spec();
    own["picker"] = json!({"resources": {"requests": {"cpu": "4"}}});
    let c = container(own);
    assert_eq!(c["resources"], json!({"requests": {"cpu": "4"}}));
    // the operator's own default is none
    let d = desired_for(base_spec(), &[]);
    let dep = serde_json::to_value(&d.deployment).expect("json");
    assert!(dep["spec"]["template"]["spec"]["containers"][0]["resources"].is_null());
}

/// With the operator's seed, every pool gets its own peer key in a Secret that its pickers
/// mount and name as `peers.keyFile`; without it, none.
#[test]
fn each_pool_gets_a_peer_key_derived_from_the_operators_seed() {
    use kvroute_operator::desired::PeerKeySeed;
    let seed = PeerKeySeed::new(b"an-operator-seed-0123456789\n").expect("seed");
    assert!(PeerKeySeed::new(b"short").is_err());
    let settings = BuildSettings {
        peer_key_seed: Some(seed.clone()),
        ..BuildSettings::default()
    };
    let pool = mk_pool(base_spec());
    let d = build(&pool, &resolve(&pool.spec, NS, &[]), &settings).expect("build");
    let secret = d.peer_secret.as_ref().expect("a peer Secret");
    assert_eq!(secret.name_any(), "llama-peers");
    let key = secret.data.as_ref().expect("set")[contract::PEER_KEY_FILE]
        .0
        .clone();
    assert_eq!(key.len(), 64, "hex of 32 bytes");
    // the same pool always gets the same key; another pool (another uid) another one
    assert_eq!(
        String::from_utf8(key.clone()).expect("set"),
        seed.pool_key(&pool.uid().expect("set"))
    );
    assert_ne!(
        seed.pool_key("another-uid"),
        seed.pool_key(&pool.uid().expect("set"))
    );
    let pod = d
        .deployment
        .spec
        .as_ref()
        .expect("set")
        .template
        .spec
        .as_ref()
        .expect("set");
    let vol = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "peer-key")
        .expect("volume");
    assert_eq!(
        vol.secret.as_ref().expect("set").secret_name.as_deref(),
        Some("llama-peers")
    );
    let mount = pod.containers[0]
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == "peer-key")
        .expect("mount");
    assert_eq!(mount.mount_path, contract::PEER_KEY_MOUNT_DIR);
    let text = &d.config_map.data.as_ref().expect("set")[contract::PICKER_CONFIG_KEY];
    assert!(
        text.contains("keyFile: /var/run/secrets/kvroute/peers/key"),
        "{text}"
    );
    // issue 52: the index snapshot lives in an emptyDir the config points at (the root file
    // system is read-only), and the rendered config is one the picker accepts
    let warm = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "warm-start")
        .expect("warm-start volume");
    assert!(
        warm.empty_dir
            .as_ref()
            .expect("emptyDir")
            .size_limit
            .is_some()
    );
    let mount = pod.containers[0]
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == "warm-start")
        .expect("warm-start mount");
    assert_eq!(mount.mount_path, contract::WARM_START_DIR);
    assert!(mount.read_only != Some(true));
    assert!(
        text.contains(&format!(
            "snapshotPath: {}/{}",
            contract::WARM_START_DIR,
            contract::WARM_START_SNAPSHOT
        )),
        "{text}"
    );
    // no seed: no Secret, no mount, no key file
    let d = desired_for(base_spec(), &[]);
    assert!(d.peer_secret.is_none());
    let text = &d.config_map.data.as_ref().expect("set")[contract::PICKER_CONFIG_KEY];
    assert!(!text.contains("keyFile"), "{text}");
}

#[test]
fn picker_deployment_and_service() {
    let mut spec = base_spec();
    spec["modelConfigs"][0]["tokenizer"] = json!({"configMap": "llama-tok"});
    spec["picker"] = json!({
        "replicas": 3,
        "image": "example.com/kvroute:dev",
        "imagePullPolicy": "IfNotPresent",
        "logLevel": "debug",
        "resources": {"requests": {"cpu": "500m"}},
        "saltSecretRef": {"name": "salt", "key": "k"}
    });
    let d = desired_for(spec, &[]);
    let dep = serde_json::to_value(&d.deployment).expect("json");
    assert_eq!(dep["metadata"]["name"], "llama-picker");
    let peers = serde_json::to_value(&d.peer_service).expect("json");
    assert_eq!(peers["metadata"]["name"], "llama-peers");
    assert_eq!(
        peers["spec"]["clusterIP"], "None",
        "headless: its name lists the pods"
    );
    assert_eq!(peers["spec"]["publishNotReadyAddresses"], true);
    assert_eq!(
        peers["spec"]["ports"],
        json!([{"name": "peers", "port": 9190, "targetPort": "peers", "protocol": "UDP"}])
    );
    assert_eq!(
        peers["spec"]["selector"],
        serde_json::to_value(&d.service).expect("json")["spec"]["selector"]
    );
    assert_eq!(dep["spec"]["replicas"], 3);
    let pod = &dep["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    assert_eq!(c["image"], "example.com/kvroute:dev");
    assert_eq!(c["imagePullPolicy"], "IfNotPresent");
    assert_eq!(
        c["args"],
        json!([
            "--config",
            "/etc/kvroute/picker.yaml",
            "--pool",
            "llama",
            "--namespace",
            NS,
            "--log-json"
        ])
    );
    assert_eq!(c["env"], json!([{"name": "RUST_LOG", "value": "debug"}]));
    assert_eq!(c["resources"]["requests"]["cpu"], "500m");
    assert_eq!(
        c["readinessProbe"]["httpGet"],
        json!({"path": "/readyz", "port": "metrics"})
    );
    assert_eq!(
        c["livenessProbe"]["httpGet"],
        json!({"path": "/healthz", "port": "metrics"})
    );
    let mounts: Vec<&str> = c["volumeMounts"]
        .as_array()
        .expect("mounts")
        .iter()
        .filter_map(|m| m["mountPath"].as_str())
        .collect();
    assert_eq!(
        mounts,
        [
            "/etc/kvroute",
            "/var/lib/kvroute/tokenizers/llama-tok",
            "/var/lib/kvroute/warm",
            "/var/run/secrets/kvroute/salt"
        ]
    );
    assert_eq!(
        pod["volumes"][3]["secret"],
        json!({"secretName": "salt", "items": [{"key": "k", "path": "salt"}]})
    );
    assert_eq!(pod["serviceAccountName"], "llama-picker");
    let selector = &dep["spec"]["selector"]["matchLabels"];
    let template_labels = &dep["spec"]["template"]["metadata"]["labels"];
    for (k, v) in selector.as_object().expect("selector") {
        assert_eq!(&template_labels[k], v);
    }
    let svc = serde_json::to_value(&d.service).expect("json");
    assert_eq!(svc["spec"]["selector"], *selector);
    let svc_ports: Vec<(String, u64)> = svc["spec"]["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap_or_default().to_owned(),
                p["port"].as_u64().unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        svc_ports,
        [
            ("http".to_owned(), 8080),
            ("ext-proc".to_owned(), 9002),
            ("metrics".to_owned(), 9090)
        ]
    );
    let (sa, role, binding) = d.rbac.as_ref().expect("per-pool RBAC");
    assert_eq!(sa.name_any(), "llama-picker");
    let role = serde_json::to_value(role).expect("json");
    assert_eq!(role["rules"][0]["resourceNames"], json!(["llama"]));
    assert_eq!(role["rules"][0]["verbs"], json!(["get", "list", "watch"]));
    assert_eq!(
        role["rules"][1]["resources"],
        json!(["inferencemodelrewrites", "inferenceobjectives"])
    );
    assert_eq!(role["rules"][2]["resources"], json!(["endpointslices"]));
    let binding = serde_json::to_value(binding).expect("json");
    assert_eq!(binding["subjects"][0]["name"], "llama-picker");
}

#[test]
fn an_own_service_account_replaces_the_per_pool_rbac() {
    let mut spec = base_spec();
    spec["picker"] = json!({"serviceAccountName": "shared-picker"});
    let d = desired_for(spec, &[]);
    assert!(d.rbac.is_none());
    let dep = serde_json::to_value(&d.deployment).expect("json");
    assert_eq!(
        dep["spec"]["template"]["spec"]["serviceAccountName"],
        "shared-picker"
    );
}

/// Routing edits reach pickers live through the pool resource: they change the ConfigMap
/// (kept for inspection) but not the pod template, so pickers do not restart.
#[test]
fn a_weight_change_does_not_roll_the_pickers() {
    let before = desired_for(base_spec(), &two_pods());
    let mut spec = base_spec();
    spec["routing"]["weights"] = json!({"queue": 7});
    let after = desired_for(spec, &two_pods());
    assert_ne!(before.config_map, after.config_map);
    assert_eq!(before.deployment, after.deployment);
    assert_eq!(before.slices, after.slices);
    assert_eq!(before.service, after.service);
}

#[test]
fn desired_objects_are_stamped_with_their_content_hash() {
    let a = desired_for(base_spec(), &two_pods());
    let b = desired_for(base_spec(), &two_pods());
    assert_eq!(a, b, "deterministic");
    let hash = |s: &EndpointSlice| s.annotations()[contract::ANNOTATION_APPLIED_HASH].clone();
    let c = desired_for(base_spec(), &two_pods()[..1]);
    assert_ne!(hash(&a.slices[0]), hash(&c.slices[0]));
}

#[test]
fn tenant_labels_ride_along_as_an_annotation() {
    let mut spec = base_spec();
    spec["tenancy"] = json!({
        "isolation": "DedicatedEndpoints",
        "header": "x-tenant",
        "tenants": [{"name": "a", "podSelector": {"tenant": "a"}}]
    });
    let pods = [mk_pod("vllm-0")
        .ip("10.0.0.1")
        .ready()
        .label("tenant", "a")
        .build()];
    let d = desired_for(spec, &pods);
    let text = &d.slices[0].annotations()[contract::ANNOTATION_ENDPOINT_LABELS];
    let v: Value = serde_json::from_str(text).expect("json");
    assert_eq!(v, json!({"vllm-0": {"tenant": "a"}}));
    let d = desired_for(base_spec(), &pods);
    assert!(
        !d.slices[0]
            .annotations()
            .contains_key(contract::ANNOTATION_ENDPOINT_LABELS)
    );
}

#[test]
fn gateway_pools_point_at_the_picker_service() {
    let mut spec = base_spec();
    spec["modelConfigs"][0]["dataParallel"] = json!({"size": 2, "rankSelection": "Port"});
    spec["modelConfigs"][0]["podSelector"] = json!({"tier": "a"});
    spec["gateway"] = json!({"exportInferencePool": true});
    let d = desired_for(spec, &[]);
    assert_eq!(d.gateway_pools.len(), 1);
    let g = serde_json::to_value(&d.gateway_pools[0]).expect("json");
    assert_eq!(g["apiVersion"], "inference.networking.k8s.io/v1");
    assert_eq!(g["metadata"]["name"], "llama-llama");
    assert_eq!(
        g["spec"]["selector"]["matchLabels"],
        json!({"app": "vllm", "tier": "a"})
    );
    assert_eq!(
        g["spec"]["targetPorts"],
        json!([{"number": 8000}, {"number": 8001}])
    );
    assert_eq!(
        g["spec"]["endpointPickerRef"],
        json!({"group": "", "kind": "Service", "name": "llama-picker", "port": {"number": 9002}, "failureMode": "FailClose"})
    );
    assert!(desired_for(base_spec(), &[]).gateway_pools.is_empty());
}

#[test]
fn role_labels_ride_along_as_an_annotation_without_tenancy() {
    let pods = [
        mk_pod("p-0")
            .ip("10.0.0.1")
            .ready()
            .label("llm-d.ai/role", "prefill")
            .build(),
        mk_pod("d-0").ip("10.0.0.2").ready().build(),
    ];
    let d = desired_for(base_spec(), &pods);
    let text = &d.slices[0].annotations()[contract::ANNOTATION_ENDPOINT_LABELS];
    let v: Value = serde_json::from_str(text).expect("json");
    assert_eq!(v, json!({"p-0": {"llm-d.ai/role": "prefill"}, "d-0": {}}));
}
