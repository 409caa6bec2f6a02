"""Every contract between the agent, the monitor and the supervisor, torch-free and importing
nothing else of lossguard: config plumbing (``config``), CLI and logging helpers, the metric
catalogue and its registry binding, the run directory on disk (``rundir``: its files, the
JSON-lines logs and their vocabulary, ``agent.json``, ``supervisor.json``, the checkpoint
format) and control protocol v1 (``control``: protocol, client, server).
"""

__version__ = "0.1.0"
