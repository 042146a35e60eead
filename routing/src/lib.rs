//! kvroute's routing core.
//!
//! Everything that decides where a request goes, free of I/O: it takes values (tokens, decoded
//! KV events, scraped metrics text, endpoint sets, the clock as a number) and returns decisions.
//! It links no HTTP, gRPC, ZMQ or Kubernetes client and no async runtime, so the picker service
//! (`kvroute-picker`), the engine simulator, the replay benchmark, the criterion benches and the
//! fuzz targets all run the same code.
//!
//! - Requests: [`request`] (an API body parsed once, bounded), [`tokenize`] (prompt text to token ids, bounded), [`block_keys`] (ids to the
//!   chained block hashes engines use), [`plan`] (what one request asks of the pool).
//! - Cache state: [`kv_events`] (vLLM/SGLang KV events: decoding, resequencing, ingest),
//!   [`index`] (which endpoint holds which blocks), [`engine_metrics`] and [`load`] (scraped
//!   queue and cache figures), [`inflight`] (the picker's own counts).
//! - Decisions: [`policy`] (the scorers), [`router`] (eligibility, scoring, ranking),
//!   [`calibration`] (the cost model's learned per-endpoint costs), [`outlier`] (passive
//!   health), [`pool_state`] (the endpoint set, index and loads behind one lock), [`place`]
//!   (the `Pool` that owns every per-endpoint table, and its two steps: `place` reads, `record`
//!   and `served` commit).
//! - Configuration: [`config`] (routing policy) and [`pool`] (model configs, tenancy), the
//!   types the `KVRoutePool` resource's `spec` is generated from.

pub mod admission;
pub mod block_keys;
pub mod calibration;
pub mod chat_mapping;
pub mod config;
pub mod endpoint;
pub mod engine_metrics;
pub mod flow;
pub mod handoff;
pub mod index;
pub mod inflight;
pub mod kv_events;
pub mod load;
pub mod outlier;
pub mod place;
pub mod plan;
pub mod policy;
pub mod pool;
pub mod pool_state;
pub mod request;
pub mod router;
pub mod session;
pub mod tokenize;
pub mod waiting;
