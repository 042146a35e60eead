//! A request's routing plan: what the router needs to know about one request, computed from
//! values alone (its token ids, its model config, the tenant's salt, the headers already read).
//!
//! The service builds it once the prompt is tokenized (tokenizing, locally or through an
//! engine's render endpoint, stays in the service); the offline replay and the benchmarks
//! build it with the same function, so they hash, salt and bound a request exactly as the
//! service does.

use std::net::SocketAddr;

use crate::block_keys::{BlockHasher, BlockKey, ChainRoot};
use crate::endpoint::{Endpoint, ModelConfig};
use crate::router::RouteRequest;
use crate::tokenize::TokenKind;

/// Longest session header value read; a longer one is ignored (routed without a session).
pub const MAX_SESSION_BYTES: usize = 256;

/// How much of the request body the fallback hash reads (requests without a full block).
const FALLBACK_HASH_BYTES: usize = 4096;

/// What a plan is made from.
#[derive(Debug, Clone)]
pub struct PlanInput<'a> {
    /// The model config serving the request (block size and model name key the blocks).
    pub config: &'a ModelConfig,
    /// The LoRA adapter the request names, if any.
    pub lora: Option<&'a str>,
    /// The prompt's ids and what they are.
    pub tokens: &'a [u32],
    pub token_kind: TokenKind,
    /// Ids per hashed block when `token_kind` is [`TokenKind::CharChunks`].
    pub char_chunk_tokens: u32,
    /// The tenant's keyed salt (`SaltedCache`); it takes precedence over the client's own.
    pub tenant_salt: Option<String>,
    /// The client's own `cache_salt`.
    pub client_salt: Option<&'a str>,
    /// The session header's value, as sent.
    pub session: Option<&'a str>,
    /// The request as the client sent it (its first bytes seed the fallback hash).
    pub request_bytes: &'a [u8],
    /// Longest prompt accepted, in ids.
    pub max_prompt_tokens: usize,
}

/// A request the plan refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("the prompt has {tokens} tokens, more than the limit of {limit}")]
    PromptTooLong { tokens: usize, limit: usize },
}

/// One request, ready for the router.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestPlan {
    /// The prompt's block keys, chained from the model, adapter and salt.
    pub keys: Vec<BlockKey>,
    /// Prompt tokens for load accounting (character chunks count about four to a token).
    pub prompt_tokens: u32,
    /// The salt the keys were hashed with: the tenant's, else the client's.
    pub salt: Option<String>,
    /// Whether `salt` is the tenant's, which every forwarded body must then carry.
    pub tenant_salted: bool,
    /// The session key, when the header held a usable one.
    pub session: Option<String>,
    /// Identifies the request when it has no full block.
    pub fallback_hash: u64,
    /// The LoRA adapter the request names.
    pub lora: Option<String>,
}

impl RequestPlan {
    pub fn new(input: PlanInput<'_>) -> Result<Self, PlanError> {
        if input.tokens.len() > input.max_prompt_tokens {
            return Err(PlanError::PromptTooLong {
                tokens: input.tokens.len(),
                limit: input.max_prompt_tokens,
            });
        }
        let tenant_salted = input.tenant_salt.is_some();
        // the engine and the index must see the same salt as these keys
        let salt = input
            .tenant_salt
            .or_else(|| input.client_salt.map(str::to_owned));
        let hasher = match input.token_kind {
            TokenKind::Tokens => BlockHasher::new(input.config.block_size),
            TokenKind::CharChunks => BlockHasher::new(input.char_chunk_tokens),
        };
        let root = ChainRoot::new(&input.config.model, input.lora, salt.as_deref());
        let keys = hasher.keys(root, input.tokens);
        let prompt_tokens = match input.token_kind {
            TokenKind::Tokens => input.tokens.len(),
            // about four characters per token, for load accounting only
            TokenKind::CharChunks => input.tokens.len().div_ceil(4),
        } as u32;
        let session = input
            .session
            .filter(|s| !s.is_empty() && s.len() <= MAX_SESSION_BYTES)
            .map(str::to_owned);
        let seed = &input.request_bytes[..input.request_bytes.len().min(FALLBACK_HASH_BYTES)];
        Ok(Self {
            keys,
            prompt_tokens,
            salt,
            tenant_salted,
            session,
            fallback_hash: xxhash_rust::xxh3::xxh3_64(seed),
            lora: input.lora.map(str::to_owned),
        })
    }

    /// The request as the router takes it.
    pub fn route_request<'a>(
        &'a self,
        config: &'a ModelConfig,
        scope: Scope<'a>,
        explain: bool,
    ) -> RouteRequest<'a> {
        RouteRequest {
            model_config: config,
            keys: &self.keys,
            prompt_tokens: self.prompt_tokens,
            session: self.session.as_deref(),
            tenant: scope.tenant,
            subset: scope.subset,
            allow: scope.allow,
            fallback_hash: self.fallback_hash,
            stage: crate::router::Stage::Whole,
            explain,
            lora: self.lora.as_deref(),
        }
    }
}

/// Which endpoints a request may go to beyond its model: its tenant, the gateway's subset,
/// the tenant's dedicated endpoints.
#[derive(Clone, Copy, Default)]
pub struct Scope<'a> {
    pub tenant: Option<&'a str>,
    pub subset: Option<&'a [SocketAddr]>,
    pub allow: Option<&'a (dyn Fn(&Endpoint) -> bool + Sync)>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::ModelConfig;

    fn config() -> ModelConfig {
        ModelConfig {
            block_size: 4,
            ..ModelConfig::new("c", "m")
        }
    }

    fn input<'a>(config: &'a ModelConfig, tokens: &'a [u32]) -> PlanInput<'a> {
        PlanInput {
            config,
            lora: None,
            tokens,
            token_kind: TokenKind::Tokens,
            char_chunk_tokens: 16,
            tenant_salt: None,
            client_salt: None,
            session: None,
            request_bytes: b"{}",
            max_prompt_tokens: 64,
        }
    }

    #[test]
    fn the_tenants_salt_takes_precedence_over_the_clients() {
        let c = config();
        let tokens: Vec<u32> = (0..12).collect();
        let plain = RequestPlan::new(input(&c, &tokens)).expect("plan");
        let client = RequestPlan::new(PlanInput {
            client_salt: Some("mine"),
            ..input(&c, &tokens)
        })
        .expect("plan");
        let tenant = RequestPlan::new(PlanInput {
            client_salt: Some("mine"),
            tenant_salt: Some("tenant".into()),
            ..input(&c, &tokens)
        })
        .expect("plan");
        let tenant_only = RequestPlan::new(PlanInput {
            tenant_salt: Some("tenant".into()),
            ..input(&c, &tokens)
        })
        .expect("plan");
        assert_eq!(plain.keys.len(), 3);
        assert_ne!(plain.keys, client.keys);
        assert_ne!(client.keys, tenant.keys);
        // whatever the client sends, a tenant's keys are its own
        assert_eq!(tenant.keys, tenant_only.keys);
        assert_eq!(tenant.salt.as_deref(), Some("tenant"));
        assert!(tenant.tenant_salted && !client.tenant_salted);
        assert_eq!(client.salt.as_deref(), Some("mine"));
    }

    #[test]
    fn character_chunks_hash_in_their_own_blocks_and_count_four_to_a_token() {
        let c = config();
        let chars: Vec<u32> = (0..40).collect();
        let p = RequestPlan::new(PlanInput {
            token_kind: TokenKind::CharChunks,
            ..input(&c, &chars)
        })
        .expect("plan");
        assert_eq!((p.keys.len(), p.prompt_tokens), (2, 10));
    }

    #[test]
    fn prompts_over_the_limit_are_refused_and_bad_sessions_ignored() {
        let c = config();
        let long: Vec<u32> = (0..65).collect();
        assert_eq!(
            RequestPlan::new(input(&c, &long)),
            Err(PlanError::PromptTooLong {
                tokens: 65,
                limit: 64
            })
        );
        let huge = "s".repeat(MAX_SESSION_BYTES + 1);
        for (header, kept) in [
            (Some("abc"), Some("abc")),
            (Some(""), None),
            (Some(huge.as_str()), None),
            (None, None),
        ] {
            let p = RequestPlan::new(PlanInput {
                session: header,
                ..input(&c, &long[..8])
            })
            .expect("plan");
            assert_eq!(p.session.as_deref(), kept);
        }
    }

    #[test]
    fn the_fallback_hash_reads_the_requests_first_bytes_only() {
        let c = config();
        let a = [b'a'; FALLBACK_HASH_BYTES + 10];
        let mut b = a;
        b[FALLBACK_HASH_BYTES + 5] = b'b';
        let mut early = a;
        early[0] = b'b';
        let hash = |bytes: &[u8]| {
            RequestPlan::new(PlanInput {
                request_bytes: bytes,
                ..input(&c, &[1])
            })
            .expect("plan")
            .fallback_hash
        };
        assert_eq!(hash(&a), hash(&b));
        assert_ne!(hash(&a), hash(&early));
    }
}
