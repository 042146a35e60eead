//! The Gateway API Inference Extension endpoint-picker protocol, spoken over Envoy `ext_proc`.
//!
//! This module knows the wire protocol and nothing about how an endpoint is chosen: it collects
//! a request's headers and complete body, hands them to an [`EndpointPicker`], and turns the
//! answer into the mutations and metadata the gateway routes on. Keeping the two apart lets the
//! service, the tests and any other picker share one implementation of a fiddly protocol.
//!
//! # The conversation (one gRPC stream per HTTP request)
//!
//! * Request headers arrive first. A bodyless request (`end_of_stream` on the headers, e.g. a
//!   `GET`) is picked right away and answered on the headers.
//! * `BUFFERED` request body mode: the proxy waits for the headers answer before it sends the
//!   (single, complete) body, so the headers are answered with a bare `CONTINUE` and the pick is
//!   answered on the body, whose header mutations Envoy still applies in this mode.
//! * `FULL_DUPLEX_STREAMED` request body mode: the proxy streams body chunks without waiting and
//!   has already drained them from its own buffers, so the headers answer is held back until the
//!   body is complete (`end_of_stream`, or request trailers), then the headers answer carries the
//!   routing and the body is streamed back as `StreamedBodyResponse` chunks, as the reference EPP
//!   does.
//! * The response passes through untouched (echoed chunk by chunk in full-duplex mode, since the
//!   proxy drops what is not sent back) and [`EndpointPicker::on_response_complete`] fires once
//!   it has ended.
//!
//! The body mode comes from `ProcessingRequest.protocol_config`, which Envoy encodes in the
//! first message of each stream; proxies that do not send it get
//! [`ExtProcLimits::assumed_body_mode`].
//!
//! # The answer
//!
//! The chosen endpoint is set as the request header `x-gateway-destination-endpoint: ip:port`,
//! exactly one, since gateways that route by the header (Envoy's `ORIGINAL_DST` cluster reading
//! it, agentgateway) take its whole value as one address; the ordered list, chosen first, then
//! the fallbacks the proxy may retry, goes in the dynamic metadata `envoy.lb` /
//! `x-gateway-destination-endpoint` (what Envoy's `override_host` load-balancing policy reads).
//! A rejection becomes an `ImmediateResponse` with an OpenAI-style JSON body.

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap as ProtoHeaderMap, HeaderValue as ProtoHeaderValue, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpBody,
    HttpHeaders, ImmediateResponse, ProcessingRequest, ProcessingResponse, StreamedBodyResponse,
    TrailersResponse, body_mutation, processing_request, processing_response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use http::{HeaderName, HeaderValue};
use parking_lot::Mutex;
use tokio::sync::{Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tonic_health::ServingStatus;
use tonic_health::pb::health_server::HealthServer;
use tonic_health::server::{HealthReporter, HealthService};

use super::errors::{Dialect, envelope};

/// Request header that carries the chosen endpoint(s) to the gateway.
pub const DESTINATION_ENDPOINT_HEADER: &str = "x-gateway-destination-endpoint";
/// Dynamic-metadata namespace of the chosen endpoint(s); `envoy.lb` is what Envoy's subset load
/// balancer reads, hence the protocol's default.
pub const DESTINATION_METADATA_NAMESPACE: &str = "envoy.lb";
/// Request header naming a split request's prefill endpoint (`ip:port`), which llm-d's
/// routing sidecar on the decode pod reads to run the prefill step there first. Set only by
/// the picker: a client's own is removed from every request.
pub const PREFILLER_HOST_PORT_HEADER: &str = "x-prefiller-host-port";
/// Key, inside [`DESTINATION_METADATA_NAMESPACE`], of the chosen endpoint(s).
pub const DESTINATION_METADATA_KEY: &str = DESTINATION_ENDPOINT_HEADER;
/// Filter-metadata namespace in which the proxy may restrict the candidates.
pub const SUBSET_HINT_NAMESPACE: &str = "envoy.lb.subset_hint";
/// Key, inside [`SUBSET_HINT_NAMESPACE`], of the candidate list (`ip:port` strings).
pub const SUBSET_HINT_KEY: &str = "x-gateway-destination-endpoint-subset";
/// Key, inside `envoy.lb` on response messages, of the endpoint that actually served the
/// request (the proxy may have fallen back down the list).
pub const SERVED_ENDPOINT_KEY: &str = "x-gateway-destination-endpoint-served";
/// gRPC health service name of process liveness.
pub const LIVENESS_SERVICE: &str = "liveness";
/// gRPC health service name of readiness to route.
pub const READINESS_SERVICE: &str = "readiness";
/// gRPC health service name of the ext_proc service itself.
pub const EXT_PROC_SERVICE: &str =
    envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::SERVICE_NAME;

/// Largest body chunk sent back in one `StreamedBodyResponse`. Envoy recommends at most 64 KiB
/// per chunk; the reference EPP uses 62,000 bytes to keep a margin, and so do we.
const STREAMED_CHUNK_BYTES: usize = 62_000;
/// Room for headers and metadata on top of the body in one inbound gRPC message, so that a
/// buffered body a little over the limit still decodes and gets a clean 413.
const MESSAGE_OVERHEAD_BYTES: usize = 1 << 20;
/// Responses queued towards the proxy before the stream task waits; enough for a burst of body
/// chunks without letting one slow proxy connection hold much memory.
const OUTBOUND_QUEUE: usize = 32;

/// What the gateway sent for one request, once headers and the complete body have arrived.
#[derive(Debug, Clone)]
pub struct PickInput {
    /// Unique per ext_proc stream on this server; the same id is passed to
    /// [`EndpointPicker::on_response_served`] and [`EndpointPicker::on_response_complete`] so
    /// that in-flight accounting can be keyed on it.
    pub request_id: u64,
    /// Regular request headers (lower-case names). Envoy carries the host of every request,
    /// HTTP/1 included, as `:authority`, which is copied into `host` when there is no `host`
    /// header; other pseudo-headers are dropped, `:path` is in [`PickInput::path`].
    pub headers: http::HeaderMap,
    /// The `:path` pseudo-header (with query), empty if the proxy did not forward it.
    pub path: String,
    /// The complete request body, empty for bodyless requests.
    pub body: Bytes,
    /// The proxy's candidate subset, when it sent one: pick only from it. An entry without a
    /// port (bare IP) has port 0, meaning any port of that address. Never empty: an empty
    /// subset is answered with 503 before the picker is asked, as the protocol requires.
    pub subset: Option<Vec<SocketAddr>>,
}

/// The picker's answer: ordered endpoints (first = chosen) plus request mutations.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PickOutput {
    /// Primary first, then fallbacks the proxy may retry in order. Must not be empty.
    pub endpoints: Vec<SocketAddr>,
    /// Extra request headers to set (overwriting), e.g. `x-data-parallel-rank`. Names that are
    /// not valid HTTP header names, values that are not valid header values, and the headers
    /// this module owns (`x-gateway-destination-endpoint`, `content-length`) are skipped.
    pub set_headers: Vec<(String, String)>,
    /// A replacement request body; `content-length` is fixed to match. Ignored for requests
    /// picked at their headers (bodyless requests, or body mode `NONE`).
    pub new_body: Option<Bytes>,
    /// What the decision was, for observability: published as strings in the dynamic
    /// metadata namespace [`DECISION_METADATA_NAMESPACE`] (access logs, tracing).
    pub decision: Vec<(&'static str, String)>,
}

/// The dynamic metadata namespace of [`PickOutput::decision`].
pub const DECISION_METADATA_NAMESPACE: &str = "kvroute.picker";

/// Why the picker refused a request; each maps to an HTTP status the client sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PickRejection {
    /// 400: the request is malformed (bad JSON, missing model, ...).
    BadRequest(String),
    /// 404: the requested model is not served by this pool.
    UnknownModel(String),
    /// 429: dropped to protect the pool (sheddable request under load).
    Shed(String),
    /// 429 with a reason code (flow control: `queue_full`, `queue_expired`, `displaced`,
    /// `too_large`).
    ShedBecause(&'static str, String),
    /// 503: no eligible endpoint (none ready, or none in the proxy's subset).
    NoEndpoint(String),
}

/// Chooses endpoints for requests. Implemented by the picker service; the protocol layer calls
/// it once per request.
pub trait EndpointPicker: Send + Sync + 'static {
    /// Chooses endpoints for one request. The future runs on its own task, so a panic in it is
    /// answered with a 500 rather than tearing the stream down, and it is dropped (cancelled)
    /// if the proxy abandons the request first.
    fn pick(
        &self,
        input: PickInput,
    ) -> impl Future<Output = Result<PickOutput, PickRejection>> + Send;

    /// The proxy reported which endpoint served the request (`envoy.lb` /
    /// `x-gateway-destination-endpoint-served` on the response), which differs from the primary
    /// when it fell back. Called at most once per request, before `on_response_complete`.
    fn on_response_served(&self, _request_id: u64, _endpoint: SocketAddr) {}

    /// The response head came back with this `:status` (for passive health). Called at most
    /// once per request, after `on_response_served` when the proxy reports both with the
    /// response headers.
    fn on_response_status(&self, _request_id: u64, _status: u16) {}

    /// The first non-empty chunk of the response body passed (only seen when the proxy sends
    /// response bodies, in `STREAMED` or `FULL_DUPLEX_STREAMED` mode). Called at most once per
    /// request, before `on_response_complete`.
    fn on_first_response_body(&self, _request_id: u64) {}

    /// A non-empty chunk of the response body passed (only seen when the proxy sends response
    /// bodies). Returns whether to be told of the next chunks too; once it returns `false` it
    /// is not called again for the request.
    fn on_response_chunk(&self, _request_id: u64, _chunk: &[u8]) -> bool {
        false
    }

    /// Whether the response body of the request is rewritten (the proxy must then send it
    /// without its `content-length`). Asked once, with the response headers; the body is
    /// rewritten only where the proxy sends it in `FULL_DUPLEX_STREAMED` mode, and
    /// `rewrite_response_chunk` is called only when this said yes.
    fn rewrites_response(&self, _request_id: u64) -> bool {
        false
    }

    /// A response body chunk as the client is to see it (`end`: the last one).
    fn rewrite_response_chunk(&self, _request_id: u64, chunk: Vec<u8>, _end: bool) -> Vec<u8> {
        chunk
    }

    /// The request that `pick` answered `Ok` for is over. Called exactly once for every `Ok`
    /// pick, whatever happened next: the response ended, the proxy cancelled, the stream broke,
    /// or the answer could not be delivered. This is what makes in-flight counts safe to keep.
    fn on_response_complete(&self, _request_id: u64) {}

    /// A request body did not complete within [`ExtProcLimits::body_timeout`] (answered 408;
    /// `pick` was not called).
    fn on_body_timeout(&self) {}

    /// A stream was refused or ended before `pick`, for `why`: `"stream_limit"` (the
    /// processing limit was reached when its headers came: 503), `"opening_limit"` (too many
    /// streams waiting for their headers: refused at once) or `"silent_stream"` (no message
    /// within [`ExtProcLimits::head_timeout`]).
    fn on_stream_refused(&self, _why: &'static str) {}
}

/// Body mode to assume when the proxy does not announce one in `protocol_config`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AssumedBodyMode {
    /// Envoy `BUFFERED`: one complete body message, sent after the headers were answered.
    Buffered,
    /// Envoy `FULL_DUPLEX_STREAMED`, which the inference-extension protocol requires gateways
    /// to support.
    FullDuplexStreamed,
}

/// Bounds and fallbacks of the ext_proc server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtProcLimits {
    /// Largest request body accepted; larger ones get a 413 `ImmediateResponse` (announced by
    /// `content-length` or found while collecting).
    pub max_body_bytes: usize,
    /// Streams (≈ requests in flight through the gateway, since a stream lasts until the
    /// response ends) served at once, counted from their first message; further ones get a
    /// 503 `ImmediateResponse`. Streams still waiting for their first message take nothing
    /// from it: they are bounded separately, by twice this number (so that one connection,
    /// at most `max_streams_per_connection` streams, never fills it), and refused at once
    /// past it.
    pub max_concurrent_streams: usize,
    /// Time a stream has from opening to its first message (the request headers); a silent
    /// stream is ended then, so it cannot hold anything for longer. A gateway sends the
    /// headers as it opens the stream, so this is short.
    pub head_timeout: std::time::Duration,
    /// Streams waiting for their first message that the connections from one address may
    /// hold together: one peer opening many connections of silent streams cannot take the
    /// whole opening room from the gateways.
    pub max_opening_per_address: usize,
    /// Streams one HTTP/2 connection may have open at once (advertised in its
    /// `SETTINGS_MAX_CONCURRENT_STREAMS`; a gateway opens more connections past it).
    pub max_streams_per_connection: u32,
    /// Body mode for both directions when the proxy sends no `protocol_config`.
    pub assumed_body_mode: AssumedBodyMode,
    /// Time from the request headers to the end of the request body; a body still incomplete
    /// then gets a 408 `ImmediateResponse`, so a stalled body cannot hold a stream slot.
    pub body_timeout: std::time::Duration,
}

impl Default for ExtProcLimits {
    fn default() -> Self {
        Self {
            max_body_bytes: 16 << 20,
            max_concurrent_streams: 16_384,
            head_timeout: std::time::Duration::from_secs(2),
            max_opening_per_address: 2048,
            max_streams_per_connection: 1024,
            assumed_body_mode: AssumedBodyMode::FullDuplexStreamed,
            body_timeout: std::time::Duration::from_secs(30),
        }
    }
}

/// Builds the tonic service for `envoy.service.ext_proc.v3.ExternalProcessor`, ready for
/// `tonic::transport::Server::add_service`.
pub fn ext_proc_server<P: EndpointPicker>(
    picker: Arc<P>,
    limits: ExtProcLimits,
) -> ExternalProcessorServer<ExtProcService<P>> {
    // tonic refuses messages over 4 MiB by default; a buffered body arrives in one message.
    let max_message = limits.max_body_bytes.saturating_add(MESSAGE_OVERHEAD_BYTES);
    ExternalProcessorServer::new(ExtProcService::new(picker, limits))
        .max_decoding_message_size(max_message)
}

/// The ext_proc service; see the module docs for the protocol it speaks.
pub struct ExtProcService<P> {
    shared: Arc<Shared<P>>,
    /// Streams past their first message.
    streams: Arc<Semaphore>,
    /// Streams waiting for their first message.
    opening: Arc<Semaphore>,
    /// Of those, how many each peer address holds (entries at zero are removed, so there
    /// are never more than the opening room).
    opening_by_address: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

/// One stream's place in [`ExtProcService::opening_by_address`], given back on drop.
struct AddressPlace {
    map: Arc<Mutex<HashMap<IpAddr, usize>>>,
    address: IpAddr,
}

impl AddressPlace {
    fn take(
        map: &Arc<Mutex<HashMap<IpAddr, usize>>>,
        address: IpAddr,
        limit: usize,
    ) -> Option<Self> {
        let mut m = map.lock();
        let n = m.entry(address).or_insert(0);
        if *n >= limit.max(1) {
            return None;
        }
        *n += 1;
        Some(Self {
            map: map.clone(),
            address,
        })
    }
}

impl Drop for AddressPlace {
    fn drop(&mut self) {
        let mut m = self.map.lock();
        if let Some(n) = m.get_mut(&self.address) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.address);
            }
        }
    }
}

struct Shared<P> {
    picker: Arc<P>,
    limits: ExtProcLimits,
    next_request_id: AtomicU64,
}

impl<P: EndpointPicker> ExtProcService<P> {
    /// A service over `picker`; [`ext_proc_server`] wraps it for tonic.
    pub fn new(picker: Arc<P>, limits: ExtProcLimits) -> Self {
        let permits = limits.max_concurrent_streams.min(Semaphore::MAX_PERMITS);
        let streams = Arc::new(Semaphore::new(permits));
        let opening = Arc::new(Semaphore::new(
            permits.saturating_mul(2).min(Semaphore::MAX_PERMITS),
        ));
        Self {
            shared: Arc::new(Shared {
                picker,
                limits,
                next_request_id: AtomicU64::new(1),
            }),
            streams,
            opening,
            opening_by_address: Arc::default(),
        }
    }
}

#[tonic::async_trait]
impl<P: EndpointPicker> ExternalProcessor for ExtProcService<P> {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let address = request.remote_addr().map(|a| a.ip());
        let inbound = request.into_inner();
        // A stream holds nothing of the processing limit until its first message: one that
        // never sends one only waits, bounded in number and in time (`head_timeout`), and per
        // peer address, so that one peer's many connections cannot fill the room.
        let place = match address {
            Some(a) => {
                let limit = self.shared.limits.max_opening_per_address;
                let Some(place) = AddressPlace::take(&self.opening_by_address, a, limit) else {
                    self.shared.picker.on_stream_refused("opening_limit");
                    return Err(Status::resource_exhausted(format!(
                        "{a} has {limit} streams waiting for their request headers"
                    )));
                };
                Some(place)
            }
            None => None,
        };
        let Ok(opening) = self.opening.clone().try_acquire_owned() else {
            self.shared.picker.on_stream_refused("opening_limit");
            return Err(Status::resource_exhausted(format!(
                "the endpoint picker has {} streams waiting for their request headers",
                self.shared.limits.max_concurrent_streams.saturating_mul(2)
            )));
        };
        let (tx, rx) = mpsc::channel(OUTBOUND_QUEUE);
        let shared = self.shared.clone();
        let streams = self.streams.clone();
        // The stream is driven on its own task so that the response stream can be returned at
        // once, as tonic requires for bidirectional calls.
        tokio::spawn(async move {
            let request_id = shared.next_request_id.fetch_add(1, Ordering::Relaxed);
            let mut task = StreamTask::new(shared, request_id, inbound, tx);
            task.admission = Admission::Opening {
                _opening: (opening, place),
                streams,
            };
            task.run().await;
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// What a stream holds of the server's stream limits.
enum Admission {
    /// Waiting for its first message: a place among the opening streams, and the semaphore to
    /// take a processing place from when it comes.
    Opening {
        _opening: (tokio::sync::OwnedSemaphorePermit, Option<AddressPlace>),
        streams: Arc<Semaphore>,
    },
    /// Past its first message.
    Processing {
        _permit: tokio::sync::OwnedSemaphorePermit,
    },
    /// Built without limits (tests of the task alone).
    Unlimited,
}

/// Whether the stream goes on after a message.
enum StreamNext {
    Continue,
    /// An immediate response was sent, or the proxy went away: end the stream cleanly.
    Stop,
}

/// Where the request stands.
enum Phase {
    AwaitingHeaders,
    /// Headers seen, body still arriving in `mode`.
    CollectingBody(RequestMode),
    /// The routing answer was sent; only response-path messages remain.
    Routed,
}

/// Request body modes this module can route in.
#[derive(Clone, Copy, PartialEq, Eq)]
enum RequestMode {
    /// No body will be sent: pick at the headers.
    None,
    /// One body message follows the headers answer (`BUFFERED`).
    Buffered,
    /// Like `Buffered`, but a body without `end_of_stream` was cut at the proxy's buffer limit.
    BufferedPartial,
    /// Chunks stream in while the headers answer is pending (`FULL_DUPLEX_STREAMED`).
    FullDuplex,
    /// A mode the protocol cannot be spoken in (`STREAMED`, `GRPC`, unknown); fine for bodyless
    /// requests only.
    Unsupported(i32),
}

impl RequestMode {
    fn from_wire(mode: i32) -> Self {
        match BodySendMode::try_from(mode) {
            Ok(BodySendMode::None) => Self::None,
            Ok(BodySendMode::Buffered) => Self::Buffered,
            Ok(BodySendMode::BufferedPartial) => Self::BufferedPartial,
            Ok(BodySendMode::FullDuplexStreamed) => Self::FullDuplex,
            Ok(BodySendMode::Streamed | BodySendMode::Grpc) | Err(_) => Self::Unsupported(mode),
        }
    }

    fn assumed(mode: AssumedBodyMode) -> Self {
        match mode {
            AssumedBodyMode::Buffered => Self::Buffered,
            AssumedBodyMode::FullDuplexStreamed => Self::FullDuplex,
        }
    }
}

/// At which message the pick happens, which decides how the answer is shaped.
#[derive(Clone, Copy)]
enum RoutePoint {
    /// Answer on the request headers (bodyless request, or body mode `NONE`).
    Headers,
    /// Answer on the one buffered body message.
    BufferedBody,
    /// Answer with held-back headers plus the streamed body; `trailers` when request trailers
    /// (not `end_of_stream`) ended the body.
    StreamedBody { trailers: bool },
}

/// The parts of the request head the picker gets.
struct RequestHead {
    headers: http::HeaderMap,
    path: String,
    content_length: Option<u64>,
}

/// Calls `on_response_complete` when dropped, so every exit path of a routed stream reports
/// completion exactly once.
struct InFlight<P: EndpointPicker> {
    picker: Arc<P>,
    request_id: u64,
    served_reported: bool,
    body_reported: bool,
    /// Whether the picker still reads the response body's chunks.
    watch_body: bool,
    /// Whether the picker rewrites the response body (decided with the response headers).
    rewrite_body: bool,
}

impl<P: EndpointPicker> Drop for InFlight<P> {
    fn drop(&mut self) {
        self.picker.on_response_complete(self.request_id);
    }
}

/// State of one ext_proc stream.
struct StreamTask<P: EndpointPicker> {
    shared: Arc<Shared<P>>,
    request_id: u64,
    inbound: Streaming<ProcessingRequest>,
    tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
    seen_first: bool,
    request_mode: RequestMode,
    /// Echo response body chunks back (full-duplex response mode) instead of `CONTINUE`.
    echo_response_body: bool,
    phase: Phase,
    head: Option<RequestHead>,
    /// The error envelope of the request's API, from its path.
    dialect: Dialect,
    body: Vec<u8>,
    subset: Option<Vec<SocketAddr>>,
    inflight: Option<InFlight<P>>,
    /// While a body is being collected: when it must be complete.
    body_deadline: Option<tokio::time::Instant>,
    /// Until the first message: when it must have come.
    head_deadline: Option<tokio::time::Instant>,
    admission: Admission,
}

impl<P: EndpointPicker> StreamTask<P> {
    fn new(
        shared: Arc<Shared<P>>,
        request_id: u64,
        inbound: Streaming<ProcessingRequest>,
        tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
    ) -> Self {
        let assumed = shared.limits.assumed_body_mode;
        let shared_head_timeout = shared.limits.head_timeout;
        Self {
            shared,
            request_id,
            inbound,
            tx,
            seen_first: false,
            request_mode: RequestMode::assumed(assumed),
            echo_response_body: assumed == AssumedBodyMode::FullDuplexStreamed,
            phase: Phase::AwaitingHeaders,
            head: None,
            dialect: Dialect::OpenAi,
            body: Vec::new(),
            subset: None,
            inflight: None,
            body_deadline: None,
            head_deadline: Some(tokio::time::Instant::now() + shared_head_timeout),
            admission: Admission::Unlimited,
        }
    }

    async fn run(mut self) {
        if let Err(status) = self.drive().await {
            // The proxy may already be gone; then there is nobody to tell.
            let _ = self.tx.send(Err(status)).await;
        }
        // Dropping `self` reports completion of a routed request that did not finish normally.
    }

    async fn drive(&mut self) -> Result<(), Status> {
        loop {
            let deadline = self.body_deadline;
            let body_late = async move {
                match deadline {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            let head = self.head_deadline;
            let head_late = async move {
                match head {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            let next = tokio::select! {
                message = self.inbound.message() => message,
                () = self.tx.closed() => return Ok(()),
                () = head_late => {
                    self.shared.picker.on_stream_refused("silent_stream");
                    return Err(Status::deadline_exceeded(format!(
                        "no request headers within {:?} of the stream opening",
                        self.shared.limits.head_timeout
                    )));
                }
                () = body_late => {
                    self.shared.picker.on_body_timeout();
                    let timeout = self.shared.limits.body_timeout;
                    self.refuse(Refusal::body_timeout(timeout)).await;
                    return Ok(());
                }
            };
            let message = match next {
                Ok(Some(message)) => message,
                Ok(None) => return Ok(()),
                Err(status) => return Err(status),
            };
            match self.handle(message).await? {
                StreamNext::Continue => {}
                StreamNext::Stop => return Ok(()),
            }
        }
    }

    async fn handle(&mut self, message: ProcessingRequest) -> Result<StreamNext, Status> {
        if !self.seen_first {
            self.seen_first = true;
            self.head_deadline = None;
            if let Admission::Opening { streams, .. } = &self.admission {
                // the opening place is given back whatever happens next
                match streams.clone().try_acquire_owned() {
                    Ok(permit) => self.admission = Admission::Processing { _permit: permit },
                    Err(_) => {
                        self.admission = Admission::Unlimited;
                        self.shared.picker.on_stream_refused("stream_limit");
                        let refusal = Refusal::overloaded(format!(
                            "the endpoint picker is at its limit of {} concurrent requests",
                            self.shared.limits.max_concurrent_streams
                        ));
                        return Ok(self.refuse(refusal).await);
                    }
                }
            }
            if message.observability_mode {
                return Err(Status::failed_precondition(
                    "ext_proc observability mode cannot route requests; disable it for the \
                     endpoint picker",
                ));
            }
            // Envoy encodes protocol_config in the first message of a stream only.
            if let Some(config) = message.protocol_config {
                self.request_mode = RequestMode::from_wire(config.request_body_mode);
                self.echo_response_body = matches!(
                    BodySendMode::try_from(config.response_body_mode),
                    Ok(BodySendMode::FullDuplexStreamed | BodySendMode::Grpc)
                );
            }
        }
        if let Some(metadata) = &message.metadata_context {
            self.note_metadata(metadata);
        }
        let Some(request) = message.request else {
            // A flow-control-only message: nothing to answer.
            return Ok(StreamNext::Continue);
        };
        match request {
            processing_request::Request::RequestHeaders(headers) => {
                self.on_request_headers(headers).await
            }
            processing_request::Request::RequestBody(body) => self.on_request_body(body).await,
            processing_request::Request::RequestTrailers(_) => self.on_request_trailers().await,
            processing_request::Request::ResponseHeaders(headers) => {
                self.require_routed("response headers")?;
                if let (Some(status), Some(inflight)) =
                    (response_status(headers.headers.as_ref()), &self.inflight)
                {
                    inflight
                        .picker
                        .on_response_status(inflight.request_id, status);
                }
                // a body that is rewritten may change length; asked once, here, so the body's
                // chunks go to the picker only when it rewrites them
                let rewrites = self.echo_response_body
                    && self
                        .inflight
                        .as_ref()
                        .is_some_and(|i| i.picker.rewrites_response(i.request_id));
                if let Some(i) = self.inflight.as_mut() {
                    i.rewrite_body = rewrites;
                }
                let answer = ProcessingResponse {
                    response: Some(processing_response::Response::ResponseHeaders(
                        HeadersResponse {
                            response: rewrites.then(|| CommonResponse {
                                header_mutation: Some(HeaderMutation {
                                    remove_headers: vec!["content-length".into()],
                                    ..Default::default()
                                }),
                                ..Default::default()
                            }),
                        },
                    )),
                    ..Default::default()
                };
                let flow = self.send(answer).await;
                if headers.end_of_stream {
                    self.inflight = None;
                }
                Ok(flow)
            }
            processing_request::Request::ResponseBody(body) => {
                self.require_routed("a response body")?;
                if let Some(inflight) = self.inflight.as_mut()
                    && !body.body.is_empty()
                {
                    if !std::mem::replace(&mut inflight.body_reported, true) {
                        inflight.picker.on_first_response_body(inflight.request_id);
                    }
                    if inflight.watch_body {
                        inflight.watch_body = inflight
                            .picker
                            .on_response_chunk(inflight.request_id, &body.body);
                    }
                }
                let end = body.end_of_stream;
                // In full-duplex mode the proxy has drained the chunk; what is not sent back
                // is lost. Otherwise an empty answer means CONTINUE with the chunk unchanged.
                let common = self.echo_response_body.then(|| {
                    let chunk = match &self.inflight {
                        Some(i) if i.rewrite_body => {
                            i.picker
                                .rewrite_response_chunk(i.request_id, body.body, end)
                        }
                        _ => body.body,
                    };
                    CommonResponse {
                        body_mutation: Some(streamed_chunk(chunk, end)),
                        ..Default::default()
                    }
                });
                let answer = ProcessingResponse {
                    response: Some(processing_response::Response::ResponseBody(BodyResponse {
                        response: common,
                    })),
                    ..Default::default()
                };
                let flow = self.send(answer).await;
                if end {
                    self.inflight = None;
                }
                Ok(flow)
            }
            processing_request::Request::ResponseTrailers(_) => {
                self.require_routed("response trailers")?;
                let flow = self.send(trailers_answer(false)).await;
                self.inflight = None;
                Ok(flow)
            }
        }
    }

    /// Keeps the latest subset hint until the pick, and reports the served endpoint after it.
    fn note_metadata(&mut self, metadata: &Metadata) {
        match self.phase {
            Phase::Routed => {
                let Some(inflight) = self.inflight.as_mut() else {
                    return;
                };
                if inflight.served_reported {
                    return;
                }
                if let Some(served) = served_endpoint(metadata) {
                    inflight.served_reported = true;
                    inflight
                        .picker
                        .on_response_served(inflight.request_id, served);
                }
            }
            Phase::AwaitingHeaders | Phase::CollectingBody(_) => {
                if let Some(subset) = subset_hint(metadata) {
                    self.subset = Some(subset);
                }
            }
        }
    }

    fn require_routed(&self, what: &str) -> Result<(), Status> {
        match self.phase {
            Phase::Routed => Ok(()),
            Phase::AwaitingHeaders | Phase::CollectingBody(_) => Err(Status::invalid_argument(
                format!("{what} arrived before the request was routed"),
            )),
        }
    }

    async fn on_request_headers(&mut self, headers: HttpHeaders) -> Result<StreamNext, Status> {
        if !matches!(self.phase, Phase::AwaitingHeaders) {
            return Err(Status::invalid_argument(
                "request headers arrived twice on one stream",
            ));
        }
        let head = match parse_request_head(headers.headers.as_ref()) {
            Ok(head) => head,
            Err(refusal) => return Ok(self.refuse(refusal).await),
        };
        let limit = self.shared.limits.max_body_bytes;
        if head
            .content_length
            .is_some_and(|length| length > limit as u64)
        {
            // Refuse before the proxy spends effort sending a body we would refuse anyway.
            return Ok(self.refuse(Refusal::too_large(limit)).await);
        }
        self.dialect = Dialect::of_path(&head.path);
        self.head = Some(head);
        if headers.end_of_stream {
            return self.route(RoutePoint::Headers).await;
        }
        match self.request_mode {
            RequestMode::None => self.route(RoutePoint::Headers).await,
            mode @ (RequestMode::Buffered | RequestMode::BufferedPartial) => {
                // The proxy sends the body only once the headers are answered.
                self.phase = Phase::CollectingBody(mode);
                self.body_deadline =
                    Some(tokio::time::Instant::now() + self.shared.limits.body_timeout);
                Ok(self.send(headers_continue()).await)
            }
            RequestMode::FullDuplex => {
                // The answer waits for the body: the routing goes on the headers answer.
                self.phase = Phase::CollectingBody(RequestMode::FullDuplex);
                self.body_deadline =
                    Some(tokio::time::Instant::now() + self.shared.limits.body_timeout);
                Ok(StreamNext::Continue)
            }
            RequestMode::Unsupported(mode) => Err(Status::failed_precondition(format!(
                "request body mode {} is not supported by the endpoint picker; configure \
                 FULL_DUPLEX_STREAMED or BUFFERED",
                body_mode_name(mode)
            ))),
        }
    }

    async fn on_request_body(&mut self, body: HttpBody) -> Result<StreamNext, Status> {
        let Phase::CollectingBody(mode) = self.phase else {
            return Err(Status::invalid_argument(match self.phase {
                Phase::AwaitingHeaders => "a request body arrived before the request headers",
                _ => "a request body arrived after the request was routed",
            }));
        };
        let limit = self.shared.limits.max_body_bytes;
        if self.body.len().saturating_add(body.body.len()) > limit {
            return Ok(self.refuse(Refusal::too_large(limit)).await);
        }
        if self.body.is_empty() {
            self.body = body.body;
        } else {
            self.body.extend_from_slice(&body.body);
        }
        match mode {
            RequestMode::FullDuplex if body.end_of_stream => {
                self.route(RoutePoint::StreamedBody { trailers: false })
                    .await
            }
            RequestMode::FullDuplex => Ok(StreamNext::Continue),
            RequestMode::BufferedPartial if !body.end_of_stream => {
                // The proxy cut the body at its own buffer limit; a partial prompt cannot be
                // routed (or served) faithfully.
                Ok(self.refuse(Refusal::too_large(limit)).await)
            }
            // In BUFFERED mode the one body message is the whole body, even without
            // end_of_stream (request trailers may follow).
            _ => self.route(RoutePoint::BufferedBody).await,
        }
    }

    async fn on_request_trailers(&mut self) -> Result<StreamNext, Status> {
        match self.phase {
            Phase::AwaitingHeaders => Err(Status::invalid_argument(
                "request trailers arrived before the request headers",
            )),
            // Trailers tell a full-duplex server that the body is complete.
            Phase::CollectingBody(RequestMode::FullDuplex) => {
                self.route(RoutePoint::StreamedBody { trailers: true })
                    .await
            }
            Phase::CollectingBody(_) => Err(Status::failed_precondition(
                "request trailers arrived before the buffered body; the request cannot be \
                 routed",
            )),
            Phase::Routed => Ok(self.send(trailers_answer(true)).await),
        }
    }

    /// Asks the picker and sends the answer shaped for `point`.
    async fn route(&mut self, point: RoutePoint) -> Result<StreamNext, Status> {
        self.body_deadline = None;
        let head = self.head.take().unwrap_or_else(|| RequestHead {
            headers: http::HeaderMap::new(),
            path: String::new(),
            content_length: None,
        });
        let subset = self.subset.take();
        if subset.as_ref().is_some_and(Vec::is_empty) {
            return Ok(self
                .refuse(Refusal::from(PickRejection::NoEndpoint(
                    "the gateway's endpoint subset has no usable endpoint".into(),
                )))
                .await);
        }
        let input = PickInput {
            request_id: self.request_id,
            headers: head.headers,
            path: head.path,
            body: Bytes::from(std::mem::take(&mut self.body)),
            subset: subset.clone(),
        };
        let original_body = input.body.clone();

        let picker = self.shared.picker.clone();
        let mut pick = tokio::spawn(async move { picker.pick(input).await });
        let joined = tokio::select! {
            joined = &mut pick => joined,
            () = self.tx.closed() => {
                pick.abort();
                // The pick may have finished just before the abort: balance its accounting.
                if let Ok(Ok(_)) = pick.await {
                    self.shared.picker.on_response_complete(self.request_id);
                }
                return Ok(StreamNext::Stop);
            }
        };
        let output = match joined {
            Ok(Ok(output)) => output,
            Ok(Err(rejection)) => return Ok(self.refuse(Refusal::from(rejection)).await),
            Err(_) => {
                return Ok(self
                    .refuse(Refusal::internal("the endpoint picker failed"))
                    .await);
            }
        };
        // From here on the picker counts this request as in flight.
        self.inflight = Some(InFlight {
            picker: self.shared.picker.clone(),
            request_id: self.request_id,
            served_reported: false,
            body_reported: false,
            watch_body: true,
            rewrite_body: false,
        });

        let endpoints = within_subset(output.endpoints, subset.as_deref());
        if endpoints.is_empty() {
            let message = if subset.is_some() {
                "no endpoint of the gateway's subset is eligible"
            } else {
                "the endpoint picker chose no endpoint"
            };
            return Ok(self
                .refuse(Refusal::from(PickRejection::NoEndpoint(message.into())))
                .await);
        }
        let destination = endpoints[0].to_string();
        let mut metadata = destination_metadata(
            &endpoints
                .iter()
                .map(SocketAddr::to_string)
                .collect::<Vec<_>>()
                .join(","),
        );
        if !output.decision.is_empty() {
            let fields = output
                .decision
                .iter()
                .map(|(k, v)| {
                    (
                        (*k).to_owned(),
                        Value {
                            kind: Some(Kind::StringValue(v.clone())),
                        },
                    )
                })
                .collect();
            metadata.fields.insert(
                DECISION_METADATA_NAMESPACE.to_owned(),
                Value {
                    kind: Some(Kind::StructValue(Struct { fields })),
                },
            );
        }
        self.phase = Phase::Routed;

        match point {
            RoutePoint::Headers => {
                let mutation = routing_headers(&destination, &output.set_headers, None);
                Ok(self.send(headers_answer(mutation, metadata)).await)
            }
            RoutePoint::BufferedBody => {
                // Envoy applies header mutations of a body answer in BUFFERED mode, and leaves
                // content-length to us when the body is replaced.
                let content_length = output.new_body.as_ref().map(Bytes::len);
                let mutation = routing_headers(&destination, &output.set_headers, content_length);
                let answer = ProcessingResponse {
                    response: Some(processing_response::Response::RequestBody(BodyResponse {
                        response: Some(CommonResponse {
                            header_mutation: Some(mutation),
                            body_mutation: output.new_body.map(|body| BodyMutation {
                                mutation: Some(body_mutation::Mutation::Body(body.to_vec())),
                            }),
                            clear_route_cache: true,
                            ..Default::default()
                        }),
                    })),
                    dynamic_metadata: Some(metadata),
                    ..Default::default()
                };
                Ok(self.send(answer).await)
            }
            RoutePoint::StreamedBody { trailers } => {
                let body = output.new_body.unwrap_or(original_body);
                let content_length = (!body.is_empty()).then_some(body.len());
                let mutation = routing_headers(&destination, &output.set_headers, content_length);
                if let StreamNext::Stop = self.send(headers_answer(mutation, metadata)).await {
                    return Ok(StreamNext::Stop);
                }
                for answer in streamed_body_answers(&body, !trailers) {
                    if let StreamNext::Stop = self.send(answer).await {
                        return Ok(StreamNext::Stop);
                    }
                }
                if trailers {
                    return Ok(self.send(trailers_answer(true)).await);
                }
                Ok(StreamNext::Continue)
            }
        }
    }

    /// Sends an immediate response; the stream ends after it.
    async fn refuse(&mut self, refusal: Refusal) -> StreamNext {
        let _ = self.send(refusal.into_response(self.dialect)).await;
        StreamNext::Stop
    }

    async fn send(&self, response: ProcessingResponse) -> StreamNext {
        match self.tx.send(Ok(response)).await {
            Ok(()) => StreamNext::Continue,
            Err(_) => StreamNext::Stop,
        }
    }
}

/// Reads the head of a request off Envoy's header list (values in `raw_value`, or `value` from
/// older proxies).
fn parse_request_head(headers: Option<&ProtoHeaderMap>) -> Result<RequestHead, Refusal> {
    let mut head = RequestHead {
        headers: http::HeaderMap::new(),
        path: String::new(),
        content_length: None,
    };
    let mut authority = None;
    for header in headers.map(|h| h.headers.as_slice()).unwrap_or_default() {
        let raw: &[u8] = if header.raw_value.is_empty() {
            header.value.as_bytes()
        } else {
            &header.raw_value
        };
        match header.key.as_str() {
            ":path" => {
                head.path = String::from_utf8(raw.to_vec()).map_err(|_| {
                    Refusal::bad_request("the request path is not valid UTF-8".into())
                })?;
            }
            ":authority" => authority = HeaderValue::from_bytes(raw).ok(),
            key if key.starts_with(':') => {}
            key => {
                // A header the http crate cannot hold would not reach an engine intact either.
                let (Ok(name), Ok(value)) = (
                    HeaderName::from_bytes(key.as_bytes()),
                    HeaderValue::from_bytes(raw),
                ) else {
                    continue;
                };
                if name == http::header::CONTENT_LENGTH {
                    let length = std::str::from_utf8(raw)
                        .ok()
                        .and_then(|text| text.trim().parse::<u64>().ok())
                        .ok_or_else(|| {
                            Refusal::bad_request("the content-length header is not a number".into())
                        })?;
                    head.content_length = Some(length);
                }
                head.headers.append(name, value);
            }
        }
    }
    if let Some(authority) = authority
        && !head.headers.contains_key(http::header::HOST)
    {
        head.headers.insert(http::header::HOST, authority);
    }
    Ok(head)
}

/// The `:status` of a response head, when the proxy sent one.
fn response_status(headers: Option<&ProtoHeaderMap>) -> Option<u16> {
    let header = headers?.headers.iter().find(|h| h.key == ":status")?;
    let raw: &[u8] = if header.raw_value.is_empty() {
        header.value.as_bytes()
    } else {
        &header.raw_value
    };
    std::str::from_utf8(raw).ok()?.trim().parse().ok()
}

/// The candidate list in `filter_metadata["envoy.lb.subset_hint"]`, if the proxy sent one.
/// Unparseable entries are dropped, so a list of only bad entries counts as empty (→ 503).
fn subset_hint(metadata: &Metadata) -> Option<Vec<SocketAddr>> {
    let value = metadata
        .filter_metadata
        .get(SUBSET_HINT_NAMESPACE)?
        .fields
        .get(SUBSET_HINT_KEY)?;
    let mut subset = Vec::new();
    match &value.kind {
        Some(Kind::ListValue(list)) => {
            for item in &list.values {
                if let Some(Kind::StringValue(text)) = &item.kind {
                    subset.extend(text.split(',').filter_map(parse_endpoint));
                }
            }
        }
        // Not the protocol's shape, but unambiguous: a comma-separated string.
        Some(Kind::StringValue(text)) => {
            subset.extend(text.split(',').filter_map(parse_endpoint));
        }
        _ => {}
    }
    Some(subset)
}

/// The endpoint the proxy reports as having served the response.
fn served_endpoint(metadata: &Metadata) -> Option<SocketAddr> {
    let value = metadata
        .filter_metadata
        .get(DESTINATION_METADATA_NAMESPACE)?
        .fields
        .get(SERVED_ENDPOINT_KEY)?;
    match &value.kind {
        Some(Kind::StringValue(text)) => text.split(',').next().and_then(parse_endpoint),
        _ => None,
    }
}

/// `ip:port`, `[v6]:port`, or a bare IP (port 0 = any port).
fn parse_endpoint(text: &str) -> Option<SocketAddr> {
    let text = text.trim();
    text.parse::<SocketAddr>()
        .ok()
        .or_else(|| text.parse::<IpAddr>().ok().map(|ip| SocketAddr::new(ip, 0)))
}

/// Keeps the endpoints the proxy allowed, by the same rule the router filters with.
fn within_subset(endpoints: Vec<SocketAddr>, subset: Option<&[SocketAddr]>) -> Vec<SocketAddr> {
    match subset {
        None => endpoints,
        Some(allowed) => endpoints
            .into_iter()
            .filter(|endpoint| crate::router::subset_allows(allowed, *endpoint))
            .collect(),
    }
}

fn set_header(name: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(ProtoHeaderValue {
            key: name.to_string(),
            raw_value: value.as_bytes().to_vec(),
            ..Default::default()
        }),
        // `append` defaults to false (overwrite) in ext_proc mutations; the explicit action keeps
        // a client-supplied destination header from surviving next to ours on proxies that
        // honour `append_action`.
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

/// The request header mutation of a routing answer.
fn routing_headers(
    destination: &str,
    extra: &[(String, String)],
    content_length: Option<usize>,
) -> HeaderMutation {
    let mut set_headers = vec![set_header(DESTINATION_ENDPOINT_HEADER, destination)];
    if let Some(length) = content_length {
        set_headers.push(set_header("content-length", &length.to_string()));
    }
    for (name, value) in extra {
        let Ok(header_name) = HeaderName::from_bytes(name.as_bytes()) else {
            continue;
        };
        if HeaderValue::from_str(value).is_err()
            || header_name == http::header::CONTENT_LENGTH
            || header_name.as_str() == DESTINATION_ENDPOINT_HEADER
        {
            continue;
        }
        set_headers.push(set_header(header_name.as_str(), value));
    }
    // a prefill endpoint is the picker's to name, never the client's
    let remove_headers = if extra
        .iter()
        .any(|(n, _)| n.eq_ignore_ascii_case(PREFILLER_HOST_PORT_HEADER))
    {
        Vec::new()
    } else {
        vec![PREFILLER_HOST_PORT_HEADER.into()]
    };
    HeaderMutation {
        set_headers,
        remove_headers,
    }
}

/// `{"envoy.lb": {"x-gateway-destination-endpoint": endpoints}}`, the comma-separated list.
fn destination_metadata(endpoints: &str) -> Struct {
    let inner = Struct {
        fields: HashMap::from([(
            DESTINATION_METADATA_KEY.to_string(),
            Value {
                kind: Some(Kind::StringValue(endpoints.to_string())),
            },
        )]),
    };
    Struct {
        fields: HashMap::from([(
            DESTINATION_METADATA_NAMESPACE.to_string(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]),
    }
}

fn headers_continue() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::RequestHeaders(
            HeadersResponse::default(),
        )),
        ..Default::default()
    }
}

/// The routing answer on the request headers. `clear_route_cache` makes Envoy re-match routes
/// that select on the destination header.
fn headers_answer(mutation: HeaderMutation, metadata: Struct) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::RequestHeaders(
            HeadersResponse {
                response: Some(CommonResponse {
                    header_mutation: Some(mutation),
                    clear_route_cache: true,
                    ..Default::default()
                }),
            },
        )),
        dynamic_metadata: Some(metadata),
        ..Default::default()
    }
}

fn trailers_answer(request: bool) -> ProcessingResponse {
    let answer = TrailersResponse::default();
    ProcessingResponse {
        response: Some(if request {
            processing_response::Response::RequestTrailers(answer)
        } else {
            processing_response::Response::ResponseTrailers(answer)
        }),
        ..Default::default()
    }
}

fn streamed_chunk(body: Vec<u8>, end_of_stream: bool) -> BodyMutation {
    BodyMutation {
        mutation: Some(body_mutation::Mutation::StreamedResponse(
            StreamedBodyResponse {
                body,
                end_of_stream,
                ..Default::default()
            },
        )),
    }
}

/// The request body sent back in full-duplex mode, in chunks of at most
/// [`STREAMED_CHUNK_BYTES`]; the last one carries `end_of_stream` unless trailers follow.
fn streamed_body_answers(body: &[u8], end_of_stream: bool) -> Vec<ProcessingResponse> {
    let wrap = |chunk: &[u8], last: bool| ProcessingResponse {
        response: Some(processing_response::Response::RequestBody(BodyResponse {
            response: Some(CommonResponse {
                body_mutation: Some(streamed_chunk(chunk.to_vec(), last && end_of_stream)),
                ..Default::default()
            }),
        })),
        ..Default::default()
    };
    if body.is_empty() {
        return vec![wrap(&[], true)];
    }
    let count = body.len().div_ceil(STREAMED_CHUNK_BYTES);
    body.chunks(STREAMED_CHUNK_BYTES)
        .enumerate()
        .map(|(index, chunk)| wrap(chunk, index + 1 == count))
        .collect()
}

fn body_mode_name(mode: i32) -> String {
    BodySendMode::try_from(mode)
        .map(|known| known.as_str_name().to_string())
        .unwrap_or_else(|_| format!("#{mode}"))
}

/// An HTTP error sent to the client through an `ImmediateResponse`, in the envelope of the
/// request's API (the same vocabulary as the picker's HTTP API).
struct Refusal {
    status: u16,
    kind: &'static str,
    code: &'static str,
    message: String,
    retry_after: bool,
}

impl Refusal {
    fn bad_request(message: String) -> Self {
        Self {
            status: 400,
            kind: "invalid_request_error",
            code: "bad_request",
            message,
            retry_after: false,
        }
    }

    fn too_large(limit: usize) -> Self {
        Self {
            status: 413,
            kind: "invalid_request_error",
            code: "body_too_large",
            message: format!("request body exceeds the limit of {limit} bytes"),
            retry_after: false,
        }
    }

    fn body_timeout(limit: std::time::Duration) -> Self {
        Self {
            status: 408,
            kind: "invalid_request_error",
            code: "body_timeout",
            message: format!("the request body did not arrive within {limit:?}"),
            retry_after: false,
        }
    }

    fn overloaded(message: String) -> Self {
        Self {
            status: 503,
            kind: "service_unavailable",
            code: "picker_overloaded",
            message,
            retry_after: true,
        }
    }

    fn internal(message: &str) -> Self {
        Self {
            status: 500,
            kind: "internal_error",
            code: "picker_failed",
            message: message.to_string(),
            retry_after: false,
        }
    }

    fn into_response(self, dialect: Dialect) -> ProcessingResponse {
        let body = envelope(dialect, self.status, self.kind, self.code, &self.message);
        let mut set_headers = vec![set_header("content-type", "application/json")];
        if self.retry_after {
            set_headers.push(set_header("retry-after", "1"));
            set_headers.push(set_header("x-kvroute-reason", self.code));
        }
        ProcessingResponse {
            response: Some(processing_response::Response::ImmediateResponse(
                ImmediateResponse {
                    status: Some(HttpStatus {
                        code: i32::from(self.status),
                    }),
                    headers: Some(HeaderMutation {
                        set_headers,
                        remove_headers: Vec::new(),
                    }),
                    body: body.to_string().into_bytes(),
                    grpc_status: None,
                    // Shows in Envoy's %RESPONSE_CODE_DETAILS%; no spaces allowed there.
                    details: format!("endpoint_picker_{}", self.code),
                },
            )),
            ..Default::default()
        }
    }
}

impl From<PickRejection> for Refusal {
    fn from(rejection: PickRejection) -> Self {
        match rejection {
            PickRejection::BadRequest(message) => Self::bad_request(message),
            PickRejection::UnknownModel(message) => Self {
                status: 404,
                kind: "invalid_request_error",
                code: "model_not_found",
                message,
                retry_after: false,
            },
            PickRejection::Shed(message) => Self {
                status: 429,
                kind: "rate_limit_error",
                code: "overloaded",
                message,
                retry_after: true,
            },
            PickRejection::ShedBecause(code, message) => Self {
                status: 429,
                kind: "rate_limit_error",
                code,
                message,
                retry_after: true,
            },
            PickRejection::NoEndpoint(message) => Self {
                status: 503,
                kind: "service_unavailable",
                code: "no_endpoint",
                message,
                retry_after: true,
            },
        }
    }
}

/// Sets the readiness reported by [`health_service`].
#[derive(Debug, Clone)]
pub struct HealthHandle {
    reporter: HealthReporter,
}

impl HealthHandle {
    /// Reports `readiness` and the ext_proc service as `SERVING` or `NOT_SERVING` (the
    /// protocol gives both the same criteria: synced and, with leader election, leading).
    /// Liveness stays `SERVING`.
    pub async fn set_ready(&self, ready: bool) {
        let status = if ready {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        self.reporter
            .set_service_status(READINESS_SERVICE, status)
            .await;
        self.reporter
            .set_service_status(EXT_PROC_SERVICE, status)
            .await;
    }
}

/// The gRPC health service (`grpc.health.v1.Health`) of the endpoint picker, answering for
/// `liveness`, `readiness` and `envoy.service.ext_proc.v3.ExternalProcessor`, plus the overall
/// server (`""`). Readiness starts as `ready` and is changed through the handle.
pub async fn health_service(ready: bool) -> (HealthHandle, HealthServer<HealthService>) {
    let reporter = HealthReporter::new();
    reporter
        .set_service_status(LIVENESS_SERVICE, ServingStatus::Serving)
        .await;
    let handle = HealthHandle {
        reporter: reporter.clone(),
    };
    handle.set_ready(ready).await;
    let server = HealthServer::new(HealthService::from_health_reporter(reporter));
    (handle, server)
}
