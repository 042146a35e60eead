#!/usr/bin/env bash
# What a huge text prompt costs the picker (issue 35, finding 1): one picker (release build)
# with a local tokenizer (the test fixture's) in front of a simulated engine, then COUNT
# concurrent chat requests, each a single message of MIB MiB of words (under maxBodyBytes,
# far over maxPromptTokens). Prints each answer's status and code, the picker's CPU time
# spent on them and its peak resident memory (VmHWM) before and after.
#
#   scripts/hostile-prompt.sh                 # one 14 MiB prompt, then three at once
#   MIB=8 COUNTS="1 3" SKIP_BUILD=1 scripts/hostile-prompt.sh
#
# Everything binds 127.0.0.1; every process it starts is stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
MIB=${MIB:-14}
# chat: one message of that size; text: a completion prompt of that size
KIND=${KIND:-chat}
COUNTS=${COUNTS:-"1 3"}
BIN=${BIN:-${CARGO_TARGET_DIR:-target}/release}
if [[ -z ${SKIP_BUILD:-} ]]; then
  cargo build --release -q -p kvroute-picker --bin kvroute-picker -p kvroute-sim --bin kvroute-sim
fi
source scripts/lib/local-picker.sh
TOK=$PWD/routing/tests/fixtures/tokenizer
start_sim 1
cat >"$TMP/picker.yaml" <<YAML
listen: {http: 127.0.0.1:0, admin: 127.0.0.1:0, metrics: 127.0.0.1:0, extProc: null}
modelConfigs:
  - name: sim
    model: sim
    port: ${SIM_PORTS[0]}
    tokenizer: {path: $TOK/tokenizer.json, configPath: $TOK/tokenizer_config.json}
endpoints:
  - {address: 127.0.0.1, modelConfig: sim}
YAML
start_picker "$TMP/picker.yaml"
HTTP=$(picker_addr http)
sleep 1
cpu_s() { awk -v hz="$(getconf CLK_TCK)" '{printf "%.2f", ($14 + $15) / hz}' "/proc/$PICKER/stat"; }

python3 - "$MIB" "$TMP/body.json" "$KIND" <<'PY'
import json, sys
mib, path, kind = int(sys.argv[1]), sys.argv[2], sys.argv[3]
words = "route the cache of alpha beta gamma to the engine that holds its prefix".split()
parts, size, i = [], 0, 0
while size < mib * 1024 * 1024 - 256:
    w = words[(i * 7) % len(words)]
    parts.append(w); size += len(w) + 1; i += 1
text = " ".join(parts)
body = {"model": "sim", "max_tokens": 4}
if kind == "chat":
    body["messages"] = [{"role": "user", "content": text}]
else:
    body["prompt"] = text
open(path, "w").write(json.dumps(body))
PY
echo "body: $(stat -c %s "$TMP/body.json") bytes; picker peak before: $(hwm) kB"
for n in $COUNTS; do
  before=$(cpu_s)
  python3 - "$HTTP" "$TMP/body.json" "$n" "$KIND" <<'PY'
import asyncio, json, sys
host, port = sys.argv[1].rsplit(":", 1)
body = open(sys.argv[2], "rb").read()
n = int(sys.argv[3])
path = "/v1/chat/completions" if sys.argv[4] == "chat" else "/v1/completions"
async def one():
    r, w = await asyncio.open_connection(host, int(port))
    w.write((f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body)
    await w.drain()
    data = await r.read()
    w.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    try:
        err = json.loads(rest)["error"]
        return f"{head.split()[1].decode()} {err['code']}: {err['message'][:120]}"
    except Exception:
        return head.split(b"\r\n")[0].decode()
async def main():
    for line in await asyncio.gather(*(one() for _ in range(n))):
        print("  ", line)
asyncio.run(main())
PY
  echo "$n at once: picker CPU $(python3 -c "print(round($(cpu_s) - $before, 2))") s; peak so far $(hwm) kB"
done
