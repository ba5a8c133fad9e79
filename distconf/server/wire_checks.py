"""Checks on serialized tensors made from their headers, before anything is decoded or allocated.

A tensor on the wire (``runtime_pb2.Tensor``) says its shape, dtype and compression next to
its buffer. `check_headers` refuses, from these alone, a dtype the blocks do not take, a
buffer whose length does not match ``shape x itemsize``, and requests larger than what the
caller may ask for (`WireBudget`: tokens per forward/backward, elements per inference step),
so a hostile header costs the server nothing beyond the bytes it already read.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from hivemind.proto import runtime_pb2

from distconf.rpc.protocol import WIRE_ITEMSIZE, buffer_problem
from distconf.server.validation import RequestError

__all__ = ["ACCEPTED_DTYPES", "WireBudget", "check_headers", "header_numel"]

ACCEPTED_DTYPES = WIRE_ITEMSIZE
"""Dtype names a request's tensors may have (hidden states and prompts are floating; ``hypo_ids`` int64)."""
_MAX_DIMS = 8


@dataclass(frozen=True)
class WireBudget:
    """What one request may carry: ``max_tokens`` rows x positions per 3-d tensor (None: unbounded)
    and ``max_numel`` elements in all (the hidden size times the tokens it may cover)."""

    max_numel: int
    max_tokens: int | None = None
    what: str = "request"


def header_numel(tensor: runtime_pb2.Tensor) -> int:
    """Elements of a serialized tensor from its header (`RequestError` for a malformed shape)."""
    size = tuple(tensor.size)
    if len(size) > _MAX_DIMS or any(d < 0 for d in size):
        raise RequestError(f"a tensor has shape {list(size)[:_MAX_DIMS + 1]}: at most {_MAX_DIMS} dimensions >= 0")
    return math.prod(size)


def _check_dtype(tensor: runtime_pb2.Tensor) -> None:
    if tensor.dtype not in ACCEPTED_DTYPES:
        raise RequestError(f"a tensor has dtype {tensor.dtype[:40]!r}; this server takes "
                           f"{', '.join(ACCEPTED_DTYPES)}")


def _check_buffer(tensor: runtime_pb2.Tensor, numel: int) -> None:
    problem = buffer_problem(tensor, numel)
    if problem is not None:
        raise RequestError(f"a {tensor.dtype[:40]} tensor of shape {list(tensor.size)[:_MAX_DIMS]} {problem}")


def check_headers(tensors: Iterable[runtime_pb2.Tensor], budget: WireBudget, *, whole: bool = True) -> int:
    """Check serialized tensors against ``budget`` from their headers; return their elements in all.

    ``whole=False`` for the first parts of streamed tensors: their buffers are a part of the
    tensor, so only the shape and dtype are checked here (the stream's bytes are bounded apart).
    """
    total = 0
    for tensor in tensors:
        _check_dtype(tensor)
        numel = header_numel(tensor)
        size = tuple(tensor.size)
        if budget.max_tokens is not None and len(size) == 3 and size[0] * size[1] > budget.max_tokens:
            raise RequestError(f"{budget.what} of {size[0]} x {size[1]} tokens exceeds the {budget.max_tokens} "
                               "tokens (batch x length) it may carry on this server")
        total += numel
        if total > budget.max_numel:
            raise RequestError(f"{budget.what} carries more than {budget.max_numel} tensor elements, the most it "
                               "may need")
        if whole:
            _check_buffer(tensor, numel)
    return total
