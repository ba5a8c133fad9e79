"""The suite's fork server starts processes that behave as new interpreters would (tests/forkserver.py).

Each check compares a forked ``python -m distconf`` process with what a new interpreter does:
its own pid, session, environment, working directory, standard streams, exit code (also for
a signal), and a request that could differ (another environment, another command) started as
a new interpreter instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import forkserver
import pytest
from client_swarm import REPO, make_model_dir
from forkserver import ForkedProcess, ForkServer

from distconf.tools import serving
from distconf.tools.serving import ServerProcess, serve_command, stop_all

pytestmark = pytest.mark.slow  # the fork server imports torch and hivemind once (seconds)


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    """This worker's fork server (or one of the module's own when the suite runs without)."""
    if forkserver.LAUNCHER is not None:
        yield forkserver.LAUNCHER.server()
        return
    fork_server = ForkServer(dict(os.environ))
    yield fork_server
    fork_server.close()


def run(server: ForkServer, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
        ) -> tuple[object, int, str]:
    """Start ``python -m distconf ARGS`` through ``server``; return the process object, exit code and output."""
    proc = server.popen([sys.executable, "-m", "distconf", *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, env=env, cwd=cwd, text=True, bufsize=1, start_new_session=True)
    out = proc.stdout.read()
    return proc, proc.wait(60), out


def test_a_command_runs_forked_and_prints_what_a_new_interpreter_prints(server: ForkServer) -> None:
    forked, code, out = run(server, "list")
    fresh = subprocess.run([sys.executable, "-m", "distconf", "list"], capture_output=True, text=True, timeout=120)
    assert isinstance(forked, ForkedProcess)
    assert code == fresh.returncode == 0
    assert out == fresh.stdout + fresh.stderr


def test_usage_errors_keep_their_exit_code(server: ForkServer) -> None:
    _, code, out = run(server, "no-such-command")
    assert code == 2 and "invalid choice" in out


def test_the_child_runs_in_its_own_working_directory(server: ForkServer, tmp_path: Path) -> None:
    family = (Path(__file__).resolve().parents[1] / "families" / "llama.yaml").read_text(encoding="utf-8")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "llama.yaml").write_text(family, encoding="utf-8")
    forked, code, out = run(server, "validate", "mine", cwd=tmp_path)  # a path relative to the child's cwd
    assert isinstance(forked, ForkedProcess)
    assert code == 0 and "mine/llama.yaml" in out, out


def test_a_request_with_another_environment_starts_a_new_interpreter(server: ForkServer) -> None:
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9"}  # huggingface_hub reads it at import
    assert not server.forks([sys.executable, "-m", "distconf", "list"], env)
    proc, code, _ = run(server, "list", env=env)
    assert isinstance(proc, subprocess.Popen) and code == 0
    assert not server.forks([sys.executable, "-c", "pass"], None)


@pytest.mark.swarm
def test_a_forked_server_leads_its_session_and_ends_as_signalled(server: ForkServer,
                                                                                 tmp_path: Path) -> None:
    model_dir, _ = make_model_dir(tmp_path / "llama", "llama")
    command = serve_command(model_dir, "--new-swarm", "--blocks", "0:2", "--dtype", "fp32", "--host", "127.0.0.1")
    launched: list[ServerProcess] = []
    try:
        for _ in range(2):
            previous = serving.set_launcher(server.popen)
            try:
                launched.append(ServerProcess(command, tmp_path / f"{len(launched)}.log",
                                              env={"PYTHONPATH": str(REPO)}))
            finally:
                serving.set_launcher(previous)
        deadline = time.monotonic() + 120
        for proc in launched:
            proc.wait_ready(deadline)
            assert isinstance(proc.proc, ForkedProcess)
            assert os.getsid(proc.proc.pid) == proc.proc.pid != os.getpid()
        stopping, killed = launched
        stopping.send_signal(signal.SIGTERM)  # it announces OFFLINE and exits 0
        assert stopping.proc.wait(60) == 0
        assert any(line.startswith("DISTCONF_READY") for line in stopping.log_tail().splitlines())
        killed.proc.send_signal(signal.SIGKILL)
        assert killed.proc.wait(30) == -signal.SIGKILL
    finally:
        stop_all(launched)
