"""`Sessions`: the one owner of a server's open ``rpc_inference`` sessions.

It keeps the registry of open sessions by session id with each one's push queue, runs a
session (`Sessions.run`, the body of ``rpc_inference``) and routes ``rpc_push`` messages
to it (`Sessions.route_push`). A session id is checked and registered in one synchronous
step, before the session awaits anything (its cache reservation may wait for memory), so
two sessions opened with one id cannot both pass; it is unregistered when the session ends.

The cache for ``batch x max_length`` tokens of every block of the chain is reserved from
the server's one `CacheBudget` for the whole session and returned when it ends, fails or
times out. The sessions of one peer together hold at most ``max_peer_cache_share`` of the
budget: a peer keeping sessions open cannot lock the others out.

Pushes: a session takes ``rpc_push`` messages from one peer only. Its own client may name
that peer (``push_from`` in a step's metadata, the previous span's server; ``""``: none);
a client that names none (Petals 2.x) gets the first peer that pushes to the session, and
pushes from any other peer are refused: a peer that learned the session id (upstream
servers see it in ``next_servers``) cannot feed steps into it.

Collaborators are passed in: the served blocks, the budget, the compute thread,
the settings and the handler's statistics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator  # noqa: UP035

from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2

from distconf.rpc.protocol import (
    KEY_ALLOC_TIMEOUT,
    KEY_SESSION_ID,
    KEY_START_FROM_POSITION,
    ProtocolError,
    loads_metadata,
    serialize_tensors,
)
from distconf.server.compute import ServedBlock
from distconf.server.inference import (
    NOT_NAMED,
    PUSH_QUEUE_SIZE,
    SessionInputs,
    Step,
    StepIds,
    is_pushed,
    named_pusher,
    parse_open,
    push_request,
)
from distconf.server.memory import CacheBudget
from distconf.server.push_streams import PushStreams
from distconf.server.scheduler import ComputeScheduler
from distconf.server.session_cache import SessionCache
from distconf.server.settings import HandlerSettings
from distconf.server.validation import RequestError, check_prompts, metadata_int, metadata_number, served_chain
from distconf.server.wire_checks import WireBudget

if TYPE_CHECKING:
    import torch

__all__ = ["Sessions", "describe_call"]

logger = logging.getLogger(__name__)

PushQueue = asyncio.Queue[runtime_pb2.ExpertRequest]


@dataclass(eq=False)
class _Route:
    """Where pushes for one session id go, and from which peer they are taken."""

    queue: PushQueue
    pusher: Any = NOT_NAMED
    """The peer named by the session's client (``""``: none), else `NOT_NAMED`."""
    first_pusher: str | None = None
    """The first peer that pushed (taken when the client names none)."""

    def admits(self, sender: str) -> bool:
        """Whether a push from ``sender`` may enter the session (the first one pins an unnamed route)."""
        if self.pusher is not NOT_NAMED:
            return bool(self.pusher) and sender == self.pusher
        if self.first_pusher is None:
            self.first_pusher = sender
        return sender == self.first_pusher


def describe_call(context: P2PContext, blocks: Sequence[ServedBlock] | None = None) -> str:
    """``blocks=a:b, peer=...xyz`` for log lines."""
    span = f"{blocks[0].index}:{blocks[-1].index + 1}" if blocks else "n/a"
    return f"blocks={span}, peer=...{str(context.remote_id)[-6:]}"


def _header_batch(request: runtime_pb2.ExpertRequest) -> int | None:
    """The batch size a session's first message announces (its first 3-d tensor's), before decoding."""
    for tensor in request.tensors:
        if len(tensor.size) == 3:
            return max(1, int(tensor.size[0]))
    return None


class Sessions:
    """Open inference sessions of one server: registry, push queues, de-duplication by session id.

    Used from the server's event loop. ``p2p`` (set when the handler starts) sends pushes
    to the next server of a caller's chain.
    """

    def __init__(self, blocks: Mapping[str, ServedBlock], budget: CacheBudget, compute: ComputeScheduler,
                 settings: HandlerSettings, stats: Counter[str]) -> None:
        self.blocks, self.budget, self.compute, self.settings, self.stats = blocks, budget, compute, settings, stats
        self.p2p: P2P | None = None
        self.pushes: PushStreams | None = None  # made with the first push
        self._routes: dict[str, _Route] = {}
        self._held: Counter[str] = Counter()  # cache bytes reserved (or waited for) by each peer's sessions
        self._tasks: set[asyncio.Task[Any]] = set()
        self._open = 0  # sessions holding a cache now

    # ------------------------------------------------------------------ registry

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._routes

    def __len__(self) -> int:
        return len(self._routes)

    def register(self, session_id: str, pushes: PushQueue) -> None:
        """Make ``session_id`` route to ``pushes``; `RequestError` if an open session has that id."""
        if session_id in self._routes:
            raise RequestError(f"session id {session_id[:64]!r} is already in use")
        self._routes[session_id] = _Route(pushes)

    def unregister(self, session_id: str, pushes: PushQueue) -> None:
        """Forget ``session_id`` if it still routes to ``pushes``."""
        route = self._routes.get(session_id)
        if route is not None and route.queue is pushes:
            del self._routes[session_id]

    def name_pusher(self, session_id: str | None, pushes: PushQueue, metadata: dict[str, Any]) -> None:
        """Take the pusher a session's own client names in ``metadata`` (nothing if it names none)."""
        named = named_pusher(metadata)
        route = self._routes.get(session_id) if session_id is not None else None
        if named is not NOT_NAMED and route is not None and route.queue is pushes:
            route.pusher = named

    @contextlib.contextmanager
    def _registered(self, session_id: str | None, pushes: PushQueue) -> Iterator[None]:
        if session_id is None:
            yield
            return
        self.register(session_id, pushes)
        try:
            yield
        finally:
            self.unregister(session_id, pushes)

    @contextlib.contextmanager
    def _peer_share(self, peer: str, nbytes: int) -> Iterator[None]:
        """Count ``nbytes`` against ``peer``'s share of the budget; `RequestError` past it (at once: bytes
        a session waits for count too, so a peer cannot queue more than its share either)."""
        share = self.settings.max_peer_cache_share
        cap = int(share * self.budget.total_bytes)
        if share < 1 and nbytes and self._held[peer] + nbytes > cap:
            raise RequestError(f"this peer's sessions hold {self._held[peer]} bytes of KV cache; with {nbytes} "
                               f"more they would pass its share of {cap} bytes "
                               f"({self.settings.max_peer_cache_share:.0%} of the server's budget)")
        self._held[peer] += nbytes
        try:
            yield
        finally:
            self._held[peer] -= nbytes
            if self._held[peer] <= 0:
                del self._held[peer]

    # ------------------------------------------------------------------ push routing

    def route_push(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> None:
        """Queue a previous server's outputs for one of this server's sessions (ignored if unknown);
        `RequestError` for a push from a peer the session does not take pushes from."""
        served_chain(self.blocks, request.uid)
        try:
            metadata = loads_metadata(request.metadata)
        except ProtocolError as exc:
            raise RequestError(str(exc)) from None
        session_id = metadata.get(KEY_SESSION_ID)
        route = self._routes.get(session_id) if isinstance(session_id, str) else None
        if route is None:
            logger.debug("rpc_push(%s): unknown session, ignored", describe_call(context))
        elif not route.admits(str(context.remote_id)):
            self.stats["refused_pushes"] += 1
            raise RequestError("rpc_push: this session takes pushes from another peer only (the previous server "
                               "of its client's chain)")
        elif route.queue.full():
            logger.warning("rpc_push(%s): session push queue full, dropped", describe_call(context))
        else:
            route.queue.put_nowait(request)
            self.stats["pushes_received"] += 1

    # ------------------------------------------------------------------ one session

    async def run(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                  context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """The body of ``rpc_inference`` (bounded by ``session_timeout`` and ``step_timeout``)."""
        s = self.settings
        pushes: PushQueue = asyncio.Queue(PUSH_QUEUE_SIZE)
        inputs = SessionInputs(requests, pushes, s.step_timeout)
        blocks: list[ServedBlock] | None = None
        try:
            async with asyncio.timeout(s.session_timeout):
                first = await inputs.next()
                if first is None:
                    return
                opened = parse_open(first, self.blocks, s.inference_max_length, s.adapters)
                blocks = opened.blocks
                # no await between the check of the session id and its registration
                with self._registered(opened.session_id, pushes):
                    self.name_pusher(opened.session_id, pushes, opened.metadata)
                    logger.info("rpc_inference.open(%s)", describe_call(context, blocks))
                    budget = self._step_budget(blocks, _header_batch(first), opened.max_length)
                    step = Step(first, s.hidden_size, s.dtype, None, budget) if first.tensors else None
                    batch = step.batch if step is not None else 1
                    cache = SessionCache(blocks, batch, opened.max_length, adapter=opened.adapter)
                    alloc_timeout = metadata_number(opened.metadata, KEY_ALLOC_TIMEOUT, 0.0)
                    what = f"a session of {batch} x {opened.max_length} tokens over {len(blocks)} blocks"
                    nbytes = SessionCache.nbytes(blocks, batch, opened.max_length)
                    # a session is charged at least one token, so a peer cannot open sessions of no cache without end
                    charged = max(nbytes, SessionCache.nbytes(blocks, 1, 1))
                    with self._peer_share(str(context.remote_id), charged):
                        async with self.budget.reserve(nbytes, alloc_timeout, what):
                            self.stats["sessions"] += 1
                            self._open += 1
                            try:
                                await self.compute.run(cache.allocate)
                                async for reply in self._steps(cache, first, step, inputs, opened.session_id):
                                    yield reply
                            finally:
                                self._open -= 1
                                cache.release()
        except TimeoutError:
            raise RequestError(f"inference session exceeded session_timeout={s.session_timeout:g} s") from None
        finally:
            inputs.cancel()
            logger.info("rpc_inference.close(%s)", describe_call(context, blocks))

    def _step_budget(self, blocks: Sequence[ServedBlock], batch: int | None, max_length: int) -> WireBudget:
        """What one step of a session may carry: ``batch`` (at most as many rows as the cache budget holds)
        x ``max_length`` positions of hidden states, deep prompts for each block, ``hypo_ids``."""
        per_row = SessionCache.nbytes(blocks, 1, max_length)
        fits = max(1, self.budget.total_bytes // per_row) if per_row else 1
        batch = fits if batch is None or batch > fits else batch
        tokens = batch * max_length
        return WireBudget(max_numel=tokens * self.settings.hidden_size * (1 + len(blocks)) + batch,
                          max_tokens=tokens, what="inference step")

    async def _steps(self, cache: SessionCache, first: runtime_pb2.ExpertRequest, step: Step | None,
                     inputs: SessionInputs, session_id: str | None) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        s = self.settings
        processed = StepIds()
        budget = self._step_budget(cache.blocks, cache.batch, cache.max_length)
        request: runtime_pb2.ExpertRequest | None = first
        while request is not None and request.tensors:
            try:
                step = step or Step(request, s.hidden_size, s.dtype, cache.batch, budget)
                if not inputs.last_pushed:
                    self.name_pusher(session_id, inputs.pushes, step.metadata)
                if step.pushed and request.uid != first.uid:
                    raise RequestError(f"pushed blocks {request.uid[:80]!r} are not this session's "
                                       f"{first.uid[:80]!r}")
                if step.step_id in processed:
                    self.stats["duplicate_steps"] += 1
                else:
                    output = await self._run_step(cache, step)
                    processed.add(step.step_id)
                    self.stats["pushed_steps" if step.pushed else "steps"] += 1
                    serialized = serialize_tensors([output], s.dtype, s.compression)[0]
                    # no push with deep prompts (as Petals 2.x): this message carries this server's prompts only
                    if step.next_servers and all(p is None for p in step.prompts_per_block):
                        self._background(self._push(step, request, serialized))
                    yield runtime_pb2.ExpertResponse(tensors=[serialized])
            except RequestError as exc:
                if not is_pushed(request):
                    raise
                # a bad push must not end the caller's session: the caller's own copy of the step still counts
                self.stats["bad_pushes"] += 1
                logger.warning("ignored a pushed step: %s", exc)
            step = None
            request = await inputs.next()

    async def _run_step(self, cache: SessionCache, step: Step) -> torch.Tensor:
        """Check the step against the session (nothing changes if it is refused), then run it."""
        s = self.settings
        start = metadata_int(step.metadata, KEY_START_FROM_POSITION, low=0, high=cache.position, default=None)
        position = cache.position if start is None else start
        refusal = cache.rewind_refusal(position)
        if refusal is not None:
            raise RequestError(refusal)
        n = step.hidden.shape[1]
        if position + n > cache.max_length:
            raise RequestError(f"Maximum length exceeded: prefix {position} + current {n} exceeds the "
                               f"session's max_length {cache.max_length}")
        step.prompts_per_block = check_prompts(step.prompts, len(cache.blocks), cache.batch, s.hidden_size,
                                               s.dtype, None)
        cache.restart(position)
        return await self.compute.step(cache, step.hidden, step.prompts_per_block, step.hypo_ids,
                                       lone=self._open == 1)

    # ------------------------------------------------------------------ outgoing pushes

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        """Keep a reference to a fire-and-forget task until it finishes."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _push(self, step: Step, request: runtime_pb2.ExpertRequest, serialized: runtime_pb2.Tensor) -> None:
        """Send this step's outputs to the next server of the caller's chain (failures are only logged)."""
        _, _, start, end = step.next_servers[0]
        peer, pushed = push_request(step, request, serialized, self.settings.dht_prefix)
        try:
            if self.pushes is None:
                assert self.p2p is not None
                self.pushes = PushStreams(self.p2p, self.settings.request_timeout)
            streamed = await self.pushes.push(peer, pushed)
            self.stats["pushes_sent"] += 1
            self.stats["pushes_streamed"] += int(streamed)
        except Exception as exc:
            logger.debug("push to %s (blocks %d:%d) failed: %r", peer[-6:], start, end, exc)
