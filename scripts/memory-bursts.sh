#!/usr/bin/env bash
# Does the picker's memory come back after bursts? (issue 12, finding 7)
# Two simulated engines (kvroute-sim), one picker in front (kvroute-picker, release build),
# then bursts of BURST concurrent requests (one connection each, closed after the response),
# and the picker's resident memory (VmRSS) at start, after the first burst, after BURSTS
# bursts, and after IDLE_S seconds idle with every client connection closed (95 s: longer
# than the 90 s the picker keeps idle upstream connections; 200 s: past its pool's reaper).
#
#   scripts/memory-bursts.sh                       # 2,000 per burst, 28 bursts, 95 s idle
#   BURST=500 BURSTS=3 IDLE_S="20 40" scripts/memory-bursts.sh
#   SKIP_BUILD=1 BIN=/path/to/release scripts/memory-bursts.sh
#
# Needs python3 and an open-file limit of 4 x BURST + 4096 (the picker keeps about half of
# what its limit leaves after in-flight requests and reserves for each of two listeners).
# Everything binds 127.0.0.1; every process it starts is stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
BURST=${BURST:-2000}
BURSTS=${BURSTS:-28}
# idle times (seconds since the last burst) at which memory is read
IDLE_S=${IDLE_S:-"95 200"}
BIN=${BIN:-${CARGO_TARGET_DIR:-target}/release}
if [[ -z ${SKIP_BUILD:-} ]]; then
  cargo build --release -q -p kvroute-picker --bin kvroute-picker -p kvroute-sim --bin kvroute-sim
fi
# a smaller limit shrinks the picker's connection cap below a burst (2 x BURST + 1024 left a
# burst of 50 with a cap of 16: 34 of 50 refused)
ulimit -n $((4 * BURST + 4096)) 2>/dev/null || true
source scripts/lib/local-picker.sh
start_sim 2 --max-waiting 100000
P0=${SIM_PORTS[0]}
P1=${SIM_PORTS[1]}
cat >"$TMP/picker.yaml" <<YAML
listen: {http: 127.0.0.1:0, admin: 127.0.0.1:0, metrics: 127.0.0.1:0, extProc: null}
modelConfigs:
  - {name: sim, model: sim, port: $P0}
endpoints:
  - {address: 127.0.0.1, modelConfig: sim}
  - {address: 127.0.0.1, modelConfig: sim, port: $P1}
YAML
start_picker "$TMP/picker.yaml"
HTTP=$(picker_addr http)
fds() { ls "/proc/$PICKER/fd" | wc -l; }  # open sockets and files of the picker
sleep 2

# one burst: BURST connections at once, each one request with `Connection: close`
cat >"$TMP/burst.py" <<'PY'
import asyncio, sys
host, port = sys.argv[1].rsplit(":", 1)
n, round_ = int(sys.argv[2]), int(sys.argv[3])
words = "kv cache aware routing sends each request to the replica holding its prefix".split()
async def one(i):
    prompt = " ".join(words[(i + k) % len(words)] for k in range(200)) + f" request {round_}-{i}"
    body = ('{"model":"sim","max_tokens":4,"prompt":"%s"}' % prompt).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    try:
        r, w = await asyncio.open_connection(host, int(port))
        w.write(head + body)
        await w.drain()
        data = await r.read()
        w.close()
        return data.startswith(b"HTTP/1.1 200")
    except OSError:
        return False
async def main():
    ok = await asyncio.gather(*(one(i) for i in range(n)))
    print(sum(ok), n - sum(ok))
asyncio.run(main())
PY
printf "%-28s %10s %6s %8s %8s\n" point rss_kib fds ok failed
printf "%-28s %10s %6s\n" "start (idle, 2 s up)" "$(rss)" "$(fds)"
for b in $(seq "$BURSTS"); do
  read -r ok failed < <(python3 "$TMP/burst.py" "$HTTP" "$BURST" "$b")
  sleep 1
  if [ "$b" = 1 ] || [ "$b" = "$BURSTS" ]; then
    printf "%-28s %10s %6s %8s %8s\n" "after burst $b" "$(rss)" "$(fds)" "$ok" "$failed"
  fi
done
idle=0
for point in $IDLE_S; do
  sleep $((point - idle)); idle=$point
  printf "%-28s %10s %6s\n" "after ${point} s idle" "$(rss)" "$(fds)"
done
