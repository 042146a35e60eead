//! The picker's feeds: everything it learns from the engines, each on its own task.
//!
//! - [`subscriptions`]: which endpoints' KV events to follow (from the pool), one subscriber
//!   per endpoint, and where their batches go (the index, through `kv_events::ingest`).
//! - [`kv_subscriber`]: one endpoint's ZMQ SUB socket and replay client, sequence-checked.
//! - [`zmtp_guard`]: the loopback frame guard in front of each subscriber.
//! - [`scraper`]: the engines' Prometheus metrics (load, capacity, activity, calibration).
//! - [`peers`]: the in-flight counts exchanged with the pool's other picker replicas.
//! - [`sources`]: the KV event publishers engines list at `/kv_event_sources`.

pub mod kv_subscriber;
pub mod peers;
pub mod scraper;
pub mod sources;
pub mod subscriptions;
pub mod zmtp_guard;
