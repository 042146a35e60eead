//! OpenAI Responses conversations: which endpoint stores which response.
//!
//! A Responses request that continues a conversation names only the last response
//! (`previous_response_id`); the engine that stored it prepends the conversation so far, and
//! no other engine can serve it (vLLM answers 404 for a response it does not hold). The
//! picker learns each response's id from the head of the response body as it relays it
//! (the `id` of the response object, or of the `response.created` event of a stream) and
//! keeps, for a bounded number of recent responses, the conversation it belongs to and the
//! endpoint holding it. A continuation then rides its conversation's session pin, and
//! `GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel` go to the holder.

use std::sync::Arc;

use hashlink::LruCache;
use parking_lot::Mutex;

use crate::endpoint::EndpointId;

/// Responses remembered (least recently used forgotten first): 65,536 × ~150 bytes ≈ 10 MB.
pub const MAX_TRACKED_RESPONSES: usize = 65_536;

/// How far into a response body its id is looked for.
pub const MAX_ID_SCAN_BYTES: usize = 8192;

/// Where a stored response lives, and whose it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseOwner {
    /// The conversation's session name (its pin key within the tenant).
    pub conversation: Arc<str>,
    pub endpoint: EndpointId,
    /// The tenant whose request made it (none without tenancy): another tenant naming its
    /// id is told it does not exist.
    pub tenant: Option<Arc<str>>,
}

/// What the picker knows of a response id, for one tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Known {
    /// It was made by this tenant, and is stored there.
    Here(ResponseOwner),
    /// It was made by another tenant: to this one, it does not exist.
    OtherTenant,
    /// Never seen here (another replica served it, or it was forgotten).
    Unknown,
}

/// Recent responses and their owners, bounded by [`MAX_TRACKED_RESPONSES`].
#[derive(Debug)]
pub struct Responses {
    owners: Mutex<LruCache<String, ResponseOwner>>,
}

impl Default for Responses {
    fn default() -> Self {
        Self::with_capacity(MAX_TRACKED_RESPONSES)
    }
}

impl Responses {
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            owners: Mutex::new(LruCache::new(capacity.max(1))),
        }
    }

    /// What is known of response `id` for `tenant`.
    pub fn lookup(&self, id: &str, tenant: Option<&str>) -> Known {
        match self.owners.lock().get(id) {
            Some(o) if o.tenant.as_deref() == tenant => Known::Here(o.clone()),
            Some(_) => Known::OtherTenant,
            None => Known::Unknown,
        }
    }

    /// The session name of the conversation `previous` belongs to: the one it was recorded
    /// with, or, for a response this picker never saw (another replica served it, or it was
    /// forgotten) or another tenant's, one named after it, so the continuations that follow
    /// still share a pin (a session key is scoped to its tenant).
    pub fn conversation_of(&self, previous: &str, tenant: Option<&str>) -> String {
        match self.lookup(previous, tenant) {
            Known::Here(owner) => owner.conversation.to_string(),
            Known::OtherTenant | Known::Unknown => conversation_named_after(previous),
        }
    }

    pub fn record(&self, id: &str, owner: ResponseOwner) {
        self.owners.lock().insert(id.to_owned(), owner);
    }

    pub fn len(&self) -> usize {
        self.owners.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The session name of a conversation first seen through response `id`.
pub fn conversation_named_after(id: &str) -> String {
    format!("response:{id}")
}

/// A Responses request being relayed, until the id of its response is seen.
#[derive(Debug)]
pub struct ResponseWatch {
    /// The request's conversation (session header, `session_id` or `previous_response_id`);
    /// `None` for a conversation's first request.
    pub conversation: Option<String>,
    pub tenant: Option<String>,
    pub endpoint: EndpointId,
    pub prompt_tokens: u32,
    head: Vec<u8>,
}

impl ResponseWatch {
    pub fn new(
        conversation: Option<String>,
        tenant: Option<String>,
        endpoint: EndpointId,
        prompt_tokens: u32,
    ) -> Self {
        Self {
            conversation,
            tenant,
            endpoint,
            prompt_tokens,
            head: Vec::new(),
        }
    }

    /// Reads the next chunk of the response body: `Some(id)` once the response's id is seen,
    /// `None` while it may still come. [`Self::exhausted`] says when to stop looking.
    pub fn feed(&mut self, chunk: &[u8]) -> Option<String> {
        let room = MAX_ID_SCAN_BYTES.saturating_sub(self.head.len());
        self.head.extend_from_slice(&chunk[..chunk.len().min(room)]);
        find_response_id(&self.head).map(str::to_owned)
    }

    /// Whether the scanned head is full without an id in it.
    pub fn exhausted(&self) -> bool {
        self.head.len() >= MAX_ID_SCAN_BYTES
    }
}

/// The value of the first `"id"` key of a JSON document or an SSE stream of them: the
/// response's id in a Responses body (`{"id": "resp_…", …}`) or stream (`data:
/// {"response": {"id": "resp_…", …}, …}` for `response.created`). Ids are 1-256 bytes without
/// escapes or control characters; anything else is not taken.
pub fn find_response_id(head: &[u8]) -> Option<&str> {
    let mut from = 0;
    while let Some(at) = find(&head[from..], b"\"id\"") {
        let key = from + at;
        from = key + 4;
        // inside a JSON string a quote is escaped: `\"id\"` is text, not a key
        if key > 0 && head[key - 1] == b'\\' {
            continue;
        }
        let mut i = from;
        let skip_ws = |i: &mut usize| {
            while head.get(*i).is_some_and(u8::is_ascii_whitespace) {
                *i += 1;
            }
        };
        skip_ws(&mut i);
        if head.get(i) != Some(&b':') {
            continue;
        }
        i += 1;
        skip_ws(&mut i);
        if head.get(i) != Some(&b'"') {
            return None;
        }
        let start = i + 1;
        let len = head[start..].iter().position(|&b| b == b'"')?;
        let id = &head[start..start + len];
        if id.is_empty() || id.len() > 256 || id.iter().any(|&b| b == b'\\' || b < 0x20) {
            return None;
        }
        return std::str::from_utf8(id).ok();
    }
    None
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_response_id_is_found_in_a_body_or_a_stream_head() {
        assert_eq!(
            find_response_id(br#"{"id":"resp_1","object":"response","output":[{"id":"msg_2"}]}"#),
            Some("resp_1")
        );
        let stream = b"event: response.created\ndata: {\"response\": {\"id\": \"resp_9\", \"created_at\": 1}, \"sequence_number\": 0, \"type\": \"response.created\"}\n\n";
        assert_eq!(find_response_id(stream), Some("resp_9"));
        // a quoted `"id"` inside a string is text; an incomplete head waits for more
        assert_eq!(
            find_response_id(br#"{"note":"say \"id\": \"x\"","id":"resp_3"}"#),
            Some("resp_3")
        );
        assert_eq!(find_response_id(br#"{"id":"resp_"#), None);
        assert_eq!(find_response_id(br#"{"id": 7}"#), None);
    }

    #[test]
    fn a_watch_reads_the_id_across_chunks_and_gives_up_past_its_bound() {
        let ep = EndpointId {
            address: "127.0.0.1".parse().expect("ip"),
            port: 8000,
            rank: 0,
        };
        let mut w = ResponseWatch::new(None, None, ep, 10);
        assert_eq!(w.feed(br#"{"id":"re"#), None);
        assert_eq!(w.feed(br#"sp_7","x":1}"#).as_deref(), Some("resp_7"));
        let mut w = ResponseWatch::new(None, None, ep, 10);
        assert_eq!(w.feed(&vec![b' '; MAX_ID_SCAN_BYTES + 10]), None);
        assert!(w.exhausted());
        assert_eq!(w.feed(br#"{"id":"late"}"#), None, "past the bound");
    }

    #[test]
    fn conversations_follow_their_responses_and_the_table_is_bounded() {
        let ep = |p| EndpointId {
            address: "127.0.0.1".parse().expect("ip"),
            port: p,
            rank: 0,
        };
        let owner = |c: &str, e| ResponseOwner {
            conversation: c.into(),
            endpoint: ep(e),
            tenant: None,
        };
        let r = Responses::with_capacity(2);
        assert_eq!(r.conversation_of("resp_a", None), "response:resp_a");
        r.record("resp_a", owner("response:resp_a", 1));
        r.record("resp_b", owner("response:resp_a", 1));
        assert_eq!(r.conversation_of("resp_b", None), "response:resp_a");
        r.record("resp_c", owner("s", 2));
        assert_eq!(r.len(), 2);
        assert_eq!(
            r.lookup("resp_a", None),
            Known::Unknown,
            "least recently used goes"
        );
        assert_eq!(r.lookup("resp_c", None), Known::Here(owner("s", 2)));
    }

    /// Hardening IV, 9: tenant B naming tenant A's response id was routed to A's engine and
    /// read or continued A's stored response.
    #[test]
    fn a_response_is_known_only_to_its_tenant() {
        let r = Responses::default();
        let a = ResponseOwner {
            conversation: "session-a".into(),
            endpoint: EndpointId {
                address: "127.0.0.1".parse().expect("ip"),
                port: 1,
                rank: 0,
            },
            tenant: Some("a".into()),
        };
        r.record("resp_1", a.clone());
        assert_eq!(r.lookup("resp_1", Some("a")), Known::Here(a));
        assert_eq!(r.lookup("resp_1", Some("b")), Known::OtherTenant);
        assert_eq!(r.lookup("resp_1", None), Known::OtherTenant);
        // B's continuation is not put in A's conversation
        assert_eq!(r.conversation_of("resp_1", Some("a")), "session-a");
        assert_eq!(r.conversation_of("resp_1", Some("b")), "response:resp_1");
    }
}
