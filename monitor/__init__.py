"""lossguard monitor: scrapes agents or queries Prometheus, evaluates rules, notifies and acts.

The monitor never imports torch.
"""

__version__ = "0.1.0"
