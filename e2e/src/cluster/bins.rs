//! Where the harness finds the programs it runs: the control-plane binaries that
//! `scripts/k8s-bins.sh` builds, and the workspace's own binaries that cargo builds.

use std::path::{Path, PathBuf};

use anyhow::bail;

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

/// The workspace's binaries, built by cargo into the target folder this test runs from.
#[derive(Debug, Clone)]
pub struct WorkspaceBins {
    pub sim: PathBuf,
    pub picker: PathBuf,
    pub operator: PathBuf,
}

impl WorkspaceBins {
    /// `sim` is this crate's own binary (`CARGO_BIN_EXE_kvroute-sim` in the tests); the
    /// operator's and picker's are found next to it (`cargo test --workspace` builds them),
    /// or at `$KVROUTE_OPERATOR_BIN` / `$KVROUTE_PICKER_BIN`.
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
}
