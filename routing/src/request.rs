//! A request body as the picker reads it: which API it came in on, its model, prompt or chat
//! and salt, parsed once; and the body forwarded to the engine.

use bytes::Bytes;
use serde_json::Value;

use crate::tokenize::PromptInput;

/// Why a request body is refused: an HTTP status (400 or 413), a machine-readable code (the
/// OpenAI error's `code` and the metrics label) and a message naming what is wrong. The
/// service answers it as an OpenAI-style error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct RequestError {
    pub status: u16,
    pub code: &'static str,
    pub message: String,
}

impl RequestError {
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status: 400,
            code,
            message: message.into(),
        }
    }

    pub fn too_large(limit: usize) -> Self {
        Self {
            status: 413,
            code: "body_too_large",
            message: format!("request body exceeds the limit of {limit} bytes"),
        }
    }
}

/// The bounds a body is parsed under (the service's `limits` of the same names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestLimits {
    /// `limits.maxBodyBytes`: larger bodies are a 413.
    pub max_body_bytes: usize,
    /// `limits.maxPromptTokens`: a prompt of more token ids is a 400.
    pub max_prompt_tokens: usize,
    /// `limits.maxMessages`: more chat messages are a 400.
    pub max_messages: usize,
}

impl Default for RequestLimits {
    fn default() -> Self {
        Self {
            max_body_bytes: 16 << 20,
            max_prompt_tokens: 512 * 1024,
            max_messages: 4096,
        }
    }
}

/// Which API a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiKind {
    Completions,
    ChatCompletions,
    /// Any other API whose JSON body names a `model` (`/v1/responses`, `/v1/messages`,
    /// `/v1/embeddings`, a path spelled differently, ...), as the gateway forwards it: routed by
    /// model, tenant and load, its prompt not read. Only the ext_proc listener takes these; the
    /// proxy serves the two OpenAI paths above.
    Other,
}

impl ApiKind {
    /// The engine path of an OpenAI API; `None` for [`ApiKind::Other`], whose path the gateway
    /// keeps.
    pub fn path(self) -> Option<&'static str> {
        match self {
            Self::Completions => Some("/v1/completions"),
            Self::ChatCompletions => Some("/v1/chat/completions"),
            Self::Other => None,
        }
    }

    /// The API of a request path (query ignored); exact spellings only, so that whatever the
    /// engine would not serve as completions is not read as completions either.
    pub fn from_path(path: &str) -> Self {
        match path.split('?').next().unwrap_or(path) {
            "/v1/completions" => Self::Completions,
            "/v1/chat/completions" => Self::ChatCompletions,
            _ => Self::Other,
        }
    }
}

/// A completion prompt as OpenAI accepts it.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    /// Token ids (of the first prompt when a batch was sent).
    Ids(Vec<u32>),
}

impl<'de> serde::Deserialize<'de> for Prompt {
    /// Reads a string, a list of strings, a list of token ids or a list of token-id lists,
    /// keeping only the first prompt of a batch (they usually share the prefix that matters).
    /// Token ids go straight into `u32`s: no intermediate JSON tree for 100k-token prompts.
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{Error, IgnoredAny, SeqAccess, Visitor};

        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum First {
            Text(String),
            Id(u32),
            Ids(Vec<u32>),
        }

        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Prompt;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string, a list of strings or a list of token ids")
            }

            fn visit_str<E: Error>(self, v: &str) -> Result<Prompt, E> {
                Ok(Prompt::Text(v.to_owned()))
            }

            fn visit_string<E: Error>(self, v: String) -> Result<Prompt, E> {
                Ok(Prompt::Text(v))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
                let first: Option<First> = seq.next_element()?;
                let out = match first {
                    None => return Err(A::Error::custom("`prompt` must not be empty")),
                    Some(First::Text(t)) => Prompt::Text(t),
                    Some(First::Ids(ids)) => Prompt::Ids(ids),
                    Some(First::Id(id)) => {
                        let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(1024) + 1);
                        ids.push(id);
                        while let Some(t) = seq.next_element::<u32>()? {
                            ids.push(t);
                        }
                        return Ok(Prompt::Ids(ids));
                    }
                };
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(out)
            }
        }
        d.deserialize_any(V)
    }
}

/// The fields the picker reads from a completions or chat body; everything else is forwarded
/// untouched.
#[derive(serde::Deserialize)]
struct BodyFields {
    #[serde(default)]
    model: Option<Value>,
    #[serde(default)]
    prompt: Option<Prompt>,
    #[serde(default)]
    stream: Option<Value>,
    #[serde(default)]
    messages: Option<Value>,
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    add_generation_prompt: Option<Value>,
    #[serde(default)]
    chat_template_kwargs: Option<Value>,
    #[serde(default)]
    cache_salt: Option<Value>,
}

/// The fields the picker reads from the body of any other API ([`ApiKind::Other`]).
#[derive(serde::Deserialize)]
struct OtherBodyFields {
    #[serde(default)]
    model: Option<Value>,
    #[serde(default)]
    stream: Option<Value>,
    #[serde(default)]
    cache_salt: Option<Value>,
}

/// The chat fields the template needs.
#[derive(Debug, Clone)]
pub struct ChatFields {
    pub messages: Value,
    pub tools: Option<Value>,
    pub add_generation_prompt: bool,
    pub kwargs: Option<Value>,
}

/// A request body parsed once.
#[derive(Debug, Clone)]
pub struct ParsedRequest {
    pub kind: ApiKind,
    pub raw: Bytes,
    pub model: String,
    pub stream: bool,
    pub prompt: Option<Prompt>,
    pub chat: Option<ChatFields>,
    /// The client's own `cache_salt` (vLLM): the engine salts the prefix with it, so the
    /// picker hashes with it too (unless tenancy replaces it).
    pub cache_salt: Option<String>,
}

impl ParsedRequest {
    /// The prompt as the tokenizer takes it: token ids, text, or a chat for the template;
    /// `None` when the body has neither `prompt` nor `messages` (another API's body).
    pub fn prompt_input(&self) -> Option<PromptInput<'_>> {
        Some(match (&self.prompt, &self.chat) {
            (Some(Prompt::Ids(ids)), _) => PromptInput::TokenIds(ids),
            (Some(Prompt::Text(t)), _) => PromptInput::Text(t),
            (None, Some(chat)) => PromptInput::Chat {
                messages: &chat.messages,
                tools: chat.tools.as_ref(),
                add_generation_prompt: chat.add_generation_prompt,
                extra: chat.kwargs.as_ref(),
            },
            (None, None) => return None,
        })
    }

    pub fn parse(kind: ApiKind, raw: Bytes, limits: &RequestLimits) -> Result<Self, RequestError> {
        if raw.len() > limits.max_body_bytes {
            return Err(RequestError::too_large(limits.max_body_bytes));
        }
        if raw.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return Err(RequestError::bad_request(
                "invalid_json",
                "request body must be a JSON object",
            ));
        }
        let invalid = |e: serde_json::Error| {
            let code = if e.is_data() {
                "invalid_field"
            } else {
                "invalid_json"
            };
            RequestError::bad_request(code, format!("invalid request body: {e}"))
        };
        if kind == ApiKind::Other {
            let head: OtherBodyFields = serde_json::from_slice(&raw).map_err(invalid)?;
            let (model, stream, cache_salt) =
                Self::common_fields(head.model, head.stream, head.cache_salt)?;
            return Ok(Self {
                kind,
                raw,
                model,
                stream,
                prompt: None,
                chat: None,
                cache_salt,
            });
        }
        let head: BodyFields = serde_json::from_slice(&raw).map_err(invalid)?;
        let (model, stream, cache_salt) =
            Self::common_fields(head.model, head.stream, head.cache_salt)?;
        let (prompt, chat) = match kind {
            ApiKind::Completions => match head.prompt {
                None => {
                    return Err(RequestError::bad_request(
                        "missing_field",
                        "missing required field `prompt`",
                    ));
                }
                Some(Prompt::Ids(ids)) if ids.len() > limits.max_prompt_tokens => {
                    return Err(RequestError::bad_request(
                        "prompt_too_long",
                        format!(
                            "the prompt has {} tokens, more than the limit of {}",
                            ids.len(),
                            limits.max_prompt_tokens
                        ),
                    ));
                }
                Some(p) => (Some(p), None),
            },
            // read by `OtherBodyFields` above
            ApiKind::Other => (None, None),
            ApiKind::ChatCompletions => {
                let messages = match head.messages {
                    None => {
                        return Err(RequestError::bad_request(
                            "missing_field",
                            "missing required field `messages`",
                        ));
                    }
                    Some(Value::Array(m)) if m.is_empty() => {
                        return Err(RequestError::bad_request(
                            "invalid_field",
                            "`messages` must not be empty",
                        ));
                    }
                    Some(Value::Array(m)) if m.len() > limits.max_messages => {
                        return Err(RequestError::bad_request(
                            "too_many_messages",
                            format!(
                                "`messages` has {} entries, more than the limit of {}",
                                m.len(),
                                limits.max_messages
                            ),
                        ));
                    }
                    Some(m @ Value::Array(_)) => m,
                    Some(_) => {
                        return Err(RequestError::bad_request(
                            "invalid_field",
                            "`messages` must be an array",
                        ));
                    }
                };
                let chat = ChatFields {
                    messages,
                    tools: head.tools.filter(|t| !t.is_null()),
                    add_generation_prompt: head
                        .add_generation_prompt
                        .as_ref()
                        .and_then(Value::as_bool)
                        .unwrap_or(true),
                    kwargs: head.chat_template_kwargs.filter(Value::is_object),
                };
                (None, Some(chat))
            }
        };
        Ok(Self {
            kind,
            raw,
            model,
            stream,
            prompt,
            chat,
            cache_salt,
        })
    }

    /// `model`, `stream` and `cache_salt`, which every API reads alike.
    fn common_fields(
        model: Option<Value>,
        stream: Option<Value>,
        cache_salt: Option<Value>,
    ) -> Result<(String, bool, Option<String>), RequestError> {
        let model = match model {
            Some(Value::String(m)) if !m.is_empty() => m,
            Some(_) => {
                return Err(RequestError::bad_request(
                    "invalid_field",
                    "`model` must be a non-empty string",
                ));
            }
            None => {
                return Err(RequestError::bad_request(
                    "missing_field",
                    "missing required field `model`",
                ));
            }
        };
        let stream = match stream {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => b,
            Some(_) => {
                return Err(RequestError::bad_request(
                    "invalid_field",
                    "`stream` must be a boolean",
                ));
            }
        };
        let cache_salt = match cache_salt {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if !s.is_empty() && s.len() <= MAX_CACHE_SALT_BYTES => Some(s),
            Some(_) => {
                return Err(RequestError::bad_request(
                    "invalid_field",
                    format!(
                        "`cache_salt` must be a non-empty string of at most {MAX_CACHE_SALT_BYTES} bytes"
                    ),
                ));
            }
        };
        Ok((model, stream, cache_salt))
    }
}

/// Longest client `cache_salt` accepted.
pub const MAX_CACHE_SALT_BYTES: usize = 1024;

/// The body to forward: the client's, rewritten only when a field must be injected (the
/// tenant's salt, replacing the client's own; SGLang's `data_parallel_rank`). A body that must
/// carry the tenant's salt is always rewritten, so what the engine reads is a tree this process
/// built; one that cannot be rewritten is refused, never forwarded as it came: the engine would
/// see the client's own `cache_salt` (or none) while the index credits the tenant's.
pub fn engine_body(
    req: &ParsedRequest,
    tenant_salt: Option<&str>,
    data_parallel_rank: Option<u32>,
) -> Result<Bytes, RequestError> {
    let mut inject: Vec<(&str, Value)> = Vec::new();
    if let Some(rank) = data_parallel_rank {
        inject.push(("data_parallel_rank", Value::from(rank)));
    }
    if let Some(salt) = tenant_salt {
        inject.push(("cache_salt", Value::from(salt)));
    }
    if inject.is_empty() {
        return Ok(req.raw.clone());
    }
    inject_fields(&req.raw, inject)
}

/// `raw` (a JSON object) with `fields` set at its top level. The slow path, only for bodies that
/// need a field injected; a body `serde_json` cannot hold as a tree (a number out of range, a
/// lone surrogate, nesting past its limit) is a 400 naming the reason.
fn inject_fields(raw: &[u8], fields: Vec<(&str, Value)>) -> Result<Bytes, RequestError> {
    let unrewritable = |why: String| {
        RequestError::bad_request(
            "invalid_json",
            format!("the request body cannot be rewritten for the engine: {why}"),
        )
    };
    let mut body = match serde_json::from_slice::<Value>(raw) {
        Ok(Value::Object(body)) => body,
        Ok(_) => return Err(unrewritable("it is not a JSON object".into())),
        Err(e) => return Err(unrewritable(e.to_string())),
    };
    for (k, v) in fields {
        body.insert(k.to_owned(), v);
    }
    serde_json::to_vec(&Value::Object(body))
        .map(Bytes::from)
        .map_err(|e| unrewritable(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(kind: ApiKind, body: &str) -> Result<ParsedRequest, RequestError> {
        ParsedRequest::parse(
            kind,
            Bytes::from(body.to_owned()),
            &RequestLimits::default(),
        )
    }

    #[test]
    fn prompts_in_every_openai_shape() {
        let p = |b: &str| parse(ApiKind::Completions, b).expect("valid").prompt;
        assert_eq!(
            p(r#"{"model":"m","prompt":"hi"}"#),
            Some(Prompt::Text("hi".into()))
        );
        assert_eq!(
            p(r#"{"model":"m","prompt":["a","b"]}"#),
            Some(Prompt::Text("a".into()))
        );
        assert_eq!(
            p(r#"{"model":"m","prompt":[1,2,3]}"#),
            Some(Prompt::Ids(vec![1, 2, 3]))
        );
        assert_eq!(
            p(r#"{"model":"m","prompt":[[4,5],[6]]}"#),
            Some(Prompt::Ids(vec![4, 5]))
        );
    }

    #[test]
    fn bad_bodies_are_400s_naming_the_problem() {
        for (body, code) in [
            ("[1,2]", "invalid_json"),
            ("{\"model\":\"m\",\"prompt\":", "invalid_json"),
            (r#"{"model":"m","prompt":[-1]}"#, "invalid_field"),
            (r#"{"model":"m","prompt":[1,"x"]}"#, "invalid_field"),
            (r#"{"model":"m","prompt":{}}"#, "invalid_field"),
            (r#"{"model":"m","prompt":[]}"#, "invalid_field"),
            (r#"{"model":"m"}"#, "missing_field"),
            (r#"{"prompt":"x"}"#, "missing_field"),
            (r#"{"model":7,"prompt":"x"}"#, "invalid_field"),
            (
                r#"{"model":"m","prompt":"x","stream":"yes"}"#,
                "invalid_field",
            ),
        ] {
            let e = parse(ApiKind::Completions, body).expect_err(body);
            assert_eq!((e.status, e.code), (400, code), "{body}: {}", e.message);
        }
        for (body, code) in [
            (r#"{"model":"m"}"#, "missing_field"),
            (r#"{"model":"m","messages":[]}"#, "invalid_field"),
            (r#"{"model":"m","messages":"hi"}"#, "invalid_field"),
        ] {
            let e = parse(ApiKind::ChatCompletions, body).expect_err(body);
            assert_eq!((e.status, e.code), (400, code), "{body}");
        }
    }

    #[test]
    fn chat_fields_are_kept_for_the_template() {
        let r = parse(
            ApiKind::ChatCompletions,
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"add_generation_prompt":false,"tools":null,"stream":true}"#,
        )
        .expect("valid");
        let chat = r.chat.expect("chat");
        assert!(!chat.add_generation_prompt && chat.tools.is_none() && r.stream);
    }
}
