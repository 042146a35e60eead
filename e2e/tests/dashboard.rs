//! The chart's Grafana dashboard reads what the picker really exports: the chart is rendered
//! with the dashboard on, and every panel's query is checked against the `/metrics` of a
//! running picker (in front of simulated engines, one endpoint dead, after traffic and an
//! error) and of an engine: each metric it names is exported, and each label it groups or
//! matches by is on that metric's series.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod sim_support;

use std::collections::BTreeSet;
use std::process::Command;

use kvroute_e2e::cluster::bins::K8sBins;
use kvroute_e2e::cluster::repo_root;
use kvroute_testkit::get_text;
use serde_json::{Value, json};
use sim_support::*;

/// Labels Prometheus adds to every series from the scrape target (the PodMonitor's), which the
/// dashboard's variables select on.
const TARGET_LABELS: [&str; 2] = ["namespace", "pod"];

/// The dashboard JSON from the rendered chart's ConfigMap.
fn rendered_dashboard() -> Value {
    let helm = K8sBins::locate().expect("helm (scripts/k8s-bins.sh)").helm;
    let out = Command::new(helm)
        .args(["template", "kvroute"])
        .arg(repo_root().join("charts/kvroute"))
        .args(["--namespace", "kvroute-system", "--kube-version", "1.36.0"])
        .args(["--set", "grafana.dashboards.enabled=true"])
        .output()
        .expect("run helm");
    assert!(
        out.status.success(),
        "helm template: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    for doc in serde_yaml_ng::Deserializer::from_str(&text) {
        let doc = <Value as serde::Deserialize>::deserialize(doc).unwrap();
        if doc["kind"] == "ConfigMap" && doc["metadata"]["labels"]["grafana_dashboard"] == "1" {
            let json = doc["data"]["kvroute-picker.json"]
                .as_str()
                .expect("the dashboard");
            return serde_json::from_str(json).expect("the dashboard is JSON");
        }
    }
    panic!("no ConfigMap labelled grafana_dashboard: \"1\" in the rendering");
}

/// Every query of every panel, with its panel's title.
fn queries(dashboard: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for t in panel["targets"].as_array().into_iter().flatten() {
            out.push((
                panel["title"].as_str().unwrap().to_owned(),
                t["expr"].as_str().unwrap().to_owned(),
            ));
        }
    }
    for var in dashboard["templating"]["list"].as_array().unwrap() {
        if let Some(q) = var["query"]["query"].as_str() {
            let q = q.trim_start_matches("label_values(").trim_end_matches(')');
            // `label_values(metric{...}, label)`: the metric must be there; the label is a
            // target label
            let metric = q.rsplit_once(',').map_or(q, |(m, _)| m);
            out.push((format!("variable {}", var["name"]), metric.to_owned()));
        }
    }
    out
}

fn ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

/// The metric names a query reads (kvroute's and the engines'), and the labels it matches,
/// groups or joins by.
fn parts(expr: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let mut metrics = BTreeSet::new();
    let mut labels = BTreeSet::new();
    let chars: Vec<char> = expr.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' {
            // a string: skip it
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                i += 1;
            }
            i += 1;
        } else if c == '{' {
            let end = (i..chars.len()).find(|&j| chars[j] == '}').unwrap();
            let inside: String = chars[i + 1..end].iter().collect();
            let mut in_string = false;
            let mut name = String::new();
            for ch in inside.chars() {
                match ch {
                    '"' => in_string = !in_string,
                    _ if in_string => {}
                    '=' | '!' | '~' => {
                        if !name.trim().is_empty() {
                            labels.insert(name.trim().to_owned());
                        }
                        name.clear();
                    }
                    ',' => name.clear(),
                    _ => name.push(ch),
                }
            }
            i = end + 1;
        } else if ident_char(c) && !c.is_ascii_digit() {
            let start = i;
            while i < chars.len() && ident_char(chars[i]) {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            if word.starts_with("kvroute_") || word.starts_with("vllm:") {
                metrics.insert(word);
            } else if matches!(word.as_str(), "by" | "without" | "on" | "ignoring") {
                let open = (i..chars.len()).find(|&j| chars[j] == '(').unwrap();
                let close = (open..chars.len()).find(|&j| chars[j] == ')').unwrap();
                let list: String = chars[open + 1..close].iter().collect();
                labels.extend(
                    list.split(',')
                        .map(str::trim)
                        .filter(|l| !l.is_empty())
                        .map(str::to_owned),
                );
                i = close + 1;
            }
        } else {
            i += 1;
        }
    }
    (metrics, labels)
}

/// The series lines of `metric` in an exposition (sample lines, not comments).
fn series<'a>(exposition: &'a str, metric: &str) -> Vec<&'a str> {
    exposition
        .lines()
        .filter(|l| {
            l.strip_prefix(metric)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .collect()
}

#[test]
fn the_query_parser_reads_metrics_and_labels() {
    let (m, l) = parts(
        r#"sum by (endpoint) (rate(kvroute_picker_x_total{namespace=~"$a", pod!="b,c"}[5m])) / ignoring (endpoint) group_left sum(rate(vllm:y_total[$__rate_interval]))"#,
    );
    assert_eq!(
        m.into_iter().collect::<Vec<_>>(),
        ["kvroute_picker_x_total", "vllm:y_total"]
    );
    assert_eq!(
        l.into_iter().collect::<Vec<_>>(),
        ["endpoint", "namespace", "pod"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_query_names_metrics_and_labels_the_picker_exports() {
    let dashboard = rendered_dashboard();
    let queries = queries(&dashboard);
    assert!(queries.len() >= 15, "{} queries", queries.len());

    // a picker in front of two engines, with flow control; a second model served only by an
    // endpoint that is not there (scrape failures, and a queue that never drains)
    let a = sim("127.0.0.1").await;
    let b = sim("127.0.0.2").await;
    // bound and never listening: connections to it are refused
    let dead_socket = tokio::net::TcpSocket::new_v4().unwrap();
    dead_socket.bind("127.0.0.3:0".parse().unwrap()).unwrap();
    let dead = dead_socket.local_addr().unwrap().port();
    let yaml = format!(
        "{LOOPBACK_LISTEN}\n{LLAMA_PRECISE}  - {{name: qwen, model: qwen, blockSize: 16}}\n\
         endpoints:\n{}{}  - {{address: 127.0.0.3, modelConfig: qwen, port: {dead}}}\n\
         routing: {{strategy: CostModel, stalenessThreshold: 5s, flowControl: {{enabled: true, ttl: 20s}}}}\n\
         scrape: {{interval: 50ms}}\n",
        endpoint_entry(&a, ""),
        endpoint_entry(&b, "")
    );
    let p = static_picker(&yaml).await;
    let url = format!("http://{}/v1/completions", p.addrs.http);
    let send = |body: Value, slo: Option<&'static str>| {
        let url = url.clone();
        async move {
            let mut r = client().post(url).json(&body);
            if let Some(ms) = slo {
                r = r.header("x-slo-ttft-ms", ms);
            }
            r.send().await.unwrap().status().as_u16()
        }
    };
    for i in 0..12 {
        let status = send(
            json!({"model": "llama", "prompt": prompt(i % 3, 256), "max_tokens": 2}),
            None,
        )
        .await;
        assert_eq!(status, 200);
    }
    // an unknown model (errors), an objective no endpoint can meet (shed), KV events that do
    // not decode (event problems), a request waiting in the queue
    assert_eq!(
        send(json!({"model": "no-such-model", "prompt": "x"}), None).await,
        404
    );
    assert_eq!(
        send(
            json!({"model": "llama", "prompt": prompt(9, 4096)}),
            Some("1")
        )
        .await,
        429
    );
    let garbage: kvroute_sim::server::fault::FaultSpec = serde_json::from_value(
        json!({"kind": "garbage_events", "per_second": 200, "max_bytes": 256}),
    )
    .unwrap();
    a.inject(0, garbage).await.unwrap();
    let queued = tokio::spawn(send(json!({"model": "qwen", "prompt": "waits"}), None));

    // every series the picker exported over the run
    let picker_metrics = format!("http://{}/metrics", p.addrs.metrics);
    let wanted = [
        "kvroute_picker_scrape_failures_total",
        "kvroute_picker_kv_event_problems_total",
        "kvroute_picker_flow_queued",
        "kvroute_picker_flow_shed_total",
    ];
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    let mut exported = String::new();
    loop {
        exported.push_str(&get_text(&client(), &picker_metrics).await);
        let missing: Vec<&str> = wanted
            .iter()
            .copied()
            .filter(|m| series(&exported, m).is_empty())
            .collect();
        if missing.is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no series of {missing:?} in 15 s:\n{exported}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    queued.abort();
    let engine = get_text(&client(), format!("http://{}/metrics", a.addrs()[0].http)).await;

    let mut problems = Vec::new();
    for (title, expr) in &queries {
        let (metrics, labels) = parts(expr);
        if metrics.is_empty() {
            problems.push(format!(
                "{title}: `{expr}` reads no kvroute or engine metric"
            ));
        }
        for metric in &metrics {
            let exposition = if metric.starts_with("vllm:") {
                &engine
            } else {
                &exported
            };
            let lines = series(exposition, metric);
            if lines.is_empty() {
                problems.push(format!("{title}: `{metric}` is not exported"));
                continue;
            }
            for label in labels
                .iter()
                .filter(|l| !TARGET_LABELS.contains(&l.as_str()))
            {
                let here = lines.iter().any(|l| l.contains(&format!("{label}=\"")));
                if !here {
                    problems.push(format!(
                        "{title}: `{metric}` has no series with label `{label}` ({} series)",
                        lines.len()
                    ));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    p.shutdown().await;
    a.shutdown();
    b.shutdown();
    drop(dead_socket);
}
