"""`bounded`: run a step of the demo in a worker thread and give up at the demo's deadline."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["bounded"]

T = TypeVar("T")


def bounded(fn: Callable[[], T], deadline: float, what: str) -> T:
    """Run ``fn`` in a worker thread; raise `TimeoutError` if it is not done by ``deadline`` (monotonic).

    The main thread only waits, so a Ctrl-C reaches it at once and the demo stops its servers.
    """
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc

    worker = threading.Thread(target=work, name="distconf-demo-step", daemon=True)
    worker.start()
    worker.join(max(1.0, deadline - time.monotonic()))
    if worker.is_alive():
        raise TimeoutError(f"{what} did not finish within the demo's time limit")
    if "error" in box:
        raise box["error"]
    return box["result"]
