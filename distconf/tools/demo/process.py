"""The orchestrator's side of a demo server process: start it, read its lines, stop it (bounded waits only)."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import IO

__all__ = ["ServerProcess"]


class ServerProcess:
    """One ``python -m distconf.tools.demo serve`` subprocess with a line reader.

    It runs in a session of its own (with its DHT and P2P daemon children), so a Ctrl-C
    in the terminal reaches only the orchestrator, which then stops every server in order;
    a server that does not stop in time is killed with its whole process group.
    """

    def __init__(self, name: str, args: list[str], log: IO[str]) -> None:
        self.name = name
        self.peer_id = ""
        self.span = (0, 0)
        cmd = [sys.executable, "-m", "distconf.tools.demo", "serve", "--name", name, *args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                     bufsize=1, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put(raw.strip())
        self.lines.put(None)

    @property
    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.proc.poll() is None

    def label(self) -> str:
        """``server-2 (blocks 4..7)``."""
        return f"{self.name} (blocks {self.span[0]}..{self.span[1] - 1})"

    def expect(self, word: str, deadline: float) -> list[str]:
        """Wait (until ``deadline``) for a line starting with ``word``; return the rest of its words."""
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"{self.name} exited (code {self.proc.poll()}) before saying {word}")
            if line.startswith(word):
                return line.split()[1:]
        raise TimeoutError(f"{self.name} did not say {word} in time")

    def send(self, line: str) -> None:
        """Write one line to the server (ignored if it is gone)."""
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()

    def stop(self, deadline: float) -> int:
        """Ask the server to stop, wait until ``deadline``, then terminate/kill it; return its exit code."""
        if self.proc.poll() is not None:
            return self.proc.returncode
        self.send("STOP")
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            return self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                return self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
                return self.proc.wait(timeout=5)
        finally:
            self._reap_group()

    def kill(self) -> None:
        """SIGKILL the server's whole process group (its DHT and P2P daemon too)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def _reap_group(self) -> None:
        """After the server exits, kill what is left of its group (a daemon child that outlived it)."""
        if self.proc.poll() is not None:
            self.kill()
