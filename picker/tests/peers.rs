//! Two picker replicas exchanging their in-flight counts over UDP on loopback (`peers`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use kvroute_picker::endpoint::EndpointId;
use support::*;

fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind((Ipv4Addr::LOCALHOST, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn replica_yaml(engine: u16, own: u16, peer: u16, key: &std::path::Path) -> String {
    let key = key.display();
    one_engine_scraped(
        engine,
        "",
        &format!(
            r#"peers:
  listen: 127.0.0.1:{own}
  addresses: [127.0.0.1:{peer}]
  interval: 20ms
  group: ns/pool
  keyFile: {key}
"#
        ),
    )
}

/// An engine and two replicas exchanging over loopback under one key, each with `extra` in
/// its config, and their UDP ports.
async fn two_replicas(
    extra: &str,
) -> (
    FakeEngine,
    kvroute_picker::service::Running,
    kvroute_picker::service::Running,
    (u16, u16),
) {
    let engine = FakeEngine::start("127.0.0.1").await;
    let (pa, pb) = (free_udp_port(), free_udp_port());
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    std::fs::write(&key, "a-pool-key-of-32-bytes-0123456789\n").unwrap();
    let a = start_picker(&(replica_yaml(engine.addr.port(), pa, pb, &key) + extra)).await;
    let b = start_picker(&(replica_yaml(engine.addr.port(), pb, pa, &key) + extra)).await;
    // the pickers have read the key: the file may go
    drop(dir);
    (engine, a, b, (pa, pb))
}

/// Poll `cond` every 10 ms for up to 5 s.
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..500 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("not within 5 s: {what}");
}

#[tokio::test]
async fn a_replica_prices_the_requests_its_peer_has_in_flight_until_they_end() {
    let (engine, a, b, (pa, pb)) = two_replicas("").await;
    assert_eq!(
        a.addrs.peers,
        Some(SocketAddr::from((Ipv4Addr::LOCALHOST, pa)))
    );
    let id = EndpointId::new(IpAddr::V4(Ipv4Addr::LOCALHOST), engine.addr.port(), 0);

    // a request replica A sent, not yet at its first token
    let guard = a.state.pool.inflight().begin(id, 1_000, 600);
    eventually("B sees A's request", || {
        b.state.pool.inflight().get_with_peers(&id).pending_tokens == 600
    })
    .await;
    assert_eq!(
        b.state.pool.inflight().get(&id).requests,
        0,
        "B sent nothing"
    );
    assert_eq!(b.state.pool.inflight().peer_count(), 1);
    // and B's placement reads it: the pick API shows the candidate's in-flight count
    let pick = post_json(
        format!("http://{}/v1/pick", b.addrs.admin),
        &[],
        &serde_json::json!({"model": "llama", "prompt": "hello"}),
    )
    .await;
    let text = pick.to_string();
    assert!(text.contains("\"inflight_requests\":1"), "{text}");
    // the gauge follows at B's next publication
    let mut metrics = String::new();
    for _ in 0..250 {
        metrics = metrics_text(b.addrs.metrics).await;
        if metrics.contains("kvroute_picker_peer_replicas 1") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        metrics.contains("kvroute_picker_peer_replicas 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("kvroute_picker_peer_datagrams_total{kind=\"received\"}"),
        "{metrics}"
    );

    // it ends at A: B's view goes back to zero
    drop(guard);
    eventually("B sees it end", || {
        b.state.pool.inflight().get_with_peers(&id).requests == 0
    })
    .await;

    // a datagram from an address that is not a peer does not count: another IP, or the
    // peer's IP from another port (peers send from the port they listen on)
    let forged = format!(
        r#"{{"v":1,"group":"ns/pool","replica":5,"seq":1,"ts":1,"counts":[["127.0.0.1",{},0,1000000000000000,9,9,9,9]]}}"#,
        engine.addr.port()
    );
    for (n, from) in [Ipv4Addr::new(127, 0, 0, 2), Ipv4Addr::LOCALHOST]
        .into_iter()
        .enumerate()
    {
        let stranger = tokio::net::UdpSocket::bind((from, 0)).await.unwrap();
        stranger
            .send_to(
                forged.as_bytes(),
                SocketAddr::from((Ipv4Addr::LOCALHOST, pb)),
            )
            .await
            .unwrap();
        let want = format!(
            "kvroute_picker_peer_datagrams_total{{kind=\"unknown_source\"}} {}",
            n + 1
        );
        wait_metric(b.addrs.metrics, &want).await;
    }
    assert_eq!(b.state.pool.inflight().peer_count(), 1, "only A is a peer");

    // A stops: B forgets it once its counts are older than the TTL
    a.shutdown().await;
    eventually("B forgets A", || b.state.pool.inflight().peer_count() == 0).await;
    // a sender on A's very address without the pool's key is not believed
    let forger = tokio::net::UdpSocket::bind((Ipv4Addr::LOCALHOST, pa))
        .await
        .unwrap();
    forger
        .send_to(
            forged.as_bytes(),
            SocketAddr::from((Ipv4Addr::LOCALHOST, pb)),
        )
        .await
        .unwrap();
    wait_metric(
        b.addrs.metrics,
        "kvroute_picker_peer_datagrams_total{kind=\"unauthenticated\"} 1",
    )
    .await;
    assert_eq!(b.state.pool.inflight().peer_count(), 0);
    assert_eq!(b.state.pool.inflight().get_with_peers(&id).requests, 0);
    b.shutdown().await;
}

/// Issue 49, item 3: with session admission on, a session served through replica A was new to
/// replica B, which held its next turn as a newcomer. A's served turns now reach B over the
/// exchange: B pins the session where A served it and admits its next turn as a live session.
#[tokio::test]
async fn a_session_served_through_one_replica_is_live_at_the_other() {
    let (engine, a, b, _) = two_replicas("routing: {admission: {enabled: true}}\n").await;
    let id = EndpointId::new(IpAddr::V4(Ipv4Addr::LOCALHOST), engine.addr.port(), 0);
    let session = kvroute_picker::router::Router::session_key(None, Some("s-1")).unwrap();
    let resp = client()
        .post(format!("http://{}/v1/completions", a.addrs.http))
        .header("x-session-id", "s-1")
        .json(&serde_json::json!({"model": "llama", "prompt": "a long agent context"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(a.state.pool.pinned(session), Some(id));
    eventually("B pins A's session", || {
        b.state.pool.pinned(session) == Some(id)
    })
    .await;
    // B's gate admits its next turn as a live session's (the pick API shows it)
    let pick = post_json(
        format!("http://{}/v1/pick", b.addrs.admin),
        &[("x-session-id", "s-1")],
        &serde_json::json!({"model": "llama", "prompt": "a long agent context"}),
    )
    .await;
    assert_eq!(
        pick["admission"],
        serde_json::json!({"admit": "live_session"}),
        "{pick}"
    );
    a.shutdown().await;
    b.shutdown().await;
}

/// Wait (at most 5 s) for the metrics at `addr` to hold the line `want`.
async fn wait_metric(addr: SocketAddr, want: &str) {
    let mut text = String::new();
    for _ in 0..250 {
        text = metrics_text(addr).await;
        if text.lines().any(|l| l == want) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("no {want} in\n{text}");
}

#[test]
fn peer_settings_errors_name_the_field() {
    use kvroute_picker::service::settings::PickerConfig;
    let base = "modelConfigs: [{name: m, model: m, port: 8000}]\n";
    for (peers, want) in [
        ("peers: {addresses: [127.0.0.1:9]}", "need peers.listen"),
        (
            "peers: {listen: 127.0.0.1:9}",
            "peers.addresses or peers.dns",
        ),
        (
            "peers: {listen: 127.0.0.1:9, dns: nameonly}",
            "peers.dns must be name:port",
        ),
        (
            "peers: {listen: 127.0.0.1:9, dns: 'a:1', interval: 1ms}",
            "peers.interval must be within",
        ),
        ("peers: {listen: 127.0.0.1:9, bogus: 1}", "bogus"),
        (
            "peers: {listen: 127.0.0.1:9, dns: 'a:1', keyFile: ''}",
            "peers.keyFile must name a file",
        ),
    ] {
        let err = PickerConfig::from_yaml(&format!("{base}{peers}\n"))
            .expect_err(peers)
            .to_string();
        assert!(err.contains(want), "{peers}: {err}");
    }
    PickerConfig::from_yaml(&format!(
        "{base}peers: {{listen: 0.0.0.0:9190, dns: 'picker-peers.ns.svc:9190', group: ns/p}}\n"
    ))
    .expect("valid");
}
