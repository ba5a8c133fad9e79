"""The server's step scheduler on a real `BlockHandler` (no swarm): sessions computed together.

Every session's outputs equal what it gets alone (float32, 1e-5 relative) while rows of
different lengths share batches, sessions join and leave mid-way, one stalls, one sends a
bad step, and a long prefill is computed in chunks; training requests wait for inference
steps, but only ``training_patience`` batches; short requests go first.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from dhthelpers import wait_for_async
from handlerhelpers import Caller, make_handler, output, step, tiny_served

from distconf.rpc.protocol import KEY_MAX_LENGTH
from distconf.server.compute import ServedBlock, forward_chain
from distconf.server.handler import BlockHandler
from distconf.server.scheduler import BatchLimits, ComputeScheduler
from distconf.server.session_cache import SessionCache
from distconf.server.validation import RequestError

H = 64
MAX_LENGTH = 64


@pytest.fixture(scope="module")
def served() -> list[ServedBlock]:
    return tiny_served(2, H)


@pytest.fixture
def executor():
    with ThreadPoolExecutor(1) as pool:
        yield pool


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max().clamp(min=1.0)))


class Client:
    """A session's inputs, the caller that sends them and the reference computed alone."""

    def __init__(self, handler: BlockHandler, served: list[ServedBlock], seed: int, lengths: list[int]) -> None:
        g = torch.Generator().manual_seed(seed)
        self.inputs = [torch.randn(1, n, H, generator=g) for n in lengths]
        self.caller = Caller(handler)
        self.alone = SessionCache(served, 1, MAX_LENGTH)
        self.alone.allocate()
        self.sent = 0

    def send_next(self) -> tuple[asyncio.Future[Any], torch.Tensor]:
        """Send the next input; (the reply future, the output it must have)."""
        x = self.inputs[self.sent]
        meta = {KEY_MAX_LENGTH: MAX_LENGTH} if self.sent == 0 else {}
        self.sent += 1
        return self.caller.send(step(x, **meta)), self.alone.step(x, [None, None], None)

    async def run(self, steps: int) -> None:
        """Send ``steps`` inputs one after another; every reply must equal the reference."""
        for _ in range(steps):
            reply, expected = self.send_next()
            assert close(output(await asyncio.wait_for(reply, 30)), expected)


class HeldThread:
    """Keeps the compute thread busy (a control task waiting on an event) until released."""

    def __init__(self, scheduler: ComputeScheduler) -> None:
        self.event = threading.Event()
        self.task = asyncio.ensure_future(scheduler.run(self.event.wait, 30))

    async def release(self) -> None:
        self.event.set()
        await self.task


async def lockstep(scheduler: ComputeScheduler, *clients: Client) -> None:
    """One step of every client, computed in one batch: the compute thread is held until all are queued."""
    held = HeldThread(scheduler)
    pending = [c.send_next() for c in clients]
    await until(lambda: scheduler.queued_steps == len(clients), "the lockstep steps are queued")
    await held.release()
    for reply, expected in pending:
        assert close(output(await asyncio.wait_for(reply, 30)), expected)


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait (bounded) until ``condition()`` holds."""
    assert await wait_for_async(condition, timeout=4.0, interval=0.01), f"timed out waiting until {what}"


def test_sessions_of_different_lengths_are_computed_together_and_exactly(served, executor) -> None:
    async def scenario() -> None:
        handler = make_handler(served, executor, 8 * SessionCache.nbytes(served, 1, MAX_LENGTH))
        scheduler = handler.compute
        clients = [Client(handler, served, seed, [n, 1, 1, 1, 1, 1, 1]) for seed, n in enumerate([3, 5, 2])]
        for c in clients:  # each opens with a prompt of its own length
            await c.run(1)
        held = HeldThread(scheduler)
        pending = [c.send_next() for c in clients]
        await until(lambda: scheduler.queued_steps == 3, "three steps are queued")
        await held.release()
        for reply, expected in pending:
            assert close(output(await asyncio.wait_for(reply, 30)), expected)
        assert scheduler.stats["max_batch_rows"] == 3 and scheduler.stats["batched_rows"] >= 3

        # a session joins mid-way, one leaves mid-way; the rest run on concurrently
        joiner = Client(handler, served, 7, [4, 1, 1, 1])
        leaver = clients[1]
        await asyncio.gather(clients[0].run(5), leaver.run(2), clients[2].run(3), joiner.run(4))
        await leaver.caller.close()
        unit = SessionCache.nbytes(served, 1, MAX_LENGTH)
        assert handler.budget.bytes_left == handler.budget.total_bytes - 3 * unit  # the leaver's share is back
        await asyncio.gather(clients[0].run(0), clients[2].run(2))
        for c in (clients[0], clients[2], joiner):
            await c.caller.close()
        assert handler.budget.bytes_left == handler.budget.total_bytes and len(handler.sessions) == 0

    asyncio.run(asyncio.wait_for(scenario(), 120))


def test_a_long_prefill_is_chunked_and_decode_goes_first(served, executor) -> None:
    async def scenario() -> None:
        limits = BatchLimits(prefill_chunk=8)
        handler = make_handler(served, executor, 4 * SessionCache.nbytes(served, 1, MAX_LENGTH), limits)
        scheduler = handler.compute
        decoder = Client(handler, served, 1, [3, 1, 1, 1])
        prefill = Client(handler, served, 2, [1, 48])
        await asyncio.gather(decoder.run(1), prefill.run(1))
        batches_before = scheduler.stats["batches"]
        held = HeldThread(scheduler)
        long_reply, long_expected = prefill.send_next()  # 48 tokens: six chunks of 8
        await until(lambda: scheduler.queued_steps == 1, "the prefill is queued")
        short_reply, short_expected = decoder.send_next()
        await until(lambda: scheduler.queued_steps == 2, "the decode step is queued")
        await held.release()
        assert close(output(await asyncio.wait_for(short_reply, 30)), short_expected)
        assert not long_reply.done()  # the decode step did not wait for the whole prefill
        remaining = asyncio.ensure_future(decoder.run(2))
        assert close(output(await asyncio.wait_for(long_reply, 30)), long_expected)
        await asyncio.wait_for(remaining, 30)
        assert scheduler.stats["batches"] - batches_before >= 6
        for c in (decoder, prefill):
            await c.caller.close()

    asyncio.run(asyncio.wait_for(scenario(), 120))


def test_a_stalled_session_and_a_bad_step_delay_nobody_else(served, executor) -> None:
    async def scenario() -> None:
        handler = make_handler(served, executor, 4 * SessionCache.nbytes(served, 1, MAX_LENGTH))
        stalled = Client(handler, served, 3, [4, 1, 1])
        busy = Client(handler, served, 4, [2] + [1] * 10)
        bad = Client(handler, served, 5, [3])
        await asyncio.gather(stalled.run(1), bad.run(1), busy.run(1))
        # the stalled session sends nothing for a while; the bad one sends a wrong hidden size
        refused = bad.caller.send(step(torch.randn(1, 1, H + 1)))
        await busy.run(9)
        with pytest.raises(RequestError, match="hidden size"):
            await asyncio.wait_for(refused, 30)
        await stalled.run(2)  # and it goes on exactly where it stopped
        for c in (stalled, busy):
            await c.caller.close()
        assert handler.budget.bytes_left == handler.budget.total_bytes and len(handler.sessions) == 0

    asyncio.run(asyncio.wait_for(scenario(), 120))


def test_training_waits_for_inference_but_not_forever(served, executor) -> None:
    async def scenario() -> None:
        scheduler = ComputeScheduler(executor, BatchLimits(max_batch_size=1, training_patience=2))
        caches = []
        for _ in range(5):
            cache = SessionCache(served, 1, MAX_LENGTH)
            await scheduler.run(cache.allocate)
            caches.append(cache)
        finished: list[str] = []

        def track(name: str, future: asyncio.Future[Any]) -> asyncio.Future[Any]:
            future = asyncio.ensure_future(future)
            future.add_done_callback(lambda _: finished.append(name))
            return future

        held = HeldThread(scheduler)
        x = torch.randn(2, 6, H)
        futures = [track("long", scheduler.run(forward_chain, served, x, [None, None], cost=1000)),
                   track("short", scheduler.run(forward_chain, served, x[:1, :2], [None, None], cost=2))]
        for i, cache in enumerate(caches):
            futures.append(track(f"step{i}", scheduler.step(cache, torch.randn(1, 1, H), [None, None], None)))
        await until(lambda: scheduler.queued_steps == 5, "five steps are queued")
        await held.release()
        await asyncio.wait_for(asyncio.gather(*futures), 60)
        # two inference batches, then the short training request; two more, then the long one
        assert finished == ["step0", "step1", "short", "step2", "step3", "long", "step4"]
        assert scheduler.stats["training"] == 2

    asyncio.run(asyncio.wait_for(scenario(), 120))


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="max_batch_size must be at least 1"):
        BatchLimits(max_batch_size=0)


def test_a_batch_stays_within_its_working_memory(served, executor) -> None:
    from distconf.planning import batch_activation_bytes

    config = served[0].module.settings.config

    def activation(rows: int, new: int, past: int) -> int:
        return batch_activation_bytes(config, rows, new, past, torch.float32, served[0].kv_bytes_per_token)

    async def scenario() -> None:
        limit = activation(2, 1, 8)  # two decode rows after 8 tokens fit; a third row does not
        scheduler = ComputeScheduler(executor, BatchLimits(max_batch_bytes=limit), activation)
        caches = []
        for _ in range(3):
            cache = SessionCache(served, 1, MAX_LENGTH)
            await scheduler.run(cache.allocate)
            await scheduler.step(cache, torch.randn(1, 8, H), [None, None], None)
            caches.append(cache)
        assert activation(3, 1, 8) > limit
        held = HeldThread(scheduler)
        steps = [asyncio.ensure_future(scheduler.step(c, torch.randn(1, 1, H), [None, None], None)) for c in caches]
        await until(lambda: scheduler.queued_steps == 3, "three steps are queued")
        await held.release()
        await asyncio.wait_for(asyncio.gather(*steps), 30)
        assert scheduler.stats["max_batch_rows"] == 2

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_step_waits_for_its_group_when_due_but_not_for_a_stalled_session(served, executor) -> None:
    async def scenario() -> None:
        limits = BatchLimits(max_batch_wait=5.0)
        handler = make_handler(served, executor, 4 * SessionCache.nbytes(served, 1, MAX_LENGTH), limits)
        stats = handler.compute.stats
        a, b = Client(handler, served, 1, [3] + [1] * 20), Client(handler, served, 2, [5] + [1] * 20)
        await asyncio.gather(a.run(1), b.run(1))
        await lockstep(handler.compute, a, b)  # their steps are computed together once: they are one group
        together = False
        for _ in range(3):  # up to 3 attempts: a round slowed by a loaded machine can make b look not steady
            for _ in range(3):  # both step in lockstep, 0.5 s apart: each is steady, and they stay one group
                await asyncio.sleep(0.5)  # (the compute thread is held until both are queued, so no race of
                await lockstep(handler.compute, a, b)  # the two arrivals splits them on a loaded machine)
            before = stats["batched_rows"]
            reply_a, expected_a = a.send_next()
            await asyncio.sleep(0.01)  # b is due: a's step waits for it
            reply_b, expected_b = b.send_next()
            assert close(output(await asyncio.wait_for(reply_a, 30)), expected_a)
            assert close(output(await asyncio.wait_for(reply_b, 30)), expected_b)
            together = stats["batched_rows"] - before == 2
            if together:
                break
        assert together  # computed together
        await asyncio.sleep(3.0)  # b stalls for far more than twice its gap: nobody waits for it any more
        await asyncio.wait_for(a.run(2), 4.0)  # waiting for b would take max_batch_wait = 5 s per step
        await b.run(1)
        for c in (a, b):
            await c.caller.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_lone_decode_step_is_computed_on_the_event_loop_and_a_due_session_still_batches(served, executor) -> None:
    """A lone session's decode steps skip the thread hand-offs (computed on the loop, exactly); the first step and
    a prefill go to the compute thread; while other sessions step, every step goes to the thread to be batched."""
    async def scenario() -> None:
        limits = BatchLimits(max_inline_seconds=1.0)  # a loaded machine must not make the tiny steps "slow"
        handler = make_handler(served, executor, 8 * SessionCache.nbytes(served, 1, MAX_LENGTH), limits)
        scheduler = handler.compute
        lone = Client(handler, served, 3, [20, 1, 1, 1, 1, 20, 1])
        await lone.run(2)  # the prefill and the first decode step: no lone step timed yet
        assert scheduler.stats["inline_steps"] == 0
        await until(lambda: scheduler.idle, "the compute thread is idle")  # it goes idle just after replying
        await lone.run(3)
        assert scheduler.stats["inline_steps"] == 3
        await lone.run(1)  # 20 tokens: a prefill-sized step, on the thread
        assert scheduler.stats["inline_steps"] == 3
        await until(lambda: scheduler.idle, "the compute thread is idle")
        await lone.run(1)
        assert scheduler.stats["inline_steps"] == 4

        mates = [Client(handler, served, seed, [2, 1, 1, 1, 1, 1]) for seed in (11, 12)]
        for c in mates:
            await c.run(1)
        for _ in range(3):  # steady mates, computed in one batch each time
            await lockstep(scheduler, *mates)
        inline = scheduler.stats["inline_steps"]
        await asyncio.gather(*(c.run(2) for c in mates))  # the compute thread is idle at times: still no inline
        assert scheduler.stats["inline_steps"] == inline
        for c in (lone, *mates):
            await c.caller.close()

    asyncio.run(asyncio.wait_for(scenario(), 120))
