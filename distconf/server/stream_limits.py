"""A bound on the bytes of one message a caller streams to this server, refused before it is read.

hivemind reads each message of a stream call (``rpc_inference``, ``rpc_forward_stream``,
``rpc_backward_stream``) whole: an 8-byte length, then that many bytes, whatever the length
says. `limit_stream_messages` makes the server process refuse a message announcing more than
its limit before reading it: the stream ends, hivemind logs one line (`MessageTooLarge` is a
refusal, see `distconf.server.logfilter`) and nothing is allocated for it. The limit is
process-wide (a server process serves one handler); `stream_message_limit` derives it from
what the largest legitimate message can carry. The exact per-session bound is checked next,
from the tensors' headers (`distconf.server.wire_checks`).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from hivemind.p2p import P2P

from distconf.server.validation import RequestError

__all__ = ["MessageTooLarge", "limit_stream_messages", "stream_message_limit"]

_state: dict[str, int | None] = {"limit": None}
_SLACK = 2**20
"""Bytes of a message beyond its tensors' elements (metadata, framing)."""


class MessageTooLarge(RequestError):
    """A streamed message announcing more bytes than the server takes."""


def stream_message_limit(cache_tokens: int, hidden_size: int, part_bytes: int) -> int:
    """The largest message a caller may need: a step of every token the cache budget holds over the chain
    (``cache_tokens``), hidden states plus as much again for deep prompts, 8 bytes per element, or one part
    of a streamed forward/backward (``part_bytes``); with room for metadata."""
    return max(8 * 2 * cache_tokens * hidden_size, part_bytes) + _SLACK


async def _receive_raw_data(original: Any, reader: asyncio.StreamReader) -> bytes:
    limit = _state["limit"]
    if limit is None:
        return await original(reader)
    header = await reader.readexactly(P2P.HEADER_LEN)
    length = int.from_bytes(header, P2P.BYTEORDER)
    if length > limit:
        raise MessageTooLarge(f"a streamed message of {length} bytes exceeds this server's limit of {limit} bytes")
    return await reader.readexactly(length)


def limit_stream_messages(max_bytes: int | None) -> None:
    """Refuse streamed messages of more than ``max_bytes`` in this process (None: no limit). Idempotent."""
    current = P2P.__dict__["receive_raw_data"]
    if not getattr(current.__func__, "_distconf_limited", False):
        original = current.__func__
        patched = functools.wraps(original)(functools.partial(_receive_raw_data, original))
        patched._distconf_limited = True  # type: ignore[attr-defined]
        P2P.receive_raw_data = staticmethod(patched)  # type: ignore[method-assign]
    _state["limit"] = max_bytes
