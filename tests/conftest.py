"""Shared fixtures: isolate the family search path and the class cache per test."""

from __future__ import annotations

import gc
import multiprocessing.process
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import forkserver
import pytest

from distconf.threads import SWITCH, apply_thread_policy, policy_defaults

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
SESSION_ENV = dict(os.environ)
"""The environment every test starts from: servers started with it are forked from a preloaded interpreter."""
FORKSERVER_ENV = "DISTCONF_TEST_FORKSERVER"
"""Set to 0: start every server as a new interpreter (see tests/forkserver.py)."""


LAUNCHER = (forkserver.LazyForkServer(SESSION_ENV) if os.environ.get(FORKSERVER_ENV) != "0"
            and policy_defaults("server", os.environ[SWITCH]) == policy_defaults("process", os.environ[SWITCH])
            else None)
"""How this worker starts servers and command-line runs (None: as new interpreters). Forking needs one thread
policy for every role: torch is imported before the fork, with the fork server's."""
forkserver.LAUNCHER = LAUNCHER


@pytest.fixture(autouse=True, scope="session")
def _server_launcher() -> Iterator[None]:
    """Servers (`distconf.tools.serving.ServerProcess`) and `forkserver.run` commands of this worker start as
    forks of one preloaded interpreter."""
    if LAUNCHER is None:
        yield
        return
    from distconf.tools import serving

    serving.set_launcher(LAUNCHER)
    yield
    serving.set_launcher(None)
    LAUNCHER.close()


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


@pytest.fixture(scope="session")
def real_source(request: pytest.FixtureRequest) -> Any:
    """The real model's GGUF as a `ModelSource` (converted once per checkout; see real_helpers)."""
    from real_helpers import open_real_source

    return open_real_source(request.config)


@pytest.fixture(scope="session")
def real_tokenizer(real_source: Any) -> Any:
    """The real model's tokenizer, loaded once per test run."""
    return real_source.load_tokenizer()


@pytest.fixture(scope="session")
def real_local(real_source: Any) -> Any:
    """The real model run locally (float32, eval, no grad), loaded once per test run and shared.

    A module that gives it an ``inference_session`` (a local cache standing for the swarm's session)
    sets it in a module fixture and deletes it after (``real_helpers.local_sessions``).
    """
    from distconf.tools import real_model as rm

    return rm.local_model(real_source.checkpoint_dir)


SWARM_FIXTURES = frozenset({"swarm", "swarms", "served", "dht", "nodes", "live_swarm", "small_swarm", "browser"})
"""Fixtures that start processes (DHT nodes, ``distconf serve`` servers, Chromium): a test using one is ``swarm``.

A test that starts such processes itself carries ``@pytest.mark.swarm`` (or its module a ``pytestmark``).
"""


SLOW_FIXTURES = frozenset({"real_local"})
"""Fixtures whose tests take seconds each: the real 135M model generating text locally (1-3 s of CPU per test)."""


LONGEST_FILES = ("test_lab_swarm.py", "test_real_swarm.py", "test_verify_swarm.py", "test_chat_swarm.py",
                 "test_adapters_swarm.py", "test_speculative_swarm.py", "test_hostile_runtime_crash.py",
                 "test_unreachable_peers.py", "test_swarm_demo.py", "test_api_swarm.py", "test_server_stop.py",
                 "test_client_generate.py", "test_verify_report_swarm.py", "test_real_model.py", "test_sources.py",
                 "test_sweep_drafts.py", "test_hub_downloads.py", "test_client_swarm.py", "test_dht_discovery.py",
                 "test_state_families_swarm.py", "test_dht_hostile.py", "test_hivemind_compat.py",
                 "test_gemma_swarm.py",
                 # the fast tier's (make test-fast deselects the ones above)
                 "test_drafting_golden.py", "test_drafting.py", "test_batch_step.py", "test_kv_sharing.py")
"""The files of the longest wall time in ``make test`` (measured, longest first): collected first, so that
``--dist loadfile --no-loadscope-reorder`` (the Makefile's) starts them first and the run does not end waiting on
one of them."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that uses a process-starting fixture as ``swarm``, and one that runs the real model as
    ``slow`` (`make test-fast` deselects both); put the longest files first (see `LONGEST_FILES`)."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if SWARM_FIXTURES.intersection(fixtures) and item.get_closest_marker("swarm") is None:
            item.add_marker(pytest.mark.swarm)
        if SLOW_FIXTURES.intersection(fixtures) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collecting imported (torch, transformers, distconf, the test modules): it lives as long as the
    worker, and every full collection would visit it again (a worker's 17 full collections of the fast tier took
    4.2-4.6 CPU-s without the freeze, 2.5-3.6 with it); the DHT nodes a test forks from the worker then leave it
    alone too."""
    gc.freeze()


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


CPU_LOG_ENV = "DISTCONF_TEST_CPU_LOG"
"""Set to a file path: each test appends ``file<TAB>test<TAB>cpu s<TAB>wall s`` to it, the CPU being the worker's and
its reaped children's (servers, DHT nodes, CLIs; forked servers once collected), module fixtures' setup and
teardown included. What makes the suite slow on 2 cores is CPU, not waits: ``make test-profile`` sums it per file."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """With `CPU_LOG_ENV` set, log the CPU and wall time of each test (and of the fixtures it sets up and tears
    down)."""
    log = os.environ.get(CPU_LOG_ENV)
    if not log:
        yield
        return
    forked = LAUNCHER.reaped_cpu if LAUNCHER else 0.0  # servers forked from the preloaded interpreter
    before, start = os.times(), time.monotonic()
    yield
    after = os.times()
    cpu = sum(after[:4]) - sum(before[:4]) + (LAUNCHER.reaped_cpu if LAUNCHER else 0.0) - forked
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"{item.path.name}\t{item.name}\t{cpu:.2f}\t{time.monotonic() - start:.2f}\n")
