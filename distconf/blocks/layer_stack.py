"""Blocks of a looped layer stack (``block.layer_stack.loop``): what a block does around its layer.

The looped stack's input (the hidden state entering the first pass) travels on the wire after the hidden state
(`distconf.loader.wire_layout.WireLayout.split_loop`): zeros before the first pass; the block starting it puts its input
there; every block starting a pass replaces the hidden state by ``entry_module(hidden) + entry_module(input)``
before its layer (``entry: module_sum``), as the model does; every block hands the input on.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distconf.loader.layer_stack import LoopRole, loop_role
from distconf.loader.wire_layout import WireLayout, wire_layout

if TYPE_CHECKING:
    import torch

__all__ = ["BlockLoop", "block_loop", "entry_module"]

_modules: dict[tuple[type, str], Any] = {}
_lock = threading.Lock()


@dataclass(frozen=True)
class BlockLoop:
    """A block's part in the looped stack: its role, the entry module and the wire it splits."""

    role: LoopRole
    module: Any
    wire: WireLayout

    @property
    def width(self) -> int:
        """Values per token of the stack's input (as wide as the hidden state)."""
        return self.wire.loop_width

    def run(self, layer_forward: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """``layer_forward`` on the hidden state of ``hidden_states`` (a wire ending with the stack's input),
        entering a pass first when the block starts one; returns its output with the input put back."""
        wire, loop_input = self.wire.split_loop(hidden_states)
        if self.role.takes_input:
            loop_input = wire[..., :self.width]
        if self.role.enters_pass:
            hidden, rest = wire[..., :self.width], wire[..., self.width:]
            hidden = self.module(hidden) + self.module(loop_input.to(hidden.dtype))
            wire = hidden if rest.shape[-1] == 0 else _cat(hidden, rest)
        output, present = layer_forward(wire, *args, **kwargs)
        return self.wire.join_loop(output, loop_input), present


def _cat(hidden: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.cat([hidden, rest], dim=-1)


def entry_module(config: Any) -> Any:
    """The family's ``block.layer_stack.loop.entry_module``: the weightless module of the causal LM, built once
    per config class (from a meta-device model of ``config``)."""
    import torch

    from distconf.blocks.hf_compat import causal_lm_class

    loop = type(config).family_spec.block.layer_stack.loop
    key = (type(config), loop.entry_module)
    with _lock:
        module = _modules.get(key)
        if module is not None:
            return module
        model_class = causal_lm_class(type(config).hf_config_class)
        with torch.device("meta"):
            model = model_class(config)
        try:
            module = model.get_submodule(loop.entry_module)
        except AttributeError:
            raise type(config).family_source.error(
                ("block", "layer_stack", "loop", "entry_module"),
                f"{type(model).__name__} has no module {loop.entry_module!r}") from None
        if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
            raise type(config).family_source.error(
                ("block", "layer_stack", "loop", "entry_module"),
                f"{loop.entry_module!r} holds weights or buffers; only a weightless entry module is supported")
        module = module.to_empty(device="cpu").eval()
        _modules[key] = module
        return module


def block_loop(config: Any, block_idx: int) -> BlockLoop | None:
    """Block ``block_idx``'s part in ``config``'s looped stack (None for a family looping no layers)."""
    role = loop_role(config, block_idx)  # a ConfigValueError naming the field when the loop does not fit
    if role is None:
        return None
    return BlockLoop(role, entry_module(config), wire_layout(config))
