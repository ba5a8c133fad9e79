"""A session's cache on a server, and the inference steps that advance it: alone or with other sessions'.

Every session keeps a `SessionCache`: per block of its chain, typed slots (`BlockSlots`: keys, values, a
sparse-attention indexer's keys, a recurrent state), preallocated for ``batch x max_length`` tokens. A step is
`step_together` of one or several sessions' parts (a session alone is a batch of one, through the same code):
per block, each session's past is read from its slots, the rows are joined along the batch, the block is called
once (`distconf.blocks.past` packs the call), and each session's new entries go back to its own slots at its
own position; each session's rows get its own LoRA adapter's delta (`distconf.blocks.lora.adapter_rows`), so
sessions of different adapters share a batch. Rows are joined in one of two ways, chosen by `batch_key`:

- **aligned**: every part stands at one position with as many new tokens; rows are stacked as they are, exactly
  like one session with more rows. Sessions whose blocks keep a recurrent state or an indexer's keys are
  batched only this way (a padded row would run through the recurrence, and the indexer's padded step is not
  laid out here).
- **padded** (blocks that keep K/V only): each row is padded on the left so that all new tokens start at the
  same index ``P`` (the longest cached prefix) and on the right up to the longest new chunk ``N``; the block
  gets a `RowLayout` (a padding mask and each row's own positions), so every row attends to exactly its own
  tokens at its own positions. The padded K/V of one block exists only while that block runs.

A failed step leaves no trace: states are taken only when every block succeeded, and the position advances
only then (K/V written past the position is overwritten by the next step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from distconf.blocks.layer_settings import RowLayout
from distconf.blocks.lora import adapter_rows
from distconf.blocks.past import LayerPast
from distconf.server.compute import ServedBlock, add_prompt, on_device

__all__ = ["BlockSlots", "SessionCache", "StepPart", "batch_key", "step_together"]


@dataclass
class BlockSlots:
    """What one session keeps for one block: K/V ``[batch, kv_heads, max_length, head_dim]`` (None for a block
    that keeps none), indexer keys ``[batch, max_length, dim]`` and the state tuple (None before the first
    token)."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    indexer: torch.Tensor | None = None
    state: tuple[Any, ...] | None = None

    def past(self, position: int) -> LayerPast:
        """The slots as a block call continuing from ``position`` reads them (views, no copy)."""
        if self.keys is None or position == 0:
            return LayerPast(state=self.state)
        return LayerPast(self.keys[:, :, :position], self.values[:, :, :position],  # type: ignore[index]
                         None if self.indexer is None else self.indexer[:, :position], self.state)

    def store(self, present: LayerPast, rows: slice, start: int, position: int, n: int) -> None:
        """Write the ``n`` new K/V (and indexer) entries of ``present``'s ``rows`` (from index ``start``) at
        ``position``; the state is taken by the caller."""
        if self.keys is None or present.keys is None:
            return
        self.keys[:, :, position:position + n] = present.keys[rows, :, start:start + n]
        self.values[:, :, position:position + n] = present.values[rows, :, start:start + n]  # type: ignore[index]
        if self.indexer is not None and present.indexer is not None:
            self.indexer[:, position:position + n] = present.indexer[rows, start:start + n]


@dataclass
class SessionCache:
    """The cache of one inference session over every block of its chain (`BlockSlots` per block).

    Slots exist between `allocate` and `release`; their bytes were reserved with the session (`nbytes`): K/V
    per token, a state per row (the state tensors come from the block's first step).
    """

    blocks: Sequence[ServedBlock]
    batch: int
    max_length: int
    position: int = 0
    slots: list[BlockSlots] = field(default_factory=list)
    adapter: str | None = None
    """The LoRA adapter the session's steps use (`distconf.blocks.lora`; None: the base model)."""

    @staticmethod
    def nbytes(blocks: Sequence[ServedBlock], batch: int, max_length: int) -> int:
        """Bytes a session of ``batch x max_length`` tokens holds over ``blocks`` (KV per token, state per row)."""
        return (sum(b.kv_bytes_per_token for b in blocks) * batch * max_length
                + sum(b.state_bytes_per_sequence for b in blocks) * batch)

    @property
    def allocated(self) -> bool:
        """The slots exist (allocated, not yet released)."""
        return bool(self.slots)

    @property
    def keeps_indexer(self) -> bool:
        """Some block of the chain keeps a sparse-attention indexer's keys next to K/V."""
        return any(b.capabilities.keeps_indexer for b in self.blocks)

    @property
    def keeps_state(self) -> bool:
        """Some block of the chain keeps a recurrent state (it cannot be cut back to an earlier position)."""
        return any(b.capabilities.keeps_state for b in self.blocks)

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
        """Allocate the slots (zeros); a state starts empty (None)."""
        self.slots = [self._new_slots(b) for b in self.blocks]

    def _new_slots(self, block: ServedBlock) -> BlockSlots:
        caps, g = block.capabilities, block.geometry
        if not caps.keeps_kv:
            return BlockSlots()
        shape = (self.batch, g.num_kv_heads, self.max_length)
        return BlockSlots(
            torch.zeros(*shape, g.key_head_dim, dtype=block.dtype, device=block.device),
            torch.zeros(*shape, g.value_head_dim, dtype=block.dtype, device=block.device),
            torch.zeros(self.batch, self.max_length, caps.indexer_dim, dtype=block.dtype, device=block.device)
            if caps.keeps_indexer else None)

    def release(self) -> None:
        """Drop the slots (a step computing at this moment keeps the ones it started with)."""
        self.slots = []

    def restart(self, position: int) -> None:
        """Continue from ``position`` (the caller checked `rewind_refusal`): 0 empties every state."""
        if position == 0:
            for slots in self.slots:
                slots.state = None
        self.position = position

    def reorder(self, hypo_ids: torch.Tensor | None) -> None:
        """Reorder the cached rows (beam search's ``hypo_ids``: row ``i`` becomes old row ``hypo_ids[i]``)."""
        pos = self.position
        if hypo_ids is None or pos == 0:
            return
        (hypo_ids,) = on_device(self.blocks, hypo_ids)
        with torch.inference_mode():
            for slots in self.slots:
                if slots.state is not None:
                    slots.state = tuple(None if t is None else t[hypo_ids] for t in slots.state)
                if slots.keys is None:
                    continue
                if slots.indexer is not None:
                    slots.indexer[:, :pos] = slots.indexer[hypo_ids, :pos]
                slots.keys[:, :, :pos] = slots.keys[hypo_ids, :, :pos]
                slots.values[:, :, :pos] = slots.values[hypo_ids, :, :pos]  # type: ignore[index]

    def step(self, hidden: torch.Tensor, prompts: Sequence[torch.Tensor | None],
             hypo_ids: torch.Tensor | None) -> torch.Tensor:
        """Process ``hidden`` ``[batch, n, hidden]`` at the current position alone; advance it by ``n``."""
        self.reorder(hypo_ids)
        if hidden.shape[1] == 0:
            (hidden,) = on_device(self.blocks, hidden)
            return hidden.cpu()
        return step_together([StepPart(self, hidden, prompts)])[0]


@dataclass
class StepPart:
    """One session's part of a step: ``hidden`` ``[batch, n, hidden]`` at its cache's position."""

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
    """Parts with equal keys may be computed together (see the module's two ways of joining rows).

    The same blocks; for a chain keeping a state or an indexer's keys, aligned rows: one position and one length
    (a state layer's step depends on where it stands, e.g. a first step differs from a continuation); for a
    family whose layers read positions from the cache length, one position.
    """
    cache = part.cache
    uids = tuple(b.uid for b in cache.blocks)
    caps = [b.capabilities for b in cache.blocks]
    if any(c.keeps_state or c.keeps_indexer for c in caps):
        return (uids, "aligned", cache.position, part.length)
    same_position = any(c.positions_from_cache_length for c in caps)
    return (uids, cache.position if same_position else None)


def _aligned(parts: Sequence[StepPart]) -> bool:
    first = parts[0]
    return all(p.cache.position == first.cache.position and p.length == first.length for p in parts)


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


def _cat(tensors: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    if tensors[0] is None:
        return None
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)  # type: ignore[arg-type]


def _stacked_past(pasts: Sequence[LayerPast]) -> LayerPast:
    """Aligned parts' pasts of one block, stacked along the batch (as they are for a single part)."""
    states = [p.state for p in pasts]
    state = None
    if states[0] is not None:
        state = tuple(_cat([s[j] for s in states]) for j in range(len(states[0])))  # type: ignore[index]
    return LayerPast(_cat([p.keys for p in pasts]), _cat([p.values for p in pasts]),
                     _cat([p.indexer for p in pasts]), state)


def _padded_past(pasts: Sequence[LayerPast], parts: Sequence[StepPart], spans: Sequence[slice],
                 past: int, device: torch.device) -> LayerPast:
    """Parts' K/V of one block, each row padded on the left to ``past`` tokens."""
    first = next((p for p in pasts if p.keys is not None), None)
    if past == 0 or first is None:
        return LayerPast()
    k0, v0 = first.keys, first.values
    batch = spans[-1].stop
    keys = torch.zeros(batch, k0.shape[1], past, k0.shape[3], dtype=k0.dtype, device=device)  # type: ignore[union-attr]
    values = torch.zeros(batch, v0.shape[1], past, v0.shape[3], dtype=v0.dtype, device=device)  # type: ignore[union-attr]
    for own, part, rows in zip(pasts, parts, spans):
        pos = part.cache.position
        if pos:
            keys[rows, :, past - pos:] = own.keys
            values[rows, :, past - pos:] = own.values
    return LayerPast(keys, values)


def _joined_input(parts: Sequence[StepPart], spans: Sequence[slice], new: int,
                  device: torch.device) -> torch.Tensor:
    if len(parts) == 1:
        return parts[0].hidden.to(device)
    first = parts[0].hidden
    hidden = torch.zeros(spans[-1].stop, new, first.shape[2], dtype=first.dtype, device=device)
    for p, rows in zip(parts, spans):
        hidden[rows, :p.length] = p.hidden.to(device)
    return hidden


def _with_prompts(hidden: torch.Tensor, parts: Sequence[StepPart], spans: Sequence[slice],
                  prompts: Sequence[Sequence[torch.Tensor | None]], b: int) -> torch.Tensor:
    """``hidden`` with each part's deep prompt of block ``b`` added (a new tensor: the caller's input is kept)."""
    if all(own[b] is None for own in prompts):
        return hidden
    hidden = hidden.clone()
    for p, rows, own in zip(parts, spans, prompts):
        if own[b] is not None:
            hidden[rows, :p.length] = add_prompt(hidden[rows, :p.length], own[b], p.cache.position)
    return hidden


def step_together(parts: Sequence[StepPart]) -> list[torch.Tensor]:
    """Each part's outputs (on the CPU), equal to what its session computes alone; every cache advances.

    Parts must share one `batch_key` and have ``length >= 1``.
    """
    blocks = parts[0].cache.blocks
    aligned = _aligned(parts)
    past = max(p.cache.position for p in parts)
    new = max(p.length for p in parts)
    spans: list[slice] = []
    for p in parts:
        start = spans[-1].stop if spans else 0
        spans.append(slice(start, start + p.rows))
    (probe,) = on_device(blocks, parts[0].hidden[:0])
    device = probe.device
    hidden = _joined_input(parts, spans, new, device)
    prompts = [on_device(blocks, *p.prompts) for p in parts]
    layout = None if aligned else _layout(parts, past, new, device)
    slots = [p.cache.slots for p in parts]  # a session released meanwhile keeps these
    states: list[list[Any]] = [[s.state for s in own] for own in slots]  # taken only when every block succeeded
    with torch.inference_mode(), adapter_rows([(p.cache.adapter, rows) for p, rows in zip(parts, spans)]):
        for b, block in enumerate(blocks):
            caps = block.capabilities
            hidden = _with_prompts(hidden, parts, spans, prompts, b)
            pasts = [own[b].past(p.cache.position) for own, p in zip(slots, parts)]
            joined = _stacked_past(pasts) if aligned else _padded_past(pasts, parts, spans, past, device)
            hidden, present = block.module(hidden, layer_past=joined.pack(caps), use_cache=True, rows=layout)
            if present is None:
                continue
            written = LayerPast.unpack(present, caps)
            for own, p, rows, kept in zip(slots, parts, spans, states):
                own[b].store(written, rows, past, p.cache.position, p.length)
                if caps.keeps_state and written.state is not None:
                    kept[b] = tuple(None if t is None else t[rows] for t in written.state)
    outputs = []
    for p, rows, own, kept in zip(parts, spans, slots, states):
        if p.cache.slots is own:  # not released meanwhile
            for s, state in zip(own, kept):
                s.state = state
        p.cache.position += p.length
        outputs.append(hidden[rows, :p.length].cpu())
    return outputs
