"""The run directory on disk (docs/design.md "Run directory"): its file names, atomic writes, the
JSON-lines logs, ``agent.json``, ``supervisor.json`` and the checkpoint format. Torch-free."""
