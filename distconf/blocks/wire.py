"""The values that travel beside the hidden state between blocks, as tensors: what the blocks and the client do
with the parts of the wire `distconf.loader.wire_layout.WireLayout` lays out (its order and widths are there).

A family with ``hidden_state.streams: N`` runs layers on ``[batch, seq, N, hidden_size]`` (or ``[N, batch, seq,
hidden_size]``: ``stream_axis: 0``); the wire holds ``[batch, seq, N * hidden_size]``
(`distconf.blocks.stream_form`, re-exported here). Values the model carries from layer to layer
(``hidden_state.carried``) follow the hidden state: `split_carried` and `join_carried`; token ids carried to every
layer (``initial: token_ids``) travel as base-256 digits (`token_id_digits`), exact in any wire dtype;
`ModelInputCapture` keeps, where the model's own forward runs (the client, check's reference), the values a model
method computes for every layer; a stack the loop grows (``grows``) is carried at its full size
(`CarriedSlot.stack` reads it, `stack_on_wire` writes it, `grow_stack` appends to it).
`carried_stand_ins` gives a layer what the block passes for a value the model carries from the layer
before (``block.call.carried_arguments``), which the wire does not hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distconf.blocks.stream_form import to_layer_form, to_wire_form
from distconf.loader.wire_layout import CarriedSlot, split_tail, wire_layout

if TYPE_CHECKING:
    import torch

__all__ = ["to_layer_form", "to_wire_form", "carried_stand_ins", "CarriedSlot", "carried_layout", "carried_wire_value",
           "split_carried", "join_carried", "ModelInputCapture", "token_id_digits", "token_ids_of", "grow_stack",
           "stack_on_wire"]


_DIGIT = 256  # digits 0..255 are exact in bf16 (8 significant bits), so ids survive any wire dtype


def carried_layout(config: Any) -> tuple[CarriedSlot, ...]:
    """The `CarriedSlot` of each value ``config``'s family carries on the wire, in wire order."""
    return wire_layout(config).carried


def token_id_digits(ids: torch.Tensor, digits: int, dtype: torch.dtype) -> torch.Tensor:
    """Token ids ``[batch, seq]`` as ``[batch, seq, digits]`` base-256 digits (most significant first)."""
    import torch

    ids = ids.long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= _DIGIT ** digits):
        raise ValueError(f"token ids {int(ids.min())}..{int(ids.max())} do not fit in {digits} base-{_DIGIT} digits "
                         "(hidden_state.carried width)")
    powers = _DIGIT ** torch.arange(digits - 1, -1, -1, device=ids.device)
    return (ids.unsqueeze(-1) // powers % _DIGIT).to(dtype)


def token_ids_of(digits: torch.Tensor) -> torch.Tensor:
    """The token ids ``[batch, seq]`` (int64) of ``[batch, seq, digits]`` base-256 digits."""
    import torch

    powers = _DIGIT ** torch.arange(digits.shape[-1] - 1, -1, -1, device=digits.device)
    return (digits.float().round().long() * powers).sum(-1)


def carried_wire_value(slot: CarriedSlot, value: Any, like: torch.Tensor) -> torch.Tensor:
    """``value`` as the model hands it to a layer, as ``slot``'s part of a wire like ``like`` (zeros for None; for
    ``initial: hidden``, the hidden state at the front of ``like``)."""
    if slot.token_ids:
        if value is None:
            raise ValueError(f"the layers need the token ids as {slot.argument}, which the model did not pass")
        return token_id_digits(value, slot.width, like.dtype).to(like.device).expand(*like.shape[:-1], slot.width)
    if value is None and slot.initial == "hidden":  # the embeddings: the first layer's own input
        value = like[..., :slot.width]
    if value is None:
        return like.new_zeros(*like.shape[:-1], slot.width)
    return value.to(like.dtype).expand(*like.shape[:-1], slot.width)


def split_carried(wire: torch.Tensor, layout: tuple[CarriedSlot, ...],
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The hidden-state part of ``wire`` and ``{argument: value}`` of the carried values after it (as on the
    wire: every layer's part of a ``computed_by`` value; token ids as ``[batch, seq]`` int64)."""
    if not layout:
        return wire, {}
    hidden, parts = split_tail(wire, [slot.width for slot in layout], "carried values")
    return hidden, {slot.argument: token_ids_of(part) if slot.token_ids else part
                    for slot, part in zip(layout, parts, strict=True)}


def stack_on_wire(stack: torch.Tensor | None, slot: CarriedSlot, like: torch.Tensor) -> torch.Tensor:
    """A stack ``[..., entries, entry]`` as the wire holds it: flattened, the entries not made yet zeros."""
    import torch

    flat = like.new_zeros(*like.shape[:-1], slot.width)
    if stack is None or stack.shape[-2] == 0:
        return flat
    if stack.shape[-1] != slot.entry or stack.shape[-2] * slot.entry > slot.width:  # type: ignore[operator]
        raise ValueError(f"{slot.argument} is a stack of {list(stack.shape)}, not at most "
                         f"{slot.width // slot.entry} entries of {slot.entry} values")  # type: ignore[operator]
    values = stack.to(like.dtype).flatten(-2)
    return torch.cat([values.expand(*like.shape[:-1], values.shape[-1]), flat[..., values.shape[-1]:]], dim=-1)


def grow_stack(part: torch.Tensor, slot: CarriedSlot, layer_idx: int, layer_input: torch.Tensor) -> torch.Tensor:
    """The stack after layer ``layer_idx``: the loop appends the layer's input after every ``every`` layers."""
    import torch

    if layer_idx % slot.every:  # type: ignore[operator]
        return part
    start = slot.entries_before(layer_idx) * slot.entry  # type: ignore[operator]
    if layer_input.shape[-1] != slot.entry or start + slot.entry > slot.width:  # type: ignore[operator]
        raise ValueError(f"layer {layer_idx} cannot append its input of {layer_input.shape[-1]} values to "
                         f"{slot.argument} ({slot.width // slot.entry} entries of {slot.entry})")  # type: ignore[operator]
    return torch.cat([part[..., :start], layer_input.to(part.dtype), part[..., start + slot.entry:]], dim=-1)


def join_carried(hidden: torch.Tensor, output: Any, layout: tuple[CarriedSlot, ...],
                 inputs: dict[str, torch.Tensor] | None = None, layer_idx: int = 0,
                 layer_input: torch.Tensor | None = None) -> torch.Tensor:
    """The wire of a layer's ``hidden`` (wire form) and the carried values: at their indices of its ``output``, or
    as the block got them (``inputs``, `split_carried`'s) for a value the layers hand on unchanged; a growing stack is
    the one the layer got with ``layer_input`` appended as the loop does."""
    import torch

    if not layout:
        return hidden
    parts = []
    for slot in layout:
        if slot.every is not None:
            if inputs is None or layer_input is None:
                raise ValueError(f"{slot.argument}: a growing stack needs the layer's input and the stack it got")
            parts.append(grow_stack(inputs[slot.argument], slot, layer_idx, layer_input))
            continue
        if slot.output_index is None:  # handed on unchanged: a computed_by value, the token ids or the embeddings
            value = (inputs or {}).get(slot.argument)
            if value is None:
                what = slot.computed_by or ("token ids" if slot.token_ids else "the embeddings")
                raise ValueError(f"no {slot.argument} ({what}) came with the hidden state")
            parts.append(carried_wire_value(slot, value, hidden))
            continue
        index = slot.output_index
        value = output[index] if isinstance(output, (tuple, list)) and len(output) > index else None
        if not isinstance(value, torch.Tensor) or value.shape[-1] != slot.width:
            shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"the layer's output {index} ({slot.argument}, carried to the next layer) is "
                             f"{shape}, not {slot.width} values per token")
        parts.append(value.to(hidden.dtype).expand(*hidden.shape[:-1], slot.width))
    return torch.cat([hidden, *parts], dim=-1)


class ModelInputCapture:
    """Keeps what the methods ``hidden_state.carried[].computed_by`` names return when the model's forward calls
    them (the client's model and check's reference run the model's own forward): each one's latest result, as
    the wire holds it (``[batch, seq, layers * width]``).
    """

    def __init__(self, model: Any, layout: tuple[CarriedSlot, ...]) -> None:
        """Wrap, on ``model`` (the causal LM) itself, each method ``layout`` computes a value by."""
        self.values: dict[str, torch.Tensor] = {}
        for slot in layout:
            if slot.computed_by is not None:
                self._wrap(model, slot)

    def _wrap(self, model: Any, slot: CarriedSlot) -> None:
        owner_name, _, method_name = slot.computed_by.rpartition(".")  # type: ignore[union-attr]
        try:
            owner = model.get_submodule(owner_name) if owner_name else model
            method = getattr(owner, method_name)
        except AttributeError:
            raise ValueError(f"{type(model).__name__} has no method {slot.computed_by!r}") from None
        if not callable(method):
            raise ValueError(f"{slot.computed_by!r} of {type(model).__name__} is not a method")

        def captured(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            self.values[slot.argument] = result.flatten(-2) if result.ndim > 3 else result
            return result
        setattr(owner, method_name, captured)

    def value(self, slot: CarriedSlot, wire: torch.Tensor) -> torch.Tensor:
        """``slot``'s value of the step whose hidden state is ``wire`` (the latest result of its method)."""
        value = self.values.get(slot.argument)
        if value is None or value.shape[-1] != slot.width or value.shape[:-1] != wire.shape[:-1]:
            shape = "nothing" if value is None else list(value.shape)
            raise ValueError(f"{slot.computed_by} gave {shape} for {slot.argument}, not {slot.width} values for "
                             f"each of the {list(wire.shape[:-1])} tokens (hidden_state.carried)")
        return value


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
