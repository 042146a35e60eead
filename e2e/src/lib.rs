//! kvroute's end-to-end harness: a local Kubernetes control plane ([`cluster`]) and real vLLM
//! engines for tests ([`real_engine`], on kvroute-bench's `real_vllm`). The engine simulator
//! and the trace replay benchmark are crates of their own, kvroute-sim and kvroute-bench.

pub mod cluster;
pub mod envoy;
pub mod real_engine;
