"""The supervisor: keeps a training command alive on its host (DESIGN.md "Supervisor").

``process`` runs the command in a process group of its own, ``resume`` picks the checkpoint a
restart resumes from, ``budget`` paces restarts, ``metrics`` exports what happened,
``supervisor`` is the loop and ``cli`` is ``lossguard-supervise``. Torch-free.
"""
