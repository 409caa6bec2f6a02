"""lossguard's Grafana dashboards as code: ``python -m dashboards.build``."""
