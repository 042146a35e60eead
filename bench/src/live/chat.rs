//! Chat mode: a session workload replayed as multi-turn chat conversations.
//!
//! The workloads describe prompts as token ids (shared prefixes as shared ids). A chat client
//! sends text instead, and its later turns carry the assistant's earlier replies as text, which
//! the engine (and a tokenizing router) must tokenize again. That re-tokenization is the part of
//! real chat traffic a token-id replay cannot show, so in chat mode each session keeps its
//! conversation: the first request is one user message, the text of its token ids; each later
//! request of the session is the conversation so far, the reply the engine actually streamed,
//! and a user message holding the turn's new tokens. A request whose prompt does not extend the
//! session's previous one (a trace that compacts its context) starts the conversation again.
//!
//! Token ids become words from a fixed list of common English words, one word per id, so equal
//! ids give equal text (shared system prompts stay shared). Each word is one token with its
//! leading space in the tiny model's tokenizer (`scripts/real-engines/make_tiny_model.py`) as
//! in the large models' ones, so a prompt of n ids is about n tokens long.

use hashlink::LruCache;
use serde::Serialize;

use super::super::workload::tokens::mix64;

/// Conversations kept at most (least recently used ones go first).
pub const MAX_SESSIONS: usize = 65_536;
/// Bytes of one reply kept for the next turn at most.
pub const MAX_REPLY_BYTES: usize = 64 << 10;

/// One chat message as the OpenAI API takes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Message {
    pub role: &'static str,
    pub content: String,
}

impl Message {
    fn user(content: String) -> Self {
        Self {
            role: "user",
            content,
        }
    }
}

/// The words token ids become (each one token, with its leading space, in the tiny model's
/// tokenizer: checked in `e2e/tests/real_vllm.rs`).
pub const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there", "been", "if",
    "more", "when", "will", "would", "so", "no", "time", "people", "year", "way", "day", "man",
    "life", "world", "state", "system", "work", "right", "back", "good", "first", "last", "long",
    "great", "little", "own", "other", "old", "same", "get", "make", "go", "know", "take", "see",
    "come",
];

/// The text of token ids: one word per id.
pub fn text_of(ids: &[u32]) -> String {
    let mut out = String::with_capacity(ids.len() * 6);
    for (i, &t) in ids.iter().enumerate() {
        if i > 0 {
            out.push(' ');
        }
        out.push_str(WORDS[(mix64(u64::from(t)) % WORDS.len() as u64) as usize]);
    }
    out
}

#[derive(Debug)]
struct Conversation {
    /// The token-id prompt of the session's last request.
    prompt: Vec<u32>,
    /// Its output length in the workload (the ids the next prompt carries for the reply).
    output_len: u32,
    /// Every message of the last request.
    messages: Vec<Message>,
    /// What the engine replied to it (`None` until the reply arrives, or when it failed).
    reply: Option<String>,
}

/// The conversations of every live session (bounded, least recently used dropped).
pub struct ChatSessions {
    sessions: LruCache<u64, Conversation>,
}

impl Default for ChatSessions {
    fn default() -> Self {
        Self::new(MAX_SESSIONS)
    }
}

impl ChatSessions {
    pub fn new(capacity: usize) -> Self {
        Self {
            sessions: LruCache::new(capacity.max(1)),
        }
    }

    pub fn len(&self) -> usize {
        self.sessions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sessions.is_empty()
    }

    /// The messages of `session`'s next request, whose token-id prompt is `prompt` and whose
    /// output is `output_len` ids long in the workload. `block_tokens` is the workload's
    /// block size: a prompt extends the previous one when they agree up to its last full
    /// block (the last block of a trace request is usually partial and is completed by the
    /// next turn).
    pub fn next(
        &mut self,
        session: u64,
        prompt: &[u32],
        output_len: u32,
        block_tokens: u32,
    ) -> Vec<Message> {
        let continued = self.sessions.get(&session).and_then(|c| {
            let reply = c.reply.as_ref()?;
            let prev = c.prompt.len();
            let keep = prev - prev % (block_tokens.max(1) as usize);
            let extends = prompt.len() > prev && prompt[..keep] == c.prompt[..keep];
            if !extends {
                return None;
            }
            let new_from = (prev + c.output_len as usize).min(prompt.len());
            let mut messages = c.messages.clone();
            messages.push(Message {
                role: "assistant",
                content: reply.clone(),
            });
            let user = if new_from < prompt.len() {
                text_of(&prompt[new_from..])
            } else {
                "continue".to_string()
            };
            messages.push(Message::user(user));
            Some(messages)
        });
        let messages = continued.unwrap_or_else(|| vec![Message::user(text_of(prompt))]);
        self.sessions.insert(
            session,
            Conversation {
                prompt: prompt.to_vec(),
                output_len,
                messages: messages.clone(),
                reply: None,
            },
        );
        messages
    }

    /// The engine's reply to `session`'s last request (`None`: it failed, so the next request
    /// starts the conversation again).
    pub fn reply(&mut self, session: u64, text: Option<String>) {
        if let Some(c) = self.sessions.get_mut(&session) {
            c.reply = text.map(|mut t| {
                if t.len() > MAX_REPLY_BYTES {
                    let mut cut = MAX_REPLY_BYTES;
                    while !t.is_char_boundary(cut) {
                        cut -= 1;
                    }
                    t.truncate(cut);
                }
                t
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(r: std::ops::Range<u32>) -> Vec<u32> {
        r.collect()
    }

    #[test]
    fn equal_ids_give_equal_text_and_one_word_per_id() {
        assert_eq!(text_of(&ids(0..50)), text_of(&ids(0..50)));
        assert_eq!(text_of(&ids(0..50)).split(' ').count(), 50);
        assert_ne!(text_of(&ids(0..50)), text_of(&ids(50..100)));
        assert_eq!(text_of(&[]), "");
    }

    #[test]
    fn a_session_carries_its_replies_and_only_the_new_tokens_as_the_next_user_turn() {
        let mut s = ChatSessions::default();
        // turn 1: 40 ids (blocks of 16: the last 8 are a partial block)
        let p1 = ids(0..40);
        let m1 = s.next(7, &p1, 10, 16);
        assert_eq!(m1, vec![Message::user(text_of(&p1))]);
        s.reply(7, Some("the reply".into()));
        // turn 2: turn 1's prompt, its 10 output ids, 20 new ids
        let mut p2 = p1.clone();
        p2.extend(ids(900..910));
        p2.extend(ids(100..120));
        let m2 = s.next(7, &p2, 5, 16);
        assert_eq!(m2.len(), 3);
        assert_eq!(m2[0], m1[0]);
        assert_eq!(m2[1].role, "assistant");
        assert_eq!(m2[1].content, "the reply");
        assert_eq!(m2[2], Message::user(text_of(&ids(100..120))));
        // turn 3 before turn 2's reply arrived (or after it failed): a new conversation
        let mut p3 = p2.clone();
        p3.extend(ids(200..230));
        assert_eq!(s.next(7, &p3, 5, 16), vec![Message::user(text_of(&p3))]);
    }

    #[test]
    fn a_prompt_that_does_not_extend_the_last_one_starts_again() {
        let mut s = ChatSessions::default();
        s.next(1, &ids(0..64), 4, 16);
        s.reply(1, Some("ok".into()));
        // differs inside the first full block: compacted context
        let mut p = ids(0..64);
        p[3] = 9_999;
        p.extend(ids(500..520));
        assert_eq!(s.next(1, &p, 4, 16), vec![Message::user(text_of(&p))]);
        // other sessions are independent
        assert_eq!(s.next(2, &ids(0..10), 1, 16).len(), 1);
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn a_trailing_partial_block_may_change_and_empty_new_turns_still_send_a_message() {
        let mut s = ChatSessions::default();
        let p1 = ids(0..40);
        s.next(3, &p1, 1, 16);
        s.reply(3, Some("r".into()));
        // the partial block (ids 32..40) differs; the full blocks agree
        let mut p2 = ids(0..32);
        p2.extend(ids(700..708));
        p2.push(1);
        let m = s.next(3, &p2, 0, 16);
        assert_eq!(m.len(), 3, "continued");
        assert_eq!(
            m[2],
            Message::user("continue".into()),
            "no ids past turn 1's output"
        );
    }

    #[test]
    fn sessions_and_replies_are_bounded() {
        let mut s = ChatSessions::new(2);
        for k in 0..5 {
            s.next(k, &ids(0..4), 1, 16);
        }
        assert_eq!(s.len(), 2);
        s.next(9, &ids(0..4), 1, 16);
        s.reply(9, Some("é".repeat(MAX_REPLY_BYTES)));
        let m = s.next(9, &ids(0..40), 1, 16);
        // the reply was cut at a char boundary (2-byte chars) within the bound
        assert_eq!(m[1].role, "assistant");
        assert_eq!(m[1].content.len(), MAX_REPLY_BYTES);
        assert!(m[1].content.chars().all(|c| c == 'é'));
    }
}
