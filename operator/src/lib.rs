//! kvroute's operator: reconciles `KVRoutePool`s into eligibility sets and pickers.
//!
//! A reconcile runs `validate → build → apply → update_status`:
//! - [`eligibility`] decides, per model config, which pods are eligible (and which are only
//!   listed, draining) — pure;
//! - [`desired`] builds every owned object: EndpointSlices with one named port per
//!   data-parallel rank, the picker's ConfigMap, ServiceAccount/Role/RoleBinding, Deployment,
//!   Service, and optional Gateway API Inference Extension pools — pure;
//! - [`apply`] server-side-applies them under one field manager, skipping up-to-date ones,
//!   and prunes what is no longer wanted;
//! - [`status`] computes the status, written only when it changes — pure;
//! - [`gateway_ref`] resolves a pool that serves an existing Gateway API InferencePool
//!   (`spec.inferencePoolRef`) and writes kvroute's entry in that pool's `status.parents`.
//!
//! [`controller`] wires watches and caches around [`reconcile`]; [`cli`] adds leader election
//! (a `coordination.k8s.io` Lease), `/metrics`, `/healthz` and `/readyz`.

pub mod apply;
pub mod cli;
pub mod controller;
pub mod desired;
pub mod eligibility;
pub mod error;
pub mod gateway_ref;
pub mod metrics;
pub mod reconcile;
pub mod server;
pub mod status;

pub use error::{Error, Result};
