//! Every listener is bounded alike (issue 12, findings 4-6): silent connections are closed,
//! stalled bodies hold no admission slot and time out, the metrics and ext_proc listeners
//! have connection caps and head timeouts too.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn yaml(port: u16, limits: &str) -> String {
    format!(
        r#"
modelConfigs:
  - {{name: llama, model: llama, port: {port}}}
endpoints:
  - {{address: 127.0.0.1, modelConfig: llama}}
routing: {{stalenessThreshold: 1m}}
limits: {limits}
"#
    )
}

/// Whether the peer closes `stream` within 10 s (EOF or reset).
async fn closed_by_peer(stream: &mut TcpStream) -> bool {
    let mut buf = [0u8; 256];
    loop {
        match tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

async fn status_of(url: &str) -> u16 {
    client().get(url).send().await.unwrap().status().as_u16()
}

#[tokio::test]
async fn silent_connections_are_closed_on_every_listener() {
    let engine = FakeEngine::start("127.0.0.1").await;
    let picker = start_picker(&yaml(
        engine.addr.port(),
        "{headerReadTimeout: 300ms, maxConnections: 3}",
    ))
    .await;
    let a = picker.addrs;
    let listeners: [(&str, SocketAddr); 4] = [
        ("proxy", a.http),
        ("admin", a.admin),
        ("metrics", a.metrics),
        ("ext_proc", a.ext_proc.unwrap()),
    ];
    for (name, addr) in listeners {
        // as many silent sockets as the listener has slots: each is cut after the timeout
        let mut silent = Vec::new();
        for _ in 0..3 {
            silent.push(TcpStream::connect(addr).await.unwrap());
        }
        for s in &mut silent {
            assert!(
                closed_by_peer(s).await,
                "{name}: a silent socket stays open"
            );
        }
    }
    // and the slots they held are free: HTTP clients get through again
    for url in [
        format!("http://{}/healthz", a.http),
        format!("http://{}/healthz", a.admin),
        format!("http://{}/metrics", a.metrics),
    ] {
        assert_eq!(status_of(&url).await, 200, "{url}");
    }
    let text = metrics_text(a.metrics).await;
    let silent = text
        .lines()
        .find(|l| l.starts_with("kvroute_picker_errors_total{kind=\"silent_connection\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(silent >= 12.0, "counted: {silent}\n{text}");
    picker.shutdown().await;
}

#[tokio::test]
async fn the_metrics_listener_has_a_connection_cap() {
    let engine = FakeEngine::start("127.0.0.1").await;
    let picker = start_picker(&yaml(engine.addr.port(), "{maxConnections: 2}")).await;
    let url = format!("http://{}/metrics", picker.addrs.metrics);
    // two clients keep their connections (pooled keep-alive); a third is refused with a 503
    let (first, second) = (client(), client());
    assert_eq!(first.get(&url).send().await.unwrap().status(), 200);
    assert_eq!(second.get(&url).send().await.unwrap().status(), 200);
    let resp = client().get(&url).send().await.unwrap();
    assert_eq!(resp.status(), 503);
    let err: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["code"], "too_many_connections");
    picker.shutdown().await;
}

/// Sends a request head announcing a body of `length` bytes and only `sent` of them.
async fn stalled_body(addr: SocketAddr, length: usize, sent: usize) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {length}\r\n\r\n"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(&vec![b' '; sent]).await.unwrap();
    s
}

#[tokio::test]
async fn stalled_bodies_hold_no_admission_slot_and_time_out() {
    let engine = FakeEngine::start("127.0.0.1").await;
    let picker = start_picker(&yaml(
        engine.addr.port(),
        "{maxInflightTotal: 2, bodyReadTimeout: 500ms}",
    ))
    .await;
    let mut stalled = Vec::new();
    for _ in 0..4 {
        stalled.push(stalled_body(picker.addrs.http, 1000, 10).await);
    }
    // with four bodies stalled and room for two requests in flight, a client still gets in
    let url = format!("http://{}/v1/completions", picker.addrs.http);
    for _ in 0..3 {
        let resp = client()
            .post(&url)
            .json(&serde_json::json!({"model": "llama", "prompt": "hi"}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
    }
    // each stalled request is answered 408 once its body is late
    for s in &mut stalled {
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut answer))
            .await
            .expect("answered and closed within 10 s")
            .unwrap();
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        assert!(answer.contains("body_timeout"), "{answer}");
    }
    let text = metrics_text(picker.addrs.metrics).await;
    assert!(
        text.contains("kvroute_picker_errors_total{kind=\"body_timeout\"} 4"),
        "{text}"
    );
    picker.shutdown().await;
}

#[tokio::test]
async fn the_body_buffer_bounds_what_bodies_being_read_hold() {
    let engine = FakeEngine::start("127.0.0.1").await;
    let picker = start_picker(&yaml(
        engine.addr.port(),
        "{maxBodyBytes: 4096, bodyBufferBytes: 4096, bodyReadTimeout: 5s}",
    ))
    .await;
    // one stalled body holds 3,000 of the 4,096 buffered bytes
    let mut held = stalled_body(picker.addrs.http, 4000, 3000).await;
    let url = format!("http://{}/v1/completions", picker.addrs.http);
    let big = format!(r#"{{"model":"llama","prompt":"{}"}}"#, "x".repeat(2000));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        // until the server has read the stalled bytes, the big body may still fit
        let resp = client().post(&url).body(big.clone()).send().await.unwrap();
        if resp.status() == 429 {
            let err: serde_json::Value = resp.json().await.unwrap();
            assert!(
                err["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("body buffer"),
                "{err}"
            );
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never refused");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // a small body still fits beside the stalled one
    let resp = client()
        .post(&url)
        .json(&serde_json::json!({"model": "llama", "prompt": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let _ = held.shutdown().await;
    picker.shutdown().await;
}

#[tokio::test]
async fn ext_proc_streams_whose_body_never_ends_get_408() {
    use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
    use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
    use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
    use envoy_types::pb::envoy::service::ext_proc::v3::{
        HttpBody, HttpHeaders, ProcessingRequest, ProtocolConfiguration, processing_request,
        processing_response,
    };

    let engine = FakeEngine::start("127.0.0.1").await;
    let picker = start_picker(&yaml(engine.addr.port(), "{bodyReadTimeout: 300ms}")).await;
    let channel = support::gateway::channel(picker.addrs.ext_proc.unwrap()).await;
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let mut stream = ExternalProcessorClient::new(channel)
        .process(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let headers = [(":method", "POST"), (":path", "/v1/completions")];
    tx.send(ProcessingRequest {
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: BodySendMode::FullDuplexStreamed as i32,
            response_body_mode: BodySendMode::FullDuplexStreamed as i32,
            send_body_without_waiting_for_header_response: false,
        }),
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: headers
                    .iter()
                    .map(|(k, v)| HeaderValue {
                        key: (*k).into(),
                        raw_value: v.as_bytes().to_vec(),
                        ..Default::default()
                    })
                    .collect(),
            }),
            end_of_stream: false,
            ..Default::default()
        })),
        ..Default::default()
    })
    .await
    .unwrap();
    tx.send(ProcessingRequest {
        request: Some(processing_request::Request::RequestBody(HttpBody {
            body: br#"{"model":"llama","#.to_vec(),
            end_of_stream: false,
            ..Default::default()
        })),
        ..Default::default()
    })
    .await
    .unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .expect("an answer within 10 s")
        .unwrap()
        .unwrap();
    let Some(processing_response::Response::ImmediateResponse(refusal)) = answer.response else {
        panic!("expected an immediate response, got {answer:?}");
    };
    assert_eq!(refusal.status.unwrap().code, 408);
    let text = metrics_text(picker.addrs.metrics).await;
    assert!(
        text.contains("kvroute_picker_errors_total{kind=\"body_timeout\"} 1"),
        "{text}"
    );
    drop(tx);
    picker.shutdown().await;
}
