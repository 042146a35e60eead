//! kvroute's endpoint picker service: the listeners (OpenAI-compatible proxy, pick API, Envoy
//! ext_proc), the feeds (metrics scraper, KV-event subscribers), the Kubernetes pool source, the
//! metrics and the CLI, around the routing core in `kvroute-routing`, re-exported here under
//! the same module names.

pub use kvroute_routing::{
    admission, block_keys, calibration, chat_mapping, config, endpoint, engine_metrics, flow,
    index, inflight, kv_events, load, outlier, place, plan, policy, pool, pool_state, request,
    router, session, tokenize, waiting,
};

pub mod cli;
pub mod error;
pub mod service;
