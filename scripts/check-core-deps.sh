#!/usr/bin/env bash
# The routing core (kvroute-routing) links no HTTP, gRPC, ZMQ or Kubernetes client and no async
# runtime; the simulator, the fuzz targets and the index comparison use the core, not the picker
# service. Fails naming the crate that broke it. Run by scripts/test.sh after clippy.
set -euo pipefail
cd "$(dirname "$0")/.."

fail=0
# names of the crates in a package's tree (normal dependencies only, or normal and dev)
tree() { cargo tree --locked --prefix none --format '{p}' "$@" | awk '{print $1}' | sort -u; }
check() {
  local what=$1 banned=$2
  shift 2
  local names found
  names=$(tree "$@")
  found=$(grep -Ex "$banned" <<<"$names" || true)
  if [[ -n $found ]]; then
    echo "check-core-deps: $what depends on: $(tr '\n' ' ' <<<"$found")" >&2
    fail=1
  fi
}

service='kvroute-picker|kvroute-crds|tonic|tonic-.*|kube|kube-.*|k8s-openapi|reqwest'
# the core, its tests and benches included
check kvroute-routing "$service|zeromq|hyper|hyper-.*|axum|tokio|tokio-.*" -p kvroute-routing -e normal,dev
# the simulator is an engine: it serves HTTP (axum) and ZMQ itself, but never through the picker
check kvroute-sim "$service" -p kvroute-sim -e normal
# the fuzz targets and the index comparison keep their own lock files
for lock in fuzz/Cargo.lock benches/index-compare/Cargo.lock; do
  if grep -Eq "^name = \"(kvroute-picker|kvroute-crds)\"" "$lock"; then
    echo "check-core-deps: $lock names the picker service; depend on kvroute-routing" >&2
    fail=1
  fi
done
if [[ $fail == 0 ]]; then
  echo "check-core-deps: the routing core and its users are free of the service's I/O stack"
fi
exit $fail
