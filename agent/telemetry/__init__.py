"""Telemetry, the sensors: per-step detection on the device, the metric registry and exporter,
hardware and FP8 readings, gradient diagnostics, and the sinks a record goes to (metrics log,
W&B, progress display)."""
