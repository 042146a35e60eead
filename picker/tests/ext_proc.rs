//! The endpoint-picker protocol over ext_proc, end to end: a tonic client plays Envoy's side
//! against the real server on 127.0.0.1:0, with a fake picker.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyResponse, CommonResponse, HeadersResponse, HttpBody, HttpHeaders, HttpTrailers,
    ImmediateResponse, ProcessingRequest, ProcessingResponse, ProtocolConfiguration, body_mutation,
    processing_request, processing_response,
};
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value, value::Kind};
use kvroute_picker::service::ext_proc::{
    AssumedBodyMode, EndpointPicker, ExtProcLimits, PickInput, PickOutput, PickRejection,
    ext_proc_server, health_service,
};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::transport::{Channel, Server};
use tonic::{Code, Status, Streaming};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

const STEP: Duration = Duration::from_secs(5);
const TEST: Duration = Duration::from_secs(30);

fn ep(text: &str) -> SocketAddr {
    text.parse().unwrap()
}

/// What the fake picker does.
#[derive(Clone)]
enum Behavior {
    Answer(PickOutput),
    Reject(PickRejection),
    /// Picks the subset's entries in reverse order (asserting there is a subset).
    ReverseSubset,
    /// Never answers.
    Hang,
    Panic,
}

struct FakePicker {
    behavior: Behavior,
    inputs: Mutex<Vec<PickInput>>,
    served: Mutex<Vec<(u64, SocketAddr)>>,
    statuses: Mutex<Vec<(u64, u16)>>,
    first_bodies: Mutex<Vec<u64>>,
    completed: Mutex<Vec<u64>>,
    /// Response bodies are rewritten (upper-cased) while set; the chunks it was given.
    rewrite: std::sync::atomic::AtomicBool,
    rewritten: Mutex<Vec<Vec<u8>>>,
}

impl FakePicker {
    fn new(behavior: Behavior) -> Arc<Self> {
        Arc::new(Self {
            behavior,
            inputs: Mutex::new(Vec::new()),
            served: Mutex::new(Vec::new()),
            statuses: Mutex::new(Vec::new()),
            first_bodies: Mutex::new(Vec::new()),
            completed: Mutex::new(Vec::new()),
            rewrite: std::sync::atomic::AtomicBool::new(false),
            rewritten: Mutex::new(Vec::new()),
        })
    }

    fn answering(endpoints: &[&str]) -> Arc<Self> {
        Self::new(Behavior::Answer(PickOutput {
            endpoints: endpoints.iter().map(|e| ep(e)).collect(),
            ..Default::default()
        }))
    }

    fn inputs(&self) -> Vec<PickInput> {
        self.inputs.lock().unwrap().clone()
    }

    fn completed(&self) -> Vec<u64> {
        self.completed.lock().unwrap().clone()
    }

    async fn wait_completed(&self, count: usize) -> Vec<u64> {
        tokio::time::timeout(STEP, async {
            loop {
                let done = self.completed();
                if done.len() >= count {
                    return done;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("on_response_complete was not called in time")
    }
}

impl EndpointPicker for FakePicker {
    async fn pick(&self, input: PickInput) -> Result<PickOutput, PickRejection> {
        let subset = input.subset.clone();
        self.inputs.lock().unwrap().push(input);
        match self.behavior.clone() {
            Behavior::Answer(output) => Ok(output),
            Behavior::Reject(rejection) => Err(rejection),
            Behavior::ReverseSubset => {
                let mut endpoints = subset.expect("the picker expected a subset");
                endpoints.reverse();
                Ok(PickOutput {
                    endpoints,
                    ..Default::default()
                })
            }
            Behavior::Hang => std::future::pending().await,
            Behavior::Panic => panic!("picker bug"),
        }
    }

    fn on_response_served(&self, request_id: u64, endpoint: SocketAddr) {
        self.served.lock().unwrap().push((request_id, endpoint));
    }

    fn on_response_status(&self, request_id: u64, status: u16) {
        self.statuses.lock().unwrap().push((request_id, status));
    }

    fn on_first_response_body(&self, request_id: u64) {
        self.first_bodies.lock().unwrap().push(request_id);
    }

    fn on_response_complete(&self, request_id: u64) {
        self.completed.lock().unwrap().push(request_id);
    }

    fn rewrites_response(&self, _request_id: u64) -> bool {
        self.rewrite.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn rewrite_response_chunk(&self, _request_id: u64, chunk: Vec<u8>, _end: bool) -> Vec<u8> {
        self.rewritten.lock().unwrap().push(chunk.clone());
        chunk.to_ascii_uppercase()
    }
}

async fn serve(picker: Arc<FakePicker>, limits: ExtProcLimits) -> (SocketAddr, Arc<FakePicker>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let service = ext_proc_server(picker.clone(), limits);
    tokio::spawn(async move {
        Server::builder()
            .add_service(service)
            .serve_with_incoming(TcpListenerStream::new(listener))
            .await
            .unwrap();
    });
    (addr, picker)
}

async fn connect(addr: SocketAddr) -> Channel {
    tokio::time::timeout(
        STEP,
        Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect(),
    )
    .await
    .unwrap()
    .unwrap()
}

/// Envoy's side of one ext_proc stream.
struct Envoy {
    tx: Option<mpsc::Sender<ProcessingRequest>>,
    rx: Streaming<ProcessingResponse>,
}

impl Envoy {
    async fn open(channel: &Channel) -> Self {
        let (tx, rx) = mpsc::channel(64);
        let mut client = ExternalProcessorClient::new(channel.clone());
        let response = tokio::time::timeout(STEP, client.process(ReceiverStream::new(rx)))
            .await
            .unwrap()
            .unwrap();
        Self {
            tx: Some(tx),
            rx: response.into_inner(),
        }
    }

    async fn send(&self, request: ProcessingRequest) {
        self.tx.as_ref().unwrap().send(request).await.unwrap();
    }

    async fn recv(&mut self) -> ProcessingResponse {
        tokio::time::timeout(STEP, self.rx.message())
            .await
            .expect("no answer in time")
            .expect("stream error")
            .expect("stream ended")
    }

    /// Asserts nothing is answered for a short while.
    async fn silent(&mut self) {
        let got = tokio::time::timeout(Duration::from_millis(150), self.rx.message()).await;
        assert!(got.is_err(), "unexpected answer: {got:?}");
    }

    /// Half-closes and returns how the server ended the stream.
    async fn finish(mut self) -> Result<Option<ProcessingResponse>, Status> {
        self.tx = None;
        tokio::time::timeout(STEP, self.rx.message())
            .await
            .expect("the stream did not end in time")
    }

    /// The stream's end without half-closing first (after an immediate response or an error).
    async fn end(&mut self) -> Result<Option<ProcessingResponse>, Status> {
        tokio::time::timeout(STEP, self.rx.message())
            .await
            .expect("the stream did not end in time")
    }
}

fn config(request: BodySendMode, response: BodySendMode) -> ProtocolConfiguration {
    ProtocolConfiguration {
        request_body_mode: request as i32,
        response_body_mode: response as i32,
        send_body_without_waiting_for_header_response: false,
    }
}

fn header_map(pairs: &[(&str, &str)]) -> HeaderMap {
    HeaderMap {
        headers: pairs
            .iter()
            .map(|(k, v)| HeaderValue {
                key: k.to_string(),
                raw_value: v.as_bytes().to_vec(),
                ..Default::default()
            })
            .collect(),
    }
}

fn request_headers(
    pairs: &[(&str, &str)],
    end_of_stream: bool,
    config: Option<ProtocolConfiguration>,
    metadata: Option<Metadata>,
) -> ProcessingRequest {
    ProcessingRequest {
        protocol_config: config,
        metadata_context: metadata,
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(header_map(pairs)),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn post_headers(body_len: usize) -> Vec<(&'static str, String)> {
    vec![
        (":method", "POST".into()),
        (":path", "/v1/chat/completions".into()),
        (":authority", "gateway.example".into()),
        ("content-type", "application/json".into()),
        ("content-length", body_len.to_string()),
        ("x-request-id", "req-1".into()),
    ]
}

fn post(body_len: usize, config: Option<ProtocolConfiguration>) -> ProcessingRequest {
    let owned = post_headers(body_len);
    let pairs: Vec<(&str, &str)> = owned.iter().map(|(k, v)| (*k, v.as_str())).collect();
    request_headers(&pairs, false, config, None)
}

fn request_body(chunk: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::RequestBody(HttpBody {
            body: chunk.to_vec(),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn response_headers(end_of_stream: bool, metadata: Option<Metadata>) -> ProcessingRequest {
    ProcessingRequest {
        metadata_context: metadata,
        request: Some(processing_request::Request::ResponseHeaders(HttpHeaders {
            headers: Some(header_map(&[
                (":status", "200"),
                ("content-type", "text/event-stream"),
            ])),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn response_body(chunk: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::ResponseBody(HttpBody {
            body: chunk.to_vec(),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn subset_metadata(entries: &[&str]) -> Metadata {
    let list = ListValue {
        values: entries
            .iter()
            .map(|e| Value {
                kind: Some(Kind::StringValue(e.to_string())),
            })
            .collect(),
    };
    Metadata {
        filter_metadata: HashMap::from([(
            "envoy.lb.subset_hint".to_string(),
            Struct {
                fields: HashMap::from([(
                    "x-gateway-destination-endpoint-subset".to_string(),
                    Value {
                        kind: Some(Kind::ListValue(list)),
                    },
                )]),
            },
        )]),
        ..Default::default()
    }
}

fn served_metadata(endpoint: &str) -> Metadata {
    Metadata {
        filter_metadata: HashMap::from([(
            "envoy.lb".to_string(),
            Struct {
                fields: HashMap::from([(
                    "x-gateway-destination-endpoint-served".to_string(),
                    Value {
                        kind: Some(Kind::StringValue(endpoint.to_string())),
                    },
                )]),
            },
        )]),
        ..Default::default()
    }
}

fn headers_response(answer: &ProcessingResponse) -> &HeadersResponse {
    match answer.response.as_ref() {
        Some(processing_response::Response::RequestHeaders(h)) => h,
        other => panic!("expected a request-headers answer, got {other:?}"),
    }
}

fn body_response(answer: &ProcessingResponse) -> &BodyResponse {
    match answer.response.as_ref() {
        Some(processing_response::Response::RequestBody(b)) => b,
        other => panic!("expected a request-body answer, got {other:?}"),
    }
}

fn immediate(answer: &ProcessingResponse) -> &ImmediateResponse {
    match answer.response.as_ref() {
        Some(processing_response::Response::ImmediateResponse(i)) => i,
        other => panic!("expected an immediate response, got {other:?}"),
    }
}

/// Header mutations as name → value (raw_value; value must be empty).
fn set_headers(common: &CommonResponse) -> HashMap<String, String> {
    let mutation = common.header_mutation.as_ref().expect("no header mutation");
    mutation
        .set_headers
        .iter()
        .map(|option| {
            let header = option.header.as_ref().unwrap();
            assert!(header.value.is_empty(), "value and raw_value both set");
            (
                header.key.clone(),
                String::from_utf8(header.raw_value.clone()).unwrap(),
            )
        })
        .collect()
}

fn destination_metadata(answer: &ProcessingResponse) -> String {
    let metadata = answer
        .dynamic_metadata
        .as_ref()
        .expect("no dynamic metadata");
    let Some(Kind::StructValue(namespace)) = &metadata.fields["envoy.lb"].kind else {
        panic!("envoy.lb is not a struct");
    };
    let Some(Kind::StringValue(value)) = &namespace.fields["x-gateway-destination-endpoint"].kind
    else {
        panic!("the destination is not a string");
    };
    value.clone()
}

/// Concatenates streamed request-body answers until end_of_stream; returns body and count.
async fn collect_streamed_request_body(envoy: &mut Envoy) -> (Vec<u8>, usize) {
    let mut body = Vec::new();
    let mut count = 0;
    loop {
        let answer = envoy.recv().await;
        let common = body_response(&answer).response.clone().unwrap();
        let Some(body_mutation::Mutation::StreamedResponse(chunk)) =
            common.body_mutation.and_then(|m| m.mutation)
        else {
            panic!("expected a streamed body mutation");
        };
        assert!(chunk.body.len() <= 64 * 1024, "chunk over 64 KiB");
        body.extend_from_slice(&chunk.body);
        count += 1;
        if chunk.end_of_stream {
            return (body, count);
        }
    }
}

fn json_error(answer: &ImmediateResponse) -> serde_json::Value {
    serde_json::from_slice(&answer.body).unwrap()
}

fn limits() -> ExtProcLimits {
    ExtProcLimits::default()
}

const CHAT: &[u8] = br#"{"model":"llama","messages":[{"role":"user","content":"hello"}]}"#;

#[tokio::test]
async fn buffered_round_trip() {
    tokio::time::timeout(TEST, async {
        let (addr, picker) =
            serve(FakePicker::answering(&["10.0.0.1:8000", "10.0.0.2:8000"]), limits()).await;
        let channel = connect(addr).await;
        let mut envoy = Envoy::open(&channel).await;

        let buffered = config(BodySendMode::Buffered, BodySendMode::Buffered);
        envoy.send(post(CHAT.len(), Some(buffered))).await;
        // BUFFERED: the proxy waits for this answer before sending the body.
        let answer = envoy.recv().await;
        assert_eq!(headers_response(&answer), &HeadersResponse::default());
        assert!(answer.dynamic_metadata.is_none());

        envoy.send(request_body(CHAT, true)).await;
        let answer = envoy.recv().await;
        let common = body_response(&answer).response.clone().unwrap();
        let headers = set_headers(&common);
        // exactly one endpoint in the header (gateways route by its whole value); the
        // ordered fallback list in the metadata
        assert_eq!(headers["x-gateway-destination-endpoint"], "10.0.0.1:8000");
        assert_eq!(
            destination_metadata(&answer),
            "10.0.0.1:8000,10.0.0.2:8000"
        );
        assert!(common.clear_route_cache);
        assert!(common.body_mutation.is_none(), "the body was not changed");
        assert!(!headers.contains_key("content-length"));

        let inputs = picker.inputs();
        assert_eq!(inputs.len(), 1);
        let input = &inputs[0];
        assert_eq!(input.body, Bytes::from_static(CHAT));
        assert_eq!(input.path, "/v1/chat/completions");
        assert_eq!(input.headers["content-type"], "application/json");
        assert_eq!(input.headers["x-request-id"], "req-1");
        assert_eq!(input.headers["host"], "gateway.example");
        assert!(input.subset.is_none());
        assert!(picker.completed().is_empty());

        // The response passes through untouched.
        envoy.send(response_headers(false, None)).await;
        let answer = envoy.recv().await;
        assert!(matches!(
            answer.response,
            Some(processing_response::Response::ResponseHeaders(ref h)) if *h == HeadersResponse::default()
        ));
        envoy.send(response_body(b"{\"choices\":[]}", true)).await;
        let answer = envoy.recv().await;
        assert!(matches!(
            answer.response,
            Some(processing_response::Response::ResponseBody(ref b)) if *b == BodyResponse::default()
        ));
        assert_eq!(picker.wait_completed(1).await, vec![input.request_id]);

        assert!(matches!(envoy.finish().await, Ok(None)));
        assert_eq!(picker.completed().len(), 1, "completion reported once");
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn full_duplex_streamed_chunks() {
    tokio::time::timeout(TEST, async {
        let (addr, picker) = serve(FakePicker::answering(&["10.0.0.3:8000"]), limits()).await;
        let channel = connect(addr).await;
        let mut envoy = Envoy::open(&channel).await;

        // A body larger than one streamed chunk, sent in uneven pieces.
        let body: Vec<u8> = (0..150_000u32).map(|i| b'a' + (i % 26) as u8).collect();
        let duplex = config(
            BodySendMode::FullDuplexStreamed,
            BodySendMode::FullDuplexStreamed,
        );
        envoy.send(post(body.len(), Some(duplex))).await;
        // The headers answer waits for the body.
        envoy.silent().await;
        let pieces = [
            &body[..1],
            &body[1..70_000],
            &body[70_000..149_999],
            &body[149_999..],
        ];
        for (i, piece) in pieces.iter().enumerate() {
            envoy.send(request_body(piece, i == pieces.len() - 1)).await;
            if i < pieces.len() - 1 {
                envoy.silent().await;
            }
        }

        let answer = envoy.recv().await;
        let common = headers_response(&answer).response.clone().unwrap();
        let headers = set_headers(&common);
        assert_eq!(headers["x-gateway-destination-endpoint"], "10.0.0.3:8000");
        assert_eq!(headers["content-length"], body.len().to_string());
        assert_eq!(destination_metadata(&answer), "10.0.0.3:8000");
        assert!(common.clear_route_cache);

        let (echoed, chunks) = collect_streamed_request_body(&mut envoy).await;
        assert_eq!(echoed, body);
        assert_eq!(chunks, 3, "150,000 bytes in chunks of at most 62,000");
        assert_eq!(picker.inputs()[0].body, Bytes::from(body));

        // Response chunks are echoed back, or the proxy would drop them.
        envoy.send(response_headers(false, None)).await;
        assert!(matches!(
            envoy.recv().await.response,
            Some(processing_response::Response::ResponseHeaders(_))
        ));
        // the first non-empty chunk is the first token (the calibration times it), reported
        // once
        for (chunk, end) in [
            (&b""[..], false),
            (&b"data: 1\n\n"[..], false),
            (&b"data: [DONE]\n\n"[..], true),
        ] {
            envoy.send(response_body(chunk, end)).await;
            let answer = envoy.recv().await;
            let Some(processing_response::Response::ResponseBody(b)) = answer.response else {
                panic!("expected a response-body answer");
            };
            let Some(body_mutation::Mutation::StreamedResponse(streamed)) = b
                .response
                .and_then(|c| c.body_mutation)
                .and_then(|m| m.mutation)
            else {
                panic!("expected a streamed echo");
            };
            assert_eq!(streamed.body, chunk);
            assert_eq!(streamed.end_of_stream, end);
            let first = picker.first_bodies.lock().unwrap().clone();
            assert_eq!(first.len(), usize::from(!chunk.is_empty()), "{first:?}");
        }
        assert_eq!(
            *picker.first_bodies.lock().unwrap(),
            vec![picker.inputs()[0].request_id]
        );
        assert!(
            picker.rewritten.lock().unwrap().is_empty(),
            "a picker that rewrites nothing is not handed the chunks"
        );
        assert_eq!(picker.wait_completed(1).await.len(), 1);
        assert!(matches!(envoy.finish().await, Ok(None)));
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn a_rewritten_response_body_loses_its_content_length_and_streams_rewritten() {
    tokio::time::timeout(TEST, async {
        let picker = FakePicker::answering(&["10.0.0.3:8000"]);
        picker
            .rewrite
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let (addr, picker) = serve(picker, limits()).await;
        let channel = connect(addr).await;
        let mut envoy = Envoy::open(&channel).await;
        let duplex = config(
            BodySendMode::FullDuplexStreamed,
            BodySendMode::FullDuplexStreamed,
        );
        envoy.send(post(CHAT.len(), Some(duplex))).await;
        envoy.send(request_body(CHAT, true)).await;
        envoy.recv().await;
        collect_streamed_request_body(&mut envoy).await;

        envoy.send(response_headers(false, None)).await;
        let answer = envoy.recv().await;
        let Some(processing_response::Response::ResponseHeaders(h)) = answer.response else {
            panic!("expected a response-headers answer");
        };
        let removed = h
            .response
            .and_then(|c| c.header_mutation)
            .map(|m| m.remove_headers)
            .unwrap_or_default();
        assert_eq!(removed, ["content-length"]);
        for (chunk, end) in [(&b"data: a\n\n"[..], false), (&b"data: b\n\n"[..], true)] {
            envoy.send(response_body(chunk, end)).await;
            let Some(processing_response::Response::ResponseBody(b)) = envoy.recv().await.response
            else {
                panic!("expected a response-body answer");
            };
            let Some(body_mutation::Mutation::StreamedResponse(streamed)) = b
                .response
                .and_then(|c| c.body_mutation)
                .and_then(|m| m.mutation)
            else {
                panic!("expected a streamed echo");
            };
            assert_eq!(streamed.body, chunk.to_ascii_uppercase());
        }
        assert_eq!(picker.rewritten.lock().unwrap().len(), 2);
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn full_duplex_is_assumed_without_protocol_config_and_trailers_end_the_body() {
    tokio::time::timeout(TEST, async {
        let (addr, picker) = serve(FakePicker::answering(&["10.0.0.4:8000"]), limits()).await;
        let channel = connect(addr).await;
        let mut envoy = Envoy::open(&channel).await;

        envoy.send(post(CHAT.len(), None)).await;
        envoy.silent().await;
        envoy.send(request_body(CHAT, false)).await;
        envoy.silent().await;
        envoy
            .send(ProcessingRequest {
                request: Some(processing_request::Request::RequestTrailers(
                    HttpTrailers::default(),
                )),
                ..Default::default()
            })
            .await;

        let answer = envoy.recv().await;
        assert_eq!(
            set_headers(headers_response(&answer).response.as_ref().unwrap())
                ["x-gateway-destination-endpoint"],
            "10.0.0.4:8000"
        );
        let answer = envoy.recv().await;
        let Some(body_mutation::Mutation::StreamedResponse(chunk)) = body_response(&answer)
            .response
            .clone()
            .and_then(|c| c.body_mutation)
            .and_then(|m| m.mutation)
        else {
            panic!("expected a streamed body");
        };
        assert_eq!(chunk.body, CHAT);
        assert!(!chunk.end_of_stream, "trailers follow, so the body does not end the stream");
        assert!(matches!(
            envoy.recv().await.response,
            Some(processing_response::Response::RequestTrailers(_))
        ));
        assert_eq!(picker.inputs()[0].body, Bytes::from_static(CHAT));
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn bodyless_request_is_picked_at_headers() {
    tokio::time::timeout(TEST, async {
        let (addr, picker) = serve(FakePicker::answering(&["10.0.0.5:9000"]), limits()).await;
        let channel = connect(addr).await;
        let mut envoy = Envoy::open(&channel).await;

        let duplex = config(
            BodySendMode::FullDuplexStreamed,
            BodySendMode::FullDuplexStreamed,
        );
        envoy
            .send(request_headers(
                &[(":method", "GET"), (":path", "/v1/models")],
                true,
                Some(duplex),
                None,
            ))
            .await;
        let answer = envoy.recv().await;
        let common = headers_response(&answer).response.clone().unwrap();
        let headers = set_headers(&common);
        assert_eq!(headers["x-gateway-destination-endpoint"], "10.0.0.5:9000");
        assert!(!headers.contains_key("content-length"));
        assert_eq!(destination_metadata(&answer), "10.0.0.5:9000");
        let input = &picker.inputs()[0];
        assert!(input.body.is_empty());
        assert_eq!(input.path, "/v1/models");

        // A response without body ends at its headers.
        envoy.send(response_headers(true, None)).await;
        envoy.recv().await;
        assert_eq!(picker.wait_completed(1).await.len(), 1);
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn subset_hint_reaches_the_picker() {
    tokio::time::timeout(TEST, async {
        let (addr, picker) = serve(FakePicker::new(Behavior::ReverseSubset), limits()).await;
        let channel = connect(addr).await;
        let mut envoy = Envoy::open(&channel).await;

        let subset = subset_metadata(&["10.1.0.1:8000", "10.1.0.2:8000", "[fd00::7]:8001"]);
        let owned = post_headers(CHAT.len());
        let pairs: Vec<(&str, &str)> = owned.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let buffered = config(BodySendMode::Buffered, BodySendMode::Buffered);
        envoy
            .send(request_headers(&pairs, false, Some(buffered), Some(subset)))
            .await;
        envoy.recv().await;
        envoy.send(request_body(CHAT, true)).await;
        let answer = envoy.recv().await;
        let expected = "[fd00::7]:8001,10.1.0.2:8000,10.1.0.1:8000";
        assert_eq!(
            set_headers(body_response(&answer).response.as_ref().unwrap())
                ["x-gateway-destination-endpoint"],
            "[fd00::7]:8001"
        );
        assert_eq!(destination_metadata(&answer), expected);
        assert_eq!(
            picker.inputs()[0].subset,
            Some(vec![ep("10.1.0.1:8000"), ep("10.1.0.2:8000"), ep("[fd00::7]:8001")])
        );

        // The served endpoint reported on the response reaches the picker.
        envoy
            .send(response_headers(false, Some(served_metadata("10.1.0.2:8000"))))
            .await;
        envoy.recv().await;
        let id = picker.inputs()[0].request_id;
        assert_eq!(*picker.served.lock().unwrap(), vec![(id, ep("10.1.0.2:8000"))]);
        // and so does the response status (passive health)
        assert_eq!(*picker.statuses.lock().unwrap(), vec![(id, 200)]);
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn subset_is_enforced() {
    tokio::time::timeout(TEST, async {
        // The picker answers outside the subset: only the allowed endpoint survives.
        let (addr, picker) = serve(
            FakePicker::answering(&["10.9.9.9:8000", "10.1.0.2:8000"]),
            limits(),
        )
        .await;
        let channel = connect(addr).await;
        let mut envoy = Envoy::open(&channel).await;
        let subset = subset_metadata(&["10.1.0.1:8000", "10.1.0.2:8000"]);
        envoy
            .send(request_headers(
                &[(":method", "GET"), (":path", "/")],
                true,
                None,
                Some(subset),
            ))
            .await;
        let answer = envoy.recv().await;
        assert_eq!(destination_metadata(&answer), "10.1.0.2:8000");
        drop(envoy);

        // Nothing allowed: 503.
        let mut envoy = Envoy::open(&channel).await;
        let subset = subset_metadata(&["10.7.7.7:8000"]);
        envoy
            .send(request_headers(&[(":path", "/")], true, None, Some(subset)))
            .await;
        let answer = envoy.recv().await;
        assert_eq!(immediate(&answer).status.unwrap().code, 503);
        assert!(matches!(envoy.end().await, Ok(None)));
        // Both picks returned Ok, so both are reported complete.
        assert_eq!(picker.wait_completed(2).await.len(), 2);

        // An empty subset is refused without asking the picker.
        let before = picker.inputs().len();
        let mut envoy = Envoy::open(&channel).await;
        envoy
            .send(request_headers(
                &[(":path", "/")],
                true,
                None,
                Some(subset_metadata(&[])),
            ))
            .await;
        let answer = envoy.recv().await;
        let refusal = immediate(&answer);
        assert_eq!(refusal.status.unwrap().code, 503);
        assert_eq!(json_error(refusal)["error"]["code"], "no_endpoint");
        assert_eq!(picker.inputs().len(), before);
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn set_headers_and_new_body_are_applied() {
    tokio::time::timeout(TEST, async {
        let new_body = Bytes::from_static(br#"{"model":"llama-8b","prompt":"rewritten"}"#);
        let output = PickOutput {
            endpoints: vec![ep("10.0.0.6:8000")],
            set_headers: vec![
                ("x-data-parallel-rank".into(), "3".into()),
                ("bad header".into(), "x".into()),
                ("x-gateway-destination-endpoint".into(), "1.2.3.4:1".into()),
                ("content-length".into(), "1".into()),
            ],
            new_body: Some(new_body.clone()),
            decision: vec![("policy", "cost-model".into()), ("score", "1.500".into())],
        };
        let (addr, _picker) = serve(FakePicker::new(Behavior::Answer(output)), limits()).await;
        let channel = connect(addr).await;

        // Buffered: a body mutation and a matching content-length.
        let mut envoy = Envoy::open(&channel).await;
        let buffered = config(BodySendMode::Buffered, BodySendMode::Buffered);
        envoy.send(post(CHAT.len(), Some(buffered))).await;
        envoy.recv().await;
        envoy.send(request_body(CHAT, true)).await;
        let answer = envoy.recv().await;
        let common = body_response(&answer).response.clone().unwrap();
        let headers = set_headers(&common);
        assert_eq!(headers["x-data-parallel-rank"], "3");
        assert_eq!(headers["x-gateway-destination-endpoint"], "10.0.0.6:8000");
        assert_eq!(headers["content-length"], new_body.len().to_string());
        assert_eq!(
            headers.len(),
            3,
            "invalid and owned headers are skipped: {headers:?}"
        );
        assert_eq!(
            common.body_mutation.unwrap().mutation,
            Some(body_mutation::Mutation::Body(new_body.to_vec()))
        );
        // the decision, in its own metadata namespace beside the destination
        let md = answer.dynamic_metadata.as_ref().expect("metadata");
        let Some(Kind::StructValue(decision)) = &md.fields["kvroute.picker"].kind else {
            panic!("no kvroute.picker metadata: {md:?}");
        };
        let field = |k: &str| match &decision.fields[k].kind {
            Some(Kind::StringValue(v)) => v.clone(),
            other => panic!("{k}: {other:?}"),
        };
        assert_eq!(
            (field("policy"), field("score")),
            ("cost-model".into(), "1.500".into())
        );
        assert_eq!(destination_metadata(&answer), "10.0.0.6:8000");

        // Full duplex: the new body is what streams back.
        let mut envoy = Envoy::open(&channel).await;
        envoy.send(post(CHAT.len(), None)).await;
        envoy.send(request_body(CHAT, true)).await;
        let answer = envoy.recv().await;
        let headers = set_headers(headers_response(&answer).response.as_ref().unwrap());
        assert_eq!(headers["x-data-parallel-rank"], "3");
        assert_eq!(headers["content-length"], new_body.len().to_string());
        let (echoed, _) = collect_streamed_request_body(&mut envoy).await;
        assert_eq!(echoed, new_body);
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn rejections_become_immediate_responses() {
    tokio::time::timeout(TEST, async {
        let cases = [
            (
                PickRejection::BadRequest("no model".into()),
                400,
                "invalid_request_error",
                "bad_request",
            ),
            (
                PickRejection::UnknownModel("no such model".into()),
                404,
                "invalid_request_error",
                "model_not_found",
            ),
            (
                PickRejection::Shed("pool saturated".into()),
                429,
                "rate_limit_error",
                "overloaded",
            ),
            (
                PickRejection::NoEndpoint("nothing ready".into()),
                503,
                "service_unavailable",
                "no_endpoint",
            ),
            (
                PickRejection::ShedBecause("queue_expired", "waited the ttl".into()),
                429,
                "rate_limit_error",
                "queue_expired",
            ),
        ];
        for (rejection, status, kind, code) in cases {
            let message = match &rejection {
                PickRejection::BadRequest(m)
                | PickRejection::UnknownModel(m)
                | PickRejection::Shed(m)
                | PickRejection::ShedBecause(_, m)
                | PickRejection::NoEndpoint(m) => m.clone(),
            };
            let (addr, picker) =
                serve(FakePicker::new(Behavior::Reject(rejection)), limits()).await;
            let channel = connect(addr).await;
            let mut envoy = Envoy::open(&channel).await;
            envoy.send(post(CHAT.len(), None)).await;
            envoy.send(request_body(CHAT, true)).await;
            let answer = envoy.recv().await;
            let refusal = immediate(&answer);
            assert_eq!(refusal.status.unwrap().code, status);
            let json = json_error(refusal);
            assert_eq!(json["error"]["message"], message.as_str());
            assert_eq!(json["error"]["type"], kind);
            assert_eq!(json["error"]["code"], code);
            let headers: HashMap<_, _> = refusal
                .headers
                .as_ref()
                .unwrap()
                .set_headers
                .iter()
                .map(|o| {
                    let h = o.header.as_ref().unwrap();
                    (h.key.clone(), h.raw_value.clone())
                })
                .collect();
            assert_eq!(headers["content-type"], b"application/json");
            assert_eq!(
                headers.contains_key("retry-after"),
                status == 429 || status == 503
            );
            if status == 429 || status == 503 {
                assert_eq!(headers["x-kvroute-reason"], code.as_bytes());
            }
            // The stream ends cleanly after an immediate response.
            assert!(matches!(envoy.end().await, Ok(None)));
            assert!(
                picker.completed().is_empty(),
                "a rejected pick is not in flight"
            );
        }
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn oversized_bodies_get_413() {
    tokio::time::timeout(TEST, async {
        let small = ExtProcLimits {
            max_body_bytes: 1000,
            ..ExtProcLimits::default()
        };
        let (addr, picker) = serve(FakePicker::answering(&["10.0.0.7:8000"]), small).await;
        let channel = connect(addr).await;

        // Announced by content-length: refused at the headers.
        let mut envoy = Envoy::open(&channel).await;
        envoy.send(post(5000, None)).await;
        let answer = envoy.recv().await;
        let refusal = immediate(&answer);
        assert_eq!(refusal.status.unwrap().code, 413);
        assert_eq!(json_error(refusal)["error"]["code"], "body_too_large");
        assert!(matches!(envoy.end().await, Ok(None)));

        // Streamed without content-length: refused once the chunks pass the limit.
        let mut envoy = Envoy::open(&channel).await;
        envoy
            .send(request_headers(
                &[(":method", "POST"), (":path", "/v1/completions")],
                false,
                None,
                None,
            ))
            .await;
        envoy.send(request_body(&[b'x'; 600], false)).await;
        envoy.silent().await;
        envoy.send(request_body(&[b'x'; 600], false)).await;
        let answer = envoy.recv().await;
        assert_eq!(immediate(&answer).status.unwrap().code, 413);
        assert!(matches!(envoy.end().await, Ok(None)));

        // BUFFERED_PARTIAL cut the body at the proxy: refused as too large.
        let mut envoy = Envoy::open(&channel).await;
        let partial = config(BodySendMode::BufferedPartial, BodySendMode::None);
        envoy
            .send(request_headers(
                &[(":path", "/v1/completions")],
                false,
                Some(partial),
                None,
            ))
            .await;
        envoy.recv().await;
        envoy.send(request_body(&[b'x'; 100], false)).await;
        assert_eq!(immediate(&envoy.recv().await).status.unwrap().code, 413);

        assert!(picker.inputs().is_empty());
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn odd_message_orders_end_with_a_grpc_error() {
    tokio::time::timeout(TEST, async {
        let (addr, picker) = serve(FakePicker::answering(&["10.0.0.8:8000"]), limits()).await;
        let channel = connect(addr).await;

        // Body before headers.
        let mut envoy = Envoy::open(&channel).await;
        envoy.send(request_body(CHAT, true)).await;
        let status = envoy.end().await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument);

        // Response headers before the request was routed.
        let mut envoy = Envoy::open(&channel).await;
        envoy.send(post(CHAT.len(), None)).await;
        envoy.send(response_headers(false, None)).await;
        assert_eq!(envoy.end().await.unwrap_err().code(), Code::InvalidArgument);

        // Headers twice.
        let mut envoy = Envoy::open(&channel).await;
        envoy.send(post(CHAT.len(), None)).await;
        envoy.send(post(CHAT.len(), None)).await;
        assert_eq!(envoy.end().await.unwrap_err().code(), Code::InvalidArgument);

        // A body after the request was routed.
        let mut envoy = Envoy::open(&channel).await;
        envoy
            .send(request_headers(&[(":path", "/")], true, None, None))
            .await;
        envoy.recv().await;
        envoy.send(request_body(b"late", true)).await;
        assert_eq!(envoy.end().await.unwrap_err().code(), Code::InvalidArgument);

        // An unsupported body mode.
        let mut envoy = Envoy::open(&channel).await;
        let streamed = config(BodySendMode::Streamed, BodySendMode::Streamed);
        envoy.send(post(CHAT.len(), Some(streamed))).await;
        assert_eq!(
            envoy.end().await.unwrap_err().code(),
            Code::FailedPrecondition
        );

        // An empty message, then a clean half-close.
        let envoy = Envoy::open(&channel).await;
        envoy.send(ProcessingRequest::default()).await;
        assert!(matches!(envoy.finish().await, Ok(None)));

        // The routed stream above is reported complete although it broke.
        assert_eq!(picker.wait_completed(1).await.len(), 1);
        // The server still works.
        let mut envoy = Envoy::open(&channel).await;
        envoy
            .send(request_headers(&[(":path", "/")], true, None, None))
            .await;
        assert_eq!(destination_metadata(&envoy.recv().await), "10.0.0.8:8000");
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn abandoned_and_failing_picks() {
    tokio::time::timeout(TEST, async {
        // The proxy goes away after routing: completion is still reported.
        let (addr, picker) = serve(FakePicker::answering(&["10.0.0.9:8000"]), limits()).await;
        let channel = connect(addr).await;
        let mut envoy = Envoy::open(&channel).await;
        envoy
            .send(request_headers(&[(":path", "/")], true, None, None))
            .await;
        envoy.recv().await;
        drop(envoy);
        assert_eq!(picker.wait_completed(1).await.len(), 1);

        // The proxy goes away while the pick hangs: the pick is dropped, nothing completes.
        let (addr, picker) = serve(FakePicker::new(Behavior::Hang), limits()).await;
        let channel = connect(addr).await;
        let envoy = Envoy::open(&channel).await;
        envoy
            .send(request_headers(&[(":path", "/")], true, None, None))
            .await;
        tokio::time::timeout(STEP, async {
            while picker.inputs().is_empty() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the pick did not start");
        drop(envoy);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(picker.completed().is_empty());

        // A panicking picker yields a 500, not a broken stream.
        let (addr, _picker) = serve(FakePicker::new(Behavior::Panic), limits()).await;
        let channel = connect(addr).await;
        let mut envoy = Envoy::open(&channel).await;
        envoy
            .send(request_headers(&[(":path", "/")], true, None, None))
            .await;
        let answer = envoy.recv().await;
        let refusal = immediate(&answer);
        assert_eq!(refusal.status.unwrap().code, 500);
        assert_eq!(json_error(refusal)["error"]["type"], "internal_error");
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn concurrent_streams_are_bounded() {
    tokio::time::timeout(TEST, async {
        let one = ExtProcLimits {
            max_concurrent_streams: 1,
            assumed_body_mode: AssumedBodyMode::FullDuplexStreamed,
            ..ExtProcLimits::default()
        };
        let (addr, _picker) = serve(FakePicker::answering(&["10.0.0.10:8000"]), one).await;
        let channel = connect(addr).await;

        let mut first = Envoy::open(&channel).await;
        first.send(post(CHAT.len(), None)).await;
        first.silent().await;

        let mut second = Envoy::open(&channel).await;
        second.send(post(CHAT.len(), None)).await;
        let answer = second.recv().await;
        let refusal = immediate(&answer);
        assert_eq!(refusal.status.unwrap().code, 503);
        assert_eq!(json_error(refusal)["error"]["code"], "picker_overloaded");

        // The first stream is unaffected; once it ends its slot is free again.
        first.send(request_body(CHAT, true)).await;
        headers_response(&first.recv().await);
        collect_streamed_request_body(&mut first).await;
        assert!(matches!(first.finish().await, Ok(None)));
        let mut third = Envoy::open(&channel).await;
        third
            .send(request_headers(&[(":path", "/")], true, None, None))
            .await;
        assert_eq!(destination_metadata(&third.recv().await), "10.0.0.10:8000");
    })
    .await
    .unwrap();
}

/// A channel whose connections come from `from` (another loopback address than the server's
/// gateway): what a second peer of the picker looks like.
async fn connect_from(addr: SocketAddr, from: std::net::Ipv4Addr) -> Channel {
    let connector = tower::service_fn(move |_: tonic::transport::Uri| async move {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.bind(SocketAddr::from((from, 0)))?;
        let stream = socket.connect(addr).await?;
        Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
    });
    tokio::time::timeout(
        STEP,
        tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect_with_connector(connector),
    )
    .await
    .unwrap()
    .unwrap()
}

/// Hardening IV, 6: 64 connections of silent streams from one peer filled the opening room
/// and the gateway's own picks failed. One address holds at most its share; the others open
/// and are served.
#[tokio::test]
async fn silent_streams_of_one_address_leave_the_opening_room_to_the_others() {
    tokio::time::timeout(TEST, async {
        let limits = ExtProcLimits {
            // 4 processing, 8 opening in all, 3 per address
            max_concurrent_streams: 4,
            max_opening_per_address: 3,
            head_timeout: Duration::from_secs(60),
            ..ExtProcLimits::default()
        };
        let (addr, _picker) = serve(FakePicker::answering(&["10.0.0.10:8000"]), limits).await;
        // the stranger, on several connections, opens streams and says nothing
        let mut silent = Vec::new();
        let mut refused = 0;
        for _ in 0..4 {
            let channel = connect_from(addr, std::net::Ipv4Addr::new(127, 0, 0, 2)).await;
            for _ in 0..2 {
                let (tx, rx) = mpsc::channel::<ProcessingRequest>(1);
                let mut client = ExternalProcessorClient::new(channel.clone());
                match client.process(ReceiverStream::new(rx)).await {
                    Ok(r) => silent.push((tx, r.into_inner(), channel.clone())),
                    Err(status) => {
                        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
                        refused += 1;
                    }
                }
            }
        }
        assert_eq!((silent.len(), refused), (3, 5));
        // the gateway opens and is answered
        let channel = connect(addr).await;
        let mut envoy = Envoy::open(&channel).await;
        envoy
            .send(request_headers(&[(":path", "/")], true, None, None))
            .await;
        assert_eq!(destination_metadata(&envoy.recv().await), "10.0.0.10:8000");
        // a silent stream that goes gives its place back
        drop(silent.pop());
        let channel = connect_from(addr, std::net::Ipv4Addr::new(127, 0, 0, 2)).await;
        let mut again = None;
        for _ in 0..50 {
            let (tx, rx) = mpsc::channel::<ProcessingRequest>(1);
            let mut client = ExternalProcessorClient::new(channel.clone());
            if let Ok(r) = client.process(ReceiverStream::new(rx)).await {
                again = Some((tx, r));
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(again.is_some(), "the place came back");
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn grpc_health_reports_the_three_services() {
    tokio::time::timeout(TEST, async {
        let (handle, service) = health_service(true).await;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            Server::builder()
                .add_service(service)
                .serve_with_incoming(TcpListenerStream::new(listener))
                .await
                .unwrap();
        });
        let mut client = HealthClient::new(connect(addr).await);
        let mut status_of = async |name: &str| {
            client
                .check(HealthCheckRequest {
                    service: name.to_string(),
                })
                .await
                .map(|r| r.into_inner().status())
        };
        let names = [
            "liveness",
            "readiness",
            "envoy.service.ext_proc.v3.ExternalProcessor",
        ];
        for name in names {
            assert_eq!(
                status_of(name).await.unwrap(),
                ServingStatus::Serving,
                "{name}"
            );
        }
        assert_eq!(
            status_of("nonexistent").await.unwrap_err().code(),
            Code::NotFound
        );

        handle.set_ready(false).await;
        assert_eq!(status_of("liveness").await.unwrap(), ServingStatus::Serving);
        assert_eq!(
            status_of("readiness").await.unwrap(),
            ServingStatus::NotServing
        );
        assert_eq!(
            status_of(names[2]).await.unwrap(),
            ServingStatus::NotServing
        );

        handle.set_ready(true).await;
        assert_eq!(
            status_of("readiness").await.unwrap(),
            ServingStatus::Serving
        );
    })
    .await
    .unwrap();
}
