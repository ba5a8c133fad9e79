"""The wire: what each token carries between blocks, in order, with every part's width (`WireLayout`).

Petals 2.x blocks exchange one ``[batch, seq, width]`` tensor. distconf's wire holds, per token:

1. the hidden state: ``streams * hidden_size`` values (``hidden_state.streams``; each token's streams one after
   the other, `distconf.blocks.stream_form`);
2. the values the model carries from layer to layer (``hidden_state.carried``, `CarriedSlot`, in the file's
   order): a ``computed_by`` value for every layer, token ids as base-256 digits, a growing stack at its largest;
3. the K/V later layers reuse (``kv_cache.shared``, `distconf.loader.kv_sharing.SharedSlot`, in store order);
4. a looped layer stack's input (``block.layer_stack``), as wide as the hidden state.

`wire_layout` is the one home of that order and of the widths: the client packs its model's values with it, the
blocks split and join their wire with it, and the config's ``wire_width`` (what servers size, check and plan
with) is its `WireLayout.width`. Nothing here imports torch; `WireLayout`'s methods work on tensors given to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from distconf.loader.kv_sharing import SharedSlot, shared_kv_slots
from distconf.loader.spec_wire import carried_widths, loops_layers, stack_entries, stream_axis_of, streams_of

if TYPE_CHECKING:
    import torch

__all__ = ["CarriedSlot", "WireLayout", "split_tail", "wire_layout", "wire_width_of"]


class CarriedSlot(NamedTuple):
    """One value of ``hidden_state.carried`` as the wire holds it (after the hidden state, in this order)."""

    argument: str
    """The layer's argument the value is passed as."""
    width: int
    """Values per token on the wire (every layer's part of a ``computed_by`` value; digits of token ids)."""
    output_index: int | None
    """Index of the value in a layer's output tuple (None: handed on unchanged: a ``computed_by`` value, the token
    ids or the embeddings)."""
    computed_by: str | None
    """Dotted name of the causal LM's method returning every layer's part (None: not computed by the model)."""
    layers: int
    """Layers whose parts the wire holds (1 unless ``computed_by``)."""
    initial: str = "zeros"
    """What the first layer gets (``hidden_state.carried[].initial``): zeros standing for the model's None, the
    model's input ids (``token_ids``, sent as ``width`` base-256 digits per token) or the embeddings (``hidden``)."""
    every: int | None = None
    """For a stack the loop grows (``grows``): the layers apart its entries are appended (None: no stack)."""
    entry: int | None = None
    """For a stack the loop grows: values per token of each entry."""

    @property
    def token_ids(self) -> bool:
        """Whether the value is the model's input ids (sent as base-256 digits)."""
        return self.initial == "token_ids"

    def layer_part(self, part: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """What layer ``layer_idx`` gets of this value's ``part`` of the wire (its own part, for ``computed_by``;
        the entries made before it, for a growing stack)."""
        if self.every is not None:
            return self.stack(part, layer_idx)
        if self.computed_by is None:
            return part
        return part.unflatten(-1, (self.layers, self.width // self.layers))[..., layer_idx, :]

    def entries_before(self, layer_idx: int) -> int:
        """Entries of a growing stack layer ``layer_idx`` reads: one per earlier multiple of ``every``."""
        return -(-layer_idx // self.every)  # type: ignore[operator]

    def stack(self, part: torch.Tensor, layer_idx: int | None = None) -> torch.Tensor:
        """A growing stack's wire part as layer ``layer_idx`` reads it, ``[..., entries, entry]`` (every entry the
        model makes when ``layer_idx`` is None: what the module reading it after the last layer gets)."""
        entries = self.width // self.entry if layer_idx is None else self.entries_before(layer_idx)  # type: ignore[operator]
        return part[..., :entries * self.entry].unflatten(-1, (entries, self.entry))  # type: ignore[operator]


@dataclass(frozen=True)
class WireLayout:
    """The parts of one token on the wire of a family's config, in wire order (see the module)."""

    hidden_size: int
    streams: int = 1
    stream_axis: int = 2
    """Where the streams sit in the layers' hidden state: 2 (``[batch, seq, streams, hidden]``) or 0."""
    carried: tuple[CarriedSlot, ...] = ()
    shared: tuple[SharedSlot, ...] = ()
    loops: bool = False
    """The wire ends with a looped layer stack's input."""

    @property
    def hidden(self) -> int:
        """Values per token of the hidden state (every stream)."""
        return self.streams * self.hidden_size

    @property
    def loop_width(self) -> int:
        """Values per token of the looped stack's input (0: the family loops no stack)."""
        return self.hidden if self.loops else 0

    @property
    def shared_width(self) -> int:
        """Values per token of the shared K/V."""
        return sum(slot.width for slot in self.shared)

    @property
    def width(self) -> int:
        """Values per token of the whole wire."""
        return self.hidden + sum(slot.width for slot in self.carried) + self.shared_width + self.loop_width

    def shared_slot(self, key: str) -> SharedSlot:
        """The shared K/V stored under ``key``."""
        return next(slot for slot in self.shared if slot.key == key)

    def split_loop(self, wire: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The wire without the looped stack's input, and that input (None for a family without one)."""
        if not self.loops:
            return wire, None
        rest, (loop_input,) = split_tail(wire, (self.loop_width,), "values of a looped stack's input")
        return rest, loop_input

    def join_loop(self, wire: torch.Tensor, loop_input: torch.Tensor | None) -> torch.Tensor:
        """`split_loop` undone."""
        if loop_input is None:
            return wire
        return _cat([wire, loop_input.to(wire.dtype).expand(*wire.shape[:-1], loop_input.shape[-1])])

    def split_shared(self, wire: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A wire without the loop's input: the rest, and ``{key: part}`` of the shared K/V."""
        if not self.shared:
            return wire, {}
        rest, parts = split_tail(wire, [slot.width for slot in self.shared], "values of shared K/V")
        return rest, {slot.key: part for slot, part in zip(self.shared, parts, strict=True)}

    def join_shared(self, wire: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """`split_shared` undone (in wire order)."""
        if not self.shared:
            return wire
        return _cat([wire, *(parts[slot.key].to(wire.dtype) for slot in self.shared)])

    def split_carried(self, wire: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A wire of the hidden state and the carried values: the hidden state, and each carried value's part."""
        if not self.carried:
            return wire, []
        return split_tail(wire, [slot.width for slot in self.carried], "carried values")


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


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    import torch

    return torch.cat(parts, dim=-1)


def _carried_slots(config: Any) -> tuple[CarriedSlot, ...]:
    hidden_state = getattr(getattr(type(config), "family_spec", None), "hidden_state", None)
    if hidden_state is None or not hidden_state.carried:
        return ()
    slots = []
    for index, (stream, width) in enumerate(zip(hidden_state.carried, carried_widths(config), strict=True)):
        if stream.grows is not None:
            every, entries = stack_entries(config, index)
            slots.append(CarriedSlot(stream.argument, width, None, None, 1, every=every, entry=width // entries))
        else:
            slots.append(CarriedSlot(stream.argument, width, stream.output_index, stream.computed_by,
                                     int(config.num_hidden_layers) if stream.computed_by is not None else 1,
                                     stream.initial))
    return tuple(slots)


def wire_layout(config: Any) -> WireLayout:
    """The wire of ``config``'s family (a plain config: its ``hidden_size`` alone)."""
    return WireLayout(int(config.hidden_size), streams_of(config), stream_axis_of(config), _carried_slots(config),
                      shared_kv_slots(config), loops_layers(config))


def wire_width_of(config: Any) -> int:
    """Values per token of the hidden state between blocks: `WireLayout.width` of ``config``'s family
    (``hidden_size`` for a family without a ``hidden_state`` section, and for a plain config)."""
    return wire_layout(config).width
