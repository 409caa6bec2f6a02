"""``lossguard-monitor demo``: the whole story in one command. A tiny GPT trains on CPU with an
injected divergence, the monitor (default rules, actions and notification routes) catches it,
rolls the run back, announces that once to the team channel (no page) and watches it recover;
a live view shows it happen and a summary tells it in words.
Torch-free: the agent runs as a subprocess."""
