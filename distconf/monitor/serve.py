"""Run the monitor's app with uvicorn: in the foreground (the CLI) or in a thread (tests, benchmarks)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["RunningServer", "is_loopback", "serve_forever", "start_in_thread"]

logger = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names the loopback interface only."""
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


def serve_forever(app: Any, host: str, port: int, *, log_level: str = "warning",
                  on_ready: Callable[[int], None] | None = None) -> None:
    """Serve ``app`` on ``host:port`` (0: a free port) until interrupted (Ctrl-C stops it cleanly).

    ``on_ready(port)`` is called once the server accepts connections, with the port it listens on,
    so whatever it prints can be dialled at once.
    """
    import uvicorn

    sock = _bound_socket(host, port)
    bound = int(sock.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False, server_header=False))

    async def serve() -> None:
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started and on_ready is not None:
            on_ready(bound)
        await task

    try:
        asyncio.run(serve())
    finally:
        sock.close()


def _bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: the OS chooses), ready to be handed to uvicorn."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


@dataclass
class RunningServer:
    """A uvicorn server running in a daemon thread; `stop` ends it."""

    url: str
    server: Any
    thread: threading.Thread

    def stop(self, timeout: float = 10.0) -> None:
        """Ask uvicorn to exit and wait up to ``timeout`` seconds."""
        self.server.should_exit = True
        self.thread.join(timeout)


def start_in_thread(app: Any, host: str = "127.0.0.1", port: int = 0, *, timeout: float = 30.0) -> RunningServer:
    """Serve ``app`` from a thread on ``host:port`` (0: a free port); wait up to ``timeout`` s until it listens."""
    import uvicorn

    sock = _bound_socket(host, port)
    bound = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", access_log=False, server_header=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="distconf-monitor-http",
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            thread.join(5)
            sock.close()
            raise TimeoutError(f"the monitor's web server did not start within {timeout} s")
        time.sleep(0.02)
    return RunningServer(f"http://{host}:{bound}", server, thread)
