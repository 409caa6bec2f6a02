#!/usr/bin/env bash
# Set up (scripts/setup.sh), then train the demo: a tiny GPT on the Python standard library's
# sources, on CPU, in a couple of minutes. Extra arguments go to `lossguard-agent run`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/lossguard-agent run configs/demo.yaml "$@"
