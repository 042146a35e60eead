//! The command line of `kvroute-sim`, the vLLM-compatible engine simulator: flags into a
//! [`SimConfig`], the engines started, one JSON line with the bound addresses on stdout once
//! every engine listens; logs go to stderr.

use std::io::Write as _;
use std::net::IpAddr;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Parser, ValueEnum};
use kvroute_routing::kv_events::EventEncoding;

use crate::engine::{EngineConfig, StepTimeModel};
use crate::server::{self, FaultSpec, Flavor, KvLoadFailure, PortSpec, SimConfig};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum KvLoadFailureArg {
    Recompute,
    Fail,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum FlavorArg {
    Vllm,
    Sglang,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum EncodingArg {
    /// Positional events (vLLM before #42892, SGLang).
    Array,
    /// Positional batch, map-encoded events (vLLM v0.26).
    MapEvents,
    /// Map batch and map events (vLLM main).
    Map,
    /// TensorRT-LLM's serializer dicts, a bare list per batch (no clear event: a reset is
    /// seen as a restart).
    Trtllm,
}

/// Simulated vLLM (or SGLang) engines: OpenAI HTTP API, /metrics, KV events over ZMQ.
#[derive(Debug, Parser)]
#[command(name = "kvroute-sim", version)]
struct Args {
    /// Address to bind (HTTP and ZMQ), e.g. 127.0.0.3.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// HTTP port of engine 0; 0 picks free ports (see the JSON line on stdout).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Engines in this process; engine i uses port + i * stride.
    #[arg(long, default_value_t = 1)]
    engines: usize,
    /// Port distance between engines (default: the DP size).
    #[arg(long)]
    port_stride: Option<u16>,
    /// Data-parallel ranks per engine.
    #[arg(long, default_value_t = 1)]
    dp_size: u32,
    /// One HTTP port per rank (port + rank) instead of one port for all ranks.
    #[arg(long)]
    dp_rank_ports: bool,
    /// Served model name.
    #[arg(long, default_value = "sim-model")]
    model: String,
    /// LoRA adapter names served next to the model (comma separated).
    #[arg(long, value_delimiter = ',')]
    lora_modules: Vec<String>,
    /// Metric names and DP body field conventions to follow.
    #[arg(long, value_enum, default_value = "vllm")]
    flavor: FlavorArg,
    /// KV cache capacity per rank, in blocks.
    #[arg(long, default_value_t = 8192)]
    kv_blocks: u32,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    #[arg(long, default_value_t = 256)]
    max_num_seqs: usize,
    /// Token budget per step (chunked prefill).
    #[arg(long, default_value_t = 8192)]
    max_batched_tokens: u32,
    /// Longest prompt + output (default: the KV capacity).
    #[arg(long)]
    max_model_len: Option<u32>,
    #[arg(long)]
    no_prefix_caching: bool,
    /// A CPU offload tier of this many blocks per rank, written through and published with
    /// `medium: CPU` as vLLM's offloading connector does (0: none).
    #[arg(long, default_value_t = 0)]
    cpu_offload_blocks: u32,
    /// Milliseconds to load one block back from the CPU tier.
    #[arg(long, default_value_t = 0.0)]
    cpu_load_ms_per_block: f64,
    /// GPU slots for LoRA adapters (vLLM's `--max-loras`); 0: adapters are always loaded.
    #[arg(long, default_value_t = 0)]
    max_loras: u32,
    /// Milliseconds to load an adapter into a slot.
    #[arg(long, default_value_t = 50.0)]
    lora_load_ms: f64,
    /// Act as vLLM with a NIXL-style KV connector (`kv_role: kv_both`): a request whose
    /// `kv_transfer_params` say `do_remote_decode` answers with the parameters a decode
    /// engine pulls its KV with; one that says `do_remote_prefill` pulls the prompt's KV
    /// from the engine named there (in this process) instead of prefilling it.
    #[arg(long)]
    kv_transfer: bool,
    /// Milliseconds to pull one KV block from a remote engine.
    #[arg(long, default_value_t = 0.1)]
    kv_transfer_ms_per_block: f64,
    /// Fixed milliseconds of one KV pull.
    #[arg(long, default_value_t = 2.0)]
    kv_transfer_latency_ms: f64,
    /// What a decode engine does when the remote KV cannot be pulled (the engine is gone
    /// or restarted): `fail` the request (vLLM 0.32's default) or `recompute` the prompt.
    #[arg(long, value_enum, default_value = "fail")]
    kv_load_failure_policy: KvLoadFailureArg,
    /// Run this many times faster than real time.
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// Seed for block hashes and fault randomness (default: random per process, like
    /// PYTHONHASHSEED).
    #[arg(long)]
    seed: Option<u64>,
    /// KV event PUB base port (rank k on port + k); 0/off disables, auto picks free ports.
    #[arg(long, default_value = "0")]
    kv_events_port: PortSpec,
    /// Replay ROUTER base port; 0/off disables, auto picks free ports.
    #[arg(long, default_value = "0")]
    kv_replay_port: PortSpec,
    #[arg(long, default_value = "")]
    kv_events_topic: String,
    #[arg(long, value_enum, default_value = "map-events")]
    kv_events_encoding: EncodingArg,
    /// Do not serve `GET /kv_event_sources` (as vLLM before 0.32 and SGLang do not).
    #[arg(long)]
    no_kv_event_sources: bool,
    /// Batches kept for replay per rank.
    #[arg(long, default_value_t = 10_000)]
    kv_replay_buffer: usize,
    /// Waiting requests per rank beyond which new requests get HTTP 429.
    #[arg(long, default_value_t = 4096)]
    max_waiting: usize,
    /// Output tokens when a request does not set max_tokens.
    #[arg(long, default_value_t = 16)]
    default_max_tokens: u32,
    #[arg(long, default_value_t = 64 << 20)]
    max_body_bytes: usize,
    /// Prefill time coefficients (ms): a*T^2 + b*T + c (+ context * sum of new x earlier tokens).
    #[arg(long, default_value_t = 4.21e-7)]
    prefill_a: f64,
    #[arg(long, default_value_t = 1.52e-2)]
    prefill_b: f64,
    #[arg(long, default_value_t = 16.5)]
    prefill_c: f64,
    #[arg(long, default_value_t = 0.0)]
    prefill_context: f64,
    /// Decode step time coefficients (ms): a + b*u + c*u^2 at KV usage u, at least floor.
    #[arg(long, default_value_t = 5.7)]
    decode_a: f64,
    #[arg(long, default_value_t = 54.0)]
    decode_b: f64,
    #[arg(long, default_value_t = -25.7, allow_hyphen_values = true)]
    decode_c: f64,
    #[arg(long, default_value_t = 1.0)]
    decode_floor: f64,
    /// Hugging Face tokenizer: tokenizer.json, or a directory with tokenizer.json and
    /// tokenizer_config.json (chat template). Default: one id per character, as the router
    /// does without a tokenizer.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// A fault as JSON, e.g. '{"kind":"slow","factor":2,"after_ms":5000,"engine":0}'
    /// (kinds: crash, hang, slow, drop_events, restart, clear). Repeatable.
    #[arg(long)]
    fault: Vec<String>,
}

fn config(a: Args) -> anyhow::Result<SimConfig> {
    let faults = a
        .fault
        .iter()
        .map(|f| serde_json::from_str::<FaultSpec>(f).with_context(|| format!("bad --fault {f}")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let seed = a.seed.unwrap_or_else(rand::random);
    if matches!(a.kv_events_encoding, EncodingArg::Trtllm) && a.cpu_offload_blocks > 0 {
        // the simulated CPU tier is vLLM's write-through one; TensorRT-LLM moves a block
        // between tiers and removes it from whichever holds it
        anyhow::bail!(
            "--kv-events-encoding trtllm cannot be combined with --cpu-offload-blocks: the \
             simulated CPU tier writes through (vLLM), TensorRT-LLM moves blocks between tiers"
        );
    }
    Ok(SimConfig {
        host: a.host,
        port: a.port,
        engines: a.engines,
        port_stride: a.port_stride,
        dp_size: a.dp_size,
        dp_rank_ports: a.dp_rank_ports,
        model: a.model,
        lora_modules: a.lora_modules,
        flavor: match a.flavor {
            FlavorArg::Vllm => Flavor::Vllm,
            FlavorArg::Sglang => Flavor::Sglang,
        },
        engine: EngineConfig {
            block_size: a.block_size,
            num_blocks: a.kv_blocks,
            max_num_seqs: a.max_num_seqs,
            max_num_batched_tokens: a.max_batched_tokens,
            max_model_len: a.max_model_len,
            enable_prefix_caching: !a.no_prefix_caching,
            step_time: StepTimeModel {
                prefill_a: a.prefill_a,
                prefill_b: a.prefill_b,
                prefill_c: a.prefill_c,
                prefill_context: a.prefill_context,
                decode_a: a.decode_a,
                decode_b: a.decode_b,
                decode_c: a.decode_c,
                decode_floor: a.decode_floor,
            },
            hash_seed: 0,
            cpu_offload_blocks: a.cpu_offload_blocks,
            cpu_load_ms_per_block: a.cpu_load_ms_per_block,
            max_loras: a.max_loras,
            lora_load_ms: a.lora_load_ms,
            kv_transfer_ms_per_block: a.kv_transfer_ms_per_block,
            kv_transfer_latency_ms: a.kv_transfer_latency_ms,
        },
        kv_transfer: a.kv_transfer.then_some(match a.kv_load_failure_policy {
            KvLoadFailureArg::Recompute => KvLoadFailure::Recompute,
            KvLoadFailureArg::Fail => KvLoadFailure::Fail,
        }),
        speedup: a.speedup,
        seed,
        kv_events: a.kv_events_port,
        kv_replay: a.kv_replay_port,
        kv_topic: a.kv_events_topic,
        kv_encoding: match a.kv_events_encoding {
            EncodingArg::Array => EventEncoding::Array,
            EncodingArg::MapEvents => EventEncoding::MapEvents,
            EncodingArg::Map => EventEncoding::Map,
            EncodingArg::Trtllm => EventEncoding::Trtllm,
        },
        kv_event_sources: !a.no_kv_event_sources,
        replay_buffer: a.kv_replay_buffer,
        max_waiting: a.max_waiting,
        max_body_bytes: a.max_body_bytes,
        default_max_tokens: a.default_max_tokens,
        faults,
        tokenizer: a.tokenizer,
    })
}

/// Entry point of the binary: runs the simulator until SIGINT or SIGTERM, or until every
/// engine has stopped.
#[tokio::main]
pub async fn main() -> anyhow::Result<()> {
    kvroute_process::init_logging(false, "info");
    let cfg = config(Args::parse())?;
    let handle = server::start(cfg).await?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{}", handle.ports_json())?;
        out.flush()?;
    }
    // SIGINT or SIGTERM (how a node agent stops a pod's process) end the process cleanly.
    tokio::select! {
        () = kvroute_process::shutdown_signal() => {}
        () = handle.stopped() => {}
    }
    tracing::info!("shutting down");
    handle.shutdown();
    Ok(())
}
