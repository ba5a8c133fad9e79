"""One block call per block for the inference steps of several sessions (continuous batching).

Every session keeps its own `SessionCache`; a batched step stacks the sessions' rows,
padding each row on the left so that all rows' new tokens start at the same index ``P``
(the longest cached prefix) and on the right up to the longest new chunk ``N``. The
block gets a `RowLayout`: a padding mask (True where a key is a real token) and each
row's own positions, so every row attends to exactly its own tokens at its own
positions, as it would alone. New keys and values go back to each session's cache at
its own position; padded rows' outputs are dropped.

The padded cache of one block exists only while that block runs: its size is at most
the batch's rows x (``P`` + ``N``) tokens of one block, next to the caches the sessions
reserved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from distconf.blocks.layer_settings import RowLayout
from distconf.server.compute import SessionCache, add_prompt, on_device

__all__ = ["StepPart", "batch_key", "step_together"]


@dataclass
class StepPart:
    """One session's part of a batched step: ``hidden`` ``[batch, n, hidden]`` at its cache's position."""

    cache: SessionCache
    hidden: torch.Tensor
    prompts: Sequence[torch.Tensor | None]

    @property
    def rows(self) -> int:
        """Rows (the session's batch)."""
        return int(self.hidden.shape[0])

    @property
    def length(self) -> int:
        """New tokens per row."""
        return int(self.hidden.shape[1])


def batch_key(part: StepPart) -> tuple[object, ...]:
    """Parts with equal keys may be computed together: the same blocks, and the same position
    when the family's layers read positions from the cache length (``position.from_cache_length``).

    A session whose blocks keep a recurrent state is computed alone (its own key): rows padded
    on the left would run through the recurrence and change its state; so is one whose blocks keep
    a sparse-attention indexer's keys (their padded step is not laid out here).
    """
    if part.cache.keeps_state or part.cache.keeps_indexer:
        return ("alone", id(part.cache))
    blocks = part.cache.blocks
    spec = getattr(blocks[0].module, "family_spec", None) if blocks else None
    same_position = spec is not None and spec.block.position.from_cache_length
    return (tuple(b.uid for b in blocks), part.cache.position if same_position else None)


def _layout(parts: Sequence[StepPart], past: int, new: int, device: torch.device) -> RowLayout:
    batch = sum(p.rows for p in parts)
    padding = torch.zeros(batch, past + new, dtype=torch.bool)
    positions = torch.empty(batch, new, dtype=torch.long)
    row = 0
    for p in parts:
        rows = slice(row, row + p.rows)
        pos = p.cache.position
        padding[rows, past - pos:past] = True
        padding[rows, past:past + p.length] = True
        positions[rows] = torch.arange(pos, pos + new)
        row += p.rows
    return RowLayout(padding.to(device), positions.to(device))


def step_together(parts: Sequence[StepPart]) -> list[torch.Tensor]:
    """Each part's outputs (on the CPU), equal to what ``part.cache.step`` gives alone; caches advance.

    Parts must have one `batch_key` and ``length >= 1``.
    """
    if len(parts) == 1:
        p = parts[0]
        return [p.cache.step(p.hidden, p.prompts, None)]
    blocks = parts[0].cache.blocks
    past = max(p.cache.position for p in parts)
    new = max(p.length for p in parts)
    hidden_size = parts[0].hidden.shape[2]
    (device_probe,) = on_device(blocks, parts[0].hidden[:0])
    device = device_probe.device
    batch = sum(p.rows for p in parts)
    hidden = torch.zeros(batch, new, hidden_size, dtype=parts[0].hidden.dtype, device=device)
    spans: list[slice] = []
    row = 0
    for p in parts:
        spans.append(slice(row, row + p.rows))
        hidden[spans[-1], :p.length] = p.hidden.to(device)
        row += p.rows
    prompts = [on_device(blocks, *p.prompts) for p in parts]
    layout = _layout(parts, past, new, device)
    caches = [(p.cache.keys, p.cache.values) for p in parts]  # a session released meanwhile keeps these
    with torch.inference_mode():
        for b, block in enumerate(blocks):
            for p, rows, own in zip(parts, spans, prompts):
                if own[b] is not None:
                    hidden[rows, :p.length] = add_prompt(hidden[rows, :p.length], own[b], p.cache.position)
            if not block.keeps_kv:  # an MLP-only layer of a hybrid family: nothing to cache
                hidden, _ = block.module(hidden, use_cache=True, rows=layout)
                continue
            layer_past = None
            if past > 0:
                k0, v0 = caches[0][0][b], caches[0][1][b]
                keys = torch.zeros(batch, k0.shape[1], past, k0.shape[3], dtype=k0.dtype, device=device)
                values = torch.zeros(batch, v0.shape[1], past, v0.shape[3], dtype=v0.dtype, device=device)
                for p, rows, (k, v) in zip(parts, spans, caches):
                    pos = p.cache.position
                    keys[rows, :, past - pos:] = k[b][:, :, :pos]
                    values[rows, :, past - pos:] = v[b][:, :, :pos]
                layer_past = (keys, values)
            hidden, present = block.module(hidden, layer_past=layer_past, use_cache=True, rows=layout)
            for p, rows, (k, v) in zip(parts, spans, caches):
                pos, n = p.cache.position, p.length
                k[b][:, :, pos:pos + n] = present[0][rows, :, past:past + n]
                v[b][:, :, pos:pos + n] = present[1][rows, :, past:past + n]
    outputs = []
    for p, rows in zip(parts, spans):
        p.cache.position += p.length
        outputs.append(hidden[rows, :p.length].cpu())
    return outputs
