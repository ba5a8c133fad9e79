"""Real servers of the real model on lab hosts (`distconf.tools.netlab`), for the tests that cross networks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import forkserver
import pytest

from distconf.tools import real_model as rm
from distconf.tools.netlab import Host, Lab, LabUnavailable
from distconf.tools.serving import ServerProcess, serve_command

REPO = Path(__file__).resolve().parents[1]
START_DEADLINE = 300.0
CLIENT = str(Path(__file__).with_name("lab_client.py"))


def open_lab() -> Lab:
    """A new lab, or the test is skipped with the reason the machine cannot host one."""
    try:
        return Lab()
    except LabUnavailable as exc:
        pytest.skip(str(exc))


def server_env(config: pytest.Config) -> dict[str, str]:
    """The environment of a real server: the shared GGUF conversion cache of the test run."""
    from real_helpers import real_cache_dir

    return {"PYTHONPATH": str(REPO), "DISTCONF_CACHE": str(real_cache_dir(config).parent)}


def start_server(host: Host, log_dir: Path, name: str, env: dict[str, str], *args: str) -> ServerProcess:
    """``distconf serve`` of the real model (fp32) inside ``host``, with ``args``; not waited for."""
    command = serve_command(rm.gguf_path(), "--dtype", "float32", *args)
    return ServerProcess(host.command(command), log_dir / f"{name}.log", name=name, env=env)


def ready(server: ServerProcess) -> dict[str, Any]:
    """The server's ready record (waits up to `START_DEADLINE` for it the first time)."""
    return server.ready if server.ready is not None else server.wait_ready(time.monotonic() + START_DEADLINE)


def lab_address(record: dict[str, Any]) -> str:
    """The first address of a ready record (the lab hosts announce their lab address only)."""
    return record["addresses"][0]


def run_client(host: Host, env: dict[str, str], timeout: float = 240.0, **options: Any) -> dict[str, Any]:
    """`tests/lab_client.py` inside ``host``: its JSON result (``error`` when it failed)."""
    result = forkserver.run(host.command([sys.executable, CLIENT, json.dumps(options)]), timeout=timeout,
                            env={**os.environ, **env})
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise AssertionError(f"the lab client printed no result (exit {result.returncode}): {result.stderr[-3000:]}")
    return json.loads(lines[-1])


def group_pid(server: ServerProcess) -> int:
    """The process group of a server (its own session: the pid of the ``ip netns exec`` that became it)."""
    return server.proc.pid


def namespace_pids(host: Host) -> list[int]:
    """Processes running in ``host`` now."""
    out = subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]
