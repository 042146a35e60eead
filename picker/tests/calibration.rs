//! The cost model calibrates itself from what a running picker observes (issue 14, item 2):
//! streamed responses through the proxy teach it an endpoint's time to first token, the
//! engine's histograms its prefill rate; `/v1/pick` explains the learned values per candidate
//! and the metrics expose them, until the endpoint leaves or calibration is turned off.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use kvroute_picker::config::CostModelCalibration;
use kvroute_picker::service::settings::PickerConfig;
use kvroute_picker::service::source::view_from_config;
use serde_json::{Value, json};
use support::*;

fn yaml(port: u16) -> String {
    one_engine_scraped(port, "", "")
}

/// A 512-token prompt of its own (so that no request finds another's blocks cached).
fn prompt(n: u32) -> Value {
    json!((0..512).map(|i| n * 1000 + i).collect::<Vec<u32>>())
}

async fn complete(addr: std::net::SocketAddr, n: u32, stream: bool) {
    let resp = client()
        .post(format!("http://{addr}/v1/completions"))
        .json(&json!({"model": "llama", "prompt": prompt(n), "stream": stream}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp.bytes().await.unwrap();
}

/// The one candidate's explained features for a fresh prompt.
async fn explained(admin: std::net::SocketAddr) -> Value {
    let pick: Value = kvroute_testkit::post_json(
        &client(),
        format!("http://{admin}/v1/pick"),
        &json!({"model": "llama", "prompt": prompt(9999)}),
    )
    .await;
    pick["candidates"][0]["features"].clone()
}

/// The value of the metric line that starts with `series`, if any.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

#[tokio::test]
async fn streamed_requests_teach_the_cost_model_and_pick_and_metrics_show_it() {
    let engine = FakeEngine::start("127.0.0.1").await;
    // a slow engine: 150 ms of prefill before its first chunk, where the prior expects ~25
    engine
        .state
        .first_chunk_delay_ms
        .store(150, Ordering::SeqCst);
    let config = PickerConfig::from_yaml(&loopback_listen(&yaml(engine.addr.port()))).unwrap();
    let picker = start_picker(&yaml(engine.addr.port())).await;
    let (http, admin, metrics) = (picker.addrs.http, picker.addrs.admin, picker.addrs.metrics);
    let prior = CostModelCalibration::default();
    let endpoint = format!("127.0.0.1:{}#0", engine.addr.port());
    let series =
        |name: &str| format!("kvroute_picker_cost_model_{name}{{endpoint=\"{endpoint}\"}}");
    let observations = |source: &str| {
        format!(
            "kvroute_picker_cost_model_calibration_observations{{endpoint=\"{endpoint}\",source=\"{source}\"}}"
        )
    };

    // a response that is not streamed has no first token to time: nothing is learned
    complete(http, 1, false).await;
    assert_eq!(explained(admin).await["learned"], Value::Null);
    let text = metrics_text(metrics).await;
    assert_eq!(sample(&text, &series("overhead_ms")), None, "{text}");

    for n in 0..12 {
        complete(http, 100 + n, true).await;
    }
    let learned = explained(admin).await["learned"].clone();
    let overhead = learned["overhead_ms"].as_f64().unwrap();
    assert!(overhead > 2.0 * prior.prefill_constant_ms, "{learned}");
    assert_eq!(learned["observations"], 12, "{learned}");
    let text = metrics_text(metrics).await;
    // the same value, up to the ageing between the two reads (the statistics halve every
    // 10 s, and the estimate moves only as the prior gains on them)
    let gauge = sample(&text, &series("overhead_ms")).expect("overhead gauge");
    assert!(
        (gauge - overhead).abs() < 0.01 * overhead,
        "{gauge} vs {learned}"
    );
    assert!(
        sample(&text, &series("prefill_ms_per_token")).is_some(),
        "{text}"
    );
    assert_eq!(
        sample(&text, &series("decode_step_ms")),
        Some(prior.decode_base_ms)
    );
    assert_eq!(sample(&text, &observations("picker_ttft")), Some(12.0));
    assert_eq!(sample(&text, &observations("engine_prefill")), Some(0.0));

    // calibration off: the configured values for everyone, and no gauges
    let mut view = view_from_config(&config);
    view.routing.cost_model.calibrate = false;
    picker.state.apply_pool(&view).unwrap();
    assert_eq!(explained(admin).await["learned"], Value::Null);
    let text = metrics_text(metrics).await;
    assert_eq!(sample(&text, &series("overhead_ms")), None, "{text}");
    complete(http, 200, true).await;
    assert_eq!(explained(admin).await["learned"], Value::Null);

    // on again, learning starts from the prior; an endpoint that leaves takes its gauges along
    view.routing.cost_model.calibrate = true;
    picker.state.apply_pool(&view).unwrap();
    complete(http, 300, true).await;
    assert_eq!(explained(admin).await["learned"]["observations"], 1);
    assert!(sample(&metrics_text(metrics).await, &series("overhead_ms")).is_some());
    view.endpoints.clear();
    picker.state.apply_pool(&view).unwrap();
    let text = metrics_text(metrics).await;
    let gauges = text
        .lines()
        .filter(|l| l.starts_with("kvroute_picker_cost_model") && l.contains(&endpoint));
    assert_eq!(gauges.count(), 0, "{text}");
    assert!(picker.state.pool.calibration().read().is_empty());
    picker.shutdown().await;
}

#[tokio::test]
async fn engine_histograms_teach_the_prefill_rate_with_less_weight() {
    let engine = FakeEngine::start("127.0.0.1").await;
    let picker = start_picker(&yaml(engine.addr.port())).await;
    let prior = CostModelCalibration::default();
    // the engine's own account: every request 1,000 uncached tokens and 2 s of prefill
    let requests = std::sync::atomic::AtomicU64::new(0);
    let publish = |n: u64| {
        *engine.state.extra_metrics.lock() = format!(
            "vllm:request_prefill_time_seconds_sum{{engine=\"0\",model_name=\"m\"}} {}\n\
             vllm:request_prefill_time_seconds_count{{engine=\"0\",model_name=\"m\"}} {n}\n\
             vllm:request_prefill_kv_computed_tokens_sum{{engine=\"0\",model_name=\"m\"}} {}\n\
             vllm:request_prefill_kv_computed_tokens_count{{engine=\"0\",model_name=\"m\"}} {n}\n",
            2.0 * n as f64,
            1000 * n,
        );
    };
    publish(0);
    let state = picker.state.clone();
    let id = state.pool.state().endpoints().endpoints()[0].id;
    // each poll the engine finishes another request; scrapes see the deltas
    eventually(Duration::from_secs(20), || {
        publish(requests.fetch_add(1, Ordering::SeqCst) + 1);
        state
            .pool
            .calibration()
            .read()
            .status(&id)
            .is_some_and(|s| s.observations.engine_prefill >= 3)
    })
    .await;
    let learned = explained(picker.addrs.admin).await["learned"].clone();
    let per_token = learned["prefill_ms_per_token"].as_f64().unwrap();
    assert!(per_token > prior.prefill_linear_ms, "{learned}");
    let status = state.pool.calibration().read().status(&id).unwrap();
    assert_eq!(status.observations.picker_ttft, 0);
    assert!(
        status.engine_weight > 0.0 && status.picker_weight == 0.0,
        "{status:?}"
    );
    let text = metrics_text(picker.addrs.metrics).await;
    let engine_prefill = format!(
        "kvroute_picker_cost_model_calibration_observations{{endpoint=\"127.0.0.1:{}#0\",source=\"engine_prefill\"}}",
        engine.addr.port()
    );
    assert!(
        sample(&text, &engine_prefill).is_some_and(|n| n >= 3.0),
        "{text}"
    );
    picker.shutdown().await;
}

#[tokio::test]
async fn the_gateway_path_times_the_first_body_chunk_of_streamed_responses() {
    use kvroute_picker::service::ext_proc::{EndpointPicker, PickInput};
    use kvroute_picker::service::gateway::GatewayPicker;

    let engine = FakeEngine::start("127.0.0.1").await;
    let picker = start_picker(&yaml(engine.addr.port())).await;
    let gateway = GatewayPicker::new(picker.state.clone());
    let state = picker.state.clone();
    let id = state.pool.state().endpoints().endpoints()[0].id;
    let observed = || {
        state
            .pool
            .calibration()
            .read()
            .status(&id)
            .map_or(0, |s| s.observations.picker_ttft)
    };
    let input = |request_id: u64, stream: bool| PickInput {
        request_id,
        headers: http::HeaderMap::new(),
        path: "/v1/completions".into(),
        body: bytes::Bytes::from(
            json!({"model": "llama", "prompt": prompt(request_id as u32), "stream": stream})
                .to_string(),
        ),
        subset: None,
    };
    // (streamed, status): only a streamed response that succeeds times a first token
    for (request_id, stream, status, counted) in [
        (1, true, 200, 1),
        (2, false, 200, 1),
        (3, true, 503, 1),
        (4, true, 200, 2),
    ] {
        gateway
            .pick(input(request_id, stream))
            .await
            .expect("picked");
        // the engine's prefill, as the gateway would wait for it
        tokio::time::sleep(Duration::from_millis(100)).await;
        gateway.on_response_status(request_id, status);
        gateway.on_first_response_body(request_id);
        gateway.on_first_response_body(request_id);
        gateway.on_response_complete(request_id);
        assert_eq!(observed(), counted, "request {request_id}");
    }
    let learned = state
        .pool
        .calibration()
        .read()
        .learned(&id)
        .expect("learned");
    assert!(
        learned.overhead_ms > CostModelCalibration::default().prefill_constant_ms,
        "{learned:?}"
    );
    picker.shutdown().await;
}
