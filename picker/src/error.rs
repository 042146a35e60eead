//! The picker's one error type for configuration, pool views and start-up. Each variant is a
//! metric label (`kvroute_picker_config_rejections_total{error="..."}` counts rejected pool
//! views and secret reloads); every message names the field or file at fault.

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::index::IndexError;

/// What can make a config, a pool view or the picker's start fail.
#[derive(Debug, thiserror::Error)]
pub enum PickerError {
    /// A field's value is invalid; the message names the field.
    #[error("{0}")]
    Invalid(String),
    /// The config is not valid YAML of the expected shape.
    #[error("invalid config: {0}")]
    Parse(#[source] serde_yaml_ng::Error),
    /// A file a field names cannot be read.
    #[error("{field} {path}: {source}")]
    ReadFile {
        /// The field naming the file (e.g. `tenancy.saltSecretFile`).
        field: String,
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// An error in a config file, with its path.
    #[error("{path}: {source}")]
    InFile {
        path: PathBuf,
        #[source]
        source: Box<PickerError>,
    },
    /// An endpoint names a model config the view does not have.
    #[error("endpoint {endpoint} names unknown model config {config:?}")]
    UnknownModelConfig { endpoint: String, config: String },
    /// A model config's tokenizer or chat template cannot be built.
    #[error("modelConfigs {name:?}: {message}")]
    Tokenizer { name: String, message: String },
    /// The KV index cannot take the view (too many endpoints).
    #[error(transparent)]
    Index(#[from] IndexError),
    /// The HTTP client for the engines cannot be built.
    #[error("cannot build the HTTP client: {0}")]
    HttpClient(#[source] reqwest::Error),
    /// A listener cannot be bound.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    /// The Kubernetes API cannot be reached.
    #[error("cannot reach the Kubernetes API: {0}")]
    Kube(#[source] kube::Error),
}

impl PickerError {
    /// The metric label of this error (a file's error is labelled by what went wrong in it).
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Invalid(_) => "invalid",
            Self::Parse(_) => "parse",
            Self::ReadFile { .. } => "read_file",
            Self::InFile { source, .. } => source.metric_label(),
            Self::UnknownModelConfig { .. } => "unknown_model_config",
            Self::Tokenizer { .. } => "tokenizer",
            Self::Index(_) => "index",
            Self::HttpClient(_) => "http_client",
            Self::Listen { .. } => "listen",
            Self::Kube(_) => "kube",
        }
    }

    /// A file `field` names could not be read.
    pub fn read_file(field: impl Into<String>, path: &str, source: std::io::Error) -> Self {
        Self::ReadFile {
            field: field.into(),
            path: path.to_owned(),
            source,
        }
    }
}

/// Field checks of the shared resource types (`kvroute-crds`) report a message naming the
/// field: an [`PickerError::Invalid`].
impl From<String> for PickerError {
    fn from(message: String) -> Self {
        Self::Invalid(message)
    }
}

impl From<&str> for PickerError {
    fn from(message: &str) -> Self {
        Self::Invalid(message.to_owned())
    }
}
