"""The vocabulary of ``events.jsonl``, the audit trail: the ``event`` of each record
(docs/design.md "Run directory"). Writers and readers name them from here."""

# the agent: the run
START = "start"
CLOSE = "close"
SIGNAL = "signal"
OVERWRITTEN = "overwritten"
RESUMED = "resumed"
FAULT = "fault"  # an injected fault (the built-in trainer's faults:)
# the agent: checkpoints and control
CHECKPOINT = "checkpoint"
CHECKPOINT_FAILED = "checkpoint_failed"
SUPERSEDED = "superseded"
ROLLBACK = "rollback"
SNAPSHOTS_OFF = "snapshots_off"  # in-memory snapshots turned off for the memory budget
RESHARDED = "resharded"  # a dcp checkpoint loaded at another world size
COMMAND = "command"
# the agent: detections
SPIKE = "spike"
NONFINITE = "nonfinite"
DETECTIONS = (SPIKE, NONFINITE)
LEVEL_SHIFT = "level_shift"  # a loss episode taken as a new level, and ended
EXPECTED_CHANGE = "expected_change"  # the detectors re-based on an operator's word
# the agent under a framework (agent/integrations/)
FRAMEWORK_CHECKPOINT = "framework_checkpoint"
CONTINUED = "continued"
# the supervisor (its records carry "source": "supervisor")
SUPERVISOR_START = "supervisor_start"
CRASH = "crash"
RESTART = "restart"
CRASH_LOOP = "crash_loop"
SUPERVISOR_EXIT = "supervisor_exit"
