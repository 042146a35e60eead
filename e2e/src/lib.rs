//! kvroute's instruments: a vLLM-compatible engine simulator, the trace replay benchmark, and
//! the end-to-end harness.

pub mod bench;
pub mod cluster;
pub mod real_engine;
pub mod real_vllm;
pub mod sim;
