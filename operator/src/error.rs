//! The operator's one error type. Each variant is a metric label
//! (`kvroute_operator_reconcile_errors_total{error="..."}`).

/// Everything that can fail in the operator.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Server-side apply of an owned object failed.
    #[error("applying {kind} {name}: {source}")]
    Apply {
        kind: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    /// Deleting an owned object that is no longer wanted failed.
    #[error("deleting {kind} {name}: {source}")]
    Delete {
        kind: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    /// Writing the pool's status failed.
    #[error("updating the status of {name}: {source}")]
    UpdateStatus {
        name: String,
        #[source]
        source: kube::Error,
    },
    /// Reading from the API (discovery, objects without a cache) failed.
    #[error("reading {what}: {source}")]
    Read {
        what: String,
        #[source]
        source: kube::Error,
    },
    /// An object lacks a field the operator needs (name, namespace, uid).
    #[error("object has no {0}")]
    MissingObjectKey(&'static str),
    /// An owned object could not be rendered.
    #[error("rendering {what}: {source}")]
    Render {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
    /// The picker config could not be rendered as YAML.
    #[error("rendering the picker config: {0}")]
    RenderYaml(#[source] serde_yaml_ng::Error),
    /// Leader election failed.
    #[error("leader election: {0}")]
    Lease(#[source] kube_lease_manager::LeaseManagerError),
    /// Leadership was lost: the process stops so that a fresh start competes again.
    #[error("lost leadership")]
    LostLeadership,
    /// Kubernetes client setup failed.
    #[error("kubernetes client: {0}")]
    Client(#[source] kube::Error),
    /// Serving `/metrics`, `/healthz`, `/readyz` failed.
    #[error("http listener: {0}")]
    Http(#[source] std::io::Error),
}

impl Error {
    /// The metric label of this error.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Apply { .. } => "apply",
            Self::Delete { .. } => "delete",
            Self::UpdateStatus { .. } => "update_status",
            Self::Read { .. } => "read",
            Self::MissingObjectKey(_) => "missing_object_key",
            Self::Render { .. } => "render",
            Self::RenderYaml(_) => "render_yaml",
            Self::Lease(_) => "lease",
            Self::LostLeadership => "lost_leadership",
            Self::Client(_) => "client",
            Self::Http(_) => "http",
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
