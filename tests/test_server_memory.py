"""The server's one KV-cache budget: reservations wait, fail clearly, and are always returned."""

from __future__ import annotations

import asyncio

import pytest
from dhthelpers import wait_for_async

from distconf.server.memory import AllocationFailed, CacheBudget


def test_reserve_and_release() -> None:
    async def run() -> None:
        budget = CacheBudget(100)
        async with budget.reserve(60, 0):
            assert budget.bytes_left == 40
            async with budget.reserve(40, 0):
                assert budget.bytes_left == 0
        assert budget.bytes_left == 100

    asyncio.run(run())


def test_never_fits_fails_at_once() -> None:
    async def run() -> None:
        budget = CacheBudget(100)
        with pytest.raises(AllocationFailed, match="whole cache budget is 100"):
            async with budget.reserve(101, 60):
                pass

    asyncio.run(run())


def test_waits_for_memory_then_gets_it() -> None:
    async def run() -> list[str]:
        budget = CacheBudget(100)
        events: list[str] = []

        async def holder() -> None:
            async with budget.reserve(80, 0):
                events.append("held")
                await asyncio.sleep(0.2)
            events.append("released")

        async def waiter() -> None:
            await wait_for_async(lambda: "held" in events, timeout=5, interval=0.005)
            async with budget.reserve(50, 5):
                events.append("got")

        await asyncio.gather(holder(), waiter())
        assert budget.bytes_left == 100
        return events

    assert asyncio.run(run()) == ["held", "released", "got"]


def test_wait_is_bounded_by_alloc_timeout_and_server_cap() -> None:
    async def run() -> None:
        budget = CacheBudget(100, max_alloc_timeout=0.1)
        async with budget.reserve(80, 0):
            with pytest.raises(AllocationFailed, match=r"only 20 of 100 were free within alloc_timeout=0.1 s"):
                async with budget.reserve(50, 3600):  # capped at the server's 0.1 s
                    pass
        assert budget.bytes_left == 100

    asyncio.run(asyncio.wait_for(run(), 10))


def test_cancelled_session_returns_its_memory() -> None:
    async def run() -> None:
        budget = CacheBudget(100)

        async def session() -> None:
            async with budget.reserve(70, 0):
                await asyncio.sleep(60)

        task = asyncio.ensure_future(session())
        await wait_for_async(lambda: budget.bytes_left == 30, timeout=5, interval=0.005)
        assert budget.bytes_left == 30
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert budget.bytes_left == 100

    asyncio.run(asyncio.wait_for(run(), 10))
