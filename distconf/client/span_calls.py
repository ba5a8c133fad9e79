"""One-shot calls to one server for one span: ``rpc_forward`` and ``rpc_backward``, checked.

Shared by `RemoteSequential` (forward and backward through the route) and the verifier
(an independent server recomputing a span). Each call carries the request metadata,
sends hidden states in the server's compute dtype, and is bounded in time. A batch larger
than the server takes in one request (``max_forward_tokens`` in its ``rpc_info``) is sent
in pieces of whole rows.
"""

from __future__ import annotations

from typing import Any

import torch

from distconf.client.reply_checks import checked_tensor
from distconf.dht import RemoteSpan
from distconf.rpc.calls import call_backward, call_forward

__all__ = ["forward_span", "backward_span", "span_prompts"]


def _timeouts(manager: Any) -> tuple[float, float]:
    """The call's own timeout and the (longer) bound on waiting for it from this thread."""
    timeout = float(manager.config.request_timeout)
    return timeout, timeout + float(manager.config.connect_timeout) + 1


def span_prompts(prompts: torch.Tensor | None, span: RemoteSpan) -> torch.Tensor | None:
    """The deep prompts of ``span``'s blocks (``prompts`` is indexed by block), or None."""
    return None if prompts is None else prompts[span.start:span.end]


def row_pieces(manager: Any, span: RemoteSpan, shape: torch.Size) -> list[slice]:
    """The rows of a ``[batch, seq, ...]`` request to ``span``'s server, in pieces it takes in one call.

    Raises `ValueError` when one row alone is longer than the server's ``max_forward_tokens``.
    """
    batch, seq = int(shape[0]), int(shape[1])
    limit = manager.rpc_info(span).get("max_forward_tokens")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0 or batch * seq <= limit:
        return [slice(0, batch)]
    if seq > limit:
        raise ValueError(f"a sequence of {seq} tokens is longer than server …{span.peer_id[-6:]} takes in one "
                         f"forward or backward call ({limit} tokens)")
    rows = limit // seq
    return [slice(i, min(i + rows, batch)) for i in range(0, batch, rows)]


def _rows(prompts: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    """Deep prompts for ``rows`` (prompts given for one row serve every row)."""
    return prompts if prompts is None or prompts.shape[1] == 1 else prompts[:, rows]


def forward_span(manager: Any, span: RemoteSpan, x: torch.Tensor, prompts: torch.Tensor | None) -> torch.Tensor:
    """``rpc_forward`` to ``span``'s server; a reply of another shape or not finite is `BadReply`."""
    timeout, wait = _timeouts(manager)
    outputs = []
    for rows in row_pieces(manager, span, x.shape):
        coro = call_forward(manager.swarm.p2p, span.peer_id, manager.chain_uid(span), x[rows],
                            span_prompts(_rows(prompts, rows), span), timeout=timeout,
                            dtype=manager.server_dtype(span), metadata=manager.request_metadata(),
                            compression=manager.server_compression(span))
        out = manager.swarm.run(coro, timeout=wait)
        outputs.append(checked_tensor(out, x[rows].shape, f"server …{span.peer_id[-6:]}", "hidden states"))
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs)).to(x.dtype)


def backward_span(manager: Any, span: RemoteSpan, inputs: torch.Tensor, grad: torch.Tensor,
                  prompts: torch.Tensor | None) -> list[torch.Tensor]:
    """``rpc_backward`` to ``span``'s server: ``[grad_inputs]`` or ``[grad_inputs, grad_prompts]`` (unchecked:
    see `RemoteSequential`). Pieces' prompt gradients are summed (prompts of one row) or joined by row."""
    timeout, wait = _timeouts(manager)
    pieces = row_pieces(manager, span, inputs.shape)
    replies = []
    for rows in pieces:
        coro = call_backward(manager.swarm.p2p, span.peer_id, manager.chain_uid(span), inputs[rows], grad[rows],
                             span_prompts(_rows(prompts, rows), span), timeout=timeout,
                             dtype=manager.server_dtype(span), metadata=manager.request_metadata(),
                             compression=manager.server_compression(span))
        replies.append(manager.swarm.run(coro, timeout=wait))
    if len(replies) == 1:
        return replies[0]
    if any(len(r) != len(replies[0]) or not r for r in replies):
        return replies[0][:0]  # malformed: the caller's checks refuse it
    joined = [torch.cat([r[0] for r in replies])]
    if len(replies[0]) > 1 and prompts is not None:
        grads = [r[1] for r in replies]
        if prompts.shape[1] == 1:
            grads = [g.sum(dim=1, keepdim=True) if g.ndim == 4 and g.shape[1] == p.stop - p.start else g
                     for g, p in zip(grads, pieces, strict=True)]
            joined.append(torch.stack(grads).sum(dim=0) if len({g.shape for g in grads}) == 1 else grads[0])
        else:
            joined.append(torch.cat(grads, dim=1))
    return joined
