"""What ``distconf generate`` needs beyond `distconf.client.textgen`: top-k sampling and models without a tokenizer.

`stream_with_top_k` is `distconf.client.textgen.stream_text` with two additions kept out of
the shared core: ``--top-k`` (the logits outside the K most likely tokens are dropped before
the core's temperature and top-p) and a model without a tokenizer (its pieces carry token ids
and no text).
"""

from __future__ import annotations

from typing import Any

import torch

from distconf.client.textgen import Sampling, TextStream

__all__ = ["NoTokenizer", "stream_with_top_k"]


class NoTokenizer:
    """Stands in for a missing tokenizer: every token decodes to no text (the caller prints the ids)."""

    eos_token_id = None

    def decode(self, ids: Any, **kwargs: Any) -> str:
        """No text for any ids."""
        return ""


class _TopKStream(TextStream):
    """A `TextStream` that samples among the ``top_k`` most likely tokens only."""

    top_k: int | None = None

    def _pick(self, logits: torch.Tensor) -> int:
        if self.top_k is not None and self.sampling.temperature > 0 and self.top_k < logits.shape[-1]:
            floor = logits.topk(self.top_k).values[-1]
            logits = logits.masked_fill(logits < floor, float("-inf"))
        return super()._pick(logits)


def stream_with_top_k(model: Any, tokenizer: Any, input_ids: list[int], sampling: Sampling,
                      top_k: int | None = None) -> TextStream:
    """`distconf.client.textgen.stream_text`, with ``top_k`` (None: all tokens) and ``tokenizer`` may be None."""
    stream = _TopKStream(model, tokenizer if tokenizer is not None else NoTokenizer(), input_ids, sampling)
    stream.top_k = top_k
    return stream
