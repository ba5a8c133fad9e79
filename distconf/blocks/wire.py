"""The hidden state between blocks (the wire) and the form a layer takes, for a model of several streams.

A family with ``hidden_state.streams: N`` (`distconf.loader.spec_wire.HiddenStateSpec`) runs layers on
``[batch, seq, N, hidden_size]``; blocks, servers and clients exchange ``[batch, seq, N * hidden_size]``,
each token's streams one after the other. These two reshapes are the only place that layout is written.
Values the model carries from layer to layer (``hidden_state.carried``) follow the hidden state on the wire;
`split_carried` and `join_carried` are the only place that layout is written.
`carried_stand_ins` gives a layer what the block passes for a value the model carries from the layer
before (``block.call.carried_arguments``), which the wire does not hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["to_layer_form", "to_wire_form", "carried_stand_ins", "carried_layout", "split_carried", "join_carried"]


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


def carried_layout(config: Any) -> tuple[tuple[str, int, int], ...]:
    """``(argument, width, output_index)`` of each value ``config``'s family carries on the wire, in wire order."""
    from distconf.loader.spec_wire import carried_widths

    hidden_state = getattr(getattr(type(config), "family_spec", None), "hidden_state", None)
    if hidden_state is None or not hidden_state.carried:
        return ()
    return tuple((stream.argument, width, stream.output_index)
                 for stream, width in zip(hidden_state.carried, carried_widths(config), strict=True))


def split_carried(wire: torch.Tensor, layout: tuple[tuple[str, int, int], ...],
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The hidden-state part of ``wire`` and ``{argument: value}`` of the carried values after it."""
    if not layout:
        return wire, {}
    extra = sum(width for _, width, _ in layout)
    if wire.shape[-1] <= extra:
        raise ValueError(f"a wire of {wire.shape[-1]} values per token cannot hold {extra} carried values and "
                         "the hidden state")
    hidden, *parts = wire.split([wire.shape[-1] - extra, *(width for _, width, _ in layout)], dim=-1)
    return hidden, {name: part for (name, _, _), part in zip(layout, parts, strict=True)}


def join_carried(hidden: torch.Tensor, output: Any, layout: tuple[tuple[str, int, int], ...]) -> torch.Tensor:
    """The wire of a layer's ``hidden`` (wire form) and the carried values at their indices of its ``output``."""
    import torch

    if not layout:
        return hidden
    parts = []
    for name, width, index in layout:
        value = output[index] if isinstance(output, (tuple, list)) and len(output) > index else None
        if not isinstance(value, torch.Tensor) or value.shape[-1] != width:
            shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"the layer's output {index} ({name}, carried to the next layer) is {shape}, not "
                             f"{width} values per token")
        parts.append(value.to(hidden.dtype).expand(*hidden.shape[:-1], width))
    return torch.cat([hidden, *parts], dim=-1)


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
