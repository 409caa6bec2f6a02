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
# Python caches a module's bytecode when it is first imported, so the installers need not
# compile all of torch up front (a third of pip's time); where the environment forbids that
# cache (PYTHONDONTWRITEBYTECODE), every process would compile what it imports, so they compile
pip_compile=(--no-compile)
uv_compile=()
if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then
  pip_compile=()
  uv_compile=(--compile-bytecode)
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@" "${pip_compile[@]}"; }

# torch through pip: pip takes a CPU machine's local wheel of the pinned version
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip install torch
  else
    pip install "torch==2.13.0"
  fi
fi
# the rest through uv, which resolves, fetches and unpacks in parallel (7 s here, pip 30 s),
# keeping the torch installed above (uv does not read pip's settings: a newer torch asked for
# by a dependency would be a CUDA build of several GB, so that is an error instead); strict
# editable mode: a static link tree that mypy and other tools can follow
pip install "uv>=0.5"
torch_version=$(.venv/bin/python -c "import torch; print(torch.__version__)")
.venv/bin/uv pip install --quiet --python .venv/bin/python "${uv_compile[@]}" \
  --constraint <(echo "torch==$torch_version") \
  -e ".[agent,wandb,huggingface,lightning,dev]" --config-settings editable_mode=strict
