//! The generated CRD: committed copy in sync, and its schema (OpenAPI structure and CEL rules)
//! rejecting what the API server must reject.

use std::path::PathBuf;

use kube::CustomResourceExt;
use kvroute_crds::{KVRoutePool, crd_yaml};
use serde_json::{Value, json};

fn committed_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(kvroute_crds::CRD_FILE)
}

#[test]
fn committed_crd_matches_the_generated_one() {
    let generated = crd_yaml().expect("render CRD");
    let path = committed_path();
    if std::env::var_os("KVROUTE_UPDATE_CRDS").is_some() {
        std::fs::write(&path, &generated).expect("write CRD");
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "{} is out of date: run `KVROUTE_UPDATE_CRDS=1 cargo test -p kvroute-crds` (it also regenerates the Helm chart's copy) and commit it",
        path.display()
    );
}

fn schema() -> Value {
    let crd = KVRoutePool::crd();
    let v = &crd.spec.versions[0];
    serde_json::to_value(
        v.schema
            .as_ref()
            .and_then(|s| s.open_api_v3_schema.as_ref())
            .expect("openAPIV3Schema"),
    )
    .expect("schema as JSON")
}

fn good() -> Value {
    json!({
        "apiVersion": "kvroute.dev/v1alpha1",
        "kind": "KVRoutePool",
        "metadata": {"name": "llama", "namespace": "default"},
        "spec": {
            "selector": {"matchLabels": {"app": "vllm-llama"}},
            "modelConfigs": [{
                "name": "llama",
                "model": "meta-llama/Llama-3.1-8B-Instruct",
                "engine": "vllm",
                "port": 8000,
                "blockSize": 16,
                "dataParallel": {"size": 2, "rankSelection": "Port"},
                "kvEvents": {"port": 5557, "topic": "kv"},
                "loraAdapters": ["sql-lora"]
            }],
            "routing": {"strategy": "Weighted", "weights": {"prefixCache": 3, "queue": 2}},
            "tenancy": {"isolation": "None"},
            "picker": {"replicas": 2}
        }
    })
}

/// Apply `edit` to a copy of the good pool.
fn with(edit: impl FnOnce(&mut Value)) -> Value {
    let mut v = good();
    edit(&mut v);
    v
}

fn structural_errors(obj: &Value) -> Vec<String> {
    let schema = schema();
    let validator = jsonschema::validator_for(&schema).expect("schema compiles");
    validator
        .iter_errors(obj)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect()
}

fn cel_errors(obj: &Value) -> Vec<String> {
    match kube_cel::validate(&schema(), obj, None) {
        Ok(()) => Vec::new(),
        Err(errs) => errs.iter().map(|e| e.to_string()).collect(),
    }
}

#[track_caller]
fn assert_rejected_by_structure(obj: &Value, needle: &str) {
    let errs = structural_errors(obj);
    assert!(
        errs.iter().any(|e| e.contains(needle)),
        "expected a schema error mentioning {needle:?}, got {errs:?}"
    );
}

#[track_caller]
fn assert_rejected_by_cel(obj: &Value, message: &str) {
    assert!(
        structural_errors(obj).is_empty(),
        "structurally valid: {:?}",
        structural_errors(obj)
    );
    let errs = cel_errors(obj);
    assert!(
        errs.iter().any(|e| e.contains(message)),
        "expected a CEL error {message:?}, got {errs:?}"
    );
}

#[test]
fn a_good_pool_passes_schema_and_cel() {
    assert_eq!(structural_errors(&good()), Vec::<String>::new());
    assert_eq!(cel_errors(&good()), Vec::<String>::new());
    let pool: KVRoutePool = serde_json::from_value(good()).expect("deserializes");
    pool.spec.validate("llama").expect("valid");
}

#[test]
fn negative_weight_is_rejected() {
    let bad = with(|v| v["spec"]["routing"]["weights"]["queue"] = json!(-1));
    assert_rejected_by_structure(&bad, "/spec/routing/weights/queue");
}

#[test]
fn unknown_strategy_is_rejected() {
    let bad = with(|v| v["spec"]["routing"]["strategy"] = json!("Fastest"));
    assert_rejected_by_structure(&bad, "/spec/routing/strategy");
}

#[test]
fn dp_size_zero_and_too_large_are_rejected() {
    let bad = with(|v| v["spec"]["modelConfigs"][0]["dataParallel"]["size"] = json!(0));
    assert_rejected_by_structure(&bad, "/spec/modelConfigs/0/dataParallel/size");
    let bad = with(|v| v["spec"]["modelConfigs"][0]["dataParallel"]["size"] = json!(1025));
    assert_rejected_by_structure(&bad, "/spec/modelConfigs/0/dataParallel/size");
}

#[test]
fn missing_model_is_rejected() {
    let bad = with(|v| {
        v["spec"]["modelConfigs"][0]
            .as_object_mut()
            .expect("object")
            .remove("model");
    });
    assert_rejected_by_structure(&bad, "\"model\" is a required property");
    let bad = with(|v| v["spec"]["modelConfigs"][0]["model"] = json!(""));
    assert_rejected_by_structure(&bad, "/spec/modelConfigs/0/model");
}

#[test]
fn other_bounds_are_rejected() {
    for (edit, at) in [
        (json!({"blockSize": 24}), "/spec/modelConfigs/0/blockSize"),
        (json!({"blockSize": 8192}), "/spec/modelConfigs/0/blockSize"),
        (json!({"engine": "ollama"}), "/spec/modelConfigs/0/engine"),
        (json!({"name": "Llama_3"}), "/spec/modelConfigs/0/name"),
        (json!({"port": 0}), "/spec/modelConfigs/0/port"),
        (
            json!({"dataParallel": {"size": 2, "rankSelection": "Rank"}}),
            "/spec/modelConfigs/0/dataParallel/rankSelection",
        ),
    ] {
        let bad = with(|v| {
            let mc = v["spec"]["modelConfigs"][0]
                .as_object_mut()
                .expect("object");
            for (k, val) in edit.as_object().expect("object") {
                mc.insert(k.clone(), val.clone());
            }
        });
        assert_rejected_by_structure(&bad, at);
    }
    let bad = with(|v| v["spec"]["routing"]["stalenessThreshold"] = json!("0s"));
    assert_rejected_by_structure(&bad, "/spec/routing/stalenessThreshold");
    let bad = with(|v| v["spec"]["routing"]["balance"]["relative"] = json!(0.5));
    assert_rejected_by_structure(&bad, "/spec/routing/balance/relative");
    let bad = with(|v| v["spec"]["routing"]["sessionHeader"] = json!("x session"));
    assert_rejected_by_structure(&bad, "/spec/routing/sessionHeader");
    let bad = with(|v| v["spec"]["selector"]["matchLabels"] = json!({}));
    assert_rejected_by_structure(&bad, "/spec/selector/matchLabels");
    let bad = with(|v| v["spec"]["modelConfigs"] = json!([]));
    assert_rejected_by_structure(&bad, "/spec/modelConfigs");
    let bad = with(|v| v["spec"]["picker"]["replicas"] = json!(-1));
    assert_rejected_by_structure(&bad, "/spec/picker/replicas");
    for (field, value) in [
        ("mode", json!("Sometimes")),
        ("maxPrefillQueue", json!(0)),
        ("maxTtftRatio", json!(0.5)),
        ("minUncachedTokens", json!(-1)),
        ("transferMsPerBlock", json!(-0.5)),
    ] {
        let bad = with(|v| v["spec"]["routing"]["disaggregation"] = json!({ field: value }));
        assert_rejected_by_structure(&bad, &format!("/spec/routing/disaggregation/{field}"));
    }
}

#[test]
fn all_weights_zero_is_rejected_by_cel() {
    let bad = with(|v| {
        v["spec"]["routing"]["weights"] = json!({
            "prefixCache": 0, "queue": 0, "kvUtilization": 0, "inflight": 0, "sessionAffinity": 0
        })
    });
    assert_rejected_by_cel(&bad, "at least one weight must be positive");
    // omitted weights take their (positive) defaults, as on the API server
    let ok = with(|v| v["spec"]["routing"]["weights"] = json!({"prefixCache": 0}));
    assert_eq!(cel_errors(&ok), Vec::<String>::new());
}

#[test]
fn tenancy_rules_are_enforced_by_cel() {
    let bad = with(
        |v| v["spec"]["tenancy"] = json!({"isolation": "DedicatedEndpoints", "tenants": [{"name": "a", "podSelector": {"t": "a"}}]}),
    );
    assert_rejected_by_cel(
        &bad,
        "tenancy.header is required unless tenancy.isolation is None",
    );
    let bad = with(|v| {
        v["spec"]["tenancy"] = json!({"isolation": "DedicatedEndpoints", "header": "x-tenant"})
    });
    assert_rejected_by_cel(&bad, "at least one tenant for DedicatedEndpoints");
    let bad =
        with(|v| v["spec"]["tenancy"] = json!({"isolation": "SaltedCache", "header": "x-tenant"}));
    assert_rejected_by_cel(&bad, "SaltedCache isolation needs a salt secret");
    let ok = with(|v| {
        v["spec"]["tenancy"] = json!({"isolation": "SaltedCache", "header": "x-tenant"});
        v["spec"]["picker"]["saltSecretRef"] = json!({"name": "tenant-salt"});
    });
    assert_eq!(cel_errors(&ok), Vec::<String>::new());
    let ok = with(|v| v["spec"]["tenancy"] = json!({}));
    assert_eq!(cel_errors(&ok), Vec::<String>::new());
}

#[test]
fn port_ranges_and_adapters_are_enforced_by_cel() {
    let bad = with(|v| {
        v["spec"]["modelConfigs"][0]["port"] = json!(65530);
        v["spec"]["modelConfigs"][0]["dataParallel"] = json!({"size": 8, "rankSelection": "Port"});
    });
    assert_rejected_by_cel(&bad, "port + dataParallel.size - 1 must not exceed 65535");
    // the same ports are fine when ranks share the port
    let ok = with(|v| {
        v["spec"]["modelConfigs"][0]["port"] = json!(65530);
        v["spec"]["modelConfigs"][0]["dataParallel"] =
            json!({"size": 8, "rankSelection": "Header"});
    });
    assert_eq!(cel_errors(&ok), Vec::<String>::new());
    let bad = with(|v| v["spec"]["modelConfigs"][0]["kvEvents"]["port"] = json!(65535));
    assert_rejected_by_cel(&bad, "kvEvents.port + dataParallel.size - 1");
    let bad = with(|v| {
        v["spec"]["modelConfigs"][0]["loraAdapters"] = json!(["meta-llama/Llama-3.1-8B-Instruct"])
    });
    assert_rejected_by_cel(&bad, "loraAdapters must differ from the base model");
    let bad = with(|v| {
        v["spec"]["gateway"] = json!({"exportInferencePool": true});
        v["spec"]["modelConfigs"][0]["dataParallel"] = json!({"size": 16, "rankSelection": "Port"});
    });
    assert_rejected_by_cel(&bad, "at most 8 target ports");
}

#[test]
fn pool_names_that_cannot_name_a_service_are_rejected_by_cel() {
    let long = "a".repeat(57);
    let bad = with(|v| v["metadata"]["name"] = json!(long));
    assert_rejected_by_cel(&bad, "at most 56 characters");
    let bad = with(|v| v["metadata"]["name"] = json!("1llama"));
    assert_rejected_by_cel(&bad, "DNS label starting with a letter");
}

/// Every rule compiles, uses only variables a CRD rule may use, and each cross-field
/// constraint the issue names is present.
#[test]
fn cel_rules_compile_and_are_present() {
    let schema = schema();
    let compiled = kube_cel::compile_schema(&schema);
    assert!(
        !compiled.has_errors(),
        "{:?}",
        compiled.compilation_errors()
    );
    let mut rules = Vec::new();
    collect_rules(&schema, &mut rules);
    for (rule, _) in &rules {
        // the checker does not know macro-bound variables (`list.all(x, ...)`)
        let bound = comprehension_vars(rule);
        let warnings: Vec<_> =
            kube_cel::check_rule_scope(rule, kube_cel::ScopeContext::CrdValidation)
                .into_iter()
                .filter(|w| !bound.iter().any(|v| w.message.contains(&format!("'{v}'"))))
                .collect();
        assert!(warnings.is_empty(), "{rule}: {warnings:?}");
    }
    let messages: Vec<&str> = rules.iter().map(|(_, m)| m.as_str()).collect();
    for expected in [
        "at least one weight must be positive",
        "tenancy.header is required unless tenancy.isolation is None",
        "tenancy.tenants must list at least one tenant",
        "SaltedCache isolation needs a salt secret",
        "port + dataParallel.size - 1 must not exceed 65535",
        "kvEvents.port + dataParallel.size - 1",
        "loraAdapters must differ from the base model",
        "at most 8 target ports",
        "at most 56 characters",
    ] {
        assert!(
            messages.iter().any(|m| m.contains(expected)),
            "no rule with message {expected:?} in {messages:?}"
        );
    }
}

fn comprehension_vars(rule: &str) -> Vec<String> {
    let mut vars = Vec::new();
    for mac in [".all(", ".exists(", ".exists_one(", ".map(", ".filter("] {
        for (i, _) in rule.match_indices(mac) {
            let rest = &rule[i + mac.len()..];
            if let Some(end) = rest.find(',') {
                vars.push(rest[..end].trim().to_owned());
            }
        }
    }
    vars
}

fn collect_rules(v: &Value, out: &mut Vec<(String, String)>) {
    match v {
        Value::Object(m) => {
            if let Some(Value::Array(rules)) = m.get("x-kubernetes-validations") {
                for r in rules {
                    out.push((
                        r["rule"].as_str().unwrap_or_default().to_owned(),
                        r["message"].as_str().unwrap_or_default().to_owned(),
                    ));
                }
            }
            m.values().for_each(|c| collect_rules(c, out));
        }
        Value::Array(a) => a.iter().for_each(|c| collect_rules(c, out)),
        _ => {}
    }
}

/// Strings and lists a CEL rule reads must be bounded, or the API server refuses the CRD
/// for an unbounded rule cost.
#[test]
fn lists_are_bounded_for_cel_cost() {
    let schema = schema();
    let spec = &schema["properties"]["spec"]["properties"];
    assert_eq!(spec["modelConfigs"]["maxItems"], json!(32));
    let mc = &spec["modelConfigs"]["items"]["properties"];
    assert_eq!(mc["loraAdapters"]["maxItems"], json!(64));
    assert_eq!(mc["loraAdapters"]["items"]["maxLength"], json!(256));
    assert_eq!(mc["model"]["maxLength"], json!(256));
    assert_eq!(
        spec["tenancy"]["properties"]["tenants"]["maxItems"],
        json!(256)
    );
    assert_eq!(
        spec["tenancy"]["properties"]["header"]["maxLength"],
        json!(256)
    );
}

#[test]
fn shipped_samples_are_valid() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../config/samples");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).expect("config/samples") {
        let path = entry.expect("entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("read sample");
        for doc in serde_yaml_ng::Deserializer::from_str(&text) {
            let value: Value = serde::Deserialize::deserialize(doc).expect("yaml");
            if value["apiVersion"] == json!("inference.networking.k8s.io/v1") {
                // a Gateway API pool a sample serves: as the published v1 API has it
                let gw: kvroute_crds::gateway_pool::GatewayInferencePool =
                    serde_json::from_value(value).expect("a v1 InferencePool");
                assert!(!gw.spec.target_ports.is_empty(), "{}", path.display());
                continue;
            }
            if value["kind"] != json!("KVRoutePool")
                || value["apiVersion"] != json!("kvroute.dev/v1alpha1")
            {
                continue;
            }
            let name = value["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            assert_eq!(
                structural_errors(&value),
                Vec::<String>::new(),
                "{}",
                path.display()
            );
            assert_eq!(
                cel_errors(&value),
                Vec::<String>::new(),
                "{}",
                path.display()
            );
            let pool: KVRoutePool = serde_json::from_value(value).expect("deserializes");
            pool.spec
                .validate(&name)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            seen += 1;
        }
    }
    assert!(seen >= 3, "expected the sample pools, found {seen}");
}

#[test]
fn a_pool_names_its_pods_by_selector_or_by_a_gateway_api_pool_not_both() {
    let mut by_ref = good();
    by_ref["spec"]
        .as_object_mut()
        .expect("spec")
        .remove("selector");
    by_ref["spec"]["inferencePoolRef"] = json!({"name": "llama"});
    assert_eq!(structural_errors(&by_ref), Vec::<String>::new());
    assert_eq!(cel_errors(&by_ref), Vec::<String>::new());
    let mut both = good();
    both["spec"]["inferencePoolRef"] = json!({"name": "llama"});
    let mut neither = by_ref.clone();
    neither["spec"]
        .as_object_mut()
        .expect("spec")
        .remove("inferencePoolRef");
    for v in [both, neither] {
        let errors = cel_errors(&v);
        assert!(
            errors
                .iter()
                .any(|e| e.contains("exactly one of selector and inferencePoolRef")),
            "{errors:?}"
        );
    }
    by_ref["spec"]["gateway"] = json!({"exportInferencePool": true});
    let errors = cel_errors(&by_ref);
    assert!(
        errors.iter().any(|e| e.contains("set one of them")),
        "{errors:?}"
    );
}
