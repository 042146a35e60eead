#!/usr/bin/env bash
# Run every cargo-fuzz target for a while and summarize (docs/RELIABILITY.md).
#   scripts/fuzz.sh            # 180 s per target
#   SECONDS_PER_TARGET=600 scripts/fuzz.sh kv_event_decode
# Needs cargo-fuzz (`cargo install cargo-fuzz`) and a nightly toolchain; with only stable,
# RUSTC_BOOTSTRAP=1 lets stable accept the sanitizer flags: TOOLCHAIN= RUSTC_BOOTSTRAP=1 ...
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SECS=${SECONDS_PER_TARGET:-180}
TOOLCHAIN=${TOOLCHAIN-+nightly}
TARGET_DIR=${FUZZ_TARGET_DIR:-$ROOT/fuzz/target}
TARGETS=("$@")
[[ ${#TARGETS[@]} -gt 0 ]] || TARGETS=(kv_event_decode metrics_parse request_body_parse chat_template_render piece_encoding)
cd "$ROOT/fuzz"
# shellcheck disable=SC2086
cargo $TOOLCHAIN fuzz build -O --target-dir "$TARGET_DIR"
for t in "${TARGETS[@]}"; do
  mkdir -p "corpus/$t" "artifacts/$t"
  log="artifacts/$t/run.log"
  # shellcheck disable=SC2086
  cargo $TOOLCHAIN fuzz run -O --target-dir "$TARGET_DIR" "$t" "corpus/$t" "seeds/$t" -- \
    -max_total_time="$SECS" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 > "$log" 2>&1 \
    && status=clean || status="FAILED (see $log and artifacts/$t)"
  last=$(grep -E '^#[0-9]+' "$log" | tail -1 || true)
  execs=$(grep -E 'stat::number_of_executed_units' "$log" | awk '{print $2}' || true)
  echo "$t: $status; ${SECS}s; execs ${execs:-?}; $last"
done
