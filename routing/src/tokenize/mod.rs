//! Turning an OpenAI-style request into the token ids the serving engine will see.
//!
//! The router hashes a prompt's KV blocks to find the endpoint that already holds them, so the
//! ids it hashes must be the ids the engine computes, byte for byte: one differing token at the
//! start shifts every block hash after it and turns a cache hit into a miss. This module
//! therefore reproduces the engine's (vLLM's / Hugging Face's) pipeline rather than anything
//! "close enough":
//!
//! * **Completions** (`PromptInput::Text`): encoded with special tokens added, as vLLM's
//!   completions endpoint does (this is where a Llama-3 tokenizer prepends `<|begin_of_text|>`).
//! * **Chat** (`PromptInput::Chat`): rendered with the model's Jinja chat template under the
//!   same rules Hugging Face `transformers` uses (`trim_blocks`, `lstrip_blocks`, loop controls,
//!   Python string/dict methods, HF's own `tojson`, `raise_exception`, `strftime_now`, Python
//!   rendering of `None`/`True`/`False`), then encoded *without* adding special tokens, because
//!   the template already wrote the BOS token.
//! * **Token ids** (`PromptInput::TokenIds`): passed through, checked against the vocabulary.
//!
//! Without a tokenizer the router still needs *some* prefix-preserving units to hash, so text is
//! mapped to one pseudo-token per Unicode scalar value ([`TokenKind::CharChunks`]); see
//! [`PromptTokenizer::char_chunk_tokens`] for how the caller groups them into blocks.
//!
//! Chat templates come from operators' configuration and request bodies come from anyone, so
//! both are treated as hostile: templates run with a fuel budget, a recursion limit and an
//! output cap, inputs are bounded in bytes, tokens and messages, and every failure is an
//! [`TokenizeError`] rather than a panic or a hang.
//!
//! # Where the result can still differ from the engine
//!
//! The test fixtures are rendered by `transformers` itself and compared byte for byte; what is
//! known not to match:
//!
//! * Object key order is kept only if the request JSON kept it: `serde_json` must be built with
//!   `preserve_order`, otherwise tool schemas print with sorted keys.
//! * Non-string values printed through `~`, `join` or string methods use minijinja's spelling
//!   (`none`, `true`); `{{ x }}`, `|string`, `|tojson` use Python's. `dict.items()` yields lists,
//!   so its repr shows `['k', 1]` where Python shows `('k', 1)`.
//! * Engine-side request rewriting is not reproduced: vLLM may flatten text-part arrays into a
//!   string for templates that expect one, and its request models can add `null` fields to
//!   tools. `continue_final_message` is not supported.
//! * `strftime_now` uses UTC; Python uses the server's local time zone.
//!
//! A template that deliberately builds a value nested hundreds of thousands of levels deep (for
//! instance `{% set ns.x = [ns.x] %}` in a loop) makes minijinja recurse that deep in `Drop`
//! and `Display`; fuel does not stop it because each level costs only a few units. Templates
//! therefore render on a large stack segment of their own ([`RENDER_STACK_BYTES`], switched to
//! on the calling thread with `stacker`), deep enough for anything the fuel budget lets a
//! template build. Request data cannot nest deeply
//! at all (its nesting is capped at 128 levels).

use std::fmt;

use minijinja::{Environment, Value};
use serde_json::Value as Json;
use tokenizers::Tokenizer;

pub mod bounded;
mod fallback;
pub mod piece_cache;
mod python;
mod template;
#[cfg(test)]
mod tests;

use self::bounded::{EncodeBound, EncodeFailure, EncodeGate};
use self::fallback::fallback_render;
pub use self::piece_cache::{PieceCacheOff, PieceCacheStats, PieceEncoder, PieceEncoding};
pub(crate) use self::python::{push_python_float, write_python_json_str};
use self::template::*;

/// Name under which the chat template is stored in the environment. It has no file extension
/// on purpose: minijinja picks HTML auto-escaping from `.html`-like names, and chat prompts
/// must never be escaped.
const TEMPLATE_NAME: &str = "chat_template";

/// Deepest JSON nesting accepted in messages, tools and template kwargs. `serde_json` refuses
/// to parse deeper documents by default, so this only bites for values built in code, and it
/// keeps every recursive walk here far away from the stack limit.
const MAX_JSON_DEPTH: usize = 128;

/// Deepest value nesting `tojson` and Python-style rendering will walk. Templates can build
/// nested lists in a loop, so the walk needs its own bound.
const MAX_RENDER_DEPTH: usize = 256;

/// Limits applied to every request.
///
/// The defaults admit 1M-token prompts. Fuel was sized by measurement: the test templates
/// needed about 0.5M fuel for a 5 MB single-message chat and about 0.55M for 8192 short
/// messages, so 3M leaves headroom for heavier real templates, while a template that burns it
/// all stops after roughly 0.1–0.4 s (release build) having allocated at most about
/// 3M × 64 B ≈ 190 MB along the way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenizeLimits {
    /// Upper bound on the prompt's text, in bytes: the completion text, or the sum of all
    /// strings (keys included) in a chat's messages, tools and template kwargs.
    pub max_prompt_bytes: usize,
    /// Upper bound on the number of token ids a prompt may produce or carry.
    pub max_tokens: usize,
    /// Upper bound on the number of chat messages.
    pub max_messages: usize,
    /// minijinja fuel per render. Every instruction costs one unit, and in minijinja 3 every
    /// 64 bytes a template creates (output, strings, lists) cost another, so fuel bounds both
    /// time and memory of a render.
    pub template_fuel: u64,
    /// Maximum nesting of macro calls / includes in a template.
    pub template_recursion: usize,
    /// Upper bound on the rendered chat prompt, in bytes.
    pub max_rendered_bytes: usize,
    /// Bytes of large texts (see [`bounded`]) this process encodes at once; one text alone is
    /// always admitted.
    pub max_encode_bytes_at_once: usize,
}

impl Default for TokenizeLimits {
    fn default() -> Self {
        Self {
            max_prompt_bytes: 8 << 20,
            max_tokens: 1 << 21,
            max_messages: 8192,
            template_fuel: 3_000_000,
            template_recursion: 100,
            max_rendered_bytes: 16 << 20,
            max_encode_bytes_at_once: 16 << 20,
        }
    }
}

/// Construction options that do not come from the model's files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptTokenizerOptions {
    /// How many [`TokenKind::CharChunks`] units (characters) the caller should hash per block
    /// when there is no tokenizer. Stored here so one object carries the whole tokenization
    /// policy; this module never groups ids itself.
    pub char_chunk_tokens: usize,
    /// Request limits.
    pub limits: TokenizeLimits,
    /// Token ids the piece cache may hold (see [`piece_cache`]); 0 turns it off.
    pub piece_cache_tokens: usize,
}

impl Default for PromptTokenizerOptions {
    fn default() -> Self {
        Self {
            // About four characters per token in English text: 64 characters is roughly one
            // 16-token KV block.
            char_chunk_tokens: 64,
            limits: TokenizeLimits::default(),
            // 16 MiB of ids: a few hundred long system prompts, documents and conversations.
            piece_cache_tokens: 1 << 22,
        }
    }
}

/// A chat template and the special-token strings it may reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatTemplateSource {
    /// Jinja source, as found in `tokenizer_config.json` or `chat_template.jinja`.
    pub source: String,
    /// Exposed to the template as `bos_token` (an empty string when absent, so templates that
    /// print it unconditionally still render).
    pub bos_token: Option<String>,
    /// Exposed to the template as `eos_token`.
    pub eos_token: Option<String>,
}

impl ChatTemplateSource {
    /// A template without special tokens.
    pub fn new(source: impl Into<String>) -> Self {
        Self {
            source: source.into(),
            bos_token: None,
            eos_token: None,
        }
    }

    /// Extracts the template and special tokens from a Hugging Face `tokenizer_config.json`.
    ///
    /// `chat_template` may be a string or the list-of-named-templates form
    /// (`[{"name": ..., "template": ...}]`), from which the template named `default` is taken,
    /// as `transformers` does when no name is requested. `bos_token` / `eos_token` may be plain
    /// strings or `AddedToken` objects (`{"content": ...}`). Returns `Ok(None)` when the file has
    /// no chat template: newer checkpoints ship it as a separate `chat_template.jinja`, which
    /// the caller then passes to [`ChatTemplateSource::new`] with the tokens from
    /// [`special_tokens_from_config`].
    pub fn from_tokenizer_config(config_json: &str) -> Result<Option<Self>, TokenizeError> {
        let config = parse_config(config_json)?;
        let source = match config.get("chat_template") {
            None | Some(Json::Null) => return Ok(None),
            Some(Json::String(s)) => s.clone(),
            Some(Json::Array(named)) => {
                let default = named
                    .iter()
                    .find(|entry| entry.get("name").and_then(Json::as_str) == Some("default"));
                match default
                    .and_then(|entry| entry.get("template"))
                    .and_then(Json::as_str)
                {
                    Some(s) => s.to_owned(),
                    None => {
                        return Err(TokenizeError::TokenizerConfig(
                            "chat_template is a list without a template named \"default\"".into(),
                        ));
                    }
                }
            }
            Some(other) => {
                return Err(TokenizeError::TokenizerConfig(format!(
                    "chat_template must be a string or a list of named templates, not {}",
                    json_kind(other)
                )));
            }
        };
        let (bos_token, eos_token) = special_tokens_of(&config)?;
        Ok(Some(Self {
            source,
            bos_token,
            eos_token,
        }))
    }
}

/// Reads `bos_token` and `eos_token` from a `tokenizer_config.json`, for checkpoints whose
/// template lives in a separate file.
pub fn special_tokens_from_config(
    config_json: &str,
) -> Result<(Option<String>, Option<String>), TokenizeError> {
    special_tokens_of(&parse_config(config_json)?)
}

fn parse_config(config_json: &str) -> Result<serde_json::Map<String, Json>, TokenizeError> {
    match serde_json::from_str::<Json>(config_json) {
        Ok(Json::Object(map)) => Ok(map),
        Ok(other) => Err(TokenizeError::TokenizerConfig(format!(
            "expected a JSON object, found {}",
            json_kind(&other)
        ))),
        Err(err) => Err(TokenizeError::TokenizerConfig(err.to_string())),
    }
}

fn special_tokens_of(
    config: &serde_json::Map<String, Json>,
) -> Result<(Option<String>, Option<String>), TokenizeError> {
    fn token(
        config: &serde_json::Map<String, Json>,
        key: &str,
    ) -> Result<Option<String>, TokenizeError> {
        match config.get(key) {
            None | Some(Json::Null) => Ok(None),
            Some(Json::String(s)) => Ok(Some(s.clone())),
            Some(Json::Object(obj)) => match obj.get("content") {
                Some(Json::String(s)) => Ok(Some(s.clone())),
                _ => Err(TokenizeError::TokenizerConfig(format!(
                    "{key} is an object without a string \"content\""
                ))),
            },
            Some(other) => Err(TokenizeError::TokenizerConfig(format!(
                "{key} must be a string or an object with \"content\", not {}",
                json_kind(other)
            ))),
        }
    }
    Ok((token(config, "bos_token")?, token(config, "eos_token")?))
}

/// What to tokenize.
#[derive(Debug, Clone, Copy)]
pub enum PromptInput<'a> {
    /// A completions prompt: encoded with special tokens added.
    Text(&'a str),
    /// Pre-tokenized prompt: passed through after validation.
    TokenIds(&'a [u32]),
    /// A chat completion request.
    Chat {
        /// The OpenAI `messages` array, exactly as received. Message content may be a string or
        /// an array of parts (`[{"type": "text", "text": ...}]`); both are handed to the
        /// template unchanged, since templates are written to handle either.
        messages: &'a Json,
        /// The OpenAI `tools` array, if any. The template sees `none` when absent.
        tools: Option<&'a Json>,
        /// Whether the template should open an assistant turn at the end.
        add_generation_prompt: bool,
        /// Extra template variables (vLLM's `chat_template_kwargs`), a JSON object. They may
        /// override `bos_token`/`eos_token` (as in `transformers`) but not `messages`, `tools`
        /// or `add_generation_prompt`.
        extra: Option<&'a Json>,
        /// Whether the rendered text is encoded with the tokenizer's special tokens added, as
        /// vLLM 0.32 does for a Responses request (a Llama-style tokenizer then prepends a
        /// second BOS to the one the template wrote); chat completions does not.
        add_special_tokens: bool,
    },
}

/// What the ids in a [`TokenizedPrompt`] are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenKind {
    /// Real token ids of the model's tokenizer: hash them in blocks of the engine's KV block
    /// size.
    Tokens,
    /// No tokenizer is configured: one id per Unicode scalar value (the code point). Hash them
    /// in blocks of [`PromptTokenizer::char_chunk_tokens`].
    CharChunks,
}

/// The result of [`PromptTokenizer::tokenize`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizedPrompt {
    /// Token ids (or character pseudo-ids, see [`TokenKind`]).
    pub ids: Vec<u32>,
    /// What `ids` holds.
    pub kind: TokenKind,
    /// Characters of the text that was encoded (the rendered chat or the completion prompt);
    /// 0 for token-id input.
    pub rendered_chars: usize,
    /// How many of `ids` came from the piece cache instead of the tokenizer.
    pub cached_tokens: usize,
}

/// Which template limit stopped a render.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TemplateLimit {
    /// [`TokenizeLimits::template_fuel`].
    Fuel,
    /// [`TokenizeLimits::template_recursion`].
    Recursion,
    /// [`TokenizeLimits::max_rendered_bytes`].
    RenderedBytes,
}

impl fmt::Display for TemplateLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Fuel => "template_fuel",
            Self::Recursion => "template_recursion",
            Self::RenderedBytes => "max_rendered_bytes",
        })
    }
}

/// Which input limit a request exceeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputLimit {
    /// [`TokenizeLimits::max_prompt_bytes`].
    PromptBytes,
    /// [`TokenizeLimits::max_tokens`].
    Tokens,
    /// [`TokenizeLimits::max_messages`].
    Messages,
}

impl fmt::Display for InputLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::PromptBytes => "bytes (limits.maxBodyBytes)",
            Self::Tokens => "tokens (limits.maxPromptTokens)",
            Self::Messages => "messages (limits.maxMessages)",
        })
    }
}

/// Everything that can go wrong building a [`PromptTokenizer`] or tokenizing a prompt.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenizeError {
    /// `tokenizer.json` could not be parsed or is not a usable tokenizer.
    #[error("tokenizer.json could not be loaded: {0}")]
    TokenizerLoad(String),
    /// `tokenizer_config.json` could not be parsed or has unexpected field types.
    #[error("tokenizer_config.json is invalid: {0}")]
    TokenizerConfig(String),
    /// Options that cannot work (such as a zero chunk size).
    #[error("invalid tokenizer options: {0}")]
    InvalidOptions(String),
    /// The chat template does not compile.
    #[error("chat template does not compile: {0}")]
    TemplateSyntax(String),
    /// The template called `raise_exception(message)`; templates use it to reject
    /// conversations they cannot format (wrong role order, unsupported content).
    #[error("chat template rejected the conversation: {0}")]
    TemplateRaised(String),
    /// The template failed at run time for another reason.
    #[error("chat template failed to render: {0}")]
    TemplateRender(String),
    /// The template hit one of the execution limits.
    #[error("chat template exceeded the {limit} limit ({max})")]
    TemplateLimit {
        /// The limit that was hit.
        limit: TemplateLimit,
        /// Its configured value.
        max: u64,
    },
    /// The request exceeds one of the input limits.
    #[error("the prompt has at least {actual} {limit}, more than the limit of {max}")]
    InputLimit {
        /// The limit that was exceeded.
        limit: InputLimit,
        /// The request's value (for bytes, at least this much: counting stops early).
        actual: usize,
        /// Its configured value.
        max: usize,
    },
    /// A token id in a pre-tokenized prompt is not in the vocabulary.
    #[error("token id {id} at position {index} is out of vocabulary (largest id is {max_id})")]
    TokenOutOfVocab {
        /// The offending id.
        id: u32,
        /// Its position in the prompt.
        index: usize,
        /// The largest id the tokenizer knows.
        max_id: u32,
    },
    /// The messages, tools or kwargs are not shaped like an OpenAI chat request.
    #[error("invalid chat request: {0}")]
    InvalidChat(String),
    /// The tokenizer failed on the text.
    #[error("tokenizer failed to encode the prompt: {0}")]
    Encode(String),
    /// Other large prompts are being tokenized; this one would take the text being encoded at
    /// once past its limit.
    #[error(
        "the picker is tokenizing other large prompts: this one's {bytes} bytes would take the text being tokenized at once past limits.tokenizeBytesAtOnce ({limit}); retry"
    )]
    Busy { bytes: usize, limit: usize },
}

/// Converts requests into token ids; build once per model and share (it is `Send + Sync`).
pub struct PromptTokenizer {
    tokenizer: Option<Tokenizer>,
    /// Piece-wise encoding with a cache of repeated pieces, when the tokenizer allows it.
    pieces: Result<PieceEncoder, PieceCacheOff>,
    /// Largest id in the vocabulary including added tokens; ids above it are rejected.
    max_token_id: Option<u32>,
    template: Option<CompiledTemplate>,
    char_chunk_tokens: usize,
    limits: TokenizeLimits,
    /// Whether the template refuses a system message after the first message.
    system_first: bool,
}

/// A compiled chat template. The environment owns its source, so compilation happens once and
/// each request only looks the template up and runs it.
struct CompiledTemplate {
    env: Environment<'static>,
    bos_token: Value,
    eos_token: Value,
}

impl fmt::Debug for PromptTokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PromptTokenizer")
            .field("has_tokenizer", &self.tokenizer.is_some())
            .field("pieces", &self.pieces)
            .field("max_token_id", &self.max_token_id)
            .field("has_chat_template", &self.template.is_some())
            .field("char_chunk_tokens", &self.char_chunk_tokens)
            .field("limits", &self.limits)
            .finish()
    }
}

impl PromptTokenizer {
    /// Builds a tokenizer from the model's `tokenizer.json` bytes (if any) and chat template (if
    /// any).
    ///
    /// Truncation and padding stored in `tokenizer.json` are switched off: `transformers`
    /// applies neither unless a call asks for it, and the engine does not ask.
    pub fn new(
        tokenizer_json: Option<&[u8]>,
        template: Option<ChatTemplateSource>,
        options: PromptTokenizerOptions,
    ) -> Result<Self, TokenizeError> {
        if options.char_chunk_tokens == 0 {
            return Err(TokenizeError::InvalidOptions(
                "char_chunk_tokens must be at least 1".into(),
            ));
        }
        let (tokenizer, max_token_id) = match tokenizer_json {
            Some(bytes) => {
                let (tokenizer, max_id) = load_tokenizer(bytes)?;
                (Some(tokenizer), Some(max_id))
            }
            None => (None, None),
        };
        let pieces = match &tokenizer {
            Some(t) => PieceEncoder::new(t, options.piece_cache_tokens),
            None => Err(PieceCacheOff::Disabled),
        };
        let template = template
            .map(|t| compile_template(t, &options.limits))
            .transpose()?;
        let mut out = Self {
            tokenizer,
            pieces,
            max_token_id,
            template,
            char_chunk_tokens: options.char_chunk_tokens,
            limits: options.limits,
            system_first: true,
        };
        out.system_first = out.template.is_none() || {
            let probe = serde_json::json!([
                {"role": "system", "content": "t"},
                {"role": "user", "content": "t"},
                {"role": "system", "content": "t"},
                {"role": "user", "content": "t"}
            ]);
            out.render_chat(&probe, None, false, None).is_err()
        };
        Ok(out)
    }

    /// Whether the chat template needs the system message first: it fails on
    /// `[system, user, system, user]`, or there is none. vLLM probes templates the same way
    /// to decide whether a Messages request's inline system messages are merged into the
    /// first ([`crate::chat_mapping::merge_inline_system`]).
    pub fn requires_system_first(&self) -> bool {
        self.system_first
    }

    /// Builds a tokenizer from the contents of a model's `tokenizer.json` and
    /// `tokenizer_config.json` (chat template and special tokens), either of which may be
    /// missing.
    pub fn from_hf_files(
        tokenizer_json: Option<&[u8]>,
        tokenizer_config_json: Option<&str>,
        options: PromptTokenizerOptions,
    ) -> Result<Self, TokenizeError> {
        let template = match tokenizer_config_json {
            Some(config) => ChatTemplateSource::from_tokenizer_config(config)?,
            None => None,
        };
        Self::new(tokenizer_json, template, options)
    }

    /// Whether real token ids are produced ([`TokenKind::Tokens`]) for text and chat input.
    pub fn has_tokenizer(&self) -> bool {
        self.tokenizer.is_some()
    }

    /// Whether chats are rendered with a real chat template (otherwise with the fallback
    /// described at [`PromptTokenizer::render_chat`]).
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// Largest valid token id, when a tokenizer is configured.
    pub fn max_token_id(&self) -> Option<u32> {
        self.max_token_id
    }

    /// How many [`TokenKind::CharChunks`] units make one hashed block.
    pub fn char_chunk_tokens(&self) -> usize {
        self.char_chunk_tokens
    }

    /// The limits in force.
    pub fn limits(&self) -> &TokenizeLimits {
        &self.limits
    }

    /// The piece cache's counters, or why this tokenizer has none.
    pub fn piece_cache(&self) -> Result<PieceCacheStats, &PieceCacheOff> {
        self.pieces.as_ref().map(PieceEncoder::stats)
    }

    /// Tokenizes one request.
    pub fn tokenize(&self, input: PromptInput<'_>) -> Result<TokenizedPrompt, TokenizeError> {
        match input {
            PromptInput::Text(text) => {
                check_prompt_bytes(text.len(), &self.limits)?;
                self.encode(text, true)
            }
            PromptInput::TokenIds(ids) => self.pass_through(ids),
            PromptInput::Chat {
                messages,
                tools,
                add_generation_prompt,
                extra,
                add_special_tokens,
            } => {
                let rendered = self.render_chat(messages, tools, add_generation_prompt, extra)?;
                // A real template writes BOS itself; the fallback rendering has none, so the
                // tokenizer's post-processor adds it as it would for a plain prompt.
                self.encode(&rendered, add_special_tokens || self.template.is_none())
            }
        }
    }

    /// Renders a chat to the prompt text the engine would tokenize.
    ///
    /// With a chat template, the template receives `messages`, `tools` (or `none`),
    /// `add_generation_prompt`, `bos_token`, `eos_token` and the keys of `extra`, like
    /// `transformers`' `apply_chat_template`, which also drops `null`-valued message fields and
    /// copies reasoning text to both `thinking` and `reasoning_content`.
    ///
    /// Without one, a fixed fallback format is used so that chats still map to stable,
    /// prefix-preserving text: `<|tools|>\n{tools as compact JSON}\n` when tools are given, then
    /// per message `<|{role}|>\n{content}\n` (string content as is; for part arrays the `text`
    /// of text parts and the compact JSON of any other part, joined by `\n`; `tool_calls`, if
    /// present, appended as `<|tool_calls|>{compact JSON}\n`), then `<|assistant|>\n` when
    /// `add_generation_prompt` is set. It will not match what an engine renders, but equal chat
    /// prefixes still give equal text prefixes.
    pub fn render_chat(
        &self,
        messages: &Json,
        tools: Option<&Json>,
        add_generation_prompt: bool,
        extra: Option<&Json>,
    ) -> Result<String, TokenizeError> {
        let list = match messages {
            Json::Array(list) => list,
            other => {
                return Err(TokenizeError::InvalidChat(format!(
                    "messages must be an array, not {}",
                    json_kind(other)
                )));
            }
        };
        if list.len() > self.limits.max_messages {
            return Err(TokenizeError::InputLimit {
                limit: InputLimit::Messages,
                actual: list.len(),
                max: self.limits.max_messages,
            });
        }
        for (index, message) in list.iter().enumerate() {
            if !message.is_object() {
                return Err(TokenizeError::InvalidChat(format!(
                    "message {index} must be an object, not {}",
                    json_kind(message)
                )));
            }
        }
        if let Some(extra) = extra
            && !extra.is_object()
        {
            return Err(TokenizeError::InvalidChat(format!(
                "chat template kwargs must be an object, not {}",
                json_kind(extra)
            )));
        }
        match &self.template {
            Some(template) => on_render_stack(|| {
                template.render(
                    messages,
                    tools.filter(|t| !t.is_null()),
                    add_generation_prompt,
                    extra,
                    &self.limits,
                )
            }),
            None => fallback_render(list, tools, add_generation_prompt, &self.limits),
        }
    }

    fn encode(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<TokenizedPrompt, TokenizeError> {
        let rendered_chars = text.chars().count();
        let Some(tokenizer) = &self.tokenizer else {
            return Ok(TokenizedPrompt {
                ids: char_chunk_ids(text),
                kind: TokenKind::CharChunks,
                rendered_chars,
                cached_tokens: 0,
            });
        };
        // `encode_fast` skips offset tracking, which the router never needs; the bound stops
        // a text far over the token limit before it is encoded whole.
        let bound = EncodeBound {
            max_tokens: self.limits.max_tokens,
            max_bytes_at_once: self.limits.max_encode_bytes_at_once,
            gate: EncodeGate::global(),
        };
        let encoded = match &self.pieces {
            Ok(pieces) => pieces.encode_bounded(tokenizer, text, add_special_tokens, &bound),
            Err(_) => {
                let mut ids = Vec::new();
                bound
                    .encode_into(tokenizer, text, add_special_tokens, &mut ids)
                    .map(|()| PieceEncoding {
                        ids,
                        cached_tokens: 0,
                    })
            }
        }
        .map_err(|failure| match failure {
            EncodeFailure::Tokenizer(err) => TokenizeError::Encode(err.to_string()),
            EncodeFailure::OverLimit { at_least } => TokenizeError::InputLimit {
                limit: InputLimit::Tokens,
                actual: at_least,
                max: self.limits.max_tokens,
            },
            EncodeFailure::Busy { bytes, limit } => TokenizeError::Busy { bytes, limit },
        })?;
        Ok(TokenizedPrompt {
            ids: encoded.ids,
            kind: TokenKind::Tokens,
            rendered_chars,
            cached_tokens: encoded.cached_tokens,
        })
    }

    fn pass_through(&self, ids: &[u32]) -> Result<TokenizedPrompt, TokenizeError> {
        if ids.len() > self.limits.max_tokens {
            return Err(TokenizeError::InputLimit {
                limit: InputLimit::Tokens,
                actual: ids.len(),
                max: self.limits.max_tokens,
            });
        }
        if let Some(max_id) = self.max_token_id
            && let Some((index, &id)) = ids.iter().enumerate().find(|&(_, &id)| id > max_id)
        {
            return Err(TokenizeError::TokenOutOfVocab { id, index, max_id });
        }
        Ok(TokenizedPrompt {
            ids: ids.to_vec(),
            kind: TokenKind::Tokens,
            rendered_chars: 0,
            cached_tokens: 0,
        })
    }
}

/// One pseudo-token per Unicode scalar value, the code point itself. Characters rather than
/// bytes because they are closer to tokens in count (so blocks of `char_chunk_tokens` cost
/// less to hash, and CJK text is not tripled) and code points need no table; equal text
/// prefixes give equal id prefixes either way.
fn char_chunk_ids(text: &str) -> Vec<u32> {
    text.chars().map(u32::from).collect()
}

fn check_prompt_bytes(len: usize, limits: &TokenizeLimits) -> Result<(), TokenizeError> {
    if len > limits.max_prompt_bytes {
        return Err(TokenizeError::InputLimit {
            limit: InputLimit::PromptBytes,
            actual: len,
            max: limits.max_prompt_bytes,
        });
    }
    Ok(())
}

fn load_tokenizer(bytes: &[u8]) -> Result<(Tokenizer, u32), TokenizeError> {
    let mut tokenizer = Tokenizer::from_bytes(bytes)
        .map_err(|err| TokenizeError::TokenizerLoad(err.to_string()))?;
    tokenizer
        .with_truncation(None)
        .map_err(|err| TokenizeError::TokenizerLoad(err.to_string()))?;
    tokenizer.with_padding(None);
    let max_id = tokenizer
        .get_vocab(true)
        .into_values()
        .max()
        .ok_or_else(|| TokenizeError::TokenizerLoad("the vocabulary is empty".into()))?;
    Ok((tokenizer, max_id))
}

fn json_kind(value: &Json) -> &'static str {
    match value {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "an array",
        Json::Object(_) => "an object",
    }
}
