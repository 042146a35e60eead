#!/usr/bin/env bash
# Builds the control-plane binaries the end-to-end tests run against — kube-apiserver,
# kube-controller-manager, etcd, kubectl (of the API server's version) and helm — from the Go
# module in e2e/k8s-bins, at the versions its go.mod pins, into ${KVROUTE_CACHE:-$HOME/.cache/kvroute}/bin/<versions>/.
# A binary already there is not rebuilt; Go's module and build caches are reused, so only the
# first run on a machine pays for the build (see docs/ci.md for how long it takes).
# Prints the folder holding the binaries on its last line of stdout (progress goes to stderr);
# the harness reads that folder from KVROUTE_K8S_BIN_DIR.
set -euo pipefail
cd "$(dirname "$0")/../e2e/k8s-bins"

command -v go >/dev/null || { echo "k8s-bins.sh: the Go toolchain (go 1.26+) is needed" >&2; exit 1; }

version_of() { go list -m -f '{{if .Replace}}{{.Replace.Version}}{{else}}{{.Version}}{{end}}' "$1"; }
k8s=$(version_of k8s.io/kubernetes)
etcd=$(version_of go.etcd.io/etcd/server/v3)
helm=$(version_of helm.sh/helm/v3)
key="k8s-${k8s}_etcd-${etcd}_helm-${helm}"
out="${KVROUTE_CACHE:-$HOME/.cache/kvroute}/bin/${key}"
mkdir -p "$out"

# No cgo: static binaries, and no C toolchain needed.
export CGO_ENABLED=0
k8s_minor=$(echo "$k8s" | cut -d. -f2)
k8s_ldflags="-s -w \
 -X k8s.io/component-base/version.gitVersion=${k8s} \
 -X k8s.io/component-base/version.gitMajor=1 \
 -X k8s.io/component-base/version.gitMinor=${k8s_minor} \
 -X k8s.io/component-base/version.gitTreeState=clean"

build() { # name package ldflags
  local name=$1 pkg=$2 ldflags=$3
  if [[ -x "$out/$name" ]]; then
    echo "k8s-bins.sh: $name present in $out" >&2
    return
  fi
  echo "k8s-bins.sh: building $name ($pkg)" >&2
  local start=$SECONDS
  # Build to a temporary name first so an interrupted build never leaves a broken binary.
  go build -trimpath -ldflags "$ldflags" -o "$out/.$name.tmp" "$pkg"
  mv "$out/.$name.tmp" "$out/$name"
  echo "k8s-bins.sh: built $name in $((SECONDS - start)) s" >&2
}

build etcd go.etcd.io/etcd/server/v3 "-s -w"
build kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver "$k8s_ldflags"
build kube-controller-manager k8s.io/kubernetes/cmd/kube-controller-manager "$k8s_ldflags"
build kubectl k8s.io/kubernetes/cmd/kubectl "$k8s_ldflags"
build helm helm.sh/helm/v3/cmd/helm "-s -w -X helm.sh/helm/v3/internal/version.version=${helm}"

echo "$out"
