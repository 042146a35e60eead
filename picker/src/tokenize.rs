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

use std::borrow::Cow;
use std::fmt::{self, Write as _};
use std::io;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{AutoEscape, Environment, ErrorKind, Output, State, Value};
use serde_json::Value as Json;
use tokenizers::Tokenizer;

use crate::token_cache::{PieceCacheOff, PieceCacheStats, PieceEncoder, PieceEncoding};

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
    /// Token ids the piece cache may hold (see [`crate::token_cache`]); 0 turns it off.
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
            Self::PromptBytes => "max_prompt_bytes",
            Self::Tokens => "max_tokens",
            Self::Messages => "max_messages",
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
    #[error("prompt exceeds the {limit} limit: {actual} > {max}")]
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
        Ok(Self {
            tokenizer,
            pieces,
            max_token_id,
            template,
            char_chunk_tokens: options.char_chunk_tokens,
            limits: options.limits,
        })
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
            } => {
                let rendered = self.render_chat(messages, tools, add_generation_prompt, extra)?;
                // A real template writes BOS itself; the fallback rendering has none, so the
                // tokenizer's post-processor adds it as it would for a plain prompt.
                self.encode(&rendered, self.template.is_none())
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
        // `encode_fast` skips offset tracking, which the router never needs.
        let encoded = match &self.pieces {
            Ok(pieces) => pieces.encode(tokenizer, text, add_special_tokens),
            Err(_) => tokenizer
                .encode_fast(text, add_special_tokens)
                .map(|e| PieceEncoding {
                    ids: e.get_ids().to_vec(),
                    cached_tokens: 0,
                }),
        }
        .map_err(|err| TokenizeError::Encode(err.to_string()))?;
        if encoded.ids.len() > self.limits.max_tokens {
            return Err(TokenizeError::InputLimit {
                limit: InputLimit::Tokens,
                actual: encoded.ids.len(),
                max: self.limits.max_tokens,
            });
        }
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

// ---------------------------------------------------------------------------------------------
// Chat templates
// ---------------------------------------------------------------------------------------------

fn compile_template(
    template: ChatTemplateSource,
    limits: &TokenizeLimits,
) -> Result<CompiledTemplate, TokenizeError> {
    let mut env = Environment::new();
    // transformers compiles templates with `trim_blocks=True, lstrip_blocks=True`; everything
    // else in the syntax is Jinja's default, which minijinja shares.
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|err| TokenizeError::TemplateSyntax(err.to_string()))?;
    env.set_syntax(syntax);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(python_formatter);
    env.set_fuel(Some(limits.template_fuel));
    env.set_recursion_limit(limits.template_recursion);
    let tojson_cap = limits.max_rendered_bytes;
    env.add_filter(
        "tojson",
        move |state: &State, value: &Value, kwargs: Kwargs| {
            tojson_filter(state, value, kwargs, tojson_cap)
        },
    );
    // Python's `str()` / `pprint` of a container is its repr (`['a', None]`); minijinja's
    // versions print JSON-like text (`["a", none]`) through unbounded recursion.
    env.add_filter("string", string_filter);
    env.add_filter("pprint", string_filter);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    let source = match rewrite_generation_tags(&template.source) {
        Cow::Borrowed(_) => template.source,
        Cow::Owned(rewritten) => rewritten,
    };
    env.add_template_owned(TEMPLATE_NAME, source)
        .map_err(|err| TokenizeError::TemplateSyntax(err.to_string()))?;
    let token = |t: Option<String>| Value::from(t.unwrap_or_default());
    Ok(CompiledTemplate {
        env,
        bos_token: token(template.bos_token),
        eos_token: token(template.eos_token),
    })
}

impl CompiledTemplate {
    fn render(
        &self,
        messages: &Json,
        tools: Option<&Json>,
        add_generation_prompt: bool,
        extra: Option<&Json>,
        limits: &TokenizeLimits,
    ) -> Result<String, TokenizeError> {
        let mut budget = ByteBudget::new(limits.max_prompt_bytes);
        let messages = messages_to_value(messages, &mut budget)?;
        let tools = match tools {
            Some(tools) => json_to_value(tools, 0, &mut budget)?,
            None => Value::from(()),
        };
        // Same precedence as transformers: special tokens first, caller kwargs may override
        // them, and the three request fields always win. `documents` is always defined (as
        // `none` unless given), because transformers passes it and `documents is not none`
        // is true for an undefined name.
        let mut context: Vec<(Value, Value)> = Vec::with_capacity(8);
        context.push((Value::from("bos_token"), self.bos_token.clone()));
        context.push((Value::from("eos_token"), self.eos_token.clone()));
        context.push((Value::from("documents"), Value::from(())));
        if let Some(Json::Object(extra)) = extra {
            for (key, value) in extra {
                budget.charge(key.len())?;
                context.push((
                    Value::from(key.as_str()),
                    json_to_value(value, 1, &mut budget)?,
                ));
            }
        }
        context.push((Value::from("messages"), messages));
        context.push((Value::from("tools"), tools));
        context.push((
            Value::from("add_generation_prompt"),
            Value::from(add_generation_prompt),
        ));
        let context = Value::from_pairs(context);

        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|err| TokenizeError::TemplateSyntax(err.to_string()))?;
        let mut out = CappedWriter {
            // Templates add little around the conversation; reserving the input size up front
            // avoids most reallocations of a large prompt.
            buf: Vec::with_capacity((budget.used + 4096).min(limits.max_rendered_bytes)),
            cap: limits.max_rendered_bytes,
            overflowed: false,
        };
        let result = template.render_captured_to(context, &mut out);
        if out.overflowed {
            return Err(TokenizeError::TemplateLimit {
                limit: TemplateLimit::RenderedBytes,
                max: limits.max_rendered_bytes as u64,
            });
        }
        if let Err(err) = result {
            return Err(classify_render_error(&err, limits));
        }
        String::from_utf8(out.buf).map_err(|err| TokenizeError::TemplateRender(err.to_string()))
    }
}

/// Counts the string bytes of the request as it is converted, so an oversized chat is rejected
/// before the template runs.
struct ByteBudget {
    used: usize,
    max: usize,
}

impl ByteBudget {
    fn new(max: usize) -> Self {
        Self { used: 0, max }
    }

    fn charge(&mut self, bytes: usize) -> Result<(), TokenizeError> {
        self.used = self.used.saturating_add(bytes);
        if self.used > self.max {
            return Err(TokenizeError::InputLimit {
                limit: InputLimit::PromptBytes,
                actual: self.used,
                max: self.max,
            });
        }
        Ok(())
    }
}

/// Message fields that carry reasoning, in the order `transformers` looks for them.
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// Converts the messages the way `transformers`' `apply_chat_template` (5.x) prepares them:
/// keys whose value is `null` are dropped (OpenAI clients send `"content": null` next to
/// `tool_calls`; a template then sees an undefined field rather than printing `None`), and a
/// message with reasoning under any of its names gets it under both `thinking` and
/// `reasoning_content` (as `{"thinking": r, **message, "reasoning_content": r}`), since
/// templates read one or the other.
fn messages_to_value(messages: &Json, budget: &mut ByteBudget) -> Result<Value, TokenizeError> {
    let Json::Array(list) = messages else {
        return json_to_value(messages, 0, budget);
    };
    let mut out = Vec::with_capacity(list.len());
    for message in list {
        let Json::Object(map) = message else {
            out.push(json_to_value(message, 1, budget)?);
            continue;
        };
        let reasoning = REASONING_FIELDS
            .iter()
            .find_map(|&key| map.get(key).filter(|v| !v.is_null()).map(|v| (key, v)));
        let reasoning = match reasoning {
            Some((key, value)) => Some((key, json_to_value(value, 2, budget)?)),
            None => None,
        };
        let mut pairs: Vec<(Value, Value)> = Vec::with_capacity(map.len() + 2);
        if let Some((_, value)) = &reasoning {
            pairs.push((Value::from("thinking"), value.clone()));
        }
        for (key, value) in map {
            if value.is_null() {
                continue;
            }
            budget.charge(key.len())?;
            let value = match &reasoning {
                Some((source, converted)) if source == key => converted.clone(),
                _ => json_to_value(value, 2, budget)?,
            };
            pairs.push((Value::from(key.as_str()), value));
        }
        if let Some((_, value)) = reasoning {
            pairs.push((Value::from("reasoning_content"), value));
        }
        // Later pairs overwrite earlier ones in place, like keys in a Python dict literal.
        out.push(Value::from_pairs(pairs));
    }
    Ok(Value::from(out))
}

/// Converts request JSON to template values, keeping object key order (minijinja's
/// `preserve_order`), as Python dicts do: `tojson` and `.items()` must list keys in the order
/// the client sent them.
fn json_to_value(
    json: &Json,
    depth: usize,
    budget: &mut ByteBudget,
) -> Result<Value, TokenizeError> {
    if depth > MAX_JSON_DEPTH {
        return Err(TokenizeError::InvalidChat(format!(
            "JSON nested deeper than {MAX_JSON_DEPTH} levels"
        )));
    }
    Ok(match json {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        Json::String(s) => {
            budget.charge(s.len())?;
            Value::from(s.as_str())
        }
        Json::Array(items) => {
            let mut out = Vec::with_capacity(items.len());
            for item in items {
                out.push(json_to_value(item, depth + 1, budget)?);
            }
            Value::from(out)
        }
        Json::Object(map) => {
            let mut out = Vec::with_capacity(map.len());
            for (key, value) in map {
                budget.charge(key.len())?;
                out.push((
                    Value::from(key.as_str()),
                    json_to_value(value, depth + 1, budget)?,
                ));
            }
            Value::from_pairs(out)
        }
    })
}

/// Collects the rendered prompt and refuses to grow past `cap`. minijinja stops rendering on
/// the first write error, so a template that prints without end is cut off at the cap instead
/// of only when the fuel runs out.
struct CappedWriter {
    buf: Vec<u8>,
    cap: usize,
    overflowed: bool,
}

impl io::Write for CappedWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.buf.len().saturating_add(data.len()) > self.cap {
            self.overflowed = true;
            return Err(io::Error::other(
                "rendered prompt exceeds max_rendered_bytes",
            ));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The error a template's `raise_exception(...)` call carries, so it can be told apart from
/// engine errors after minijinja wraps it.
#[derive(Debug)]
struct RaisedByTemplate(String);

impl fmt::Display for RaisedByTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedByTemplate {}

/// Stack reserved for one template render. minijinja's value `Drop` and `Display` recurse
/// once per nesting level, and a template can nest a value once per few fuel units
/// (`{% set ns.x = [ns.x] %}` in a loop), far deeper than any thread's default stack holds.
/// The stack is virtual memory: only what a render actually touches is committed, and fuel
/// bounds that. Measured: the deepest nesting the default fuel allows fits with room to spare
/// (`tests::a_template_nesting_values_as_deep_as_fuel_allows_does_not_overflow`).
pub const RENDER_STACK_BYTES: usize = 1 << 30;

/// Runs a render on a fresh stack segment of [`RENDER_STACK_BYTES`] on the calling thread
/// (`stacker` maps it, switches to it, and unmaps it afterwards; no thread is started), so a
/// hostile template ends in an error instead of overflowing the caller's stack, which would
/// abort the process. A panic inside the template engine becomes an error too.
fn on_render_stack<F>(render: F) -> Result<String, TokenizeError>
where
    F: FnOnce() -> Result<String, TokenizeError>,
{
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        stacker::grow(RENDER_STACK_BYTES, render)
    }))
    .unwrap_or_else(|_| {
        Err(TokenizeError::TemplateRender(
            "the chat template panicked".into(),
        ))
    })
}

/// Marks an error raised because a filter's output would exceed `max_rendered_bytes`.
#[derive(Debug)]
struct RenderedBytesExceeded;

impl fmt::Display for RenderedBytesExceeded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("output exceeds max_rendered_bytes")
    }
}

impl std::error::Error for RenderedBytesExceeded {}

fn classify_render_error(err: &minijinja::Error, limits: &TokenizeLimits) -> TokenizeError {
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = current {
        if let Some(raised) = e.downcast_ref::<RaisedByTemplate>() {
            return TokenizeError::TemplateRaised(raised.0.clone());
        }
        if e.downcast_ref::<RenderedBytesExceeded>().is_some() {
            return TokenizeError::TemplateLimit {
                limit: TemplateLimit::RenderedBytes,
                max: limits.max_rendered_bytes as u64,
            };
        }
        if let Some(jinja) = e.downcast_ref::<minijinja::Error>() {
            if jinja.kind() == ErrorKind::OutOfFuel {
                return TokenizeError::TemplateLimit {
                    limit: TemplateLimit::Fuel,
                    max: limits.template_fuel,
                };
            }
            // minijinja reports the recursion limit as a generic invalid operation; its
            // message is the only distinguishing mark (pinned by a test).
            if jinja.detail() == Some("recursion limit exceeded") {
                return TokenizeError::TemplateLimit {
                    limit: TemplateLimit::Recursion,
                    max: limits.template_recursion as u64,
                };
            }
        }
        current = e.source();
    }
    TokenizeError::TemplateRender(err.to_string())
}

/// `raise_exception(message)`: templates call it to reject conversations they cannot format.
fn raise_exception(message: Value) -> Result<Value, minijinja::Error> {
    let message = match message.as_str() {
        Some(s) => s.to_owned(),
        None => message.to_string(),
    };
    Err(
        minijinja::Error::new(ErrorKind::InvalidOperation, message.clone())
            .with_source(RaisedByTemplate(message)),
    )
}

/// `strftime_now(format)`: the current time, formatted like Python's `strftime`. Llama 3.x
/// templates print today's date with it. The time is UTC (Python uses local time, which is UTC
/// in typical serving containers).
fn strftime_now(format: &str) -> Result<Value, minijinja::Error> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0);
    Ok(Value::from(format_strftime(format, secs)))
}

const WEEKDAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// Formats a UTC Unix timestamp with the C-locale `strftime` directives templates use
/// (`%a %A %b %B %h %d %e %m %y %Y %H %I %M %S %p %j %F %T %D %Z %z %n %t %%`, and glibc's `-`
/// flag to drop padding). Unknown directives are copied through, as glibc does.
fn format_strftime(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let hour = secs_of_day / 3600;
    let minute = secs_of_day % 3600 / 60;
    let second = secs_of_day % 60;
    // 1970-01-01 was a Thursday (index 4 with Sunday = 0).
    let weekday = usize::try_from((days + 4).rem_euclid(7)).unwrap_or(0);
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let month_name = MONTHS
        .get(usize::try_from(month - 1).unwrap_or(0))
        .copied()
        .unwrap_or("");
    let weekday_name = WEEKDAYS.get(weekday).copied().unwrap_or("");
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = chars.peek() == Some(&'-');
        if no_pad {
            chars.next();
        }
        let num = |out: &mut String, value: i64, width: usize, pad: char| {
            if no_pad {
                let _ = write!(out, "{value}");
            } else if pad == ' ' {
                let _ = write!(out, "{value:>width$}");
            } else {
                let _ = write!(out, "{value:0width$}");
            }
        };
        match chars.next() {
            Some('a') => out.push_str(weekday_name.get(..3).unwrap_or("")),
            Some('A') => out.push_str(weekday_name),
            Some('b' | 'h') => out.push_str(month_name.get(..3).unwrap_or("")),
            Some('B') => out.push_str(month_name),
            Some('d') => num(&mut out, day, 2, '0'),
            Some('e') => num(&mut out, day, 2, ' '),
            Some('m') => num(&mut out, month, 2, '0'),
            Some('y') => num(&mut out, year.rem_euclid(100), 2, '0'),
            Some('Y') => num(&mut out, year, 1, '0'),
            Some('H') => num(&mut out, hour, 2, '0'),
            Some('I') => num(&mut out, hour12, 2, '0'),
            Some('M') => num(&mut out, minute, 2, '0'),
            Some('S') => num(&mut out, second, 2, '0'),
            Some('j') => num(&mut out, day_of_year, 3, '0'),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('F') => {
                let _ = write!(out, "{year}-{month:02}-{day:02}");
            }
            Some('T') => {
                let _ = write!(out, "{hour:02}:{minute:02}:{second:02}");
            }
            Some('D') => {
                let _ = write!(out, "{month:02}/{day:02}/{:02}", year.rem_euclid(100));
            }
            Some('Z') => out.push_str("UTC"),
            Some('z') => out.push_str("+0000"),
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if no_pad {
                    out.push('-');
                }
                out.push(other);
            }
            None => {
                out.push('%');
                if no_pad {
                    out.push('-');
                }
            }
        }
    }
    out
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian calendar (Howard
/// Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Inverse of [`civil_from_days`].
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Rewrites transformers' `{% generation %}...{% endgeneration %}` tags (which only mark
/// assistant spans for training masks and render their body unchanged) into
/// `{% if true %}...{% endif %}`, keeping whitespace-control markers, so templates using them
/// compile in minijinja and render identically.
fn rewrite_generation_tags(source: &str) -> Cow<'_, str> {
    if !source.contains("generation") {
        return Cow::Borrowed(source);
    }
    let mut out = String::with_capacity(source.len() + 16);
    let mut rest = source;
    let mut changed = false;
    while let Some(pos) = rest.find("{%") {
        let (before, tag) = rest.split_at(pos + 2);
        out.push_str(before);
        rest = tag;
        let control_len = usize::from(tag.starts_with('-') || tag.starts_with('+'));
        let (control, body) = tag.split_at(control_len);
        let keyword_start = body.trim_start();
        let leading_ws = &body[..body.len() - keyword_start.len()];
        let replacement = if let Some(after) = keyword_start.strip_prefix("endgeneration") {
            Some((after, "endif"))
        } else {
            keyword_start
                .strip_prefix("generation")
                .map(|after| (after, "if true"))
        };
        if let Some((after, replacement)) = replacement {
            let closing = after.trim_start();
            let closes = closing.starts_with("%}")
                || closing.starts_with("-%}")
                || closing.starts_with("+%}");
            let separated = after.len() != closing.len() || closes;
            if closes && separated {
                out.push_str(control);
                out.push_str(leading_ws);
                out.push_str(replacement);
                rest = after;
                changed = true;
            }
        }
    }
    if !changed {
        return Cow::Borrowed(source);
    }
    out.push_str(rest);
    Cow::Owned(out)
}

/// Prints values the way Jinja2 under Python does: `None`, `True`, `False`, Python float and
/// container reprs. minijinja would print `none`, `true`, `[1, 2]` differs in quoting, and so
/// on; any such difference changes the token ids.
fn python_formatter(
    out: &mut Output,
    state: &mut State,
    value: &Value,
) -> Result<(), minijinja::Error> {
    match value.kind() {
        ValueKind::String => out.write_str(value.as_str().unwrap_or_default())?,
        ValueKind::Undefined => {}
        ValueKind::None | ValueKind::Bool | ValueKind::Number | ValueKind::Seq | ValueKind::Map => {
            let mut text = String::new();
            write_python_repr(&mut text, value, 0)?;
            out.write_str(&text)?;
        }
        _ => minijinja::escape_formatter(out, state, value)?,
    }
    Ok(())
}

/// `|string` (and `|pprint`): Python's `str()`. Strings pass through, everything else gets its
/// Python repr. (`pprint` wraps values longer than 80 characters over several lines in
/// Python; chat templates do not use it for prompt text.)
fn string_filter(value: &Value) -> Result<Value, minijinja::Error> {
    match value.kind() {
        ValueKind::String => Ok(value.clone()),
        ValueKind::Undefined => Ok(Value::from("")),
        ValueKind::None | ValueKind::Bool | ValueKind::Number | ValueKind::Seq | ValueKind::Map => {
            let mut text = String::new();
            write_python_repr(&mut text, value, 0)?;
            Ok(Value::from(text))
        }
        _ => Ok(Value::from(value.to_string())),
    }
}

fn too_deep() -> minijinja::Error {
    minijinja::Error::new(
        ErrorKind::InvalidOperation,
        format!("value nested deeper than {MAX_RENDER_DEPTH} levels"),
    )
}

/// Python's `repr` for template values (`str()` of containers uses the items' `repr`).
fn write_python_repr(
    out: &mut String,
    value: &Value,
    depth: usize,
) -> Result<(), minijinja::Error> {
    if depth > MAX_RENDER_DEPTH {
        return Err(too_deep());
    }
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => write_python_number(out, value),
        ValueKind::String => write_python_str_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq => {
            out.push('[');
            for (i, item) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_python_repr(out, &item, depth + 1)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                let item = value.get_item(&key)?;
                write_python_repr(out, &key, depth + 1)?;
                out.push_str(": ");
                write_python_repr(out, &item, depth + 1)?;
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
    Ok(())
}

fn write_python_number(out: &mut String, value: &Value) {
    if value.is_integer() {
        let _ = write!(out, "{value}");
    } else {
        match f64::try_from(value.clone()) {
            Ok(f) => push_python_float(out, f, "nan", "inf"),
            Err(_) => {
                let _ = write!(out, "{value}");
            }
        }
    }
}

/// Python's `repr(str)`: single quotes unless the text has a single quote and no double quote,
/// C escapes for control characters. (Python also escapes other non-printable code points; they
/// do not occur in real prompts.)
fn write_python_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || (0x7f..0xa0).contains(&(c as u32)) => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Python's `repr(float)`: shortest round-trip digits, fixed notation for exponents -4..=15
/// (always with a fractional part), scientific (`1e+16`, `1.5e-05`) otherwise.
fn push_python_float(out: &mut String, f: f64, nan: &str, inf: &str) {
    if f.is_nan() {
        out.push_str(nan);
        return;
    }
    if f.is_infinite() {
        if f < 0.0 {
            out.push('-');
        }
        out.push_str(inf);
        return;
    }
    // `{:e}` gives the shortest round-trip digits as `d.ddde±x` without padding.
    let sci = format!("{f:e}");
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    out.push_str(sign);
    if (-4..16).contains(&exponent) {
        let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
        if exponent >= 0 {
            let int_len = usize::try_from(exponent).unwrap_or(0) + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                out.extend(std::iter::repeat_n('0', int_len - digits.len()));
                out.push_str(".0");
            } else {
                let (int_part, frac_part) = digits.split_at(int_len);
                out.push_str(int_part);
                out.push('.');
                out.push_str(frac_part);
            }
        } else {
            out.push_str("0.");
            let zeros = usize::try_from(-exponent - 1).unwrap_or(0);
            out.extend(std::iter::repeat_n('0', zeros));
            out.push_str(&digits);
        }
    } else {
        out.push_str(mantissa);
        let _ = write!(
            out,
            "e{}{:02}",
            if exponent < 0 { '-' } else { '+' },
            exponent.unsigned_abs()
        );
    }
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`. Unlike Jinja's and minijinja's built-in `tojson` it does
/// not HTML-escape, keeps key order, and puts a space after `,` and `:` (no space after `,`
/// when indenting), and the keyword arguments mean what they mean for `json.dumps`.
fn tojson_filter(
    state: &State,
    value: &Value,
    kwargs: Kwargs,
    cap: usize,
) -> Result<Value, minijinja::Error> {
    let indent: Option<String> = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_owned(),
            None => {
                let n = v.as_i64().ok_or_else(|| {
                    minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "indent must be an int or a string",
                    )
                })?;
                " ".repeat(usize::try_from(n).unwrap_or(0).min(64))
            }
        }),
    };
    let (item_sep, key_sep) = match kwargs.get::<Option<Value>>("separators")? {
        Some(v) if !v.is_none() => {
            let mut parts = v.try_iter()?;
            match (parts.next(), parts.next(), parts.next()) {
                (Some(a), Some(b), None) if a.as_str().is_some() && b.as_str().is_some() => (
                    a.as_str().unwrap_or_default().to_owned(),
                    b.as_str().unwrap_or_default().to_owned(),
                ),
                _ => {
                    return Err(minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "separators must be a pair of strings",
                    ));
                }
            }
        }
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    let options = JsonDumps {
        indent,
        item_sep,
        key_sep,
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    let mut meter = OutputMeter {
        state,
        charged: 0,
        cap,
    };
    options.write(&mut out, &mut meter, value, 0)?;
    meter.finish(out.len())?;
    Ok(Value::from(out))
}

/// Charges fuel while `tojson` output grows and caps it at `max_rendered_bytes`.
///
/// minijinja charges a filter's result only once it is returned. Indentation multiplies the
/// input (every line repeats the indent once per nesting level), so a request with deeply
/// nested tool schemas under `tojson(indent=4)` could otherwise allocate hundreds of times its
/// own size before any limit applied.
struct OutputMeter<'s, 't, 'e> {
    state: &'s State<'t, 'e>,
    charged: usize,
    cap: usize,
}

impl OutputMeter<'_, '_, '_> {
    fn check(&mut self, len: usize) -> Result<(), minijinja::Error> {
        if len > self.cap {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson output exceeds max_rendered_bytes",
            )
            .with_source(RenderedBytesExceeded));
        }
        if len - self.charged.min(len) >= 4096 {
            self.finish(len)?;
        }
        Ok(())
    }

    fn finish(&mut self, len: usize) -> Result<(), minijinja::Error> {
        let units = len.saturating_sub(self.charged) / 64;
        self.charged += units * 64;
        self.state.consume_fuel(units as u64)
    }
}

struct JsonDumps {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

impl JsonDumps {
    fn newline(
        &self,
        out: &mut String,
        meter: &mut OutputMeter,
        depth: usize,
    ) -> Result<(), minijinja::Error> {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(indent);
                meter.check(out.len())?;
            }
        }
        Ok(())
    }

    fn write(
        &self,
        out: &mut String,
        meter: &mut OutputMeter,
        value: &Value,
        depth: usize,
    ) -> Result<(), minijinja::Error> {
        meter.check(out.len())?;
        if depth > MAX_RENDER_DEPTH {
            return Err(too_deep());
        }
        match value.kind() {
            ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => {
                if value.is_integer() {
                    let _ = write!(out, "{value}");
                } else {
                    let f = f64::try_from(value.clone())?;
                    push_python_float(out, f, "NaN", "Infinity");
                }
            }
            ValueKind::String => self.write_str(out, value.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                if items.is_empty() {
                    out.push_str("[]");
                    return Ok(());
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(out, meter, depth + 1)?;
                    self.write(out, meter, item, depth + 1)?;
                }
                self.newline(out, meter, depth)?;
                out.push(']');
            }
            ValueKind::Map => {
                let mut entries: Vec<(String, Value)> = Vec::new();
                for key in value.try_iter()? {
                    let item = value.get_item(&key)?;
                    entries.push((json_key(&key)?, item));
                }
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                if entries.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                out.push('{');
                for (i, (key, item)) in entries.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(out, meter, depth + 1)?;
                    self.write_str(out, key);
                    out.push_str(&self.key_sep);
                    self.write(out, meter, item, depth + 1)?;
                }
                self.newline(out, meter, depth)?;
                out.push('}');
            }
            kind => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("object of type {kind} is not JSON serializable"),
                ));
            }
        }
        Ok(())
    }

    /// JSON string escaping as Python's `json` module does it.
    fn write_str(&self, out: &mut String, s: &str) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => {
                    let _ = write!(out, "\\u{:04x}", c as u32);
                }
                c if self.ensure_ascii && !c.is_ascii() => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        let _ = write!(out, "\\u{unit:04x}");
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// Python's `json.dumps` converts non-string keys: numbers via `str()`, booleans and `None` to
/// their JSON spelling; anything else is an error.
fn json_key(key: &Value) -> Result<String, minijinja::Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_owned()),
        ValueKind::None => Ok("null".to_owned()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_owned()),
        ValueKind::Number => {
            let mut s = String::new();
            write_python_number(&mut s, key);
            Ok(s)
        }
        kind => Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("keys must be str, int, float, bool or None, not {kind}"),
        )),
    }
}

// ---------------------------------------------------------------------------------------------
// Fallback chat rendering
// ---------------------------------------------------------------------------------------------

fn fallback_render(
    messages: &[Json],
    tools: Option<&Json>,
    add_generation_prompt: bool,
    limits: &TokenizeLimits,
) -> Result<String, TokenizeError> {
    let mut out = String::new();
    let push = |out: &mut String, s: &str| -> Result<(), TokenizeError> {
        check_prompt_bytes(out.len().saturating_add(s.len()), limits)?;
        out.push_str(s);
        Ok(())
    };
    let compact = |value: &Json| {
        serde_json::to_string(value).map_err(|err| TokenizeError::InvalidChat(err.to_string()))
    };
    if let Some(tools) = tools.filter(|t| !t.is_null()) {
        push(&mut out, "<|tools|>\n")?;
        push(&mut out, &compact(tools)?)?;
        push(&mut out, "\n")?;
    }
    for (index, message) in messages.iter().enumerate() {
        let role = message.get("role").and_then(Json::as_str).ok_or_else(|| {
            TokenizeError::InvalidChat(format!("message {index} has no string \"role\""))
        })?;
        push(&mut out, "<|")?;
        push(&mut out, role)?;
        push(&mut out, "|>\n")?;
        match message.get("content") {
            None | Some(Json::Null) => {}
            Some(Json::String(text)) => push(&mut out, text)?,
            Some(Json::Array(parts)) => {
                for (i, part) in parts.iter().enumerate() {
                    if i > 0 {
                        push(&mut out, "\n")?;
                    }
                    match part.get("text").and_then(Json::as_str) {
                        Some(text) if part.get("type").and_then(Json::as_str) == Some("text") => {
                            push(&mut out, text)?;
                        }
                        _ => push(&mut out, &compact(part)?)?,
                    }
                }
            }
            Some(other) => push(&mut out, &compact(other)?)?,
        }
        push(&mut out, "\n")?;
        if let Some(calls) = message.get("tool_calls").filter(|c| !c.is_null()) {
            push(&mut out, "<|tool_calls|>")?;
            push(&mut out, &compact(calls)?)?;
            push(&mut out, "\n")?;
        }
    }
    if add_generation_prompt {
        push(&mut out, "<|assistant|>\n")?;
    }
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::time::Instant;

    const TOKENIZER_JSON: &[u8] = include_bytes!("../tests/fixtures/tokenizer/tokenizer.json");
    const TOKENIZER_CONFIG: &str =
        include_str!("../tests/fixtures/tokenizer/tokenizer_config.json");
    const LLAMA3: &str = include_str!("../tests/fixtures/tokenizer/llama3_style.jinja");
    const CHATML: &str = include_str!("../tests/fixtures/tokenizer/chatml_style.jinja");
    const CASES: &str = include_str!("../tests/fixtures/tokenizer/chat_cases.json");

    const BOS: &str = "<|begin_of_text|>";
    const EOT: &str = "<|eot_id|>";

    fn template(source: &str) -> ChatTemplateSource {
        ChatTemplateSource {
            source: source.to_owned(),
            bos_token: Some(BOS.to_owned()),
            eos_token: Some(EOT.to_owned()),
        }
    }

    fn with_template(source: &str) -> PromptTokenizer {
        PromptTokenizer::new(
            Some(TOKENIZER_JSON),
            Some(template(source)),
            PromptTokenizerOptions::default(),
        )
        .unwrap()
    }

    fn template_only(source: &str, limits: TokenizeLimits) -> PromptTokenizer {
        PromptTokenizer::new(
            None,
            Some(ChatTemplateSource::new(source)),
            PromptTokenizerOptions {
                limits,
                ..PromptTokenizerOptions::default()
            },
        )
        .unwrap()
    }

    fn chat<'a>(messages: &'a Json, add_generation_prompt: bool) -> PromptInput<'a> {
        PromptInput::Chat {
            messages,
            tools: None,
            add_generation_prompt,
            extra: None,
        }
    }

    #[test]
    fn text_prompts_match_the_python_tokenizer() {
        // Expected ids printed by gen_tokenizer.py (Python `tokenizers`, add_special_tokens=True).
        let tok = PromptTokenizer::new(Some(TOKENIZER_JSON), None, Default::default()).unwrap();
        let cases: [(&str, &[u32]); 4] = [
            ("Hello, world!", &[0, 375, 284, 19, 228, 94, 86, 89, 328, 8]),
            (
                "The quick brown fox",
                &[0, 315, 347, 408, 287, 89, 302, 85, 228, 401, 95],
            ),
            (
                "日本語 🚀",
                &[
                    0, 170, 253, 106, 170, 258, 113, 172, 111, 260, 228, 180, 261, 256, 230,
                ],
            ),
            (
                "  two  spaces\n\nnewlines",
                &[
                    0, 228, 266, 94, 86, 228, 271, 87, 72, 74, 278, 206, 206, 85, 76, 94, 300, 85,
                    278,
                ],
            ),
        ];
        for (text, ids) in cases {
            let got = tok.tokenize(PromptInput::Text(text)).unwrap();
            assert_eq!(got.ids, ids, "{text:?}");
            assert_eq!(got.kind, TokenKind::Tokens);
            assert_eq!(got.rendered_chars, text.chars().count());
        }
        assert_eq!(tok.max_token_id(), Some(419));
    }

    #[test]
    fn special_tokens_in_text_are_recognised() {
        let tok = PromptTokenizer::new(Some(TOKENIZER_JSON), None, Default::default()).unwrap();
        let got = tok.tokenize(PromptInput::Text("<|eot_id|>")).unwrap();
        // BOS from the post-processor, then the single special token (id 4 in SPECIAL order).
        assert_eq!(got.ids, [0, 4]);
    }

    #[test]
    fn chat_cases_match_transformers() {
        let cases: Json = serde_json::from_str(CASES).unwrap();
        // The fixtures list tool keys in non-alphabetical order, as clients send them.
        let probe: Json = serde_json::from_str(r#"{"b": 1, "a": 2}"#).unwrap();
        assert_eq!(
            probe.as_object().unwrap().keys().next().map(String::as_str),
            Some("b"),
            "serde_json must be built with `preserve_order`, or tool schemas are re-ordered \
             and no longer render like the engine renders them"
        );
        let llama = with_template(LLAMA3);
        let chatml = with_template(CHATML);
        let cases = cases.as_array().unwrap();
        assert!(cases.len() >= 10);
        for case in cases {
            let name = case["name"].as_str().unwrap();
            let tok = match case["template"].as_str().unwrap() {
                "llama3_style.jinja" => &llama,
                "chatml_style.jinja" => &chatml,
                other => panic!("unknown template {other}"),
            };
            let rendered = tok.render_chat(
                &case["messages"],
                case.get("tools"),
                case["add_generation_prompt"].as_bool().unwrap_or(false),
                case.get("extra"),
            );
            match (case.get("expected"), case.get("error")) {
                (Some(expected), _) => {
                    assert_eq!(
                        rendered.as_deref().ok(),
                        expected.as_str(),
                        "case {name}: {rendered:?}"
                    );
                }
                (None, Some(error)) => assert_eq!(
                    rendered,
                    Err(TokenizeError::TemplateRaised(
                        error.as_str().unwrap().to_owned()
                    )),
                    "case {name}"
                ),
                _ => panic!("case {name} has neither expected nor error"),
            }
        }
    }

    #[test]
    fn llama3_style_renders_exactly() {
        let tok = with_template(LLAMA3);
        let messages = json!([
            {"role": "system", "content": "Be brief. "},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": [{"type": "text", "text": "Bye"}]},
        ]);
        let extra = json!({"date_string": "26 Jul 2024"});
        let rendered = tok
            .render_chat(&messages, None, true, Some(&extra))
            .unwrap();
        assert_eq!(
            rendered,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n\
             Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n\
             Be brief.<|eot_id|>\
             <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>\
             <|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
        // The rendered text already holds BOS: encoding must not add a second one.
        let ids = tok.tokenize(PromptInput::Chat {
            messages: &messages,
            tools: None,
            add_generation_prompt: true,
            extra: Some(&extra),
        });
        let ids = ids.unwrap();
        assert_eq!(ids.kind, TokenKind::Tokens);
        assert_eq!(ids.ids.iter().filter(|&&id| id == 0).count(), 1);
        assert_eq!(ids.ids[0], 0);
        assert_eq!(ids.rendered_chars, rendered.chars().count());
    }

    #[test]
    fn chatml_style_renders_exactly_with_tools() {
        let tok = with_template(CHATML);
        let messages = json!([
            {"role": "user", "content": "Time?"},
        ]);
        let tools = json!([{"type": "function", "function": {"name": "now", "parameters": {}}}]);
        let rendered = tok
            .render_chat(&messages, Some(&tools), true, None)
            .unwrap();
        assert_eq!(
            rendered,
            "<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n\
             You may call one or more functions to assist with the user query.\n\n\
             You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n\
             {\"type\": \"function\", \"function\": {\"name\": \"now\", \"parameters\": {}}}\n\
             </tools>\n\n\
             For each function call, return a json object with function name and arguments within \
             <tool_call></tool_call> XML tags:\n<tool_call>\n\
             {\"name\": <function-name>, \"arguments\": <args-json-object>}\n\
             </tool_call><|im_end|>\n\
             <|im_start|>user\nTime?<|im_end|>\n<|im_start|>assistant\n"
        );
        // `tools: null` is the same as no tools.
        let without = tok
            .render_chat(&messages, Some(&Json::Null), false, None)
            .unwrap();
        assert_eq!(
            without,
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
             <|im_start|>user\nTime?<|im_end|>\n"
        );
    }

    #[test]
    fn chats_with_the_same_system_prompt_share_leading_ids() {
        let tok = with_template(LLAMA3);
        let extra = json!({"date_string": "26 Jul 2024"});
        let system = "You are a helpful assistant. Answer the user's questions concisely.";
        let a = json!([
            {"role": "system", "content": system},
            {"role": "user", "content": "What is the weather like in Paris?"},
        ]);
        let b = json!([
            {"role": "system", "content": system},
            {"role": "user", "content": "The quick brown fox jumps"},
        ]);
        let run = |m: &Json| {
            tok.tokenize(PromptInput::Chat {
                messages: m,
                tools: None,
                add_generation_prompt: true,
                extra: Some(&extra),
            })
            .unwrap()
            .ids
        };
        let (ia, ib) = (run(&a), run(&b));
        let system_only = tok
            .render_chat(
                &json!([{"role": "system", "content": system}]),
                None,
                false,
                Some(&extra),
            )
            .unwrap();
        let system_ids = tok.tokenize(PromptInput::Text(&system_only)).unwrap().ids;
        // `system_ids` has a second BOS from add_special_tokens; skip it.
        let prefix = &system_ids[1..];
        assert!(prefix.len() > 20);
        assert_eq!(&ia[..prefix.len()], prefix);
        assert_eq!(&ib[..prefix.len()], prefix);
        assert_ne!(ia, ib);
    }

    #[test]
    fn token_ids_pass_through_and_are_checked() {
        let tok = PromptTokenizer::new(Some(TOKENIZER_JSON), None, Default::default()).unwrap();
        let ok = tok.tokenize(PromptInput::TokenIds(&[0, 5, 419])).unwrap();
        assert_eq!(
            ok,
            TokenizedPrompt {
                ids: vec![0, 5, 419],
                kind: TokenKind::Tokens,
                rendered_chars: 0,
                cached_tokens: 0
            }
        );
        let err = tok
            .tokenize(PromptInput::TokenIds(&[0, 5, 420, 9]))
            .unwrap_err();
        assert_eq!(
            err,
            TokenizeError::TokenOutOfVocab {
                id: 420,
                index: 2,
                max_id: 419
            }
        );
        assert!(err.to_string().contains("420"), "{err}");

        // Without a tokenizer there is nothing to check against.
        let bare = PromptTokenizer::new(None, None, Default::default()).unwrap();
        let ids = bare
            .tokenize(PromptInput::TokenIds(&[7, 1_000_000]))
            .unwrap();
        assert_eq!(ids.ids, [7, 1_000_000]);
        assert_eq!(ids.kind, TokenKind::Tokens);
    }

    #[test]
    fn char_chunk_fallback() {
        let tok = PromptTokenizer::new(
            None,
            None,
            PromptTokenizerOptions {
                char_chunk_tokens: 16,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(tok.char_chunk_tokens(), 16);
        let got = tok.tokenize(PromptInput::Text("añ🚀")).unwrap();
        assert_eq!(
            got,
            TokenizedPrompt {
                ids: vec![0x61, 0xf1, 0x1f680],
                kind: TokenKind::CharChunks,
                rendered_chars: 3,
                cached_tokens: 0
            }
        );

        // Chats without template: the documented fallback rendering.
        let messages = json!([
            {"role": "system", "content": "sys"},
            {"role": "user", "content": [
                {"type": "text", "text": "a"},
                {"type": "image_url", "image_url": {"url": "u"}},
            ]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "1"}]},
        ]);
        let tools = json!([{"name": "t"}]);
        let rendered = tok
            .render_chat(&messages, Some(&tools), true, None)
            .unwrap();
        assert_eq!(
            rendered,
            "<|tools|>\n[{\"name\":\"t\"}]\n<|system|>\nsys\n<|user|>\na\n\
             {\"image_url\":{\"url\":\"u\"},\"type\":\"image_url\"}\n\
             <|assistant|>\n\n<|tool_calls|>[{\"id\":\"1\"}]\n<|assistant|>\n"
                .replace(
                    "{\"image_url\":{\"url\":\"u\"},\"type\":\"image_url\"}",
                    &serde_json::to_string(&messages[1]["content"][1]).unwrap()
                )
        );
        let a = tok
            .tokenize(chat(
                &json!([{"role": "system", "content": "shared"}, {"role": "user", "content": "x"}]),
                true,
            ))
            .unwrap();
        let b = tok
            .tokenize(chat(
                &json!([{"role": "system", "content": "shared"}, {"role": "user", "content": "y"}]),
                true,
            ))
            .unwrap();
        assert_eq!(a.kind, TokenKind::CharChunks);
        assert_eq!(a.ids[..18], b.ids[..18]);
        assert_ne!(a.ids, b.ids);

        // Template without tokenizer: rendered text in char chunks.
        let tpl = template_only(
            "{% for m in messages %}{{ m.content }}|{% endfor %}",
            TokenizeLimits::default(),
        );
        let got = tpl
            .tokenize(chat(&json!([{"role": "user", "content": "ab"}]), false))
            .unwrap();
        assert_eq!(got.ids, ['a' as u32, 'b' as u32, '|' as u32]);

        assert!(matches!(
            PromptTokenizer::new(
                None,
                None,
                PromptTokenizerOptions {
                    char_chunk_tokens: 0,
                    ..Default::default()
                }
            ),
            Err(TokenizeError::InvalidOptions(_))
        ));
    }

    #[test]
    fn fallback_chat_with_tokenizer_adds_bos_once() {
        let tok = PromptTokenizer::new(Some(TOKENIZER_JSON), None, Default::default()).unwrap();
        let got = tok
            .tokenize(chat(&json!([{"role": "user", "content": "Hello"}]), true))
            .unwrap();
        let text = tok
            .tokenize(PromptInput::Text("<|user|>\nHello\n<|assistant|>\n"))
            .unwrap();
        assert_eq!(got.ids, text.ids);
        assert_eq!(got.ids[0], 0);
    }

    #[test]
    fn tokenizer_config_variants() {
        let t = ChatTemplateSource::from_tokenizer_config(TOKENIZER_CONFIG)
            .unwrap()
            .unwrap();
        assert!(t.source.starts_with("{{- bos_token }}"));
        assert_eq!(t.bos_token.as_deref(), Some(BOS));
        assert_eq!(t.eos_token.as_deref(), Some(EOT));

        let tok = PromptTokenizer::from_hf_files(
            Some(TOKENIZER_JSON),
            Some(TOKENIZER_CONFIG),
            Default::default(),
        )
        .unwrap();
        let rendered = tok
            .render_chat(
                &json!([{"role": "user", "content": " Hi "}]),
                None,
                true,
                None,
            )
            .unwrap();
        assert_eq!(
            rendered,
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );

        let plain = ChatTemplateSource::from_tokenizer_config(
            r#"{"chat_template": "x", "bos_token": null}"#,
        )
        .unwrap()
        .unwrap();
        assert_eq!(plain, ChatTemplateSource::new("x"));
        assert_eq!(
            ChatTemplateSource::from_tokenizer_config(r#"{"bos_token": "<s>"}"#).unwrap(),
            None
        );
        assert_eq!(
            special_tokens_from_config(r#"{"bos_token": "<s>", "eos_token": {"content": "</s>"}}"#)
                .unwrap(),
            (Some("<s>".to_owned()), Some("</s>".to_owned()))
        );
        for bad in [
            "not json",
            "[1]",
            r#"{"chat_template": 5}"#,
            r#"{"chat_template": [{"name": "rag", "template": "x"}]}"#,
            r#"{"chat_template": "x", "eos_token": {"id": 3}}"#,
            r#"{"chat_template": "x", "bos_token": 3}"#,
        ] {
            assert!(
                matches!(
                    ChatTemplateSource::from_tokenizer_config(bad),
                    Err(TokenizeError::TokenizerConfig(_))
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn malformed_tokenizer_json_is_an_error() {
        for bad in [
            &b"{"[..],
            b"{}",
            b"[]",
            b"\xff\xfe",
            &TOKENIZER_JSON[..TOKENIZER_JSON.len() / 2],
        ] {
            let err = PromptTokenizer::new(Some(bad), None, Default::default()).unwrap_err();
            assert!(matches!(err, TokenizeError::TokenizerLoad(_)), "{err:?}");
        }
    }

    #[test]
    fn malformed_templates_and_inputs_are_errors() {
        let err = PromptTokenizer::new(
            None,
            Some(ChatTemplateSource::new("{% for %}")),
            Default::default(),
        )
        .unwrap_err();
        assert!(matches!(err, TokenizeError::TemplateSyntax(_)), "{err:?}");

        let tok = with_template(CHATML);
        for (messages, extra) in [
            (json!({"role": "user"}), None),
            (json!(["hi"]), None),
            (json!([{"role": "user", "content": "x"}]), Some(json!([1]))),
        ] {
            let err = tok
                .render_chat(&messages, None, false, extra.as_ref())
                .unwrap_err();
            assert!(matches!(err, TokenizeError::InvalidChat(_)), "{err:?}");
        }
        // A template error that is not raise_exception: calling an undefined function.
        let tpl = template_only("{{ nope() }}", TokenizeLimits::default());
        let err = tpl.render_chat(&json!([]), None, false, None).unwrap_err();
        assert!(matches!(err, TokenizeError::TemplateRender(_)), "{err:?}");
        // Values nested deeper than the JSON limit, built in code.
        let mut deep = json!("x");
        for _ in 0..200 {
            deep = json!([deep]);
        }
        let err = tok
            .render_chat(
                &json!([{"role": "user", "content": deep}]),
                None,
                false,
                None,
            )
            .unwrap_err();
        assert!(matches!(err, TokenizeError::InvalidChat(_)), "{err:?}");
    }

    #[test]
    fn input_limits_name_the_limit() {
        let limits = TokenizeLimits {
            max_prompt_bytes: 10,
            max_tokens: 3,
            max_messages: 2,
            ..Default::default()
        };
        let tok = PromptTokenizer::new(
            Some(TOKENIZER_JSON),
            Some(template(CHATML)),
            PromptTokenizerOptions {
                limits,
                ..Default::default()
            },
        )
        .unwrap();
        let err = tok.tokenize(PromptInput::Text("01234567890")).unwrap_err();
        assert_eq!(
            err,
            TokenizeError::InputLimit {
                limit: InputLimit::PromptBytes,
                actual: 11,
                max: 10
            }
        );
        assert!(err.to_string().contains("max_prompt_bytes"), "{err}");

        let err = tok.tokenize(PromptInput::Text("Hello, world")).unwrap_err();
        assert!(matches!(
            err,
            TokenizeError::InputLimit {
                limit: InputLimit::PromptBytes,
                ..
            }
        ));
        let err = tok.tokenize(PromptInput::Text("a b c d e")).unwrap_err();
        assert!(
            matches!(
                err,
                TokenizeError::InputLimit {
                    limit: InputLimit::Tokens,
                    max: 3,
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("max_tokens"), "{err}");
        let err = tok
            .tokenize(PromptInput::TokenIds(&[1, 2, 3, 4]))
            .unwrap_err();
        assert_eq!(
            err,
            TokenizeError::InputLimit {
                limit: InputLimit::Tokens,
                actual: 4,
                max: 3
            }
        );

        let three = json!([
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
        ]);
        let err = tok.tokenize(chat(&three, true)).unwrap_err();
        assert_eq!(
            err,
            TokenizeError::InputLimit {
                limit: InputLimit::Messages,
                actual: 3,
                max: 2
            }
        );
        assert!(err.to_string().contains("max_messages"), "{err}");

        let big = json!([{"role": "user", "content": "this is longer than ten bytes"}]);
        let err = tok.render_chat(&big, None, false, None).unwrap_err();
        assert!(
            matches!(
                err,
                TokenizeError::InputLimit {
                    limit: InputLimit::PromptBytes,
                    ..
                }
            ),
            "{err:?}"
        );
    }

    /// Each hostile template must fail with the expected limit (the limit, not a clock, is
    /// what bounds it; the time is printed for the record).
    fn assert_limited(source: &str, limits: TokenizeLimits, expected: TemplateLimit) {
        let tok = template_only(source, limits);
        let started = Instant::now();
        let err = tok
            .render_chat(&json!([{"role": "user", "content": "x"}]), None, true, None)
            .unwrap_err();
        let elapsed = started.elapsed();
        assert!(
            matches!(&err, TokenizeError::TemplateLimit { limit, .. } if *limit == expected),
            "{source}: {err:?}"
        );
        eprintln!("{expected}: {elapsed:?} for {source}");
        assert!(err.to_string().contains(&expected.to_string()), "{err}");
    }

    #[test]
    fn hostile_templates_hit_limits_quickly() {
        let limits = TokenizeLimits::default();
        // Python-style huge range: minijinja refuses ranges over 100k items outright.
        let tok = template_only("{% for i in range(10**9) %}x{% endfor %}", limits);
        assert!(tok.render_chat(&json!([]), None, false, None).is_err());
        // Nested loops that each stay under the range cap: fuel.
        assert_limited(
            "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
            limits,
            TemplateLimit::Fuel,
        );
        // Unbounded recursion through a macro.
        assert_limited(
            "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
            limits,
            TemplateLimit::Recursion,
        );
        // Huge output: cut off by the output cap before the fuel runs out.
        assert_limited(
            "{% for i in range(99999) %}{{ 'x' * 1000 }}{% endfor %}",
            TokenizeLimits {
                max_rendered_bytes: 1 << 20,
                ..limits
            },
            TemplateLimit::RenderedBytes,
        );
        // One giant string: refused by fuel before it is allocated.
        assert_limited("{{ 'x' * 10**12 }}", limits, TemplateLimit::Fuel);
        // Exponential growth by doubling a string in a namespace.
        assert_limited(
            "{% set ns = namespace(s='x') %}{% for i in range(64) %}\
             {% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
            limits,
            TemplateLimit::Fuel,
        );
        // Deeply nested values: tojson and printing refuse instead of overflowing the stack.
        let nest = "{% set ns = namespace(x=[]) %}\
                    {% for i in range(1000) %}{% set ns.x = [ns.x] %}{% endfor %}";
        for tail in ["{{ ns.x | tojson }}", "{{ ns.x }}", "{{ ns.x | string }}"] {
            let tok = template_only(&format!("{nest}{tail}"), limits);
            let err = tok.render_chat(&json!([]), None, false, None).unwrap_err();
            assert!(
                matches!(err, TokenizeError::TemplateRender(_)),
                "{tail}: {err:?}"
            );
        }
    }

    #[test]
    fn tojson_indent_blowup_is_bounded() {
        // 128-deep tool schemas under `tojson(indent=...)`: every line repeats the indent per
        // level, so the output is far larger than the request. It must stop at a limit.
        let mut deep = json!(1);
        for _ in 0..100 {
            deep = json!([deep]);
        }
        for _ in 0..12 {
            deep = json!([deep, deep.clone()]);
        }
        // About 0.8 MB of request; about 3 GB once indented.
        assert!(deep.to_string().len() < 1 << 20);
        let tools = json!([deep]);
        let messages = json!([{"role": "user", "content": "x"}]);
        for (fuel, max_rendered_bytes, expected) in [
            (u64::MAX / 128, 4 << 20, TemplateLimit::RenderedBytes),
            (
                TokenizeLimits::default().template_fuel,
                1 << 30,
                TemplateLimit::Fuel,
            ),
        ] {
            let limits = TokenizeLimits {
                template_fuel: fuel,
                max_rendered_bytes,
                ..Default::default()
            };
            let tok = template_only("{{ tools | tojson(indent=40) | length }}", limits);
            let err = tok
                .render_chat(&messages, Some(&tools), false, None)
                .unwrap_err();
            assert!(
                matches!(&err, TokenizeError::TemplateLimit { limit, .. } if *limit == expected),
                "{err:?}"
            );
        }
    }

    #[test]
    fn python_isms() {
        let tok = template_only(
            "{{ none }}|{{ true }}|{{ [1, 'a', none, 1.5, {'k': false}] }}|{{ 1e20 }}|\
             {{ 0.1 + 0.2 }}|\
             {{ ' a '.strip() }}|{{ 'a,b'.split(',') }}|{{ {'x': 1}.keys() | list }}|\
             {{ 'abc'.startswith('ab') }}|{{ \"it's\" ~ '' }}|{{ [\"it's\"] }}|\
             {{ {'a': 1}.get('b', 2) }}|\
             {{ {'é': 'ü', 'n': [1.0, 2], 't': true} | tojson }}|\
             {{ 'é' | tojson(ensure_ascii=true) }}|\
             {{ {'b': 1, 'a': [] } | tojson(sort_keys=true, separators=(',', ':')) }}|\
             {{ [1] | tojson(indent=2) }}|{{ dict(a=1) | tojson }}|{{ [none, 'x'] | string }}|\
             {{ 2 | string }}|{{ undefined_name | string }}",
            TokenizeLimits::default(),
        );
        let got = tok.render_chat(&json!([]), None, false, None).unwrap();
        assert_eq!(
            got,
            "None|True|[1, 'a', None, 1.5, {'k': False}]|1e+20|0.30000000000000004|\
             a|['a', 'b']|['x']|True|it's|[\"it's\"]|2|\
             {\"é\": \"ü\", \"n\": [1.0, 2], \"t\": true}|\"\\u00e9\"|\
             {\"a\":[],\"b\":1}|[\n  1\n]|{\"a\": 1}|[None, 'x']|2|"
        );
    }

    #[test]
    fn context_precedence() {
        let tok = with_template(
            "{{ bos_token }}|{{ eos_token }}|{{ documents is none }}|{{ add_generation_prompt }}|\
             {{ tools is none }}|{{ messages | length }}",
        );
        let messages = json!([{"role": "user", "content": "x"}]);
        let plain = tok.render_chat(&messages, None, true, None).unwrap();
        assert_eq!(plain, "<|begin_of_text|>|<|eot_id|>|True|True|True|1");
        let extra =
            json!({"bos_token": "B", "documents": [], "add_generation_prompt": 0, "messages": []});
        let overridden = tok
            .render_chat(&messages, None, true, Some(&extra))
            .unwrap();
        assert_eq!(overridden, "B|<|eot_id|>|False|True|True|1");
    }

    #[test]
    fn generation_tags_and_loop_controls() {
        let src = "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}\
                   {%- generation -%} {{ m.content }} {%- endgeneration %}{% endfor %}";
        let tok = template_only(src, TokenizeLimits::default());
        let got = tok
            .render_chat(
                &json!([{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]),
                None,
                false,
                None,
            )
            .unwrap();
        assert_eq!(got, "a");
        assert_eq!(
            rewrite_generation_tags("{{ generation }}"),
            "{{ generation }}"
        );
        assert_eq!(
            rewrite_generation_tags("{% generation_x %}"),
            "{% generation_x %}"
        );
        assert_eq!(
            rewrite_generation_tags("{%+ generation+%}x{% endgeneration %}"),
            "{%+ if true+%}x{% endif %}"
        );
    }

    #[test]
    fn strftime_matches_python() {
        // 2024-07-26 13:25:09 UTC, a Friday; values from Python's time.strftime.
        let t = 1_722_000_309;
        assert_eq!(format_strftime("%d %b %Y", t), "26 Jul 2024");
        assert_eq!(
            format_strftime("%A %B %-d, %y %H:%M:%S %p %I %j %e", t),
            "Friday July 26, 24 13:25:09 PM 01 208 26"
        );
        assert_eq!(
            format_strftime("%F %T %D %% %q %", t),
            "2024-07-26 13:25:09 07/26/24 % %q %"
        );
        assert_eq!(format_strftime("%Y-%m-%d %a", 0), "1970-01-01 Thu");
        assert_eq!(
            format_strftime("%Y-%m-%d %j", 951_782_400),
            "2000-02-29 060"
        );
        let tok = template_only(
            "{{ strftime_now('%Y') | length }}",
            TokenizeLimits::default(),
        );
        assert_eq!(tok.render_chat(&json!([]), None, false, None).unwrap(), "4");
    }

    #[test]
    fn python_float_repr() {
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (123_456_789.125, "123456789.125"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (1e100, "1e+100"),
            (-0.0, "-0.0"),
            (f64::NAN, "nan"),
            (f64::NEG_INFINITY, "-inf"),
        ];
        for (f, want) in cases {
            let mut s = String::new();
            push_python_float(&mut s, f, "nan", "inf");
            assert_eq!(s, want, "{f}");
        }
    }

    #[test]
    fn prompt_tokenizer_is_shareable() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<PromptTokenizer>();
    }

    /// Regression (hardening review): before renders ran on their own stack, this template
    /// overflowed the stack of the calling thread and aborted the process.
    #[test]
    fn a_template_nesting_values_as_deep_as_fuel_allows_does_not_overflow() {
        let source = "{% set ns = namespace(x=none) %}{% for i in range(100000) %}{% for j in range(100) %}{% set ns.x = [ns.x] %}{% endfor %}{% endfor %}{{ ns.x }}";
        let tok = PromptTokenizer::new(
            None,
            Some(ChatTemplateSource {
                source: source.into(),
                bos_token: None,
                eos_token: None,
            }),
            PromptTokenizerOptions::default(),
        )
        .expect("compiles");
        let messages = serde_json::json!([{"role": "user", "content": "hi"}]);
        let r = tok.render_chat(&messages, None, true, None);
        assert!(
            matches!(r, Err(TokenizeError::TemplateLimit { .. })),
            "{r:?}"
        );
        // the same with the output printed before fuel runs out
        let shallow = source.replace("range(100000)", "range(50)");
        let tok = PromptTokenizer::new(
            None,
            Some(ChatTemplateSource {
                source: shallow,
                bos_token: None,
                eos_token: None,
            }),
            PromptTokenizerOptions::default(),
        )
        .expect("compiles");
        let _ = tok.render_chat(&messages, None, true, None);
    }
}
