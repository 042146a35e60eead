//! A frame-checking relay between the `zeromq` crate and an engine's KV event sockets.
//!
//! The `zeromq` crate (0.7) has no maximum message size: its codec reserves whatever length a
//! frame header announces before reading the frame, so a publisher (or anything that answers
//! on its port) announcing a frame of 2^60 bytes makes the allocation fail and aborts the
//! picker. libzmq has `ZMQ_MAXMSGSIZE` for this; the crate does not, and no maintained pure-Rust
//! ZMQ implementation offers one either (the `zmq` crate binds libzmq through C, which this
//! workspace avoids).
//!
//! So each subscription connects to a relay on loopback instead of the engine. The relay
//! forwards bytes both ways unchanged, but parses the ZMTP 3 framing of what the engine sends
//! (the 64-byte greeting, then `flags, size, body` frames, commands included) and drops both
//! connections the moment a frame announces more than `max_frame` bytes or breaks the
//! framing. The subscriber sees an ordinary disconnect and reconnects with backoff.
//! What the picker sends (subscriptions, replay requests) is copied through unchecked.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// Length of a ZMTP 3 greeting.
const GREETING_LEN: usize = 64;
const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;

/// Why the relay cut a connection.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameViolation {
    #[error("not a ZMTP 3 greeting")]
    BadGreeting,
    #[error("reserved frame flag bits set: {0:#04x}")]
    BadFlags(u8),
    #[error("frame of {size} bytes exceeds the limit of {limit}")]
    TooLarge { size: u64, limit: u64 },
}

/// Checks the ZMTP stream a peer sends, incrementally: feed it bytes as they arrive.
#[derive(Debug, Clone)]
pub struct FrameChecker {
    limit: u64,
    state: State,
}

#[derive(Debug, Clone)]
enum State {
    Greeting {
        seen: usize,
    },
    Flags,
    Size {
        long: bool,
        buf: [u8; 8],
        have: usize,
    },
    Body {
        left: u64,
    },
}

impl FrameChecker {
    pub fn new(limit: u64) -> Self {
        Self {
            limit,
            state: State::Greeting { seen: 0 },
        }
    }

    /// Check `bytes`, the next part of the stream. An error means the peer must be cut off.
    pub fn feed(&mut self, mut bytes: &[u8]) -> Result<(), FrameViolation> {
        while !bytes.is_empty() {
            match &mut self.state {
                State::Greeting { seen } => {
                    let take = (GREETING_LEN - *seen).min(bytes.len());
                    for (i, &b) in bytes.iter().take(take).enumerate() {
                        let at = *seen + i;
                        // signature 0xFF, 8 bytes of padding, 0x7F; then version major >= 3
                        let ok = match at {
                            0 => b == 0xFF,
                            9 => b == 0x7F,
                            10 => b >= 3,
                            _ => true,
                        };
                        if !ok {
                            return Err(FrameViolation::BadGreeting);
                        }
                    }
                    *seen += take;
                    bytes = &bytes[take..];
                    if *seen == GREETING_LEN {
                        self.state = State::Flags;
                    }
                }
                State::Flags => {
                    let flags = bytes[0];
                    bytes = &bytes[1..];
                    if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 {
                        return Err(FrameViolation::BadFlags(flags));
                    }
                    self.state = State::Size {
                        long: flags & FLAG_LONG != 0,
                        buf: [0; 8],
                        have: 0,
                    };
                }
                State::Size { long, buf, have } => {
                    let need = if *long { 8 } else { 1 };
                    let take = (need - *have).min(bytes.len());
                    buf[*have..*have + take].copy_from_slice(&bytes[..take]);
                    *have += take;
                    bytes = &bytes[take..];
                    if *have == need {
                        let size = if *long {
                            u64::from_be_bytes(*buf)
                        } else {
                            u64::from(buf[0])
                        };
                        if size > self.limit {
                            return Err(FrameViolation::TooLarge {
                                size,
                                limit: self.limit,
                            });
                        }
                        self.state = if size == 0 {
                            State::Flags
                        } else {
                            State::Body { left: size }
                        };
                    }
                }
                State::Body { left } => {
                    let take = (*left).min(bytes.len() as u64);
                    *left -= take;
                    bytes = &bytes[take as usize..];
                    if *left == 0 {
                        self.state = State::Flags;
                    }
                }
            }
        }
        Ok(())
    }
}

/// A relay listening on loopback for one upstream ZMQ endpoint.
#[derive(Debug)]
pub struct ZmtpGuard {
    /// `tcp://127.0.0.1:port`: connect the `zeromq` socket here.
    pub endpoint: String,
    pub local: SocketAddr,
}

/// Start a relay to `upstream` (`host:port` or `tcp://host:port`) that cuts connections whose
/// frames exceed `max_frame` bytes. It stops when `cancel` fires.
pub async fn spawn_guard(
    upstream: &str,
    max_frame: u64,
    connect_timeout: Duration,
    cancel: CancellationToken,
) -> io::Result<ZmtpGuard> {
    let upstream = upstream
        .strip_prefix("tcp://")
        .unwrap_or(upstream)
        .to_owned();
    let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
    let local = listener.local_addr()?;
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                () = cancel.cancelled() => return,
                r = listener.accept() => r,
            };
            let Ok((client, _)) = accepted else {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            };
            let upstream = upstream.clone();
            let cancel = cancel.clone();
            tokio::spawn(async move {
                let server = match tokio::time::timeout(
                    connect_timeout,
                    TcpStream::connect(&upstream),
                )
                .await
                {
                    Ok(Ok(s)) => s,
                    // dropping the client shows the subscriber a failed connection
                    _ => return,
                };
                let _ = server.set_nodelay(true);
                let _ = client.set_nodelay(true);
                tokio::select! {
                    () = cancel.cancelled() => {}
                    r = relay(client, server, max_frame) => {
                        if let Err(e) = r {
                            tracing::warn!(%upstream, error = %e, "KV event connection cut by the frame guard");
                        }
                    }
                }
            });
        }
    });
    Ok(ZmtpGuard {
        endpoint: format!("tcp://{local}"),
        local,
    })
}

/// Relay until either side closes; an error when the upstream broke the framing rules.
async fn relay(client: TcpStream, server: TcpStream, max_frame: u64) -> io::Result<()> {
    let (mut client_r, mut client_w) = client.into_split();
    let (mut server_r, mut server_w) = server.into_split();
    let outbound = async {
        let _ = tokio::io::copy(&mut client_r, &mut server_w).await;
        let _ = server_w.shutdown().await;
        Ok::<(), io::Error>(())
    };
    let inbound = checked_copy(&mut server_r, &mut client_w, FrameChecker::new(max_frame));
    // whichever ends first ends the relay: a closed side or a violation
    tokio::select! {
        r = outbound => r,
        r = inbound => r,
    }
}

async fn checked_copy<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    from: &mut R,
    to: &mut W,
    mut checker: FrameChecker,
) -> io::Result<()> {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = from.read(&mut buf).await?;
        if n == 0 {
            let _ = to.shutdown().await;
            return Ok(());
        }
        checker
            .feed(&buf[..n])
            .map_err(|v| io::Error::new(io::ErrorKind::InvalidData, v))?;
        to.write_all(&buf[..n]).await?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn greeting() -> Vec<u8> {
        let mut g = vec![0u8; GREETING_LEN];
        g[0] = 0xFF;
        g[9] = 0x7F;
        g[10] = 3;
        g[12..16].copy_from_slice(b"NULL");
        g
    }

    #[test]
    fn well_formed_streams_pass_in_any_split() {
        let mut stream = greeting();
        // a READY command, a short frame with MORE, a long frame
        stream.extend([FLAG_COMMAND, 3, b'a', b'b', b'c']);
        stream.extend([FLAG_MORE, 2, 1, 2]);
        stream.push(FLAG_LONG);
        stream.extend(300u64.to_be_bytes());
        stream.extend(std::iter::repeat_n(7u8, 300));
        for chunk in [1, 2, 7, 64, 1000] {
            let mut c = FrameChecker::new(1024);
            for part in stream.chunks(chunk) {
                c.feed(part).expect("valid");
            }
            assert!(matches!(c.state, State::Flags), "chunk {chunk}");
        }
    }

    #[test]
    fn huge_frames_bad_flags_and_bad_greetings_are_violations() {
        let mut c = FrameChecker::new(1024);
        c.feed(&greeting()).expect("greeting");
        let mut huge = vec![FLAG_LONG];
        huge.extend((1u64 << 60).to_be_bytes());
        assert_eq!(
            c.feed(&huge),
            Err(FrameViolation::TooLarge {
                size: 1 << 60,
                limit: 1024
            })
        );
        let mut c = FrameChecker::new(1024);
        c.feed(&greeting()).expect("greeting");
        assert_eq!(c.feed(&[0x80]), Err(FrameViolation::BadFlags(0x80)));
        let mut c = FrameChecker::new(1024);
        assert_eq!(c.feed(b"HTTP/1.1 200 OK"), Err(FrameViolation::BadGreeting));
    }

    /// A hostile "publisher" that greets properly and then announces a 2^60-byte frame:
    /// through the guard, the real `zeromq` SUB socket sees a disconnect, and the process
    /// survives (without the guard the crate would try to allocate the frame and abort).
    #[tokio::test]
    async fn the_guard_cuts_a_publisher_announcing_a_huge_frame() {
        use zeromq::{Socket, SocketRecv};
        let hostile = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = hostile.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((mut s, _)) = hostile.accept().await {
                tokio::spawn(async move {
                    let mut g = greeting();
                    g[32] = 1; // as-server
                    let _ = s.write_all(&g).await;
                    // READY with Socket-Type PUB
                    let mut ready = vec![5u8];
                    ready.extend(b"READY");
                    ready.push(11);
                    ready.extend(b"Socket-Type");
                    ready.extend(3u32.to_be_bytes());
                    ready.extend(b"PUB");
                    let _ = s.write_all(&[FLAG_COMMAND, ready.len() as u8]).await;
                    let _ = s.write_all(&ready).await;
                    let mut huge = vec![FLAG_LONG];
                    huge.extend((1u64 << 60).to_be_bytes());
                    let _ = s.write_all(&huge).await;
                    let mut sink = [0u8; 1024];
                    while let Ok(n) = s.read(&mut sink).await {
                        if n == 0 {
                            break;
                        }
                    }
                });
            }
        });
        let cancel = CancellationToken::new();
        let guard = spawn_guard(
            &format!("tcp://{addr}"),
            1 << 20,
            Duration::from_secs(2),
            cancel.clone(),
        )
        .await
        .expect("guard");
        let mut sub = zeromq::SubSocket::new();
        let connected =
            tokio::time::timeout(Duration::from_secs(5), sub.connect(&guard.endpoint)).await;
        if let Ok(Ok(())) = connected {
            let _ = sub.subscribe("").await;
            // nothing arrives: the connection was cut before the frame's body
            let got = tokio::time::timeout(Duration::from_millis(500), sub.recv()).await;
            assert!(!matches!(got, Ok(Ok(_))), "no message may come through");
        }
        cancel.cancel();
    }
}
