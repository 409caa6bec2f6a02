"""``lossguard-ctl``, the operator's command line to a run: torch-free, it imports only
``lossguard.common``."""
