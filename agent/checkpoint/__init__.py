"""The checkpoint store: atomic, verified, retained checkpoints under ``run_dir/checkpoints``.

``meta`` names checkpoints and reads and validates ``meta.json`` (torch-free), ``targets``
resolves ``latest``, ``best``, ``last_good`` or a step (torch-free), ``files`` writes durably,
``snapshot`` copies state off the device for async saves and ``store`` holds ``CheckpointStore``,
whose docstring tells the on-disk layout and how it survives a crash (``reader``: how it finds
and loads them). ``formats`` is the
interface a run's checkpoints go through (``torch_format``, ``sharded_format`` on
``dcp_format``); ``snapshots`` keeps copies in host memory; ``cadence`` says when.
"""
