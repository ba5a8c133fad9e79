"""One KV-cache budget shared by every inference session of a server.

A session reserves ``batch x max_length`` tokens of every block of its chain at once
(`CacheBudget.reserve`), waiting up to its ``alloc_timeout`` when other sessions hold the
memory, and returns it when it ends, fails or times out. Used from the server's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

__all__ = ["AllocationFailed", "CacheBudget"]

logger = logging.getLogger(__name__)


class AllocationFailed(RuntimeError):
    """A cache reservation that cannot be satisfied (now or ever)."""


class CacheBudget:
    """Bytes of KV cache the server may hold for all sessions together.

    :param total_bytes: the budget. :param max_alloc_timeout: cap on a request's wait.
    """

    def __init__(self, total_bytes: int, max_alloc_timeout: float = 600.0) -> None:
        if total_bytes < 0:
            raise ValueError(f"cache budget must be >= 0 bytes, got {total_bytes}")
        self.total_bytes = int(total_bytes)
        self.max_alloc_timeout = float(max_alloc_timeout)
        self._used = 0
        self._changed: asyncio.Condition | None = None

    @property
    def bytes_left(self) -> int:
        """Bytes not reserved by any session."""
        return self.total_bytes - self._used

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    @contextlib.asynccontextmanager
    async def reserve(self, nbytes: int, timeout: float, what: str = "the session") -> AsyncIterator[None]:
        """Hold ``nbytes`` for the duration of the ``async with`` block.

        Waits up to ``min(timeout, max_alloc_timeout)`` seconds for other sessions to free
        memory; raises `AllocationFailed` when the request can never fit or the wait ends.
        """
        if nbytes > self.total_bytes:
            raise AllocationFailed(f"{what} needs {nbytes} bytes of KV cache but the server's whole cache budget "
                                   f"is {self.total_bytes} bytes; ask for fewer tokens (max_length x batch)")
        timeout = max(0.0, min(float(timeout), self.max_alloc_timeout))
        changed = self._condition()
        if nbytes > self.bytes_left:
            async with changed:
                try:
                    await asyncio.wait_for(changed.wait_for(lambda: nbytes <= self.bytes_left), timeout or 1e-3)
                except TimeoutError:
                    raise AllocationFailed(
                        f"{what} needs {nbytes} bytes of KV cache; only {self.bytes_left} of {self.total_bytes} "
                        f"were free within alloc_timeout={timeout:g} s") from None
        self._used += nbytes
        try:
            yield
        finally:
            self._used -= nbytes  # synchronous: a cancelled session cannot leak its reservation
            asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        changed = self._condition()
        async with changed:
            changed.notify_all()
