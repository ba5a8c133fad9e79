"""What a server computes on its blocks: forward, backward and cached inference steps.

Blocks follow the adapter's calling convention (``hidden, present = block(hidden,
layer_past=(k, v), use_cache=True)``, caches ``[batch, kv_heads, tokens, head_dim]``; a
recurrent block's ``(conv, recurrent)`` state per row instead, ``(k, v, conv, recurrent)`` for a
block keeping both, see `distconf.blocks.adapter`).
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
    state_bytes_per_sequence: int = 0
    """Bytes of per-sequence state (a recurrent block's conv and SSM state, `distconf.blocks.state`)."""
    device: torch.device = field(init=False)

    def __post_init__(self) -> None:
        weight = next(iter(self.module.parameters()), None) if hasattr(self.module, "parameters") else None
        self.device = torch.device("cpu") if weight is None else weight.device

    @property
    def keeps_state(self) -> bool:
        """The block keeps a per-sequence state (its family's ``state`` section, for this layer's type)."""
        settings = getattr(self.module, "_distconf", None)
        return bool(settings is not None and settings.keeps_state)

    @property
    def state_width(self) -> int:
        """Tensors of the block's state: its conv states, then its recurrent states (``(conv, recurrent)``: 2), then
        the token count when the family keeps it (``state.counts_positions``)."""
        settings = getattr(self.module, "_distconf", None)
        return settings.state_width if settings is not None else 2

    @property
    def keeps_kv(self) -> bool:
        """The block keeps a K/V cache (False for a recurrent or MLP-only layer)."""
        settings = getattr(self.module, "_distconf", None)
        return settings is None or settings.keeps_kv


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
    """The preallocated KV cache of one inference session: every block of its chain, ``batch x max_length``.

    A block that keeps a per-sequence state (`ServedBlock.keeps_state`, alone or next to K/V) holds
    its ``(conv, recurrent)`` state (every state, `ServedBlock.state_width`) in ``states`` (None before
    the first token); its bytes were reserved with the session (`nbytes`), the tensors come from the
    block's first step. A block that keeps no K/V has empty ``keys``/``values`` entries.
    """

    blocks: Sequence[ServedBlock]
    batch: int
    max_length: int
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    position: int = 0
    states: list[Any] = field(default_factory=list)
    indexers: list[Any] = field(default_factory=list)
    """Per block, a sparse-attention indexer's keys ``[batch, max_length, dim]`` (None: the block keeps none)."""

    @staticmethod
    def nbytes(blocks: Sequence[ServedBlock], batch: int, max_length: int) -> int:
        """Bytes a session of ``batch x max_length`` tokens holds over ``blocks`` (KV per token, state per row)."""
        return (sum(b.kv_bytes_per_token for b in blocks) * batch * max_length
                + sum(b.state_bytes_per_sequence for b in blocks) * batch)

    @property
    def keeps_indexer(self) -> bool:
        """Some block of the chain keeps a sparse-attention indexer's keys next to K/V."""
        return any(b.keeps_kv and b.geometry.indexer_head_dim for b in self.blocks)

    @property
    def keeps_state(self) -> bool:
        """Some block of the chain keeps a recurrent state (it cannot be cut back to an earlier position)."""
        return any(b.keeps_state for b in self.blocks)

    def rewind_refusal(self, position: int) -> str | None:
        """Why the session cannot restart from ``position`` (None: it can).

        A KV cache is cut back by position; a recurrent state holds every earlier token
        folded together, so it can only restart where it stands or from the empty state (0).
        """
        if not self.keeps_state or position in (0, self.position):
            return None
        return (f"start_from_position={position} is refused: the blocks keep a recurrent state per sequence, "
                f"which cannot be cut back from position {self.position} (only to 0 or {self.position}); "
                "replay the tokens from 0 instead")

    def allocate(self) -> None:
        """Allocate the cache tensors (zeros); a state block's state starts empty (None)."""
        self.states = [None] * len(self.blocks)
        self.indexers = [torch.zeros(self.batch, self.max_length, b.geometry.indexer_head_dim, dtype=b.dtype,
                                     device=b.device) if b.keeps_kv and b.geometry.indexer_head_dim else None
                         for b in self.blocks]
        for b in self.blocks:
            if not b.keeps_kv:
                self.keys.append(torch.zeros(0))
                self.values.append(torch.zeros(0))
                continue
            g = b.geometry
            self.keys.append(torch.zeros(self.batch, g.num_kv_heads, self.max_length, g.key_head_dim, dtype=b.dtype,
                                         device=b.device))
            self.values.append(torch.zeros(self.batch, g.num_kv_heads, self.max_length, g.value_head_dim,
                                           dtype=b.dtype, device=b.device))

    def release(self) -> None:
        """Drop the cache tensors (a step computing at this moment keeps the lists it started with)."""
        self.keys, self.values, self.states, self.indexers = [], [], [], []

    def restart(self, position: int) -> None:
        """Continue from ``position`` (the caller checked `rewind_refusal`): 0 empties every state."""
        if position == 0:
            self.states = [None] * len(self.states)
        self.position = position

    def reorder(self, hypo_ids: torch.Tensor | None) -> None:
        """Reorder the cached rows (beam search's ``hypo_ids``: row ``i`` becomes old row ``hypo_ids[i]``)."""
        pos = self.position
        if hypo_ids is None or pos == 0:
            return
        (hypo_ids,) = on_device(self.blocks, hypo_ids)
        with torch.inference_mode():
            for i, (k, v) in enumerate(zip(self.keys, self.values)):
                if self.blocks[i].keeps_state:
                    state = self.states[i]
                    if state is not None:
                        self.states[i] = tuple(None if t is None else t[hypo_ids] for t in state)
                if not self.blocks[i].keeps_kv:
                    continue
                if self.indexers[i] is not None:
                    self.indexers[i][:, :pos] = self.indexers[i][hypo_ids, :pos]
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
            old_states = self.states
            states = list(old_states)  # taken only when every block succeeded: a failed step leaves no trace
            indexers = self.indexers
            for i, (block, k, v, prompt) in enumerate(zip(self.blocks, self.keys, self.values, prompts)):
                kv: tuple[Any, ...] = (k[:, :, :pos], v[:, :, :pos]) if (block.keeps_kv and pos > 0) else (None, None)
                if indexers[i] is not None and pos > 0:
                    kv = (*kv, indexers[i][:, :pos])
                state = (tuple(states[i]) if (block.keeps_state and states[i] is not None)
                         else (None,) * block.state_width)
                past = (*kv, *state) if block.keeps_kv and block.keeps_state else (kv if block.keeps_kv else state)
                hidden, present = block.module(add_prompt(hidden, prompt, pos), layer_past=past, use_cache=True)
                if present is None:
                    continue
                if block.keeps_state:
                    states[i] = tuple(present[-block.state_width:])
                if block.keeps_kv:
                    k[:, :, pos:pos + n] = present[0][:, :, pos:pos + n]
                    v[:, :, pos:pos + n] = present[1][:, :, pos:pos + n]
                    if indexers[i] is not None:
                        indexers[i][:, pos:pos + n] = present[2][:, pos:pos + n]
        if self.states is old_states:  # not released meanwhile
            self.states = states
        self.position = pos + n
        return hidden.cpu()
