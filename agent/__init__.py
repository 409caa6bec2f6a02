"""lossguard training agent: runs or instruments a PyTorch training loop and exposes what it sees.

Importing this package does not import torch; ``Guard``, ``SkippableDataLoader`` and the
trainer load it when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lossguard.common import __version__

if TYPE_CHECKING:
    from lossguard.agent.guard import Guard
    from lossguard.agent.loader import SkippableDataLoader

__all__ = ["Guard", "SkippableDataLoader", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Guard":
        from lossguard.agent.guard import Guard

        return Guard
    if name == "SkippableDataLoader":
        from lossguard.agent.loader import SkippableDataLoader

        return SkippableDataLoader
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
