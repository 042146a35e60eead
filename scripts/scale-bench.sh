#!/usr/bin/env bash
# One picker in front of 64 servers x 8 data-parallel ranks (512 endpoints) with KV events
# flowing: the picker's CPU, memory, ingest lag and added latency per request rate, for text and
# token-id prompts of 8k, 32k and 128k tokens (issue 53; `kvroute-bench scale`, figures in
# picker/BENCHMARKS.md section 4).
#
#   scripts/scale-bench.sh                          # the whole sweep, about 10 minutes
#   scripts/scale-bench.sh --kinds text --sizes 32768 --rates 50,100,200
#   TOKENIZER=routing/tests/fixtures/tokenizer scripts/scale-bench.sh   # no download
#
# Text prompts are tokenized with Llama 3's tokenizer: Meta's `tokenizer.model` from the
# `llama-models` wheel on PyPI, converted once to a Hugging Face `tokenizer.json` with
# transformers' TikTokenConverter, in a virtualenv of its own, all under
# ~/.cache/kvroute/llama3-tokenizer. Extra arguments go to `kvroute-bench scale` (its --help
# lists them). Everything binds 127.0.0.1; every process it starts is stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${KVROUTE_CACHE:-$HOME/.cache/kvroute}/llama3-tokenizer
if [ -z "${TOKENIZER:-}" ]; then
  TOKENIZER=$CACHE
  if [ ! -s "$CACHE/tokenizer.json" ]; then
    mkdir -p "$CACHE/dl"
    python3 -m venv "$CACHE/venv"
    "$CACHE/venv/bin/pip" install -q 'transformers==5.19.0' 'tiktoken==0.14.0' 'blobfile' 'protobuf'
    "$CACHE/venv/bin/pip" download -q --no-deps -d "$CACHE/dl" 'llama-models==0.3.0'
    python3 -m zipfile -e "$CACHE"/dl/llama_models-0.3.0-py3-none-any.whl "$CACHE/dl/x"
    "$CACHE/venv/bin/python" - "$CACHE/dl/x/llama_models/llama3/tokenizer.model" "$CACHE/tokenizer.json.part" <<'PY'
import sys
from transformers.convert_slow_tokenizer import TikTokenConverter
# Llama 3's pre-tokenizer pattern and its 256 special tokens, as llama_models/llama3/tokenizer.py
pattern = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
named = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
         "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
         "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
         "<|python_tag|>", "<|image|>"]
special = named + [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(named))]
tok = TikTokenConverter(vocab_file=sys.argv[1], pattern=pattern,
                        additional_special_tokens=special).converted()
assert tok.encode("hello world").ids == [15339, 1917], "not Llama 3's ids"
tok.save(sys.argv[2])
PY
    mv "$CACHE/tokenizer.json.part" "$CACHE/tokenizer.json"
    rm -rf "$CACHE/dl"
  fi
fi
cargo build --release -q -p kvroute-bench
exec target/release/kvroute-bench scale --tokenizer "$TOKENIZER" "$@"
