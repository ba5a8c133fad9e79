"""The two reshapes between the wire's ``[batch, seq, streams * hidden]`` and a layer's several streams.

``[batch, seq, streams, hidden]`` (``hidden_state.stream_axis`` 2) or ``[streams, batch, seq, hidden]`` (0); the
only place that layout is written (`distconf.blocks.wire` re-exports them with the rest of the wire's layout).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["to_layer_form", "to_wire_form"]


def to_layer_form(hidden: torch.Tensor, streams: int, axis: int = 2) -> torch.Tensor:
    """``[..., streams * hidden]`` on the wire as the layer's ``[..., streams, hidden]`` (``axis`` 2), or
    ``[streams, ...,  hidden]`` (``axis`` 0: ``hidden_state.stream_axis``); as it is for 1 stream."""
    if streams == 1:
        return hidden
    width = hidden.shape[-1]
    if width % streams:
        raise ValueError(f"a hidden state of {width} values per token does not split into {streams} streams")
    layer = hidden.unflatten(-1, (streams, width // streams))
    return layer.movedim(-2, 0) if axis == 0 else layer


def to_wire_form(hidden: torch.Tensor, streams: int, axis: int = 2) -> torch.Tensor:
    """A layer's ``[..., streams, hidden]`` (``axis`` 2) or ``[streams, ..., hidden]`` (``axis`` 0) as
    ``[..., streams * hidden]`` for the wire (as it is for 1 stream)."""
    if streams == 1:
        return hidden
    at = 0 if axis == 0 else -2
    if hidden.ndim < 2 or hidden.shape[at] != streams:
        form = f"[{streams}, ..., hidden]" if axis == 0 else f"[..., {streams}, hidden]"
        raise ValueError(f"expected a hidden state of {streams} streams {form}, got {list(hidden.shape)}")
    return (hidden.movedim(0, -2) if axis == 0 else hidden).flatten(-2)
