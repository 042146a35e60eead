//! Issue 52, publisher discovery, against simulated engines: an engine that serves vLLM's
//! `GET /kv_event_sources` is subscribed where it says its publishers are (here: ports the
//! pool's settings do not know), and followed when it comes back on other ports; one that
//! does not serve it is subscribed on the computed ports as before.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod sim_support;

use std::time::Duration;

use kvroute_sim::server::start as start_sim;
use sim_support::*;

/// Send `engine_url` distinct prompts until `ip`'s blocks show in `p`'s index (a subscriber
/// joining a publisher misses what was sent before it joined).
async fn until_indexed(
    p: &kvroute_picker::service::Running,
    engine_url: &str,
    ip: &str,
    seed: u32,
) {
    let before = indexed_blocks(p, ip);
    for i in 0..100 {
        complete(engine_url.to_owned(), &prompt(seed + i, 64)).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        if indexed_blocks(p, ip) > before {
            return;
        }
    }
    panic!("{ip}'s KV events never reached the index");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishers_listed_by_the_engine_are_followed_and_the_rest_computed() {
    // a lists its publishers (vLLM 0.32); b does not (older vLLM, SGLang)
    let a = start_sim(sim_config("127.0.0.51", 50.0)).await.unwrap();
    let mut old = sim_config("127.0.0.52", 50.0);
    old.kv_event_sources = false;
    let b = start_sim(old).await.unwrap();
    let (aa, ba) = (a.addrs()[0].clone(), b.addrs()[0].clone());
    // the model config's port (1) is wrong for both; only b's endpoint names its real ports
    let p = static_picker(&format!(
        "{LOOPBACK_LISTEN}\n{LLAMA_PRECISE}endpoints:\n  \
         - {{address: 127.0.0.51, modelConfig: llama, port: {}}}\n  \
         - {{address: 127.0.0.52, modelConfig: llama, port: {}, kvEventsPort: {}, kvReplayPort: {}}}\n\
         routing: {{strategy: CostModel, stalenessThreshold: 5s}}\nscrape: {{interval: 50ms}}\n",
        aa.http.port(),
        ba.http.port(),
        ba.kv_events[0].port(),
        ba.replay[0].port(),
    ))
    .await;
    until_indexed(
        &p,
        &format!("http://{}/v1/completions", aa.http),
        "127.0.0.51",
        100,
    )
    .await;
    until_indexed(
        &p,
        &format!("http://{}/v1/completions", ba.http),
        "127.0.0.52",
        200,
    )
    .await;
    let subscribed = |p: &kvroute_picker::service::Running, ip: &str| {
        let id = p
            .state
            .pool
            .state()
            .endpoints()
            .endpoints()
            .iter()
            .find(|e| e.id.address.to_string() == ip)
            .unwrap()
            .id;
        p.state.event_sources.get(&id).map(|s| s.publisher)
    };
    assert_eq!(
        subscribed(&p, "127.0.0.51"),
        Some(format!("tcp://{}", aa.kv_events[0]))
    );
    assert_eq!(subscribed(&p, "127.0.0.52"), None);

    // a comes back on the same HTTP port with new publisher ports: followed
    a.shutdown();
    a.stopped().await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut again = sim_config("127.0.0.51", 50.0);
    again.port = aa.http.port();
    let a2 = start_sim(again).await.unwrap();
    let a2a = a2.addrs()[0].clone();
    assert_ne!(
        a2a.kv_events[0], aa.kv_events[0],
        "the new engine kept its ports"
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while subscribed(&p, "127.0.0.51") != Some(format!("tcp://{}", a2a.kv_events[0])) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the new ports were never followed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    until_indexed(
        &p,
        &format!("http://{}/v1/completions", a2a.http),
        "127.0.0.51",
        300,
    )
    .await;
    p.shutdown().await;
    a2.shutdown();
    b.shutdown();
}
