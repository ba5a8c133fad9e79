"""Every command that joins a swarm says, in one line and with exit code 2, which initial peer failed and why."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import forkserver
import pytest
from real_helpers import real_cache_dir

from distconf.tools import real_model as rm

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PEER_ID = "QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z"


@pytest.fixture(scope="module")
def refusing_peer() -> Iterator[str]:
    """The multiaddr of a loopback port nobody listens on: bound here and never listened on, so connections are
    refused and no other process of the run can take the port meanwhile."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"/ip4/127.0.0.1/tcp/{sock.getsockname()[1]}/p2p/{PEER_ID}"


COMMANDS = {
    "serve": ["{model}", "--blocks", "0:2"],
    "generate": ["{model}", "hello"],
    "chat": ["{model}"],
    "api": ["{model}", "--port", "0"],
    "swarm": ["--model", "x"],
    "monitor": ["--port", "0"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_an_unreachable_initial_peer_is_one_line_naming_it_and_the_cause(command, refusing_peer, request):
    args = [a.format(model=rm.gguf_path()) for a in COMMANDS[command]]
    env = {**os.environ, "PYTHONPATH": str(REPO), "DISTCONF_CACHE": str(real_cache_dir(request.config).parent)}
    result = forkserver.run([sys.executable, "-m", "distconf", command, *args, "--initial-peers", refusing_peer],
                            timeout=300, env=env)
    ours = [line for line in result.stderr.splitlines() if line.startswith("distconf ")]
    assert result.returncode == 2, result.stderr[-3000:]
    assert ours == [f"distconf {command}: cannot join the swarm: {refusing_peer}: connection refused"], result.stderr
    assert "Traceback" not in result.stderr and result.stdout.strip() == ""
