//! Issue 52, warm start, against simulated engines publishing real ZMQ events: a picker that
//! starts beside a warm peer, or after its own snapshot, routes to the engine holding a
//! prefix before that engine publishes anything new; a copy it cannot trust (another pool,
//! another model configuration, a torn or corrupt file, an unsigned or oversized answer) is
//! refused with a message and changes nothing.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod sim_support;

use std::time::Duration;

use kvroute_picker::service::Running;
use kvroute_sim::server::SimHandle;
use serde_json::Value;
use sim_support::*;

async fn debug(p: &Running) -> Value {
    client()
        .get(format!("http://{}/debug/endpoints", p.addrs.admin))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// A picker of engines `a` and `b` with `extra` YAML (warm start, peers) appended; `replay`
/// lists each engine's replay port (without it the replay window has, in effect, passed).
async fn picker(engines: &[&SimHandle], replay: bool, extra: &str) -> Running {
    let endpoints: String = engines
        .iter()
        .map(|e| {
            let a = &e.addrs()[0];
            let replay = if replay {
                format!(", kvReplayPort: {}", a.replay[0].port())
            } else {
                String::new()
            };
            format!(
                "  - {{address: {}, modelConfig: llama, port: {}, kvEventsPort: {}{replay}}}\n",
                a.http.ip(),
                a.http.port(),
                a.kv_events[0].port(),
            )
        })
        .collect();
    static_picker(&format!(
        "{LOOPBACK_LISTEN}\n{LLAMA_PRECISE}endpoints:\n{endpoints}\
         routing: {{strategy: CostModel, stalenessThreshold: 5s}}\nscrape: {{interval: 50ms}}\n{extra}"
    ))
    .await
}

/// Warm `engine` with `tokens` directly (not through `p`) and wait until `p` has indexed it.
/// First `p`'s subscription is shown to be receiving (a publisher drops what it sends before
/// a subscriber has joined, and without a replay nothing brings that back).
async fn warm(p: &Running, engine: &SimHandle, tokens: &[u32]) {
    let ip = engine.addrs()[0].http.ip().to_string();
    let mut seed = 9000;
    while indexed_blocks(p, &ip) == 0 {
        assert!(seed < 9100, "the picker never received the engine's events");
        complete(
            format!("http://{}/v1/completions", engine.addrs()[0].http),
            &prompt(seed, 32),
        )
        .await;
        seed += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let before = indexed_blocks(p, &ip);
    complete(
        format!("http://{}/v1/completions", engine.addrs()[0].http),
        tokens,
    )
    .await;
    eventually("the warm engine's blocks in the index", || {
        indexed_blocks(p, &ip) >= before + tokens.len() / 16 - 1
    })
    .await;
}

/// Where `p` sends `tokens`, and how many blocks of it it believes cached there.
async fn placed(p: &Running, tokens: &[u32]) -> (String, u64) {
    let v = pick(p, tokens).await;
    let host = v["endpoint"]
        .as_str()
        .unwrap()
        .split(':')
        .next()
        .unwrap()
        .to_owned();
    (host, v["matched_blocks"].as_u64().unwrap_or(0))
}

fn endpoint_warmth<'a>(debug: &'a Value, ip: &str) -> &'a Value {
    let map = debug["warm_start"]["endpoints"].as_object().unwrap();
    map.iter()
        .find(|(k, _)| k.starts_with(ip))
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("{ip} not seeded: {debug}"))
}

/// Copied blocks no event has confirmed yet, over all endpoints.
fn unconfirmed(p: &Running) -> usize {
    let pool = p.state.pool.state().read();
    let index = pool.index();
    index
        .endpoints()
        .map(|(s, _)| index.unconfirmed_blocks(s))
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_picker_copies_a_warm_peers_index_and_the_replay_confirms_it() {
    let a = sim("127.0.0.41").await;
    let b = sim("127.0.0.42").await;
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("peer.key");
    std::fs::write(&key, "a-pool-key-of-32-bytes-0123456789").unwrap();
    // the peers are listed by address (the copy is asked of that IP, on `peerPort`)
    let keyed = |peer: Option<std::net::SocketAddr>, group: &str| {
        let mut s = format!("peers: {{group: {group}, keyFile: \"{}\"", key.display());
        if let Some(metrics) = peer {
            s.push_str(&format!(
                ", listen: \"127.0.0.1:0\", addresses: [\"{metrics}\"]}}\n"
            ));
            s.push_str(&format!("warmStart: {{peerPort: {}}}\n", metrics.port()));
        } else {
            s.push_str("}\n");
        }
        s
    };
    let warm_picker = picker(&[&a, &b], true, &keyed(None, "ns/pool")).await;
    let tokens = prompt(52, 1024);
    warm(&warm_picker, &b, &tokens).await;
    // and 512 blocks on the other engine (a copy of more than 8 KB)
    warm(&warm_picker, &a, &prompt(55, 8192)).await;
    assert_eq!(placed(&warm_picker, &tokens).await.0, "127.0.0.42");
    let peer = warm_picker.addrs.metrics;

    // a peer that asks without the pool's key gets nothing
    let unsigned = client()
        .get(format!(
            "http://{}/internal/index-copy",
            warm_picker.addrs.metrics
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(unsigned.status(), 401);

    // a new picker of the same pool routes warm before the engine says anything new
    let new = picker(&[&a, &b], true, &keyed(Some(peer), "ns/pool")).await;
    let (host, matched) = placed(&new, &tokens).await;
    assert_eq!(host, "127.0.0.42");
    assert!(matched >= 63, "matched {matched}");
    let d = debug(&new).await;
    assert!(
        d["warm_start"]["source"]
            .as_str()
            .unwrap()
            .starts_with("peer 127.0.0.1:"),
        "{d}"
    );
    assert_eq!(d["warm_start"]["endpoints_seeded"], 2, "{d}");
    // the engine's replay still holds the copy's last batch: the whole copy is confirmed
    let mut confirmed = false;
    for _ in 0..100 {
        let d = debug(&new).await;
        if ["127.0.0.41", "127.0.0.42"]
            .iter()
            .all(|ip| endpoint_warmth(&d, ip)["state"] == "confirmed")
        {
            confirmed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(confirmed, "{}", debug(&new).await);
    assert_eq!(unconfirmed(&new), 0, "{}", debug(&new).await);
    // what the engine does next still reaches the copy
    let more = prompt(53, 512);
    warm(&new, &a, &more).await;
    assert_eq!(placed(&new, &more).await.0, "127.0.0.41");

    // a picker of another pool is refused, and starts cold
    let foreign = picker(&[&a, &b], true, &keyed(Some(peer), "ns/other")).await;
    let d = debug(&foreign).await;
    assert!(d["warm_start"]["source"].is_null(), "{d}");
    let refused = d["warm_start"]["refused"].to_string();
    assert!(
        refused.contains("401") || refused.contains("pool"),
        "{refused}"
    );
    // (it may learn the engine's blocks from the engine's replay, but nothing from the copy)
    assert_eq!(d["warm_start"]["endpoints_seeded"], 0, "{d}");
    assert_eq!(unconfirmed(&foreign), 0);

    // a copy larger than the picker reads is refused
    let small = picker(
        &[&a, &b],
        true,
        &keyed(Some(peer), "ns/pool").replace("warmStart: {", "warmStart: {maxBytes: 4096, "),
    )
    .await;
    let d = debug(&small).await;
    assert!(d["warm_start"]["source"].is_null(), "{d}");
    assert!(
        d["warm_start"]["refused"]
            .to_string()
            .contains("warmStart.maxBytes"),
        "{d}"
    );
    assert_eq!(unconfirmed(&small), 0);

    for p in [warm_picker, new, foreign, small] {
        p.shutdown().await;
    }
    a.shutdown();
    b.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_picker_loads_its_snapshot_and_refuses_a_corrupt_one() {
    // engines without a replay socket: a restarted picker cannot prove its copy continuous
    // (as when the replay window has passed), so the copy stays unconfirmed credit that the
    // engine's events settle
    let no_replay = |ip: &str| {
        let mut c = sim_config(ip, 50.0);
        c.kv_replay = kvroute_sim::server::PortSpec::Disabled;
        c
    };
    let a = kvroute_sim::server::start(no_replay("127.0.0.43"))
        .await
        .unwrap();
    let b = kvroute_sim::server::start(no_replay("127.0.0.44"))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("index.snapshot");
    let warm_start = format!(
        "warmStart: {{snapshotPath: \"{}\", snapshotInterval: 1s}}\n",
        path.display()
    );
    let first = picker(&[&a, &b], false, &warm_start).await;
    let tokens = prompt(54, 1024);
    warm(&first, &a, &tokens).await;
    first.shutdown().await; // writes a last snapshot
    let bytes = std::fs::read(&path).unwrap();
    assert!(bytes.starts_with(b"KVRINDEX"));

    let second = picker(&[&a, &b], false, &warm_start).await;
    let (host, matched) = placed(&second, &tokens).await;
    assert_eq!(host, "127.0.0.43");
    assert!(matched >= 63, "matched {matched}");
    let d = debug(&second).await;
    assert_eq!(
        d["warm_start"]["source"],
        format!("snapshot {}", path.display())
    );
    // without a replay nothing proves it, so it waits for the engine's own events
    let mut unproven = false;
    for _ in 0..50 {
        let d = debug(&second).await;
        if endpoint_warmth(&d, "127.0.0.43")["state"] == "unproven" {
            unproven = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(unproven, "{}", debug(&second).await);
    // a request routed there confirms the blocks of its prefix (the priming prompts' blocks
    // stay unconfirmed)
    let before = unconfirmed(&second);
    complete(
        format!("http://{}/v1/completions", second.addrs.http),
        &tokens,
    )
    .await;
    let after = unconfirmed(&second);
    assert!(before >= 64 && after + 64 <= before, "{before} -> {after}");
    second.shutdown().await;

    // a corrupt snapshot (one flipped byte) and a torn one are refused, and the picker starts
    // cold and serves
    for (what, damaged) in [
        ("checksum", {
            let mut b = std::fs::read(&path).unwrap();
            let at = b.len() - 3;
            b[at] ^= 1;
            b
        }),
        ("torn", std::fs::read(&path).unwrap()[..100].to_vec()),
        ("not a kvroute index copy", b"{\"endpoints\": []}".to_vec()),
    ] {
        std::fs::write(&path, &damaged).unwrap();
        let p = picker(
            &[&a, &b],
            false,
            &format!(
                "warmStart: {{snapshotPath: \"{}\", snapshotInterval: 60m}}\n",
                path.display()
            ),
        )
        .await;
        let d = debug(&p).await;
        assert!(d["warm_start"]["source"].is_null(), "{what}: {d}");
        assert!(
            d["warm_start"]["refused"].to_string().contains(what),
            "{what}: {d}"
        );
        assert_eq!(placed(&p, &tokens).await.1, 0, "{what}");
        assert_eq!(unconfirmed(&p), 0);
        p.shutdown().await;
    }
    a.shutdown();
    b.shutdown();
}
