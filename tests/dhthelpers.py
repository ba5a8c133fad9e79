"""Helpers shared by the DHT and monitor tests: a stand-in config and a bounded wait."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any


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
