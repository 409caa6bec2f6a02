"""The names of what a run directory holds (docs/design.md "Run directory"); every module that
opens one of them names it from here."""

CONFIG_FILE = "config.yaml"  # the resolved config
ENV_FILE = "env.json"  # versions, host, device, argv
METRICS_LOG = "metrics.jsonl"
EVENTS_LOG = "events.jsonl"  # the audit trail
AGENT_FILE = "agent.json"  # how a monitor finds the run
SUPERVISOR_FILE = "supervisor.json"
SUPERVISOR_SOCKET = "supervisor.sock"
SOCKET_NAME = "control.sock"  # the agent's control socket
CHECKPOINT_DIR = "checkpoints"
COORDINATION_DIR = "supervisors"  # the supervisors of a multi-node run agree through it
