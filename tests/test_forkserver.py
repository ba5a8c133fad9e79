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
def test_a_forked_command_asked_to_fork_its_servers_starts_them_from_the_same_server(server: ForkServer,
                                                                                     tmp_path: Path) -> None:
    """What the demo's test does: the demo's `ServerProcess` starts are forks too (and only when asked); their
    CPU is counted in the command's, as a new interpreter's children's would be."""
    burn = tmp_path / "burns_a_second.py"
    burn.write_text("import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0:\n    pass\n"
                    "print('burnt')\n")
    script = tmp_path / "starts_a_server.py"
    script.write_text("import sys\n"
                      "from distconf.tools.serving import ServerProcess\n"
                      f"p = ServerProcess([sys.executable, {str(burn)!r}], name='s')\n"
                      "print(type(p.proc).__name__, p.proc.wait(60), p.lines.get(timeout=60))\n")
    for fork_servers, kind in ((True, "ForkedProcess"), (False, "Popen")):
        cpu = server.reaped_cpu
        proc = server.popen([sys.executable, str(script)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True,
                            fork_servers=fork_servers)
        out = proc.stdout.read()
        assert proc.wait(60) == 0 and out.split() == [kind, "0", "burnt"], out
        assert server.reaped_cpu - cpu >= 1.0


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


EXIT_SCRIPT = """\
import atexit, sys, tempfile, threading, time
from pathlib import Path
kept = tempfile.TemporaryDirectory(dir=sys.argv[1])  # removed at exit by a weakref finalizer
Path(kept.name, "f").write_text("x")
atexit.register(print, "exit handler ran")
import logging
logging.basicConfig(stream=sys.stderr, format="%(message)s")
logging.getLogger("t").warning("logged")
threading.Thread(target=lambda: (time.sleep(0.5), print("thread finished", flush=False))).start()
mode = sys.argv[2]
if mode == "message":
    sys.exit("a message on stderr")
if mode == "code":
    sys.exit(3)
if mode == "raise":
    raise ValueError("uncaught")
print("end of script", flush=False)
"""


@pytest.mark.parametrize("mode", ["message", "code", "raise", "end"])
def test_a_forked_process_exits_as_a_new_interpreter_does(server: ForkServer, tmp_path: Path, mode: str) -> None:
    """Exit code, a message or traceback on stderr, non-daemon threads, exit handlers (the command's and the
    preloaded libraries': logging, weakref finalizers), unflushed output: the same, forked or not."""
    script = tmp_path / "exits.py"
    script.write_text(EXIT_SCRIPT)
    results = []
    for launch in (server.popen, subprocess.Popen):
        work = tmp_path / launch.__name__
        work.mkdir()
        proc = launch([sys.executable, str(script), str(work), mode], stdin=subprocess.DEVNULL,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=-1, start_new_session=True)
        out, err = proc.communicate(timeout=120)
        unframed = [line for line in err.splitlines() if not line.startswith(" ")]  # forked: the fork server's too
        results.append((proc.returncode, out, unframed, list(work.iterdir())))
    forked, fresh = results
    assert forked == fresh
    assert fresh[0] == {"message": 1, "code": 3, "raise": 1, "end": 0}[mode] and fresh[3] == []
    assert "thread finished" in fresh[1] and fresh[1].rstrip().endswith("exit handler ran")
    assert "logged" in fresh[2] and ("ValueError: uncaught" in fresh[2]) == (mode == "raise")
    assert ("a message on stderr" in fresh[2]) == (mode == "message")


HOLD_HIVEMIND_LOCK = """
import sys, time
from hivemind.utils.mpfuture import MPFuture
MPFuture._update_lock.acquire()  # as a process killed while it sends a DHT reply (hivemind's lock of every update)
print("HOLDING", flush=True)
time.sleep(600)
"""
TAKE_HIVEMIND_LOCK = """
from hivemind.utils.mpfuture import MPFuture
print("TAKEN" if MPFuture._update_lock.acquire(timeout=5) else "BLOCKED", flush=True)
"""


def test_a_forked_process_killed_holding_hivemind_s_lock_blocks_no_other(server: ForkServer) -> None:
    """hivemind's MPFuture locks are multiprocessing locks made at import, which every fork of a preloaded interpreter
    would share: one forked process killed while holding the lock every DHT reply takes (a client a test kills) left
    every later DHT node of that worker unable to say it is ready (60 s, then "DHT node not ready"). Each forked
    process has its own, as each new interpreter has."""
    holder = server.popen([sys.executable, forkserver.script(HOLD_HIVEMIND_LOCK)], stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                          start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "HOLDING"
    finally:
        holder.kill()
        holder.wait(30)
    taker = server.popen([sys.executable, forkserver.script(TAKE_HIVEMIND_LOCK)], stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
    out, _ = taker.communicate(timeout=60)
    assert out.strip() == "TAKEN"
