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
    one_engine_pool(port, &format!("limits: {limits}\n"))
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
        assert_eq!(completion_status(&url, "hi").await, 200);
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
    assert_eq!(completion_status(&url, "hi").await, 200);
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

mod mtls {
    //! The ext_proc listener with TLS and required client certificates (finding 12).

    use super::*;
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
        KeyPair, KeyUsagePurpose,
    };
    use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;

    struct Ca {
        pem: String,
        issuer: Issuer<'static, KeyPair>,
    }

    fn ca(name: &str) -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let pem = params.self_signed(&key).unwrap().pem();
        Ca {
            pem,
            issuer: Issuer::new(params, key),
        }
    }

    /// (certificate PEM, key PEM) signed by `ca`.
    fn leaf(ca: &Ca, names: &[&str], usage: ExtendedKeyUsagePurpose) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let mut params =
            CertificateParams::new(names.iter().map(|n| (*n).to_string()).collect::<Vec<_>>())
                .unwrap();
        params.distinguished_name.push(DnType::CommonName, names[0]);
        params.extended_key_usages = vec![usage];
        let cert = params.signed_by(&key, &ca.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    async fn health(channel: Channel) -> Result<i32, tonic::Status> {
        HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: "liveness".into(),
            })
            .await
            .map(|r| r.into_inner().status)
    }

    /// Whether a TLS client with `tls` gets a gRPC health answer.
    async fn served(addr: SocketAddr, tls: ClientTlsConfig) -> bool {
        let endpoint = Channel::from_shared(format!("https://{addr}"))
            .unwrap()
            .tls_config(tls)
            .unwrap()
            .connect_timeout(Duration::from_secs(5));
        match endpoint.connect().await {
            Ok(c) => health(c).await.is_ok(),
            Err(_) => false,
        }
    }

    #[tokio::test]
    async fn ext_proc_requires_a_client_certificate_signed_by_the_configured_ca() {
        let dir = std::env::temp_dir().join(format!("kvroute-mtls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let server_ca = ca("kvroute-test-server-ca");
        let client_ca = ca("kvroute-test-gateway-ca");
        let other_ca = ca("kvroute-test-someone-else");
        let (cert, key) = leaf(
            &server_ca,
            &["localhost", "127.0.0.1"],
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        for (name, text) in [
            ("server.crt", &cert),
            ("server.key", &key),
            ("clients.crt", &client_ca.pem),
        ] {
            std::fs::write(dir.join(name), text).unwrap();
        }
        let engine = FakeEngine::start("127.0.0.1").await;
        let config = format!(
            r#"
listen:
  http: 127.0.0.1:0
  admin: 127.0.0.1:0
  metrics: 127.0.0.1:0
  extProc: 127.0.0.1:0
  extProcTls:
    certFile: {}
    keyFile: {}
    clientCaFile: {}
{}"#,
            dir.join("server.crt").display(),
            dir.join("server.key").display(),
            dir.join("clients.crt").display(),
            yaml(engine.addr.port(), "{headerReadTimeout: 2s}")
        );
        let config =
            kvroute_picker::service::settings::PickerConfig::from_yaml(&config).expect("config");
        let view = kvroute_picker::service::source::view_from_config(&config);
        let picker = kvroute_picker::service::start(
            config,
            Box::new(kvroute_picker::service::source::StaticSource(view)),
            tokio_util::sync::CancellationToken::new(),
        )
        .await
        .expect("picker starts");
        let addr = picker.addrs.ext_proc.unwrap();
        let trust = Certificate::from_pem(&server_ca.pem);

        // the gateway's certificate: served
        let (gw_cert, gw_key) = leaf(
            &client_ca,
            &["gateway"],
            ExtendedKeyUsagePurpose::ClientAuth,
        );
        let gateway = ClientTlsConfig::new()
            .ca_certificate(trust.clone())
            .domain_name("localhost")
            .identity(Identity::from_pem(gw_cert, gw_key));
        assert!(served(addr, gateway).await, "the gateway's certificate");

        // no client certificate, or one from another CA: refused
        let anonymous = ClientTlsConfig::new()
            .ca_certificate(trust.clone())
            .domain_name("localhost");
        assert!(!served(addr, anonymous).await, "no certificate");
        let (x_cert, x_key) = leaf(
            &other_ca,
            &["intruder"],
            ExtendedKeyUsagePurpose::ClientAuth,
        );
        let intruder = ClientTlsConfig::new()
            .ca_certificate(trust)
            .domain_name("localhost")
            .identity(Identity::from_pem(x_cert, x_key));
        assert!(!served(addr, intruder).await, "foreign certificate");
        // and plaintext gets nowhere
        let plain = Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect_timeout(Duration::from_secs(5))
            .connect()
            .await;
        let refused = match plain {
            Err(_) => true,
            Ok(c) => health(c).await.is_err(),
        };
        assert!(refused, "plaintext");
        picker.shutdown().await;
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Streams that open and never send a message (finding 3 of issue 35): they take no
/// processing place, so the gateway's real requests are served while they are held, and each
/// is ended after `headerReadTimeout` and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_ext_proc_streams_hold_no_processing_place_and_are_ended() {
    use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;

    let engine = FakeEngine::start("127.0.0.1").await;
    // 8 processing places (twice maxInflightTotal); one connection may hold 8 streams
    let picker = start_picker(&yaml(
        engine.addr.port(),
        "{maxInflightTotal: 4, extProcStreamsPerConnection: 8, headerReadTimeout: 2s}",
    ))
    .await;
    let ext = picker.addrs.ext_proc.unwrap();
    let idle = support::gateway::channel(ext).await;
    let mut held = Vec::new();
    for _ in 0..8 {
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let stream = tokio::time::timeout(
            Duration::from_secs(10),
            ExternalProcessorClient::new(idle.clone())
                .process(tokio_stream::wrappers::ReceiverStream::new(rx)),
        )
        .await
        .expect("the stream opens")
        .unwrap()
        .into_inner();
        held.push((tx, stream));
    }
    // every processing place would be taken if opening a stream took one
    let gateway = support::gateway::channel(ext).await;
    for _ in 0..3 {
        let answer = support::gateway::request(
            &gateway,
            "/v1/completions",
            &[],
            br#"{"model":"llama","prompt":"served while idle streams are held"}"#,
        )
        .await;
        assert_eq!(answer.destination(), engine.addr.to_string());
    }
    // the silent streams are ended, each with an error the gateway can log, and counted
    for (_tx, stream) in &mut held {
        let status = tokio::time::timeout(Duration::from_secs(10), stream.message())
            .await
            .expect("ended within 10 s")
            .expect_err("ended with a status");
        assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status}");
    }
    let text = metrics_text(picker.addrs.metrics).await;
    assert!(
        text.contains("kvroute_picker_errors_total{kind=\"silent_stream\"} 8"),
        "{text}"
    );
    picker.shutdown().await;
}
