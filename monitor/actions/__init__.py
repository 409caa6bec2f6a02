"""Actions: what the monitor does about a firing alert that carries an ``action`` label (roll
back, pause, stop, save a checkpoint), exactly once per alert instance, through the agent's
control socket."""
