"""The one place that calls torch's private operators, checked against the torch they were written for.

`weight_int8pack_mm` (``torch._weight_int8pack_mm``, the int8 weight-only CPU kernel `distconf.blocks.quant`
uses) is an ATen operator without a public Python name; its signature has held since torch 2.3. The range is
pyproject's (`SUPPORTED_TORCH`); another torch is refused with what to install, at first use.
"""

from __future__ import annotations

import functools
from typing import Any

from distconf.versions import declared_range, version_in_range

__all__ = ["SUPPORTED_TORCH", "UnsupportedTorchError", "weight_int8pack_mm"]

SUPPORTED_TORCH = declared_range("torch")
"""The torch versions distconf was written for (pyproject's requirement; tested with 2.13.0)."""


class UnsupportedTorchError(ImportError):
    """The installed torch is outside `SUPPORTED_TORCH`."""


@functools.cache
def _checked_torch() -> Any:
    import torch

    version = torch.__version__.split("+")[0]
    if not version_in_range(version, SUPPORTED_TORCH):
        raise UnsupportedTorchError(f"distconf needs torch{SUPPORTED_TORCH}; torch {torch.__version__} is installed")
    return torch


def weight_int8pack_mm(x: Any, weight: Any, scales: Any) -> Any:
    """``x @ weight.T * scales`` with ``weight`` int8 ``[out, in]``, ``x`` and ``scales`` bf16/fp16 (CPU kernel)."""
    return _checked_torch()._weight_int8pack_mm(x, weight, scales)
