//! ZMQ message frames around a payload: `(topic, sequence, payload)` on the PUB socket, the
//! replay socket's frames, the replay end marker, and the topic's epoch suffix.

use super::decode::decode_event_batch;
use super::{DecodeError, DecodeLimits, EventBatch, REPLAY_END_SEQ, Result};

/// Decodes one ZMQ message: frames `(topic, sequence, payload)` as the PUB socket sends them
/// (and as a DEALER replay client receives them, with the empty delimiter in the topic slot).
///
/// Returns the topic (borrowed), the sequence number and the batch. The replay end marker is
/// reported as [`DecodeError::ReplayEndMarker`]; test with [`is_replay_end`] first.
///
/// # Errors
///
/// [`DecodeError::WrongFrameCount`], [`DecodeError::BadSequenceFrame`],
/// [`DecodeError::ReplayEndMarker`], or any payload error of [`decode_event_batch`].
pub fn decode_message<'a>(
    frames: &[&'a [u8]],
    limits: &DecodeLimits,
) -> Result<(&'a [u8], u64, EventBatch)> {
    let &[topic, seq, payload] = frames else {
        return Err(DecodeError::WrongFrameCount { got: frames.len() });
    };
    let seq = parse_seq(seq)?;
    if seq == REPLAY_END_SEQ && payload.is_empty() {
        return Err(DecodeError::ReplayEndMarker);
    }
    let batch = decode_event_batch(payload, limits)?;
    Ok((topic, seq, batch))
}

/// Decodes one replay reply, in any of the framings of [`replay_frames`]. Returns the topic
/// (empty when the reply has none), the sequence number and the batch.
///
/// # Errors
///
/// As [`decode_message`].
pub fn decode_replay_message<'a>(
    frames: &[&'a [u8]],
    limits: &DecodeLimits,
) -> Result<(&'a [u8], u64, EventBatch)> {
    let (topic, seq, payload) = replay_frames(frames)?;
    decode_message(&[topic, seq, payload], limits)
}

/// Splits one replay reply into `(topic, sequence, payload)`, whichever publisher sent it.
///
/// The publisher's ROUTER prefixes every reply with the client's identity and an empty
/// delimiter; the identity never reaches the client, the delimiter does unless the client is
/// a REQ socket. What follows changed across releases (checked against a real vLLM 0.32):
///
/// | publisher | reply (after the identity) | a DEALER receives | a REQ receives |
/// |---|---|---|---|
/// | vLLM 0.32 | `("", topic, seq, payload)`, end `("", "", -1, "")` | 4 frames | 3 frames |
/// | older vLLM, SGLang | `("", seq, payload)`, end `("", -1, "")` | 3 frames | 2 frames |
///
/// So four frames are the delimiter, the topic, the number and the payload; three are
/// `(delimiter or topic, seq, payload)`, read like a live message; two are `(seq, payload)`
/// without a topic.
///
/// # Errors
///
/// [`DecodeError::WrongFrameCount`] for any other count, or four frames whose first (the
/// delimiter) is not empty.
pub fn replay_frames<'a>(frames: &[&'a [u8]]) -> Result<(&'a [u8], &'a [u8], &'a [u8])> {
    match *frames {
        // the empty delimiter first
        [[], topic, seq, payload] => Ok((topic, seq, payload)),
        [topic, seq, payload] => Ok((topic, seq, payload)),
        [seq, payload] => Ok((&[], seq, payload)),
        _ => Err(DecodeError::WrongFrameCount { got: frames.len() }),
    }
}

/// Parses an 8-byte big-endian sequence frame.
///
/// # Errors
///
/// [`DecodeError::BadSequenceFrame`] when the frame is not exactly 8 bytes.
pub fn parse_seq(frame: &[u8]) -> Result<u64> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| DecodeError::BadSequenceFrame { len: frame.len() })?;
    Ok(u64::from_be_bytes(bytes))
}

/// The 8-byte big-endian frame for `seq`: the sequence frame of a published message, and also
/// the body of a replay request ("send me everything from `seq` on").
#[must_use]
pub fn seq_frame(seq: u64) -> [u8; 8] {
    seq.to_be_bytes()
}

/// True for the replay end marker: sequence all ones and an empty payload, in any framing of
/// [`replay_frames`]: vLLM 0.32's `("", "", -1, "")` to a DEALER (`("", -1, "")` to a REQ),
/// older vLLM's and SGLang's `("", -1, "")` to a DEALER (`(-1, "")` to a REQ).
#[must_use]
pub fn is_replay_end(frames: &[&[u8]]) -> bool {
    replay_frames(frames)
        .is_ok_and(|(_, seq, payload)| payload.is_empty() && parse_seq(seq) == Ok(REPLAY_END_SEQ))
}

/// Splits the epoch that newer SGLang publishers append to the topic frame when their snapshot
/// endpoint is enabled (`topic + b"\0sgl-kv-epoch=" + epoch`, possibly followed by
/// `b"\0sgl-kv-snapshot=" + id` on barrier messages). Returns the configured topic and the
/// epoch, if any. A new epoch means the publisher restarted and its sequence numbers began
/// again, so a caller should [`SequenceTracker::reset`] and resynchronize that endpoint.
#[must_use]
pub fn split_topic_epoch(topic: &[u8]) -> (&[u8], Option<&[u8]>) {
    const MARKER: &[u8] = b"\0sgl-kv-epoch=";
    let Some(at) = find(topic, MARKER) else {
        return (topic, None);
    };
    let base = topic.get(..at).unwrap_or(topic);
    let rest = topic.get(at + MARKER.len()..).unwrap_or_default();
    let epoch_end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
    (base, rest.get(..epoch_end))
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Seconds since the Unix epoch now: the unit and clock of [`EventBatch::ts`].
#[must_use]
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
