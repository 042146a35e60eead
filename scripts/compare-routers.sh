#!/usr/bin/env bash
# Compare kvroute with peer routers on the same simulated engines and the same workload.
#
# Not part of CI. Installs the peers (vllm-router from PyPI; sglang-router too with
# WITH_SGLANG=1) into a throwaway virtualenv, then for each router:
#   1. starts fresh simulated engines: `kvroute-bench engines` (HTTP + ZMQ KV events),
#   2. starts the router in front of them,
#   3. replays the workload through it: `kvroute-bench replay --mode live --router URL`,
#   4. stops both.
# kvroute itself runs through `kvroute-bench replay --mode live` (engines + picker), with
# cost-model, least-load and round-robin. `direct` is the null router: the client sends each
# request straight to an engine, round robin, so kvroute round-robin minus direct is the
# latency the picker's hop adds.
#
# Usage: scripts/compare-routers.sh [extra replay args...]
#   env: ENGINES (8), SPEEDUP (1), MAX_REQUESTS (600), FORMAT/TRACE (default: generated),
#        WITH_SGLANG (0), OUT (target/compare-routers), VENV (a temp dir),
#        ROUTERS (default "direct kvroute vllm-round_robin vllm-kv_aware vllm-cache_aware
#        sglang-cache_aware": which to run), KVROUTE_POLICIES (cost-model,least-load,round-robin)
# Added latency of a router = its round robin's TTFT minus direct's (same placement, one hop).
# Example: FORMAT=mooncake MAX_REQUESTS=2000 scripts/compare-routers.sh --arrival-scale 4
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ENGINES="${ENGINES:-8}"
SPEEDUP="${SPEEDUP:-1}"
MAX_REQUESTS="${MAX_REQUESTS:-600}"
FORMAT="${FORMAT:-generated}"
TRACE="${TRACE:-}"
WITH_SGLANG="${WITH_SGLANG:-0}"
ROUTERS="${ROUTERS:-direct kvroute vllm-round_robin vllm-kv_aware vllm-cache_aware sglang-cache_aware}"
KVROUTE_POLICIES="${KVROUTE_POLICIES:-cost-model,least-load,round-robin}"
want() { [[ " $ROUTERS " == *" $1 "* ]]; }
OUT="${OUT:-$ROOT/target/compare-routers}"
VENV="${VENV:-$(mktemp -d)/venv}"
BENCH="$ROOT/target/release/kvroute-bench"
mkdir -p "$OUT"

PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do
    [ -n "$p" ] && kill "$p" 2>/dev/null || true
  done
  wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM

echo "== building kvroute-bench"
cargo build --release -q -p kvroute-bench

if want vllm-round_robin || want vllm-kv_aware || want vllm-cache_aware || want sglang-cache_aware; then
  echo "== installing peers into $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip >/dev/null
  "$VENV/bin/pip" install -q vllm-router
  if [ "$WITH_SGLANG" = 1 ]; then
    "$VENV/bin/pip" install -q sglang-router || echo "sglang-router did not install; skipping it"
  fi
fi

WORKLOAD=(--format "$FORMAT" --max-requests "$MAX_REQUESTS" --engines "$ENGINES" --speedup "$SPEEDUP")
[ -n "$TRACE" ] && WORKLOAD+=(--trace "$TRACE")
WORKLOAD+=("$@")

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

# start_engines FILE: fresh engines; their address JSON goes to FILE
start_engines() {
  local json="$1"
  : > "$json"
  "$BENCH" engines --engines "$ENGINES" --speedup "$SPEEDUP" > "$json" 2> "$OUT/engines.log" &
  ENGINES_PID=$!
  PIDS+=("$ENGINES_PID")
  for _ in $(seq 100); do
    [ -s "$json" ] && return 0
    sleep 0.1
  done
  echo "engines did not start (see $OUT/engines.log)" >&2
  return 1
}

wait_http() {
  local url="$1"
  for _ in $(seq 300); do
    curl -sf -o /dev/null "$url" && return 0
    sleep 0.2
  done
  echo "$url did not come up" >&2
  return 1
}

# run_peer NAME COMMAND...: the command gets ROUTER_PORT and engine lists from the env
run_peer() {
  local name="$1"; shift
  local json="$OUT/engines-$name.json"
  start_engines "$json"
  local port; port="$(free_port)"
  local urls events
  urls="$(python3 -c 'import json,sys; print(" ".join(e["url"] for e in json.load(open(sys.argv[1]))["engines"]))' "$json")"
  events="$(python3 -c 'import json,sys; print(" ".join("--kv-event-source %s=%s" % (e["url"], e["kv_event_endpoints"][0]) for e in json.load(open(sys.argv[1]))["engines"]))' "$json")"
  # shellcheck disable=SC2086
  ROUTER_PORT="$port" URLS="$urls" EVENTS="$events" "$@" > "$OUT/$name.log" 2>&1 &
  local rpid=$!
  PIDS+=("$rpid")
  if wait_http "http://127.0.0.1:$port/health" || wait_http "http://127.0.0.1:$port/v1/models"; then
    echo "== replaying through $name"
    "$BENCH" replay --mode live --router "http://127.0.0.1:$port" --router-name "$name" \
      --engines-json "$json" "${WORKLOAD[@]}" --json "$OUT/$name.json" --no-progress \
      | tee "$OUT/$name.txt" || echo "$name: replay failed"
  else
    echo "$name did not start; see $OUT/$name.log"
  fi
  kill "$rpid" "$ENGINES_PID" 2>/dev/null || true
  wait "$rpid" "$ENGINES_PID" 2>/dev/null || true
}

vllm_router() {
  # shellcheck disable=SC2086
  # no admission limits of its own: the comparison is about routing
  exec "$VENV/bin/vllm-router" --host 127.0.0.1 --port "$ROUTER_PORT" --worker-urls $URLS \
    --max-concurrent-requests 8192 --queue-size 8192 --request-timeout-secs 900 \
    --disable-retries --log-level warning "$@"
}
vllm_kv_aware() { vllm_router --policy kv_aware $EVENTS --kv-event-block-size 16 --kv-event-model sim-model; }
vllm_cache_aware() { vllm_router --policy cache_aware; }
vllm_round_robin() { vllm_router --policy round_robin; }
sglang_cache_aware() {
  # shellcheck disable=SC2086
  exec "$VENV/bin/python" -m sglang_router.launch_router --host 127.0.0.1 --port "$ROUTER_PORT" \
    --worker-urls $URLS --policy cache_aware
}

if want direct; then
  start_engines "$OUT/engines-direct.json"
  echo "== replaying straight to the engines (no router, round robin)"
  "$BENCH" replay --mode live --router direct --router-name direct-round-robin \
    --engines-json "$OUT/engines-direct.json" "${WORKLOAD[@]}" --json "$OUT/direct.json" \
    --no-progress | tee "$OUT/direct.txt" || echo "direct: replay failed"
  kill "$ENGINES_PID" 2>/dev/null || true
  wait "$ENGINES_PID" 2>/dev/null || true
fi
if want kvroute; then
  echo "== kvroute ($KVROUTE_POLICIES) through its own picker"
  "$BENCH" replay --mode live --policies "$KVROUTE_POLICIES" "${WORKLOAD[@]}" \
    --json "$OUT/kvroute.json" --no-progress | tee "$OUT/kvroute.txt"
fi
want vllm-round_robin && run_peer vllm-router-round_robin vllm_round_robin
want vllm-kv_aware && run_peer vllm-router-kv_aware vllm_kv_aware
want vllm-cache_aware && run_peer vllm-router-cache_aware vllm_cache_aware
if want sglang-cache_aware && [ "$WITH_SGLANG" = 1 ] \
  && "$VENV/bin/python" -c 'import sglang_router' 2>/dev/null; then
  run_peer sglang-router-cache_aware sglang_cache_aware
fi

echo
echo "== summary ($OUT)"
python3 - "$OUT" <<'PY'
import json, glob, os, sys
rows = []
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    if os.path.basename(f).startswith("engines-"):
        continue
    try:
        rows += json.load(open(f))
    except Exception:
        pass
keys = ["policy", "requests", "errors", "hit_rate", "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99",
        "e2e_ms_p50", "tpot_ms_p50", "output_tok_s", "slo_attainment", "decision_us_p99"]
print(" | ".join(keys))
for r in rows:
    cells = []
    for k in keys:
        v = r.get(k)
        cells.append(f"{v:.3f}" if isinstance(v, float) and k in ("hit_rate", "slo_attainment") else
                     f"{v:.0f}" if isinstance(v, float) else str(v))
    print(" | ".join(cells))
PY
