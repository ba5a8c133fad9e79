"""One-shot calls to one server for one span: ``rpc_forward`` and ``rpc_backward``, checked.

Shared by `RemoteSequential` (forward and backward through the route) and the verifier
(an independent server recomputing a span). Each call carries the request metadata,
sends hidden states in the server's compute dtype, and is bounded in time.
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


def forward_span(manager: Any, span: RemoteSpan, x: torch.Tensor, prompts: torch.Tensor | None) -> torch.Tensor:
    """One ``rpc_forward`` call to ``span``'s server; a reply of another shape or not finite is `BadReply`."""
    timeout, wait = _timeouts(manager)
    coro = call_forward(manager.swarm.p2p, span.peer_id, manager.chain_uid(span), x, span_prompts(prompts, span),
                        timeout=timeout, dtype=manager.server_dtype(span), metadata=manager.request_metadata())
    out = manager.swarm.run(coro, timeout=wait)
    return checked_tensor(out, x.shape, f"server …{span.peer_id[-6:]}", "hidden states").to(x.dtype)


def backward_span(manager: Any, span: RemoteSpan, inputs: torch.Tensor, grad: torch.Tensor,
                  prompts: torch.Tensor | None) -> list[torch.Tensor]:
    """One ``rpc_backward`` call to ``span``'s server (its reply unchecked: see `RemoteSequential`)."""
    timeout, wait = _timeouts(manager)
    coro = call_backward(manager.swarm.p2p, span.peer_id, manager.chain_uid(span), inputs, grad,
                         span_prompts(prompts, span), timeout=timeout,
                         dtype=manager.server_dtype(span), metadata=manager.request_metadata())
    return manager.swarm.run(coro, timeout=wait)
