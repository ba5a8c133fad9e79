"""What a client accepts from a server: replies of the right size, shape and dtype, and finite.

A reply that fails a check is the server's failure (`BadReply`, a `ConnectionError`): the
caller bans the server and fails over, as for a server that hangs or closes. Sizes and
dtypes are checked on the serialized header, before anything is decoded or allocated; an
inference stream also refuses a reply longer than `max_reply_bytes` before reading it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from hivemind.proto import runtime_pb2

from distconf.rpc.protocol import buffer_problem, deserialize_tensors

__all__ = ["BadReply", "REPLY_DTYPES", "checked_tensor", "checked_reply", "max_reply_bytes"]

REPLY_DTYPES = ("float32", "float16", "bfloat16")
"""Dtype names a reply's hidden states or gradients may carry (their bytes on the wire: `WIRE_ITEMSIZE`)."""

_OVERHEAD = 64 * 1024  # message framing and metadata around the tensors


class BadReply(ConnectionError):
    """A server's reply is malformed, of the wrong size, shape or dtype, or not finite."""


def max_reply_bytes(*shapes: Sequence[int]) -> int:
    """The most bytes a reply holding tensors of ``shapes`` needs (float32 values plus framing)."""
    return sum(4 * math.prod(shape) for shape in shapes) + _OVERHEAD


def _check_header(proto: runtime_pb2.Tensor, shape: tuple[int, ...], who: str, what: str) -> None:
    got = tuple(proto.size)
    if got != shape:
        raise BadReply(f"{who} returned {what} of shape {list(got)} for {list(shape)}")
    if proto.dtype not in REPLY_DTYPES:
        raise BadReply(f"{who} returned {what} of dtype {proto.dtype[:40]!r} (expected one of "
                       f"{', '.join(REPLY_DTYPES)})")
    problem = buffer_problem(proto, math.prod(shape))
    if problem is not None:
        raise BadReply(f"{who} returned {what} of {len(proto.buffer)} bytes: its {proto.dtype} tensor {problem}")


def checked_tensor(tensor: torch.Tensor, shape: Sequence[int], who: str, what: str = "a tensor") -> torch.Tensor:
    """``tensor`` if it is floating, of ``shape`` and finite; else `BadReply`."""
    if tuple(tensor.shape) != tuple(shape):
        raise BadReply(f"{who} returned {what} of shape {list(tensor.shape)} for {list(shape)}")
    if not tensor.is_floating_point():
        raise BadReply(f"{who} returned {what} of dtype {tensor.dtype}")
    if not bool(torch.isfinite(tensor).all()):
        raise BadReply(f"{who} returned {what} with non-finite values")
    return tensor


def checked_reply(protos: Sequence[runtime_pb2.Tensor], shape: Sequence[int], who: str,
                  what: str = "hidden states") -> torch.Tensor:
    """The first tensor of a reply, checked before decoding (shape, dtype, size) and after (finite)."""
    if not protos:
        raise BadReply(f"{who} returned no tensor")
    shape = tuple(int(s) for s in shape)
    _check_header(protos[0], shape, who, what)
    try:
        tensor = deserialize_tensors(protos[:1])[0]
    except Exception as exc:
        raise BadReply(f"{who} returned {what} that cannot be decoded: {exc}") from None
    return checked_tensor(tensor, shape, who, what)
