"""`OncePerKey`: a thread-safe cache that builds each value once (the classes synthesized per config class)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["OncePerKey"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class OncePerKey(Generic[K, V]):
    """``get(key, build)`` returns the value built for ``key``, calling ``build()`` once per key.

    Reads take no lock (a dict lookup is atomic); a miss builds under a re-entrant lock, so a
    builder may itself ask the cache for another key, and two threads never build one key twice.
    """

    def __init__(self) -> None:
        self._values: dict[K, V] = {}
        self._lock = threading.RLock()

    def get(self, key: K, build: Callable[[], V]) -> V:
        """The value of ``key``, built by ``build()`` on first use."""
        try:
            return self._values[key]
        except KeyError:
            pass
        with self._lock:
            if key not in self._values:
                self._values[key] = build()
            return self._values[key]
