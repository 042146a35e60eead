//! Child processes that can never outlive the benchmark.
//!
//! Every child is started with a pipe on its stdin and the `--exit-on-stdin-close` flag, and
//! is held by a [`ChildGuard`] that kills it by pid when dropped — on success, on error, on a
//! panic, and on Ctrl-C (the runner drops its work future, and with it the guards). If the
//! benchmark itself is killed with SIGKILL, the pipe closes and the child exits on its own.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context as _;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};

/// Longest first line (the address JSON) read from a child.
const MAX_LINE: u64 = 1 << 20;

/// Kills its child by pid when dropped.
#[derive(Debug)]
pub struct ChildGuard {
    name: String,
    child: Option<Child>,
    /// Held open: the child exits when it closes.
    _stdin: Option<ChildStdin>,
    pub log: PathBuf,
}

impl ChildGuard {
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }

    /// Kill now and wait for the process to be reaped.
    pub async fn stop(mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.start_kill();
            let _ = tokio::time::timeout(Duration::from_secs(5), c.wait()).await;
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            tracing::debug!(name = %self.name, pid = ?c.id(), "killing child");
            // SIGKILL by pid; the zombie is reaped by tokio's orphan reaper
            let _ = c.start_kill();
            let _ = c.try_wait();
        }
    }
}

/// The directory for child logs and config files of this benchmark process.
pub fn work_dir() -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("kvroute-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// Start `program args...`, wait (up to `timeout`) for its first stdout line and parse it as
/// JSON. The child's stderr goes to `<work dir>/<name>.log`; its later stdout is discarded.
pub async fn spawn_with_json(
    program: &Path,
    args: &[String],
    name: &str,
    timeout: Duration,
) -> anyhow::Result<(ChildGuard, serde_json::Value)> {
    let dir = work_dir()?;
    let log = dir.join(format!("{name}.log"));
    let log_file =
        std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log_file))
        .env(
            "RUST_LOG",
            std::env::var("KVROUTE_BENCH_CHILD_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {} {}", program.display(), args.join(" ")))?;
    let stdin = child.stdin.take();
    let stdout = child.stdout.take().context("child stdout")?;
    let mut guard = ChildGuard {
        name: name.to_string(),
        child: Some(child),
        _stdin: stdin,
        log: log.clone(),
    };
    let mut reader = BufReader::new(stdout);
    let mut line = String::new();
    let read =
        tokio::time::timeout(timeout, (&mut reader).take(MAX_LINE).read_line(&mut line)).await;
    let n = match read {
        Ok(Ok(n)) => n,
        Ok(Err(e)) => return Err(e).context(format!("reading {name}'s address line")),
        Err(_) => {
            anyhow::bail!(
                "{name} did not report its addresses within {timeout:?} (log: {})",
                log.display()
            )
        }
    };
    if n == 0 {
        let status = match guard.child.as_mut() {
            Some(c) => c.try_wait().ok().flatten(),
            None => None,
        };
        let tail = std::fs::read_to_string(&log).unwrap_or_default();
        let tail: String = tail
            .lines()
            .rev()
            .take(10)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n");
        anyhow::bail!("{name} exited before reporting its addresses ({status:?}):\n{tail}");
    }
    let value: serde_json::Value = serde_json::from_str(line.trim())
        .with_context(|| format!("{name} printed {line:?}, not its address JSON"))?;
    // keep draining stdout so that the child never blocks on a full pipe
    tokio::spawn(async move {
        let mut sink = [0u8; 4096];
        while let Ok(n) = reader.read(&mut sink).await {
            if n == 0 {
                break;
            }
        }
    });
    Ok((guard, value))
}

/// Resolves when stdin reaches end of file (the parent went away).
pub async fn stdin_closed() {
    let mut stdin = tokio::io::stdin();
    let mut buf = [0u8; 256];
    loop {
        match stdin.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}
