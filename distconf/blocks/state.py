"""Per-sequence state of recurrent blocks, from the family file's ``state`` section, and the
cache object a block hands to its recurrent layer.

A recurrent layer (convolution + SSM / linear-attention state) keeps a fixed-size state
per sequence: its size does not grow with the tokens seen, so it is counted in bytes per
sequence (`distconf.blocks.sizing.state_bytes_per_sequence`), not per token. A block's state is the tuple
``(conv, recurrent)`` of ``[batch, *shape]`` tensors (an entry is None when the family keeps
no such state); rows are sequences, so beam search reorders them like KV rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from distconf.blocks.layer_types import keeps_state_at
from distconf.errors import ConfigValueError
from distconf.loader.config_protocol import DistributedConfig
from distconf.loader.formula import Formula, FormulaError

__all__ = ["StateGeometry", "state_geometry", "keeps_state", "BlockStateCache"]


@dataclass(frozen=True)
class StateGeometry:
    """What one block keeps per sequence: the shapes of its conv and recurrent states (None: none kept)."""

    conv_shape: tuple[int, ...] | None
    recurrent_shape: tuple[int, ...] | None
    recurrent_float32: bool

    @property
    def conv_values(self) -> int:
        """Values of the convolution state of one sequence."""
        return math.prod(self.conv_shape) if self.conv_shape else 0

    @property
    def recurrent_values(self) -> int:
        """Values of the recurrent state of one sequence."""
        return math.prod(self.recurrent_shape) if self.recurrent_shape else 0


def keeps_state(config: DistributedConfig | type) -> bool:
    """Whether some blocks of ``config`` (or of a config class) keep a per-sequence state (the family has a
    ``state`` section); which ones: `distconf.blocks.layer_types.keeps_state_at`."""
    cls = config if isinstance(config, type) else type(config)
    spec = getattr(cls, "family_spec", None)
    return spec is not None and spec.state is not None


def _shape(config: DistributedConfig, field: str, entries: list[int | Formula] | None) -> tuple[int, ...] | None:
    if entries is None:
        return None
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
    """The per-sequence state block ``layer_idx`` of ``config`` keeps (from its family file), or None for a layer
    that keeps none. Without ``layer_idx``: the state of the family's state-keeping layers (None: no state)."""
    spec = getattr(type(config), "family_spec", None)
    state = spec.state if spec is not None else None
    if state is None or (layer_idx is not None and not keeps_state_at(config, layer_idx)):
        return None
    return StateGeometry(_shape(config, "conv_shape", state.conv_shape),
                         _shape(config, "recurrent_shape", state.recurrent_shape),
                         state.recurrent_dtype == "float32")


class BlockStateCache:
    """The cache object a block passes to its recurrent layer for one forward call.

    It implements the part of the transformers ``Cache`` interface recurrent layers use
    (``get_conv_state`` / ``update_conv_state``, ``get_recurrent_state`` /
    ``update_recurrent_state``, ``is_recording_past``), for this one layer whatever
    ``layer_idx`` the layer passes. The state given in is copied first: layers update their
    state in place, and the caller's tensors (a session's state, kept for a retry) stay intact.
    """

    def __init__(self, past: tuple[Any, Any] | None) -> None:
        conv, recurrent = past if past is not None else (None, None)
        self.conv = None if conv is None else conv.clone()
        self.recurrent = None if recurrent is None else recurrent.clone()
        self.has_previous_state = past is not None

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """A recurrent state has no token dimension (transformers' linear-attention layers say 0 too)."""
        return 0

    def is_recording_past(self, layer_idx: int | None = None) -> bool:
        """The state is never kept per token (a rewind is refused, not replayed from a recorded past)."""
        return False

    def get_conv_state(self, layer_idx: int | None = None, state_idx: int = 0) -> Any:
        """The convolution state of earlier tokens, or None before the first step."""
        return self.conv if self.has_previous_state else None

    def get_recurrent_state(self, layer_idx: int | None = None, state_idx: int = 0) -> Any:
        """The recurrent state of earlier tokens, or None before the first step."""
        return self.recurrent if self.has_previous_state else None

    def update_conv_state(self, conv_states: Any, layer_idx: int | None = None, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs: Any) -> Any:
        """Keep the last ``conv_kernel_size`` inputs; return the earlier window followed by the new inputs
        (as transformers' linear-attention cache layer does)."""
        import torch

        kernel = conv_kernel_size or (self.conv.shape[-1] if self.conv is not None else conv_states.shape[-1])
        if self.conv is not None and self.has_previous_state:
            full = torch.cat([self.conv.to(conv_states.dtype), conv_states], dim=-1)
        else:
            full = conv_states
            if full.shape[-1] < kernel:
                full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0), value=0)
        self.conv = full[..., -kernel:].contiguous()
        return full

    def update_recurrent_state(self, recurrent_states: Any, layer_idx: int | None = None, state_idx: int = 0,
                               **kwargs: Any) -> Any:
        """Keep the new recurrent state."""
        self.recurrent = recurrent_states
        return recurrent_states

    @property
    def present(self) -> tuple[Any, Any] | None:
        """The state to hand back to the caller: ``(conv, recurrent)``, or None if the layer kept none."""
        if self.conv is None and self.recurrent is None:
            return None
        return (self.conv, self.recurrent)
