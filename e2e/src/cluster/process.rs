//! Child processes that cannot outlive the test process.
//!
//! Every process the harness starts joins the process group of one [`Reaper`]: a tiny shell
//! loop that polls the test process and, once it is gone, kills its whole group and removes
//! the state folder. So nothing leaks even when the test binary is killed, or when a harness
//! kept in a `static` (whose destructor never runs) goes away with the process. While the
//! test process lives, [`Proc`] kills its child on drop.

use std::fs::File;
use std::io::{BufRead as _, BufReader};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

/// Kills the harness's processes (and removes `cleanup`) when the test process exits.
#[derive(Debug)]
pub struct Reaper {
    child: Child,
}

impl Reaper {
    /// Start the reaper; `cleanup` is removed after the processes are killed.
    pub fn start(cleanup: &Path) -> anyhow::Result<Self> {
        // $0: the pid to watch, $1: the folder to remove. The reaper leads the process group
        // every child joins: it ignores the TERM it sends the group, SIGKILLs whatever
        // survives a second, then removes the folder.
        let script = r#"while kill -0 "$0" 2>/dev/null; do sleep 0.5; done
trap '' TERM
kill -TERM 0
sleep 1
for p in $(pgrep -g $$); do [ "$p" = "$$" ] || kill -KILL "$p" 2>/dev/null; done
rm -rf -- "$1""#;
        let child = Command::new("sh")
            .arg("-c")
            .arg(script)
            .arg(std::process::id().to_string())
            .arg(cleanup)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .context("cannot start the reaper shell (sh)")?;
        Ok(Self { child })
    }

    /// The process group children join.
    pub fn group(&self) -> i32 {
        // pids fit in i32 on every platform Rust supports
        i32::try_from(self.child.id()).unwrap_or(0)
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A started process: stdout and stderr go to a log file, except that its first stdout line
/// can be awaited (the binaries started here print their bound addresses as one JSON line).
#[derive(Debug)]
pub struct Proc {
    pub name: String,
    child: Child,
    log: PathBuf,
    // behind a mutex only so that `Proc` is `Sync` (a harness in a `static` holds some)
    first_line: std::sync::Mutex<FirstLine>,
}

#[derive(Debug)]
enum FirstLine {
    Waiting(mpsc::Receiver<String>),
    Got(String),
    Closed,
}

impl Proc {
    /// Spawn `cmd` into `group` (see [`Reaper::group`]), logging to `log`.
    pub fn spawn(name: &str, mut cmd: Command, group: i32, log: &Path) -> anyhow::Result<Self> {
        let err = File::create(log).with_context(|| format!("cannot create {}", log.display()))?;
        let out_log = err.try_clone()?;
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(err)
            .process_group(group)
            .spawn()
            .with_context(|| format!("cannot start {name} ({:?})", cmd.get_program()))?;
        let (tx, rx) = mpsc::channel();
        if let Some(stdout) = child.stdout.take() {
            std::thread::spawn(move || {
                use std::io::Write as _;
                let mut out_log = out_log;
                let mut first = Some(tx);
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    let _ = writeln!(out_log, "[stdout] {line}");
                    if let Some(tx) = first.take() {
                        let _ = tx.send(line);
                    }
                }
            });
        }
        Ok(Self {
            name: name.to_string(),
            child,
            log: log.to_path_buf(),
            first_line: std::sync::Mutex::new(FirstLine::Waiting(rx)),
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The first line the process printed on stdout, if it printed one yet.
    pub fn try_first_line(&self) -> Option<String> {
        let mut state = self
            .first_line
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let FirstLine::Waiting(rx) = &*state {
            match rx.try_recv() {
                Ok(line) => *state = FirstLine::Got(line),
                Err(mpsc::TryRecvError::Disconnected) => *state = FirstLine::Closed,
                Err(mpsc::TryRecvError::Empty) => {}
            }
        }
        match &*state {
            FirstLine::Got(line) => Some(line.clone()),
            _ => None,
        }
    }

    /// The first line the process prints on stdout, within `timeout`.
    pub fn first_line(&mut self, timeout: Duration) -> anyhow::Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(line) = self.try_first_line() {
                return Ok(line);
            }
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "{} exited ({status}) before listening\n{}",
                    self.name,
                    self.tail()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "{} printed no address line within {timeout:?}\n{}",
                    self.name,
                    self.tail()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `Some(status)` once the process has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// SIGTERM, then SIGKILL after `grace`.
    pub fn terminate(&mut self, grace: Duration) {
        if self.exited().is_some() {
            return;
        }
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.pid().to_string())
            .status();
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if self.exited().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.kill();
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The last lines of the log, for error messages.
    pub fn tail(&self) -> String {
        log_tail(&self.log, 40)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The last `n` lines of a log file, prefixed with its path.
pub fn log_tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let start = lines.len().saturating_sub(n);
    format!(
        "--- last lines of {} ---\n{}",
        path.display(),
        lines[start..].join("\n")
    )
}

/// A free TCP port on `ip`: bound and released (the harness owns the loopback addresses it
/// uses, so the window between release and reuse is harmless).
pub fn free_port(ip: std::net::IpAddr) -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind((ip, 0)).context("cannot bind a free port")?;
    Ok(l.local_addr()?.port())
}
