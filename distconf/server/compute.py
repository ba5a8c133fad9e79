"""What a server computes on its blocks: forward, backward and cached inference steps.

Blocks follow the adapter's calling convention (``hidden, present = block(hidden,
layer_past=(k, v), use_cache=True)``, caches ``[batch, kv_heads, tokens, head_dim]``).
Requests arrive and replies leave on the CPU; inputs move to the blocks' device (where the
caches live too) and results come back, so a GPU server needs nothing else here.
These functions are synchronous and run in the server's one compute thread, in the order
`distconf.server.scheduler` chooses (it batches inference steps of several sessions with
`distconf.server.batch_step`); inputs are already validated (see `distconf.server.validation`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from distconf.blocks.kvcache import KVGeometry

__all__ = ["ServedBlock", "SessionCache", "add_prompt", "backward_chain", "forward_chain", "on_device"]


@dataclass
class ServedBlock:
    """One loaded block: its uid, index, module, dtype and KV geometry; ``device`` is where its weights are."""

    uid: str
    index: int
    module: Any
    dtype: torch.dtype
    geometry: KVGeometry
    kv_bytes_per_token: int
    device: torch.device = field(init=False)

    def __post_init__(self) -> None:
        weight = next(iter(self.module.parameters()), None) if hasattr(self.module, "parameters") else None
        self.device = torch.device("cpu") if weight is None else weight.device


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
                  prompts: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """Run ``hidden`` through ``blocks`` (no cache); deep prompts added to each block's input."""
    hidden, *prompts = on_device(blocks, hidden, *prompts)
    with torch.inference_mode():
        for block, prompt in zip(blocks, prompts):
            hidden, _ = block.module(add_prompt(hidden, prompt))
    return hidden.cpu()


def backward_chain(blocks: Sequence[ServedBlock], inputs: torch.Tensor, grad_outputs: torch.Tensor,
                   prompts: torch.Tensor | None) -> list[torch.Tensor]:
    """Gradients of ``<outputs, grad_outputs>`` w.r.t. ``inputs`` (and ``prompts`` when given).

    ``prompts``: ``[num_blocks, batch or 1, pre_seq_len, hidden]``. Weights get no gradient.
    """
    inputs, grad_outputs, prompts = on_device(blocks, inputs, grad_outputs, prompts)
    with torch.enable_grad():
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


@dataclass
class SessionCache:
    """The preallocated KV cache of one inference session: every block of its chain, ``batch x max_length``."""

    blocks: Sequence[ServedBlock]
    batch: int
    max_length: int
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    position: int = 0

    @staticmethod
    def nbytes(blocks: Sequence[ServedBlock], batch: int, max_length: int) -> int:
        """Bytes a session of ``batch x max_length`` tokens holds over ``blocks``."""
        return sum(b.kv_bytes_per_token for b in blocks) * batch * max_length

    def allocate(self) -> None:
        """Allocate the cache tensors (zeros)."""
        for b in self.blocks:
            g = b.geometry
            self.keys.append(torch.zeros(self.batch, g.num_kv_heads, self.max_length, g.key_head_dim, dtype=b.dtype,
                                         device=b.device))
            self.values.append(torch.zeros(self.batch, g.num_kv_heads, self.max_length, g.value_head_dim,
                                           dtype=b.dtype, device=b.device))

    def release(self) -> None:
        """Drop the cache tensors (a step computing at this moment keeps the lists it started with)."""
        self.keys, self.values = [], []

    def reorder(self, hypo_ids: torch.Tensor | None) -> None:
        """Reorder the cached rows (beam search's ``hypo_ids``: row ``i`` becomes old row ``hypo_ids[i]``)."""
        pos = self.position
        if hypo_ids is None or pos == 0:
            return
        (hypo_ids,) = on_device(self.blocks, hypo_ids)
        with torch.inference_mode():
            for k, v in zip(self.keys, self.values):
                k[:, :, :pos] = k[hypo_ids, :, :pos]
                v[:, :, :pos] = v[hypo_ids, :, :pos]

    def step(self, hidden: torch.Tensor, prompts: Sequence[torch.Tensor | None],
             hypo_ids: torch.Tensor | None) -> torch.Tensor:
        """Process ``hidden`` ``[batch, n, hidden]`` at the current position; advance it by ``n``."""
        self.reorder(hypo_ids)
        pos, n = self.position, hidden.shape[1]
        hidden, *prompts = on_device(self.blocks, hidden, *prompts)
        with torch.inference_mode():
            if n == 0:
                return hidden.cpu()
            for block, k, v, prompt in zip(self.blocks, self.keys, self.values, prompts):
                past = (k[:, :, :pos], v[:, :, :pos]) if pos > 0 else None
                hidden, present = block.module(add_prompt(hidden, prompt, pos), layer_past=past, use_cache=True)
                k[:, :, pos:pos + n] = present[0][:, :, pos:pos + n]
                v[:, :, pos:pos + n] = present[1][:, :, pos:pos + n]
        self.position = pos + n
        return hidden.cpu()
