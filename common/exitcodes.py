"""The exit-code contract of ``lossguard-agent run``, of runs that use ``Guard`` (through
``Guard.exit_code()``) and of ``lossguard-supervise``: one code per outcome, chosen with the
conventions schedulers already act on (docs/exit-codes.md).

| outcome     | code | a scheduler should                                               |
|-------------|------|------------------------------------------------------------------|
| completed   | 0    | finish the job                                                   |
| stopped     | 3    | finish the job, not retry it (stopped on request, state saved)   |
| preempted   | 138  | requeue it without counting a failure (state saved on SIGUSR1)   |
| retryable   | 75   | retry it, counting a failure (a crash; a coordination time-out)  |
| config      | 2    | fail the job: the command or its configuration is wrong          |
| permanent   | 1    | fail the job: the supervisor gave up a crash loop; cannot resume |

138 is 128 + SIGUSR1, the signal Slurm's ``--signal=B:USR1@…`` sends before a time limit; the
Kubeflow-derived operators treat it as "user-defined retryable". 75 is ``EX_TEMPFAIL`` of
sysexits.h ("try again later"). 2 (usage) and 1 are in the operators' permanent set (1, 2,
126-128, 139). 3 is a code of ours, outside both sets, so a stop is never taken for a crash.
"""

from __future__ import annotations

from typing import Literal

Outcome = Literal["completed", "stopped", "preempted", "retryable", "config", "permanent"]

EXIT_CODES: dict[Outcome, int] = {
    "completed": 0,
    "stopped": 3,
    "preempted": 138,
    "retryable": 75,
    "config": 2,
    "permanent": 1,
}
OUTCOMES: dict[int, Outcome] = {code: outcome for outcome, code in EXIT_CODES.items()}

EXIT_COMPLETED = EXIT_CODES["completed"]
EXIT_STOPPED = EXIT_CODES["stopped"]
EXIT_PREEMPTED = EXIT_CODES["preempted"]
EXIT_RETRYABLE = EXIT_CODES["retryable"]
EXIT_CONFIG = EXIT_CODES["config"]
EXIT_PERMANENT = EXIT_CODES["permanent"]

ENDS_THE_RUN: frozenset[int] = frozenset(
    (EXIT_COMPLETED, EXIT_STOPPED, EXIT_PREEMPTED, EXIT_CONFIG)
)
"""Codes of a training command that a supervisor does not restart: the run ended on purpose
(or cannot start). Anything else is a crash."""
