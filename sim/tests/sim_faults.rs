//! Fault injection: each fault behaves as a router would see it from a real engine.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod contract;
mod sim_support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvroute_routing::endpoint::EngineKind;
use kvroute_routing::kv_events::KvEvent;
use serde_json::{Value, json};
use sim_support::*;

async fn admin(addr: std::net::SocketAddr, fault: Value) {
    let (s, v) = post(addr, "/admin/fault", &fault).await;
    assert_eq!(s, 200, "{v}");
}

#[tokio::test]
async fn slow_multiplies_step_time() {
    bounded(async {
        let (_h, a) = start(|c| c.speedup = 2.0).await;
        let timed = |seed| async move {
            let t = Instant::now();
            assert_eq!(complete(a.http, &tokens(seed, 16), 8).await.0, 200);
            t.elapsed()
        };
        // ~17 ms prefill + 7 decodes of ~6 ms = ~57 ms virtual, ~29 ms wall; 10x slower is
        // ~290 ms.
        let fast = timed(1).await;
        admin(a.http, json!({"kind": "slow", "factor": 10})).await;
        let slow = timed(2).await;
        assert!(
            slow > fast * 4 && slow > Duration::from_millis(250),
            "{fast:?} vs {slow:?}"
        );
        admin(a.http, json!({"kind": "clear"})).await;
        assert!(timed(3).await < slow / 2);
        let (s, _) = post(
            a.http,
            "/admin/fault",
            &json!({"kind": "slow", "factor": -1}),
        )
        .await;
        assert_eq!(s, 400);
    })
    .await;
}

#[tokio::test]
async fn hang_accepts_but_never_answers_until_cleared() {
    bounded(async {
        let (_h, a) = start(|_| {}).await;
        admin(a.http, json!({"kind": "hang"})).await;
        let short = reqwest::Client::builder()
            .timeout(Duration::from_millis(300))
            .build()
            .unwrap();
        let err = short.get(url(a.http, "/health")).send().await.unwrap_err();
        assert!(err.is_timeout(), "{err}");
        // A request sent during the hang completes once it is cleared.
        let pending = tokio::spawn(complete(a.http, &tokens(1, 20), 2));
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!pending.is_finished());
        admin(a.http, json!({"kind": "clear"})).await;
        assert_eq!(pending.await.unwrap().0, 200);
        assert_eq!(
            client()
                .get(url(a.http, "/health"))
                .send()
                .await
                .unwrap()
                .status(),
            200
        );
    })
    .await;
}

#[tokio::test]
async fn restart_in_place_clears_cache_and_counters() {
    bounded(async {
        let (_h, a) = start(|_| {}).await;
        let mut sub = Sub::connect(a.kv_events[0]).await;
        let p = tokens(1, 64);
        complete(a.http, &p, 1).await;
        assert_eq!(cached(&complete(a.http, &p, 1).await.1), 48);
        admin(a.http, json!({"kind": "restart"})).await;
        let msgs = sub.drain_quiet(Duration::from_millis(300)).await;
        let last = msgs.last().unwrap();
        assert_eq!(last.1.events, vec![KvEvent::AllBlocksCleared]);
        assert_eq!(last.0, msgs.len() as u64 - 1, "sequence continues");
        let m = metrics(a.http, EngineKind::Vllm).await;
        assert_eq!(m.for_rank(0).unwrap().prefix_cache_queries, Some(0.0));
        assert_eq!(cached(&complete(a.http, &p, 1).await.1), 0);

        admin(a.http, json!({"kind": "restart", "seq": "zero"})).await;
        let msgs = sub.drain_quiet(Duration::from_millis(300)).await;
        let last = msgs.last().unwrap();
        assert_eq!(
            (last.0, &last.1.events),
            (0, &vec![KvEvent::AllBlocksCleared])
        );
        // The replay buffer started over too.
        let replayed = replay(a.replay[0], 0).await;
        assert_eq!(replayed.len(), 1);
    })
    .await;
}

#[tokio::test]
async fn restart_fails_in_flight_requests() {
    bounded(async {
        let (h, a) = start(|c| c.speedup = 5.0).await;
        let inflight = tokio::spawn(complete(a.http, &tokens(1, 16), 200));
        tokio::time::sleep(Duration::from_millis(100)).await;
        h.inject(
            0,
            serde_json::from_value(json!({"kind": "restart"})).unwrap(),
        )
        .await
        .unwrap();
        let (s, v) = inflight.await.unwrap();
        assert_eq!(s, 503, "{v}");
        assert_eq!(v["error"]["type"], "ServiceUnavailableError");
    })
    .await;
}

#[tokio::test]
async fn crash_close_drops_connections_and_restarts_on_the_same_ports() {
    bounded(async {
        let (h, a) = start(|c| c.speedup = 5.0).await;
        let mut sub = Sub::connect(a.kv_events[0]).await;
        let p = tokens(1, 48);
        complete(a.http, &p, 1).await;
        assert!(!sub.drain_quiet(Duration::from_millis(200)).await.is_empty());
        // A long streaming response is cut mid-way.
        let stream = tokio::spawn(async move {
            let r = client()
                .post(url(a.http, "/v1/completions"))
                .json(&json!({"prompt": tokens(2, 16), "max_tokens": 500, "stream": true}))
                .send()
                .await
                .unwrap();
            r.text().await
        });
        tokio::time::sleep(Duration::from_millis(150)).await;
        admin(
            a.http,
            json!({"kind": "crash", "mode": "close", "restart_after_ms": 700}),
        )
        .await;
        match stream.await.unwrap() {
            Err(_) => {}
            Ok(body) => assert!(!body.contains("[DONE]"), "the stream must not complete"),
        }
        // Down: connections are refused.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let err = client()
            .get(url(a.http, "/health"))
            .send()
            .await
            .unwrap_err();
        assert!(err.is_connect() || err.is_request(), "{err}");
        // Back on the same ports with an empty cache, and events from 0 again.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(r) = client().get(url(a.http, "/health")).send().await
                && r.status() == 200
            {
                break;
            }
            assert!(Instant::now() < deadline, "engine came back");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(h.addrs()[0], a);
        let mut sub = Sub::connect(a.kv_events[0]).await;
        assert_eq!(cached(&complete(a.http, &p, 1).await.1), 0);
        let msgs = sub.drain_quiet(Duration::from_millis(300)).await;
        assert_eq!(msgs.first().map(|m| m.0), Some(0));
        let m = metrics(a.http, EngineKind::Vllm).await;
        assert_eq!(m.for_rank(0).unwrap().prefix_cache_queries, Some(48.0));
    })
    .await;
}

/// The binary: `--port 0` prints the bound addresses as one JSON line, serves, and a crash
/// fault from the command line exits the process with status 1.
#[test]
fn binary_prints_ports_and_crash_exits() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute-sim"))
        .args([
            "--port",
            "0",
            "--kv-events-port",
            "auto",
            "--kv-replay-port",
            "auto",
            "--dp-size",
            "2",
            "--speedup",
            "100",
            "--seed",
            "1",
            "--fault",
            r#"{"kind":"crash","after_ms":1500}"#,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let ports: Value = serde_json::from_str(&line).unwrap();
    let e = &ports["engines"][0];
    assert_eq!(e["kv_events"].as_array().unwrap().len(), 2);
    assert_eq!(e["replay"].as_array().unwrap().len(), 2);
    let http = e["http"].as_str().unwrap().to_owned();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let status = rt.block_on(async {
        let (s, v) = post(
            http.parse().unwrap(),
            "/v1/completions",
            &json!({"prompt": "hi", "max_tokens": 2}),
        )
        .await;
        assert_eq!(s, 200, "{v}");
        s
    });
    assert_eq!(status, 200);
    let deadline = Instant::now() + Duration::from_secs(20);
    let code = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the crash fault did not end the process");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(code, Some(1));
}

#[tokio::test]
async fn client_disconnect_aborts_the_request() {
    bounded(async {
        let (_h, a) = start(|c| c.speedup = 5.0).await;
        let mut r = client()
            .post(url(a.http, "/v1/completions"))
            .json(&json!({"prompt": tokens(1, 64), "max_tokens": 5000, "stream": true}))
            .send()
            .await
            .unwrap();
        assert!(r.chunk().await.unwrap().is_some());
        let m = metrics(a.http, EngineKind::Vllm).await;
        assert_eq!(m.aggregate().running, 1.0);
        assert!(m.aggregate().kv_usage > 0.0);
        drop(r);
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let m = metrics(a.http, EngineKind::Vllm).await;
            if m.aggregate().running == 0.0 {
                assert_eq!(m.aggregate().kv_usage, 0.0, "blocks released");
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the engine noticed the disconnect"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}
