//! Where the harness finds the programs it runs: the control-plane binaries that
//! `scripts/k8s-bins.sh` builds, and the workspace's own binaries that cargo builds.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use anyhow::{Context as _, bail};

/// The Go-built binaries (see `e2e/k8s-bins/go.mod`).
#[derive(Debug, Clone)]
pub struct K8sBins {
    pub dir: PathBuf,
    pub etcd: PathBuf,
    pub kube_apiserver: PathBuf,
    pub kube_controller_manager: PathBuf,
    pub kubectl: PathBuf,
    pub helm: PathBuf,
}

/// Names the folder `scripts/k8s-bins.sh` writes to, from the versions `go.mod` pins.
fn cache_key(go_mod: &str) -> Option<String> {
    // the replace lines pin staging modules; the three modules named here are required ones
    let version = |module: &str| {
        go_mod.lines().find_map(|l| {
            let mut words = l.split_whitespace();
            (words.next() == Some(module)).then(|| words.next().map(str::to_string))?
        })
    };
    Some(format!(
        "k8s-{}_etcd-{}_helm-{}",
        version("k8s.io/kubernetes")?,
        version("go.etcd.io/etcd/server/v3")?,
        version("helm.sh/helm/v3")?
    ))
}

impl K8sBins {
    /// `$KVROUTE_K8S_BIN_DIR`, else the cache folder `scripts/k8s-bins.sh` fills for the
    /// versions in `e2e/k8s-bins/go.mod`. Fails (never skips) when a binary is missing.
    pub fn locate() -> anyhow::Result<Self> {
        let dir = match std::env::var_os("KVROUTE_K8S_BIN_DIR") {
            Some(d) => PathBuf::from(d),
            None => {
                let go_mod = Path::new(env!("CARGO_MANIFEST_DIR")).join("k8s-bins/go.mod");
                let text = std::fs::read_to_string(&go_mod).unwrap_or_default();
                let Some(key) = cache_key(&text) else {
                    bail!("cannot read the pinned versions from {}", go_mod.display())
                };
                let cache = std::env::var_os("KVROUTE_CACHE")
                    .map(PathBuf::from)
                    .or_else(|| {
                        std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/kvroute"))
                    })
                    .unwrap_or_else(|| PathBuf::from(".cache/kvroute"));
                cache.join("bin").join(key)
            }
        };
        let bins = Self {
            etcd: dir.join("etcd"),
            kube_apiserver: dir.join("kube-apiserver"),
            kube_controller_manager: dir.join("kube-controller-manager"),
            kubectl: dir.join("kubectl"),
            helm: dir.join("helm"),
            dir,
        };
        let missing: Vec<String> = [
            &bins.etcd,
            &bins.kube_apiserver,
            &bins.kube_controller_manager,
            &bins.kubectl,
            &bins.helm,
        ]
        .into_iter()
        .filter(|p| !p.is_file())
        .map(|p| p.display().to_string())
        .collect();
        if !missing.is_empty() {
            bail!(
                "the end-to-end tests need the control-plane binaries, missing: {}.\n\
                 Build them with `scripts/k8s-bins.sh` (Go 1.26+, the Go module proxy; the first \
                 build takes several minutes) and, if you put them elsewhere, point \
                 KVROUTE_K8S_BIN_DIR at their folder.",
                missing.join(", ")
            );
        }
        Ok(bins)
    }
}

/// The `kvroute-sim` binary (kvroute-sim's, not this crate's: cargo sets
/// `CARGO_BIN_EXE_kvroute-sim` only for the simulator's own tests), built for the target folder
/// and profile of the running test executable (`<target>/<profile>/deps/<test>`; the `debug`
/// folder is the `dev` profile).
///
/// Once per process it runs `$CARGO build --locked --workspace --bin kvroute-sim --test
/// sim_faults --profile <profile> --target-dir <target>` (`cargo` when `CARGO` is unset), its
/// progress on stderr, and returns `<target>/<profile>/kvroute-sim`. The whole workspace and a
/// test target (kvroute-sim's `sim_faults`, which runs the binary) make cargo resolve features
/// as `cargo test --workspace` does, so after that build this only checks the binary; `-p
/// kvroute-sim` alone would resolve them for the simulator by itself and rebuild a few dozen
/// dependencies, and the binary, into the same place.
pub fn sim_binary() -> anyhow::Result<PathBuf> {
    static SIM: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    SIM.get_or_init(|| build_sim().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(anyhow::Error::msg)
}

fn build_sim() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the running test executable")?;
    // <target>/<profile>/deps/<test>
    let deps = exe
        .parent()
        .filter(|d| d.file_name() == Some("deps".as_ref()));
    let profile_dir = deps.and_then(Path::parent);
    let (Some(profile_dir), Some(target)) = (profile_dir, profile_dir.and_then(Path::parent))
    else {
        bail!(
            "{} is not in <target>/<profile>/deps/: cannot tell where cargo builds kvroute-sim",
            exe.display()
        );
    };
    let Some(dir_name) = profile_dir.file_name().and_then(|n| n.to_str()) else {
        bail!("no profile folder in {}", exe.display());
    };
    let profile = if dir_name == "debug" { "dev" } else { dir_name };
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(&cargo);
    cmd.args(["build", "--locked", "--workspace", "--bin", "kvroute-sim"])
        .args(["--test", "sim_faults", "--profile", profile])
        .arg("--target-dir")
        .arg(target)
        .current_dir(super::repo_root())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    // what cargo set for this test process describes this crate; in the build's environment it
    // would be taken for a change (build scripts such as ring's rerun when CARGO_PKG_NAME or
    // CARGO_MANIFEST_DIR change) and rebuild their dependents, here and in the next build
    for (key, _) in std::env::vars_os() {
        if key.to_str().is_some_and(set_by_cargo_for_tests) {
            cmd.env_remove(key);
        }
    }
    let described = format!("{cmd:?}");
    let status = cmd
        .status()
        .with_context(|| format!("running {described}"))?;
    if !status.success() {
        bail!("building the simulator failed ({status}): {described}");
    }
    let sim = profile_dir.join("kvroute-sim");
    if !sim.is_file() {
        bail!("{described} succeeded but left no {}", sim.display());
    }
    Ok(sim)
}

/// The variables cargo sets for the crate whose tests it runs (the rest of the environment,
/// `CARGO_HOME`, `CARGO_BUILD_JOBS`, `RUSTFLAGS` and the like, is the caller's and stays).
fn set_by_cargo_for_tests(name: &str) -> bool {
    name.starts_with("CARGO_PKG_")
        || name.starts_with("CARGO_BIN_")
        || matches!(
            name,
            "CARGO_MANIFEST_DIR"
                | "CARGO_MANIFEST_PATH"
                | "CARGO_MANIFEST_LINKS"
                | "CARGO_CRATE_NAME"
                | "CARGO_PRIMARY_PACKAGE"
                | "CARGO_TARGET_TMPDIR"
                | "CARGO_RUSTC_CURRENT_DIR"
                | "OUT_DIR"
        )
}

/// The workspace's binaries, built by cargo into the target folder this test runs from.
#[derive(Debug, Clone)]
pub struct WorkspaceBins {
    pub sim: PathBuf,
    pub picker: PathBuf,
    pub operator: PathBuf,
}

impl WorkspaceBins {
    /// `sim` is the simulator's binary ([`sim_binary`] in the tests); the operator's and
    /// picker's are found next to it (`cargo test --workspace` builds them), or at
    /// `$KVROUTE_OPERATOR_BIN` / `$KVROUTE_PICKER_BIN`.
    pub fn locate(sim: &Path) -> anyhow::Result<Self> {
        let dir = sim.parent().unwrap_or(Path::new("."));
        let find = |var: &str, name: &str| -> anyhow::Result<PathBuf> {
            let path = std::env::var_os(var)
                .map(PathBuf::from)
                .unwrap_or_else(|| dir.join(name));
            if !path.is_file() {
                bail!(
                    "{} not found: build it first (`cargo build -p {name}`; `cargo test \
                     --workspace` builds it too) or set {var}",
                    path.display()
                );
            }
            Ok(path)
        };
        Ok(Self {
            sim: sim.to_path_buf(),
            picker: find("KVROUTE_PICKER_BIN", "kvroute-picker")?,
            operator: find("KVROUTE_OPERATOR_BIN", "kvroute-operator")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_key_reads_required_versions() {
        let go_mod = "module x\n\nrequire (\n\tgo.etcd.io/etcd/server/v3 v3.6.8\n\thelm.sh/helm/v3 v3.21.4\n\tk8s.io/kubernetes v1.36.3\n)\n\nreplace (\n\tk8s.io/api => k8s.io/api v0.36.3\n)\n";
        assert_eq!(
            cache_key(go_mod).as_deref(),
            Some("k8s-v1.36.3_etcd-v3.6.8_helm-v3.21.4")
        );
        assert_eq!(cache_key("module x\n"), None);
    }

    #[test]
    fn the_simulator_binary_is_built_beside_the_tests() {
        let sim = sim_binary().expect("kvroute-sim builds");
        assert!(sim.is_file(), "{}", sim.display());
        let exe = std::env::current_exe().expect("the test executable");
        // <target>/<profile>/deps/<test> and <target>/<profile>/kvroute-sim
        assert_eq!(sim.parent(), exe.parent().and_then(Path::parent));
        assert_eq!(
            sim_binary().ok(),
            Some(sim),
            "built once, the same path after"
        );
    }
}
