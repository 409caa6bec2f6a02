"""Counting the calls that read a tensor to the host (a device sync) during a test."""

from __future__ import annotations

from typing import Any

import pytest
import torch

HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")


def count_host_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """From now on, record every call that reads a tensor to the host (a device sync)."""
    reads: list[str] = []
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def read(self: torch.Tensor, *args: Any, _original=original, _name=name, **kw: Any) -> Any:
            reads.append(_name)
            return _original(self, *args, **kw)

        monkeypatch.setattr(torch.Tensor, name, read)
    return reads
