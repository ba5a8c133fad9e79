"""The orchestrator's side of a demo server process: `distconf.tools.serving.ServerProcess` with a name."""

from __future__ import annotations

import signal
import sys
from typing import IO

from distconf.tools.serving import ServerProcess

__all__ = ["DemoServer"]


class DemoServer(ServerProcess):
    """One ``python -m distconf.tools.demo serve`` subprocess, driven over its stdin (``GO``, ``STOP``).

    It runs in a session of its own (with its DHT and P2P daemon children), so a Ctrl-C
    in the terminal reaches only the orchestrator, which then stops every server in order;
    a server that does not stop in time is killed with its whole process group.
    """

    def __init__(self, name: str, args: list[str], log: IO[str]) -> None:
        super().__init__([sys.executable, "-m", "distconf.tools.demo", "serve", "--name", name, *args], log,
                         name=name, stdin=True)

    def stop(self, timeout: float = 20.0, sig: int = signal.SIGTERM) -> int:
        """Say ``STOP``, then close the server's input (`ServerProcess.stop`); return its exit code.

        Either alone makes the server announce OFFLINE and exit; ``STOP`` does not depend on
        the end of input reaching it.
        """
        self.send("STOP")
        return super().stop(timeout, sig)

    def label(self) -> str:
        """``server-2 (blocks 4..7)``."""
        return f"{self.name} (blocks {self.span[0]}..{self.span[1] - 1})"
