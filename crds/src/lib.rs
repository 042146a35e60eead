//! kvroute's Kubernetes API.
//!
//! The spec types here are shared by the `InferencePool` custom resource and the picker's
//! config file, so what users write in the resource is exactly what the picker runs. Doc
//! comments are what `kubectl explain` shows.

pub mod pool;
pub mod routing;
