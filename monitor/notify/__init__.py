"""Notifications: alert transitions become grouped, routed, deduplicated messages, written to an
outbox before delivery and delivered with retries to Slack, PagerDuty, webhooks and the log."""
