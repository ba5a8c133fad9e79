"""The messages of an ``rpc_inference`` session: its opening, its steps, where they come from.

The first message names the chain and carries ``max_length`` (and optionally
``session_id``, ``alloc_timeout``); its batch size fixes the session's (`parse_open`).
Each later message with tensors is a step (`Step`), from the caller's stream or pushed by
the previous server (`SessionInputs`); a step whose ``step_id`` was already processed is
a duplicate (`StepIds`: the same step can arrive from the caller and by ``rpc_push``).
A step's tensors are checked from their headers (`distconf.server.wire_checks`) before they
are decoded; its ids are bounded in length and only their digests are remembered.
Nothing here holds server state: `distconf.server.sessions` runs sessions with these.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator  # noqa: UP035

from hivemind.proto import runtime_pb2

from distconf.rpc.protocol import (
    KEY_MAX_LENGTH,
    KEY_NEXT_SERVERS,
    KEY_PUSH_FROM,
    KEY_PUSHED,
    KEY_SESSION_ID,
    KEY_STEP_ID,
    ProtocolError,
    chain_uid,
    dumps_metadata,
    loads_metadata,
    read_request,
)
from distconf.server.compute import ServedBlock
from distconf.server.validation import (
    RequestError,
    check_adapter,
    check_hidden,
    check_hypo_ids,
    check_id,
    check_peer_id,
    metadata_int,
    next_servers,
    served_chain,
    unpack_tensors,
)
from distconf.server.wire_checks import WireBudget, check_headers

if TYPE_CHECKING:
    import torch

__all__ = ["MAX_REMEMBERED_STEPS", "NOT_NAMED", "PUSH_QUEUE_SIZE", "OpenRequest", "SessionInputs", "Step",
           "StepIds", "is_pushed", "named_pusher", "parse_open", "push_request"]

PUSH_QUEUE_SIZE = 64
"""Pushed steps a session may hold before further pushes are dropped."""
MAX_REMEMBERED_STEPS = 1024
"""Step ids a session remembers for de-duplication (a duplicate arrives right after its original);
each as a 16-byte digest, so a session's ids take a few tens of KiB whatever their length."""
NOT_NAMED = object()
"""`named_pusher` of metadata that does not name the session's upstream server."""


@dataclass(frozen=True)
class OpenRequest:
    """What a session's first message asks for (checked, except whether its session id is free)."""

    blocks: list[ServedBlock]
    metadata: dict[str, Any]
    max_length: int
    session_id: str | None
    adapter: str | None = None


def parse_open(first: runtime_pb2.ExpertRequest, blocks: Mapping[str, ServedBlock],
               inference_max_length: int, adapters: Collection[str] = ()) -> OpenRequest:
    """Check a session's first message against the served ``blocks``; `RequestError` says what is wrong."""
    chain = served_chain(blocks, first.uid)
    try:
        metadata = loads_metadata(first.metadata)
    except ProtocolError as exc:
        raise RequestError(str(exc)) from None
    max_length = metadata_int(metadata, KEY_MAX_LENGTH, low=0, high=inference_max_length)
    adapter = check_adapter(metadata, adapters)
    session_id = check_id(metadata.get(KEY_SESSION_ID), KEY_SESSION_ID)
    return OpenRequest(chain, metadata, max_length, session_id, adapter)


def named_pusher(metadata: dict[str, Any]) -> Any:
    """The peer a session's own client names as the one server that may push to the session
    (``push_from``: a base58 peer id, or ``""`` for none); `NOT_NAMED` when the key is absent."""
    value = metadata.get(KEY_PUSH_FROM, NOT_NAMED)
    if value is NOT_NAMED or value == "":
        return value
    return check_peer_id(value, f"metadata {KEY_PUSH_FROM!r}")


class Step:
    """A parsed step message (hidden states checked against the server's ``hidden_size`` and the session's batch)."""

    def __init__(self, request: runtime_pb2.ExpertRequest, hidden_size: int, dtype: torch.dtype,
                 batch: int | None, budget: WireBudget | None = None) -> None:
        """``budget``: what the message may carry, checked from the tensors' headers before decoding."""
        if budget is not None:
            check_headers(request.tensors, budget)
        try:
            tensors, self.metadata = read_request(request)
        except ProtocolError as exc:
            raise RequestError(str(exc)) from None
        hidden, self.prompts, hypo_ids = unpack_tensors(tensors, self.metadata,
                                                        ("hidden_states", "prompts", "hypo_ids"))
        self.hidden = check_hidden("hidden_states", hidden, hidden_size, dtype, batch=batch, allow_empty=True)
        self.batch = self.hidden.shape[0]
        self.hypo_ids = check_hypo_ids(hypo_ids, self.batch)
        self.step_id = check_id(self.metadata.get(KEY_STEP_ID), KEY_STEP_ID, (str, bytes, int))
        self.pushed = bool(self.metadata.get(KEY_PUSHED))
        self.next_servers = next_servers(self.metadata.get(KEY_NEXT_SERVERS))
        self.prompts_per_block: list[torch.Tensor | None] = []


class StepIds:
    """The step ids a session processed, as digests (the oldest are forgotten past `MAX_REMEMBERED_STEPS`)."""

    def __init__(self, limit: int = MAX_REMEMBERED_STEPS) -> None:
        self.limit = limit
        self._seen: dict[bytes, None] = {}  # insertion-ordered: the oldest ids are forgotten first

    @staticmethod
    def _digest(step_id: str | bytes | int) -> bytes:
        raw = step_id if isinstance(step_id, bytes) else str(step_id).encode()
        return hashlib.blake2b(type(step_id).__name__.encode() + b":" + raw, digest_size=16).digest()

    def __contains__(self, step_id: Any) -> bool:
        return step_id is not None and self._digest(step_id) in self._seen

    def add(self, step_id: Any) -> None:
        """Remember ``step_id`` (None is never remembered)."""
        if step_id is None:
            return
        self._seen[self._digest(step_id)] = None
        if len(self._seen) > self.limit:
            del self._seen[next(iter(self._seen))]


class SessionInputs:
    """Next message of a session: from the caller's stream or the push queue, within ``step_timeout``."""

    def __init__(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                 pushes: asyncio.Queue[runtime_pb2.ExpertRequest], step_timeout: float) -> None:
        self.requests, self.pushes, self.step_timeout = requests, pushes, step_timeout
        self._own: asyncio.Task[Any] | None = None
        self._push: asyncio.Task[Any] | None = None
        self.last_pushed = False  # whether the last message came from the push queue (not the caller's stream)

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
            self.last_pushed = False
            try:
                return task.result()
            except StopAsyncIteration:
                return None
        if self._push in done:
            task, self._push = self._push, None
            self.last_pushed = True
            return task.result()
        raise RequestError(f"no inference step arrived within step_timeout={self.step_timeout:g} s")

    def cancel(self) -> None:
        """Cancel pending waits."""
        for task in (self._own, self._push):
            if task is not None:
                task.cancel()


def is_pushed(request: runtime_pb2.ExpertRequest) -> bool:
    """Whether a message says it was pushed by a previous server (False when its metadata is unreadable)."""
    try:
        return bool(loads_metadata(request.metadata).get(KEY_PUSHED))
    except ProtocolError:
        return False


def push_request(step: Step, request: runtime_pb2.ExpertRequest, output: runtime_pb2.Tensor,
                 dht_prefix: str) -> tuple[str, runtime_pb2.ExpertRequest]:
    """(next peer, ``rpc_push`` message) carrying this step's ``output`` to the next server of the chain."""
    peer, session_id, start, end = step.next_servers[0]
    metadata = dict(step.metadata)
    metadata.update({KEY_SESSION_ID: session_id, KEY_NEXT_SERVERS: step.next_servers[1:], KEY_PUSHED: True})
    return peer, runtime_pb2.ExpertRequest(uid=chain_uid(dht_prefix, start, end),
                                           tensors=[output, *request.tensors[1:]], metadata=dumps_metadata(metadata))
