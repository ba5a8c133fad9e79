"""`RemoteLayers`: the one module a distributed model has in place of its decoder layers; it runs them all on the
swarm, packing and unpacking what travels beside the hidden state (`distconf.loader.wire_layout.WireLayout`)."""

from __future__ import annotations

from typing import Any

import torch

from distconf.blocks.wire import (
    CarriedSlot,
    ModelInputCapture,
    carried_wire_value,
    split_carried,
    stack_on_wire,
    to_layer_form,
    to_wire_form,
)
from distconf.client.cache import RemoteCache
from distconf.client.ptune import PromptTuning
from distconf.client.sequential import RemoteSequential
from distconf.loader.wire_layout import WireLayout

__all__ = ["RemoteLayers"]


class RemoteLayers(torch.nn.Module):
    """Stands in for the whole decoder-layer list: one call runs every block on the swarm.

    Inside ``generate`` (a `RemoteCache` among the arguments) it steps the inference
    session; otherwise it runs a differentiable forward through the swarm, with the
    model's trained prompts (if any) in front and cut off again after the last block.
    It returns what the model's layer loop expects (a tensor, or a tuple holding it and
    ``tuple_padding`` Nones: ``returns_tuple``, found at load by
    `distconf.client.hf_generation.layer_output_is_tuple`, which sets ``probing`` to make the
    stand-in pass hidden states through). A model whose layers take ``streams`` streams
    (``hidden_state.streams``) hands it ``[batch, seq, streams, hidden]`` (``[streams, batch, seq, hidden]`` with
    ``stream_axis`` 0), sent flattened
    (`distconf.blocks.wire`); the model's own forward expands and collapses the streams. K/V later layers reuse
    (``kv_cache.shared``, ``shared_width`` values per token) go last, zeros the blocks fill. A value the model's
    loop carries from layer to layer (``hidden_state.carried``: ``carried`` holds each one's argument, its
    `CarriedSlot` and its position among the layer's arguments) goes on the wire after the hidden state
    (zeros where the model hands None, token ids as digits) and comes back at its index of the returned tuple;
    one a model method computes for every layer (``computed_by``) goes as that method returned it in the model's
    forward (``capture``), all layers' parts, and the blocks hand it on; a stack the loop grows (``grows``) goes as
    the model's loop has it (zeros for the entries not made yet) and comes back whole in ``stacks``
    (`hand_final_stacks` gives it to the module reading it).
    """

    def __init__(self, remote: RemoteSequential, attributes: dict[str, Any], wire: WireLayout,
                 carried: tuple[tuple[CarriedSlot, int | None], ...] = (),
                 capture: ModelInputCapture | None = None) -> None:
        super().__init__()
        self.remote = remote
        self.wire = wire
        self.carried = carried
        self.__dict__["capture"] = capture
        self.stacks: dict[str, torch.Tensor] = {}
        self.returns_tuple = False
        self.tuple_padding = 0
        self.probing = False
        self.__dict__["prompts"] = None  # the model owns the prompts; a reference here is not a submodule
        for name, value in attributes.items():
            if name not in vars(self) and not hasattr(type(self), name):  # never the stand-in's own
                setattr(self, name, value)

    @property
    def streams(self) -> int:
        """Streams of ``hidden_size`` values the model's layers hand each other."""
        return self.wire.streams

    @property
    def stream_axis(self) -> int:
        """Where the streams sit in the layers' hidden state (2 or 0)."""
        return self.wire.stream_axis

    def use_prompts(self, prompts: PromptTuning | None) -> None:
        """Run with these trained prompts (held by the model, not registered here)."""
        self.__dict__["prompts"] = prompts

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """Run all blocks on ``hidden_states`` (``[batch, seq, hidden]``, or ``[batch, seq, streams, hidden]``
        / ``[streams, batch, seq, hidden]``)."""
        layout = self.wire
        wire = to_wire_form(hidden_states, layout.streams, layout.stream_axis)
        if self.carried:
            wire = torch.cat([wire, *self._carried_inputs(wire, args, kwargs)], dim=-1)
        # kv_cache.shared: nothing stored yet; the blocks fill and read it
        wire = layout.join_shared(wire, {s.key: wire.new_zeros(*wire.shape[:-1], s.width) for s in layout.shared})
        if self.probing:
            out = wire
        else:
            cache = next((v for v in (*args, *kwargs.values()) if isinstance(v, RemoteCache)), None)
            out = cache.step(wire) if cache is not None else self._forward(wire)
        out, _ = layout.split_shared(out)
        out, carried = split_carried(out, tuple(slot for slot, _ in self.carried))
        self.stacks = {slot.argument: slot.stack(carried[slot.argument]) for slot, _ in self.carried
                       if slot.every is not None}
        out = to_layer_form(out, layout.streams, layout.stream_axis)
        if not self.returns_tuple:
            return out
        result: list[Any] = [out, *[None] * self.tuple_padding]
        for (slot, _), value in zip(self.carried, carried.values(), strict=True):
            if slot.output_index is None:  # not returned by the layers (computed by the model, the ids, a stack)
                continue
            result += [None] * (slot.output_index + 1 - len(result))
            result[slot.output_index] = value
        return tuple(result)

    def _carried_inputs(self, wire: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """Each carried value as the model's loop hands it (by keyword or position), zeros for None; a
        ``computed_by`` value as its method returned it."""
        values = []
        for slot, position in self.carried:
            capture: ModelInputCapture | None = self.__dict__["capture"]
            if slot.computed_by is not None and capture is not None:
                values.append(capture.value(slot, wire).to(wire.dtype))
                continue
            value = kwargs.get(slot.argument)
            if value is None and position is not None and len(args) > position:
                value = args[position]
            if slot.every is not None:  # the stack so far (none before the first block)
                values.append(stack_on_wire(value, slot, wire))
                continue
            values.append(carried_wire_value(slot, value, wire))
        return values

    def _forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        prompts: PromptTuning | None = self.__dict__["prompts"]
        if prompts is None:
            return self.remote(hidden_states)
        prefix = prompts.input_prompts(hidden_states.shape[0], hidden_states.dtype).to(hidden_states.device)
        deep = prompts.deep_prompts(hidden_states.dtype)
        out = self.remote(torch.cat([prefix, hidden_states], dim=1), deep)
        return out[:, prompts.pre_seq_len:]
