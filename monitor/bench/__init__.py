"""The monitor's benchmark beside Prometheus: the default rules over N simulated agents
(:mod:`.fleet`), scraped and evaluated on the daemon's schedule (:mod:`.monitor`), then the same
agents, rules and interval under Debian's Prometheus (:mod:`.prometheus`), back to back
(:mod:`.compare`).

``python -m lossguard.monitor.bench --agents 256 512 --seconds 20 --interval 1s``
"""
