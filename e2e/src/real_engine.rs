//! Real vLLM engines for the tests: the venv of `scripts/real-engines/install-vllm.sh`, the
//! tiny model of `make_tiny_model.py`, and one engine started by `vllm-engine.sh` in its own
//! process group (stopped, group-wide, on drop). Used by `tests/real_vllm.rs` and
//! `tests/vllm_contract.rs`; the venv, model and port helpers are [`kvroute_bench::real_vllm`]'s
//! (the live benchmark's launcher), here failing the test instead of returning an error.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// The engines' KV block size (vLLM's CPU backend needs a multiple of 32).
pub const BLOCK: u64 = 32;
pub use kvroute_bench::real_vllm::{ENGINE_START, repo_root};

/// A loopback client with a 60 s timeout (a CPU engine's longest answer in the tests).
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

/// The vLLM venv made by install-vllm.sh, or a failure that says how to make it.
pub fn vllm_venv() -> PathBuf {
    kvroute_bench::real_vllm::vllm_venv().unwrap_or_else(|e| panic!("{e:#} before these tests"))
}

pub fn free_port() -> u16 {
    kvroute_bench::real_vllm::free_port().expect("a free loopback port")
}

/// One vLLM engine in its own process group; stopped (group-wide) on drop.
pub struct Engine {
    child: Child,
    pub http: u16,
    pub kv: u16,
    pub replay: u16,
    pub log: PathBuf,
    /// How it was started, for a start on fresh ports.
    launch: Launch,
}

#[derive(Clone)]
struct Launch {
    model: PathBuf,
    core: u32,
    kv_cache_bytes: u64,
    logs: PathBuf,
    /// Its ports were picked free at spawn (not given): if one was taken before vLLM bound
    /// it, [`Engine::wait_healthy`] starts it again on others.
    fresh_ports: bool,
    /// With vLLM's NixlConnector ([`Engine::spawn_kv_transfer`]).
    kv_transfer: bool,
}

/// Starts on fresh ports after a port was taken between its probe and vLLM's bind (the probe
/// releases the port; vLLM's own internal sockets, or another test's, can take it first).
const PORT_RETRIES: u32 = 3;

impl Engine {
    pub fn spawn(model: &Path, core: u32, kv_cache_bytes: u64, logs: &Path) -> Self {
        let ports = (free_port(), free_port(), free_port());
        let mut e = Self::start(model, core, kv_cache_bytes, logs, ports, false);
        e.launch.fresh_ports = true;
        e
    }

    /// An engine with vLLM's NixlConnector (`kv_both`, CPU buffers, UCX over loopback): it
    /// answers a request carrying `kv_transfer_params.do_remote_decode` with the parameters
    /// another engine pulls the prompt's KV with, and pulls it itself for a request carrying
    /// those (prefill/decode disaggregation). Its NIXL side channel takes a free port.
    pub fn spawn_kv_transfer(model: &Path, core: u32, kv_cache_bytes: u64, logs: &Path) -> Self {
        let ports = (free_port(), free_port(), free_port());
        let mut e = Self::start(model, core, kv_cache_bytes, logs, ports, true);
        e.launch.fresh_ports = true;
        e
    }

    /// Its KV-event publisher and replay sockets bound at port 0 (`tcp://*:0`, on
    /// `VLLM_HOST_IP`): only vLLM's `GET /kv_event_sources` says where they are (`kv` and
    /// `replay` read 0).
    pub fn spawn_port0_publishers(
        model: &Path,
        core: u32,
        kv_cache_bytes: u64,
        logs: &Path,
    ) -> Self {
        Self::start(
            model,
            core,
            kv_cache_bytes,
            logs,
            (free_port(), 0, 0),
            false,
        )
    }

    /// On given (http, kv, replay) ports: a restart keeps the addresses the picker knows.
    pub fn spawn_on(
        model: &Path,
        core: u32,
        kv_cache_bytes: u64,
        logs: &Path,
        ports: (u16, u16, u16),
    ) -> Self {
        Self::start(model, core, kv_cache_bytes, logs, ports, false)
    }

    fn start(
        model: &Path,
        core: u32,
        kv_cache_bytes: u64,
        logs: &Path,
        (http, kv, replay): (u16, u16, u16),
        kv_transfer: bool,
    ) -> Self {
        static STARTS: AtomicU32 = AtomicU32::new(0);
        let n = STARTS.fetch_add(1, Ordering::Relaxed);
        let log = logs.join(format!("vllm-{http}-{n}.log"));
        let out = std::fs::File::create(&log).unwrap();
        let mut command = Command::new("bash");
        command
            .arg(repo_root().join("scripts/real-engines/vllm-engine.sh"))
            .args(["--model", model.to_str().unwrap()])
            .args(["--port", &http.to_string()])
            .args(["--kv-port", &kv.to_string()])
            .args(["--replay-port", &replay.to_string()])
            .args(["--core", &core.to_string()])
            .args(["--block-size", &BLOCK.to_string()])
            .args(["--kv-cache-bytes", &kv_cache_bytes.to_string()]);
        if kv_transfer {
            command
                .args([
                    "--",
                    "--kv-transfer-config",
                    r#"{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu"}"#,
                ])
                .env("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
                .env("VLLM_NIXL_SIDE_CHANNEL_PORT", free_port().to_string());
        }
        if kv == 0 {
            // `tcp://*:0` binds the node's IP, which vLLM takes from here
            command.env("VLLM_HOST_IP", "127.0.0.1");
        }
        let child = command
            .env("KVROUTE_VLLM_VENV", vllm_venv())
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .process_group(0)
            .spawn()
            .expect("spawn vllm-engine.sh");
        Self {
            child,
            http,
            kv,
            replay,
            log,
            launch: Launch {
                model: model.to_path_buf(),
                core,
                kv_cache_bytes,
                logs: logs.to_path_buf(),
                fresh_ports: false,
                kv_transfer,
            },
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.http)
    }

    /// What the log says about a failure: from its first error or traceback (vLLM reports an
    /// engine core's root cause there and only "see root cause above" at the end), 40 lines,
    /// then the last 20.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        failure_excerpt(&text)
    }

    /// Until `/health` answers. An engine spawned on free ports that lost one of them before
    /// binding it is started again on others (at most [`PORT_RETRIES`] times): read the
    /// ports after this returns.
    pub async fn wait_healthy(&mut self) {
        let mut deadline = Instant::now() + ENGINE_START;
        let mut retries = 0;
        loop {
            if let Ok(r) = client().get(self.url("/health")).send().await
                && r.status().is_success()
            {
                return;
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                let taken = std::fs::read_to_string(&self.log)
                    .is_ok_and(|t| t.contains("Address already in use"));
                if taken && self.launch.fresh_ports && retries < PORT_RETRIES {
                    retries += 1;
                    eprintln!(
                        "vLLM on port {} lost a port before binding it; starting it on others",
                        self.http
                    );
                    let l = self.launch.clone();
                    // the old one's group is stopped as it drops
                    let ports = (free_port(), free_port(), free_port());
                    *self = Self::start(
                        &l.model,
                        l.core,
                        l.kv_cache_bytes,
                        &l.logs,
                        ports,
                        l.kv_transfer,
                    );
                    self.launch.fresh_ports = true;
                    deadline = Instant::now() + ENGINE_START;
                    continue;
                }
                panic!(
                    "vLLM on port {} exited ({status}) before it was healthy; log tail:\n{}",
                    self.http,
                    self.log_tail()
                );
            }
            assert!(
                Instant::now() < deadline,
                "vLLM on port {} not healthy after {ENGINE_START:?}; log tail:\n{}",
                self.http,
                self.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Its process group (the API server and its engine core), for a kill from elsewhere.
    pub fn process_group(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL to the whole group, as a crash or an OOM kill would do.
    pub fn kill_now(mut self) {
        self.signal_group("-KILL");
        let _ = self.child.wait();
    }

    fn signal_group(&self, signal: &str) {
        let _ = Command::new("kill")
            .args([signal, "--", &format!("-{}", self.child.id())])
            .stderr(Stdio::null())
            .status();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.signal_group("-TERM");
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // the API server's children (EngineCore, Worker) share its group
        self.signal_group("-KILL");
        let _ = self.child.wait();
    }
}

fn failure_excerpt(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let tail = lines.len().saturating_sub(20);
    let first = lines
        .iter()
        .position(|l| l.contains("ERROR") || l.starts_with("Traceback"))
        .filter(|&i| i < tail);
    match first {
        Some(i) => {
            let head_end = (i + 40).min(tail);
            let mut out = lines[i..head_end].join("\n");
            if head_end < tail {
                out.push_str("\n[...]");
            }
            out.push('\n');
            out.push_str(&lines[tail..].join("\n"));
            out
        }
        None => lines[lines.len().saturating_sub(30)..].join("\n"),
    }
}

/// Writes the tiny model into `dir` with the venv's python (it has `tokenizers`).
pub fn make_model(dir: &Path) {
    kvroute_bench::real_vllm::tiny_model(Some(dir)).unwrap_or_else(|e| panic!("{e:#}"));
}

/// Writes a Gemma-3-style hybrid of the tiny model into `dir`: layer 0 attends over a 64-token
/// sliding window, layer 1 over everything, so vLLM runs two KV-cache groups (a
/// `sliding_window` one and a `full_attention` one) and publishes both in its KV events. Same
/// tokenizer, random weights.
pub fn make_hybrid_model(dir: &Path) {
    make_model(dir);
    let path = dir.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).expect("config.json")).expect("json");
    let o = c.as_object_mut().expect("object");
    o.remove("hidden_act");
    for (k, v) in [
        ("architectures", serde_json::json!(["Gemma3ForCausalLM"])),
        ("model_type", serde_json::json!("gemma3_text")),
        ("sliding_window", serde_json::json!(SLIDING_WINDOW)),
        (
            "layer_types",
            serde_json::json!(["sliding_attention", "full_attention"]),
        ),
        ("sliding_window_pattern", serde_json::json!(2)),
        ("query_pre_attn_scalar", serde_json::json!(64)),
        ("rope_local_base_freq", serde_json::json!(10000.0)),
        ("hidden_activation", serde_json::json!("gelu_pytorch_tanh")),
        ("final_logit_softcapping", serde_json::Value::Null),
        ("attn_logit_softcapping", serde_json::Value::Null),
        ("rope_scaling", serde_json::Value::Null),
        ("pad_token_id", serde_json::json!(0)),
    ] {
        o.insert(k.into(), v);
    }
    std::fs::write(&path, serde_json::to_vec_pretty(&c).expect("json")).expect("write config");
}

/// The sliding window of [`make_hybrid_model`]'s first layer, in tokens.
pub const SLIDING_WINDOW: u64 = 64;

#[cfg(test)]
mod tests {
    use super::failure_excerpt;

    #[test]
    fn a_failures_excerpt_starts_at_its_root_cause() {
        let mut log: Vec<String> = (0..100).map(|i| format!("INFO line {i}")).collect();
        log[10] = "ERROR EngineCore failed: Address already in use".into();
        let out = failure_excerpt(&log.join("\n"));
        assert!(out.starts_with("ERROR EngineCore failed"), "{out}");
        assert!(
            out.contains("[...]") && out.ends_with("INFO line 99"),
            "{out}"
        );
        // no error: the last 30 lines
        let quiet: Vec<String> = (0..50).map(|i| format!("INFO {i}")).collect();
        let out = failure_excerpt(&quiet.join("\n"));
        assert!(
            out.starts_with("INFO 20") && out.ends_with("INFO 49"),
            "{out}"
        );
    }
}
