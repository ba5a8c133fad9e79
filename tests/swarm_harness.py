"""The tests' one swarm harness: DHT nodes, ``distconf serve`` servers, client models, guaranteed teardown.

A `Swarm` owns everything it starts and stops it in order on `Swarm.close` (client models,
then servers all at once, then extra DHT nodes, then its bootstrap node), also when a start
fails halfway (``with Swarm(...)``, `swarm_fixture`). `dht_node` is the same guarantee for a
one-off DHT node.

Typical use, a module-scoped swarm of a tiny llama (A holds blocks 0:2, B and C hold 2:4)::

    swarm = swarm_fixture("client-swarm", spans=("0:2", "2:4", "2:4"))

    def test_x(swarm: Swarm) -> None:
        model = swarm.model()
        assert generate(model, ids) == swarm.expected(ids)
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from client_swarm import REPO, START_DEADLINE, make_model_dir

from distconf.tools.serving import ServerProcess, serve_command, stop_all, wait_all_ready

__all__ = ["Swarm", "dht_node", "generate", "shutdown_nodes", "swarm_fixture"]


def shutdown_nodes(nodes: Sequence[Any]) -> None:
    """Shut DHT nodes down, newest first (each shutdown bounded; one failing does not keep the rest alive)."""
    for node in reversed(list(nodes)):
        with contextlib.suppress(Exception):
            if node.is_alive():
                node.shutdown()


@contextlib.contextmanager
def dht_node(initial_peers: Sequence[str] = (), **kwargs: Any) -> Iterator[Any]:
    """A hardened loopback DHT node (`distconf.dht.start_local_dht`), shut down on exit."""
    from distconf.dht import start_local_dht

    node = start_local_dht(list(initial_peers), **kwargs)
    try:
        yield node
    finally:
        shutdown_nodes([node])


def generate(model: Any, ids: torch.Tensor, **kwargs: Any) -> list[list[int]]:
    """``model.generate`` on unpadded rows (pad token 0), as token lists."""
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, **kwargs).tolist()


class Swarm:
    """A bootstrap DHT node on 127.0.0.1 and what the test adds: model folders, servers, nodes, client models.

    ``Swarm(root, family=..., spans=(...), *server_args)`` also makes a tiny model folder of
    ``family`` (`model_dir`, its local reference `local`, `config`) and starts one server per
    span at once, waiting until all announce themselves. ``family=None`` starts only the
    bootstrap node (add folders with `add_model`, servers with `serve`, DHT nodes with `node`); ``root``
    (where folders and server logs go) may be None for a swarm of DHT nodes only.
    """

    def __init__(self, root: Path | None = None, family: str | None = None, spans: Sequence[str] = (),
                 server_args: Sequence[str] = (), *, dht_kwargs: dict[str, Any] | None = None,
                 **model_kwargs: Any) -> None:
        from distconf.dht import start_local_dht, visible_maddrs

        self.root = root
        self.servers: list[ServerProcess] = []
        self.models: list[Any] = []
        self.nodes: list[Any] = []
        self.closers: list[Callable[[], Any]] = []
        self.model_dir: Path | None = None
        self.local: Any = None
        self.dht = start_local_dht(**(dht_kwargs or {}))
        self.peers = visible_maddrs(self.dht)
        try:
            if family is not None:
                self.model_dir, self.local = self.add_model(family, **model_kwargs)
                if spans:
                    self.serve([(self.model_dir, span) for span in spans], *server_args)
            self.build()
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- building

    def build(self) -> None:
        """What a subclass starts besides the bootstrap node (called at construction: a failure stops all)."""

    def add_model(self, family: str, name: str | None = None, **kwargs: Any) -> tuple[Path, Any]:
        """A tiny model folder of ``family`` under ``root / (name or family)`` and its local reference model."""
        return make_model_dir(self.root / (name or family), family, **kwargs)

    @functools.cached_property
    def config(self) -> Any:
        """The distributed config of `model_dir` (read once)."""
        from distconf.loader.auto import AutoDistributedConfig

        return AutoDistributedConfig.from_pretrained(str(self.model_dir))

    @functools.cached_property
    def prefix(self) -> str:
        """The DHT prefix of `model_dir` (read once)."""
        return self.config.dht_prefix

    def start_server(self, model: str | Path, span: str | None, *args: str, log: str | None = None, dtype: str = "fp32",
                     name: str | None = None, env: dict[str, str] | None = None) -> ServerProcess:
        """Start (and own) a ``distconf serve`` of ``span`` of ``model`` on 127.0.0.1, joined through the
        bootstrap node; not waited for (see `wait_ready`). ``span`` None: the server places itself (pass
        ``--num-blocks``). ``env`` adds to the environment (and PYTHONPATH)."""
        log_path = self.root / (log or f"{Path(model).name}-{len(self.servers)}.log")
        blocks = ("--blocks", span) if span is not None else ()
        cmd = serve_command(model, "--initial-peers", *self.peers, *blocks, "--dtype", dtype, "--host", "127.0.0.1",
                            *args)
        server = ServerProcess(cmd, log_path, name=name or Path(model).name,
                               env={"PYTHONPATH": str(REPO), **(env or {})})
        self.servers.append(server)
        return server

    def add_server(self, server: ServerProcess) -> ServerProcess:
        """Own a server started some other way (a hostile server, a custom command line)."""
        self.servers.append(server)
        return server

    def wait_ready(self, servers: Sequence[ServerProcess] | None = None, timeout: float = START_DEADLINE
                   ) -> list[ServerProcess]:
        """Wait (bounded) until ``servers`` (default: all of this swarm's) printed their ready line."""
        servers = list(self.servers if servers is None else servers)
        wait_all_ready(servers, time.monotonic() + timeout)
        return servers

    def serve(self, jobs: Sequence[tuple[Path, str]], *args: str) -> list[ServerProcess]:
        """One server per ``(model_dir, "A:B")`` job, all started at once, then waited for."""
        return self.wait_ready([self.start_server(model_dir, span, *args) for model_dir, span in jobs])

    def node(self, **kwargs: Any) -> Any:
        """Another DHT node joined through the bootstrap node (shut down with the swarm)."""
        from distconf.dht import start_local_dht

        node = start_local_dht(self.peers, **kwargs)
        self.nodes.append(node)
        return node

    def plain_node(self) -> Any:
        """A plain hivemind DHT node (a Petals 2.x node, or an attacker) joined through the bootstrap node."""
        from dhthelpers import start_plain_dht

        node = start_plain_dht(self.peers)
        self.nodes.append(node)
        return node

    def on_close(self, closer: Callable[[], Any]) -> None:
        """Call ``closer`` first when the swarm closes (a monitor thread, a client of the test's own)."""
        self.closers.append(closer)

    # ---------------------------------------------------------------- using

    def model(self, directory: Path | None = None, **kwargs: Any) -> Any:
        """A client model on this swarm (through the bootstrap node unless ``initial_peers`` is given).

        ``max_retries`` defaults to 3 (every wait bounded). Shut down with the swarm.
        """
        from distconf.client import AutoDistributedModelForCausalLM

        if "initial_peers" not in kwargs:
            kwargs.setdefault("dht", self.dht)
        kwargs.setdefault("max_retries", 3)
        model = AutoDistributedModelForCausalLM.from_pretrained(directory or self.model_dir, **kwargs)
        self.models.append(model)
        return model

    def expected(self, ids: torch.Tensor, **kwargs: Any) -> list[list[int]]:
        """What the local reference model generates."""
        return generate(self.local, ids, **kwargs)

    # ---------------------------------------------------------------- teardown

    def close(self) -> list[int]:
        """Stop everything this swarm started, in order; returns the servers' exit codes."""
        for closer in reversed(self.closers):
            with contextlib.suppress(Exception):
                closer()
        for model in self.models:
            with contextlib.suppress(Exception):
                model.shutdown()
        codes = stop_all(self.servers)  # all at once: they announce OFFLINE in parallel
        shutdown_nodes(self.nodes)
        from distconf.client.swarm import release_dht

        release_dht(self.dht)
        return codes

    def __enter__(self) -> Swarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def swarm_fixture(name: str, family: str | None = "llama", spans: Sequence[str] = ("0:2", "2:4", "2:4"),
                  server_args: Sequence[str] = (), *, scope: str = "module", cls: type[Swarm] = Swarm,
                  **model_kwargs: Any) -> Any:
    """A pytest fixture (named ``swarm`` where it is assigned) yielding a `Swarm` in a fresh temp folder."""

    @pytest.fixture(scope=scope)
    def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
        with cls(tmp_path_factory.mktemp(name), family, spans, server_args, **model_kwargs) as s:
            yield s

    return swarm
