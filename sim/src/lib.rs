//! kvroute-sim, the engine simulator: vLLM's interfaces without GPUs.
//!
//! [`engine`] is the pure performance and cache model (no I/O, virtual time) that both the
//! real-time server and an offline discrete-event benchmark drive; [`server`] puts ranks of it
//! behind vLLM's HTTP, metrics and KV-event interfaces in real time. The binary `kvroute-sim`
//! is a thin wrapper over [`cli`].

pub mod cli;
pub mod engine;
pub mod server;
