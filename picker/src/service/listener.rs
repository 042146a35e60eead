//! Accept loops with the bounds `axum::serve` and tonic do not expose: concurrent connections,
//! request-head size and the time a client may take to start and to send its head. Every
//! listener of the picker (proxy, admin, metrics, ext_proc) runs behind them.
//!
//! Past `max_connections` a new HTTP connection is still accepted, answered with one
//! OpenAI-style 503 (`too_many_connections`) as soon as its request starts (clients do not
//! read an answer that comes before their request) and closed, so the client learns why
//! instead of waiting in the kernel's backlog; a gRPC connection is closed. Refusing is
//! bounded apart from the cap: at most [`REFUSED_LINGERING`] refused connections are kept open
//! at once, each for at most [`REFUSED_LINGER`] to start its request and as long again to be
//! closed cleanly; one that stays silent, or comes while that many are open, is closed at once
//! without an answer. So silent connections past the cap cannot use up the open files. A head larger than
//! `max_header_bytes` gets hyper's 431. A connection that sends nothing within
//! `header_read_timeout` is closed (`kvroute_picker_errors_total{kind="silent_connection"}`):
//! hyper's own head timer starts only once it has read enough to tell HTTP/1 from HTTP/2, so
//! without this a socket that connects and stays silent would hold its slot forever.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use super::errors::ApiError;
use super::state::PickerState;

/// Connection-level bounds of one listener.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    pub max_connections: usize,
    /// Largest request head (request line and headers), in bytes; at least 8 KiB.
    pub max_header_bytes: usize,
    /// Time a client has to send a complete request head.
    pub header_read_timeout: Duration,
}

/// Serve `app` on `listener` until `cancel`, then let open connections finish their
/// in-flight requests (up to `drain`).
pub async fn serve_bounded(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    picker: Option<Arc<PickerState>>,
    cancel: CancellationToken,
    drain: Duration,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(limits.max_header_bytes.max(8192));
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX))
        // a peer that stops answering pings is gone: free its slot
        .keep_alive_interval(Some(H2_KEEPALIVE))
        .keep_alive_timeout(H2_KEEPALIVE);
    let builder = Arc::new(builder);
    let refusal = Arc::<[u8]>::from(too_many_connections_response());
    let lingering = Arc::new(Semaphore::new(REFUSED_LINGERING));
    loop {
        let Some((stream, peer)) = accept(&listener, &cancel).await else {
            break;
        };
        let _ = stream.set_nodelay(true);
        let permit = slots.clone().try_acquire_owned();
        let Ok(permit) = permit else {
            if let Some(c) = &picker {
                c.metrics.error("too_many_connections");
            }
            tracing::debug!(%peer, "connection refused: too many connections");
            refuse_now(stream, &refusal, &lingering);
            continue;
        };
        let svc = hyper::service::service_fn({
            let app = app.clone();
            move |req: hyper::Request<Incoming>| app.clone().oneshot(req.map(axum::body::Body::new))
        });
        let builder = builder.clone();
        let watcher = graceful.watcher();
        let picker = picker.clone();
        tokio::spawn(async move {
            if !speaks_within(&stream, limits.header_read_timeout, picker.as_deref(), peer).await {
                return;
            }
            let conn = builder
                .serve_connection_with_upgrades(TokioIo::new(stream), svc)
                .into_owned();
            if let Err(e) = watcher.watch(conn).await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
            drop(permit);
        });
    }
    drop(listener);
    let _ = tokio::time::timeout(drain, graceful.shutdown()).await;
}

/// Refused connections kept open at once to close them cleanly.
pub const REFUSED_LINGERING: usize = 64;
/// How long a refused connection is kept open to read what its client sent.
pub const REFUSED_LINGER: Duration = Duration::from_secs(1);

/// The whole HTTP/1.1 answer to a connection past the cap.
fn too_many_connections_response() -> Vec<u8> {
    let error = ApiError::unavailable(
        "too_many_connections",
        "the picker has too many open connections; retry later",
    );
    let body = serde_json::to_vec(&error.body()).unwrap_or_default();
    let mut out = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         retry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    out
}

/// Answer a connection past the cap once its request starts, then close it (see the module
/// docs); closed at once when [`REFUSED_LINGERING`] refused connections are open already.
fn refuse_now(stream: TcpStream, answer: &Arc<[u8]>, lingering: &Arc<Semaphore>) {
    let Ok(slot) = lingering.clone().try_acquire_owned() else {
        return;
    };
    let answer = answer.clone();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = stream;
        if !first_bytes_within(&stream, REFUSED_LINGER).await {
            return;
        }
        let _ = tokio::time::timeout(REFUSED_LINGER, async {
            stream.write_all(&answer).await?;
            stream.shutdown().await?;
            // read what the client sent, so that closing does not reset the answer away
            let mut sink = [0u8; 4096];
            while stream.read(&mut sink).await? > 0 {}
            Ok::<(), std::io::Error>(())
        })
        .await;
        drop(slot);
    });
}

/// Ping interval and answer timeout on HTTP/2 connections.
const H2_KEEPALIVE: Duration = Duration::from_secs(20);

/// The next connection; `None` once cancelled. A failed accept (EMFILE and friends) backs off
/// instead of spinning.
async fn accept(
    listener: &TcpListener,
    cancel: &CancellationToken,
) -> Option<(TcpStream, SocketAddr)> {
    loop {
        tokio::select! {
            () = cancel.cancelled() => return None,
            r = listener.accept() => match r {
                Ok(s) => return Some(s),
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
}

/// Whether the peer sends its first bytes within `timeout` (false also when it closes first).
async fn first_bytes_within(stream: &TcpStream, timeout: Duration) -> bool {
    let mut probe = [0u8; 1];
    matches!(
        tokio::time::timeout(timeout, stream.peek(&mut probe)).await,
        Ok(Ok(n)) if n > 0
    )
}

/// [`first_bytes_within`], and a connection that stays silent counted and logged as closed.
async fn speaks_within(
    stream: &TcpStream,
    timeout: Duration,
    picker: Option<&PickerState>,
    peer: SocketAddr,
) -> bool {
    if first_bytes_within(stream, timeout).await {
        return true;
    }
    if let Some(p) = picker {
        p.metrics.error("silent_connection");
    }
    tracing::debug!(%peer, "connection closed: it sent nothing");
    false
}

/// A connection holding one of its listener's connection slots until it is dropped.
#[derive(Debug)]
pub struct Bounded<T> {
    io: T,
    _slot: OwnedSemaphorePermit,
}

impl<T: AsyncRead + Unpin> AsyncRead for Bounded<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Bounded<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl<T: tonic::transport::server::Connected> tonic::transport::server::Connected for Bounded<T> {
    type ConnectInfo = T::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

/// The connections of a gRPC listener, bounded like [`serve_bounded`]'s: at most
/// `max_connections` open (further ones are closed at once), and each handed to the server only
/// once it has sent its first bytes within `header_read_timeout`. The stream ends on `cancel`.
pub fn bounded_incoming(
    listener: TcpListener,
    limits: ConnLimits,
    picker: Option<Arc<PickerState>>,
    cancel: CancellationToken,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<Bounded<TcpStream>>> {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let (tx, rx) = mpsc::channel(limits.max_connections.clamp(1, 1024));
    tokio::spawn(async move {
        loop {
            let Some((stream, peer)) = accept(&listener, &cancel).await else {
                return;
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                if let Some(c) = &picker {
                    c.metrics.error("too_many_connections");
                }
                tracing::debug!(%peer, "connection refused: too many connections");
                continue;
            };
            let _ = stream.set_nodelay(true);
            let tx = tx.clone();
            let picker = picker.clone();
            tokio::spawn(async move {
                if !speaks_within(&stream, limits.header_read_timeout, picker.as_deref(), peer)
                    .await
                {
                    return;
                }
                let _ = tx
                    .send(Ok(Bounded {
                        io: stream,
                        _slot: slot,
                    }))
                    .await;
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}
