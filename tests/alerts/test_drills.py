"""The drill catalog's short version (the benchmark is ``python -m benchmarks.bench_drills``): a
fault-free run, one NaN and lr x1000 at 300 steps, under the shipped monitor config, and each
drill's outcome must be the one the catalog expects.

It waits for the monitor's last notifications at most SETTLE_S after a drill's run ends (the
shipped group_wait and 5 s): a resolve the monitor would send later (group_interval 5m) is
not seen here; the benchmark waits for it. lr x1000 alone
takes about 100 s (LossSpikeNotRecovering: 300 steps, then its `for: 1m`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lossguard.monitor.demo.scenario import MONITOR_BASE
from tests.support.drill_catalog import CATALOG, Outcome
from tests.support.drill_runner import Options, run_catalog, shipped_with_receivers
from tests.support.fake_receivers import FakePagerDuty, FakeSlack

pytestmark = pytest.mark.live

SHORT = ("lr-x1000", "one-nan", "fault-free")  # the longest first: two train at once
SETTLE_S = 35.0


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    options = Options(steps=300, seeds=1, settle_limit_s=SETTLE_S, jobs=2)
    work = tmp_path_factory.mktemp("drills")
    found = run_catalog([CATALOG[n] for n in SHORT], options, work, CATALOG["fault-free"])
    return {o.drill: o for o in found}


@pytest.mark.parametrize("name", SHORT)
def test_the_drill_ends_as_expected(outcomes: dict[str, Outcome], name: str) -> None:
    outcome = outcomes[name]
    assert outcome.not_runnable is None and outcome.error is None, outcome
    assert outcome.stop_met, outcome.summary()
    assert CATALOG[name].expected.misses(outcome) == [], outcome.summary()


def test_the_monitor_config_is_the_shipped_one_with_its_receivers(tmp_path: Path) -> None:
    from tests.support.drill_runner import monitor_settings

    shipped = yaml.safe_load(MONITOR_BASE.read_text())
    filled = shipped_with_receivers()
    assert (
        filled["notifications"]["route"]["group_wait"]
        == shipped["notifications"]["route"]["group_wait"]
    )
    assert filled["notifications"]["inhibit_rules"] == shipped["notifications"]["inhibit_rules"]
    assert filled["actions"] == shipped["actions"]
    with FakeSlack() as slack, FakePagerDuty() as pagerduty:
        settings, env = monitor_settings(tmp_path, 9999, slack, pagerduty)
    kinds = {k for r in settings["notifications"]["receivers"] for k in r if k.endswith("_configs")}
    assert {"pagerduty_configs", "slack_configs"} <= kinds
    assert set(env.values()) == {slack.webhook_url, pagerduty.routing_key}
    changed = {k for k in settings if settings[k] != shipped.get(k)}
    assert changed == {"rules", "scrape", "state", "listen", "notifications"}
    assert settings["scrape"] == {**shipped["scrape"], "runs_root": str(tmp_path)}
    assert settings["rules"]["evaluation_interval"] == shipped["rules"]["evaluation_interval"]
