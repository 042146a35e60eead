//! OpenAI-style errors: `{"error": {"message", "type", "code"}}` with the right HTTP status.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`.
    pub kind: &'static str,
    /// Machine-readable code; also the metrics label.
    pub code: &'static str,
    /// Seconds, for 429/503.
    pub retry_after: Option<u32>,
}

impl From<crate::request::RequestError> for ApiError {
    fn from(e: crate::request::RequestError) -> Self {
        let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST);
        Self::new(status, "invalid_request_error", e.code, e.message)
    }
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, code: &'static str, message: String) -> Self {
        Self {
            status,
            message,
            kind,
            code,
            retry_after: None,
        }
    }

    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            code,
            message.into(),
        )
    }

    pub fn unknown_model(model: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model_not_found",
            format!("the model `{model}` does not exist in this pool"),
        )
    }

    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "body_too_large",
            format!("request body exceeds the limit of {limit} bytes"),
        )
    }

    pub fn body_timeout(limit: std::time::Duration) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            "body_timeout",
            format!("the request body did not arrive within {limit:?}"),
        )
    }

    pub fn shed(message: impl Into<String>) -> Self {
        Self {
            retry_after: Some(1),
            ..Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "overloaded",
                message.into(),
            )
        }
    }

    /// A 429 with its own code (flow control's reasons).
    pub fn shed_because(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            ..Self::shed(message)
        }
    }

    pub fn unavailable(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            retry_after: Some(1),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                code,
                message.into(),
            )
        }
    }

    pub fn bad_gateway(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_GATEWAY,
            "upstream_error",
            "upstream_failed",
            message.into(),
        )
    }

    pub fn gateway_timeout(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::GATEWAY_TIMEOUT,
            "upstream_error",
            "upstream_timeout",
            message.into(),
        )
    }

    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "unauthorized",
            "a valid bearer token is required".into(),
        )
    }

    /// A stored response this tenant does not have, in vLLM's words.
    pub fn unknown_response(id: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "response_not_found",
            format!("Response with id '{id}' not found."),
        )
    }

    pub fn not_found(path: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "not_found",
            format!("no route for {path}"),
        )
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
            // what a client or gateway can act on without reading the body
            resp.headers_mut().insert(
                header::HeaderName::from_static("x-kvroute-reason"),
                HeaderValue::from_static(self.code),
            );
        }
        resp
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({}): {}", self.status, self.code, self.message)
    }
}

impl std::error::Error for ApiError {}
