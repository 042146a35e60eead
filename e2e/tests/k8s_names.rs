//! kvroute's resource beside the Gateway API Inference Extension's, on a real API server: with
//! the Gateway API `InferencePool` CRD installed (`kvroute_crds::gateway_pool`, written from
//! the published v1 API) and a Gateway API pool of the same name in the namespace, every
//! `kubectl` command of the README and the docs, run as written, addresses the object it
//! means: the migration from the old `InferencePool` kind moves the pools to `KVRoutePool`,
//! and the README's `get`, `patch` and `explain` of `kvpool`/`kvroutepool` change kvroute's
//! pool and leave the Gateway API's alone.
//!
//! A KVRoutePool that names an existing Gateway API InferencePool (`spec.inferencePoolRef`)
//! serves it: the InferencePool's selector and ports become the endpoints, the picker runs, a
//! real Envoy configured as the gateway's endpoint-picker filter routes through it, an edit of
//! the KVRoutePool's policy retunes it live, llm-d's InferenceModelRewrite for the
//! InferencePool is honoured, and kvroute's entry appears in the InferencePool's
//! `status.parents` beside the gateway's.
//!
//! Needs the control-plane binaries of `scripts/k8s-bins.sh`.
#![allow(clippy::unwrap_used)]

mod k8s_support;

use kube::Api;
use kvroute_crds::KVRoutePool;
use kvroute_crds::gateway_pool::GatewayInferencePool;
use std::net::SocketAddr;

use kvroute_e2e::cluster::{repo_root, wait};
use kvroute_e2e::envoy::{Envoy, EnvoySpec, Shape};

use k8s_support::*;

/// The shell command lines of a Markdown file that run `kubectl` (in `sh` code blocks,
/// continuation lines joined; inline code spans too), minus those that need a running pod
/// (`port-forward`) or another ServiceAccount's token.
fn kubectl_lines(markdown: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut in_sh = false;
    let mut pending = String::new();
    for line in markdown.lines() {
        if line.starts_with("```") {
            in_sh = !in_sh && line.trim() == "```sh";
            continue;
        }
        if in_sh {
            pending.push_str(line);
            if pending.ends_with('\\') {
                // the shell joins it with the next line
                pending.push('\n');
                continue;
            }
            lines.push(std::mem::take(&mut pending));
        } else {
            // `kubectl explain ...` and the like, quoted in prose
            for (i, span) in line.split('`').enumerate() {
                if i % 2 == 1 && span.starts_with("kubectl ") && span.split(' ').count() > 2 {
                    lines.push(span.to_owned());
                }
            }
        }
    }
    lines
        .into_iter()
        .filter(|l| l.trim_start().starts_with("kubectl "))
        .filter(|l| !l.contains("port-forward") && !l.contains("create token"))
        .collect()
}

/// The old kind's CRD (`inferencepools.kvroute.dev`), as the chart installed it before the
/// rename: the current CRD under the old names.
fn old_crd() -> String {
    std::fs::read_to_string(repo_root().join("crds/kvroutepool.yaml"))
        .unwrap()
        .replace(
            "name: kvroutepools.kvroute.dev",
            "name: inferencepools.kvroute.dev",
        )
        .replace("kind: KVRoutePool", "kind: InferencePool")
        .replace("plural: kvroutepools", "plural: inferencepools")
        .replace("singular: kvroutepool", "singular: inferencepool")
        .replace("- kvpool", "- oldkvpool")
}

/// The Gateway API InferencePool CRD, installed and established once per cluster.
fn install_gateway_crd() {
    static ONCE: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    ONCE.get_or_init(|| {
        // server-side: creating or updating is one idempotent request
        let file = std::env::temp_dir().join(format!("gateway-crd-{}.yaml", std::process::id()));
        let crds = format!(
            "{}---\n{}---\n{}",
            kvroute_crds::gateway_pool::gateway_crd_yaml().unwrap(),
            kvroute_crds::gateway_pool::model_rewrite_crd_yaml().unwrap(),
            kvroute_crds::gateway_pool::objective_crd_yaml().unwrap()
        );
        std::fs::write(&file, crds).unwrap();
        sh(&format!("kubectl apply --server-side -f {}", file.display()));
        let _ = std::fs::remove_file(&file);
        sh("kubectl wait --for condition=established --timeout=60s crd/inferencepools.inference.networking.k8s.io crd/inferencemodelrewrites.inference.networking.x-k8s.io crd/inferenceobjectives.inference.networking.x-k8s.io");
    });
}

fn sh(line: &str) -> String {
    let out = cluster().shell(line).unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(out.status.success(), "`{line}` failed:\n{stdout}\n{stderr}");
    stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kubectl_command_in_the_docs_addresses_the_intended_pool() {
    let c = cluster();
    c.install_chart().unwrap();
    install_gateway_crd();
    apply("default", &old_crd());
    for crd in ["inferencepools.kvroute.dev", "kvroutepools.kvroute.dev"] {
        sh(&format!(
            "kubectl wait --for condition=established --timeout=60s crd/{crd}"
        ));
    }
    let ns = c.namespace("names").await.unwrap();
    let n = ns.name.as_str();
    let client = client().await;

    // a pool of the old kind, and a Gateway API pool named like the README's kvroute pool
    let legacy = llama_pool(|p| {
        p["kind"] = "InferencePool".into();
        p["metadata"]["name"] = "legacy".into();
    });
    apply(n, &legacy);
    apply(
        n,
        r#"
apiVersion: inference.networking.k8s.io/v1
kind: InferencePool
metadata: {name: llama}
spec:
  selector: {matchLabels: {app.kubernetes.io/name: vllm-llama}}
  targetPorts: [{number: 8000}, {number: 8001}]
  endpointPickerRef: {name: other-epp, port: {number: 9002}}
"#,
    );
    let gateway: Api<GatewayInferencePool> = Api::namespaced(client.clone(), n);
    let before = gateway.get("llama").await.unwrap();

    // the migration note, run as written (the chart is already upgraded here), then the
    // README's commands against this namespace
    let work = tempfile::tempdir().unwrap();
    let pools_file = work.path().join("kvroute-pools.yaml");
    let helm = std::fs::read_to_string(repo_root().join("docs/helm.md")).unwrap();
    let migration = kubectl_lines(&helm);
    assert!(
        migration
            .iter()
            .any(|l| l.contains("inferencepools.kvroute.dev")),
        "the migration note's commands: {migration:?}"
    );
    for line in &migration {
        sh(&line.replace("kvroute-pools.yaml", &pools_file.display().to_string()));
    }
    let readme = kubectl_lines(&std::fs::read_to_string(repo_root().join("README.md")).unwrap());
    assert!(
        readme.len() >= 5,
        "the README's kubectl commands: {readme:?}"
    );
    let mut explained = String::new();
    for line in &readme {
        let out = sh(&line.replace("-n default", &format!("-n {n}")));
        if line.contains("explain") {
            explained = out;
        }
    }

    // the old pool moved to the new kind, the old CRD is gone
    let pools: Api<KVRoutePool> = Api::namespaced(client.clone(), n);
    let moved = pools.get("legacy").await.unwrap();
    let old: KVRoutePool =
        serde_yaml_ng::from_str(&legacy.replace("kind: InferencePool", "kind: KVRoutePool"))
            .unwrap();
    assert_eq!(moved.spec, old.spec, "the migrated pool keeps its spec");
    let crds = sh("kubectl get crd -o name");
    assert!(!crds.contains("inferencepools.kvroute.dev"), "{crds}");

    // the README's patches reached kvroute's pool...
    let llama = pools.get("llama").await.unwrap();
    let routing = serde_json::to_value(&llama.spec.routing).unwrap();
    assert_eq!(routing["costModel"]["recomputeWeight"], 4.0, "{routing}");
    assert_eq!(routing["admission"]["enabled"], true, "{routing}");
    assert_eq!(routing["flowControl"]["enabled"], true, "{routing}");
    assert_eq!(
        routing["flowControl"]["objectives"][0]["name"], "interactive",
        "{routing}"
    );
    assert_eq!(routing["strategy"], "Weighted", "{routing}");
    assert!(explained.contains("costModel"), "{explained}");
    // ...and the disaggregated sample's pool
    let pd = pools.get("llama-pd").await.unwrap();
    let pd = serde_json::to_value(pd.spec.routing.disaggregation).unwrap();
    assert_eq!(pd["mode"], "Auto", "{pd}");
    assert_eq!(pd["minUncachedTokens"], 1024, "{pd}");
    assert_eq!(pd["maxTtftRatio"], 2.0, "{pd}");
    // ...and left the Gateway API pool of the same name as it was
    let after = gateway.get("llama").await.unwrap();
    assert_eq!(
        after.metadata.resource_version, before.metadata.resource_version,
        "the Gateway API pool was not touched"
    );
    assert_eq!(
        sh(&format!(
            "kubectl get inferencepool llama -n {n} -o jsonpath='{{.apiVersion}}'"
        )),
        "inference.networking.k8s.io/v1"
    );
    let listed = sh(&format!("kubectl get kvpool -n {n} -o name"));
    assert_eq!(
        listed.lines().collect::<Vec<_>>(),
        [
            "kvroutepool.kvroute.dev/legacy",
            "kvroutepool.kvroute.dev/llama",
            "kvroutepool.kvroute.dev/llama-pd"
        ],
        "{listed}"
    );
}

/// kvroute's entry in the InferencePool's `status.parents`, as `(condition, status)` pairs.
async fn kvroute_entry(api: &Api<GatewayInferencePool>, name: &str) -> Vec<(String, String)> {
    let gw = api.get(name).await.unwrap();
    gw.status
        .unwrap_or_default()
        .parents
        .into_iter()
        .find(|p| p.parent_ref.kind.as_deref() == Some("KVRoutePool"))
        .map(|p| {
            p.conditions
                .into_iter()
                .map(|c| (c.type_, c.status))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kvroutepool_serves_the_gateway_api_pool_it_names() {
    let c = cluster();
    c.install_chart().unwrap();
    install_gateway_crd();
    c.ensure_operator().await.unwrap();
    let ns = c.namespace("gwref").await.unwrap();
    let n = ns.name.as_str();
    let client = client().await;

    // the InferencePool as a user has it, with a gateway controller's entry in its status
    apply(n, &sample("serve-gateway-inferencepool.yaml"));
    sh(&format!(
        "kubectl patch inferencepool.inference.networking.k8s.io llama -n {n} --subresource=status --type=merge \
         -p '{{\"status\":{{\"parents\":[{{\"parentRef\":{{\"name\":\"gw\"}},\"conditions\":[{{\"type\":\"Accepted\",\"status\":\"True\",\"reason\":\"Accepted\",\"message\":\"\",\"lastTransitionTime\":\"2026-12-05T00:00:00Z\"}}]}}]}}}}'"
    ));
    apply(n, &llama_servers(1));

    // the InferencePool's selector and port, the KVRoutePool's model config: 1 pod, 2 ranks
    let pool = wait_pool_eligible(&client, n, "llama", "llama", 1, 2).await;
    assert_eq!(pool.status.unwrap().ready_endpoints, 2);
    let picker = picker(&client, n, "llama").await;
    picker.wait_endpoints(2).await;
    let out = picker.complete(LLAMA_MODEL, "hello", false).await.unwrap();
    assert!(out.contains("choices"), "{out}");

    // a real Envoy, configured as a gateway's endpoint-picker filter for this InferencePool,
    // routes through the picker's ext_proc to the pool's engine
    let server = ready_pods(&client, n, "app.kubernetes.io/name=vllm-llama").await;
    let engine = SocketAddr::new(pod_ip(&server[0]).parse().unwrap(), 8000);
    let ext_proc = SocketAddr::new(
        picker.ip.parse().unwrap(),
        kvroute_crds::contract::PICKER_EXT_PROC_PORT,
    );
    let envoy = Envoy::start(EnvoySpec::new(Shape::OverrideHost, ext_proc, &[engine])).await;
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let decisions = || async {
        let metrics = format!(
            "http://{}:{}/metrics",
            picker.ip,
            kvroute_crds::contract::PICKER_METRICS_PORT
        );
        let page = kvroute_testkit::get_text(&http, metrics).await;
        kvroute_testkit::metric_sum(&page, "kvroute_picker_decisions_total", &[])
    };
    let before = decisions().await;
    let r = http
        .post(envoy.url("/v1/completions"))
        .json(&serde_json::json!({"model": LLAMA_MODEL, "prompt": "through the gateway", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    let status = r.status();
    let text = r.text().await.unwrap();
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("choices"), "{text}");
    assert!(
        decisions().await > before,
        "the picker decided the gateway's request"
    );

    // the KVRoutePool's policy retunes the picker live
    sh(&format!(
        "kubectl patch kvpool llama -n {n} --type merge -p '{{\"spec\":{{\"routing\":{{\"strategy\":\"LeastLoad\"}}}}}}'"
    ));
    wait::until("the picker to run the edited policy", TIMEOUT, || async {
        let view = picker.endpoints().await?;
        Ok((view["routing"]["strategy"] == "LeastLoad").then_some(()))
    })
    .await
    .unwrap();

    // llm-d's InferenceModelRewrite for this InferencePool: `chat` is served by the model and
    // answered in its name
    apply(
        n,
        &[
            "apiVersion: inference.networking.x-k8s.io/v1alpha2",
            "kind: InferenceModelRewrite",
            "metadata: {name: chat-alias}",
            "spec:",
            "  poolRef: {name: llama}",
            "  rules:",
            "    - matches: [{model: {value: chat}}]",
            &format!("      targets: [{{modelRewrite: {LLAMA_MODEL}}}]"),
        ]
        .join("\n"),
    );
    wait::until(
        "the picker to take the InferenceModelRewrite",
        TIMEOUT,
        || async {
            let out = picker.complete("chat", "via a rewrite", false).await;
            Ok(out
                .ok()
                .filter(|o| o.contains(r#""model":"chat""#))
                .map(|_| ()))
        },
    )
    .await
    .unwrap();

    // an InferenceObjective for this InferencePool: a priority the picker's flow control
    // gives requests naming it
    apply(
        n,
        &[
            "apiVersion: inference.networking.x-k8s.io/v1alpha2",
            "kind: InferenceObjective",
            "metadata: {name: interactive}",
            "spec: {priority: 7, poolRef: {name: llama}}",
        ]
        .join("\n"),
    );
    wait::until(
        "the picker to take the InferenceObjective",
        TIMEOUT,
        || async {
            let view = picker.endpoints().await?;
            let objectives = &view["routing"]["flowControl"]["objectives"];
            Ok(
                (objectives == &serde_json::json!([{"name": "interactive", "priority": 7}]))
                    .then_some(()),
            )
        },
    )
    .await
    .unwrap();

    // kvroute's entry beside the gateway's, which stays
    let gateway: Api<GatewayInferencePool> = Api::namespaced(client.clone(), n);
    let both_true = [
        ("Accepted".to_owned(), "True".to_owned()),
        ("ResolvedRefs".to_owned(), "True".to_owned()),
    ];
    wait::until(
        "kvroute's entry in the InferencePool's status",
        TIMEOUT,
        || async { Ok((kvroute_entry(&gateway, "llama").await == both_true).then_some(())) },
    )
    .await
    .unwrap();
    let parents = gateway.get("llama").await.unwrap().status.unwrap().parents;
    assert!(
        parents
            .iter()
            .any(|p| p.parent_ref.name == "gw" && p.parent_ref.kind.is_none()),
        "the gateway's entry is kept: {parents:?}"
    );

    // the InferencePool pointed at another endpoint picker: ResolvedRefs turns False
    sh(&format!(
        "kubectl patch inferencepool.inference.networking.k8s.io llama -n {n} --type=merge \
         -p '{{\"spec\":{{\"endpointPickerRef\":{{\"name\":\"other-epp\"}}}}}}'"
    ));
    wait::until("ResolvedRefs False", TIMEOUT, || async {
        let entry = kvroute_entry(&gateway, "llama").await;
        Ok(entry
            .iter()
            .any(|(t, s)| t == "ResolvedRefs" && s == "False")
            .then_some(()))
    })
    .await
    .unwrap();
}
