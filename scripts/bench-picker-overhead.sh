#!/usr/bin/env bash
# Picker overhead over loopback: the same requests sent straight to a simulated engine that
# answers (almost) instantly, and through kvroute-picker in front of it, by wrk from a separate
# process. Added latency = picker percentile - direct percentile. Also the pick API's
# sustained decisions/s (tokenize + hash + match + score, nothing forwarded). Prompts: token
# ids, text (a new ending per request) and chat (a 16-turn history, a new question per request).
#
#   [KINDS="ids text chat"] [SIZES="1 8 128"] [RATE=req/s CONNS=n] [PEERS_VENV=dir] \
#     scripts/bench-picker-overhead.sh [seconds-per-run]
#
# RATE: each of CONNS connections pauses CONNS/RATE s before each request, so the offered
# load is at most RATE (without it: one connection, back to back). PEERS_VENV: a virtualenv
# with `vllm-router` and/or `sglang-router` installed (pip install vllm-router sglang-router);
# each runs in front of the same engine with PEER_POLICY (default round_robin; with one worker
# the hop alone; cache_aware adds its prefix tree), and is
# measured beside the picker. The SGLang router takes text prompts only (no token ids).
#
# Needs wrk (apt-get install wrk) and python3. Everything binds 127.0.0.1; every process it
# starts is stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=${1:-10}
command -v wrk >/dev/null || { echo "wrk is required: apt-get install wrk" >&2; exit 1; }
cargo build --release -q -p kvroute-picker -p kvroute-sim --bin kvroute-picker --bin kvroute-sim
TMP=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$TMP"; }
trap cleanup EXIT

TOK=routing/tests/fixtures/tokenizer
target/release/kvroute-sim --host 127.0.0.1 --port 0 --model bench --speedup 100000 \
  --kv-blocks 400000 --kv-events-port auto --kv-replay-port auto --default-max-tokens 1 \
  --max-batched-tokens 262144 --tokenizer "$TOK" >"$TMP/sim.json" 2>"$TMP/sim.log" &
PIDS+=($!)
for _ in $(seq 100); do [ -s "$TMP/sim.json" ] && break; sleep 0.1; done
read -r HTTP EV RP < <(python3 -c '
import json,sys; e=json.load(open(sys.argv[1]))["engines"][0]
print(e["http"], e["kv_events"][0].split(":")[-1], e["replay"][0].split(":")[-1])' "$TMP/sim.json")
cat >"$TMP/picker.yaml" <<YAML
listen: {http: 127.0.0.1:0, admin: 127.0.0.1:0, metrics: 127.0.0.1:0, extProc: null}
modelConfigs:
  - name: bench
    model: bench
    port: ${HTTP##*:}
    kvEvents: {port: 1}
    tokenizer: {path: $PWD/$TOK/tokenizer.json, configPath: $PWD/$TOK/tokenizer_config.json}
endpoints:
  - {address: 127.0.0.1, modelConfig: bench, kvEventsPort: $EV, kvReplayPort: $RP}
limits: {maxBodyBytes: 67108864, maxPromptTokens: 1048576}
YAML
RUST_LOG=warn target/release/kvroute-picker --config "$TMP/picker.yaml" --print-addresses >"$TMP/picker.json" 2>"$TMP/picker.log" &
PIDS+=($!)
for _ in $(seq 100); do [ -s "$TMP/picker.json" ] && break; sleep 0.1; done
PHTTP=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["http"])' "$TMP/picker.json")
PADMIN=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["admin"])' "$TMP/picker.json")

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}
wait_up() { # url
  for _ in $(seq 150); do curl -s -o /dev/null -m 1 "$1" && return 0; sleep 0.2; done
  echo "$1 did not come up" >&2; return 1
}
PEERS=()
if [ -n "${PEERS_VENV:-}" ]; then
  if [ -x "$PEERS_VENV/bin/vllm-router" ]; then
    VPORT=$(free_port)
    "$PEERS_VENV/bin/vllm-router" --host 127.0.0.1 --port "$VPORT" --worker-urls "http://$HTTP" \
      --policy "${PEER_POLICY:-round_robin}" --prometheus-port "$(free_port)" --max-concurrent-requests 8192 \
      --queue-size 8192 --disable-retries --log-level warning >"$TMP/vllm-router.log" 2>&1 &
    PIDS+=($!)
    wait_up "http://127.0.0.1:$VPORT/health" && PEERS+=("vllm-router=127.0.0.1:$VPORT")
  fi
  if "$PEERS_VENV/bin/python" -c 'import sglang_router' 2>/dev/null; then
    SPORT=$(free_port)
    "$PEERS_VENV/bin/python" -m sglang_router.launch_router --host 127.0.0.1 --port "$SPORT" \
      --worker-urls "http://$HTTP" --policy "${PEER_POLICY:-round_robin}" --prometheus-port "$(free_port)" \
      --log-level warn >"$TMP/sglang-router.log" 2>&1 &
    PIDS+=($!)
    wait_up "http://127.0.0.1:$SPORT/health" && PEERS+=("sglang-router=127.0.0.1:$SPORT")
  fi
fi
CONNS=${CONNS:-1}
DELAY_MS=0
[ -n "${RATE:-}" ] && DELAY_MS=$(python3 -c "print(round($CONNS * 1000 / $RATE, 3))")

# request bodies: token-id prompts (no tokenization), text prompts (tokenized by the picker;
# each request ends differently, so none is served whole from the tokenizer's piece cache) and
# chats (a long conversation whose history repeats and whose last question is new each time)
python3 - "$TMP" <<'PY'
import json, sys, random
out = sys.argv[1]
random.seed(7)
words = "kv cache aware routing sends each request to the replica that holds its prefix".split()
for k in (1, 8, 128):
    n = k * 1024
    ids = [random.randrange(1, 400) for _ in range(n)]
    json.dump({"model": "bench", "prompt": ids, "max_tokens": 1}, open(f"{out}/ids{k}k.json", "w"))
    # the fixture tokenizer makes roughly one token per 1.8 characters of this text
    text = " ".join(random.choice(words) + str(i % 97) for i in range(int(n / 2.2)))
    json.dump({"model": "bench", "prompt": text + " request @@N@@", "max_tokens": 1},
              open(f"{out}/text{k}k.json", "w"))
    turns = [{"role": "system", "content": "You are a helpful assistant."}]
    per = len(text) // 16
    for t in range(16):
        turns.append({"role": "user" if t % 2 == 0 else "assistant",
                      "content": text[t * per:(t + 1) * per]})
    turns.append({"role": "user", "content": "question @@N@@: why?"})
    json.dump({"model": "bench", "messages": turns, "max_tokens": 1}, open(f"{out}/chat{k}k.json", "w"))
PY
cat >"$TMP/post.lua" <<'LUA'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local f = io.open(os.getenv("BODY"), "rb"); local body = f:read("*a"); f:close()
local at = body:find("@@N@@", 1, true)
local head, tail = body, nil
if at then head, tail = body:sub(1, at - 1), body:sub(at + 5) end
local n = 0
local pause = tonumber(os.getenv("DELAY_MS") or "0")
if pause > 0 then
  function delay() return pause end
end
function request()
  n = n + 1
  if tail then return wrk.format(nil, nil, nil, head .. n .. tail) end
  return wrk.format(nil, nil, nil, body)
end
function done(summary, latency, requests)
  io.write(string.format("RESULT %d %d %.1f %.1f %.1f\n", summary.requests, summary.errors.status + summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
    latency:percentile(50), latency:percentile(99), summary.requests / (summary.duration / 1e6)))
end
LUA
run() { # url body conns -> "requests errors p50us p99us rps"
  BODY="$2" DELAY_MS="${4:-0}" wrk -t1 -c"$3" -d"${DUR}s" --timeout 30s -s "$TMP/post.lua" "$1" \
    | awk '/^RESULT/ {print $2, $3, $4, $5, $6}'
}
printf "%-10s %-13s %10s %10s %10s %10s %10s %12s\n" prompt path p50_us p99_us add_p50_us add_p99_us errors req_per_s
for kind in ${KINDS:-ids text chat}; do
  path=/v1/completions
  [ "$kind" = chat ] && path=/v1/chat/completions
  for k in ${SIZES:-1 8 128}; do
    body="$TMP/${kind}${k}k.json"
    read -r n1 e1 d50 d99 drps < <(run "http://$HTTP$path" "$body" "$CONNS" "$DELAY_MS")
    printf "%-10s %-13s %10.0f %10.0f %10s %10s %10s %12.1f\n" "${kind}-${k}k" direct "$d50" "$d99" - - "$e1" "$drps"
    for via in "picker=$PHTTP" "${PEERS[@]}"; do
      name=${via%%=*}
      [ "$name" = sglang-router ] && [ "$kind" = ids ] && continue # token ids: refused (422)
      read -r n2 e2 p50 p99 prps < <(run "http://${via#*=}$path" "$body" "$CONNS" "$DELAY_MS")
      printf "%-10s %-13s %10.0f %10.0f %10.0f %10.0f %10s %12.1f\n" "${kind}-${k}k" "$name" "$p50" "$p99" \
        "$(python3 -c "print($p50-$d50)")" "$(python3 -c "print($p99-$d99)")" "$e2" "$prps"
    done
    read -r n3 e3 k50 k99 krps < <(run "http://$PADMIN/v1/pick" "$body" 4)
    printf "%-10s %-13s %10.0f %10.0f %10s %10s %10s %12.1f\n" "${kind}-${k}k" pick-api "$k50" "$k99" - - "$e3" "$krps"
  done
done
