"""lossguard monitor: scrapes agents or queries Prometheus, evaluates rules, notifies and acts.

The monitor never imports torch.
"""

from lossguard.common import __version__

__all__ = ["__version__"]
