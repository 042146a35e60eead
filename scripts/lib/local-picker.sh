# Sourced by the probe scripts (memory-bursts, hostile-prompt, idle-streams): simulated engines
# and one release picker on 127.0.0.1, stopped when the script exits. Set BIN (the folder with
# kvroute-sim and kvroute-picker) before sourcing; afterwards TMP is a scratch folder.

TMP=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$TMP"; }
trap cleanup EXIT

# start_sim N [kvroute-sim flags…]: N simulated engines; their HTTP ports in SIM_PORTS.
start_sim() {
  local engines=$1
  shift
  "$BIN/kvroute-sim" --host 127.0.0.1 --port 0 --engines "$engines" --model sim --speedup 1000 \
    --default-max-tokens 4 "$@" >"$TMP/sim.json" 2>"$TMP/sim.log" &
  PIDS+=($!)
  for _ in $(seq 100); do [ -s "$TMP/sim.json" ] && break; sleep 0.1; done
  mapfile -t SIM_PORTS < <(python3 -c '
import json, sys
for e in json.load(open(sys.argv[1]))["engines"]:
    print(e["http"].rsplit(":", 1)[1])' "$TMP/sim.json")
}

# start_picker CONFIG: the picker with that config file; its pid in PICKER.
start_picker() {
  RUST_LOG=warn "$BIN/kvroute-picker" --config "$1" --print-addresses \
    >"$TMP/picker.json" 2>"$TMP/picker.log" &
  PICKER=$!
  PIDS+=($PICKER)
  for _ in $(seq 100); do [ -s "$TMP/picker.json" ] && break; sleep 0.1; done
}

# picker_addr NAME: the address the picker's NAME listener (http, ext_proc, metrics…) bound.
picker_addr() {
  python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$TMP/picker.json" "$1"
}

# The picker's resident memory now, and its peak, in kB.
rss() { awk '/^VmRSS/ {print $2}' "/proc/$PICKER/status"; }
hwm() { awk '/^VmHWM/ {print $2}' "/proc/$PICKER/status"; }
