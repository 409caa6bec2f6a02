#!/usr/bin/env bash
# Set up lossguard on a fresh machine: a virtual environment in .venv with the agent and the
# development tools. CPU machines get the pinned CPU build of torch; GPU users install their
# CUDA build of torch first (any version the pyproject range admits) and then run this.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip install torch
  else
    pip install "torch==2.13.0"
  fi
fi
# strict editable mode: a static link tree that mypy and other tools can follow
pip install -e ".[agent,wandb,huggingface,lightning,dev]" --config-settings editable_mode=strict
