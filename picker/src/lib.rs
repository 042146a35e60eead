//! kvroute's endpoint picker.
//!
//! The routing core is free of I/O: it takes values (tokens, decoded KV events, scraped load,
//! endpoint sets) and returns decisions, so the service, the benchmarks and the tests all call
//! the same code.

pub mod block_keys;
pub mod calibration;
pub mod cli;
/// Routing configuration (shared with the `InferencePool` resource).
pub mod config {
    pub use kvroute_crds::routing::*;
}
pub mod endpoint;
pub mod engine_metrics;
pub mod error;
pub mod index;
pub mod inflight;
pub mod kv_events;
pub mod load;
pub mod outlier;
pub mod plan;
pub mod policy;
pub mod pool_state;
/// Pool specification types (shared with the `InferencePool` resource).
pub mod pool {
    pub use kvroute_crds::pool::*;
}
pub mod router;
pub mod service;
pub mod session;
pub mod tokenize;
