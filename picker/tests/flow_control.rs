//! Flow control (`routing.flowControl`) in the service, against a fake engine whose reported
//! queue decides whether the pool has headroom.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde_json::json;
use support::*;

fn yaml(port: u16, flow: &str) -> String {
    yaml_with(port, flow, "{}")
}

/// With `routing.saturation: saturation`.
fn yaml_with(port: u16, flow: &str, saturation: &str) -> String {
    yaml_routing(
        port,
        &format!("flowControl: {{enabled: true, {flow}}}\n  saturation: {saturation}"),
    )
}

/// One engine at `port` and the routing settings `routing` (lines indented by two).
fn yaml_routing(port: u16, routing: &str) -> String {
    one_engine_scraped(port, "", &format!("routing:\n  {routing}\n"))
}

/// Waits until the picker's metrics have the line `line`.
async fn metric(picker: &kvroute_picker::service::Running, line: &str) {
    until_metric(picker.addrs.metrics, |l| l == line).await;
}

/// Waits until `n` requests wait in flow control's queue.
async fn queued(picker: &kvroute_picker::service::Running, n: usize) {
    metric(
        picker,
        &format!(r#"kvroute_picker_flow_queued{{model_config="llama"}} {n}"#),
    )
    .await;
}

/// A fake engine reporting a queue of 10 (saturated at the default depth 5) and a picker with
/// flow control on (`flow`: more settings) that has seen it so.
async fn saturated(flow: &str) -> (FakeEngine, kvroute_picker::service::Running) {
    picker_at(10, flow, "{}", "2.0").await
}

/// A fake engine reporting `waiting` requests and a picker with flow control (`flow`) and
/// `routing.saturation: saturation` that has seen it so (its pool-saturation gauge at `gauge`).
async fn picker_at(
    waiting: u64,
    flow: &str,
    saturation: &str,
    gauge: &str,
) -> (FakeEngine, kvroute_picker::service::Running) {
    let engine = FakeEngine::start("127.0.0.1").await;
    engine.state.waiting.store(waiting, Ordering::SeqCst);
    let picker = start_picker(&yaml_with(engine.addr.port(), flow, saturation)).await;
    metric(
        &picker,
        &format!(r#"kvroute_picker_pool_saturation{{model_config="llama"}} {gauge}"#),
    )
    .await;
    (engine, picker)
}

/// A completion with the given headers; returns its status and `x-kvroute-reason`.
async fn post(http: std::net::SocketAddr, headers: &[(&str, String)]) -> (u16, Option<String>) {
    let mut r = client()
        .post(format!("http://{http}/v1/completions"))
        .json(&json!({"model": "llama", "prompt": "hello", "max_tokens": 4}));
    for (h, v) in headers {
        r = r.header(*h, v);
    }
    let resp = r.send().await.unwrap();
    let reason = resp
        .headers()
        .get("x-kvroute-reason")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    (resp.status().as_u16(), reason)
}

/// A completion with priority header `priority`.
async fn complete(http: std::net::SocketAddr, priority: Option<i32>) -> (u16, Option<String>) {
    let h: Vec<(&str, String)> = priority
        .map(|p| ("x-kvroute-priority", p.to_string()))
        .into_iter()
        .collect();
    post(http, &h).await
}

/// A completion carrying TTFT objective `slo` (ms) when given.
async fn complete_within(http: std::net::SocketAddr, slo: Option<u32>) -> (u16, Option<String>) {
    let h: Vec<(&str, String)> = slo
        .map(|v| ("x-slo-ttft-ms", v.to_string()))
        .into_iter()
        .collect();
    post(http, &h).await
}

#[tokio::test]
async fn saturated_requests_wait_and_leave_by_priority() {
    let engine = FakeEngine::start("127.0.0.1").await;
    let picker = start_picker(&yaml(
        engine.addr.port(),
        "ttl: 30s, priorityHeader: x-kvroute-priority",
    ))
    .await;
    let http = picker.addrs.http;
    // with headroom (once scraped) a request goes straight on, not through the queue
    metric(
        &picker,
        r#"kvroute_picker_pool_saturation{model_config="llama"} 0.125"#,
    )
    .await;
    assert_eq!(complete(http, None).await.0, 200);
    // the engine's queue at 10 of the default depth 5: saturated
    engine.state.waiting.store(10, Ordering::SeqCst);
    metric(
        &picker,
        r#"kvroute_picker_pool_saturation{model_config="llama"} 2.0"#,
    )
    .await;
    let served = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (name, priority) in [("low", -1), ("high", 5)] {
        let served = served.clone();
        tasks.push(tokio::spawn(async move {
            let (status, _) = complete(http, Some(priority)).await;
            served.lock().push((name, status));
        }));
        // the low one is queued first
        queued(&picker, tasks.len()).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        served.lock().is_empty(),
        "nothing is placed while saturated"
    );
    let before = engine.state.requests.load(Ordering::SeqCst);
    // one slot of headroom (4 waiting of 5): the gate releases one request at a time
    engine.state.waiting.store(4, Ordering::SeqCst);
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(*served.lock(), vec![("high", 200), ("low", 200)]);
    assert_eq!(engine.state.requests.load(Ordering::SeqCst), before + 2);
    metric(&picker, "kvroute_picker_flow_dispatched_total 2").await;
    // the decision latency leaves the wait out (it has its own histogram): the two requests
    // waited 300 ms and more each; their decisions, the wait left out, a small part of that
    let text = kvroute_testkit::get_text(
        &client(),
        format!("http://{}/metrics", picker.addrs.metrics),
    )
    .await;
    let sum = |name: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("{name} in\n{text}"))
    };
    let wait = sum("kvroute_picker_flow_wait_seconds_sum");
    assert!(wait >= 0.6, "{text}");
    assert!(
        sum("kvroute_picker_decision_seconds_sum") < wait / 2.0,
        "{text}"
    );
    picker.shutdown().await;
}

#[tokio::test]
async fn a_request_that_waits_its_ttl_is_answered_429() {
    let (_engine, picker) = saturated("ttl: 200ms").await;
    let started = std::time::Instant::now();
    let (status, reason) = complete(picker.addrs.http, None).await;
    assert_eq!((status, reason.as_deref()), (429, Some("queue_expired")));
    assert!(started.elapsed() >= Duration::from_millis(200));
    metric(
        &picker,
        r#"kvroute_picker_flow_shed_total{kind="queue_expired",band="standard"} 1"#,
    )
    .await;
    // nothing is left waiting
    metric(&picker, r#"kvroute_picker_flow_dispatched_total 0"#).await;
    picker.shutdown().await;
}

#[tokio::test]
async fn a_full_queue_refuses_its_band_and_displaces_a_lower_one() {
    let (engine, picker) =
        saturated("ttl: 30s, maxQueued: 1, priorityHeader: x-kvroute-priority").await;
    let http = picker.addrs.http;
    let low = tokio::spawn(async move { complete(http, Some(-1)).await });
    queued(&picker, 1).await;
    // the same band finds the queue full
    let (status, reason) = complete(http, Some(-1)).await;
    assert_eq!((status, reason.as_deref()), (429, Some("queue_full")));
    // a higher band pushes the low one out and waits
    let high = tokio::spawn(async move { complete(http, Some(3)).await });
    let (status, reason) = low.await.unwrap();
    assert_eq!((status, reason.as_deref()), (429, Some("displaced")));
    engine.state.waiting.store(0, Ordering::SeqCst);
    assert_eq!(high.await.unwrap().0, 200);
    // counted by reason and by the band of the request answered
    for kind in ["queue_full", "displaced"] {
        metric(
            &picker,
            &format!(r#"kvroute_picker_flow_shed_total{{kind="{kind}",band="sheddable"}} 1"#),
        )
        .await;
    }
    picker.shutdown().await;
}

/// A raw priority is believed only from the header the operator names: by default a client
/// asking for band 1000 stays in the default band, and only a named objective moves it
/// (Hardening IV, 3).
#[tokio::test]
async fn a_client_cannot_choose_its_own_band_by_default() {
    let (engine, picker) =
        saturated("ttl: 30s, maxQueued: 1, objectives: [{name: critical, priority: 5}]").await;
    let http = picker.addrs.http;
    let first = tokio::spawn(async move { complete(http, None).await });
    queued(&picker, 1).await;
    // the header names a band no gateway gave it: it is the default band, and finds the queue full
    let (status, reason) = complete(http, Some(1000)).await;
    assert_eq!((status, reason.as_deref()), (429, Some("queue_full")));
    // a named objective is what raises a request
    let critical = tokio::spawn(async move {
        post(
            http,
            &[("x-llm-d-inference-objective", "critical".to_owned())],
        )
        .await
    });
    let (status, reason) = first.await.unwrap();
    assert_eq!((status, reason.as_deref()), (429, Some("displaced")));
    engine.state.waiting.store(0, Ordering::SeqCst);
    assert_eq!(critical.await.unwrap().0, 200);
    picker.shutdown().await;
}

#[tokio::test]
async fn a_client_that_leaves_is_taken_out_of_line() {
    let (engine, picker) = saturated("ttl: 30s").await;
    let http = picker.addrs.http;
    let waiting = tokio::spawn(async move { complete(http, None).await });
    queued(&picker, 1).await;
    waiting.abort();
    let _ = waiting.await;
    // the queue empties (its series goes) and the engine never sees the request
    let c = client();
    let url = format!("http://{}/metrics", picker.addrs.metrics);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let text = kvroute_testkit::get_text(&c, url.clone()).await;
        if !text.contains("kvroute_picker_flow_queued{") {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{text}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before = engine.state.requests.load(Ordering::SeqCst);
    engine.state.waiting.store(0, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(engine.state.requests.load(Ordering::SeqCst), before);
    picker.shutdown().await;
}

/// The ext_proc listener queues the same way: the gateway's stream stays open until the
/// request is dispatched, and a request that waits its TTL gets an immediate 429.
#[tokio::test]
async fn the_gateway_stream_waits_for_dispatch() {
    let (engine, picker) = saturated("ttl: 30s").await;
    let ext = gateway::channel(picker.addrs.ext_proc.unwrap()).await;
    let body = br#"{"model":"llama","prompt":"hello"}"#;
    let waiting = {
        let ext = ext.clone();
        tokio::spawn(async move { gateway::request(&ext, "/v1/completions", &[], body).await })
    };
    queued(&picker, 1).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!waiting.is_finished(), "answered while saturated");
    engine.state.waiting.store(0, Ordering::SeqCst);
    let answer = waiting.await.unwrap();
    assert_eq!(answer.destination(), engine.addr.to_string());
    picker.shutdown().await;

    let picker = start_picker(&yaml(engine.addr.port(), "ttl: 100ms")).await;
    engine.state.waiting.store(10, Ordering::SeqCst);
    metric(
        &picker,
        r#"kvroute_picker_pool_saturation{model_config="llama"} 2.0"#,
    )
    .await;
    let ext = gateway::channel(picker.addrs.ext_proc.unwrap()).await;
    let answer = gateway::request(&ext, "/v1/completions", &[], body).await;
    assert_eq!(answer.refused(), 429);
    picker.shutdown().await;
}

/// The settings apply live: a picker started with flow control off lets a saturated pool's
/// request through; after the file is edited, the next one waits; turned off again, the queue
/// is released.
#[tokio::test]
async fn flow_control_settings_apply_without_restart() {
    let engine = FakeEngine::start("127.0.0.1").await;
    engine.state.waiting.store(10, Ordering::SeqCst);
    let dir = std::env::temp_dir().join(format!("kvroute-flow-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("picker.yaml");
    let write = |flow: &str| {
        let yaml = loopback_listen(&yaml_routing(
            engine.addr.port(),
            &format!("flowControl: {{{flow}}}"),
        ));
        write_atomically(&path, &yaml);
    };
    write("enabled: false");
    let picker = start_picker_file(path.clone()).await;
    let http = picker.addrs.http;
    metric(
        &picker,
        r#"kvroute_picker_pool_saturation{model_config="llama"} 2.0"#,
    )
    .await;
    assert_eq!(complete(http, None).await.0, 200, "off: straight on");
    write("enabled: true, ttl: 30s");
    let state = picker.state.clone();
    eventually(Duration::from_secs(5), || {
        state.routing().flow_control.enabled
    })
    .await;
    let waiting = tokio::spawn(async move { complete(http, None).await });
    queued(&picker, 1).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!waiting.is_finished(), "on: it waits");
    // turned off again, the queue is released
    write("enabled: false");
    assert_eq!(waiting.await.unwrap().0, 200);
    picker.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// A TTFT objective the cost model predicts no endpoint can meet is answered at once.
#[tokio::test]
async fn an_unattainable_ttft_objective_is_answered_at_once() {
    let engine = FakeEngine::start("127.0.0.1").await;
    let picker = start_picker(&yaml(engine.addr.port(), "ttl: 30s")).await;
    metric(
        &picker,
        r#"kvroute_picker_pool_saturation{model_config="llama"} 0.125"#,
    )
    .await;
    let send = |slo: &'static str| {
        client()
            .post(format!("http://{}/v1/completions", picker.addrs.http))
            .header("x-slo-ttft-ms", slo)
            .json(&json!({"model": "llama", "prompt": "hello"}))
            .send()
    };
    // even an idle engine needs more than a millisecond for a prefill step
    let resp = send("1").await.unwrap();
    assert_eq!(resp.status(), 429);
    assert_eq!(resp.headers()["x-kvroute-reason"], "slo_unattainable");
    let before = engine.state.requests.load(Ordering::SeqCst);
    assert_eq!(send("60000").await.unwrap().status(), 200);
    assert_eq!(engine.state.requests.load(Ordering::SeqCst), before + 1);
    metric(
        &picker,
        r#"kvroute_picker_flow_shed_total{kind="slo_unattainable",band="standard"} 1"#,
    )
    .await;
    picker.shutdown().await;
}

/// Three requests of one flow wait (the engine's queue at 10 of depth 1); released one at a
/// time (each holds the single place until it is answered, 300 ms), they leave in `order`.
async fn leaving_order(order: &str) -> Vec<&'static str> {
    let (engine, picker) = picker_at(
        10,
        &format!("ttl: 30s, order: {order}"),
        "{queueDepth: 1}",
        "10.0",
    )
    .await;
    *engine.state.slow.lock() = Some(("hello".into(), 300));
    let http = picker.addrs.http;
    let served = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (name, slo) in [
        ("none", None),
        ("late", Some(30_000)),
        ("soon", Some(10_000)),
    ] {
        let served = served.clone();
        tasks.push(tokio::spawn(async move {
            let (status, _) = complete_within(http, slo).await;
            assert_eq!(status, 200, "{name}");
            served.lock().push(name);
        }));
        queued(&picker, tasks.len()).await;
    }
    engine.state.waiting.store(0, Ordering::SeqCst);
    for t in tasks {
        t.await.unwrap();
    }
    picker.shutdown().await;
    served.lock().clone()
}

#[tokio::test]
async fn requests_with_a_ttft_objective_leave_by_deadline() {
    assert_eq!(
        leaving_order("EarliestDeadline").await,
        ["soon", "late", "none"],
        "the earliest deadline first, then those without one"
    );
    assert_eq!(
        leaving_order("FirstComeFirstServed").await,
        ["none", "late", "soon"],
        "arrival order, objectives or not"
    );
}

/// `unattainableSlo: Queue`: a request whose objective no endpoint is predicted to meet (the
/// engine reports 200 waiting requests: about 4 s of assumed prefill) waits and is placed once
/// the prediction meets what is left; one that never can is answered 429 near its deadline.
#[tokio::test]
async fn an_unattainable_objective_can_wait_instead_of_being_shed() {
    // a deep queue threshold: flow control itself holds nothing
    let (engine, picker) = picker_at(
        200,
        "ttl: 30s, unattainableSlo: Queue",
        "{queueDepth: 1000}",
        "0.2",
    )
    .await;
    let http = picker.addrs.http;
    let before = engine.state.requests.load(Ordering::SeqCst);
    let waiting = tokio::spawn(async move { complete_within(http, Some(3_000)).await });
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(!waiting.is_finished(), "it waits rather than being shed");
    assert_eq!(engine.state.requests.load(Ordering::SeqCst), before);
    // the engine's queue drains: the prediction meets the objective
    engine.state.waiting.store(0, Ordering::SeqCst);
    assert_eq!(waiting.await.unwrap(), (200, None));
    assert_eq!(engine.state.requests.load(Ordering::SeqCst), before + 1);

    engine.state.waiting.store(200, Ordering::SeqCst);
    metric(
        &picker,
        r#"kvroute_picker_pool_saturation{model_config="llama"} 0.2"#,
    )
    .await;
    let started = std::time::Instant::now();
    let (status, reason) = complete_within(http, Some(400)).await;
    assert_eq!((status, reason.as_deref()), (429, Some("slo_unattainable")));
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "answered when its objective was nearly spent, not at once"
    );
    assert_eq!(engine.state.requests.load(Ordering::SeqCst), before + 1);
    picker.shutdown().await;
}

/// `routing.saturation.sheddableQueueDepth`: with the engine's queue at 3, a sheddable request
/// (priority -1, room below 2) waits while a priority-0 one (room below 5) goes on; it leaves
/// when the queue falls below 2.
#[tokio::test]
async fn sheddable_requests_leave_room_for_the_other_bands() {
    let (engine, picker) = picker_at(
        3,
        "ttl: 30s, priorityHeader: x-kvroute-priority",
        "{queueDepth: 5, sheddableQueueDepth: 2}",
        "0.6",
    )
    .await;
    let http = picker.addrs.http;
    let sheddable = tokio::spawn(async move { complete(http, Some(-1)).await });
    queued(&picker, 1).await;
    assert_eq!(complete(http, Some(0)).await.0, 200, "the room kept for it");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !sheddable.is_finished(),
        "no room below sheddableQueueDepth"
    );
    engine.state.waiting.store(1, Ordering::SeqCst);
    assert_eq!(sheddable.await.unwrap().0, 200);
    picker.shutdown().await;
}

/// `placement`: with flow control on, a request goes to an endpoint with room (`WithRoom`, the
/// default) even when the policy (round robin here) would send it to a saturated one;
/// `Anywhere` leaves the choice to the policy.
#[tokio::test]
async fn requests_are_placed_where_the_room_is() {
    let full = FakeEngine::start("127.0.0.1").await;
    let free = FakeEngine::start("127.0.0.1").await;
    // full: 4 waiting, at the sheddable depth of 4 but below the default depth 5
    full.state.waiting.store(4, Ordering::SeqCst);
    let yaml = |placement: &str| {
        format!(
            r#"
modelConfigs:
  - {{name: llama, model: llama, port: {}}}
endpoints:
  - {{address: 127.0.0.1, modelConfig: llama}}
  - {{address: 127.0.0.1, modelConfig: llama, port: {}}}
scrape: {{interval: 50ms, timeout: 200ms}}
routing:
  strategy: RoundRobin
  saturation: {{sheddableQueueDepth: 4}}
  flowControl: {{enabled: true, placement: {placement}, priorityHeader: x-kvroute-priority}}
"#,
            full.addr.port(),
            free.addr.port()
        )
    };
    for (placement, priority, to_full) in
        [("WithRoom", -1, 0), ("WithRoom", 0, 3), ("Anywhere", -1, 3)]
    {
        let picker = start_picker(&yaml(placement)).await;
        metric(
            &picker,
            r#"kvroute_picker_pool_saturation{model_config="llama"} 0.4625"#,
        )
        .await;
        let before = full.state.requests.load(Ordering::SeqCst);
        for _ in 0..6 {
            assert_eq!(complete(picker.addrs.http, Some(priority)).await.0, 200);
        }
        assert_eq!(
            full.state.requests.load(Ordering::SeqCst) - before,
            to_full,
            "{placement}, priority {priority}"
        );
        picker.shutdown().await;
    }
}

/// An endpoint whose metrics went stale has no room: a request waits until they are fresh
/// again (and the pool-saturation gauge counts it as saturated meanwhile).
#[tokio::test]
async fn stale_metrics_count_as_saturated() {
    let engine = FakeEngine::start("127.0.0.1").await;
    let picker = start_picker(&yaml_routing(
        engine.addr.port(),
        "stalenessThreshold: 300ms\n  flowControl: {enabled: true, ttl: 30s}",
    ))
    .await;
    let http = picker.addrs.http;
    metric(
        &picker,
        r#"kvroute_picker_pool_saturation{model_config="llama"} 0.125"#,
    )
    .await;
    engine.state.metrics_broken.store(true, Ordering::SeqCst);
    metric(
        &picker,
        r#"kvroute_picker_pool_saturation{model_config="llama"} 1.0"#,
    )
    .await;
    let before = engine.state.requests.load(Ordering::SeqCst);
    let waiting = tokio::spawn(async move { complete(http, None).await });
    queued(&picker, 1).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !waiting.is_finished(),
        "no room while the metrics are stale"
    );
    assert_eq!(engine.state.requests.load(Ordering::SeqCst), before);
    engine.state.metrics_broken.store(false, Ordering::SeqCst);
    assert_eq!(waiting.await.unwrap().0, 200);
    assert_eq!(engine.state.requests.load(Ordering::SeqCst), before + 1);
    picker.shutdown().await;
}

/// A body larger than `maxQueuedBytes` cannot wait: 429 `too_large`, while a small one waits.
#[tokio::test]
async fn a_body_larger_than_the_queue_is_refused() {
    let (engine, picker) = saturated("ttl: 30s, maxQueuedBytes: 1024").await;
    let http = picker.addrs.http;
    let resp = client()
        .post(format!("http://{http}/v1/completions"))
        .json(&json!({"model": "llama", "prompt": "word ".repeat(400), "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 429);
    assert_eq!(resp.headers()["x-kvroute-reason"], "too_large");
    assert!(resp.headers().contains_key("retry-after"));
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "too_large", "{body}");
    let waiting = tokio::spawn(async move { complete(http, None).await });
    queued(&picker, 1).await;
    engine.state.waiting.store(0, Ordering::SeqCst);
    assert_eq!(waiting.await.unwrap().0, 200);
    metric(
        &picker,
        r#"kvroute_picker_flow_shed_total{kind="too_large",band="standard"} 1"#,
    )
    .await;
    picker.shutdown().await;
}

/// Issue 49: a request whose answer comes whole shows no first token, and it used to count as
/// waiting at its endpoint until its answer ended, so flow control held requests back from an
/// engine that was running them (40 non-streamed completions: 1.88 s with flow control, 0.25 s
/// without). Its prefill is taken to be over once its predicted first token is due: here the
/// engine runs twelve requests that never end, more than its queue depth of 5.
#[tokio::test]
async fn non_streamed_requests_leave_the_queue_once_their_prefill_is_due() {
    let engine = FakeEngine::start("127.0.0.1").await;
    let picker = start_picker(&yaml(engine.addr.port(), "ttl: 60s")).await;
    metric(
        &picker,
        r#"kvroute_picker_pool_saturation{model_config="llama"} 0.125"#,
    )
    .await;
    engine.state.hang.store(true, Ordering::SeqCst);
    let http = picker.addrs.http;
    let held: Vec<_> = (0..12)
        .map(|_| tokio::spawn(async move { complete(http, None).await }))
        .collect();
    // bounded, not timed: each request's predicted first token is a few ms away
    let mut seen = 0;
    for _ in 0..1_000 {
        seen = engine.state.requests.load(Ordering::SeqCst);
        if seen == 12 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(seen, 12, "the engine runs every request, none held back");
    for h in held {
        h.abort();
    }
    picker.shutdown().await;
}

/// Issue 49: the pool-saturation gauge, meant for an autoscaler, read only the engines' own
/// counters and stayed at 0 while the picker held requests. It counts what the picker holds:
/// at the engines' thresholds and three requests held it reads above 1; idle again, what the
/// engine's KV usage alone says.
#[tokio::test]
async fn the_saturation_gauge_counts_the_requests_the_picker_holds() {
    let (engine, picker) = picker_at(5, "ttl: 30s", "{}", "1.0").await;
    let http = picker.addrs.http;
    let held: Vec<_> = (0..3)
        .map(|_| tokio::spawn(async move { complete(http, None).await }))
        .collect();
    queued(&picker, 3).await;
    // 1.0 from the engine, 3 held over a depth of 5
    metric(
        &picker,
        r#"kvroute_picker_pool_saturation{model_config="llama"} 1.6"#,
    )
    .await;
    engine.state.waiting.store(0, Ordering::SeqCst);
    for h in held {
        assert_eq!(h.await.unwrap().0, 200);
    }
    // (the fake engine's KV cache is an eighth full)
    metric(
        &picker,
        r#"kvroute_picker_pool_saturation{model_config="llama"} 0.125"#,
    )
    .await;
    picker.shutdown().await;
}
