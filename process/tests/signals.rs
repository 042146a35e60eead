//! The shutdown future against real signals sent to this test process (its own binary, so no
//! other test shares the handlers).

use std::time::Duration;

use kvroute_process::shutdown_signal;

/// Send `sig` (`TERM`, `INT`) to this process with kill(1).
fn raise(sig: &str) {
    let status = std::process::Command::new("kill")
        .args(["-s", sig, &std::process::id().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -s {sig} failed: {status}");
}

#[tokio::test]
async fn sigterm_and_sigint_each_end_the_wait_and_nothing_else_does() {
    // no signal: still waiting
    let idle = shutdown_signal();
    assert!(
        tokio::time::timeout(Duration::from_millis(200), idle)
            .await
            .is_err()
    );
    for sig in ["TERM", "INT"] {
        // sent before the future is first polled: not lost (the handler is installed at call)
        let wait = shutdown_signal();
        raise(sig);
        tokio::time::timeout(Duration::from_secs(10), wait)
            .await
            .unwrap_or_else(|_| panic!("signal {sig} did not end the wait"));
    }
}

#[test]
fn logging_installs_once() {
    assert!(kvroute_process::init_logging(false, "warn"));
    assert!(
        !kvroute_process::init_logging(true, "info"),
        "already installed"
    );
}
