"""Calling a block server's handlers: one helper per RPC, every wait bounded by a timeout.

The single home of these calls: the server (``rpc_push``, `RpcLoop`), the client
(`distconf.client`) and the tests all call servers through this module. Peers are given as
a ``PeerID`` or its base58 text.

All helpers are coroutines run on the event loop that owns ``p2p``. `BackgroundLoop` is the
one way to run them from plain code (the client uses the process-wide `BackgroundLoop.shared`);
`RpcLoop` is a server's own loop with a P2P replicated from a running ``hivemind.DHT``.
Errors raised by the remote handler arrive as ``hivemind.p2p.P2PHandlerError`` carrying the server's message.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any, TypeVar

import torch
from hivemind.compression.serialization import deserialize_tensor_stream
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import aiter_with_timeout, anext, iter_as_aiter

from distconf.rpc.protocol import (
    DUMMY,
    DUMMY_INT64,
    KEY_ARGS_STRUCTURE,
    MAX_UNARY_PAYLOAD_SIZE,
    ProtocolError,
    deserialize_tensors,
    dumps_metadata,
    loads_metadata,
    make_request,
    pack_args_kwargs,
    serialize_tensors,
    serialized_size,
    stream_parts,
)
from distconf.rpc.servicer import BlockServicer

__all__ = ["BackgroundLoop", "InferenceStream", "RpcLoop", "as_peer_id", "call_backward", "call_forward",
           "call_info", "call_push", "inference_step_request", "get_stub"]

T = TypeVar("T")


def as_peer_id(peer: PeerID | str) -> PeerID:
    """A ``PeerID`` from itself or its base58 text."""
    return peer if isinstance(peer, PeerID) else PeerID.from_base58(str(peer))


def get_stub(p2p: P2P, peer: PeerID | str) -> Any:
    """A stub whose ``rpc_*`` coroutines call ``peer``'s block-server handlers."""
    return BlockServicer.get_stub(p2p, as_peer_id(peer))


async def call_info(p2p: P2P, peer: PeerID | str, uid: str = "", *, timeout: float) -> dict[str, Any]:
    """``rpc_info``: the server's info dict (with the block's schemas when ``uid`` is given)."""
    info = await get_stub(p2p, peer).rpc_info(runtime_pb2.ExpertUID(uid=uid), timeout=timeout)
    return loads_metadata(info.serialized_info)


async def _call_tensors(p2p: P2P, peer: PeerID | str, name: str, uid: str, tensors: Sequence[torch.Tensor],
                        metadata: dict[str, Any] | None, timeout: float, dtype: torch.dtype | None
                        ) -> list[torch.Tensor]:
    stub = get_stub(p2p, peer)
    serialized = serialize_tensors(tensors, dtype)
    if serialized_size(serialized) <= MAX_UNARY_PAYLOAD_SIZE:
        response = await getattr(stub, name)(make_request(uid, serialized, metadata), timeout=timeout)
        return deserialize_tensors(response.tensors)
    parts = stream_parts(uid, serialized, dumps_metadata(metadata))

    async def collect() -> list[torch.Tensor]:
        outputs = await getattr(stub, f"{name}_stream")(iter_as_aiter(parts))
        return await deserialize_tensor_stream(msg.tensors async for msg in aiter_with_timeout(outputs, timeout))

    return await asyncio.wait_for(collect(), timeout)


async def call_forward(p2p: P2P, peer: PeerID | str, uid: str, hidden_states: torch.Tensor,
                       prompts: torch.Tensor | None = None, *, timeout: float, dtype: torch.dtype | None = None,
                       metadata: dict[str, Any] | None = None) -> torch.Tensor:
    """``rpc_forward`` (or ``rpc_forward_stream`` above the unary payload limit) over chain ``uid``.

    ``prompts``: deep prompts ``[num_blocks, batch, pre_seq_len, hidden]`` or None.
    Returns the last block's hidden states (`ProtocolError` if the reply holds none).
    """
    flat, structure = pack_args_kwargs(hidden_states, DUMMY if prompts is None else prompts)
    meta = {**(metadata or {}), KEY_ARGS_STRUCTURE: structure}
    outputs = await _call_tensors(p2p, peer, "rpc_forward", uid, flat, meta, timeout, dtype)
    if not outputs:
        raise ProtocolError(f"rpc_forward of {uid!r}: the reply holds no tensors")
    return outputs[0]


async def call_backward(p2p: P2P, peer: PeerID | str, uid: str, inputs: torch.Tensor, grad_outputs: torch.Tensor,
                        prompts: torch.Tensor | None = None, *, timeout: float, dtype: torch.dtype | None = None,
                        metadata: dict[str, Any] | None = None) -> list[torch.Tensor]:
    """``rpc_backward`` (stream form when large): ``[grad_inputs]`` or ``[grad_inputs, grad_prompts]``."""
    flat, structure = pack_args_kwargs(inputs, grad_outputs, DUMMY if prompts is None else prompts)
    meta = {**(metadata or {}), KEY_ARGS_STRUCTURE: structure}
    return await _call_tensors(p2p, peer, "rpc_backward", uid, flat, meta, timeout, dtype)


async def call_push(p2p: P2P, peer: PeerID | str, request: runtime_pb2.ExpertRequest, *, timeout: float) -> None:
    """``rpc_push``: hand a step's request to ``peer``'s session named in its metadata."""
    await get_stub(p2p, peer).rpc_push(request, timeout=timeout)


def inference_step_request(uid: str, hidden_states: torch.Tensor, prompts: torch.Tensor | None = None,
                           hypo_ids: torch.Tensor | None = None, metadata: dict[str, Any] | None = None, *,
                           dtype: torch.dtype | None = None) -> runtime_pb2.ExpertRequest:
    """One ``rpc_inference`` step message: tensors ``(hidden, prompts or DUMMY, hypo_ids or DUMMY_INT64)``."""
    flat, structure = pack_args_kwargs(hidden_states, DUMMY if prompts is None else prompts,
                                       DUMMY_INT64 if hypo_ids is None else hypo_ids)
    meta = {**(metadata or {}), KEY_ARGS_STRUCTURE: structure}
    return make_request(uid, serialize_tensors(flat, dtype), meta)


class InferenceStream:
    """The client end of one ``rpc_inference`` stream: send a step, wait (bounded) for its reply.

    >>> stream = await InferenceStream.open(p2p, peer, timeout=5)         # doctest: +SKIP
    >>> reply = await stream.step(inference_step_request(...), timeout=5)  # doctest: +SKIP
    >>> await stream.close(timeout=5)                                     # doctest: +SKIP
    """

    def __init__(self, queue: asyncio.Queue[runtime_pb2.ExpertRequest | None],
                 outputs: AsyncIterator[runtime_pb2.ExpertResponse]) -> None:
        self._queue = queue
        self._outputs = outputs
        self.closed = False

    @classmethod
    async def open(cls, p2p: P2P, peer: PeerID | str, *, timeout: float) -> InferenceStream:
        """Open a stream to ``peer`` (nothing is sent until the first `step`)."""
        queue: asyncio.Queue[runtime_pb2.ExpertRequest | None] = asyncio.Queue()

        async def requests() -> AsyncIterator[runtime_pb2.ExpertRequest]:
            while True:
                item = await queue.get()
                if item is None:
                    return
                yield item
                if not item.uid and not item.tensors:
                    return

        outputs = await asyncio.wait_for(get_stub(p2p, peer).rpc_inference(requests()), timeout)
        return cls(queue, outputs)

    async def send(self, request: runtime_pb2.ExpertRequest) -> None:
        """Queue a message without waiting for a reply (e.g. a step the server will not answer)."""
        if self.closed:
            raise RuntimeError("the inference stream is closed")
        await self._queue.put(request)

    async def receive(self, *, timeout: float) -> runtime_pb2.ExpertResponse:
        """The next reply; `EOFError` if the server ended the stream."""
        try:
            return await asyncio.wait_for(anext(self._outputs), timeout)
        except StopAsyncIteration:
            raise EOFError("the server ended the inference stream") from None

    async def step(self, request: runtime_pb2.ExpertRequest, *, timeout: float) -> runtime_pb2.ExpertResponse:
        """Send one step message and wait up to ``timeout`` seconds for its reply."""
        await self.send(request)
        return await self.receive(timeout=timeout)

    async def close(self, *, timeout: float = 5.0) -> None:
        """Send the end-of-stream message (empty request) and wait, bounded, for the server to finish.

        Then close the reply stream (at most 1 s more), so a server that did not end its
        side in time does not keep the stream open.
        """
        if self.closed:
            return
        self.closed = True
        await self._queue.put(runtime_pb2.ExpertRequest())
        try:
            await asyncio.wait_for(anext(self._outputs), timeout)
        except (StopAsyncIteration, Exception):  # the stream is over either way
            pass
        finally:
            self._queue.put_nowait(None)
            closer = getattr(self._outputs, "aclose", None)
            if closer is not None:
                try:
                    await asyncio.wait_for(closer(), 1.0)
                except Exception:  # best effort: the stream is finished for us regardless
                    pass


class BackgroundLoop:
    """An asyncio event loop in a daemon thread: the one way distconf runs a coroutine from plain code.

    `run` submits a coroutine from any thread and waits, bounded, for its result.
    `shared` is the process-wide loop clients use: hivemind keeps one P2P replica per
    ``DHT`` object, bound to the loop that made it, so every client of one DHT must run
    on the same loop. A server makes its own (`RpcLoop`).
    """

    _shared: BackgroundLoop | None = None
    _shared_lock = threading.Lock()

    def __init__(self, name: str = "distconf-rpc-loop") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    @classmethod
    def shared(cls) -> BackgroundLoop:
        """The process-wide loop (started on first use, never stopped: its thread is a daemon)."""
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls(name="distconf-shared-loop")
            return cls._shared

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop (for scheduling coroutines yourself)."""
        return self._loop

    def run(self, coro: Coroutine[Any, Any, T], *, timeout: float | None) -> T:
        """Run ``coro`` on the loop and wait up to ``timeout`` seconds for its result.

        On timeout the coroutine is cancelled and `TimeoutError` is raised.
        """
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"RPC did not finish within {timeout} s") from None

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel the loop's pending tasks (waiting up to ``timeout`` s), stop it and close it."""
        if self is BackgroundLoop._shared:
            raise RuntimeError("the shared loop is never stopped")
        if not self._loop.is_running():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=timeout)

        try:
            self.run(cancel_all(), timeout=timeout)
        except Exception:  # stopping is best effort; the loop stops regardless
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._loop.close()


class RpcLoop:
    """A background event loop of its own with a P2P replicated from a running ``hivemind.DHT``.

    ``run(coro, timeout)`` runs a coroutine of this module there from any thread. Used by
    a server, whose DHT no client shares.
    """

    def __init__(self, dht: Any, *, timeout: float = 30.0) -> None:
        self._background = BackgroundLoop()
        self.p2p: P2P = self.run(dht.replicate_p2p(), timeout=timeout)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop (for scheduling coroutines yourself)."""
        return self._background.loop

    def run(self, coro: Coroutine[Any, Any, T], *, timeout: float | None) -> T:
        """Run ``coro`` on the loop and wait up to ``timeout`` seconds for its result."""
        return self._background.run(coro, timeout=timeout)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Close the replicated P2P (the DHT's daemon keeps running), cancel pending tasks, stop the loop."""
        if not self._background.loop.is_running():
            return
        try:
            self.run(self.p2p.shutdown(), timeout=timeout)
        except Exception:  # closing is best effort; the loop stops regardless
            pass
        self._background.stop(timeout)
