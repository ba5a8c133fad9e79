"""Blocks of a looped layer stack (``block.layer_stack.loop``): the one home of the block/layer arithmetic.

distconf counts blocks, not model layers: a block is a layer as the forward pass runs it, so for a model that
runs layers ``[start, end)`` ``count`` times there are ``layers + (count - 1) * (end - start)`` blocks. Every
consumer that enumerates, plans, announces or sizes blocks reads `block_count`; whatever builds or loads a block
turns its index into the model layer it runs with `model_layer`. ``num_hidden_layers`` stays the model's own
count (the transformers model is built from it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from distconf.errors import ConfigValueError, excerpt
from distconf.loader.formula import count_on

__all__ = ["Loop", "loop_of", "block_count", "model_layer", "pass_entry", "LoopRole", "loop_role"]


@dataclass(frozen=True)
class Loop:
    """A looped range evaluated on one config: layers ``[start, end)`` run ``count`` times."""

    start: int
    end: int
    count: int
    entry_module: str

    @property
    def width(self) -> int:
        """Layers in one pass."""
        return self.end - self.start

    @property
    def unrolled_end(self) -> int:
        """One past the last block of the last pass."""
        return self.start + self.count * self.width


@dataclass(frozen=True)
class LoopRole:
    """What block of a looped stack does besides its layer: take the stack's input from the hidden state (the
    first pass's entry), combine the two (every pass's entry), or only carry the input on."""

    takes_input: bool
    enters_pass: bool


def _value(config: Any, family: str, name: str, value: Any) -> int:
    return count_on(config, family, f"block.layer_stack.loop.{name}", value, minimum=0)


def loop_of(config: Any) -> Loop | None:
    """The looped range of ``config``'s family on ``config`` (None: each layer runs once).

    Raises `ConfigValueError` naming the field when the range is not within the model's layers, or when
    ``config`` has a value other than ``requires`` says the blocks are exact for.
    """
    spec = getattr(type(config), "family_spec", None)
    stack = getattr(getattr(spec, "block", None), "layer_stack", None)
    if stack is None:
        return None
    loop = stack.loop
    family = spec.family
    for field, wanted in loop.requires.items():
        have = getattr(config, field, None)
        if have != wanted:
            raise ConfigValueError(f"family {family!r}: block.layer_stack.loop.requires: {field}={excerpt(have)}; "
                                   f"the blocks of a looped stack are exact only for {field}={excerpt(wanted)}")
    start, end, count = (_value(config, family, name, getattr(loop, name)) for name in ("start", "end", "count"))
    layers = int(config.num_hidden_layers)
    if not 0 < start < end <= layers:
        raise ConfigValueError(f"family {family!r}: block.layer_stack.loop: layers [{start}, {end}) are not a "
                               f"non-empty range after layer 0 within the model's {layers} layers")
    if count < 1:
        raise ConfigValueError(f"family {family!r}: block.layer_stack.loop.count gave {count}; expected at least 1")
    return Loop(start, end, count, loop.entry_module)


def block_count(config: Any) -> int:
    """Blocks of ``config``'s model: its layers as the forward pass runs them (``num_hidden_layers`` unless a
    range of layers is looped)."""
    layers = int(config.num_hidden_layers)
    loop = loop_of(config)
    return layers if loop is None else layers + (loop.count - 1) * loop.width


def model_layer(config: Any, block_idx: int) -> int:
    """The model layer block ``block_idx`` runs (the block index itself unless a range of layers is looped)."""
    loop = loop_of(config)
    if loop is None or block_idx < loop.start:
        return block_idx
    if block_idx < loop.unrolled_end:
        return loop.start + (block_idx - loop.start) % loop.width
    return block_idx - (loop.count - 1) * loop.width


def pass_entry(config: Any, block_idx: int) -> bool:
    """Whether block ``block_idx`` starts a pass through the looped range."""
    loop = loop_of(config)
    return (loop is not None and loop.start <= block_idx < loop.unrolled_end
            and (block_idx - loop.start) % loop.width == 0)


def loop_role(config: Any, block_idx: int) -> LoopRole | None:
    """What block ``block_idx`` does with the stack's input on the wire (None: the family loops no layers)."""
    loop = loop_of(config)
    if loop is None:
        return None
    return LoopRole(takes_input=block_idx == loop.start, enters_pass=pass_entry(config, block_idx))
