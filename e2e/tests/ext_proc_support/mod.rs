#![allow(dead_code)] // each test file reads the parts of the answer it checks
//! Envoy's side of an ext_proc stream, just enough for a BUFFERED request (shared by the
//! e2e tests that talk to the picker's ext_proc listener without a real Envoy).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
    processing_request, processing_response,
};
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value, value::Kind};
use tokio_stream::wrappers::ReceiverStream;

/// What the picker answered.
#[derive(Debug)]
pub enum Answer {
    Route {
        destination: String,
        metadata: String,
        /// Every header the answer sets.
        headers: HashMap<String, String>,
        /// The headers the answer removes.
        removed: Vec<String>,
    },
    Immediate {
        status: u32,
        body: String,
    },
}

fn headers(pairs: &[(&str, String)]) -> HeaderMap {
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

fn subset(entries: &[String]) -> Metadata {
    let list = ListValue {
        values: entries
            .iter()
            .map(|e| Value {
                kind: Some(Kind::StringValue(e.clone())),
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

async fn next(s: &mut tonic::Streaming<ProcessingResponse>, step: Duration) -> ProcessingResponse {
    tokio::time::timeout(step, s.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap()
}

/// Send one chat/completions request through ext_proc in BUFFERED mode.
pub async fn route(addr: SocketAddr, body: &[u8], subset_hint: Option<&[String]>) -> Answer {
    let step = Duration::from_secs(5);
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let mut client = ExternalProcessorClient::new(channel);
    let mut stream = tokio::time::timeout(step, client.process(ReceiverStream::new(rx)))
        .await
        .unwrap()
        .unwrap()
        .into_inner();
    let hdrs = [
        (":method", "POST".to_string()),
        (":path", "/v1/completions".to_string()),
        (":authority", "gateway".to_string()),
        ("content-type", "application/json".to_string()),
        ("content-length", body.len().to_string()),
    ];
    tx.send(ProcessingRequest {
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: BodySendMode::Buffered as i32,
            response_body_mode: BodySendMode::Buffered as i32,
            send_body_without_waiting_for_header_response: false,
        }),
        metadata_context: subset_hint.map(subset),
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(headers(&hdrs)),
            end_of_stream: false,
            ..Default::default()
        })),
        ..Default::default()
    })
    .await
    .unwrap();
    let first = next(&mut stream, step).await;
    if let Some(processing_response::Response::ImmediateResponse(i)) = first.response {
        return Answer::Immediate {
            status: i.status.map_or(0, |s| s.code as u32),
            body: String::from_utf8_lossy(&i.body).into_owned(),
        };
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
    let answer = next(&mut stream, step).await;
    match answer.response {
        Some(processing_response::Response::ImmediateResponse(i)) => Answer::Immediate {
            status: i.status.map_or(0, |s| s.code as u32),
            body: String::from_utf8_lossy(&i.body).into_owned(),
        },
        Some(processing_response::Response::RequestBody(b)) => {
            let common = b.response.unwrap();
            let mutation = common.header_mutation.unwrap();
            let removed = mutation.remove_headers.clone();
            let headers: HashMap<String, String> = mutation
                .set_headers
                .into_iter()
                .filter_map(|o| o.header)
                .map(|h| (h.key, String::from_utf8_lossy(&h.raw_value).into_owned()))
                .collect();
            let md = answer.dynamic_metadata.unwrap();
            let Some(Kind::StructValue(ns)) = &md.fields["envoy.lb"].kind else {
                panic!("envoy.lb is not a struct");
            };
            let Some(Kind::StringValue(metadata)) =
                &ns.fields["x-gateway-destination-endpoint"].kind
            else {
                panic!("no destination in metadata");
            };
            Answer::Route {
                destination: headers["x-gateway-destination-endpoint"].clone(),
                metadata: metadata.clone(),
                headers,
                removed,
            }
        }
        other => panic!("unexpected answer {other:?}"),
    }
}
