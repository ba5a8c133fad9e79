"""The hidden state between blocks (the wire) and the form a layer takes, for a model of several streams.

A family with ``hidden_state.streams: N`` (`distconf.loader.spec_wire.HiddenStateSpec`) runs layers on
``[batch, seq, N, hidden_size]``; blocks, servers and clients exchange ``[batch, seq, N * hidden_size]``,
each token's streams one after the other. These two reshapes are the only place that layout is written.
`carried_stand_ins` gives a layer what the block passes for a value the model carries from the layer
before (``block.call.carried_arguments``), which the wire does not hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["to_layer_form", "to_wire_form", "carried_stand_ins"]


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


def carried_stand_ins(block_cls: type, config: Any, hidden: torch.Tensor, past: int) -> dict[str, Any]:
    """``{keyword: value}`` of the family's ``block.call.carried_arguments`` for a step of ``hidden`` after ``past``
    cached tokens: every key's index for each query (``all_keys``); a step past ``exact_up_to`` keys is refused."""
    import torch

    from distconf.blocks.layer_settings import evaluate_field

    carried = block_cls.family_spec.block.call.carried_arguments  # type: ignore[attr-defined]
    if not carried:
        return {}
    batch, seq = hidden.shape[:2]
    keys = past + seq
    values: dict[str, Any] = {}
    for name, argument in carried.items():
        limit = argument.exact_up_to
        if not isinstance(limit, int):
            limit = evaluate_field(block_cls, ("block", "call", "carried_arguments", name, "exact_up_to"), limit,
                                   config)
        if keys > limit:
            raise ValueError(f"{keys} tokens: the blocks of {block_cls.family_spec.family!r} pass every key "  # type: ignore[attr-defined]
                             f"for {name}, which equals the model's value only up to {limit} keys "
                             "(block.call.carried_arguments)")
        values[name] = torch.arange(keys, dtype=torch.int32, device=hidden.device).expand(batch, seq, keys)
    return values
