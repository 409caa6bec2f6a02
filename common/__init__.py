"""What the agent and the monitor share, torch-free: config plumbing, CLI and logging helpers,
the ``agent.json`` schema, the metric catalogue, the control protocol and its client.
"""

__version__ = "0.1.0"
