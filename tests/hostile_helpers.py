"""Start hostile ``distconf serve`` processes (`hostile_serve.py`) next to honest ones, on 127.0.0.1.

They are `distconf.tools.serving.ServerProcess` like every other server of the tests
(see `client_swarm.start_server`); only the command differs.
"""

from __future__ import annotations

import sys
from pathlib import Path

from client_swarm import REPO

from distconf.tools.serving import ServerProcess

__all__ = ["HOSTILE_SCRIPT", "hostile_command", "serve_args", "start_hostile", "start_honest"]

HOSTILE_SCRIPT = Path(__file__).resolve().with_name("hostile_serve.py")


def serve_args(model_dir: Path, peers: list[str], blocks: str, *extra: str, dtype: str = "fp32") -> list[str]:
    """The ``distconf serve`` arguments the tests use (loopback, ``dtype``, blocks "A:B")."""
    return [str(model_dir), "--initial-peers", *peers, "--blocks", blocks, "--dtype", dtype, "--host", "127.0.0.1",
            *extra]


def hostile_command(mode: str, args: list[str], *, every: int | None = None, noise: float | None = None,
                    boost: float = 1.0, block: int | None = None, seed: int = 0) -> list[str]:
    """The command line of a hostile server in ``mode`` serving with ``args`` (see `hostile_serve`)."""
    cmd = [sys.executable, str(HOSTILE_SCRIPT), "--mode", mode, "--seed", str(seed), "--throughput-boost", str(boost)]
    if every is not None:
        cmd += ["--every", str(every)]
    if noise is not None:
        cmd += ["--noise", str(noise)]
    if block is not None:
        cmd += ["--block", str(block)]
    return [*cmd, "--", *args]


def start_hostile(mode: str, model_dir: Path, peers: list[str], blocks: str, log: Path, *extra: str,
                  dtype: str = "fp32", every: int | None = None, noise: float | None = None, boost: float = 1.0,
                  block: int | None = None) -> ServerProcess:
    """A hostile server (not waited for: call ``wait_ready``)."""
    cmd = hostile_command(mode, serve_args(model_dir, peers, blocks, *extra, dtype=dtype), every=every, noise=noise,
                          boost=boost, block=block)
    return ServerProcess(cmd, log, name=f"hostile-{mode}", env={"PYTHONPATH": str(REPO)})


def start_honest(model_dir: Path, peers: list[str], blocks: str, log: Path, *extra: str,
                 dtype: str = "fp32") -> ServerProcess:
    """An honest ``distconf serve`` process (not waited for)."""
    from distconf.tools.serving import serve_command

    cmd = serve_command(*serve_args(model_dir, peers, blocks, *extra, dtype=dtype))
    return ServerProcess(cmd, log, name=f"honest-{log.stem}", env={"PYTHONPATH": str(REPO)})
