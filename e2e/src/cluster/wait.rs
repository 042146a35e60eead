//! Time-bounded polling: every wait in the end-to-end tests has a deadline and says, when it
//! expires, what it last saw.

use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::bail;

use super::process::Proc;

/// How often conditions are polled.
pub const POLL: Duration = Duration::from_millis(200);

/// Poll `check` until it returns `Ok(Some(value))`, for at most `timeout`. `Ok(None)` and
/// errors mean "not yet"; the last error or `Ok(None)` is reported on timeout.
pub async fn until<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<Option<T>>>,
{
    let deadline = Instant::now() + timeout;
    let mut last = String::from("condition not met");
    loop {
        match check().await {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last = format!("{e:#}"),
        }
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}: {last}");
        }
        tokio::time::sleep(POLL).await;
    }
}

/// The first stdout line of `proc` (its addresses), without blocking the runtime.
pub async fn first_line(proc: &mut Proc, timeout: Duration) -> anyhow::Result<String> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(line) = proc.try_first_line() {
            return Ok(line);
        }
        if let Some(status) = proc.exited() {
            bail!(
                "{} exited ({status}) before listening\n{}",
                proc.name,
                proc.tail()
            );
        }
        if Instant::now() > deadline {
            bail!(
                "{} printed no address line within {timeout:?}\n{}",
                proc.name,
                proc.tail()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
