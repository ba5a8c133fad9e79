"""Whether a model is causal: its outputs for the first tokens must not change when later tokens are appended.

A chain of blocks generating step by step with a KV cache computes each token from the ones
before it only; a model whose tokens attend to later ones (bidirectional attention over its
whole input) gives other full-sequence outputs, which no step-by-step run can reproduce.
The drafter refuses such a model in one line, and the check names the cause when its
cached runs disagree with the full sequence.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NON_CAUSAL_TOLERANCE", "later_tokens_change", "non_causal_cause"]

NON_CAUSAL_TOLERANCE = 1e-3
"""Relative change of the first tokens' logits above which the model counts as not causal (far above float noise)."""

_TOKENS = 6


def later_tokens_change(model: Any, vocab_size: int) -> float | None:
    """How much the logits of the first tokens change, relative to their size, when one token is appended
    (None when the model does not run on token ids or returns no logits)."""
    import torch

    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(1, max(2, min(int(vocab_size), 200)), (1, _TOKENS), generator=generator)
    try:
        with torch.no_grad():
            longer = model(input_ids=ids, use_cache=False).logits
            shorter = model(input_ids=ids[:, :-1], use_cache=False).logits
    except Exception:  # the check's own runs report why the model does not run
        return None
    if not isinstance(longer, torch.Tensor) or not isinstance(shorter, torch.Tensor):
        return None
    first = longer[:, : shorter.shape[1]]
    if first.shape != shorter.shape:
        return None
    scale = max(1.0, float(shorter.abs().max()))
    return float((first - shorter).abs().max()) / scale


def non_causal_cause(model: Any, vocab_size: int) -> str | None:
    """One line saying the model is not causal, or None when it is (or cannot be probed)."""
    change = later_tokens_change(model, vocab_size)
    if change is None or change <= NON_CAUSAL_TOLERANCE:
        return None
    return (f"the model is not causal: its outputs for the first {_TOKENS - 1} tokens change (by {change:.1e}, "
            f"relative) when a {_TOKENS}th token is appended, so its tokens attend to later ones (bidirectional "
            "attention); a chain of blocks computing step by step with a KV cache cannot reproduce its "
            "full-sequence outputs")
