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
    post_json_with(client, url, &[], body).await
}

/// [`post_json`] with request `headers`.
pub async fn post_json_with<B: serde::Serialize + ?Sized>(
    client: &Client,
    url: impl IntoUrl,
    headers: &[(&str, &str)],
    body: &B,
) -> Value {
    let (resp, what) = post(client, url, headers, body).await;
    resp.json()
        .await
        .unwrap_or_else(|e| panic!("{what}: not JSON: {e}"))
}

/// `POST url` with `body` as JSON, the answer's body as text (whatever the status).
pub async fn post_text<B: serde::Serialize + ?Sized>(
    client: &Client,
    url: impl IntoUrl,
    body: &B,
) -> String {
    let (resp, what) = post(client, url, &[], body).await;
    resp.text().await.unwrap_or_else(|e| panic!("{what}: {e}"))
}

async fn post<B: serde::Serialize + ?Sized>(
    client: &Client,
    url: impl IntoUrl,
    headers: &[(&str, &str)],
    body: &B,
) -> (Response, String) {
    let url = url.into_url().unwrap();
    let what = format!("POST {url}");
    let mut req = client.post(url).json(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    (send(req, &what).await, what)
}

/// The sum of the samples of metric `name` (exactly that name, any labels) in a Prometheus
/// text page whose line contains every one of `labels`.
pub fn metric_sum(page: &str, name: &str, labels: &[&str]) -> f64 {
    page.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(|l| labels.iter().all(|x| l.contains(x)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::metric_sum;

    #[test]
    fn metric_sum_adds_one_metrics_samples_with_the_labels() {
        let page = "# HELP x_total x\n# TYPE x_total counter\nx_total{a=\"1\",b=\"2\"} 3\n\
                    x_total{a=\"2\"} 4.5\nx_total_created 99\nx_totals 7\nx_total 1\n";
        assert_eq!(metric_sum(page, "x_total", &[]), 8.5);
        assert_eq!(metric_sum(page, "x_total", &["a=\"1\""]), 3.0);
        assert_eq!(metric_sum(page, "x_total", &["a=\"1\"", "b=\"3\""]), 0.0);
        assert_eq!(metric_sum(page, "missing", &[]), 0.0);
    }
}
