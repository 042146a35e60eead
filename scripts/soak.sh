#!/usr/bin/env bash
# Soak and faults under load, loopback only, bounded in time: simulated engines
# (kvroute-bench engines), one picker (kvroute-picker), load from wrk in fixed windows.
# Per window it records requests, errors, latency percentiles and the picker's resident
# memory; faults are injected into the simulated engines at fixed windows:
#   window FAULT_HANG:    engine 0 hangs (accepts, never answers) for one window
#   window FAULT_CRASH:   engine 1 crashes mid-stream (connections dropped), back after 5 s
#                         with an empty cache and sequence numbers from 0
#   window FAULT_EVENTS:  engine 2 drops all KV event batches for good (gaps, no replay)
#   window FAULT_GARBAGE: engine 3's publisher floods GARBAGE_RATE hostile messages per second
#                         (random bytes, damaged payloads, bogus sequence numbers, bad frames)
# Results: $OUT/summary.tsv (one line per window) and the raw wrk output per window.
#
#   scripts/soak.sh                        # 10 windows of 30 s (about 5.5 minutes)
#   WINDOWS=20 WINDOW_S=60 scripts/soak.sh # longer
#   SKIP_BUILD=1 BIN=/tmp/kvr-t7/release scripts/soak.sh
set -euo pipefail

WINDOWS=${WINDOWS:-10}
WINDOW_S=${WINDOW_S:-30}
ENGINES=${ENGINES:-4}
CONNS=${CONNS:-32}
SPEEDUP=${SPEEDUP:-50}
FAULT_HANG=${FAULT_HANG:-3}
FAULT_CRASH=${FAULT_CRASH:-5}
FAULT_EVENTS=${FAULT_EVENTS:-6}
FAULT_GARBAGE=${FAULT_GARBAGE:-8}
GARBAGE_RATE=${GARBAGE_RATE:-20000}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
BIN=${BIN:-$TARGET/release}
OUT=${OUT:-$TARGET/soak}
mkdir -p "$OUT"

command -v wrk >/dev/null || { echo "wrk is required (apt-get install wrk)" >&2; exit 2; }
if [[ -z ${SKIP_BUILD:-} ]]; then
  (cd "$ROOT" && cargo build --release -p kvroute-picker --bin kvroute-picker \
     -p kvroute-bench)
fi

pids=()
cleanup() {
  exec 3>&- 2>/dev/null || true
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

# engines: their stdin is a pipe we hold open; closing it (or the trap) stops them
rm -f "$OUT/engines.fifo"; mkfifo "$OUT/engines.fifo"
"$BIN/kvroute-bench" engines --engines "$ENGINES" --speedup "$SPEEDUP" --kv-blocks 8192 \
  --exit-on-stdin-close < "$OUT/engines.fifo" > "$OUT/engines.json" 2> "$OUT/engines.log" &
pids+=($!)
exec 3> "$OUT/engines.fifo"
for _ in $(seq 100); do [[ -s $OUT/engines.json ]] && break; sleep 0.1; done
[[ -s $OUT/engines.json ]] || { echo "engines did not start" >&2; exit 1; }

# the picker's config: every engine, precise KV events with replay
python3 - "$OUT" <<'EOF'
import json, socket, sys
out = sys.argv[1]
engines = json.loads(open(f"{out}/engines.json").readline())["engines"]
def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p
http, metrics, admin = free_port(), free_port(), free_port()
eps = []
for e in engines:
    host, port = e["http"].rsplit(":", 1)
    ev = e["kv_events"][0].rsplit(":", 1)[1]
    rp = e["replay"][0].rsplit(":", 1)[1]
    eps.append(f"  - {{address: {host}, modelConfig: sim, port: {port}, kvEventsPort: {ev}, kvReplayPort: {rp}}}")
open(f"{out}/picker.yaml", "w").write(f"""
listen: {{http: 127.0.0.1:{http}, metrics: 127.0.0.1:{metrics}, admin: 127.0.0.1:{admin}, extProc: null}}
modelConfigs:
  - name: sim
    model: sim-model
    blockSize: 16
    kvEvents: {{port: 1}}
    kvCapacityBlocks: 8192
endpoints:
{chr(10).join(eps)}
routing: {{strategy: CostModel, stalenessThreshold: 2s, failureMode: FailOpen}}
scrape: {{interval: 100ms, timeout: 500ms}}
limits: {{upstreamTimeout: 5s, idleTimeout: 5s}}
""")
open(f"{out}/ports", "w").write(f"{http} {metrics} {admin}\n")
open(f"{out}/engine_urls", "w").write("\n".join("http://" + e["http"] for e in engines) + "\n")
EOF
read -r HTTP METRICS ADMIN < "$OUT/ports"
mapfile -t URLS < "$OUT/engine_urls"

"$BIN/kvroute-picker" --config "$OUT/picker.yaml" > "$OUT/picker.log" 2>&1 &
PICKER=$!
pids+=("$PICKER")
for _ in $(seq 100); do
  curl -sf "http://127.0.0.1:$METRICS/readyz" >/dev/null 2>&1 && break; sleep 0.1
done

# the load: 16 shared 1024-token prefixes, a 64-token random suffix, 8 output tokens, streamed
cat > "$OUT/load.lua" <<'EOF'
local prefixes = {}
math.randomseed(42)
for p = 1, 16 do
  local t = {}
  for i = 1, 1024 do t[i] = (p * 7919 + i * 13) % 30000 + 1 end
  prefixes[p] = table.concat(t, ",")
end
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
request = function()
  local s = {}
  for i = 1, 64 do s[i] = math.random(1, 30000) end
  local body = '{"model":"sim-model","max_tokens":8,"stream":true,"prompt":[' ..
    prefixes[math.random(1, 16)] .. "," .. table.concat(s, ",") .. "]}"
  return wrk.format(nil, nil, nil, body)
end
EOF

fault() { # engine-index json
  curl -sf -X POST -H 'content-type: application/json' -d "$2" "${URLS[$1]}/admin/fault" >/dev/null \
    || echo "fault injection on engine $1 failed" >&2
}

printf 'window\tfault\trequests\tnon2xx\tsocket_errors\tp50_ms\tp90_ms\tp99_ms\trss_kib\n' \
  > "$OUT/summary.tsv"
for w in $(seq 1 "$WINDOWS"); do
  label=none
  if (( w == FAULT_HANG )); then fault 0 '{"kind":"hang"}'; label=hang_engine0; fi
  if (( w == FAULT_HANG + 1 )); then fault 0 '{"kind":"clear"}'; fi
  if (( w == FAULT_CRASH )); then
    (sleep $((WINDOW_S / 3)); fault 1 '{"kind":"crash","mode":"close","restart_after_ms":5000}') &
    label=crash_engine1
  fi
  if (( w == FAULT_EVENTS )); then
    fault 2 '{"kind":"drop_events","fraction":1.0,"replayable":false}'; label=drop_events_engine2
  fi
  if (( w == FAULT_EVENTS + 1 )); then fault 2 '{"kind":"clear"}'; fi
  if (( w == FAULT_GARBAGE )); then
    fault 3 "{\"kind\":\"garbage_events\",\"per_second\":$GARBAGE_RATE,\"max_bytes\":4096}"
    label=garbage_events_engine3
  fi
  if (( w == FAULT_GARBAGE + 1 )); then fault 3 '{"kind":"clear"}'; fi
  wrk -t2 -c"$CONNS" -d"${WINDOW_S}s" --timeout 10s --latency -s "$OUT/load.lua" \
    "http://127.0.0.1:$HTTP/v1/completions" > "$OUT/wrk-$w.txt" 2>&1 || true
  rss=$(awk '/VmRSS/ {print $2}' "/proc/$PICKER/status" 2>/dev/null || echo dead)
  python3 - "$OUT/wrk-$w.txt" "$w" "$label" "$rss" >> "$OUT/summary.tsv" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
def ms(p):
    m = re.search(rf"^\s*{p}%\s+([\d.]+)(us|ms|s)\s*$", text, re.M)
    if not m: return "-"
    v, u = float(m.group(1)), m.group(2)
    return f"{v / 1000 if u == 'us' else v * 1000 if u == 's' else v:.1f}"
req = re.search(r"(\d+) requests in", text)
non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
print("\t".join([sys.argv[2], sys.argv[3], req.group(1) if req else "-",
                 non2xx.group(1) if non2xx else "0",
                 str(sum(map(int, sock.groups()))) if sock else "0",
                 ms(50), ms(90), ms(99), sys.argv[4]]))
EOF
  tail -1 "$OUT/summary.tsv"
done
curl -s "http://127.0.0.1:$METRICS/metrics" > "$OUT/picker-metrics.txt" || true
column -t -s $'\t' "$OUT/summary.tsv"
