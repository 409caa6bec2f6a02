"""The supervisor: keeps a training command alive (docs/design.md "Supervisor").

``process`` runs the command in a process group of its own and ``tree`` keeps its whole
process tree in reach, ``resume`` picks the checkpoint a restart resumes from, ``budget`` paces
restarts, ``outcome`` maps an exit to the exit-code contract, ``metrics`` exports what
happened, ``supervisor`` is the loop (node 0 of a multi-node run: ``leader``), ``follower`` the
loop of the other nodes, ``multinode`` the files through which they agree, and ``cli`` is
``lossguard-supervise``. Torch-free.
"""
