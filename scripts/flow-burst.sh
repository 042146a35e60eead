#!/usr/bin/env bash
# Flow control against a burst of non-streamed requests (issue 49): one simulated engine that
# batches 256 sequences, one picker (release build unless BIN says otherwise), REQUESTS
# concurrent non-streamed completions of ~200 prompt tokens and max_tokens 10, ROUNDS times,
# with routing.flowControl off and then on. Prints each round's wall time; flow control should
# cost little when the engine has room for the whole burst.
#
#   scripts/flow-burst.sh
#   SKIP_BUILD=1 BIN=target/debug REQUESTS=40 ROUNDS=3 scripts/flow-burst.sh
#
# Everything binds 127.0.0.1; every process it starts is stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
REQUESTS=${REQUESTS:-40}
ROUNDS=${ROUNDS:-3}
BIN=${BIN:-${CARGO_TARGET_DIR:-target}/release}
if [[ -z ${SKIP_BUILD:-} ]]; then
  cargo build --release -q -p kvroute-picker --bin kvroute-picker -p kvroute-sim --bin kvroute-sim
fi
source scripts/lib/local-picker.sh
# real-time engine timing (the helper's default speeds the simulator up a thousandfold)
"$BIN/kvroute-sim" --host 127.0.0.1 --port 0 --engines 1 --model sim --max-num-seqs 256 \
  >"$TMP/sim.json" 2>"$TMP/sim.log" &
PIDS+=($!)
for _ in $(seq 100); do [ -s "$TMP/sim.json" ] && break; sleep 0.1; done
PORT=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["engines"][0]["http"].rsplit(":", 1)[1])' "$TMP/sim.json")
for fc in false true; do
  cat >"$TMP/picker.yaml" <<YAML
listen: {http: 127.0.0.1:0, admin: 127.0.0.1:0, metrics: 127.0.0.1:0}
modelConfigs:
  - {name: sim, model: sim, port: $PORT}
endpoints:
  - {address: 127.0.0.1, modelConfig: sim}
routing: {flowControl: {enabled: $fc}}
YAML
  start_picker "$TMP/picker.yaml"
  sleep 2
  python3 - "$(picker_addr http)" "$fc" "$REQUESTS" "$ROUNDS" <<'PY'
import json, sys, threading, time, urllib.request
http, fc, n, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def one(i, out):
    body = json.dumps({"model": "sim", "prompt": f"request {i} " + "x " * 200, "max_tokens": 10}).encode()
    req = urllib.request.Request(f"http://{http}/v1/completions", body, {"content-type": "application/json"})
    t = time.time()
    urllib.request.urlopen(req).read()
    out[i] = time.time() - t
for r in range(rounds):
    out = {}
    t0 = time.time()
    threads = [threading.Thread(target=one, args=(i, out)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"flowControl {fc}, round {r + 1}: {n} non-streamed in {time.time() - t0:.2f} s (slowest {max(out.values()):.2f} s)")
PY
  kill "$PICKER"
  wait "$PICKER" 2>/dev/null || true
done
