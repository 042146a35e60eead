#!/usr/bin/env bash
# The project's test command: format check, clippy with warnings denied, all tests.
# Needs the Rust toolchain and Python 3 with pip (the ZMQ interop tests talk to a libzmq
# publisher written with pyzmq).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c 'import zmq, msgpack' 2>/dev/null || python3 -m pip install --quiet 'pyzmq>=26' 'msgpack>=1.0'
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked
