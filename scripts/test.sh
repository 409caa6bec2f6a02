#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the linters, the type checker and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# promtool (Debian's prometheus package) checks the exposition and, later, the alert rules.
if ! command -v promtool >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null
  else
    echo "scripts/test.sh: promtool is missing: sudo apt-get install prometheus" >&2
    exit 1
  fi
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/python -m pytest "$@"
