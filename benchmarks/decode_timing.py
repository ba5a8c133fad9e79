"""Seconds between decode steps of one greedy generation: the per-token figure the swarm benchmarks share."""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch

__all__ = ["step_gaps", "timed_greedy"]


class _Clock:
    """A logits processor that stamps the time of every decode step."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores


def timed_greedy(model: Any, ids: torch.Tensor, new_tokens: int, *, pad_token_id: int = 0,
                 full_length: bool = False) -> tuple[list[int], list[float]]:
    """The new token ids of one greedy generation and the ``perf_counter`` time each one's logits were ready.

    ``full_length``: no early stop (exactly ``new_tokens`` tokens).
    """
    from transformers import LogitsProcessorList

    clock = _Clock()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens if full_length else None, do_sample=False,
                             pad_token_id=pad_token_id, logits_processor=LogitsProcessorList([clock]))
    return out[0, ids.shape[1]:].tolist(), clock.stamps


def step_gaps(model: Any, ids: torch.Tensor, new_tokens: int, *, pad_token_id: int = 0,
              full_length: bool = False) -> list[float]:
    """Seconds between consecutive decode steps of one greedy generation (``full_length``: no early stop)."""
    _, stamps = timed_greedy(model, ids, new_tokens, pad_token_id=pad_token_id, full_length=full_length)
    return [b - a for a, b in itertools.pairwise(stamps)]
