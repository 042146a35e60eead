//! A request body as the picker reads it: which API it came in on, its model, prompt or chat
//! and salt, parsed once; and the body forwarded to the engine.

use bytes::Bytes;
use serde::Deserialize as _;
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
    /// OpenAI Responses (`/v1/responses`): `instructions`, `input` and `tools` read as the chat
    /// vLLM renders for them ([`crate::chat_mapping`]); `previous_response_id` and
    /// `session_id` name the conversation.
    Responses,
    /// Anthropic Messages (`/v1/messages`): `system`, `messages` and `tools` read as the chat
    /// vLLM renders for them.
    Messages,
    /// Embeddings (`/v1/embeddings`): `input` read as a completions prompt (the engine
    /// prefills it).
    Embeddings,
    /// Any other API whose JSON body names a `model` (the render endpoints, `/tokenize`,
    /// `/detokenize`, `/v1/messages/count_tokens`, a path spelled differently, ...): routed by
    /// model, tenant and load, its prompt not read (none of these prefill anything a later
    /// request could reuse).
    Other,
}

impl ApiKind {
    /// The engine path of an OpenAI API; `None` for [`ApiKind::Other`], whose path the gateway
    /// keeps.
    pub fn path(self) -> Option<&'static str> {
        match self {
            Self::Completions => Some("/v1/completions"),
            Self::ChatCompletions => Some("/v1/chat/completions"),
            Self::Responses => Some("/v1/responses"),
            Self::Messages => Some("/v1/messages"),
            Self::Embeddings => Some("/v1/embeddings"),
            Self::Other => None,
        }
    }

    /// A short name of the API (span and log attribute).
    pub fn name(self) -> &'static str {
        match self {
            Self::Completions => "completions",
            Self::ChatCompletions => "chat_completions",
            Self::Responses => "responses",
            Self::Messages => "messages",
            Self::Embeddings => "embeddings",
            Self::Other => "other",
        }
    }

    /// vLLM's render endpoint for this API: the token ids it would prefill, without running
    /// the model.
    pub fn render_path(self) -> Option<&'static str> {
        match self {
            Self::Completions => Some("/v1/completions/render"),
            Self::ChatCompletions => Some("/v1/chat/completions/render"),
            Self::Responses => Some("/v1/responses/render"),
            Self::Messages => Some("/v1/messages/render"),
            Self::Embeddings | Self::Other => None,
        }
    }

    /// The API of a request path (query ignored); exact spellings only, so that whatever the
    /// engine would not serve as completions is not read as completions either.
    pub fn from_path(path: &str) -> Self {
        match path.split('?').next().unwrap_or(path) {
            "/v1/completions" => Self::Completions,
            "/v1/chat/completions" => Self::ChatCompletions,
            "/v1/responses" => Self::Responses,
            "/v1/messages" => Self::Messages,
            "/v1/embeddings" => Self::Embeddings,
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
    #[serde(default)]
    kv_transfer_params: Option<serde::de::IgnoredAny>,
}

/// The fields the picker reads from a Responses, Messages or embeddings body.
#[derive(serde::Deserialize)]
struct ConversationFields {
    #[serde(default)]
    model: Option<Value>,
    #[serde(default)]
    stream: Option<Value>,
    #[serde(default)]
    cache_salt: Option<Value>,
    #[serde(default)]
    kv_transfer_params: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    input: Option<Value>,
    #[serde(default)]
    instructions: Option<Value>,
    #[serde(default)]
    system: Option<Value>,
    #[serde(default)]
    messages: Option<Value>,
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    chat_template_kwargs: Option<Value>,
    #[serde(default)]
    previous_response_id: Option<Value>,
    #[serde(default)]
    session_id: Option<Value>,
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
    #[serde(default)]
    kv_transfer_params: Option<serde::de::IgnoredAny>,
}

/// The chat fields the template needs.
#[derive(Debug, Clone)]
pub struct ChatFields {
    pub messages: Value,
    pub tools: Option<Value>,
    pub add_generation_prompt: bool,
    pub kwargs: Option<Value>,
    /// A Messages request: its system messages are merged into the first when the template
    /// needs the system message first ([`crate::chat_mapping::merge_inline_system`]).
    pub merge_inline_system: bool,
    /// Whether the rendered chat is encoded with special tokens added: vLLM 0.32 does for a
    /// Responses request (its render shows a second BOS), not for chat or Messages.
    pub add_special_tokens: bool,
}

/// A request body parsed once.
#[derive(Debug, Clone)]
pub struct ParsedRequest {
    pub kind: ApiKind,
    pub raw: Bytes,
    /// The model the body names; `None` when it names none (a vLLM server then serves its one
    /// model, and the picker the pool's one model).
    pub model: Option<String>,
    pub stream: bool,
    pub prompt: Option<Prompt>,
    pub chat: Option<ChatFields>,
    /// The client's own `cache_salt` (vLLM): the engine salts the prefix with it, so the
    /// picker hashes with it too (unless tenancy replaces it).
    pub cache_salt: Option<String>,
    /// A Responses request's `previous_response_id`: the conversation it continues.
    pub previous_response_id: Option<String>,
    /// A Responses request's `session_id` (vLLM): the conversation's stable name.
    pub session_id: Option<String>,
    /// Why the prompt of a Responses or Messages request is not read (its rendering is not
    /// reproduced): it is routed by model, tenant and load.
    pub unread: Option<&'static str>,
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
                add_special_tokens: chat.add_special_tokens,
            },
            (None, None) => return None,
        })
    }

    /// The chat's messages as `tok`'s engine renders them, when they differ from
    /// [`Self::prompt_input`]'s: a Messages request's inline system messages merged into the
    /// first for a template that needs the system message first.
    pub fn merged_messages(&self, tok: &crate::tokenize::PromptTokenizer) -> Option<Value> {
        let chat = self.chat.as_ref()?;
        (chat.merge_inline_system && tok.requires_system_first()).then(|| {
            Value::Array(crate::chat_mapping::merge_inline_system(
                chat.messages.as_array().map_or(&[][..], Vec::as_slice),
            ))
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
        if kind == ApiKind::Other {
            let head: OtherBodyFields = read_fields(&raw)?;
            let (model, stream, cache_salt) = Self::common_fields(
                head.model,
                head.stream,
                head.cache_salt,
                head.kv_transfer_params.is_some(),
            )?;
            return Ok(Self::without_prompt(kind, raw, model, stream, cache_salt));
        }
        if matches!(
            kind,
            ApiKind::Responses | ApiKind::Messages | ApiKind::Embeddings
        ) {
            let head: ConversationFields = read_fields(&raw)?;
            return Self::conversation(kind, raw, head, limits);
        }
        let head: BodyFields = read_fields(&raw)?;
        let (model, stream, cache_salt) = Self::common_fields(
            head.model,
            head.stream,
            head.cache_salt,
            head.kv_transfer_params.is_some(),
        )?;
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
                    merge_inline_system: false,
                    add_special_tokens: false,
                };
                (None, Some(chat))
            }
            ApiKind::Responses | ApiKind::Messages | ApiKind::Embeddings => {
                unreachable!("read by `ConversationFields` above")
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
            previous_response_id: None,
            session_id: None,
            unread: None,
        })
    }

    /// A request whose prompt is not (yet) read.
    fn without_prompt(
        kind: ApiKind,
        raw: Bytes,
        model: Option<String>,
        stream: bool,
        cache_salt: Option<String>,
    ) -> Self {
        Self {
            kind,
            raw,
            model,
            stream,
            prompt: None,
            chat: None,
            cache_salt,
            previous_response_id: None,
            session_id: None,
            unread: None,
        }
    }

    /// A Responses, Messages or embeddings body: the prompt as chat (or as a completions
    /// prompt for embeddings), and the conversation it names.
    fn conversation(
        kind: ApiKind,
        raw: Bytes,
        head: ConversationFields,
        limits: &RequestLimits,
    ) -> Result<Self, RequestError> {
        use crate::chat_mapping::{self as map, Unmapped};
        let (model, stream, cache_salt) = Self::common_fields(
            head.model,
            head.stream,
            head.cache_salt,
            head.kv_transfer_params.is_some(),
        )?;
        let id = |v: Option<Value>, name: &str| match v {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if !s.is_empty() && s.len() <= MAX_ID_BYTES => Ok(Some(s)),
            Some(_) => Err(RequestError::bad_request(
                "invalid_field",
                format!("`{name}` must be a non-empty string of at most {MAX_ID_BYTES} bytes"),
            )),
        };
        let mut out = Self::without_prompt(kind, raw, model, stream, cache_salt);
        let mapped = match kind {
            ApiKind::Embeddings => {
                let input = head.input.ok_or_else(|| {
                    RequestError::bad_request("missing_field", "missing required field `input`")
                })?;
                // text or token ids; other inputs (images, chat-style inputs) are not read
                out.prompt = Prompt::deserialize(input).ok();
                if out.prompt.is_none() {
                    out.unread = Some("embeddings input");
                }
                if let Some(Prompt::Ids(ids)) = &out.prompt
                    && ids.len() > limits.max_prompt_tokens
                {
                    return Err(RequestError::bad_request(
                        "prompt_too_long",
                        format!(
                            "the input has {} tokens, more than the limit of {}",
                            ids.len(),
                            limits.max_prompt_tokens
                        ),
                    ));
                }
                return Ok(out);
            }
            ApiKind::Responses => {
                out.previous_response_id = id(head.previous_response_id, "previous_response_id")?;
                out.session_id = id(head.session_id, "session_id")?;
                let input = head.input.ok_or_else(|| {
                    RequestError::bad_request("missing_field", "missing required field `input`")
                })?;
                if out.previous_response_id.is_some() {
                    // the engine prepends the stored conversation, which the picker does not
                    // hold: the conversation's pin routes it
                    out.unread = Some("previous_response_id");
                    return Ok(out);
                }
                map::responses_messages(head.instructions.as_ref(), input)
                    .and_then(|m| Ok((m, map::responses_tools(head.tools.as_ref())?, true)))
            }
            _ => {
                let messages = head.messages.ok_or_else(|| {
                    RequestError::bad_request("missing_field", "missing required field `messages`")
                })?;
                map::anthropic_messages(head.system.as_ref(), &messages)
                    .and_then(|m| Ok((m, map::anthropic_tools(head.tools.as_ref())?, false)))
            }
        };
        match mapped {
            Ok((messages, tools, responses)) => {
                if messages.len() > limits.max_messages {
                    return Err(RequestError::bad_request(
                        "too_many_messages",
                        format!(
                            "the request has {} messages, more than the limit of {}",
                            messages.len(),
                            limits.max_messages
                        ),
                    ));
                }
                out.chat = Some(ChatFields {
                    messages: Value::Array(messages),
                    tools,
                    add_generation_prompt: true,
                    kwargs: head.chat_template_kwargs.filter(Value::is_object),
                    merge_inline_system: !responses,
                    add_special_tokens: responses,
                });
            }
            Err(Unmapped::Invalid(m)) => {
                return Err(RequestError::bad_request("invalid_field", m));
            }
            Err(Unmapped::NotReproduced(why)) => out.unread = Some(why),
        }
        Ok(out)
    }

    /// `model`, `stream` and `cache_salt`, which every API reads alike; and no
    /// `kv_transfer_params` (`transfer`): only the picker's own prefill/decode split sets
    /// them. A client's would make a connector-equipped engine fetch KV from a host of the
    /// client's choice.
    fn common_fields(
        model: Option<Value>,
        stream: Option<Value>,
        cache_salt: Option<Value>,
        transfer: bool,
    ) -> Result<(Option<String>, bool, Option<String>), RequestError> {
        if transfer {
            return Err(RequestError::bad_request(
                "invalid_field",
                "`kv_transfer_params` is set by the router for a prefill/decode split, never by a client",
            ));
        }
        let model = match model {
            Some(Value::String(m)) if !m.is_empty() => Some(m),
            None | Some(Value::Null) => None,
            Some(_) => {
                return Err(RequestError::bad_request(
                    "invalid_field",
                    "`model` must be a non-empty string",
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

/// Longest `previous_response_id` or `session_id` accepted.
pub const MAX_ID_BYTES: usize = 256;

/// Longest client `cache_salt` accepted.
pub const MAX_CACHE_SALT_BYTES: usize = 1024;

/// The body to forward: the client's, rewritten only when a field must be injected (the
/// tenant's salt, replacing the client's own; SGLang's `data_parallel_rank`; the model a
/// rewrite rule sends it to). A body that must
/// carry the tenant's salt is always rewritten, so what the engine reads is a tree this process
/// built; one that cannot be rewritten is refused, never forwarded as it came: the engine would
/// see the client's own `cache_salt` (or none) while the index credits the tenant's.
pub fn engine_body(
    req: &ParsedRequest,
    tenant_salt: Option<&str>,
    data_parallel_rank: Option<u32>,
    model: Option<&str>,
) -> Result<Bytes, RequestError> {
    let mut inject: Vec<(&str, Value)> = Vec::new();
    if let Some(model) = model {
        inject.push(("model", Value::from(model)));
    }
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

/// The fields the picker reads from a request body, parsed once on the fast path. A body that
/// fails is parsed again, only then, to name the field at fault by its path in the body and
/// what it should be (`` `prompt[1]`: invalid type: string "x", expected a token id ``); a body
/// that is not JSON says where it stops being JSON.
fn read_fields<T: serde::de::DeserializeOwned>(raw: &[u8]) -> Result<T, RequestError> {
    let not_json = |e: serde_json::Error| {
        RequestError::bad_request(
            "invalid_json",
            format!("the request body is not valid JSON: {e}"),
        )
    };
    let e = match serde_json::from_slice(raw) {
        Ok(fields) => return Ok(fields),
        Err(e) if !e.is_data() => return Err(not_json(e)),
        Err(e) => e,
    };
    let mut de = serde_json::Deserializer::from_slice(raw);
    let Err(named) = serde_path_to_error::deserialize::<_, T>(&mut de) else {
        return Err(not_json(e)); // not reached: the same parse failed above
    };
    let path = named.path().to_string();
    if path == "." {
        return Err(not_json(e));
    }
    // serde's position is of no use to a client that built the body as an object
    let what = named.into_inner().to_string();
    let what = what
        .rsplit_once(" at line ")
        .map_or(what.as_str(), |(w, _)| w);
    let what = what.replace("expected u32", "expected a token id (an integer from 0)");
    Err(RequestError::bad_request(
        "invalid_field",
        format!("`{path}`: {what}"),
    ))
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

    /// Hardening IV, 7: a client's `kv_transfer_params` reached the engine (a
    /// `do_remote_prefill` from a host of its choice); refused on every API.
    #[test]
    fn a_clients_kv_transfer_params_are_refused_on_every_api() {
        let params = r#""kv_transfer_params":{"do_remote_prefill":true,"remote_host":"10.9.9.9","remote_port":5600}"#;
        for (kind, body) in [
            (
                ApiKind::Completions,
                format!(r#"{{"model":"m","prompt":"hi",{params}}}"#),
            ),
            (
                ApiKind::ChatCompletions,
                format!(
                    r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],{params}}}"#
                ),
            ),
            (
                ApiKind::Responses,
                format!(r#"{{"model":"m","input":"hi",{params}}}"#),
            ),
            (
                ApiKind::Messages,
                format!(
                    r#"{{"model":"m","max_tokens":5,"messages":[{{"role":"user","content":"hi"}}],{params}}}"#
                ),
            ),
            (
                ApiKind::Embeddings,
                format!(r#"{{"model":"m","input":"hi",{params}}}"#),
            ),
            (ApiKind::Other, format!(r#"{{"model":"m",{params}}}"#)),
        ] {
            let e = parse(kind, &body).expect_err(&body);
            assert_eq!((e.status, e.code), (400, "invalid_field"), "{kind:?}");
            assert!(e.message.contains("kv_transfer_params"), "{}", e.message);
        }
        // null is no parameters at all
        parse(
            ApiKind::Completions,
            r#"{"model":"m","prompt":"hi","kv_transfer_params":null}"#,
        )
        .expect("valid");
    }

    #[test]
    fn a_body_without_a_model_is_for_the_pools_one_model() {
        for body in [r#"{"prompt":"x"}"#, r#"{"model":null,"prompt":"x"}"#] {
            let r = parse(ApiKind::Completions, body).expect(body);
            assert_eq!(r.model, None, "{body}");
        }
        let r = parse(ApiKind::Completions, r#"{"model":"m","prompt":"x"}"#).expect("valid");
        assert_eq!(r.model.as_deref(), Some("m"));
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
            (r#"{"model":7,"prompt":"x"}"#, "invalid_field"),
            (
                r#"{"model":"m","prompt":"x","stream":"yes"}"#,
                "invalid_field",
            ),
        ] {
            let e = parse(ApiKind::Completions, body).expect_err(body);
            assert_eq!((e.status, e.code), (400, code), "{body}: {}", e.message);
            // no parser position where a field is at fault
            assert!(
                code == "invalid_json" || !e.message.contains(" at line "),
                "{body}: {}",
                e.message
            );
        }
        // a field of the wrong type is named by its path in the body
        for (kind, body, named) in [
            (
                ApiKind::Completions,
                r#"{"model":"m","prompt":[1,"x"]}"#,
                "`prompt[1]`: invalid type: string \"x\", expected a token id (an integer from 0)",
            ),
            (ApiKind::Other, r#"{"model":["m"]}"#, "`model` must be"),
            (
                ApiKind::Messages,
                r#"{"model":"m","messages":[],"stream":1}"#,
                "`stream`",
            ),
        ] {
            let e = parse(kind, body).expect_err(body);
            assert!(e.message.starts_with(named), "{body}: {}", e.message);
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

    #[test]
    fn one_conversation_reads_as_the_same_chat_on_every_api() {
        let chat = parse(
            ApiKind::ChatCompletions,
            r#"{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello."},{"role":"user","content":"Bye"}]}"#,
        )
        .expect("chat");
        let responses = parse(
            ApiKind::Responses,
            r#"{"model":"m","instructions":"Be brief.","input":[{"role":"user","content":"Hi"},{"type":"message","role":"assistant","content":[{"type":"output_text","text":"Hello."}]},{"role":"user","content":"Bye"}],"stream":true}"#,
        )
        .expect("responses");
        let messages = parse(
            ApiKind::Messages,
            r#"{"model":"m","max_tokens":8,"system":"Be brief.","messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":[{"type":"text","text":"Hello."}]},{"role":"user","content":"Bye"}]}"#,
        )
        .expect("messages");
        let want = &chat.chat.as_ref().expect("chat fields").messages;
        for r in [&responses, &messages] {
            let c = r.chat.as_ref().expect("chat fields");
            assert_eq!(&c.messages, want, "{:?}", r.kind);
            assert!(c.add_generation_prompt && r.unread.is_none());
        }
        assert!(responses.stream);
        let (r, m) = (responses.chat.expect("chat"), messages.chat.expect("chat"));
        // vLLM encodes a Responses chat with special tokens; it merges Messages' system turns
        assert!(r.add_special_tokens && !r.merge_inline_system);
        assert!(!m.add_special_tokens && m.merge_inline_system);
        assert!(!chat.chat.expect("chat").add_special_tokens);
    }

    #[test]
    fn a_continuation_or_an_unreproduced_item_is_routed_without_its_prompt() {
        let r = parse(
            ApiKind::Responses,
            r#"{"model":"m","previous_response_id":"resp_1","session_id":"s","input":"more"}"#,
        )
        .expect("valid");
        assert_eq!(r.previous_response_id.as_deref(), Some("resp_1"));
        assert_eq!(r.session_id.as_deref(), Some("s"));
        assert_eq!(
            (r.unread, r.prompt_input().is_none()),
            (Some("previous_response_id"), true)
        );
        let r = parse(
            ApiKind::Responses,
            r#"{"model":"m","input":[{"type":"item_reference","id":"x"}]}"#,
        )
        .expect("valid");
        assert_eq!(r.unread, Some("input item type"));
        for (kind, body) in [
            (ApiKind::Responses, r#"{"model":"m"}"#),
            (ApiKind::Responses, r#"{"model":"m","input":5}"#),
            (
                ApiKind::Responses,
                r#"{"model":"m","input":"x","previous_response_id":7}"#,
            ),
            (ApiKind::Messages, r#"{"model":"m","max_tokens":1}"#),
            (
                ApiKind::Messages,
                r#"{"model":"m","messages":[{"role":"user","content":7}]}"#,
            ),
            (ApiKind::Embeddings, r#"{"model":"m"}"#),
        ] {
            let e = parse(kind, body).expect_err(body);
            assert_eq!(e.status, 400, "{body}");
        }
        let e = parse(ApiKind::Embeddings, r#"{"model":"m","input":[1,2,3]}"#).expect("ids");
        assert_eq!(e.prompt, Some(Prompt::Ids(vec![1, 2, 3])));
    }
}
