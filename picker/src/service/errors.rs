//! The picker's own error answers, in the envelope of the API the request came in on:
//! OpenAI's `{"error": {"message", "type", "param", "code"}}` (the keys vLLM's OpenAI server
//! sends) and, on `/v1/messages`, Anthropic's `{"type": "error", "error": {"type", "message"}}`
//! with Anthropic's error types; both with the right HTTP status.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// Which API's error envelope an answer takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    OpenAi,
    /// Anthropic Messages (`/v1/messages` and the paths under it).
    Anthropic,
}

impl Dialect {
    /// The dialect of a request path (with or without its query).
    pub fn of_path(path: &str) -> Self {
        let path = path.split('?').next().unwrap_or_default();
        if path == "/v1/messages" || path.starts_with("/v1/messages/") {
            Self::Anthropic
        } else {
            Self::OpenAi
        }
    }
}

/// Anthropic's error type for an HTTP status (its documented set; 503 is `overloaded_error`,
/// as Anthropic's 529 is).
fn anthropic_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        504 => "timeout_error",
        500..=599 => "api_error",
        _ => "invalid_request_error",
    }
}

/// The error body of an answer the picker gives itself: OpenAI's `type` (`kind`) and `code`
/// (the picker's machine-readable reason) in OpenAI's envelope; in Anthropic's the type the
/// status has there (the reason stays in the `x-kvroute-reason` header where one is sent).
pub fn envelope(
    dialect: Dialect,
    status: u16,
    kind: &str,
    code: &str,
    message: &str,
) -> serde_json::Value {
    match dialect {
        Dialect::OpenAi => {
            json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
        }
        Dialect::Anthropic => {
            json!({"type": "error", "error": {"type": anthropic_type(status), "message": message}})
        }
    }
}

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

    /// The body in OpenAI's envelope.
    pub fn body(&self) -> serde_json::Value {
        self.body_in(Dialect::OpenAi)
    }

    /// The body in `dialect`'s envelope.
    pub fn body_in(&self, dialect: Dialect) -> serde_json::Value {
        envelope(
            dialect,
            self.status.as_u16(),
            self.kind,
            self.code,
            &self.message,
        )
    }

    /// The answer in `dialect`'s envelope.
    pub fn into_response_in(self, dialect: Dialect) -> Response {
        let mut resp = (self.status, axum::Json(self.body_in(dialect))).into_response();
        if let Some(s) = self.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
            // what a client or gateway can act on without reading the body
            resp.headers_mut().insert(
                header::HeaderName::from_static("x-kvroute-reason"),
                HeaderValue::from_static(self.code),
            );
        }
        // the picker's own answer: `speak_the_request_api` reshapes it for the request's API
        resp.extensions_mut().insert(self);
        resp
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.into_response_in(Dialect::OpenAi)
    }
}

/// Middleware of the inference listener: an error the picker answered itself (not one relayed
/// from an engine) takes the envelope of the API the request came in on.
pub async fn speak_the_request_api(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let dialect = Dialect::of_path(req.uri().path());
    let resp = next.run(req).await;
    if dialect == Dialect::OpenAi {
        return resp;
    }
    match resp.extensions().get::<ApiError>() {
        Some(error) => error.clone().into_response_in(dialect),
        None => resp,
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({}): {}", self.status, self.code, self.message)
    }
}

impl std::error::Error for ApiError {}
