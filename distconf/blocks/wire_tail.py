"""One rule for the wire's tail: values per token appended after the hidden state, split off by their widths."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["split_tail"]


def split_tail(wire: torch.Tensor, widths: Sequence[int], what: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``wire`` without its last ``sum(widths)`` values per token, and those values cut into ``widths``.

    :param what: what the tail holds, for the error when the wire is too narrow (e.g. "carried values").
    :raises ValueError: the wire has no room for the tail and a hidden state.
    """
    extra = sum(widths)
    if wire.shape[-1] <= extra:
        raise ValueError(f"a wire of {wire.shape[-1]} values per token cannot hold {extra} {what} and the hidden "
                         "state")
    rest, *parts = wire.split([wire.shape[-1] - extra, *widths], dim=-1)
    return rest, parts
