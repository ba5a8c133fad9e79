"""One harness for server processes: start one, read its lines, wait for its ready line, stop or kill it.

The demo, the tests and the benchmarks all start servers through `ServerProcess`; every
wait is bounded. A server is ready when it prints the line `distconf.cli.cmd_serve.ready_line`
makes (``DISTCONF_READY {json}``), whose record `wait_ready` returns.

A server given a stdin pipe stops when its input ends, so the write end of that pipe must
belong to this process alone: a process forked from it later (a client's hivemind DHT node,
any ``multiprocessing`` fork) would inherit it, and the server would never see the end of
its input. Every forked child therefore points the pipes of the servers it inherited at
``/dev/null`` (`_release_stdin_pipes`).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from distconf.server.ready import parse_ready_line

__all__ = ["Launcher", "ServerProcess", "serve_command", "set_launcher", "stop_all", "wait_all_ready"]

Launcher = Callable[..., Any]
"""Starts a server process: `subprocess.Popen`'s signature, returning an object with Popen's ``pid``,
``stdin``, ``stdout``, ``returncode``, ``poll``, ``wait`` and ``send_signal``."""

_launcher: Launcher = subprocess.Popen


def set_launcher(launcher: Launcher | None) -> Launcher:
    """How `ServerProcess` starts servers from now on in this process (None: `subprocess.Popen`); returns the
    launcher it replaces.

    The test suite starts its servers from a preloaded fork server this way (``tests/forkserver.py``).
    """
    global _launcher
    previous, _launcher = _launcher, (subprocess.Popen if launcher is None else launcher)
    return previous


def serve_command(model_dir: str | Path, *args: str) -> list[str]:
    """The command line of a ``distconf serve MODEL_DIR ARGS...`` process run by this interpreter."""
    return [sys.executable, "-m", "distconf", "serve", str(model_dir), *args]


_with_stdin: weakref.WeakSet[ServerProcess] = weakref.WeakSet()
"""The servers of this process whose stdin is a pipe that is still open."""


def _release_stdin_pipes() -> None:
    """In a forked child: point the inherited stdin pipes of this process's servers at ``/dev/null``.

    The servers then see the end of their input when the parent closes its end, whatever
    it forked meanwhile. The descriptors stay taken (by ``/dev/null``), so the inherited
    file objects never close or write to a descriptor the child reuses for something else.
    """
    pipes = list(_with_stdin)
    _with_stdin.clear()
    if not pipes:
        return
    null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    try:
        for server in pipes:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                os.dup2(null, server.proc.stdin.fileno(), inheritable=False)
    finally:
        os.close(null)


os.register_at_fork(after_in_child=_release_stdin_pipes)


class ServerProcess:
    """A server subprocess in a session of its own (its DHT and P2P daemon children go with it).

    Its stdout and stderr are read line by line by a thread; every line is copied to ``log``
    (a path or an open text file) and kept for `expect` / `wait_ready`. A Ctrl-C in the
    terminal reaches only the parent, which stops its servers in order.
    """

    def __init__(self, cmd: Sequence[str], log: str | Path | IO[str] | None = None, *, name: str = "server",
                 env: dict[str, str] | None = None, stdin: bool = False) -> None:
        self.name = name
        self.peer_id = ""
        self.ready: dict[str, Any] | None = None
        self.signalled = False
        self.log_path = Path(log) if isinstance(log, (str, Path)) else None
        self._log: IO[str] | None = self.log_path.open("w", encoding="utf-8") if self.log_path else log
        self._owns_log = self.log_path is not None
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = _launcher(list(cmd), stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                              env=full_env, start_new_session=True)
        if stdin:
            _with_stdin.add(self)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            if self._log is not None:
                with contextlib.suppress(ValueError):  # the log was closed under us
                    self._log.write(raw)
                    self._log.flush()
            self.lines.put(raw.rstrip("\n"))
        self.lines.put(None)

    @property
    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the log file (empty when the log is not a file of this process's own)."""
        if self.log_path is None:
            return ""
        return self.log_path.read_text(encoding="utf-8", errors="replace")[-chars:]

    def _failure(self, what: str) -> str:
        where = f"; log {self.log_path}:\n{self.log_tail()}" if self.log_path else ""
        return f"{self.name} {what}{where}"

    def expect(self, word: str, deadline: float) -> str:
        """Wait (until ``deadline``, monotonic) for a line whose first word is ``word``; return the line."""
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(self._failure(f"exited (code {self.proc.poll()}) before saying {word}"))
            if line.split(maxsplit=1)[:1] == [word]:
                return line
        raise TimeoutError(self._failure(f"did not say {word} in time"))

    def wait_ready(self, deadline: float) -> dict[str, Any]:
        """Wait (until ``deadline``) for the ready line; keep its record and peer id, and return the record."""
        from distconf.server.ready import READY_TAG

        record = parse_ready_line(self.expect(READY_TAG, deadline))
        assert record is not None
        self.ready, self.peer_id = record, record["peer_id"]
        return record

    @property
    def span(self) -> tuple[int, int]:
        """``(start, end)`` of the blocks served (``(0, 0)`` before the ready line)."""
        if self.ready is None:
            return 0, 0
        start, end = self.ready["blocks"]
        return int(start), int(end)

    def send(self, line: str) -> None:
        """Write one line to the server's stdin (ignored if it is gone or has no stdin pipe)."""
        with contextlib.suppress(OSError, ValueError, AttributeError):
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to the server once (SIGTERM: it announces OFFLINE and exits)."""
        if self.proc.poll() is None and not self.signalled:
            self.signalled = True
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL the server's whole process group at once (a crash: no OFFLINE announcement); reap it."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def stop(self, timeout: float = 20.0, sig: int = signal.SIGTERM) -> int:
        """Ask the server to stop, wait up to ``timeout`` s, then kill its group; return its exit code.

        A server with a stdin pipe is asked by closing its input (it stops when its input ends),
        and signalled only if it is still running after ``timeout``; any other is signalled at once.
        """
        if self.proc.stdin is not None:
            _with_stdin.discard(self)
            with contextlib.suppress(OSError, ValueError):
                self.proc.stdin.close()
            self._wait(timeout)
            self.send_signal(sig)
            self._wait(5.0)
        else:
            self.send_signal(sig)
            self._wait(timeout)
        self.kill()  # the server, or what outlived it in its group (a DHT or P2P daemon child)
        self._pump_thread.join(10)  # the last lines (e.g. the shutdown checks) reach the log before it closes
        if self._owns_log and self._log is not None:
            self._log.close()
        return self.proc.returncode

    def _wait(self, timeout: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(max(0.1, timeout))


def stop_all(servers: Sequence[ServerProcess], timeout: float = 20.0) -> list[int]:
    """Signal every server at once (they announce OFFLINE in parallel), then stop each; return the exit codes."""
    for server in servers:
        server.send_signal()
    return [server.stop(timeout) for server in servers]


def wait_all_ready(servers: Sequence[ServerProcess], deadline: float) -> list[dict[str, Any]]:
    """Wait (until ``deadline``) for every server's ready line; on failure stop them all and re-raise."""
    try:
        return [server.wait_ready(deadline) for server in servers]
    except BaseException:
        stop_all(servers)
        raise
