"""The blocks a server holds (`ServedBlock`, with their typed capabilities) and what it computes on them without a
cache: forward and backward passes.

Requests arrive and replies leave on the CPU; inputs move to the blocks' device (where the
caches live too) and results come back, so a GPU server needs nothing else here.
These functions are synchronous and run in the server's one compute thread, in the order
`distconf.server.scheduler` chooses; cached inference steps are `distconf.server.session_cache`'s. Inputs are
already validated (see `distconf.server.validation`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from distconf.blocks.adapter import BlockAdapter
from distconf.blocks.kvcache import KVGeometry
from distconf.blocks.lora import adapter_rows
from distconf.blocks.past import BlockCapabilities

__all__ = ["ServedBlock", "add_prompt", "backward_chain", "forward_chain", "on_device"]


@dataclass
class ServedBlock:
    """One loaded block: its uid, index, module, dtype and KV geometry; ``device`` is where its weights are."""

    uid: str
    index: int
    module: Any
    dtype: torch.dtype
    geometry: KVGeometry
    kv_bytes_per_token: int
    state_bytes_per_sequence: int = 0
    """Bytes of per-sequence state (a recurrent block's conv and SSM state, `distconf.blocks.state`)."""
    device: torch.device = field(init=False)

    def __post_init__(self) -> None:
        weight = next(iter(self.module.parameters()), None) if hasattr(self.module, "parameters") else None
        self.device = torch.device("cpu") if weight is None else weight.device
        # a distconf block states what it keeps; any other module (a test's bare layer) is a K/V layer
        self._capabilities = self.module.capabilities if isinstance(self.module, BlockAdapter) else BlockCapabilities()

    @property
    def capabilities(self) -> BlockCapabilities:
        """What the block keeps between calls (`distconf.blocks.past.BlockCapabilities`)."""
        return self._capabilities

    @property
    def keeps_state(self) -> bool:
        """The block keeps a per-sequence state (its family's ``state`` section, for this layer's type)."""
        return self._capabilities.keeps_state

    @property
    def keeps_kv(self) -> bool:
        """The block keeps a K/V cache (False for a recurrent or MLP-only layer)."""
        return self._capabilities.keeps_kv

    @property
    def state_width(self) -> int:
        """Tensors of the block's state: conv states, recurrent states, then the token count when kept."""
        return self._capabilities.state_width


def on_device(blocks: Sequence[ServedBlock], *tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """``tensors`` moved to the device of ``blocks`` (no copy when they are there already)."""
    device = blocks[0].device if blocks else torch.device("cpu")
    return [None if t is None else t.to(device) for t in tensors]


def add_prompt(hidden: torch.Tensor, prompt: torch.Tensor | None, position: int = 0) -> torch.Tensor:
    """``hidden`` with ``prompt[:, p]`` added at absolute positions ``p`` (``hidden`` starts at ``position``)."""
    if prompt is None:
        return hidden
    end = min(prompt.shape[1], position + hidden.shape[1])
    if end <= position:
        return hidden
    hidden = hidden.clone()
    hidden[:, : end - position] += prompt[:, position:end]
    return hidden


def forward_chain(blocks: Sequence[ServedBlock], hidden: torch.Tensor,
                  prompts: Sequence[torch.Tensor | None], adapter: str | None = None) -> torch.Tensor:
    """Run ``hidden`` through ``blocks`` (no cache); deep prompts added to each block's input; with the LoRA
    ``adapter`` (None: the base model)."""
    hidden, *prompts = on_device(blocks, hidden, *prompts)
    with torch.inference_mode(), adapter_rows([(adapter, slice(0, hidden.shape[0]))]):
        for block, prompt in zip(blocks, prompts):
            hidden, _ = block.module(add_prompt(hidden, prompt))
    return hidden.cpu()


def backward_chain(blocks: Sequence[ServedBlock], inputs: torch.Tensor, grad_outputs: torch.Tensor,
                   prompts: torch.Tensor | None, adapter: str | None = None) -> list[torch.Tensor]:
    """Gradients of ``<outputs, grad_outputs>`` w.r.t. ``inputs`` (and ``prompts`` when given), through the LoRA
    ``adapter`` (None: the base model).

    ``prompts``: ``[num_blocks, batch or 1, pre_seq_len, hidden]``. Weights get no gradient.
    """
    inputs, grad_outputs, prompts = on_device(blocks, inputs, grad_outputs, prompts)
    with torch.enable_grad(), adapter_rows([(adapter, slice(0, inputs.shape[0]))]):
        inputs = inputs.detach().requires_grad_(True)
        leaves = [inputs]
        if prompts is not None:
            prompts = prompts.detach().requires_grad_(True)
            leaves.append(prompts)
        hidden = inputs
        for i, block in enumerate(blocks):
            hidden, _ = block.module(add_prompt(hidden, None if prompts is None else prompts[i]))
        grads = torch.autograd.grad(hidden, leaves, grad_outputs, allow_unused=True)
    return [(torch.zeros_like(leaf) if g is None else g).cpu() for g, leaf in zip(grads, leaves)]
