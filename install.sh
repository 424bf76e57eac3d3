#!/usr/bin/env bash
# Installs Tandem and its test dependencies into ./.venv (idempotent).
# On a machine without an NVIDIA GPU, torch is pinned to the CPU build first, so that
# the unpinned `torch` dependency does not pull several GB of CUDA packages.
# The Node.js example worker's test needs node and npm (the machine's; its package from npm).
# The dashboard's browser test needs Chromium: installed with apt (Debian's `chromium`) when it is
# missing and apt can be used. `./install.sh --chromium` does only that step (the test runs it).
set -euo pipefail
cd "$(dirname "$0")"

install_chromium() {
  if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    return 0
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "chromium not installed and no apt-get: the browser test will be skipped" >&2
    return 1
  fi
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo -n"
  $sudo apt-get install -y -q chromium >/dev/null \
    || { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q chromium >/dev/null; } \
    || { echo "could not install chromium with apt-get: the browser test will be skipped" >&2; return 1; }
}

if [ "${1:-}" = "--chromium" ]; then
  install_chromium
  exit $?
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
if ! command -v nvidia-smi >/dev/null 2>&1; then
  .venv/bin/python -c "import torch" 2>/dev/null || $PIP install -q "torch==2.13.0"
fi
$PIP install -q -e ".[test]"
# the Node.js example worker's one dependency (npm's nats), for its test; skipped without npm
if command -v npm >/dev/null 2>&1; then
  npm ci --prefix docs/examples/node_worker --no-audit --no-fund --loglevel=error >/dev/null \
    || echo "npm ci of docs/examples/node_worker failed: the Node.js worker test will fail" >&2
fi
install_chromium || true
echo "installed: $(.venv/bin/tandem --version)" >&2
