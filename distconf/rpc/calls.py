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
import contextlib
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import torch
from hivemind.compression.serialization import deserialize_tensor_stream
from hivemind.p2p import P2P, P2PHandlerError, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import aiter_with_timeout, iter_as_aiter

from distconf.dht.hivemind_rpc_compat import END_OF_STREAM_FRAME, FrameTooLarge, harden_peer_process, read_frame
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
from distconf.rpc.servicer import BlockServicer, handle_name

__all__ = ["BackgroundLoop", "InferenceStream", "PushStream", "ReplyTooLarge", "RpcLoop", "as_peer_id", "call_backward",
           "call_forward", "call_info", "call_push", "inference_step_request", "get_stub"]

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
                        metadata: dict[str, Any] | None, timeout: float, dtype: torch.dtype | None,
                        compression: int = 0) -> list[torch.Tensor]:
    stub = get_stub(p2p, peer)
    serialized = serialize_tensors(tensors, dtype, compression)
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
                       metadata: dict[str, Any] | None = None, compression: int = 0) -> torch.Tensor:
    """``rpc_forward`` (or ``rpc_forward_stream`` above the unary payload limit) over chain ``uid``.

    ``prompts``: deep prompts ``[num_blocks, batch, pre_seq_len, hidden]`` or None; ``compression``: the
    hivemind compression of what is sent (the server's, from its ``rpc_info``).
    Returns the last block's hidden states (`ProtocolError` if the reply holds none).
    """
    flat, structure = pack_args_kwargs(hidden_states, DUMMY if prompts is None else prompts)
    meta = {**(metadata or {}), KEY_ARGS_STRUCTURE: structure}
    outputs = await _call_tensors(p2p, peer, "rpc_forward", uid, flat, meta, timeout, dtype, compression)
    if not outputs:
        raise ProtocolError(f"rpc_forward of {uid!r}: the reply holds no tensors")
    return outputs[0]


async def call_backward(p2p: P2P, peer: PeerID | str, uid: str, inputs: torch.Tensor, grad_outputs: torch.Tensor,
                        prompts: torch.Tensor | None = None, *, timeout: float, dtype: torch.dtype | None = None,
                        metadata: dict[str, Any] | None = None, compression: int = 0) -> list[torch.Tensor]:
    """``rpc_backward`` (stream form when large): ``[grad_inputs]`` or ``[grad_inputs, grad_prompts]``."""
    flat, structure = pack_args_kwargs(inputs, grad_outputs, DUMMY if prompts is None else prompts)
    meta = {**(metadata or {}), KEY_ARGS_STRUCTURE: structure}
    return await _call_tensors(p2p, peer, "rpc_backward", uid, flat, meta, timeout, dtype, compression)


async def call_push(p2p: P2P, peer: PeerID | str, request: runtime_pb2.ExpertRequest, *, timeout: float) -> None:
    """``rpc_push``: hand a step's request to ``peer``'s session named in its metadata."""
    await get_stub(p2p, peer).rpc_push(request, timeout=timeout)


_STEP_STRUCTURE = pack_args_kwargs(torch.empty(0), torch.empty(0), torch.empty(0))[1]
"""``args_structure`` of a step of three distinct tensors (hidden states, prompts, hypo_ids)."""


def inference_step_request(uid: str, hidden_states: torch.Tensor, prompts: torch.Tensor | None = None,
                           hypo_ids: torch.Tensor | None = None, metadata: dict[str, Any] | None = None, *,
                           dtype: torch.dtype | None = None, compression: int = 0) -> runtime_pb2.ExpertRequest:
    """One ``rpc_inference`` step message: tensors ``(hidden, prompts or DUMMY, hypo_ids or DUMMY_INT64)``."""
    flat = [hidden_states, DUMMY if prompts is None else prompts, DUMMY_INT64 if hypo_ids is None else hypo_ids]
    if len({id(t) for t in flat}) == len(flat):  # the usual case: the structure is always the same
        structure = _STEP_STRUCTURE
    else:
        flat, structure = pack_args_kwargs(*flat)
    meta = {**(metadata or {}), KEY_ARGS_STRUCTURE: structure}
    return make_request(uid, serialize_tensors(flat, dtype, compression), meta)


async def _open_stream(p2p: P2P, peer: PeerID | str, handle: str, timeout: float
                       ) -> tuple[PeerID, asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw stream to ``peer``'s handler ``handle``, opened within ``timeout`` seconds."""
    peer_id = as_peer_id(peer)
    _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(peer_id, handle), timeout)
    return peer_id, reader, writer


class ReplyTooLarge(ConnectionError):
    """A server's reply is larger than the request can need (refused before it is read)."""


class InferenceStream:
    """The client end of one ``rpc_inference`` stream: send a step, wait (bounded) for its reply.

    Messages are written to and read from the p2p daemon's stream directly, framed as hivemind's
    stubs frame them (`hivemind.P2P.send_protobuf` / ``receive_protobuf``), so a step costs no
    queue, writer task or extra task per reply on the event loop.

    >>> stream = await InferenceStream.open(p2p, peer, timeout=5)         # doctest: +SKIP
    >>> reply = await stream.step(inference_step_request(...), timeout=5)  # doctest: +SKIP
    >>> await stream.close(timeout=5)                                     # doctest: +SKIP
    """

    HANDLE_NAME = handle_name("rpc_inference")
    """The p2p handler name of ``rpc_inference`` (what hivemind's stub calls)."""

    def __init__(self, peer: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.peer = peer
        self._reader, self._writer = reader, writer
        self._input_done = False  # our side of the stream has ended (after an empty request)
        self.closed = False

    @classmethod
    async def open(cls, p2p: P2P, peer: PeerID | str, *, timeout: float) -> InferenceStream:
        """Open a stream to ``peer`` (nothing is sent until the first `step`)."""
        return cls(*await _open_stream(p2p, peer, cls.HANDLE_NAME, timeout))

    async def _write(self, message: Any) -> None:
        try:
            await P2P.send_protobuf(message, self._writer)
        except (ConnectionError, OSError, RuntimeError):
            # the server ended the stream (its error or EOF is what `receive` reports)
            self._input_done = True

    async def send(self, request: runtime_pb2.ExpertRequest) -> None:
        """Send a message without waiting for a reply (e.g. a step the server will not answer).

        An empty request ends the session: the input stream ends after it, as with hivemind's stub.
        """
        if self.closed:
            raise RuntimeError("the inference stream is closed")
        if self._input_done:
            return
        await self._write(request)
        if not request.uid and not request.tensors:
            try:
                self._writer.write(END_OF_STREAM_FRAME)
                await self._writer.drain()
            except (ConnectionError, OSError, RuntimeError):
                pass  # the server ended the stream already
            self._input_done = True

    async def receive(self, *, timeout: float, max_bytes: int | None = None) -> runtime_pb2.ExpertResponse:
        """The next reply; `EOFError` if the server ended the stream, ``P2PHandlerError`` for its error.

        ``max_bytes``: a reply announcing more is refused (`ReplyTooLarge`) before it is read.
        """
        async with asyncio.timeout(timeout):
            return await self._read(max_bytes)

    async def _read(self, max_bytes: int | None = None) -> runtime_pb2.ExpertResponse:
        try:
            error, data = await read_frame(self._reader, max_bytes)
        except FrameTooLarge as exc:
            self._input_done = True
            self._writer.close()  # the rest of the message is never read
            raise ReplyTooLarge(f"server {self.peer} sent a reply of {exc.length} bytes (at most {max_bytes} "
                                f"expected)") from None
        except asyncio.IncompleteReadError:
            raise EOFError("the server ended the inference stream") from None
        except ConnectionError as exc:
            raise ConnectionError(f"server {self.peer} sent {exc}") from None
        if error is not None:
            raise P2PHandlerError(f"Failed to call handler `{self.HANDLE_NAME}` at {self.peer}: {error}")
        response = runtime_pb2.ExpertResponse()
        response.ParseFromString(data)
        return response

    async def step(self, request: runtime_pb2.ExpertRequest, *, timeout: float,
                   max_reply_bytes: int | None = None) -> runtime_pb2.ExpertResponse:
        """Send one step message and wait for its reply, both within ``timeout`` seconds.

        ``max_reply_bytes``: a larger reply is refused before it is read (`ReplyTooLarge`).
        """
        async with asyncio.timeout(timeout):
            await self.send(request)
            return await self._read(max_reply_bytes)

    async def close(self, *, timeout: float = 5.0) -> None:
        """Send the end-of-stream message (empty request) and wait, bounded, for the server to finish.

        Then close the stream, so a server that did not end its side in time does not keep it open.
        """
        if self.closed:
            return
        try:
            await self.send(runtime_pb2.ExpertRequest())
            await self.receive(timeout=timeout)
        except Exception:  # the stream is over either way
            pass
        finally:
            self.closed = True
            self._writer.close()


class PushStream:
    """The sending end of a server's ``rpc_push_stream`` to the next server: pushes written one after another,
    no replies (framed as `InferenceStream` frames its steps)."""

    HANDLE_NAME = handle_name("rpc_push_stream")
    """The p2p handler name of ``rpc_push_stream``."""

    def __init__(self, peer: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.peer = peer
        self._reader, self._writer = reader, writer

    @classmethod
    async def open(cls, p2p: P2P, peer: PeerID | str, *, timeout: float) -> PushStream:
        """Open a push stream to ``peer`` (an error if it cannot be opened, e.g. a peer without the handler)."""
        return cls(*await _open_stream(p2p, peer, cls.HANDLE_NAME, timeout))

    @property
    def broken(self) -> bool:
        """The stream ended (the peer closed it or failed): it takes no more pushes."""
        return self._writer.is_closing() or self._reader.at_eof()

    async def send(self, request: runtime_pb2.ExpertRequest, *, timeout: float) -> None:
        """Write one push (``ConnectionError`` if the stream is broken; waits while the peer's buffer is full)."""
        if self.broken:
            raise ConnectionError(f"the push stream to {self.peer} is closed")
        async with asyncio.timeout(timeout):
            await P2P.send_protobuf(request, self._writer)

    def close(self) -> None:
        """End the stream (the peer's handler returns)."""
        if not self._writer.is_closing():
            with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                self._writer.write(END_OF_STREAM_FRAME)
            self._writer.close()


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
        harden_peer_process()  # every process that runs RPCs has a loop like this one (msgpack depth guard too)
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
