"""``lossguard-monitor demo``: the real command, shortened (a NaN early in a tiny run), tells
the story and leaves exactly what Slack and PagerDuty would have received in its inbox; the
view's plain/terminal choice; the summary from a recorded timeline."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from lossguard.monitor.actions.model import ActionRecord
from lossguard.monitor.demo.inbox import Message
from lossguard.monitor.demo.scenario import (
    PAGERDUTY_ENV,
    SLACK_ENV,
    STAND_IN_ROUTING_KEY,
    Receivers,
    Scenario,
    prepare,
    write_monitor_config,
)
from lossguard.monitor.demo.summary import Places, build_story, summary_lines
from lossguard.monitor.demo.view import LiveView, sparkline, use_plain
from lossguard.monitor.demo.watch import AlertChange, Happening, RunStatus, Sent
from tests.support.fake_receivers import slack_problem
from tests.support.processes import monitor_cli, run_cli

pytestmark = pytest.mark.live

TINY = (
    "model.n_layer=2", "model.n_head=2", "model.n_embd=64", "model.block_size=64",
    "train.batch_size=8", "train.eval_batches=2", "data.max_bytes=400000",
)  # fmt: skip


def test_the_demo_rolls_back_announces_it_once_and_pages_nobody(
    tmp_path: Path, corpus_cache: Path
) -> None:
    out = tmp_path / "demo"
    overrides = [f"--set={o}" for o in (*TINY, f"data.cache_dir={corpus_cache}")]
    done = run_cli(
        "demo", "--plain", "--fault", "nan", "--steps", "30", "--out", str(out), *overrides,
        module="lossguard.monitor.cli", timeout=300, **{SLACK_ENV: "", PAGERDUTY_ENV: ""},
    )  # fmt: skip
    text = done.stdout
    assert done.returncode == 0, text + done.stderr
    # live: NaN losses for the 40 steps LossNonFinite waits for, from a third of 30 steps;
    # checkpoints every 4; the alert (info: no one is told of it), the action, its announcement
    assert "step 10: injected fault: NaN losses for 40 steps" in text
    assert re.search(
        r"\] alert LossNonFinite \(info\) firing: Non-finite losses up to step 49 of run "
        r"tiny-gpt",
        text,
    )
    applied = re.search(
        r"\] action rollback \(LossNonFinite\): rolled back from step (\d+) to step 8 "
        r"\(step_00000008\), skipped (\d+) batches",
        text,
    )
    assert applied is not None, text
    from_step = int(applied[1])
    # every NaN step (10 to 49) lies before the rollback: the replay is clean, one rollback
    assert from_step >= 50 and int(applied[2]) == from_step - 8
    assert text.count("] action rollback (LossNonFinite): rolled back") == 1
    rolled = f"rolled back from step {from_step} to step 8 (step_00000008)"
    assert f"] alert ActionTaken (info) firing: Run tiny-gpt: {rolled}" in text
    told = "-> Slack (team-slack): [FIRING:1] ActionTaken run=tiny-gpt (info): Run tiny-gpt: "
    assert told + rolled in text
    assert "-> PagerDuty" not in text
    # the summary's facts
    summary = text[text.index("\nWhat happened\n") :]
    assert "step 10: NaN losses from step 10 to 49 (40 steps, as many as LossNonFinite" in summary
    assert f"rollback: {rolled}" in summary
    assert re.search(
        r"  told: Slack \d messages? \([^)]*ActionTaken\), PagerDuty 0 events\n", summary
    )
    assert (
        "  the rollback was announced once (ActionTaken to Slack (team-slack)); nobody was paged "
        "(no PagerDuty event)\n"
    ) in summary
    assert re.search(
        rf"from the start of the bad step \(step 10\): LossNonFinite fired after \d+\.\d s, the "
        rf"rollback was applied after \d+\.\d s \(at step {from_step}, back to step 8\)",
        summary,
    )
    # the demo stops the run once it sees an evaluation from step 30 (every 5 steps); the run
    # trains on for the stop command's round trip
    final = re.search(
        r"with lossguard: validation loss \d\.\d+ at step (\d+), after the rollback", text
    )
    stopped = re.search(r"the demo stopped the run at step (\d+)", summary)
    assert final is not None and stopped is not None, summary
    assert 30 <= int(final[1]) <= int(stopped[1]) and int(final[1]) % 5 == 0
    assert f"report         {out / 'report.html'}" in summary
    assert (out / "report.html").is_file()
    # the inbox: the payloads as sent, valid for Slack; no PagerDuty event at all
    inbox = [json.loads(line) for line in (out / "inbox.jsonl").read_text().splitlines()]
    slack = [m["body"] for m in inbox if m["service"] == "slack"]
    assert [m for m in inbox if m["service"] == "pagerduty"] == []
    assert slack and all(slack_problem(body) is None for body in slack)
    assert all(b["blocks"][0]["type"] == "header" for b in slack)
    announced = [b["text"] for b in slack if "ActionTaken" in b["text"]]
    assert len(announced) == 1 and rolled in announced[0]
    assert announced[0].startswith("[FIRING:1] ActionTaken run=tiny-gpt (info)")
    # the rollback comes before the episode lasts LossSpike's 50 steps; should a slow machine
    # get there first, the warnings are the only other messages the shipped routes send
    others = [b["text"] for b in slack if "ActionTaken" not in b["text"]]
    assert all(
        re.match(r"\[(FIRING:1|RESOLVED)\] (LossSpike|GradNormSpike) run=tiny-gpt \(warning\)", t)
        for t in others
    ), others
    assert not any(b["text"].startswith("[RESOLVED] ActionTaken") for b in slack)  # never
    assert (
        f"{len(slack)} Slack message{'s' if len(slack) > 1 else ''}, 0 PagerDuty events" in summary
    )


def test_options_that_cannot_tell_the_story_are_refused(tmp_path: Path) -> None:
    short = monitor_cli("demo", "--steps", "60", "--out", str(tmp_path / "a"))
    assert short.returncode == 2
    assert short.stderr.strip() == (
        "lossguard-monitor: error: --steps: at least 120 with --fault lr, not 60 (the fault "
        "comes at a third of the run, after the spike detector's 32 steps of history and a "
        "checkpoint)"
    )
    used = tmp_path / "used"
    used.mkdir()
    (used / "x").write_text("")
    taken = monitor_cli("demo", "--fault", "nan", "--out", str(used))
    assert taken.returncode == 2
    assert f"--out: {used} exists and is not an empty folder" in taken.stderr
    bad = monitor_cli("demo", "--out", str(tmp_path / "b"), "--set", "train.lr=-1")
    assert bad.returncode == 2
    assert "train.lr" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize(
    ("plain", "tty", "ci", "expected"),
    [
        (False, True, "", False),
        (False, True, "false", False),
        (False, True, "0", False),
        (True, True, "", True),
        (False, False, "", True),
        (False, True, "true", True),
        (False, True, "1", True),
    ],
)
def test_plain_lines_when_asked_piped_or_in_ci(
    plain: bool, tty: bool, ci: str, expected: bool
) -> None:
    assert use_plain(plain, _Stream(tty), {"CI": ci}) is expected


def test_sparkline_spans_orders_of_magnitude() -> None:
    assert sparkline([2.0, 2.0, 600.0, 20.0]) == "▁▁█▄"
    assert sparkline([float("nan"), 3.0]) == " ▁"
    assert sparkline([]) == ""


def test_real_receivers_when_their_variables_are_set(tmp_path: Path) -> None:
    files = prepare(tmp_path / "demo")
    environ = {SLACK_ENV: "https://hooks.slack.com/services/T/B/x", PAGERDUTY_ENV: "k" * 32}
    receivers = Receivers.from_env(environ)
    assert not receivers.any_local
    write_monitor_config(files, receivers, None)
    config = yaml.safe_load(files.monitor_config.read_text())
    pager = config["notifications"]["receivers"][1]["pagerduty_configs"][0]
    assert "url" not in pager  # PagerDuty's own
    # the routes and timers configs/monitor.yml ships: nothing shortened for the demo
    route = config["notifications"]["route"]
    assert (route["group_wait"], route["group_interval"]) == ("30s", "5m")
    assert route["routes"] == [
        {"receiver": "team-slack", "matchers": ['announce="once"'], "group_by": ["..."]},
        {"receiver": "oncall-pager", "matchers": ['severity="critical"'], "continue": True},
        {"receiver": "team-slack", "matchers": ['severity=~"critical|warning"']},
    ]
    assert receivers.monitor_env(environ, None) == environ
    local = Receivers.from_env({})
    env = local.monitor_env({}, "http://127.0.0.1:9")
    assert env == {SLACK_ENV: "http://127.0.0.1:9/slack", PAGERDUTY_ENV: STAND_IN_ROUTING_KEY}


def test_a_relative_folder_is_watched_where_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the default --out is relative (runs/demo-<time>); the monitor reads its paths from a
    # config inside that folder, so they must not be relative to the shell's folder
    monkeypatch.chdir(tmp_path)
    files = prepare(Path("runs") / "demo-x")
    write_monitor_config(files, Receivers.from_env({}), "http://127.0.0.1:9")
    config = yaml.safe_load(files.monitor_config.read_text())
    here = files.monitor_config.parent
    assert here / config["scrape"]["runs_root"] == tmp_path / "runs" / "demo-x"
    assert (here / config["state"]["path"]).parent.parent == tmp_path / "runs" / "demo-x"


LR_CAUSE = "learning rate 1000x its schedule from step 100 on (2 instead of 0.002 at 100)"
"""What the agent's diagnosis says of the lr fault (tests/agent/test_diagnosis_drills.py)."""


def _action(**result: Any) -> ActionRecord:
    return ActionRecord(
        id="lg-1",
        run_id="tiny-gpt",
        kind="rollback",
        alertname="LossSpikeNotRecovering",
        fingerprint="f",
        labels={},
        origin="rules",
        args={"target": "last_good", "skip_batches": "abandoned", "lr_scale": 1.0},
        state="applied",
        created_at=1091.1,
        updated_at=1091.5,
        attempt=1,
        of_attempts=3,
        result=result,
    )


def _timeline() -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[AlertChange]]:
    events = [
        {"time": 1000.0, "step": 100, "event": "fault", "kind": "lr_scale", "factor": 1000.0},
        {
            "time": 1000.9, "step": 105, "event": "spike", "signal": "loss",
            "diagnosis": {"signal": "loss", "step": 101, "value": 30.87, "zscore": 101.1,
                          "window_mean": 2.43, "causes": [LR_CAUSE]},
        },
        {"time": 1091.5, "step": 1012, "event": "rollback", "from_step": 1012, "to_step": 80},
    ]  # fmt: skip
    records = [
        {"kind": "eval", "step": 50, "time": 995.0, "val_loss": 2.65},
        {"kind": "train", "step": 95, "time": 999.5, "train_loss": 2.5},
        {"kind": "eval", "step": 1000, "time": 1090.0, "val_loss": 601.0},
        {"kind": "train", "step": 1010, "time": 1091.0, "train_loss": 437.0},
        {"kind": "train", "step": 85, "time": 1092.0, "train_loss": 2.45},
        {"kind": "eval", "step": 300, "time": 1115.0, "val_loss": 2.31},
        {"kind": "train", "step": 303, "time": 1115.5, "train_loss": 2.3},
    ]
    alerts = [
        AlertChange(1000.9, "LossSpike", "pending", "warning", "Loss spike"),
        AlertChange(1000.9, "LossSpike", "firing", "warning", "Loss spike"),
        AlertChange(1031.0, "LossSpikeNotRecovering", "pending", "info", "not recovering"),
        AlertChange(1091.0, "LossSpikeNotRecovering", "firing", "info", "not recovering"),
        AlertChange(1091.6, "ActionTaken", "firing", "info", "Run tiny-gpt: rolled back"),
        AlertChange(1093.0, "LossSpikeNotRecovering", "resolved", "info", "not recovering"),
    ]
    return events, records, alerts


ROLLED = (
    "rolled back from step 1012 to step 80 (step_00000080), skipped 932 batches, lr scaled by 1 "
    "(run's lr scale now 1), attempt 1 of 3"
)


def _sent_as_shipped() -> list[Sent]:
    """What the shipped routes send of the timeline: the warning and the announcement, to
    Slack after group_wait (30 s)."""
    return [
        Sent(1031.0, "Slack", "team-slack", "[FIRING:1] LossSpike", True, firing=("LossSpike",)),
        Sent(
            1121.7, "Slack", "team-slack", f"[FIRING:1] ActionTaken: {ROLLED}", True,
            announced=("ActionTaken",), action_ids=("lg-1",),
        ),
    ]  # fmt: skip


def _places(tmp_path: Path, inbox: Path | None = None) -> Places:
    return Places(
        tmp_path, tmp_path / "tiny-gpt", tmp_path / "monitor.yml", tmp_path / "state.db",
        tmp_path / "report.html", None, inbox,
    )  # fmt: skip


def test_the_summary_tells_a_recorded_timeline(tmp_path: Path) -> None:
    events, records, alerts = _timeline()
    action = _action(
        from_step=1012, to_step=80, checkpoint="step_00000080", skipped_batches=932, lr_scale=1.0
    )
    fault = Scenario(300, "lr").describe()
    story = build_story(
        fault, events, records, alerts, [action], _sent_as_shipped(), stopped_by_demo=True
    )
    assert story.recovered
    text = "\n".join(summary_lines(story, _places(tmp_path), []))
    assert "  step 100: the learning rate multiplied by 1000 from step 100 on\n" in text
    assert (
        "At step 101 the loss spiked to 30.87 (101.1 std above its window mean 2.43); probable "
        f"cause: {LR_CAUSE}"
    ) in text
    assert "+0.9 s  step 95     alert LossSpike (warning) firing" in text
    assert "LossSpike (warning) pending" not in text  # it fired at once (for: 0s)
    assert "+31.0 s  step 95     alert LossSpikeNotRecovering (info) pending" in text
    assert "+91.0 s  step 1010   alert LossSpikeNotRecovering (info) firing" in text
    assert "+91.6 s  step 1010   alert ActionTaken (info) firing" in text
    assert "+93.0 s  step 85     alert LossSpikeNotRecovering (info) resolved" in text
    assert f"+91.5 s  step 1010   rollback: {ROLLED}" in text
    assert (
        "  told: Slack 2 messages (LossSpike firing; ActionTaken), PagerDuty 0 events\n"
        "  the rollback was announced once (ActionTaken to Slack (team-slack)); nobody was paged "
        "(no PagerDuty event)\n"
        "  when the demo stopped the monitor: LossSpike still firing, no resolve sent\n"
    ) in text
    assert (
        "from the start of the bad step (step 100): LossSpikeNotRecovering fired after 91.0 s, "
        "the rollback was applied after 91.5 s (at step 1012, back to step 80), training again "
        "after 92.0 s"
    ) in text
    assert "with lossguard: validation loss 2.31 at step 300, after the rollback" in text
    assert "before the fault: validation loss 2.65 at step 50" in text
    assert (
        "without the rollback, the abandoned timeline: train loss 437 at step 1010, validation "
        "loss 601 at step 1000"
    ) in text
    assert "the demo stopped the run at step 303" in text
    assert "inbox" not in text  # every service got the real messages


def test_the_summary_counts_the_inbox_and_tells_pages_and_untold_resolves(
    tmp_path: Path,
) -> None:
    events, records, alerts = _timeline()
    alerts.append(AlertChange(1095.0, "LossSpike", "resolved", "warning", "Loss spike"))
    action = _action(from_step=1012, to_step=80)
    sent = [
        *_sent_as_shipped(),
        Sent(1100.0, "PagerDuty", "oncall-pager", "trigger X", True, firing=("X",)),
        Sent(1200.0, "PagerDuty", "oncall-pager", "resolve X", True, resolved=("X",)),
        Sent(1201.0, "Slack", "team-slack", "[RESOLVED] X", False, resolved=("X",)),
    ]
    story = build_story("x", events, records, alerts, [action], sent, stopped_by_demo=True)
    inbox = [
        Message(1031.0, "slack", {"text": "[FIRING:1] LossSpike"}),
        Message(1100.0, "pagerduty", {"event_action": "trigger", "dedup_key": "lossguard-x"}),
    ]
    text = "\n".join(summary_lines(story, _places(tmp_path, tmp_path / "i"), inbox))
    assert "PagerDuty 2 events (X firing; X resolved); 1 not delivered\n" in text
    assert "nobody was paged" not in text
    assert "; PagerDuty was sent 1 trigger and 1 resolve\n" in text
    assert "when the demo stopped the monitor: LossSpike resolved at +95.0 s, its resolve" in text
    assert "1 Slack message, 1 PagerDuty event\n" in text
    assert "+31.0 s  Slack      [FIRING:1] LossSpike" in text
    assert "+100.0 s  PagerDuty  trigger lossguard-x" in text


def test_a_story_without_a_rollback_says_so(tmp_path: Path) -> None:
    events, records, alerts = _timeline()
    story = build_story("x", events[:2], records[:4], alerts[:2], [], [], stopped_by_demo=True)
    assert not story.recovered and story.recovery is None
    places = Places(tmp_path, tmp_path, tmp_path, tmp_path, None, "no metrics", tmp_path / "i")
    text = "\n".join(summary_lines(story, places, []))
    assert "nothing: no alert asked for an action" in text
    assert "it did not: the run was not rolled back" in text
    assert "told: Slack 0 messages, PagerDuty 0 events\n  nobody was paged" in text
    assert "report         not written: no metrics" in text
    assert "0 Slack messages, 0 PagerDuty events" in text
    assert "empty: nothing was sent" in text


def test_the_live_view_draws_its_panel_on_a_terminal() -> None:
    stream = _Stream(tty=True)
    view = LiveView(stream, "lossguard demo: run tiny-gpt")
    status = RunStatus(step=120, train_loss=2.41, tokens_per_second=20031.0, mfu=0.718)
    status.losses.extend([2.5, 2.4, 30.0])
    view.tell([Happening(1.0, "alert", "alert LossSpike (warning) firing", "bad")], 12.0)
    view.show(status, ["LossSpike (firing)"], 12.5)
    view.close()
    shown = stream.getvalue()
    assert "alert LossSpike (warning) firing" in shown
    for text in ("lossguard demo: run tiny-gpt - 12 s", "120", "2.41", "20,031", "71.8%"):
        assert text in shown
    assert "LossSpike (firing)" in shown and "▁▁█" in shown
