"""The rules engine: Prometheus-format rule files, their evaluation schedule, the alert
lifecycle (pending, firing, resolved), Go templates for annotations, and promtool-style tests."""
