#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the linters, the type checker and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
logs=()
trap 'rm -f "${logs[@]}"' EXIT
# Debian packages the tests run for real: promtool and prometheus (rules, exposition, the live
# comparison), amtool and alertmanager (routing and webhook payloads compared with ours), slurm
# and munge (deploy/slurm/), iproute2 (network namespaces as hosts).
missing=()
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v amtool >/dev/null 2>&1 || missing+=(prometheus-alertmanager)
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)  # opens the run report (headless)
# a single-host Slurm (tests/support/slurm.py): the sbatch template's requeue, for real
command -v slurmctld >/dev/null 2>&1 || [ -x /usr/sbin/slurmctld ] || missing+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || [ -x /usr/sbin/munged ] || missing+=(munge)
# network namespaces as simulated hosts (tests/support/netns.py): a monitor on its own host
command -v ip >/dev/null 2>&1 || [ -x /usr/sbin/ip ] || missing+=(iproute2)
apt_pid=
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "scripts/test.sh: missing Debian packages: sudo apt-get install ${missing[*]}" >&2
    exit 1
  fi
  # installed beside the Python set-up: both spend most of their time on the disk and network
  apt_log=$(mktemp)
  logs+=("$apt_log")
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}") \
    >"$apt_log" 2>&1 &
  apt_pid=$!
fi
# each module compiled to bytecode once for the whole run, not in every process the tests start
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup.sh
if [ -n "$apt_pid" ] && ! wait "$apt_pid"; then
  cat "$apt_log" >&2
  echo "scripts/test.sh: apt-get install ${missing[*]} failed" >&2
  exit 1
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# the type check (about a minute of one core) runs beside the tests; its report follows
# theirs, and either failing fails the command
mypy_log=$(mktemp)
logs+=("$mypy_log")
.venv/bin/mypy >"$mypy_log" 2>&1 &
mypy_pid=$!
# four workers on 2 cores: two take the files that mostly wait on timers (the shipped rules'
# `for:`, group_wait, back-offs), in two lanes, while the other two keep both cores busy; a
# whole file to a worker, so a module's shared run (a fixture) is made once; the files in the
# order the suite gives them (tests/support/schedule.py), not xdist's most-tests-first
status=0
.venv/bin/python -m pytest -n 4 --dist loadfile --no-loadscope-reorder "$@" || status=$?
mypy_status=0
wait "$mypy_pid" || mypy_status=$?
cat "$mypy_log"
if [ "$mypy_status" -ne 0 ]; then
  echo "scripts/test.sh: mypy failed (exit $mypy_status)" >&2
  status=1
fi
exit "$status"
