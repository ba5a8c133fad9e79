"""Between token ids and text: the `Piece` a stream yields per token, incremental decoding that never splits a
character (`IncrementalDecoder`), the text held back while it may begin a stop string (`held_back`), the chat
template's input ids and the ids that end a generation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["IncrementalDecoder", "Piece", "chat_input_ids", "eos_token_ids", "held_back"]


@dataclass(frozen=True)
class Piece:
    """One new token: the text it completes (may be empty), its id, and its log-probability.

    ``logprob`` is the token's log-probability under the model's (untempered) distribution;
    ``top_logprobs`` holds ``(token_id, logprob)`` of the most likely tokens when asked for.
    """

    text: str
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


class IncrementalDecoder:
    """Decodes a growing list of token ids into text pieces that never split a character.

    Keeps a short window of ids (as streaming detokenizers do) so that the text of a
    token that depends on its neighbours (leading spaces, multi-byte characters) is
    right, at a cost per token independent of the text's length.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] were decoded into text already given out
        self.read = 0

    def _decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:  # a model without a tokenizer: pieces carry ids, no text
            return ""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def add(self, token_id: int) -> str:
        """Append a token; return the new complete text (empty while a character is incomplete)."""
        self.ids.append(int(token_id))
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever text is still held (an incomplete character at the end decodes as is)."""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):] if after.startswith(before) else ""


def held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is the beginning of a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """Token ids that end a generation: the model's generation config's and the tokenizer's eos."""
    ids: set[int] = set()
    for value in (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                  getattr(model.config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def chat_input_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of ``messages`` (``[{"role", "content"}, ...]``) through the tokenizer's chat template.

    The template's generation prompt is added (the model answers as the assistant).
    Raises ValueError when the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template: use a raw prompt (completions) instead")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    ids = out["input_ids"]
    if isinstance(ids, torch.Tensor):
        ids = ids.reshape(-1).tolist()
    elif ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(i) for i in ids]
