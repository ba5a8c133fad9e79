"""Helpers shared by the tests: a stand-in config, bounded waits (the suite's only polling), plain hivemind nodes."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from hivemind import DHT

T = TypeVar("T")


def stand_in_config(prefix: str, n: int) -> SimpleNamespace:
    """A stand-in config: discovery reads only dht_prefix, num_hidden_layers, update_period."""
    return SimpleNamespace(dht_prefix=prefix, num_hidden_layers=n, update_period=30.0)


def wait_for(predicate: Callable[[], Any], timeout: float = 15.0, interval: float = 0.25) -> Any:
    """Poll ``predicate`` until it returns a truthy value; bounded in time (and so in count)."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(interval)


async def wait_for_async(predicate: Callable[[], Any], timeout: float = 15.0, interval: float = 0.25) -> Any:
    """`wait_for` inside an event loop (other tasks run between polls); ``predicate`` may be a coroutine function."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result or time.monotonic() > deadline:
            return result
        await asyncio.sleep(interval)


def wait_until(read: Callable[[], T], done: Callable[[T], Any], timeout: float = 15.0, interval: float = 0.25) -> T:
    """`wait_for` ``done(read())``; returns the last reading (whether or not it was done in time)."""
    readings: list[T] = []

    def check() -> Any:
        readings.append(read())
        return done(readings[-1])

    wait_for(check, timeout, interval)
    return readings[-1]


def stop_process(proc: Any, sig: int = 15, timeout: float = 30.0) -> int:
    """Send ``sig`` (default SIGTERM) to a process the test started, wait ``timeout`` s, then kill it; its exit code."""
    import subprocess

    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait(10)


def start_plain_dht(initial_peers: list[str], timeout: float = 60.0) -> DHT:
    """A hivemind DHT node with no validator and no guard (a Petals 2.x node, or an attacker).

    Its cache refresh is off (``cache_refresh_before_expiry=0``, ``cache_on_store=False``):
    a plain node decodes every record it holds under a key when it refreshes that key
    (hivemind refreshes at once when the node stores into a key it also caches), so the
    deep records the hostile tests plant would crash the plain node itself, not the
    guarded node under test, at a moment that depends on timing.
    """
    from hivemind import DHT

    dht = DHT(initial_peers=list(initial_peers), start=False, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
              cache_refresh_before_expiry=0, cache_on_store=False)
    dht.run_in_background(await_ready=True, timeout=timeout)
    return dht


def run_in_node(dht: DHT, job: Callable[..., Any], timeout: float = 60.0) -> Any:
    """Run ``job(dht, node)`` in the DHT's process and return its result.

    Bounded in time; fails at once, naming the exit code, if the node's process dies
    (a dead node never answers, and waiting out the timeout would hide why).
    """
    future = dht.run_coroutine(job, return_future=True)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return future.result(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
        except TimeoutError:
            if not dht.is_alive():
                raise AssertionError(f"DHT node pid {dht.pid} died (exit code {dht.exitcode})") from None
            if time.monotonic() >= deadline:
                raise
