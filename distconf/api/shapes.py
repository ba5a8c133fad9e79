"""OpenAI's response objects: completions, chat completions, their stream chunks, logprobs, usage.

Each function returns a plain dict in the exact shape OpenAI documents (and the
``openai`` package parses); `sse` frames one as a server-sent event.
"""

from __future__ import annotations

import json
from typing import Any

from distconf.client.textgen import Piece

__all__ = ["DONE", "sse", "usage", "chat_logprobs", "completion_logprobs", "chat_completion", "chat_chunk",
           "text_completion", "completion_chunk", "usage_chunk", "model_object"]

DONE = b"data: [DONE]\n\n"
"""The last event of every stream."""


def sse(obj: dict[str, Any]) -> bytes:
    """``data: {json}`` and a blank line."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's ``usage`` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _token(tokenizer: Any, token_id: int) -> str:
    return str(tokenizer.decode([token_id]))


def chat_logprobs(tokenizer: Any, pieces: list[Piece]) -> dict[str, Any]:
    """A chat choice's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}``."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = _token(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = [{**entry(p.token_id, p.logprob or 0.0),
                "top_logprobs": [entry(i, lp) for i, lp in p.top_logprobs]} for p in pieces]
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer: Any, pieces: list[Piece], offset: int = 0) -> dict[str, Any]:
    """A completion choice's ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, offsets, position = [], [], offset
    for p in pieces:
        tokens.append(_token(tokenizer, p.token_id))
        offsets.append(position)
        position += len(p.text)
    return {"tokens": tokens, "token_logprobs": [p.logprob for p in pieces],
            "top_logprobs": [{_token(tokenizer, i): lp for i, lp in p.top_logprobs} for p in pieces],
            "text_offset": offsets}


def chat_completion(cid: str, created: int, model: str, choices: list[dict[str, Any]],
                    use: dict[str, int]) -> dict[str, Any]:
    """A ``chat.completion``; each choice ``{index, text, finish_reason, logprobs}``."""
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": c["index"], "message": {"role": "assistant", "content": c["text"], "refusal": None},
                         "logprobs": c.get("logprobs"), "finish_reason": c["finish_reason"]} for c in choices],
            "usage": use, "system_fingerprint": None}


def chat_chunk(cid: str, created: int, model: str, index: int, delta: dict[str, Any],
               finish_reason: str | None = None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One ``chat.completion.chunk`` with one choice."""
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": None,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


def text_completion(cid: str, created: int, model: str, choices: list[dict[str, Any]],
                    use: dict[str, int]) -> dict[str, Any]:
    """A ``text_completion``; each choice ``{index, text, finish_reason, logprobs}``."""
    return {"id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": c["index"], "text": c["text"], "logprobs": c.get("logprobs"),
                         "finish_reason": c["finish_reason"]} for c in choices],
            "usage": use, "system_fingerprint": None}


def completion_chunk(cid: str, created: int, model: str, index: int, text: str, finish_reason: str | None = None,
                     logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed ``text_completion`` chunk (OpenAI streams completions with that object name)."""
    return {"id": cid, "object": "text_completion", "created": created, "model": model, "system_fingerprint": None,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


def usage_chunk(cid: str, created: int, model: str, kind: str, use: dict[str, int]) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": cid, "object": obj, "created": created, "model": model, "system_fingerprint": None,
            "choices": [], "usage": use}


def model_object(model_id: str, created: int) -> dict[str, Any]:
    """An entry of ``GET /v1/models``."""
    return {"id": model_id, "object": "model", "created": created, "owned_by": "distconf"}
