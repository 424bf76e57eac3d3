#!/usr/bin/env bash
# Installs Tandem and its test dependencies into ./.venv (idempotent).
# On a machine without an NVIDIA GPU, torch is pinned to the CPU build first, so that
# the unpinned `torch` dependency does not pull several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
if ! command -v nvidia-smi >/dev/null 2>&1; then
  .venv/bin/python -c "import torch" 2>/dev/null || $PIP install -q "torch==2.13.0"
fi
$PIP install -q -e ".[test]"
echo "installed: $(.venv/bin/tandem --version)" >&2
