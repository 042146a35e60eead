//! kvroute's instruments: the trace replay benchmark and the end-to-end harness. The engine
//! simulator is its own crate, kvroute-sim.

pub mod bench;
pub mod cluster;
pub mod real_engine;
pub mod real_vllm;
