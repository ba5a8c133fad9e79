"""``rpc_inference`` sessions: one KV cache per session, steps from the caller or pushed by a peer.

The first message names the chain and carries ``max_length`` (and optionally
``session_id``, ``alloc_timeout``); its batch size fixes the session's. The cache for
``batch x max_length`` tokens of every block is reserved from the server's one budget
for the whole session and returned when it ends, fails or times out. Each message with
tensors is a step, answered with one reply, unless its ``step_id`` was already processed
(the same step can arrive from the caller and by ``rpc_push``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, AsyncIterator  # noqa: UP035

from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from distconf.rpc.calls import call_push
from distconf.rpc.protocol import (
    KEY_ALLOC_TIMEOUT,
    KEY_MAX_LENGTH,
    KEY_NEXT_SERVERS,
    KEY_PUSHED,
    KEY_SESSION_ID,
    KEY_START_FROM_POSITION,
    KEY_STEP_ID,
    ProtocolError,
    chain_uid,
    dumps_metadata,
    loads_metadata,
    read_request,
)
from distconf.server.compute import ServedBlock, SessionCache
from distconf.server.validation import (
    RequestError,
    check_adapter,
    check_hidden,
    check_hypo_ids,
    check_prompts,
    metadata_int,
    metadata_number,
    next_servers,
    unpack_tensors,
)

if TYPE_CHECKING:
    import torch

BlockHandler = Any
"""The handler (`distconf.server.handler.BlockHandler`, which imports this module)."""

__all__ = ["MAX_REMEMBERED_STEPS", "PUSH_QUEUE_SIZE", "run_session"]

logger = logging.getLogger(__name__)

PUSH_QUEUE_SIZE = 64
"""Pushed steps a session may hold before further pushes are dropped."""
MAX_REMEMBERED_STEPS = 4096
"""Step ids a session remembers for de-duplication (a duplicate arrives right after its original)."""


class _Step:
    """A parsed step message."""

    def __init__(self, request: runtime_pb2.ExpertRequest, handler: BlockHandler, batch: int | None) -> None:
        s = handler.settings
        try:
            tensors, self.metadata = read_request(request)
        except ProtocolError as exc:
            raise RequestError(str(exc)) from None
        hidden, self.prompts, hypo_ids = unpack_tensors(tensors, self.metadata,
                                                        ("hidden_states", "prompts", "hypo_ids"))
        self.hidden = check_hidden("hidden_states", hidden, s.hidden_size, s.dtype, batch=batch, allow_empty=True)
        self.batch = self.hidden.shape[0]
        self.hypo_ids = check_hypo_ids(hypo_ids, self.batch)
        step_id = self.metadata.get(KEY_STEP_ID)
        if step_id is not None and not isinstance(step_id, (str, bytes, int)):
            raise RequestError(f"metadata 'step_id' must be a string, got {type(step_id).__name__}")
        self.step_id = step_id
        self.pushed = bool(self.metadata.get(KEY_PUSHED))
        self.next_servers = next_servers(self.metadata.get(KEY_NEXT_SERVERS))
        self.prompts_per_block: list[torch.Tensor | None] = []


class _Inputs:
    """Next message of a session: from the caller's stream or the push queue, within ``step_timeout``."""

    def __init__(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                 pushes: asyncio.Queue[runtime_pb2.ExpertRequest], step_timeout: float) -> None:
        self.requests, self.pushes, self.step_timeout = requests, pushes, step_timeout
        self._own: asyncio.Task[Any] | None = None
        self._push: asyncio.Task[Any] | None = None

    async def next(self) -> runtime_pb2.ExpertRequest | None:
        """The next message; None when the caller ended its stream."""
        if self._own is None:
            self._own = asyncio.ensure_future(self.requests.__anext__())
        if self._push is None:
            self._push = asyncio.ensure_future(self.pushes.get())
        done, _ = await asyncio.wait([self._own, self._push], timeout=self.step_timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        if self._own in done:
            task, self._own = self._own, None
            try:
                return task.result()
            except StopAsyncIteration:
                return None
        if self._push in done:
            task, self._push = self._push, None
            return task.result()
        raise RequestError(f"no inference step arrived within step_timeout={self.step_timeout:g} s")

    def cancel(self) -> None:
        """Cancel pending waits."""
        for task in (self._own, self._push):
            if task is not None:
                task.cancel()


def _open(handler: BlockHandler, first: runtime_pb2.ExpertRequest) -> tuple[list[ServedBlock], dict[str, Any]]:
    blocks = handler.check_uids(first.uid)
    try:
        metadata = loads_metadata(first.metadata)
    except ProtocolError as exc:
        raise RequestError(str(exc)) from None
    metadata_int(metadata, KEY_MAX_LENGTH, low=0, high=handler.settings.inference_max_length)
    check_adapter(metadata)
    session_id = metadata.get(KEY_SESSION_ID)
    if session_id is not None and not isinstance(session_id, str):
        raise RequestError(f"metadata 'session_id' must be a string, got {type(session_id).__name__}")
    if session_id is not None and session_id in handler.sessions:
        raise RequestError(f"session id {session_id[:64]!r} is already in use")
    return blocks, metadata


async def run_session(handler: BlockHandler, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                      context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
    """The body of ``rpc_inference`` (bounded by ``session_timeout`` and ``step_timeout``)."""
    s = handler.settings
    pushes: asyncio.Queue[runtime_pb2.ExpertRequest] = asyncio.Queue(PUSH_QUEUE_SIZE)
    inputs = _Inputs(requests, pushes, s.step_timeout)
    blocks: list[ServedBlock] | None = None
    try:
        async with asyncio.timeout(s.session_timeout):
            first = await inputs.next()
            if first is None:
                return
            blocks, metadata = _open(handler, first)
            logger.info("rpc_inference.open(%s)", handler.describe(context, blocks))
            step = _Step(first, handler, None) if first.tensors else None
            batch = step.batch if step is not None else 1
            max_length = metadata[KEY_MAX_LENGTH]
            cache = SessionCache(blocks, batch, max_length)
            alloc_timeout = metadata_number(metadata, KEY_ALLOC_TIMEOUT, 0.0)
            what = f"a session of {batch} x {max_length} tokens over {len(blocks)} blocks"
            async with handler.budget.reserve(SessionCache.nbytes(blocks, batch, max_length), alloc_timeout, what):
                session_id = metadata.get(KEY_SESSION_ID)
                if session_id is not None:
                    handler.sessions[session_id] = pushes
                handler.stats["sessions"] += 1
                try:
                    await handler.compute(cache.allocate)
                    async for reply in _steps(handler, cache, first, step, inputs):
                        yield reply
                finally:
                    if session_id is not None:
                        handler.sessions.pop(session_id, None)
                    cache.release()
    except TimeoutError:
        raise RequestError(f"inference session exceeded session_timeout={s.session_timeout:g} s") from None
    finally:
        inputs.cancel()
        logger.info("rpc_inference.close(%s)", handler.describe(context, blocks))


async def _steps(handler: BlockHandler, cache: SessionCache, first: runtime_pb2.ExpertRequest,
                 step: _Step | None, inputs: _Inputs) -> AsyncIterator[runtime_pb2.ExpertResponse]:
    processed: dict[Any, None] = {}  # insertion-ordered: the oldest ids are forgotten first
    request: runtime_pb2.ExpertRequest | None = first
    while request is not None and request.tensors:
        try:
            step = step or _Step(request, handler, cache.batch)
            if step.pushed and request.uid != first.uid:
                raise RequestError(f"pushed blocks {request.uid[:80]!r} are not this session's {first.uid[:80]!r}")
            if step.step_id is not None and step.step_id in processed:
                handler.stats["duplicate_steps"] += 1
            else:
                output = await _run_step(handler, cache, step)
                if step.step_id is not None:
                    processed[step.step_id] = None
                    if len(processed) > MAX_REMEMBERED_STEPS:
                        del processed[next(iter(processed))]
                handler.stats["pushed_steps" if step.pushed else "steps"] += 1
                serialized = handler.serialize_output(output)
                # no push with deep prompts (as Petals 2.x): this message carries this server's prompts only
                if step.next_servers and all(p is None for p in step.prompts_per_block):
                    handler.background(_push(handler, request, serialized, step))
                yield runtime_pb2.ExpertResponse(tensors=[serialized])
        except RequestError as exc:
            if not _pushed(request):
                raise
            # a bad push must not end the caller's session: the caller's own copy of the step still counts
            handler.stats["bad_pushes"] += 1
            logger.warning("ignored a pushed step: %s", exc)
        step = None
        request = await inputs.next()


def _pushed(request: runtime_pb2.ExpertRequest) -> bool:
    try:
        return bool(loads_metadata(request.metadata).get(KEY_PUSHED))
    except ProtocolError:
        return False


async def _run_step(handler: BlockHandler, cache: SessionCache, step: _Step) -> torch.Tensor:
    """Check the step against the session (nothing changes if it is refused), then run it."""
    s = handler.settings
    start = metadata_int(step.metadata, KEY_START_FROM_POSITION, low=0, high=cache.position, default=None)
    position = cache.position if start is None else start
    n = step.hidden.shape[1]
    if position + n > cache.max_length:
        raise RequestError(f"Maximum length exceeded: prefix {position} + current {n} exceeds the "
                           f"session's max_length {cache.max_length}")
    step.prompts_per_block = check_prompts(step.prompts, len(cache.blocks), cache.batch, s.hidden_size, s.dtype,
                                           None)
    cache.position = position
    return await handler.compute(cache.step, step.hidden, step.prompts_per_block, step.hypo_ids)


async def _push(handler: BlockHandler, request: runtime_pb2.ExpertRequest, serialized: runtime_pb2.Tensor,
                step: _Step) -> None:
    """Send this step's outputs to the next server of the caller's chain (failures are only logged)."""
    peer, session_id, start, end = step.next_servers[0]
    metadata = dict(step.metadata)
    metadata.update({KEY_SESSION_ID: session_id, KEY_NEXT_SERVERS: step.next_servers[1:], KEY_PUSHED: True})
    pushed = runtime_pb2.ExpertRequest(uid=chain_uid(handler.settings.dht_prefix, start, end),
                                       tensors=[serialized, *request.tensors[1:]], metadata=dumps_metadata(metadata))
    try:
        assert handler.p2p is not None
        await call_push(handler.p2p, peer, pushed, timeout=handler.settings.request_timeout)
        handler.stats["pushes_sent"] += 1
    except Exception as exc:
        logger.debug("push to %s (blocks %d:%d) failed: %r", peer[-6:], start, end, exc)
