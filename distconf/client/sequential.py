"""`RemoteSequential`: all blocks of a model, run on the swarm, forward and backward.

Forward sends the hidden states through the route span by span (``rpc_forward``, or
``rpc_forward_stream`` for large payloads) and keeps each span's inputs; backward goes
through the same spans in reverse (``rpc_backward``). A failed span is retried on
another route over its blocks (the failed server is banned), as often as the retry
policy allows. Inference goes through `InferenceSession` (`inference_session`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from distconf.client.routing import SequenceManager
from distconf.client.session import InferenceSession
from distconf.dht import RemoteSpan
from distconf.rpc.calls import call_backward, call_forward

__all__ = ["RemoteSequential"]

logger = logging.getLogger(__name__)


class RemoteSequential(torch.nn.Module):
    """The model's decoder blocks, served by the swarm.

    :param config: the distributed config (every ClientConfig field is used).
    :param swarm: a `SwarmClient` connected to the swarm.
    """

    def __init__(self, config: Any, swarm: Any) -> None:
        super().__init__()
        self.config = config
        self.swarm = swarm
        self.manager = SequenceManager(config, swarm)

    def __len__(self) -> int:
        return self.manager.num_blocks

    def forward(self, hidden_states: torch.Tensor, prompts: torch.Tensor | None = None) -> torch.Tensor:
        """All blocks on ``[batch, seq, hidden]`` (differentiable: backward runs on the servers too)."""
        return _RemoteBlocks.apply(hidden_states, self.manager, prompts)

    def inference_session(self, max_length: int) -> InferenceSession:
        """A new inference session holding up to ``max_length`` tokens (close it when done)."""
        return InferenceSession(self.manager, max_length, dtype=_float_dtype(self.config))


def _float_dtype(config: Any) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def _timeouts(manager: SequenceManager) -> tuple[float, float]:
    """The call's own timeout and the (longer) bound on waiting for it from this thread."""
    timeout = float(manager.config.request_timeout)
    return timeout, timeout + float(manager.config.connect_timeout) + 1


def _forward_span(manager: SequenceManager, span: RemoteSpan, x: torch.Tensor) -> torch.Tensor:
    """One ``rpc_forward`` call to ``span``'s server (checked: same shape back)."""
    timeout, wait = _timeouts(manager)
    coro = call_forward(manager.swarm.p2p, span.peer_id, manager.chain_uid(span), x, timeout=timeout,
                        dtype=manager.server_dtype(span), metadata=manager.request_metadata())
    out = manager.swarm.run(coro, timeout=wait)
    if out.shape != x.shape:
        raise ConnectionError(f"…{span.peer_id[-6:]} returned {out.shape} for {x.shape}")
    return out.to(x.dtype)


def _backward_hop(manager: SequenceManager, span: RemoteSpan, inputs: torch.Tensor, grad: torch.Tensor
                  ) -> list[torch.Tensor]:
    """One ``rpc_backward`` call to ``span``'s server."""
    timeout, wait = _timeouts(manager)
    coro = call_backward(manager.swarm.p2p, span.peer_id, manager.chain_uid(span), inputs, grad, timeout=timeout,
                         dtype=manager.server_dtype(span), metadata=manager.request_metadata())
    return manager.swarm.run(coro, timeout=wait)


def run_forward(manager: SequenceManager, x: torch.Tensor, start: int = 0, end: int | None = None
                ) -> tuple[torch.Tensor, list[tuple[RemoteSpan, torch.Tensor]]]:
    """Blocks ``start..end-1`` on ``x``; returns the outputs and each span with its inputs."""
    end = manager.num_blocks if end is None else end
    records: list[tuple[RemoteSpan, torch.Tensor]] = []
    block = start
    while block < end:
        def attempt(_: int, block: int = block, x: torch.Tensor = x) -> tuple[RemoteSpan, torch.Tensor]:
            span = manager.make_route(block, end)[0]
            try:
                return span, _forward_span(manager, span, x)
            except Exception as exc:
                manager.on_failure(span.peer_id, exc)
                raise

        span, out = manager.with_retries(f"forward of blocks {block}..{end - 1}", attempt)
        manager.on_success(span.peer_id)
        records.append((span, x))
        x, block = out, span.end
    return x, records


def run_backward(manager: SequenceManager, records: list[tuple[RemoteSpan, torch.Tensor]],
                 grad: torch.Tensor) -> torch.Tensor:
    """Gradient w.r.t. the first span's inputs, through ``records`` in reverse."""
    for span, inputs in reversed(records):
        grad = _backward_span(manager, span, inputs, grad)
    return grad


def _backward_span(manager: SequenceManager, span: RemoteSpan, inputs: torch.Tensor, grad: torch.Tensor
                   ) -> torch.Tensor:
    def attempt(n: int) -> torch.Tensor:
        if n == 0:
            chain = [(span, inputs)]
        else:  # re-route the span's blocks; recompute the inputs of each new hop
            _, chain = run_forward(manager, inputs, span.start, span.end)
        g = grad
        for hop, hop_inputs in reversed(chain):
            try:
                out = _backward_hop(manager, hop, hop_inputs, g)
            except Exception as exc:
                manager.on_failure(hop.peer_id, exc)
                raise
            if not out or out[0].shape != hop_inputs.shape:
                raise ConnectionError(f"…{hop.peer_id[-6:]} returned a gradient of the wrong shape")
            g = out[0].to(grad.dtype)
        return g

    return manager.with_retries(f"backward of blocks {span.start}..{span.end - 1}", attempt)


class _RemoteBlocks(torch.autograd.Function):
    """Autograd over the swarm: forward and backward both run on the servers."""

    @staticmethod
    def forward(ctx: Any, hidden_states: torch.Tensor, manager: SequenceManager, prompts: Any) -> torch.Tensor:
        x = hidden_states.detach().cpu()
        out, records = run_forward(manager, x)
        ctx.manager, ctx.records = manager, records
        return out.to(hidden_states.device, hidden_states.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grad = run_backward(ctx.manager, ctx.records, grad_output.detach().cpu().to(ctx.records[0][1].dtype))
        return grad.to(grad_output.device, grad_output.dtype), None, None
