"""The server's one owner of inference sessions, driven through a real `BlockHandler` (no swarm).

Two sessions opened with one session id race while the first waits for cache memory: the
second is refused at once, the first works (and keeps receiving pushes), and the budget
is full again afterwards.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from dhthelpers import wait_for_async
from handlerhelpers import CONTEXT, Caller, make_handler, output, step, tiny_served

from distconf.rpc.protocol import KEY_ALLOC_TIMEOUT, KEY_MAX_LENGTH, KEY_PUSHED, KEY_SESSION_ID, KEY_STEP_ID
from distconf.server.compute import ServedBlock, forward_chain
from distconf.server.session_cache import SessionCache
from distconf.server.validation import RequestError

H = 64  # hidden size of the tiny blocks


@pytest.fixture(scope="module")
def served() -> list[ServedBlock]:
    """Two real tiny blocks (random weights), as the server holds them."""
    return tiny_served(2, H)


@pytest.fixture
def executor():
    with ThreadPoolExecutor(1) as pool:
        yield pool


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
        assert await wait_for_async(lambda: "same" in sessions, timeout=5, interval=0.01)
        assert not first_reply.done()  # the first session now waits for cache memory

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
