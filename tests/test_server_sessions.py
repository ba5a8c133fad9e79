"""The server's one owner of inference sessions, driven through a real `BlockHandler` (no swarm).

Two sessions opened with one session id race while the first waits for cache memory: the
second is refused at once, the first works (and keeps receiving pushes), and the budget
is full again afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from blockhelpers import family_config

from distconf.blocks import build_block, kv_geometry
from distconf.rpc import chain_uid, deserialize_tensors, inference_step_request
from distconf.rpc.protocol import KEY_ALLOC_TIMEOUT, KEY_MAX_LENGTH, KEY_PUSHED, KEY_SESSION_ID, KEY_STEP_ID
from distconf.server.compute import ServedBlock, SessionCache, forward_chain
from distconf.server.handler import BlockHandler, HandlerSettings
from distconf.server.memory import CacheBudget
from distconf.server.validation import RequestError

PREFIX = "sessions-test"
CONTEXT: Any = SimpleNamespace(remote_id="peer-abcdef")
H = 64  # hidden size of the tiny blocks


@pytest.fixture(scope="module")
def served() -> list[ServedBlock]:
    """Two real tiny llama blocks (random weights), as the server holds them."""
    config, _, _ = family_config("llama", num_hidden_layers=2, hidden_size=H)
    torch.manual_seed(0)
    modules = [build_block(config, i, device="cpu", dtype=torch.float32).requires_grad_(False) for i in range(2)]
    geometry = kv_geometry(config)
    per_token = geometry.values_per_token * 4
    uids = [chain_uid(PREFIX, i, i + 1) for i in range(2)]
    return [ServedBlock(uid, i, m, torch.float32, geometry, per_token) for i, (uid, m) in enumerate(zip(uids, modules))]


@pytest.fixture
def executor():
    with ThreadPoolExecutor(1) as pool:
        yield pool


def make_handler(served: list[ServedBlock], executor: ThreadPoolExecutor, budget_bytes: int) -> BlockHandler:
    settings = HandlerSettings(dht_prefix=PREFIX, hidden_size=H, dtype=torch.float32,
                               inference_max_length=64, step_timeout=20, session_timeout=60)
    return BlockHandler(served, CacheBudget(budget_bytes), settings, executor)


class Caller:
    """One ``rpc_inference`` stream: messages put by the test, replies read from the handler."""

    def __init__(self, handler: BlockHandler) -> None:
        self.messages: asyncio.Queue[Any] = asyncio.Queue()
        self.replies = handler.rpc_inference(self._requests(), CONTEXT)

    async def _requests(self) -> AsyncIterator[Any]:
        while (message := await self.messages.get()) is not None:
            yield message

    def send(self, message: Any) -> asyncio.Future[Any]:
        """Put ``message`` on the stream; the future is the next reply."""
        self.messages.put_nowait(message)
        return asyncio.ensure_future(self.replies.__anext__())

    async def close(self) -> None:
        """End the stream; the session must end with it."""
        self.messages.put_nowait(None)
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(self.replies.__anext__(), 20)


def step(hidden: torch.Tensor, **metadata: Any) -> Any:
    return inference_step_request(chain_uid(PREFIX, 0, 2), hidden, metadata=metadata)


def output(reply: Any) -> torch.Tensor:
    (tensor,) = deserialize_tensors(reply.tensors)
    return tensor


def test_two_opens_with_one_session_id_race(served: list[ServedBlock], executor: ThreadPoolExecutor) -> None:
    unit = SessionCache.nbytes(served, 1, 8)

    async def scenario() -> None:
        handler = make_handler(served, executor, 2 * unit)
        budget, sessions = handler.budget, handler.sessions
        h = H
        hidden = torch.randn(1, 3, h, generator=torch.Generator().manual_seed(1))

        holder = Caller(handler)  # holds the whole budget
        await asyncio.wait_for(holder.send(step(hidden, **{KEY_MAX_LENGTH: 16, KEY_SESSION_ID: "holder"})), 20)
        assert budget.bytes_left == 0

        first = Caller(handler)
        first_reply = first.send(step(hidden, **{KEY_MAX_LENGTH: 8, KEY_SESSION_ID: "same", KEY_ALLOC_TIMEOUT: 30,
                                                 KEY_STEP_ID: "s1"}))
        await asyncio.sleep(0.2)  # the first session now waits for cache memory
        assert not first_reply.done() and "same" in sessions

        second = Caller(handler)
        with pytest.raises(RequestError) as refused:
            await asyncio.wait_for(second.send(step(hidden, **{KEY_MAX_LENGTH: 8, KEY_SESSION_ID: "same",
                                                                KEY_ALLOC_TIMEOUT: 30})), 5)
        assert str(refused.value) == "session id 'same' is already in use"
        assert "same" in sessions  # the refused open did not unregister the first

        await holder.close()
        reply = await asyncio.wait_for(first_reply, 20)
        assert torch.allclose(output(reply), forward_chain(served, hidden, [None, None]), atol=1e-5)
        assert budget.bytes_left == unit

        # the first session still gets pushes by its id; a pushed copy of a processed step is a duplicate
        pushed = step(hidden[:, :1], **{KEY_SESSION_ID: "same", KEY_PUSHED: True, KEY_STEP_ID: "s2"})
        await handler.rpc_push(pushed, CONTEXT)
        assert handler.stats["pushes_received"] == 1
        pushed_reply = await asyncio.wait_for(first.replies.__anext__(), 20)
        assert output(pushed_reply).shape == (1, 1, h)
        first.messages.put_nowait(step(hidden[:, :1], **{KEY_STEP_ID: "s2"}))  # the caller's copy: no reply
        following = await asyncio.wait_for(first.send(step(hidden[:, :2], **{KEY_STEP_ID: "s3"})), 20)
        assert output(following).shape == (1, 2, h) and handler.stats["duplicate_steps"] == 1
        assert handler.stats["steps"] == 3  # holder's, s1 and s3: the duplicate did not run

        await handler.rpc_push(step(hidden[:, :1], **{KEY_SESSION_ID: "nobody", KEY_PUSHED: True}), CONTEXT)
        assert handler.stats["pushes_received"] == 1  # an unknown session's push is ignored
        first.messages.put_nowait(None)
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(first.replies.__anext__(), 20)
        assert budget.bytes_left == budget.total_bytes == 2 * unit
        assert len(sessions) == 0 and "same" not in sessions
        assert handler.stats["sessions"] == 2 and handler.stats["pushed_steps"] == 1

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_concurrent_opens_without_waiting_refuse_the_later_one(served: list[ServedBlock],
                                                              executor: ThreadPoolExecutor) -> None:
    async def scenario() -> None:
        handler = make_handler(served, executor, 4 * SessionCache.nbytes(served, 1, 8))
        h = H
        hidden = torch.randn(1, 2, h)
        a, b = Caller(handler), Caller(handler)
        opens = [c.send(step(hidden, **{KEY_MAX_LENGTH: 8, KEY_SESSION_ID: "x"})) for c in (a, b)]
        results = await asyncio.wait_for(asyncio.gather(*opens, return_exceptions=True), 20)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert len(errors) == 1 and isinstance(errors[0], RequestError)
        assert str(errors[0]) == "session id 'x' is already in use"
        winner = a if not isinstance(results[0], BaseException) else b
        await winner.close()
        assert handler.budget.bytes_left == handler.budget.total_bytes and len(handler.sessions) == 0

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_failed_open_frees_its_session_id(served: list[ServedBlock], executor: ThreadPoolExecutor) -> None:
    async def scenario() -> None:
        handler = make_handler(served, executor, SessionCache.nbytes(served, 1, 8))
        h = H
        bad = Caller(handler)
        with pytest.raises(RequestError, match="has hidden size 3"):
            await asyncio.wait_for(bad.send(step(torch.randn(1, 2, 3), **{KEY_MAX_LENGTH: 8,
                                                                        KEY_SESSION_ID: "y"})), 20)
        assert "y" not in handler.sessions
        good = Caller(handler)
        await asyncio.wait_for(good.send(step(torch.randn(1, 2, h), **{KEY_MAX_LENGTH: 8, KEY_SESSION_ID: "y"})), 20)
        await good.close()
        assert handler.budget.bytes_left == handler.budget.total_bytes and len(handler.sessions) == 0

    asyncio.run(asyncio.wait_for(scenario(), 60))
