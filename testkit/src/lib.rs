//! Helpers the test suites of the picker, the simulator, the benchmark and the end-to-end
//! harness share: HTTP calls whose every failure (no connection, a body that is not what was
//! asked for) fails the test with the request in the message.

#![allow(clippy::unwrap_used)]

use reqwest::{Client, IntoUrl, RequestBuilder, Response};
use serde_json::Value;

/// Send `req` (described as `what` in a failure).
async fn send(req: RequestBuilder, what: &str) -> Response {
    req.send().await.unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// `GET url`, its body as JSON (whatever the status).
pub async fn get_json(client: &Client, url: impl IntoUrl) -> Value {
    let url = url.into_url().unwrap();
    let what = format!("GET {url}");
    let resp = send(client.get(url), &what).await;
    resp.json()
        .await
        .unwrap_or_else(|e| panic!("{what}: not JSON: {e}"))
}

/// `GET url`, its body as text (whatever the status).
pub async fn get_text(client: &Client, url: impl IntoUrl) -> String {
    let url = url.into_url().unwrap();
    let what = format!("GET {url}");
    let resp = send(client.get(url), &what).await;
    resp.text().await.unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// `POST url` with `body` as JSON, the answer's body as JSON (whatever the status).
pub async fn post_json<B: serde::Serialize + ?Sized>(
    client: &Client,
    url: impl IntoUrl,
    body: &B,
) -> Value {
    let url = url.into_url().unwrap();
    let what = format!("POST {url}");
    let resp = send(client.post(url).json(body), &what).await;
    resp.json()
        .await
        .unwrap_or_else(|e| panic!("{what}: not JSON: {e}"))
}
