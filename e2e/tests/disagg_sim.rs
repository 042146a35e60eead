//! Prefill/decode disaggregation through the picker against simulated engines with a KV
//! connector (`kvroute-sim --kv-transfer`): the two-step handshake through the proxy
//! (streamed), the decider, prefix credit on the prefill side from real event flow, each
//! failure mode, a client going away mid-prefill, both steps on the chosen data-parallel
//! ranks, and the ext_proc answer for llm-d's routing sidecar.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use kvroute_picker::service::Running;
use kvroute_sim::server::{KvLoadFailure, SimConfig, SimHandle, start as start_sim};
use serde_json::{Value, json};

#[path = "ext_proc_support/mod.rs"]
mod envoy;
#[path = "sim_support/mod.rs"]
mod sim_support;
use sim_support::{
    LLAMA_PRECISE, LOOPBACK_LISTEN, client, endpoint_entry, eventually, indexed_blocks, pick,
    prompt, sim_config, static_picker,
};

async fn sim(host: &str) -> SimHandle {
    let mut cfg = SimConfig {
        kv_transfer: Some(KvLoadFailure::Recompute),
        ..sim_config(host, 20.0)
    };
    cfg.engine.kv_transfer_ms_per_block = 0.05;
    cfg.engine.kv_transfer_latency_ms = 2.0;
    start_sim(cfg).await.expect("simulator starts")
}

/// A picker over `(engine, role)`, disaggregating with `disaggregation` (YAML flow map).
async fn picker(engines: &[(&SimHandle, &str)], disaggregation: &str) -> Running {
    let endpoints: String = engines
        .iter()
        .map(|(e, role)| endpoint_entry(e, &format!(", role: {role}")))
        .collect();
    let yaml = format!(
        r#"
{LOOPBACK_LISTEN}
{LLAMA_PRECISE}endpoints:
{endpoints}
routing: {{stalenessThreshold: 1m, disaggregation: {disaggregation}}}
scrape: {{interval: 50ms}}
"#
    );
    let p = static_picker(&yaml).await;
    // every engine scraped once, so none is passed over as never seen
    eventually("first scrape", || {
        p.state.pool.state().read().loads().len() == engines.len()
    })
    .await;
    p
}

/// A counter or gauge of an engine's `/metrics` (summed over its labelled series matching
/// `labels`).
async fn engine_metric(e: &SimHandle, name: &str, labels: &str) -> f64 {
    let text =
        kvroute_testkit::get_text(&client(), format!("http://{}/metrics", e.addrs()[0].http)).await;
    kvroute_testkit::metric_sum(&text, name, &[labels])
}

/// A one-token completion of `tokens` sent to engine `e` directly, past the picker.
async fn complete_on(e: &SimHandle, tokens: &[u32]) {
    let r = client()
        .post(format!("http://{}/v1/completions", e.addrs()[0].http))
        .json(&json!({"model": "llama", "prompt": tokens, "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

/// Stop engine `e` (its listeners close) and wait until it refuses connections.
async fn crash(e: &SimHandle) {
    let http = e.addrs()[0].http;
    kvroute_testkit::post_json(
        &client(),
        format!("http://{http}/admin/fault"),
        &json!({"kind": "crash", "mode": "close"}),
    )
    .await;
    for _ in 0..200 {
        if tokio::net::TcpStream::connect(http).await.is_err() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{http} still accepts connections");
}

async fn picker_metric(p: &Running, line: &str) -> f64 {
    let text =
        kvroute_testkit::get_text(&client(), format!("http://{}/metrics", p.addrs.metrics)).await;
    text.lines()
        .find(|l| l.starts_with(line))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

/// A streamed completion through the picker: its text and whether it ended with `[DONE]`.
async fn stream(p: &Running, tokens: &[u32], max_tokens: u32) -> (String, bool) {
    let r = client()
        .post(format!("http://{}/v1/completions", p.addrs.http))
        .json(
            &json!({"model": "llama", "prompt": tokens, "max_tokens": max_tokens, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    let body = r.text().await.unwrap();
    let mut text = String::new();
    let mut done = false;
    for line in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if line == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(line).unwrap();
        text.push_str(v["choices"][0]["text"].as_str().unwrap_or_default());
    }
    (text, done)
}

const AUTO: &str = "{mode: Auto, minUncachedTokens: 256}";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prompt_is_prefilled_on_the_prefill_engine_and_streamed_from_the_decode_engine() {
    let pf = sim("127.0.0.31").await;
    let de = sim("127.0.0.32").await;
    let p = picker(&[(&pf, "prefill"), (&de, "decode")], AUTO).await;
    let tokens = prompt(1, 1024);

    let explained = pick(&p, &tokens).await;
    assert_eq!(
        explained["disaggregation"]["verdict"], "split",
        "{explained}"
    );
    assert_eq!(
        explained["prefill"]["endpoint"],
        pf.addrs()[0].http.to_string()
    );
    assert_eq!(explained["endpoint"], de.addrs()[0].http.to_string());
    assert_eq!(explained["policy"], "Decode");

    let (text, done) = stream(&p, &tokens, 8).await;
    assert!(done, "the decode engine's stream reached the client");
    assert_eq!(text.chars().count(), 8, "{text:?}");
    // the prefill engine computed the prompt and one token; the decode engine pulled all of
    // the prompt's KV but its last block and generated the output
    assert_eq!(
        engine_metric(&pf, "vllm:generation_tokens_total", "").await,
        1.0
    );
    assert_eq!(
        engine_metric(&pf, "vllm:prompt_tokens_by_source_total", "local_compute").await,
        1024.0
    );
    assert_eq!(
        engine_metric(
            &de,
            "vllm:prompt_tokens_by_source_total",
            "external_kv_transfer"
        )
        .await,
        1024.0
    );
    assert_eq!(
        engine_metric(&de, "vllm:generation_tokens_total", "").await,
        8.0
    );
    assert_eq!(
        picker_metric(&p, "kvroute_picker_disaggregation_total{kind=\"split\"}").await,
        1.0
    );

    // a short prompt runs whole on the decode engine: the prefill engine sees nothing of it
    let short = prompt(2, 100);
    assert_eq!(
        pick(&p, &short).await["disaggregation"]["verdict"],
        "few_uncached"
    );
    let (text, _) = stream(&p, &short, 4).await;
    assert_eq!(text.chars().count(), 4);
    assert_eq!(
        engine_metric(&pf, "vllm:generation_tokens_total", "").await,
        1.0
    );
    assert_eq!(
        engine_metric(&de, "vllm:generation_tokens_total", "").await,
        12.0
    );
    p.shutdown().await;
    pf.shutdown();
    de.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prefill_engines_cache_from_its_events_moves_the_prefill_and_the_decider() {
    let p1 = sim("127.0.0.33").await;
    let p2 = sim("127.0.0.34").await;
    let de = sim("127.0.0.35").await;
    let p = picker(&[(&p1, "prefill"), (&p2, "prefill"), (&de, "decode")], AUTO).await;
    let tokens = prompt(3, 2048);
    // the prompt computed on p2 directly: only its KV events tell the picker
    complete_on(&p2, &tokens).await;
    let blocks_on = |ip: &str| indexed_blocks(&p, ip);
    eventually("p2's blocks", || blocks_on("127.0.0.34") >= 127).await;

    // the same conversation, grown by 512 tokens: prefilled where its prefix is
    let mut longer = tokens.clone();
    longer.extend(prompt(4, 512));
    let e = pick(&p, &longer).await;
    assert_eq!(
        e["prefill"]["endpoint"],
        p2.addrs()[0].http.to_string(),
        "{e}"
    );
    assert_eq!(e["prefill"]["cached_tokens"], 2048);
    assert_eq!(
        e["disaggregation"],
        json!({"verdict": "split", "uncached_tokens": 512})
    );
    // once the decode engine holds the conversation (its events say so), a turn that adds
    // only 100 tokens has too little left to prefill to pay for a transfer: it runs whole
    complete_on(&de, &tokens).await;
    eventually("the decode engine's blocks", || {
        blocks_on("127.0.0.35") >= 127
    })
    .await;
    let mut bit = tokens.clone();
    bit.extend(prompt(5, 100));
    let e = pick(&p, &bit).await;
    assert_eq!(
        e["disaggregation"],
        json!({"verdict": "few_uncached", "uncached_tokens": 100, "min": 256})
    );
    assert!(e["prefill"].is_null());
    p.shutdown().await;
    for s in [p1, p2, de] {
        s.shutdown();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_prefill_is_retried_on_the_next_prefill_engine_then_run_whole() {
    let p1 = sim("127.0.0.36").await;
    let p2 = sim("127.0.0.37").await;
    let de = sim("127.0.0.38").await;
    let p = picker(&[(&p1, "prefill"), (&p2, "prefill"), (&de, "decode")], AUTO).await;
    // one prefill engine gone: whichever the picker chose first, the split still happens
    crash(&p1).await;
    let (text, done) = stream(&p, &prompt(6, 1024), 4).await;
    assert!(done && text.chars().count() == 4);
    assert_eq!(
        engine_metric(
            &de,
            "vllm:prompt_tokens_by_source_total",
            "external_kv_transfer"
        )
        .await,
        1024.0,
        "the decode engine pulled the prompt from the prefill engine that answered"
    );
    assert_eq!(
        picker_metric(
            &p,
            "kvroute_picker_prefill_failures_total{kind=\"aggregated\"}"
        )
        .await,
        0.0
    );
    // both gone: tried on each, then run whole on the decode engine
    let before = picker_metric(
        &p,
        "kvroute_picker_prefill_failures_total{kind=\"retried\"}",
    )
    .await;
    crash(&p2).await;
    let (text, done) = stream(&p, &prompt(7, 1024), 4).await;
    assert!(done && text.chars().count() == 4);
    assert_eq!(
        picker_metric(
            &p,
            "kvroute_picker_prefill_failures_total{kind=\"retried\"}"
        )
        .await,
        before + 1.0
    );
    assert_eq!(
        picker_metric(
            &p,
            "kvroute_picker_prefill_failures_total{kind=\"aggregated\"}"
        )
        .await,
        1.0
    );
    assert_eq!(
        engine_metric(&de, "vllm:prompt_tokens_by_source_total", "local_compute").await,
        1024.0,
        "nothing of the split request, the whole prompt of the other"
    );
    p.shutdown().await;
    for s in [p1, p2, de] {
        s.shutdown();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_engine_that_fails_before_its_first_byte_is_replaced_with_the_same_kv() {
    let pf = sim("127.0.0.39").await;
    let d1 = sim("127.0.0.40").await;
    let d2 = sim("127.0.0.41").await;
    let p = picker(&[(&pf, "prefill"), (&d1, "decode"), (&d2, "decode")], AUTO).await;
    let tokens = prompt(8, 512);
    // d1 holds the conversation, so the decode goes there first; then it dies
    complete_on(&d1, &tokens).await;
    eventually("d1's blocks", || {
        pick_sync_endpoint(&p, &tokens) == Some(d1.addrs()[0].http.to_string())
    })
    .await;
    crash(&d1).await;
    let mut longer = tokens.clone();
    longer.extend(prompt(9, 1536));
    let (text, done) = stream(&p, &longer, 4).await;
    assert!(done && text.chars().count() == 4);
    assert_eq!(
        engine_metric(
            &d2,
            "vllm:prompt_tokens_by_source_total",
            "external_kv_transfer"
        )
        .await,
        2048.0,
        "the fallback decode engine pulled the KV the prefill engine computed"
    );
    assert_eq!(
        picker_metric(&p, "kvroute_picker_upstream_retries_total").await,
        1.0,
        "the decode went to d1 first"
    );
    p.shutdown().await;
    for s in [pf, d1, d2] {
        s.shutdown();
    }
}

/// Where the picker would decode `tokens` now (read from the pool, no HTTP).
fn pick_sync_endpoint(p: &Running, tokens: &[u32]) -> Option<String> {
    use kvroute_picker::block_keys::{BlockHasher, ChainRoot};
    use kvroute_picker::router::RouteRequest;
    let snapshot = p.state.pool.state().endpoints();
    let mc = snapshot.endpoints().first()?.model_config.clone();
    let keys = BlockHasher::new(16).keys(ChainRoot::new("llama", None, None), tokens);
    let req = RouteRequest::whole(&mc, &keys, tokens.len() as u32);
    let placed = p.state.pool.place_split(&req, p.state.now_ms()).ok()?;
    Some(placed.placement.decision.endpoint.host_port())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_during_the_prefill_cancels_it_and_nothing_is_decoded() {
    let pf = sim("127.0.0.42").await;
    let de = sim("127.0.0.43").await;
    let p = picker(&[(&pf, "prefill"), (&de, "decode")], AUTO).await;
    // a prefill that takes seconds
    kvroute_testkit::post_json(
        &client(),
        format!("http://{}/admin/fault", pf.addrs()[0].http),
        &json!({"kind": "slow", "factor": 2000.0}),
    )
    .await;
    let request = client()
        .post(format!("http://{}/v1/completions", p.addrs.http))
        .json(
            &json!({"model": "llama", "prompt": prompt(10, 1024), "max_tokens": 4, "stream": true}),
        )
        .send();
    let request = tokio::spawn(request);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!request.is_finished(), "still prefilling");
    let counts = |e: &SimHandle| {
        let a = e.addrs()[0].http;
        let id = kvroute_picker::endpoint::EndpointId::new(a.ip(), a.port(), 0);
        p.state.pool.inflight().get(&id)
    };
    // the decode endpoint counts the request while its prefill runs elsewhere: the KV it
    // will pull is on its way there
    let on_decode = counts(&de);
    assert_eq!(on_decode.requests, 1, "{on_decode:?}");
    assert!(on_decode.pending_prompt_tokens >= 1024, "{on_decode:?}");
    // but nothing to prefill there
    assert_eq!(on_decode.pending_tokens, 0);
    assert_eq!(counts(&pf).requests, 1);
    request.abort();
    // the client is gone: the prefill engine drops the request, the decode engine never sees it
    let mut idle = false;
    for _ in 0..200 {
        let running = engine_metric(&pf, "vllm:num_requests_running", "").await
            + engine_metric(&pf, "vllm:num_requests_waiting", "").await;
        if running == 0.0 {
            idle = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(idle, "the prefill engine aborted the request");
    assert_eq!(
        engine_metric(&de, "vllm:prompt_tokens_total", "").await,
        0.0
    );
    eventually("in-flight counts released", || {
        counts(&pf).requests == 0 && counts(&de).requests == 0
    })
    .await;
    p.shutdown().await;
    pf.shutdown();
    de.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ext_proc_answers_the_decode_engine_with_the_prefill_engine_for_the_sidecar() {
    let pf = sim("127.0.0.44").await;
    let de = sim("127.0.0.45").await;
    let p = picker(&[(&pf, "prefill"), (&de, "decode")], AUTO).await;
    let ext = p.addrs.ext_proc.expect("ext_proc listener");
    let long = serde_json::to_vec(&json!({"model": "llama", "prompt": prompt(11, 1024)})).unwrap();
    match envoy::route(ext, &long, None).await {
        envoy::Answer::Route {
            destination,
            headers,
            removed,
            ..
        } => {
            assert_eq!(destination, de.addrs()[0].http.to_string());
            assert_eq!(
                headers.get("x-prefiller-host-port"),
                Some(&pf.addrs()[0].http.to_string())
            );
            assert!(removed.is_empty(), "{removed:?}");
        }
        other => panic!("expected a route, got {other:?}"),
    }
    // whole: no prefiller, and a client's own is removed
    let short = serde_json::to_vec(&json!({"model": "llama", "prompt": prompt(12, 50)})).unwrap();
    match envoy::route(ext, &short, None).await {
        envoy::Answer::Route {
            destination,
            headers,
            removed,
            ..
        } => {
            assert_eq!(destination, de.addrs()[0].http.to_string());
            assert!(!headers.contains_key("x-prefiller-host-port"));
            assert_eq!(removed, ["x-prefiller-host-port"]);
        }
        other => panic!("expected a route, got {other:?}"),
    }
    p.shutdown().await;
    pf.shutdown();
    de.shutdown();
}

/// Prompt tokens of `source` on rank `rank` of engine `e`.
async fn rank_tokens(e: &SimHandle, rank: u64, source: &str) -> f64 {
    let text =
        kvroute_testkit::get_text(&client(), format!("http://{}/metrics", e.addrs()[0].http)).await;
    let rank = format!("engine=\"{rank}\"");
    kvroute_testkit::metric_sum(
        &text,
        "vllm:prompt_tokens_by_source_total",
        &[&rank, source],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_steps_go_to_the_chosen_data_parallel_rank() {
    let dp = |host: &str| {
        let mut cfg = SimConfig {
            host: host.parse().unwrap(),
            model: "llama".into(),
            speedup: 20.0,
            dp_size: 2,
            kv_transfer: Some(KvLoadFailure::Recompute),
            ..SimConfig::default()
        };
        cfg.engine.num_blocks = 4096;
        start_sim(cfg)
    };
    let pf = dp("127.0.0.46").await.expect("simulator starts");
    let de = dp("127.0.0.47").await.expect("simulator starts");
    let (a, b) = (pf.addrs()[0].http, de.addrs()[0].http);
    let p = static_picker(&format!(
        r#"
listen: {{http: 127.0.0.1:0, admin: 127.0.0.1:0, metrics: 127.0.0.1:0}}
modelConfigs:
  - name: llama
    model: llama
    blockSize: 16
    dataParallel: {{size: 2, rankSelection: Header}}
endpoints:
  - {{address: {}, modelConfig: llama, port: {}, role: prefill}}
  - {{address: {}, modelConfig: llama, port: {}, role: decode}}
routing: {{stalenessThreshold: 1m, disaggregation: {AUTO}}}
scrape: {{interval: 50ms}}
"#,
        a.ip(),
        a.port(),
        b.ip(),
        b.port()
    ))
    .await;
    eventually("first scrape", || {
        p.state.pool.state().read().loads().len() == 4
    })
    .await;
    let tokens = prompt(13, 1024);
    let e = pick(&p, &tokens).await;
    assert_eq!(e["disaggregation"]["verdict"], "split", "{e}");
    let prefill_rank = e["prefill"]["rank"].as_u64().expect("rank");
    let decode_rank = e["rank"].as_u64().expect("rank");
    let (text, done) = stream(&p, &tokens, 4).await;
    assert!(done && text.chars().count() == 4);
    // each step ran on the rank the picker chose, and only there
    assert_eq!(
        rank_tokens(&pf, prefill_rank, "local_compute").await,
        1024.0
    );
    assert_eq!(
        rank_tokens(&pf, 1 - prefill_rank, "local_compute").await,
        0.0
    );
    assert_eq!(
        rank_tokens(&de, decode_rank, "external_kv_transfer").await,
        1024.0
    );
    assert_eq!(
        rank_tokens(&de, 1 - decode_rank, "external_kv_transfer").await,
        0.0
    );
    p.shutdown().await;
    pf.shutdown();
    de.shutdown();
}
