//! The pure engine model: one [`Rank`] is one vLLM engine core (one data-parallel rank).
//!
//! No I/O and no wall clock: the rank keeps its own virtual clock in milliseconds, advanced by
//! the duration of each step it runs ([`Rank::next_step`]) and by the caller for idle time
//! ([`Rank::advance_to`]). The real-time server sleeps each step's duration (divided by its
//! speed-up); an offline discrete-event benchmark can drive the same code in virtual time.
//!
//! What is modelled, following vLLM v1's scheduler and KV cache manager:
//! * A paged KV cache of `num_blocks` blocks of `block_size` tokens. Full blocks are hashed
//!   in a chain (each hash covers the whole prefix up to its block; the cache salt and the LoRA
//!   adapter are folded into the first block's parent), registered as soon as they are
//!   scheduled, and reused by later requests with the same prefix. A hit never covers the
//!   prompt's last token (vLLM recomputes it to get logits), so a fully cached prompt still
//!   recomputes its last block.
//! * Blocks freed by a finished or preempted request keep their hash and join the tail of the
//!   eviction queue, tail blocks of the request first; they are evicted (and reported with
//!   `BlockRemoved`) only when an allocation needs their space.
//! * Continuous batching: each step first advances the running requests (decode, or the next
//!   chunk of a chunked prefill), preempting the newest running request (recompute) when KV
//!   space runs out, then admits waiting requests first-come-first-served while the token
//!   budget (`max_num_batched_tokens`), `max_num_seqs` and KV space allow. No waiting request
//!   is admitted in a step that preempted.
//! * Step time from [`StepTimeModel`].
//! * KV events exactly when blocks are registered (`BlockStored`, with parent hash and token
//!   ids) and evicted (`BlockRemoved`), and `AllBlocksCleared` on [`Rank::reset`].
//!
//! # Driving it in virtual time
//!
//! A discrete-event loop keeps, per rank, the time its current step ends. At a step boundary
//! `t` it submits the requests that arrived up to `t` (with [`Rank::submit_at`] and their
//! arrival times, after [`Rank::advance_to`]`(arrival)` when the rank was idle), then calls
//! [`Rank::next_step`]: the step covers `[t, outcome.end_ms]`, its tokens, first tokens and
//! finished requests happen at `end_ms`, and its KV events are one published batch. An idle
//! rank (`next_step` returned `None`) waits for the next arrival. [`FinishedRequest`] carries
//! arrival, first-token and finish times, so TTFT and latency come straight out.
//!
//! Output tokens are pseudo-text: each token id is the code point of one character (lowercase
//! letters and spaces), so a client that sends the generated text back in its next turn gets
//! exactly the same ids from the character tokenizer, and the output blocks are reused like in
//! a real multi-turn conversation.

mod pool;

use std::collections::VecDeque;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use kvroute_routing::kv_events::{BlockPlace, ExtraKey, KvEvent};
use rustc_hash::FxHashMap;
use thiserror::Error;

use pool::{BlockId, BlockPool};

/// Engine-side request identifier (the server maps its string ids onto these).
pub type RequestId = u64;

/// Storage tier reported in events, as vLLM reports GPU blocks.
pub const MEDIUM_GPU: &str = "GPU";
/// The CPU offload tier's `medium`, as vLLM names it.
pub const MEDIUM_CPU: &str = "CPU";

/// Step-time model in milliseconds. Defaults are the published fit in DESIGN.md §10.
///
/// * prefill part (when the step schedules any prefill tokens, `T` of them):
///   `prefill_a·T² + prefill_b·T + prefill_c + prefill_context·Σ cᵢ·pᵢ`, where request `i`
///   prefills `cᵢ` new tokens after `pᵢ` already computed (cached or earlier chunks) ones. The
///   last term is 0 by default; setting it to `2·prefill_a` makes a chunked or cache-hit prompt
///   pay for attention over its earlier context the way an unchunked prompt does in the fit.
/// * decode part (when any request decodes): `max(decode_floor, decode_a + decode_b·u +
///   decode_c·u²)` at KV usage `u` in 0..=1.
/// * A step with both pays both; the total is multiplied by `slowdown` (a fault knob).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepTimeModel {
    pub prefill_a: f64,
    pub prefill_b: f64,
    pub prefill_c: f64,
    pub prefill_context: f64,
    pub decode_a: f64,
    pub decode_b: f64,
    pub decode_c: f64,
    pub decode_floor: f64,
}

impl Default for StepTimeModel {
    fn default() -> Self {
        Self {
            prefill_a: 4.21e-7,
            prefill_b: 1.52e-2,
            prefill_c: 16.5,
            prefill_context: 0.0,
            decode_a: 5.7,
            decode_b: 54.0,
            decode_c: -25.7,
            decode_floor: 1.0,
        }
    }
}

impl StepTimeModel {
    /// Prefill part for `tokens` batched prefill tokens and `context` = Σ cᵢ·pᵢ.
    pub fn prefill_ms(&self, tokens: u64, context: f64) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        let t = tokens as f64;
        (self.prefill_a * t * t
            + self.prefill_b * t
            + self.prefill_c
            + self.prefill_context * context)
            .max(0.0)
    }

    /// Decode part at KV usage `usage`.
    pub fn decode_ms(&self, usage: f64) -> f64 {
        let u = usage.clamp(0.0, 1.0);
        (self.decode_a + self.decode_b * u + self.decode_c * u * u).max(self.decode_floor)
    }
}

/// Static configuration of one rank.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV capacity in blocks (vLLM's `num_gpu_blocks`), counting the null block: like vLLM's
    /// `BlockPool`, block 0 is reserved and never holds a cached block, so `num_blocks - 1`
    /// are usable (a real engine evicts one block earlier than `num_gpu_blocks` suggests).
    pub num_blocks: u32,
    /// Most requests in the running batch.
    pub max_num_seqs: usize,
    /// Token budget of one step (prefill chunks plus decodes).
    pub max_num_batched_tokens: u32,
    /// Longest prompt + output, in tokens; `None` = the whole KV capacity.
    pub max_model_len: Option<u32>,
    /// Reuse cached blocks across requests (vLLM's `enable_prefix_caching`).
    pub enable_prefix_caching: bool,
    pub step_time: StepTimeModel,
    /// Seed of the block hash (like `PYTHONHASHSEED`: hashes are comparable only within one
    /// seed) and of the pseudo-text.
    pub hash_seed: u64,
    /// A CPU offload tier of this many blocks (0: none), as vLLM's offloading connector keeps
    /// one: every block the engine computes is written through to it (`BlockStored` with
    /// `medium: CPU`), its least recently used blocks are dropped when it is full
    /// (`BlockRemoved`, `medium: CPU`), and a request's blocks past its GPU hit that the tier
    /// holds are loaded back instead of prefilled.
    pub cpu_offload_blocks: u32,
    /// Milliseconds to load one block back from the CPU tier.
    pub cpu_load_ms_per_block: f64,
    /// GPU slots for LoRA adapters (vLLM's `max_loras`; 0: every adapter is always loaded).
    /// A request whose adapter is not in a slot takes the least recently used slot whose
    /// adapter has no running request and waits `lora_load_ms` for the weights; when every
    /// slot's adapter is running, it is skipped until one frees (as vLLM's scheduler does).
    pub max_loras: u32,
    /// Milliseconds to load an adapter into a slot.
    pub lora_load_ms: f64,
    /// Milliseconds to pull one block of a request's remote KV ([`Request::remote_blocks`]).
    pub kv_transfer_ms_per_block: f64,
    /// Fixed milliseconds of one KV pull (the connector's handshake).
    pub kv_transfer_latency_ms: f64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_blocks: 8192,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_model_len: None,
            enable_prefix_caching: true,
            step_time: StepTimeModel::default(),
            hash_seed: 0,
            cpu_offload_blocks: 0,
            cpu_load_ms_per_block: 0.0,
            max_loras: 0,
            lora_load_ms: 0.0,
            kv_transfer_ms_per_block: 0.0,
            kv_transfer_latency_ms: 0.0,
        }
    }
}

impl EngineConfig {
    /// The effective longest sequence: `max_model_len` bounded by the KV capacity, since a
    /// request that cannot fit in an empty cache would never finish.
    pub fn effective_max_model_len(&self) -> u64 {
        let capacity =
            u64::from(usable_blocks(self.num_blocks)) * u64::from(self.block_size.max(1));
        self.max_model_len
            .map_or(capacity, |m| u64::from(m).min(capacity))
    }
}

/// Blocks that can hold KV: all but vLLM's null block.
fn usable_blocks(num_blocks: u32) -> u32 {
    num_blocks.saturating_sub(1).max(1)
}

/// A request as the engine receives it (already tokenized).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub id: RequestId,
    pub token_ids: Vec<u32>,
    /// Output tokens to generate (exactly this many: the pseudo-model never stops early).
    pub max_tokens: u32,
    /// Tenant salt: requests with different salts never share blocks.
    pub cache_salt: Option<String>,
    /// LoRA adapter name; blocks of different adapters are never shared.
    pub lora: Option<String>,
    /// Leading prompt blocks whose KV another engine computed and this one pulls over its KV
    /// connector instead of prefilling (a disaggregated decode; 0: none). Blocks this
    /// engine's own cache holds are not pulled.
    pub remote_blocks: u32,
}

/// Why [`Rank::submit`] refused a request (the server maps these to HTTP 400).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SubmitError {
    #[error("request {0} is already in the engine")]
    DuplicateId(RequestId),
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    #[error(
        "this model's maximum context length is {max_model_len} tokens; the request has \
         {prompt} prompt tokens and asks for {max_tokens} output tokens"
    )]
    TooLong {
        prompt: usize,
        max_tokens: u32,
        max_model_len: u64,
    },
}

/// The LoRA adapters a rank has in use (vLLM's `lora_requests_info`, SGLang's pool gauges).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LoraState {
    /// Adapters of running requests, sorted.
    pub running: Vec<Arc<str>>,
    /// Adapters of waiting requests, sorted.
    pub waiting: Vec<Arc<str>>,
    /// GPU slots (`None`: no slot model, adapters are always loaded).
    pub max_loras: Option<u32>,
    /// Slots holding an adapter.
    pub slots_used: u32,
}

/// A request that completed in a step.
#[derive(Debug, Clone, PartialEq)]
pub struct FinishedRequest {
    pub id: RequestId,
    pub prompt_tokens: u32,
    /// Prompt tokens served from the prefix cache when the request was first scheduled.
    pub cached_tokens: u32,
    pub output_tokens: u32,
    pub arrival_ms: f64,
    pub first_token_ms: f64,
    pub finish_ms: f64,
    pub preemptions: u32,
}

/// What one step did.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StepOutcome {
    /// Virtual time the step took.
    pub duration_ms: f64,
    /// Virtual time at the end of the step (the rank's clock after it).
    pub end_ms: f64,
    /// Prefill tokens batched in the step.
    pub prefill_tokens: u32,
    /// Requests that decoded one token in the step.
    pub decode_requests: u32,
    /// Blocks requests admitted in the step load back from the CPU offload tier (each such
    /// request computes nothing until its load is done; the others do not wait for it).
    pub loaded_blocks: u32,
    /// Requests whose first output token was produced in this step.
    pub first_tokens: Vec<RequestId>,
    /// The output token each request produced in this step, in schedule order.
    pub tokens: Vec<(RequestId, u32)>,
    /// Requests that finished in this step (their blocks are already released).
    pub finished: Vec<FinishedRequest>,
    /// Requests preempted (sent back to the waiting queue) in this step.
    pub preempted: Vec<RequestId>,
    /// KV events of this step, in order: one batch per step.
    pub kv_events: Vec<KvEvent>,
}

/// Monotonic counters and gauges for `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EngineStats {
    pub waiting: usize,
    pub running: usize,
    /// Fraction of blocks referenced by requests (vLLM's `kv_cache_usage_perc`).
    pub kv_usage: f64,
    pub num_blocks: u32,
    pub block_size: u32,
    /// Distinct block hashes currently cached (used or evictable).
    pub cached_blocks: usize,
    /// Prompt tokens looked up in the prefix cache (counter, tokens).
    pub prefix_cache_queries: u64,
    /// Of those, tokens found (counter, tokens).
    pub prefix_cache_hits: u64,
    /// Prompt tokens loaded back from the CPU offload tier instead of prefilled.
    pub offload_hit_tokens: u64,
    /// Prompt tokens pulled from a remote engine's KV instead of prefilled.
    pub remote_kv_tokens: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub preemptions: u64,
    pub finished_requests: u64,
    pub aborted_requests: u64,
    pub steps: u64,
    /// Requests naming an adapter, counted when first scheduled.
    pub lora_requests: u64,
    /// Of those, the ones whose adapter was already in a slot.
    pub lora_resident: u64,
    /// Adapter loads into a slot.
    pub lora_loads: u64,
}

#[derive(Debug, Clone)]
struct Req {
    tokens: Vec<u32>,
    prompt_len: u32,
    max_tokens: u32,
    /// Parent of the first block's hash: the seed, the salt and the adapter.
    root: u64,
    lora_name: Option<Arc<str>>,
    lora_id: Option<i64>,
    /// Reported in the first block's extra keys, as vLLM does.
    cache_salt: Option<Arc<str>>,
    /// Chained engine hash of every full block of `tokens`.
    block_hashes: Vec<u64>,
    /// Physical blocks holding the request's KV, in order.
    blocks: Vec<BlockId>,
    /// Leading blocks of `blocks` already registered in the cache.
    num_cached_blocks: usize,
    num_computed: u32,
    output_tokens: u32,
    cached_tokens: u32,
    scheduled_once: bool,
    arrival_ms: f64,
    first_token_ms: Option<f64>,
    preemptions: u32,
    text_seed: u64,
    /// While its blocks load back from the CPU tier, it computes nothing before this time (ms).
    ready_ms: f64,
    /// Leading prompt blocks a remote engine holds for it, until it is first scheduled.
    remote_blocks: u32,
    /// Its whole prompt but the last token was pulled: its first step is a decode step.
    pulled_all: bool,
}

impl Req {
    fn num_tokens(&self) -> u32 {
        self.tokens.len() as u32
    }
}

/// One vLLM engine core. See the module docs.
#[derive(Debug, Clone)]
pub struct Rank {
    config: EngineConfig,
    pool: BlockPool,
    requests: FxHashMap<RequestId, Req>,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
    now_ms: f64,
    slowdown: f64,
    stats: EngineStats,
    lora_ids: FxHashMap<Arc<str>, i64>,
    /// The CPU offload tier's blocks, least recently used first.
    cpu: hashlink::LinkedHashMap<u64, ()>,
    /// Adapters in GPU slots, least recently used first (with `max_loras > 0`).
    lora_slots: hashlink::LinkedHashMap<Arc<str>, ()>,
}

impl Rank {
    /// A rank with an empty cache and its clock at 0. Out-of-range sizes are raised to 1 (2 blocks: one is the null block) so
    /// that a bad configuration cannot make the model divide by zero or never progress.
    pub fn new(mut config: EngineConfig) -> Self {
        config.block_size = config.block_size.max(1);
        config.num_blocks = config.num_blocks.max(2);
        config.max_num_seqs = config.max_num_seqs.max(1);
        config.max_num_batched_tokens = config.max_num_batched_tokens.max(1);
        let stats = EngineStats {
            num_blocks: config.num_blocks,
            block_size: config.block_size,
            ..EngineStats::default()
        };
        Self {
            pool: BlockPool::new(usable_blocks(config.num_blocks)),
            config,
            requests: FxHashMap::default(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            now_ms: 0.0,
            slowdown: 1.0,
            stats,
            lora_ids: FxHashMap::default(),
            cpu: hashlink::LinkedHashMap::new(),
            lora_slots: hashlink::LinkedHashMap::new(),
        }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The rank's virtual clock.
    pub fn now_ms(&self) -> f64 {
        self.now_ms
    }

    /// Move the clock forward to `t` (idle time); never backwards.
    pub fn advance_to(&mut self, t_ms: f64) {
        if t_ms > self.now_ms {
            self.now_ms = t_ms;
        }
    }

    /// Multiply every step's duration by `factor` (>= 0.01), a fault knob.
    pub fn set_slowdown(&mut self, factor: f64) {
        self.slowdown = if factor.is_finite() {
            factor.max(0.01)
        } else {
            1.0
        };
    }

    pub fn slowdown(&self) -> f64 {
        self.slowdown
    }

    /// Whether a step would do anything.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Fraction of the usable blocks referenced by requests (vLLM leaves the null block out).
    pub fn kv_usage(&self) -> f64 {
        self.pool.num_used() as f64 / self.pool.num_blocks() as f64
    }

    pub fn stats(&self) -> EngineStats {
        EngineStats {
            waiting: self.waiting.len(),
            running: self.running.len(),
            kv_usage: self.kv_usage(),
            cached_blocks: self.pool.num_cached_hashes(),
            ..self.stats
        }
    }

    /// Prompt tokens of an in-flight request served from the prefix cache (known once it has
    /// been scheduled; 0 before).
    pub fn cached_tokens(&self, id: RequestId) -> Option<u32> {
        self.requests.get(&id).map(|r| r.cached_tokens)
    }

    pub fn contains(&self, id: RequestId) -> bool {
        self.requests.contains_key(&id)
    }

    /// Tokens of `token_ids` that a request would find in the cache right now (a full-block
    /// count times the block size, capped below the last token like a real lookup).
    pub fn probe_prefix(
        &self,
        token_ids: &[u32],
        cache_salt: Option<&str>,
        lora: Option<&str>,
    ) -> u32 {
        if !self.config.enable_prefix_caching || token_ids.is_empty() {
            return 0;
        }
        let bs = self.config.block_size as usize;
        let max_blocks = (token_ids.len() - 1) / bs;
        let mut parent = self.root_hash(cache_salt, lora);
        let mut hit = 0;
        for block in token_ids.chunks_exact(bs).take(max_blocks) {
            parent = self.block_hash(parent, block);
            if self.pool.lookup(parent).is_none() {
                break;
            }
            hit += 1;
        }
        (hit * bs) as u32
    }

    /// Queue a request (arriving now).
    ///
    /// # Errors
    /// [`SubmitError`] when the id is in use, the prompt is empty, `max_tokens` is 0, or
    /// prompt + output exceed the model length.
    pub fn submit(&mut self, request: Request) -> Result<(), SubmitError> {
        let now = self.now_ms;
        self.submit_at(request, now)
    }

    /// Queue a request that arrived at `arrival_ms` (for TTFT accounting; may be earlier than
    /// the clock when the caller's clock and the rank's drift apart).
    ///
    /// # Errors
    /// As [`Self::submit`].
    pub fn submit_at(&mut self, request: Request, arrival_ms: f64) -> Result<(), SubmitError> {
        if self.requests.contains_key(&request.id) {
            return Err(SubmitError::DuplicateId(request.id));
        }
        if request.token_ids.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if request.max_tokens == 0 {
            return Err(SubmitError::ZeroMaxTokens);
        }
        let max_model_len = self.config.effective_max_model_len();
        let total = request.token_ids.len() as u64 + u64::from(request.max_tokens);
        if total > max_model_len {
            return Err(SubmitError::TooLong {
                prompt: request.token_ids.len(),
                max_tokens: request.max_tokens,
                max_model_len,
            });
        }
        let id = request.id;
        let req = self.new_req(request, arrival_ms);
        self.requests.insert(id, req);
        self.waiting.push_back(id);
        Ok(())
    }

    /// The engine's record of a request that has passed [`Self::submit_at`]'s checks, with its
    /// block hashes.
    fn new_req(&mut self, request: Request, arrival_ms: f64) -> Req {
        let lora_name: Option<Arc<str>> = request.lora.as_deref().map(Arc::from);
        let lora_id = lora_name.as_ref().map(|name| {
            let next = self.lora_ids.len() as i64 + 1;
            *self.lora_ids.entry(name.clone()).or_insert(next)
        });
        let root = self.root_hash(request.cache_salt.as_deref(), request.lora.as_deref());
        let mut req = Req {
            prompt_len: request.token_ids.len() as u32,
            tokens: request.token_ids,
            max_tokens: request.max_tokens,
            root,
            lora_name,
            lora_id,
            cache_salt: request.cache_salt.as_deref().map(Arc::from),
            block_hashes: Vec::new(),
            blocks: Vec::new(),
            num_cached_blocks: 0,
            num_computed: 0,
            output_tokens: 0,
            cached_tokens: 0,
            scheduled_once: false,
            arrival_ms,
            first_token_ms: None,
            preemptions: 0,
            text_seed: mix(self.config.hash_seed ^ mix(request.id.wrapping_add(0x5eed))),
            ready_ms: 0.0,
            remote_blocks: request.remote_blocks,
            pulled_all: false,
        };
        self.extend_block_hashes(&mut req);
        req
    }

    /// Prefill a synthetic prompt of `len` tokens (ids drawn from `seed`) outside the
    /// scheduler, as traffic this simulator does not serve would: its blocks are stored in
    /// the cache, evicting the least recently used as a full GPU does, then released, so they
    /// stay cached until evicted in turn. Returns the KV events that a real engine publishes
    /// for it (a `BlockStored`, and a `BlockRemoved` per evicted block); none when running
    /// requests hold too much of the cache to take it. Takes no modelled time and leaves the
    /// counters alone.
    pub fn prefill_synthetic(&mut self, seed: u64, len: u32) -> Vec<KvEvent> {
        let token_ids = synthetic_tokens(seed, len.max(1));
        let request = Request {
            id: RequestId::MAX,
            token_ids,
            max_tokens: 1,
            cache_salt: None,
            lora: None,
            remote_blocks: 0,
        };
        let now = self.now_ms;
        let mut req = self.new_req(request, now);
        let hits = self.lookup_prefix(&req);
        req.num_computed = hits.len() as u32 * self.config.block_size;
        let todo = req.num_tokens() - req.num_computed;
        let mut events = Vec::new();
        if self.allocate(&mut req, todo, &hits, &mut events) {
            self.release_blocks(&mut req);
        }
        events
    }

    /// Remove a request wherever it is (client went away), releasing its blocks. Returns
    /// whether it was known.
    pub fn abort(&mut self, id: RequestId) -> bool {
        let Some(mut req) = self.requests.remove(&id) else {
            return false;
        };
        if let Some(pos) = self.running.iter().position(|&r| r == id) {
            self.running.remove(pos);
        } else if let Some(pos) = self.waiting.iter().position(|&r| r == id) {
            self.waiting.remove(pos);
        }
        self.release_blocks(&mut req);
        self.stats.aborted_requests += 1;
        true
    }

    /// Drop every request and the whole cache, as a restarted engine (or vLLM's
    /// `reset_prefix_cache`) would. Returns the aborted requests and the event to publish
    /// (`AllBlocksCleared`). With `reset_counters` the metrics counters start over too, as in a
    /// new process.
    pub fn reset(&mut self, reset_counters: bool) -> (Vec<RequestId>, Vec<KvEvent>) {
        let mut aborted: Vec<RequestId> = self.running.drain(..).collect();
        aborted.extend(self.waiting.drain(..));
        self.requests.clear();
        self.pool.reset(usable_blocks(self.config.num_blocks));
        // `AllBlocksCleared` makes a router forget every tier of the engine
        self.cpu.clear();
        if reset_counters {
            self.stats = EngineStats {
                num_blocks: self.config.num_blocks,
                block_size: self.config.block_size,
                ..EngineStats::default()
            };
        } else {
            self.stats.aborted_requests += aborted.len() as u64;
        }
        (aborted, vec![KvEvent::AllBlocksCleared])
    }

    /// Run one scheduler step: schedule, advance the clock by the modelled duration, and
    /// apply its results. `None` when there is nothing to do.
    pub fn next_step(&mut self) -> Option<StepOutcome> {
        if !self.has_work() {
            return None;
        }
        let mut out = StepOutcome::default();
        let scheduled = self.schedule(&mut out);
        if scheduled.is_empty()
            && let Some(ready) = self
                .running
                .iter()
                .filter_map(|id| self.requests.get(id))
                .map(|r| r.ready_ms)
                .filter(|&t| t > self.now_ms)
                .min_by(f64::total_cmp)
        {
            // nothing to compute until a load finishes: the engine waits for it
            out.duration_ms = ready - self.now_ms;
            self.now_ms = ready;
            out.end_ms = ready;
            return Some(out);
        }
        if scheduled.is_empty() {
            // Cannot happen for requests admitted by `submit` (each fits an empty cache), but a
            // stuck engine must not spin: report an idle step.
            return if out.kv_events.is_empty() && out.preempted.is_empty() {
                None
            } else {
                Some(out)
            };
        }

        // Step time.
        let mut prefill_tokens = 0u64;
        let mut context = 0f64;
        let mut decodes = 0u32;
        for &(id, n) in &scheduled {
            let Some(req) = self.requests.get(&id) else {
                continue;
            };
            let is_decode = n == 1
                && (req.output_tokens > 0 || req.pulled_all)
                && req.num_computed + 1 == req.num_tokens();
            if is_decode {
                decodes += 1;
            } else {
                prefill_tokens += u64::from(n);
                context += f64::from(n) * f64::from(req.num_computed);
            }
        }
        let model = &self.config.step_time;
        let mut duration = model.prefill_ms(prefill_tokens, context);
        if decodes > 0 {
            duration += model.decode_ms(self.kv_usage());
        }
        duration = (duration * self.slowdown).max(model.decode_floor.max(0.001));
        out.duration_ms = duration;
        out.prefill_tokens = prefill_tokens as u32;
        out.decode_requests = decodes;
        self.now_ms += duration;
        out.end_ms = self.now_ms;
        self.stats.steps += 1;

        // Results: every request whose tokens are all computed samples one token.
        for (id, n) in scheduled {
            let Some(mut req) = self.requests.remove(&id) else {
                continue;
            };
            req.num_computed += n;
            if req.num_computed < req.num_tokens() {
                self.requests.insert(id, req);
                continue;
            }
            let token = pseudo_token(req.text_seed, req.output_tokens);
            req.tokens.push(token);
            req.output_tokens += 1;
            self.extend_block_hashes(&mut req);
            self.stats.generation_tokens += 1;
            out.tokens.push((id, token));
            if req.first_token_ms.is_none() {
                req.first_token_ms = Some(self.now_ms);
                self.stats.prompt_tokens += u64::from(req.prompt_len);
                out.first_tokens.push(id);
            }
            if req.output_tokens >= req.max_tokens {
                if let Some(pos) = self.running.iter().position(|&r| r == id) {
                    self.running.remove(pos);
                }
                self.release_blocks(&mut req);
                self.stats.finished_requests += 1;
                out.finished.push(FinishedRequest {
                    id,
                    prompt_tokens: req.prompt_len,
                    cached_tokens: req.cached_tokens,
                    output_tokens: req.output_tokens,
                    arrival_ms: req.arrival_ms,
                    first_token_ms: req.first_token_ms.unwrap_or(self.now_ms),
                    finish_ms: self.now_ms,
                    preemptions: req.preemptions,
                });
            } else {
                self.requests.insert(id, req);
            }
        }
        Some(out)
    }

    /// The scheduling half of a step: which requests compute how many tokens.
    fn schedule(&mut self, out: &mut StepOutcome) -> Vec<(RequestId, u32)> {
        let mut budget = self.config.max_num_batched_tokens;
        let mut scheduled = Vec::new();
        let mut preempted_any = false;

        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let Some(mut req) = self.requests.remove(&id) else {
                self.running.remove(i);
                continue;
            };
            let n = (req.num_tokens() - req.num_computed).min(budget);
            if n == 0 || req.ready_ms > self.now_ms {
                self.requests.insert(id, req);
                i += 1;
                continue;
            }
            let mut placed = false;
            loop {
                if self.allocate(&mut req, n, &[], &mut out.kv_events) {
                    placed = true;
                    break;
                }
                // Out of KV space: preempt the newest running request.
                let Some(victim) = self.running.pop() else {
                    break;
                };
                preempted_any = true;
                out.preempted.push(victim);
                if victim == id {
                    self.preempt(&mut req);
                    break;
                }
                if let Some(mut v) = self.requests.remove(&victim) {
                    self.preempt(&mut v);
                    self.requests.insert(victim, v);
                }
                self.waiting.push_front(victim);
            }
            self.requests.insert(id, req);
            if placed {
                scheduled.push((id, n));
                budget -= n;
                i += 1;
            } else {
                // `id` itself was preempted (it was the last running request).
                self.waiting.push_front(id);
            }
        }

        if preempted_any {
            return scheduled;
        }
        let mut at = 0;
        while budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(&id) = self.waiting.get(at) else {
                break;
            };
            let Some(mut req) = self.requests.remove(&id) else {
                self.waiting.remove(at);
                continue;
            };
            // its adapter needs a slot: skip it while every slot's adapter is running
            let lora = match req.lora_name.clone() {
                Some(name) if self.config.max_loras > 0 => match self.lora_slot(&name) {
                    Some(load) => Some((name, load)),
                    None => {
                        self.requests.insert(id, req);
                        at += 1;
                        continue;
                    }
                },
                _ => None,
            };
            let hits = if req.num_computed == 0 {
                self.lookup_prefix(&req)
            } else {
                Vec::new()
            };
            // the blocks after the GPU hit that the CPU tier holds are loaded, not prefilled
            let loaded = if req.num_computed == 0 {
                self.lookup_offloaded(&req, hits.len())
            } else {
                0
            };
            // the prompt a remote engine computed for it is pulled, once (after a preemption
            // it recomputes it here), except what this engine holds: every token but the
            // last, which its first step computes as a decode step would (vLLM 0.32 pulls
            // the whole prompt, partial last block included: docs/real-engines.md)
            let bs = self.config.block_size.max(1);
            let held = (hits.len() as u32 + loaded) * bs;
            let pulled = if req.num_computed == 0 && req.remote_blocks > 0 {
                std::mem::take(&mut req.remote_blocks)
                    .saturating_mul(bs)
                    .min(req.prompt_len.saturating_sub(1))
                    .saturating_sub(held)
            } else {
                0
            };
            let hit_tokens = hits.len() as u32 * bs;
            let computed = held + pulled;
            // a request loading from the CPU tier or pulling remote KV takes its blocks now
            // and computes once they are in
            let n = if loaded > 0 || pulled > 0 {
                0
            } else {
                (req.num_tokens() - computed).min(budget)
            };
            // an adapter being loaded: the request computes once its weights are in
            let lora_wait = lora.as_ref().map_or(0.0, |(_, load)| *load);
            let n = if lora_wait > 0.0 { 0 } else { n };
            req.num_computed = computed;
            if !self.allocate(&mut req, n, &hits, &mut out.kv_events) {
                req.num_computed = 0;
                self.requests.insert(id, req);
                break;
            }
            if let Some((name, load)) = &lora {
                self.take_lora_slot(name, !req.scheduled_once, *load == 0.0);
            }
            out.loaded_blocks += loaded;
            self.stats.offload_hit_tokens += u64::from(loaded * self.config.block_size);
            if loaded > 0 {
                req.ready_ms =
                    self.now_ms + f64::from(loaded) * self.config.cpu_load_ms_per_block.max(0.0);
            }
            if pulled > 0 {
                // all of the prompt came from the remote engine: its last token too, as vLLM
                // counts it (`external_kv_transfer`)
                req.pulled_all = computed + 1 == req.prompt_len;
                self.stats.remote_kv_tokens += u64::from(pulled + u32::from(req.pulled_all));
                req.ready_ms = req.ready_ms.max(
                    self.now_ms
                        + self.config.kv_transfer_latency_ms.max(0.0)
                        + f64::from(pulled.div_ceil(bs))
                            * self.config.kv_transfer_ms_per_block.max(0.0),
                );
            }
            if lora_wait > 0.0 {
                req.ready_ms = req.ready_ms.max(self.now_ms + lora_wait);
            }
            if !req.scheduled_once {
                req.scheduled_once = true;
                req.cached_tokens = hit_tokens;
                if self.config.enable_prefix_caching {
                    self.stats.prefix_cache_queries += u64::from(req.prompt_len);
                    self.stats.prefix_cache_hits += u64::from(hit_tokens);
                }
            }
            self.requests.insert(id, req);
            self.waiting.remove(at);
            self.running.push(id);
            if n > 0 {
                scheduled.push((id, n));
                budget -= n;
            }
        }
        scheduled
    }

    /// Whether adapter `name` can run now: `Some(0.0)` when it is in a slot, `Some(load
    /// time)` when a slot is free or holds an adapter with no running request, `None` when
    /// every slot's adapter is running.
    fn lora_slot(&self, name: &Arc<str>) -> Option<f64> {
        if self.lora_slots.contains_key(name) {
            return Some(0.0);
        }
        let free = self.lora_slots.len() < self.config.max_loras as usize
            || self.lora_slots.keys().any(|held| !self.lora_running(held));
        free.then_some(self.config.lora_load_ms.max(0.0))
    }

    /// Whether a running request uses adapter `name`.
    fn lora_running(&self, name: &Arc<str>) -> bool {
        self.running.iter().any(|id| {
            self.requests
                .get(id)
                .and_then(|r| r.lora_name.as_ref())
                .is_some_and(|n| n == name)
        })
    }

    /// Puts adapter `name` in a slot (evicting the least recently used idle one when all are
    /// taken) or marks it used; counts a `first` scheduling (`resident`: its adapter was in a
    /// slot).
    fn take_lora_slot(&mut self, name: &Arc<str>, first: bool, resident: bool) {
        if self.lora_slots.contains_key(name) {
            self.lora_slots.to_back(name);
        } else {
            if self.lora_slots.len() >= self.config.max_loras as usize {
                let idle = self
                    .lora_slots
                    .keys()
                    .find(|held| !self.lora_running(held))
                    .cloned();
                if let Some(idle) = idle {
                    self.lora_slots.remove(&idle);
                }
            }
            self.lora_slots.insert(name.clone(), ());
            self.stats.lora_loads += 1;
        }
        if first {
            self.stats.lora_requests += 1;
            self.stats.lora_resident += u64::from(resident);
        }
    }

    /// The adapters in use, as the engines' LoRA metrics report them.
    pub fn lora_state(&self) -> LoraState {
        let names = |ids: &mut dyn Iterator<Item = &RequestId>| {
            let mut v: Vec<Arc<str>> = ids
                .filter_map(|id| self.requests.get(id)?.lora_name.clone())
                .collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        LoraState {
            running: names(&mut self.running.iter()),
            waiting: names(&mut self.waiting.iter()),
            max_loras: (self.config.max_loras > 0).then_some(self.config.max_loras),
            slots_used: self.lora_slots.len() as u32,
        }
    }

    /// Longest run of cached leading blocks, never covering the last token.
    fn lookup_prefix(&self, req: &Req) -> Vec<BlockId> {
        if !self.config.enable_prefix_caching {
            return Vec::new();
        }
        let max_blocks = (req.num_tokens() as usize - 1) / self.config.block_size as usize;
        req.block_hashes
            .iter()
            .take(max_blocks)
            .map_while(|&h| self.pool.lookup(h))
            .collect()
    }

    /// Blocks right after the first `from` of `req`'s prompt that the CPU tier holds (never
    /// covering the last token), refreshed as used.
    fn lookup_offloaded(&mut self, req: &Req, from: usize) -> u32 {
        if self.config.cpu_offload_blocks == 0 || !self.config.enable_prefix_caching {
            return 0;
        }
        let max_blocks = (req.num_tokens() as usize - 1) / self.config.block_size as usize;
        let mut n = 0;
        for h in req.block_hashes.iter().take(max_blocks).skip(from) {
            if self.cpu.to_back(h).is_none() {
                break;
            }
            n += 1;
        }
        n
    }

    /// Write the blocks of a `BlockStored` through to the CPU tier (vLLM's offloading
    /// connector with self-describing events: the same hashes, parent and tokens, `medium:
    /// CPU`), dropping its least recently used blocks past its capacity.
    fn offload(&mut self, stored: &KvEvent, events: &mut Vec<KvEvent>) {
        let cap = self.config.cpu_offload_blocks as usize;
        let KvEvent::BlockStored { block_hashes, .. } = stored else {
            return;
        };
        if cap == 0 {
            return;
        }
        for &h in block_hashes {
            if self.cpu.to_back(&h).is_none() {
                self.cpu.insert(h, ());
            }
        }
        let mut copy = stored.clone();
        if let KvEvent::BlockStored { medium, place, .. } = &mut copy {
            *medium = Some(MEDIUM_CPU.to_owned());
            place.locality = Some("LOCAL".to_owned());
        }
        events.push(copy);
        let mut dropped = Vec::new();
        while self.cpu.len() > cap {
            if let Some((h, ())) = self.cpu.pop_front() {
                dropped.push(h);
            }
        }
        if !dropped.is_empty() {
            events.push(KvEvent::BlockRemoved {
                block_hashes: dropped,
                medium: Some(MEDIUM_CPU.to_owned()),
                place: BlockPlace {
                    group_idx: Some(0),
                    locality: Some("LOCAL".to_owned()),
                    ..BlockPlace::default()
                },
            });
        }
    }

    /// Give `req` room for `n` more tokens after `req.num_computed` (which already counts the
    /// `hits`), taking references on the hit blocks, evicting cached blocks as needed and
    /// registering the blocks this step fills. `false` (and no change) when it does not fit.
    fn allocate(
        &mut self,
        req: &mut Req,
        n: u32,
        hits: &[BlockId],
        events: &mut Vec<KvEvent>,
    ) -> bool {
        let bs = self.config.block_size as usize;
        let total = req.num_computed as usize + n as usize;
        let need = total.div_ceil(bs);
        let have = req.blocks.len() + hits.len();
        let new_blocks = need.saturating_sub(have);
        let hits_in_free = hits.iter().filter(|&&b| self.pool.ref_cnt(b) == 0).count();
        if new_blocks > self.pool.num_free().saturating_sub(hits_in_free) {
            return false;
        }
        for &b in hits {
            self.pool.touch(b);
        }
        if !hits.is_empty() {
            // Hits are only looked up for a request holding no blocks; they are registered.
            req.blocks.extend_from_slice(hits);
            req.num_cached_blocks = hits.len();
        }
        for _ in 0..new_blocks {
            let Some((b, evicted)) = self.pool.pop_free() else {
                break;
            };
            if let Some(h) = evicted {
                events.push(KvEvent::BlockRemoved {
                    block_hashes: vec![h],
                    medium: Some(MEDIUM_GPU.to_owned()),
                    place: BlockPlace {
                        group_idx: Some(0),
                        ..BlockPlace::default()
                    },
                });
            }
            req.blocks.push(b);
        }
        if self.config.enable_prefix_caching {
            let full = total.min(req.tokens.len()) / bs;
            self.register_full_blocks(req, full, events);
        }
        true
    }

    fn register_full_blocks(&mut self, req: &mut Req, full: usize, events: &mut Vec<KvEvent>) {
        let start = req.num_cached_blocks;
        if full <= start {
            return;
        }
        let bs = self.config.block_size as usize;
        let mut hashes = Vec::with_capacity(full - start);
        for i in start..full {
            let h = req.block_hashes[i];
            self.pool.register(req.blocks[i], h);
            hashes.push(h);
        }
        // vLLM's extra keys: the adapter on every block, the salt on the prefix's first
        let extra_keys = if req.lora_name.is_some() || req.cache_salt.is_some() {
            (start..full)
                .map(|i| {
                    let mut keys = Vec::new();
                    if let Some(l) = &req.lora_name {
                        keys.push(ExtraKey::Str(l.to_string()));
                    }
                    if let (0, Some(s)) = (i, &req.cache_salt) {
                        keys.push(ExtraKey::Str(s.to_string()));
                    }
                    (!keys.is_empty()).then_some(keys)
                })
                .collect()
        } else {
            Vec::new()
        };
        events.push(KvEvent::BlockStored {
            block_hashes: hashes,
            parent_block_hash: start.checked_sub(1).map(|p| req.block_hashes[p]),
            token_ids: req.tokens[start * bs..full * bs].to_vec(),
            block_size: self.config.block_size,
            lora_id: req.lora_id,
            medium: Some(MEDIUM_GPU.to_owned()),
            lora_name: req.lora_name.as_deref().map(str::to_owned),
            extra_keys,
            cache_salt: None,
            // vLLM 0.32 names the (single, full-attention) group on every store
            place: BlockPlace {
                group_idx: Some(0),
                spec_kind: Some("full_attention".to_owned()),
                ..BlockPlace::default()
            },
        });
        if self.config.cpu_offload_blocks > 0
            && let Some(stored) = events.last().cloned()
        {
            self.offload(&stored, events);
        }
        req.num_cached_blocks = full;
    }

    fn preempt(&mut self, req: &mut Req) {
        self.release_blocks(req);
        req.num_computed = 0;
        req.preemptions += 1;
        self.stats.preemptions += 1;
    }

    /// Release a request's blocks, last block first, so that its tail is evicted before its
    /// head (the head is what other requests share).
    fn release_blocks(&mut self, req: &mut Req) {
        for &b in req.blocks.iter().rev() {
            self.pool.release(b);
        }
        req.blocks.clear();
        req.num_cached_blocks = 0;
    }

    fn extend_block_hashes(&self, req: &mut Req) {
        let bs = self.config.block_size as usize;
        let full = req.tokens.len() / bs;
        while req.block_hashes.len() < full {
            let i = req.block_hashes.len();
            let parent = i.checked_sub(1).map_or(req.root, |p| req.block_hashes[p]);
            let h = self.block_hash(parent, &req.tokens[i * bs..(i + 1) * bs]);
            req.block_hashes.push(h);
        }
    }

    /// The engine's block hash: SipHash over (seed, parent, tokens). Deliberately a different
    /// function from the picker's block keys, so the picker has to re-key events from their
    /// token ids exactly as it must with a real engine.
    fn block_hash(&self, parent: u64, tokens: &[u32]) -> u64 {
        let mut h = std::hash::DefaultHasher::new();
        self.config.hash_seed.hash(&mut h);
        parent.hash(&mut h);
        tokens.hash(&mut h);
        h.finish()
    }

    fn root_hash(&self, salt: Option<&str>, lora: Option<&str>) -> u64 {
        let mut h = std::hash::DefaultHasher::new();
        self.config.hash_seed.hash(&mut h);
        "kvroute-sim-root".hash(&mut h);
        salt.hash(&mut h);
        lora.hash(&mut h);
        h.finish()
    }
}

/// The token ids of [`Rank::prefill_synthetic`]'s prompt `seed`: `len` ids below 32,000.
pub(crate) fn synthetic_tokens(seed: u64, len: u32) -> Vec<u32> {
    (0..len)
        .map(|i| (mix(seed ^ u64::from(i).wrapping_mul(0xa076_1d64_78bd_642f)) % 32_000) as u32)
        .collect()
}

/// SplitMix64 finalizer.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Output token `index` of a request: the code point of a lowercase letter, or a space about
/// once in six, so the text reads as words.
pub fn pseudo_token(seed: u64, index: u32) -> u32 {
    let r = mix(seed ^ u64::from(index).wrapping_mul(0xa076_1d64_78bd_642f));
    if index > 0 && r.is_multiple_of(6) {
        u32::from(b' ')
    } else {
        u32::from(b'a') + ((r >> 8) % 26) as u32
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests;
