"""A persistent benchmark client process that answers one JSON line per command, and the machine's load line.

The lab benchmarks (`bench_wan.py`, `bench_speculative.py`) start their client once (in a lab host, or here) and
send it commands, so that each measurement pays no model load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["LineClient", "load"]


def load() -> str:
    """The machine's load averages and core count (it is shared)."""
    one, five, _ = os.getloadavg()
    return f"load {one:.2f} / {five:.2f} (1 / 5 min), {os.cpu_count()} cores"


class LineClient:
    """``script PEER`` run in ``host`` (a lab host; None: here); it prints ``ready``, then a JSON line per command."""

    def __init__(self, script: Path, host: Any, peer: str, env: dict[str, str]) -> None:
        popen = subprocess.Popen if host is None else host.popen
        self.proc = popen([sys.executable, str(script), peer], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True, bufsize=1, env={**os.environ, **env})
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the benchmark client did not start")

    def ask(self, **command: Any) -> dict[str, Any]:
        """Send one command, return its answer."""
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the benchmark client exited")
        return json.loads(line)

    def close(self) -> None:
        """End the client (its stdin closes) and wait for it."""
        self.proc.stdin.close()
        self.proc.wait(30)
