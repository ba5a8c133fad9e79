"""Step 3 of the check: the blocks against the HF model's hidden states.

Three runs through the chain of blocks: the full sequence (each block on its layer's
reference input), token by token carrying each block's KV cache, and in multi-token steps
after a prefix (masks sized on past + new tokens).
"""

from __future__ import annotations

from typing import Any

from distconf.tools.checker.failures import located_failure
from distconf.tools.checker.reference import SEQ_LEN
from distconf.tools.checker.result import TOLERANCE, CheckResult

__all__ = ["CHUNKS", "max_rel_diff", "run_in_steps", "compare_full", "compare_cached", "chunk_sizes"]

CHUNKS = (4, 2, 1, 2)
"""Step sizes of the chunked run (they sum to `SEQ_LEN`)."""
assert sum(CHUNKS) == SEQ_LEN


def chunk_sizes(length: int) -> list[int]:
    """`CHUNKS` cut or extended to ``length`` positions: the layer stack may see another sequence length than the
    model's input (a byte-level model's stack runs on patches of tokens)."""
    sizes, left = [], length
    for size in CHUNKS:
        if left <= 0:
            break
        sizes.append(min(size, left))
        left -= sizes[-1]
    return sizes + ([left] if left > 0 else [])


def max_rel_diff(a: Any, b: Any) -> float:
    """Largest |a - b| relative to max(1, |b|)."""
    scale = max(1.0, float(b.abs().max()))
    return float((a - b).abs().max()) / scale


def run_in_steps(blocks: list[Any], hidden: Any, sizes: list[int]) -> tuple[Any, list[Any]]:
    """Feed ``hidden`` through the chain in steps of ``sizes`` tokens, carrying each block's cache."""
    import torch

    caches: list[Any] = [None] * len(blocks)
    outputs, start = [], 0
    for size in sizes:
        step = hidden[:, start:start + size]
        for i, block in enumerate(blocks):
            step, caches[i] = block(step, layer_past=caches[i], use_cache=True)
        outputs.append(step)
        start += size
    return torch.cat(outputs, dim=1), caches


def _keeps_something(block: Any) -> bool:
    """The block's layer keeps K/V or a state (`distconf.blocks.layer_types`); an MLP-only layer keeps nothing."""
    caps = block.capabilities
    return caps.keeps_kv or caps.keeps_state


def compare_full(cls: type, blocks: list[Any], ref_in: Any, ref_out: list[Any], result: CheckResult) -> None:
    """Each block on its layer's reference input, full sequence, no cache."""
    import torch

    hidden, worst = ref_in, 0.0
    with torch.no_grad():
        for i, block in enumerate(blocks):
            out, _ = block(hidden)
            diff = max_rel_diff(out, ref_out[i])
            worst = max(worst, diff)
            if diff > TOLERANCE:
                result.full_diff = diff
                raise located_failure(cls, ("block",), f"block {i} output differs from the model's layer {i} by "
                                      f"{diff:.2e} (full sequence; tolerance {TOLERANCE:.0e}): check "
                                      "block.position, block.mask and block.call")
            hidden = ref_out[i]  # compare each layer on its own reference input
    result.full_diff = worst


def compare_cached(cls: type, blocks: list[Any], ref_in: Any, ref_out: list[Any], result: CheckResult) -> list[Any]:
    """Token-by-token and chunked runs with the KV cache, and the whole chain; return the token-by-token caches."""
    import torch

    with torch.no_grad():
        length = int(ref_in.shape[1])
        incremental, caches = run_in_steps(blocks, ref_in, [1] * length)
        empty = [i for i, c in enumerate(caches) if c is None and _keeps_something(blocks[i])]
        if empty:
            keyword = cls.family_spec.block.call.cache_argument  # type: ignore[attr-defined]
            raise located_failure(cls, ("block", "call", "cache_argument"),
                                  f"block {empty[0]} kept no KV cache: the layer never wrote to the "
                                  f"cache passed as {keyword}=...; its forward takes the cache under another keyword")
        chunked, _ = run_in_steps(blocks, ref_in, chunk_sizes(length))
        chained = ref_in  # full-sequence chain through our blocks, for a like-for-like comparison
        for block in blocks:
            chained, _ = block(chained)
    diffs = [max_rel_diff(run, ref_out[-1]) for run in (incremental, chunked, chained)]
    diff = max(diffs)
    result.incremental_diff = diff
    if diff > TOLERANCE:
        state = cls.family_spec.state  # type: ignore[attr-defined]
        if state is not None and state.continuation == "any_length" and max(diffs[0], diffs[2]) <= TOLERANCE:
            raise located_failure(cls, ("state", "continuation"), f"steps of {'/'.join(map(str, CHUNKS))} tokens "
                                  f"differ from the model by {diffs[1]:.2e} (one-token steps and the whole sequence "
                                  "agree): the recurrent layer reads its state only in one-token steps; set "
                                  "state.continuation: one_token")
        raise located_failure(cls, ("block",), f"token-by-token outputs with the KV cache differ from the model by "
                              f"{diff:.2e} (tolerance {TOLERANCE:.0e}): check kv_cache.layer_writes, "
                              "block.position and block.mask")
    return caches
