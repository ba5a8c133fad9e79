"""A bound on the bytes of one message a caller streams to this server, refused before it is read.

hivemind reads each message of a stream call (``rpc_inference``, ``rpc_forward_stream``,
``rpc_backward_stream``) whole: an 8-byte length, then that many bytes, whatever the length
says. `limit_stream_messages` makes the server process refuse (through
`distconf.dht.hivemind_rpc_compat.check_stream_message_lengths`) a message announcing more than
its limit before reading it: the stream ends, hivemind logs one line (`MessageTooLarge` is a
refusal, see `distconf.server.logfilter`) and nothing is allocated for it. The limit is
process-wide (a server process serves one handler); `stream_message_limit` derives it from
what the largest legitimate message can carry. The exact per-session bound is checked next,
from the tensors' headers (`distconf.server.wire_checks`).
"""

from __future__ import annotations

from distconf.dht.hivemind_rpc_compat import check_stream_message_lengths
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


def _check(length: int) -> None:
    limit = _state["limit"]
    if limit is not None and length > limit:
        raise MessageTooLarge(f"a streamed message of {length} bytes exceeds this server's limit of {limit} bytes")


def limit_stream_messages(max_bytes: int | None) -> None:
    """Refuse streamed messages of more than ``max_bytes`` in this process (None: no limit). Idempotent."""
    _state["limit"] = max_bytes
    check_stream_message_lengths(_check)
