#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the demo: a tiny GPT on CPU diverges (an injected learning-
# rate fault), the monitor with the default rules catches it, rolls the run back and announces it
# once to Slack, paging no one (Slack and PagerDuty when LOSSGUARD_SLACK_WEBHOOK_URL /
# LOSSGUARD_PAGERDUTY_ROUTING_KEY are set, else a local inbox): about 3 to 4 minutes on 2 cores,
# set-up aside. Arguments go to `lossguard-monitor demo`
# (--steps, --fault lr|nan, --plain, --out DIR, --set KEY=VALUE).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/lossguard-monitor demo "$@"
