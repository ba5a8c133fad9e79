"""`RemoteSequential`: all blocks of a model, run on the swarm, forward and backward.

Forward sends the hidden states (and the deep prompts of each span's blocks, if any)
through the route span by span (``rpc_forward``, or ``rpc_forward_stream`` for large
payloads) and keeps each span's inputs; backward goes through the same spans in reverse
(``rpc_backward``), collecting the deep prompts' gradients block by block. A failed span is retried on
another route over its blocks (the failed server is banned), as often as the retry
policy allows. Inference goes through `InferenceSession` (`inference_session`). With
``verify_fraction`` set, `verifier` spot-checks forward calls and inference sessions
(`distconf.client.verifier`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from distconf.client.reply_checks import BadReply, checked_tensor
from distconf.client.sequence_manager import SequenceManager
from distconf.client.session import InferenceSession
from distconf.client.span_calls import backward_span, forward_span, span_prompts
from distconf.client.verifier import Verifier
from distconf.dht import RemoteSpan
from distconf.loader.config_protocol import DistributedConfig

__all__ = ["RemoteSequential"]

logger = logging.getLogger(__name__)


class RemoteSequential(torch.nn.Module):
    """The model's decoder blocks, served by the swarm.

    :param config: the distributed config (every ClientConfig field is used).
    :param swarm: a `SwarmClient` connected to the swarm.
    """

    def __init__(self, config: DistributedConfig, swarm: Any) -> None:
        super().__init__()
        self.config = config
        self.swarm = swarm
        self.manager = SequenceManager(config, swarm)
        self.verifier = Verifier(self.manager)

    def __len__(self) -> int:
        return self.manager.num_blocks

    def forward(self, hidden_states: torch.Tensor, prompts: torch.Tensor | None = None) -> torch.Tensor:
        """All blocks on ``[batch, seq, hidden]`` (differentiable: backward runs on the servers too).

        ``prompts``: deep prompts ``[num_blocks, batch or 1, pre_seq_len, hidden]`` added by the
        servers to the first ``pre_seq_len`` positions of each block's input; gradients reach
        them through ``rpc_backward``.
        """
        if prompts is not None:
            _check_prompts(prompts, self.manager.num_blocks, hidden_states)
        return _RemoteBlocks.apply(hidden_states, prompts, self.manager, self.verifier)

    def inference_session(self, max_length: int, adapter: str | None = None) -> InferenceSession:
        """A new inference session holding up to ``max_length`` tokens (close it when done), through the LoRA
        ``adapter`` (None: the config's ``active_adapter``)."""
        manager = self.manager.with_adapter(adapter) if adapter else self.manager
        return InferenceSession(manager, max_length, dtype=_float_dtype(self.config), verifier=self.verifier)


def _check_prompts(prompts: torch.Tensor, num_blocks: int, hidden_states: torch.Tensor) -> None:
    batch, seq, hidden = hidden_states.shape
    shape = tuple(prompts.shape)
    if len(shape) != 4 or shape[0] != num_blocks or shape[1] not in (1, batch) or shape[3] != hidden:
        raise ValueError(f"deep prompts must have shape [{num_blocks}, {batch} or 1, pre_seq_len, {hidden}], "
                         f"got {list(shape)}")
    if shape[2] > seq:
        raise ValueError(f"deep prompts cover {shape[2]} positions but the input has only {seq}")


def _float_dtype(config: DistributedConfig) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def run_forward(manager: SequenceManager, x: torch.Tensor, start: int = 0, end: int | None = None,
                prompts: torch.Tensor | None = None, verifier: Verifier | None = None
                ) -> tuple[torch.Tensor, list[tuple[RemoteSpan, torch.Tensor]]]:
    """Blocks ``start..end-1`` on ``x``; returns the outputs and each span with its inputs.

    ``prompts``: deep prompts of all blocks of the model (indexed by block), or None.
    ``verifier``: spot-checks each span's result (`Verifier.check_forward`), or None.
    """
    end = manager.num_blocks if end is None else end
    records: list[tuple[RemoteSpan, torch.Tensor]] = []
    block = start
    while block < end:
        def attempt(_: int, block: int = block, x: torch.Tensor = x) -> tuple[RemoteSpan, torch.Tensor]:
            span = manager.plan_route(block, end)[0]
            try:
                return span, forward_span(manager, span, x, prompts)
            except Exception as exc:
                manager.on_failure(span.peer_id, exc)
                raise

        span, out = manager.with_retries(f"forward of blocks {block}..{end - 1}", attempt)
        manager.on_success(span.peer_id)
        if verifier is not None and verifier.enabled:
            out = verifier.check_forward(span, x, out, prompts)
        records.append((span, x))
        x, block = out, span.end
    return x, records


def run_backward(manager: SequenceManager, records: list[tuple[RemoteSpan, torch.Tensor]], grad: torch.Tensor,
                 prompts: torch.Tensor | None = None, verifier: Verifier | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients w.r.t. the first span's inputs and the deep prompts, through ``records`` in reverse.

    ``verifier``: spot-checks each hop's gradients (`Verifier.check_backward`), or None.
    """
    grad_prompts = None if prompts is None else torch.zeros_like(prompts)
    for span, inputs in reversed(records):
        grad = _backward_span(manager, span, inputs, grad, prompts, grad_prompts, verifier)
    return grad, grad_prompts


def _backward_span(manager: SequenceManager, span: RemoteSpan, inputs: torch.Tensor, grad: torch.Tensor,
                   prompts: torch.Tensor | None, grad_prompts: torch.Tensor | None,
                   verifier: Verifier | None = None) -> torch.Tensor:
    def attempt(n: int) -> torch.Tensor:
        if n == 0 and span.peer_id not in manager.banned():
            chain = [(span, inputs)]
        else:  # re-route the span's blocks (e.g. its server was caught since); recompute each new hop's inputs
            _, chain = run_forward(manager, inputs, span.start, span.end, prompts, verifier)
        g = grad
        hop_prompt_grads = []
        for hop, hop_inputs in reversed(chain):
            try:
                out = backward_span(manager, hop, hop_inputs, g, prompts)
            except Exception as exc:
                manager.on_failure(hop.peer_id, exc)
                raise
            if verifier is not None and verifier.enabled:
                out = verifier.check_backward(hop, hop_inputs, g, prompts, out)
            hop_prompt_grad = _check_backward_reply(hop, out, hop_inputs, span_prompts(prompts, hop))
            g = out[0].to(grad.dtype)
            if hop_prompt_grad is not None:
                hop_prompt_grads.append((hop, hop_prompt_grad))
        if grad_prompts is not None:  # only once the whole span succeeded: a retry must not count twice
            for hop, hop_grad in hop_prompt_grads:
                grad_prompts[hop.start:hop.end] += hop_grad.to(grad_prompts.dtype)
        return g

    return manager.with_retries(f"backward of blocks {span.start}..{span.end - 1}", attempt)


def _check_backward_reply(hop: RemoteSpan, out: list[torch.Tensor], inputs: torch.Tensor,
                          prompts: torch.Tensor | None) -> torch.Tensor | None:
    """Check a server's ``rpc_backward`` reply; return the deep prompts' gradient (shaped like ``prompts``).

    Prompts sent with batch 1 are broadcast by the server; some servers (Petals 2.x) reply
    with the gradient per batch row, which is summed here.
    """
    who = f"server …{hop.peer_id[-6:]}"
    if not out:
        raise BadReply(f"{who} returned no gradient")
    checked_tensor(out[0], inputs.shape, who, "a gradient")
    if prompts is None:
        return None
    grad = out[1] if len(out) > 1 else None
    if grad is not None and grad.shape != prompts.shape and prompts.shape[1] == 1 and grad.ndim == 4 \
            and grad.shape[1] == inputs.shape[0] and (grad.shape[0], *grad.shape[2:]) == (prompts.shape[0],
                                                                                           *prompts.shape[2:]):
        grad = grad.sum(dim=1, keepdim=True)
    if grad is None:
        raise BadReply(f"{who} returned no deep-prompt gradient for prompts {list(prompts.shape)}")
    return checked_tensor(grad, prompts.shape, who, "a deep-prompt gradient")


class _RemoteBlocks(torch.autograd.Function):
    """Autograd over the swarm: forward and backward both run on the servers."""

    @staticmethod
    def forward(ctx: Any, hidden_states: torch.Tensor, prompts: torch.Tensor | None,
                manager: SequenceManager, verifier: Verifier) -> torch.Tensor:
        x = hidden_states.detach().cpu()
        sent_prompts = None if prompts is None else prompts.detach().cpu().to(x.dtype)
        out, records = run_forward(manager, x, prompts=sent_prompts, verifier=verifier)
        ctx.manager, ctx.records, ctx.prompts, ctx.verifier = manager, records, sent_prompts, verifier
        ctx.prompts_meta = None if prompts is None else (prompts.device, prompts.dtype)
        return out.to(hidden_states.device, hidden_states.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grad, grad_prompts = run_backward(ctx.manager, ctx.records,
                                          grad_output.detach().cpu().to(ctx.records[0][1].dtype), ctx.prompts,
                                          ctx.verifier)
        if grad_prompts is not None:
            grad_prompts = grad_prompts.to(*ctx.prompts_meta)
        return grad.to(grad_output.device, grad_output.dtype), grad_prompts, None, None
