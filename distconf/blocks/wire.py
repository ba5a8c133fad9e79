"""The hidden state between blocks (the wire) and the form a layer takes, for a model of several streams.

A family with ``hidden_state.streams: N`` (`distconf.loader.spec_wire.HiddenStateSpec`) runs layers on
``[batch, seq, N, hidden_size]``; blocks, servers and clients exchange ``[batch, seq, N * hidden_size]``,
each token's streams one after the other. These two reshapes are the only place that layout is written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["to_layer_form", "to_wire_form"]


def to_layer_form(hidden: torch.Tensor, streams: int) -> torch.Tensor:
    """``[..., streams * hidden]`` on the wire as the layer's ``[..., streams, hidden]`` (as it is for 1 stream)."""
    if streams == 1:
        return hidden
    width = hidden.shape[-1]
    if width % streams:
        raise ValueError(f"a hidden state of {width} values per token does not split into {streams} streams")
    return hidden.unflatten(-1, (streams, width // streams))


def to_wire_form(hidden: torch.Tensor, streams: int) -> torch.Tensor:
    """A layer's ``[..., streams, hidden]`` as ``[..., streams * hidden]`` for the wire (as it is for 1 stream)."""
    if streams == 1:
        return hidden
    if hidden.ndim < 2 or hidden.shape[-2] != streams:
        raise ValueError(f"expected a hidden state of {streams} streams [..., {streams}, hidden], got "
                         f"{list(hidden.shape)}")
    return hidden.flatten(-2)
