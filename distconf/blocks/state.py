"""Per-sequence state of recurrent blocks, from the family file's ``state`` section, and the
cache object a block hands to its recurrent layer.

A recurrent layer (convolution + SSM / linear-attention state) keeps a fixed-size state
per sequence: its size does not grow with the tokens seen, so it is counted in bytes per
sequence (`distconf.blocks.sizing.state_bytes_per_sequence`), not per token. A block's state is the tuple
``(conv, recurrent)`` of ``[batch, *shape]`` tensors (an entry is None when the family keeps
no such state); rows are sequences, so beam search reorders them like KV rows. A layer keeping several
states (cache ``state_idx`` 0, 1, ...) has ``(conv_0, ..., conv_n, recurrent_0, ..., recurrent_m)``
(`distconf.loader.spec_state.StateSpec.slots`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from distconf.blocks.layer_types import keeps_state_at, layer_type
from distconf.errors import ConfigValueError
from distconf.loader.config_protocol import DistributedConfig
from distconf.loader.formula import Formula, FormulaError
from distconf.loader.per_layer import is_heterogeneous, layer_config

__all__ = ["StateGeometry", "state_geometry", "keeps_state", "BlockStateCache"]


@dataclass(frozen=True)
class StateGeometry:
    """What one block keeps per sequence: the shapes of its conv and recurrent states, one per ``state_idx``
    (empty: none kept)."""

    conv_shapes: tuple[tuple[int, ...], ...]
    recurrent_shapes: tuple[tuple[int, ...], ...]
    recurrent_float32: bool
    conv_float32: bool = False
    """The convolution states are kept in float32 (``state.conv_dtype``), else in the block's dtype."""
    counts_positions: bool = False
    """The block keeps each sequence's token count (one int64) after its states (``state.counts_positions``)."""

    @property
    def conv_shape(self) -> tuple[int, ...] | None:
        """The shape of the first convolution state (None: none kept)."""
        return self.conv_shapes[0] if self.conv_shapes else None

    @property
    def recurrent_shape(self) -> tuple[int, ...] | None:
        """The shape of the first recurrent state (None: none kept)."""
        return self.recurrent_shapes[0] if self.recurrent_shapes else None

    @property
    def conv_values(self) -> int:
        """Values of the convolution states of one sequence (all of them)."""
        return sum(math.prod(shape) for shape in self.conv_shapes)

    @property
    def recurrent_values(self) -> int:
        """Values of the recurrent states of one sequence (all of them)."""
        return sum(math.prod(shape) for shape in self.recurrent_shapes)

    @property
    def expected(self) -> tuple[tuple[str, tuple[int, ...] | None], ...]:
        """(field, shape) of every entry of the state part of a block's past, in order (None: the entry is
        None), with ``field`` naming the family file's field (and the state's index when there are several)."""
        def entries(field: str, shapes: tuple[tuple[int, ...], ...]) -> list[tuple[str, tuple[int, ...] | None]]:
            if not shapes:
                return [(field, None)]
            return [(field if len(shapes) == 1 else f"{field}[{i}]", shape) for i, shape in enumerate(shapes)]
        counted = (("counts_positions", (1,)),) if self.counts_positions else ()
        return (*entries("conv_shape", self.conv_shapes), *entries("recurrent_shape", self.recurrent_shapes),
                *counted)


def keeps_state(config: DistributedConfig | type) -> bool:
    """Whether some blocks of ``config`` (or of a config class) keep a per-sequence state (the family has a
    ``state`` section); which ones: `distconf.blocks.layer_types.keeps_state_at`."""
    cls = config if isinstance(config, type) else type(config)
    spec = getattr(cls, "family_spec", None)
    return spec is not None and spec.state is not None


def _shape(config: DistributedConfig, field: str, entries: list[int | Formula]) -> tuple[int, ...]:
    spec = type(config).family_spec
    out = []
    for i, entry in enumerate(entries):
        try:
            value = entry if isinstance(entry, int) else entry.evaluate_on(config)
        except (FormulaError, AttributeError, TypeError, ZeroDivisionError) as exc:
            raise ConfigValueError(f"family {spec.family!r}: state.{field}[{i}]: {exc}") from None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigValueError(f"family {spec.family!r}: state.{field}[{i}] gave {value!r}; "
                                   "expected a positive integer")
        out.append(value)
    return tuple(out)


def state_geometry(config: DistributedConfig, layer_idx: int | None = None) -> StateGeometry | None:
    """The per-sequence state block ``layer_idx`` of ``config`` keeps (from its family file, with the
    ``state.layer_overrides`` of its layer type, read on the layer's own config: `distconf.loader.per_layer`), or
    None for a layer that keeps none. Without ``layer_idx``: the
    largest state of the family's state-keeping layers (None: no state)."""
    spec = getattr(type(config), "family_spec", None)
    state = spec.state if spec is not None else None
    if state is None or (layer_idx is not None and not keeps_state_at(config, layer_idx)):
        return None
    if layer_idx is None:
        if is_heterogeneous(config):  # sizes per layer: the largest layer's
            geometries = [g for i in range(config.num_hidden_layers) if (g := state_geometry(config, i)) is not None]
        else:
            geometries = [_geometry_of(config, kind) for kind in [None, *state.layer_overrides]]
        return max(geometries, key=lambda g: g.conv_values + g.recurrent_values)
    kind = layer_type(config, layer_idx) if state.layer_overrides else None
    return _geometry_of(layer_config(config, layer_idx), kind)


def _geometry_of(config: DistributedConfig, kind: str | None) -> StateGeometry:
    """The state of the family's section, with the shapes ``state.layer_overrides`` gives layer type ``kind``."""
    state = type(config).family_spec.state
    where = "" if kind is None or kind not in state.layer_overrides else f"layer_overrides.{kind}."

    def shapes(field: str) -> tuple[tuple[int, ...], ...]:
        listed: list[list[int | Formula]] = state.shapes_for(field, kind)
        if len(listed) == 1:
            return (_shape(config, f"{where}{field}_shape", listed[0]),)
        return tuple(_shape(config, f"{where}{field}_shape[{i}]", entries) for i, entries in enumerate(listed))
    return StateGeometry(shapes("conv"), shapes("recurrent"), state.recurrent_dtype == "float32",
                         state.conv_dtype == "float32", state.counts_positions)


class BlockStateCache:
    """The cache object a block passes to its recurrent layer for one forward call.

    It implements the part of the transformers ``Cache`` interface recurrent layers use
    (``get_conv_state`` / ``update_conv_state``, ``get_recurrent_state`` /
    ``update_recurrent_state``, ``is_recording_past``), for this one layer whatever
    ``layer_idx`` the layer passes. The state given in is copied first: layers update their
    state in place, and the caller's tensors (a session's state, kept for a retry) stay intact.
    ``slots``: how many conv and recurrent states the layer keeps (``StateSpec.slots``), one per
    ``state_idx``; ``past`` holds the conv states, then the recurrent ones.
    """

    def __init__(self, past: tuple[Any, ...] | None, slots: tuple[int, int] = (1, 1)) -> None:
        convs, recurrents = slots
        entries = tuple(past) if past is not None else (None,) * (convs + recurrents)
        if len(entries) != convs + recurrents:
            raise ConfigValueError(f"a state of {len(entries)} tensors was given to a layer keeping {convs} conv "
                                   f"and {recurrents} recurrent states")
        self.convs = [None if t is None else t.clone() for t in entries[:convs]]
        self.recurrents = [None if t is None else t.clone() for t in entries[convs:]]
        self.has_previous_state = past is not None

    @property
    def width(self) -> int:
        """Entries of the state part of the layer's past (conv states, then recurrent states)."""
        return len(self.convs) + len(self.recurrents)

    @property
    def conv(self) -> Any:
        """The first convolution state (None: not kept yet)."""
        return self.convs[0]

    @property
    def recurrent(self) -> Any:
        """The first recurrent state (None: not kept yet)."""
        return self.recurrents[0]

    @staticmethod
    def _slot(states: list[Any], kind: str, state_idx: int) -> int:
        if not 0 <= state_idx < len(states):
            raise ConfigValueError(f"the layer uses {kind} state {state_idx}, but the family's state.{kind}_shape "
                                   f"declares {len(states)} (a list of shapes declares one per state_idx)")
        return state_idx

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """A recurrent state has no token dimension (transformers' linear-attention layers say 0 too)."""
        return 0

    def is_recording_past(self, layer_idx: int | None = None) -> bool:
        """The state is never kept per token (a rewind is refused, not replayed from a recorded past)."""
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """No intermediate recurrent states are kept (the past is not recorded; transformers >= 5.25 asks)."""
        return 0

    def increase_count(self, layer_idx: int | None = None, state_idx: int = 0) -> None:
        """A token was convolved in place (transformers >= 5.25 counts tokens per linear layer; the block's
        positions come from the session, so there is nothing to count here)."""

    def get_conv_state(self, layer_idx: int | None = None, state_idx: int = 0) -> Any:
        """The convolution state ``state_idx`` of earlier tokens, or None before the first step."""
        return self.convs[self._slot(self.convs, "conv", state_idx)] if self.has_previous_state else None

    def get_recurrent_state(self, layer_idx: int | None = None, state_idx: int = 0) -> Any:
        """The recurrent state ``state_idx`` of earlier tokens, or None before the first step."""
        if not self.has_previous_state:
            return None
        return self.recurrents[self._slot(self.recurrents, "recurrent", state_idx)]

    def update_conv_state(self, conv_states: Any, layer_idx: int | None = None, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs: Any) -> Any:
        """Keep the last ``conv_kernel_size`` inputs; return the earlier window followed by the new inputs
        (as transformers' linear-attention cache layer does)."""
        import torch

        slot = self._slot(self.convs, "conv", state_idx)
        conv = self.convs[slot]
        kernel = conv_kernel_size or (conv.shape[-1] if conv is not None else conv_states.shape[-1])
        if conv is not None and self.has_previous_state:
            full = torch.cat([conv.to(conv_states.dtype), conv_states], dim=-1)
        else:
            full = conv_states
            if full.shape[-1] < kernel:
                full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0), value=0)
        self.convs[slot] = full[..., -kernel:].contiguous()
        return full

    def update_recurrent_state(self, recurrent_states: Any, layer_idx: int | None = None, state_idx: int = 0,
                               **kwargs: Any) -> Any:
        """Keep the new recurrent state ``state_idx`` (given a list of the last states, as transformers >= 5.25
        may give one: its last)."""
        if isinstance(recurrent_states, (list, tuple)):
            recurrent_states = recurrent_states[-1]
        self.recurrents[self._slot(self.recurrents, "recurrent", state_idx)] = recurrent_states
        return recurrent_states

    @property
    def present(self) -> tuple[Any, ...] | None:
        """The state to hand back to the caller: ``(conv, recurrent)`` (with several states: every conv state, then
        every recurrent state), or None if the layer kept none."""
        entries = (*self.convs, *self.recurrents)
        return None if all(t is None for t in entries) else entries
