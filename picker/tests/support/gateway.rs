//! Envoy's side of one ext_proc stream in BUFFERED mode, for tests that drive the picker's
//! ext_proc listener as a gateway would: any method, path, headers and body.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    CommonResponse, HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
    ProtocolConfiguration, body_mutation, processing_request, processing_response,
};
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value as PbValue};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

/// What the picker answered.
#[derive(Debug)]
pub enum Answer {
    Route {
        /// `x-gateway-destination-endpoint` as set on the request.
        destination: String,
        /// `envoy.lb` / `x-gateway-destination-endpoint` dynamic metadata.
        metadata: String,
        /// Every header the answer sets.
        headers: HashMap<String, String>,
        /// The replacement body, when the picker rewrote it.
        new_body: Option<Vec<u8>>,
        /// The decision the picker published (`kvroute.picker` metadata).
        decision: HashMap<String, String>,
    },
    Immediate {
        status: u32,
        body: serde_json::Value,
    },
}

impl Answer {
    /// The destination of a routed request; panics on a refusal.
    pub fn destination(&self) -> &str {
        match self {
            Self::Route { destination, .. } => destination,
            Self::Immediate { status, body } => panic!("refused with {status}: {body}"),
        }
    }

    /// The status of a refusal; panics on a route.
    pub fn refused(&self) -> u32 {
        match self {
            Self::Immediate { status, .. } => *status,
            Self::Route { destination, .. } => panic!("routed to {destination}"),
        }
    }
}

pub async fn channel(addr: SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

fn header_map(pairs: &[(&str, &str)]) -> HeaderMap {
    HeaderMap {
        headers: pairs
            .iter()
            .map(|(k, v)| HeaderValue {
                key: (*k).to_string(),
                raw_value: v.as_bytes().to_vec(),
                ..Default::default()
            })
            .collect(),
    }
}

async fn next(s: &mut tonic::Streaming<ProcessingResponse>) -> ProcessingResponse {
    tokio::time::timeout(Duration::from_secs(10), s.message())
        .await
        .expect("an answer within 10 s")
        .expect("no gRPC error")
        .expect("the stream is open")
}

fn immediate(answer: &ProcessingResponse) -> Option<Answer> {
    match &answer.response {
        Some(processing_response::Response::ImmediateResponse(i)) => Some(Answer::Immediate {
            status: i.status.as_ref().map_or(0, |s| s.code as u32),
            body: serde_json::from_slice(&i.body).unwrap_or(serde_json::Value::Null),
        }),
        _ => None,
    }
}

fn route_answer(common: CommonResponse, answer: &ProcessingResponse) -> Answer {
    let headers: HashMap<String, String> = common
        .header_mutation
        .unwrap_or_default()
        .set_headers
        .into_iter()
        .filter_map(|o| o.header)
        .map(|h| (h.key, String::from_utf8_lossy(&h.raw_value).into_owned()))
        .collect();
    let md = answer.dynamic_metadata.clone().expect("routing metadata");
    let Some(Kind::StructValue(ns)) = &md.fields["envoy.lb"].kind else {
        panic!("envoy.lb is not a struct");
    };
    let Some(Kind::StringValue(metadata)) = &ns.fields["x-gateway-destination-endpoint"].kind
    else {
        panic!("no destination in metadata");
    };
    let decision = match md
        .fields
        .get("kvroute.picker")
        .and_then(|v| v.kind.as_ref())
    {
        Some(Kind::StructValue(s)) => s
            .fields
            .iter()
            .filter_map(|(k, v)| match &v.kind {
                Some(Kind::StringValue(v)) => Some((k.clone(), v.clone())),
                _ => None,
            })
            .collect(),
        _ => HashMap::new(),
    };
    let new_body = common.body_mutation.and_then(|m| match m.mutation {
        Some(body_mutation::Mutation::Body(b)) => Some(b),
        _ => None,
    });
    Answer::Route {
        destination: headers["x-gateway-destination-endpoint"].clone(),
        metadata: metadata.clone(),
        headers,
        new_body,
        decision,
    }
}

/// One request through ext_proc (BUFFERED): `POST` when `body` is not empty, else a bodyless
/// `GET`. `headers` are the client's (name, value) pairs, repeated names sent as repeated
/// entries as Envoy does.
pub async fn request(
    channel: &Channel,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Answer {
    exchange(channel, path, headers, body, None, None).await
}

/// The gateway's subset hint (`envoy.lb.subset_hint`) listing `entries`.
fn subset_metadata(entries: &[&str]) -> Metadata {
    let list = ListValue {
        values: entries
            .iter()
            .map(|e| PbValue {
                kind: Some(Kind::StringValue((*e).to_string())),
            })
            .collect(),
    };
    Metadata {
        filter_metadata: HashMap::from([(
            "envoy.lb.subset_hint".to_string(),
            Struct {
                fields: HashMap::from([(
                    "x-gateway-destination-endpoint-subset".to_string(),
                    PbValue {
                        kind: Some(Kind::ListValue(list)),
                    },
                )]),
            },
        )]),
        ..Default::default()
    }
}

/// [`request`] with the gateway's subset hint, and, when `response` is given and the request
/// was routed, the upstream's answer passed back through the stream: its status, then its
/// body in one chunk.
pub async fn exchange(
    channel: &Channel,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    subset: Option<&[&str]>,
    response: Option<(u16, &[u8])>,
) -> Answer {
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let mut client = ExternalProcessorClient::new(channel.clone());
    let mut stream = tokio::time::timeout(
        Duration::from_secs(10),
        client.process(ReceiverStream::new(rx)),
    )
    .await
    .unwrap()
    .unwrap()
    .into_inner();
    let bodyless = body.is_empty();
    let length = body.len().to_string();
    let mut pairs = vec![
        (":method", if bodyless { "GET" } else { "POST" }),
        (":path", path),
        (":authority", "gateway"),
    ];
    if !bodyless {
        pairs.push(("content-type", "application/json"));
        pairs.push(("content-length", &length));
    }
    pairs.extend_from_slice(headers);
    tx.send(ProcessingRequest {
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: BodySendMode::Buffered as i32,
            response_body_mode: BodySendMode::Buffered as i32,
            send_body_without_waiting_for_header_response: false,
        }),
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(header_map(&pairs)),
            end_of_stream: bodyless,
            ..Default::default()
        })),
        metadata_context: subset.map(subset_metadata),
        ..Default::default()
    })
    .await
    .unwrap();
    let first = next(&mut stream).await;
    if let Some(refusal) = immediate(&first) {
        return refusal;
    }
    if bodyless {
        let Some(processing_response::Response::RequestHeaders(h)) = &first.response else {
            panic!("expected a headers answer, got {first:?}");
        };
        let answer = route_answer(h.response.clone().unwrap_or_default(), &first);
        respond(&tx, &mut stream, response).await;
        return answer;
    }
    tx.send(ProcessingRequest {
        request: Some(processing_request::Request::RequestBody(HttpBody {
            body: body.to_vec(),
            end_of_stream: true,
            ..Default::default()
        })),
        ..Default::default()
    })
    .await
    .unwrap();
    let answer = next(&mut stream).await;
    if let Some(refusal) = immediate(&answer) {
        return refusal;
    }
    let routed = match &answer.response {
        Some(processing_response::Response::RequestBody(b)) => {
            route_answer(b.response.clone().unwrap_or_default(), &answer)
        }
        other => panic!("unexpected answer {other:?}"),
    };
    respond(&tx, &mut stream, response).await;
    routed
}

/// The upstream's response through the stream: headers with `:status`, then the body.
async fn respond(
    tx: &tokio::sync::mpsc::Sender<ProcessingRequest>,
    stream: &mut tonic::Streaming<ProcessingResponse>,
    response: Option<(u16, &[u8])>,
) {
    let Some((status, body)) = response else {
        return;
    };
    let status = status.to_string();
    let send = |request| ProcessingRequest {
        request: Some(request),
        ..Default::default()
    };
    tx.send(send(processing_request::Request::ResponseHeaders(
        HttpHeaders {
            headers: Some(header_map(&[(":status", &status)])),
            end_of_stream: false,
            ..Default::default()
        },
    )))
    .await
    .unwrap();
    next(stream).await;
    tx.send(send(processing_request::Request::ResponseBody(HttpBody {
        body: body.to_vec(),
        end_of_stream: true,
        ..Default::default()
    })))
    .await
    .unwrap();
    next(stream).await;
}
