"""Shared fixtures: isolate the family search path and the class cache per test."""

from __future__ import annotations

import multiprocessing.process
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from distconf.threads import SWITCH, apply_thread_policy

# One compute thread and passive OpenMP waits per process (here and in every process the tests start),
# set before torch is imported: tests run several processes per core (xdist workers, swarms), whose
# spinning OpenMP threads starve each other (a tiny MoE block's test took 12 s instead of 0.06 s).
# The user's own variables win (see distconf.threads).
os.environ.setdefault(SWITCH, "1")
apply_thread_policy("process")
# Nothing dials the public hub: hub ids are read from the cache (processes the tests start inherit it), unless a
# test points HF_ENDPOINT at its own stand-in hub on loopback and lifts this.
os.environ["HF_HUB_OFFLINE"] = "1"

REPO = Path(__file__).resolve().parents[1]
FAMILIES = REPO / "families"


@pytest.fixture(autouse=True)
def _isolated_search_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """No user families and no initial-peer env leak into tests unless a test sets them."""
    monkeypatch.delenv("DISTCONF_FAMILIES_PATH", raising=False)
    monkeypatch.delenv("DISTCONF_INITIAL_PEERS", raising=False)
    monkeypatch.delenv("DISTCONF_TRUSTED_MODULES", raising=False)


@pytest.fixture
def fresh_cache():
    """Forget synthesized classes before and after the test (for tests that change the search path)."""
    from distconf.loader.registry import clear_cache

    clear_cache()
    yield
    clear_cache()


@pytest.fixture
def family_text():
    """Text of a built-in family file."""
    return lambda name: (FAMILIES / f"{name}.yaml").read_text(encoding="utf-8")


SWARM_FIXTURES = frozenset({"swarm", "swarms", "served", "dht", "nodes", "live_swarm", "small_swarm", "browser"})
"""Fixtures that start processes (DHT nodes, ``distconf serve`` servers, Chromium): a test using one is ``swarm``.

A test that starts such processes itself carries ``@pytest.mark.swarm`` (or its module a ``pytestmark``).
"""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that uses a process-starting fixture as ``swarm`` (`make test-fast` deselects them)."""
    for item in items:
        if SWARM_FIXTURES.intersection(getattr(item, "fixturenames", ())) and item.get_closest_marker("swarm") is None:
            item.add_marker(pytest.mark.swarm)


@pytest.fixture(autouse=True)
def _swarm_tier_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A test not marked ``swarm`` may not start a hivemind process (a DHT node): the fast tier stays fast."""
    if request.node.get_closest_marker("swarm") is not None:
        yield
        return
    start = multiprocessing.process.BaseProcess.start

    def guarded_start(process: multiprocessing.process.BaseProcess) -> None:
        if any(cls.__module__.startswith("hivemind") for cls in type(process).__mro__):  # distconf's too
            raise RuntimeError(f"{request.node.nodeid} starts a hivemind {type(process).__name__} process: "
                               "mark it @pytest.mark.swarm (or use a fixture in conftest.SWARM_FIXTURES)")
        start(process)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", guarded_start)
    yield
