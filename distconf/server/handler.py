"""The block server's P2P servicer: Petals 2.x RPCs over the blocks this server holds.

`BlockHandler` implements `distconf.rpc.BlockServicer` (handlers are registered under
Petals 2.x's names). Compute runs in one compute thread; the event loop only parses,
validates and moves messages, so one slow or hostile caller does not stall the others:
every request's size is checked from its tensors' headers before they are decoded (tokens
per forward/backward at most ``max_forward_tokens``), and a request past ``request_timeout``
is refused in one line, its queued compute dropped.
Inference sessions and pushes are owned by `distconf.server.sessions.Sessions`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any, AsyncIterator  # noqa: UP035 (hivemind reads typing.AsyncIterator hints)

import torch
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import split_for_streaming
from hivemind.utils.tensor_descr import BatchTensorDescriptor

from distconf.rpc.protocol import (
    CACHE_TOKENS_AVAILABLE,
    DEFAULT_MAX_MSG_SIZE,
    ProtocolError,
    deserialize_tensors,
    loads_metadata,
    serialize_tensors,
)
from distconf.rpc.servicer import BlockServicer
from distconf.server.compute import ServedBlock, backward_chain, forward_chain
from distconf.server.logfilter import REFUSALS, logged_refusal
from distconf.server.memory import CacheBudget
from distconf.server.scheduler import BatchLimits, ComputeScheduler
from distconf.server.sessions import Sessions
from distconf.server.settings import HandlerSettings
from distconf.server.stream_limits import limit_stream_messages, stream_message_limit
from distconf.server.validation import (
    RequestError,
    check_adapter,
    check_hidden,
    check_prompts,
    served_chain,
    unpack_tensors,
)
from distconf.server.wire_checks import WireBudget, check_headers

__all__ = ["BlockHandler", "HandlerSettings"]

logger = logging.getLogger(__name__)


class BlockHandler(BlockServicer):
    """Serves ``blocks`` (consecutive, loaded) with one shared KV-cache ``budget``."""

    def __init__(self, blocks: Sequence[ServedBlock], budget: CacheBudget, settings: HandlerSettings,
                 executor: Executor, limits: BatchLimits | None = None,
                 activation_bytes: Callable[[int, int, int], int] | None = None) -> None:
        """``limits``, ``activation_bytes``: how inference steps of several sessions are batched
        (see `ComputeScheduler`; default `BatchLimits()`, no memory estimate)."""
        self.blocks = {b.uid: b for b in blocks}
        self.ordered = list(blocks)
        self.budget, self.settings, self.executor = budget, settings, executor
        self.compute = ComputeScheduler(executor, limits, activation_bytes)
        self.p2p: P2P | None = None
        self.stats: Counter[str] = Counter()
        self.sessions = Sessions(self.blocks, budget, self.compute, settings, self.stats)

    # ------------------------------------------------------------------ lifecycle and helpers

    async def start(self, p2p: P2P) -> None:
        """Register the handlers on ``p2p`` (the DHT's daemon: the server's peer id is the DHT's), and bound
        the bytes of one streamed message in this process (`limit_stream_messages`)."""
        self.p2p = self.sessions.p2p = p2p
        chain_tokens = self.budget.total_bytes // max(1, sum(b.kv_bytes_per_token for b in self.ordered))
        limit_stream_messages(stream_message_limit(chain_tokens, self.settings.hidden_size, DEFAULT_MAX_MSG_SIZE))
        await self.add_p2p_handlers(p2p)

    async def stop(self) -> None:
        """Unregister the handlers."""
        if self.sessions.pushes is not None:
            self.sessions.pushes.close()
        if self.p2p is not None:
            await self.remove_p2p_handlers(self.p2p)
            limit_stream_messages(None)

    @property
    def max_kv_bytes_per_token(self) -> int:
        """KV bytes per token of the largest served block (a block keeping a per-sequence state: that
        state spread over ``inference_max_length`` tokens, what a session charges per token of its length)."""
        length = max(1, self.settings.inference_max_length)
        return max(max(1, b.kv_bytes_per_token + -(-b.state_bytes_per_sequence // length)) for b in self.ordered)

    def cache_tokens_available(self) -> int:
        """Free cache bytes // KV bytes per token of one block (Petals 2.x's ``cache_tokens_available``)."""
        return self.budget.bytes_left // self.max_kv_bytes_per_token

    def check_uids(self, uids: str) -> list[ServedBlock]:
        """The served blocks named by a chain string, in order; `RequestError` if unknown or not consecutive."""
        return served_chain(self.blocks, uids)

    def serialize_output(self, tensor: torch.Tensor) -> runtime_pb2.Tensor:
        """A reply tensor in the server's dtype."""
        return serialize_tensors([tensor], self.settings.dtype, self.settings.compression)[0]

    # ------------------------------------------------------------------ rpc_info

    def block_info(self, block: ServedBlock) -> dict[str, Any]:
        """Schemas of a block (Petals 2.x's ``get_info`` keys)."""
        descr = BatchTensorDescriptor(1, 2048, self.settings.hidden_size, dtype=self.settings.dtype,
                                      compression=self.settings.compression)
        args_schema = (descr,)
        return {
            "forward_schema": (args_schema, {}), "args_schema": args_schema, "kwargs_schema": {},
            "outputs_schema": (descr,), "keyword_names": (),
            "inference_schema": ((descr, BatchTensorDescriptor((), dtype=self.settings.dtype),
                                  BatchTensorDescriptor((), dtype=torch.int64)), {}),
        }

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        """Server info; with a uid, also that block's schemas."""
        s = self.settings
        result: dict[str, Any] = {
            "version": s.version, "dht_client_mode": s.dht_client_mode,
            CACHE_TOKENS_AVAILABLE: self.cache_tokens_available(), "inference_max_length": s.inference_max_length,
            "torch_dtype": str(s.dtype).removeprefix("torch."), "hidden_size": s.hidden_size,
            "start_block": self.ordered[0].index, "end_block": self.ordered[-1].index + 1,
            "stats": {**self.stats, **self.compute.stats},
            "max_forward_tokens": s.max_forward_tokens,  # a distconf extension: larger requests are refused
        }
        if s.weights_sha256 is not None:
            result["weights_sha256"] = s.weights_sha256
        if s.block_sha256 is not None:
            result["block_sha256"] = list(s.block_sha256)
        if s.weights_form is not None:
            result["weights_form"] = s.weights_form
        if s.adapter_sha256:
            result["adapter_sha256"] = {name: list(d) for name, d in s.adapter_sha256.items()}
        if request.uid:
            (block,) = self.check_uids(request.uid)[:1]
            result.update(self.block_info(block))
        return runtime_pb2.ExpertInfo(serialized_info=MSGPackSerializer.dumps(result))

    # ------------------------------------------------------------------ forward / backward

    def _budget(self, uids: str, what: str) -> WireBudget:
        """What one forward/backward request over ``uids`` may carry (hidden, grads and per-block prompts)."""
        s = self.settings
        blocks = len(self.check_uids(uids))
        return WireBudget(max_numel=(2 + blocks) * s.max_forward_tokens * s.hidden_size,
                          max_tokens=s.max_forward_tokens, what=what)

    def _decode(self, uid: str, serialized: Sequence[runtime_pb2.Tensor], what: str) -> list[torch.Tensor]:
        """Tensors of a request over ``uid``, checked from their headers first (`check_headers`)."""
        check_headers(serialized, self._budget(uid, what))
        try:
            return deserialize_tensors(serialized)
        except ProtocolError as exc:
            raise RequestError(str(exc)) from None

    async def _gather(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], what: str
                      ) -> tuple[str, list[torch.Tensor], dict[str, Any]]:
        """uid, tensors and metadata of a stream call: parts joined (hivemind's framing), the bytes bounded
        by what the announced shapes need, every tensor checked from its header before it is decoded."""
        uid: str | None = None
        metadata: dict[str, Any] = {}
        budget: WireBudget | None = None
        joined: list[tuple[runtime_pb2.Tensor, list[bytes]]] = []
        received = expected = 0
        async for req in requests:
            if uid is None:
                uid, metadata, budget = req.uid, self._metadata(req.metadata), self._budget(req.uid, what)
            elif req.uid != uid:
                raise RequestError("block uids differ between the parts of one request")
            assert budget is not None
            for part in req.tensors:
                if part.dtype:  # the first part of a tensor: its header
                    expected += 8 * check_headers([part], budget, whole=False) + 4096
                    joined.append((part, []))
                elif not joined:
                    raise RequestError("a stream request starts with a part of no tensor")
                received += len(part.buffer)
                limit = min(self.settings.max_request_bytes, 8 * budget.max_numel + 4096 * len(joined))
                if received > expected or received > limit:
                    raise RequestError(f"the request's parts hold more bytes than its tensors' shapes need "
                                       f"({received} > {min(expected, limit)})")
                joined[-1][1].append(part.buffer)
        serialized = []
        for first, buffers in joined:
            tensor = runtime_pb2.Tensor()
            tensor.CopyFrom(first)
            tensor.buffer = b"".join(buffers)
            serialized.append(tensor)
        return uid or "", self._decode(uid or "", serialized, what) if serialized else [], metadata

    @staticmethod
    def _metadata(raw: bytes) -> dict[str, Any]:
        try:
            return loads_metadata(raw)
        except ProtocolError as exc:
            raise RequestError(str(exc)) from None

    async def _forward(self, uids: str, tensors: list[torch.Tensor], metadata: dict[str, Any]) -> torch.Tensor:
        blocks = self.check_uids(uids)
        adapter = check_adapter(metadata, self.settings.adapters)
        s = self.settings
        hidden, prompts = unpack_tensors(tensors, metadata, ("hidden_states", "prompts"))
        hidden = check_hidden("hidden_states", hidden, s.hidden_size, s.dtype)
        per_block = check_prompts(prompts, len(blocks), hidden.shape[0], s.hidden_size, s.dtype, hidden.shape[1])
        return await self.compute.run(forward_chain, blocks, hidden, per_block, adapter,
                                      cost=hidden.shape[0] * hidden.shape[1])

    async def _backward(self, uids: str, tensors: list[torch.Tensor], metadata: dict[str, Any]
                        ) -> list[torch.Tensor]:
        blocks = self.check_uids(uids)
        adapter = check_adapter(metadata, self.settings.adapters)
        s = self.settings
        inputs, grads, prompts = unpack_tensors(tensors, metadata, ("inputs", "grad_outputs", "prompts"))
        inputs = check_hidden("inputs", inputs, s.hidden_size, s.dtype)
        grads = check_hidden("grad_outputs", grads, s.hidden_size, s.dtype)
        if grads.shape != inputs.shape:
            raise RequestError(f"grad_outputs has shape {list(grads.shape)}, inputs {list(inputs.shape)}")
        check_prompts(prompts, len(blocks), inputs.shape[0], s.hidden_size, s.dtype, inputs.shape[1])
        has_prompts = prompts is not None and prompts.numel() > 0
        return await self.compute.run(backward_chain, blocks, inputs, grads,
                                      prompts.to(s.dtype) if has_prompts else None, adapter,
                                      cost=2 * inputs.shape[0] * inputs.shape[1])

    @contextlib.asynccontextmanager
    async def _deadline(self, what: str) -> AsyncIterator[None]:
        """``request_timeout`` over a request: past it the request is refused in one line (no traceback),
        and its queued compute is dropped before it starts (its future is cancelled)."""
        try:
            async with asyncio.timeout(self.settings.request_timeout):
                yield
        except TimeoutError:
            raise RequestError(f"{what} exceeded request_timeout={self.settings.request_timeout:g} s") from None

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext
                          ) -> runtime_pb2.ExpertResponse:
        """Forward through the chain named by ``request.uid``; reply ``[hidden]``."""
        with logged_refusal("rpc_forward"):  # hivemind logs nothing for a unary call
            async with self._deadline("rpc_forward"):
                metadata = self._metadata(request.metadata)
                tensors = self._decode(request.uid, request.tensors, "rpc_forward")
                out = await self._forward(request.uid, tensors, metadata)
                self.stats["forward"] += 1
                return runtime_pb2.ExpertResponse(tensors=[self.serialize_output(out)])

    async def rpc_forward_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                                 ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Stream form of `rpc_forward` (inputs and output split in parts)."""
        async with self._deadline("rpc_forward_stream"):
            uid, tensors, metadata = await self._gather(requests, "rpc_forward_stream")
            out = await self._forward(uid, tensors, metadata)
            self.stats["forward"] += 1
        for part in split_for_streaming(self.serialize_output(out), DEFAULT_MAX_MSG_SIZE):
            yield runtime_pb2.ExpertResponse(tensors=[part])

    async def rpc_backward(self, request: runtime_pb2.ExpertRequest, context: P2PContext
                           ) -> runtime_pb2.ExpertResponse:
        """Gradients w.r.t. inputs (and deep prompts); weights are never updated."""
        with logged_refusal("rpc_backward"):
            async with self._deadline("rpc_backward"):
                metadata = self._metadata(request.metadata)
                tensors = self._decode(request.uid, request.tensors, "rpc_backward")
                grads = await self._backward(request.uid, tensors, metadata)
                self.stats["backward"] += 1
                return runtime_pb2.ExpertResponse(
                    tensors=serialize_tensors(grads, self.settings.dtype, self.settings.compression))

    async def rpc_backward_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                                  ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Stream form of `rpc_backward`."""
        async with self._deadline("rpc_backward_stream"):
            uid, tensors, metadata = await self._gather(requests, "rpc_backward_stream")
            grads = await self._backward(uid, tensors, metadata)
            self.stats["backward"] += 1
        for tensor in serialize_tensors(grads, self.settings.dtype, self.settings.compression):
            for part in split_for_streaming(tensor, DEFAULT_MAX_MSG_SIZE):
                yield runtime_pb2.ExpertResponse(tensors=[part])

    # ------------------------------------------------------------------ inference and push

    async def rpc_inference(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                            ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """A session over a chain of blocks with a KV cache (see `distconf.server.sessions`)."""
        async for reply in self.sessions.run(requests, context):
            yield reply

    async def rpc_push(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """Feed a previous server's outputs into one of this server's sessions (ignored if unknown)."""
        with logged_refusal("rpc_push"):
            self.sessions.route_push(request, context)
        return runtime_pb2.ExpertResponse()

    async def rpc_push_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                              ) -> runtime_pb2.ExpertResponse:
        """`rpc_push` for each message of a stream; a refused push is logged and the stream goes on (as separate
        ``rpc_push`` calls would)."""
        async for request in requests:
            try:
                with logged_refusal("rpc_push_stream"):
                    self.sessions.route_push(request, context)
            except REFUSALS:
                pass
        return runtime_pb2.ExpertResponse()
