"""The DHT node process: a ``hivemind.DHT`` whose parent alone decides when it stops.

A hivemind DHT node runs in a forked child process, which starts the p2p daemon
(``p2pd``) as a child of its own. Left as hivemind makes them, both get every signal
sent to the parent's process group (Ctrl-C in a terminal, ``kill -- -PGID``, systemd's
default ``KillMode``): p2pd exits at once, so a server can no longer announce OFFLINE;
the DHT child inherits the parent's Python SIGTERM handler, so it survives both the
signal and hivemind's ``terminate()``, and the parent then blocks for ever in
multiprocessing's exit join.

`NodeProcess` makes the order explicit:

- the child ignores SIGINT and SIGTERM, and p2pd runs in a process group of its own
  (`distconf.dht.hivemind_rpc_compat.isolate_p2p_daemon`), so a signal to the group reaches
  the parent only, which announces OFFLINE and then shuts the node down;
- `NodeProcess.shutdown` is bounded: hivemind's graceful shutdown (``shutdown_timeout``,
  3 s by default), then SIGKILL;
- a child whose parent is gone (killed, or exited without shutting it down) exits by
  itself, and p2pd follows it (Linux: its death signal). A parent thread's death signal
  (``PR_SET_PDEATHSIG``) is not used for the child: it fires when the *thread* that forked
  it ends, and a client may start its node from any thread. First the child stores its
  last will (`set_last_will`: a server's OFFLINE records), so a killed server's records
  say OFFLINE within a second instead of ONLINE until they expire;
- at interpreter exit every node still running is shut down before multiprocessing
  joins its children.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

from hivemind import DHT

from distconf.dht.hivemind_p2p_compat import static_relays
from distconf.dht.hivemind_rpc_compat import guard_msgpack_depth, isolate_p2p_daemon, renew_future_locks

__all__ = ["KILL_TIMEOUT", "WILL_TIMEOUT", "NodeProcess", "set_last_will", "shutdown_all"]

logger = logging.getLogger(__name__)

KILL_TIMEOUT = 2.0
"""Seconds a killed node process may take to be reaped."""
PARENT_POLL = 0.5
"""Seconds between the child's checks that its parent is still alive."""
WILL_TIMEOUT = 5.0
"""Seconds a child whose parent died may spend storing its last will before it exits."""

_exit_hook = threading.Lock()
_exit_hook_installed = False
_wills: dict[Hashable, Callable[[], Awaitable[Any]]] = {}  # in a DHT child: what to store if its parent dies
_will_loop: asyncio.AbstractEventLoop | None = None
_wills_lock = threading.Lock()


class NodeProcess(DHT):
    """A ``hivemind.DHT`` that ignores process-group signals and stops in bounded time (see the module)."""

    def start(self) -> None:
        """Start the child process (and make sure nodes still running at exit are shut down first)."""
        _install_exit_hook()
        self._distconf_parent = os.getpid()
        super().start()

    def run(self) -> None:
        """The child: ignore SIGINT/SIGTERM, watch the parent, isolate p2pd, guard msgpack, then run hivemind's node.

        The depth guard is installed before the node exists: its first messages (the bootstrap
        peers' replies) are decoded before `distconf.dht.guard.install_guard` runs."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # the parent's handlers were inherited by the fork
        threading.Thread(target=_exit_with_parent, args=(self._distconf_parent,), name="distconf-parent-watch",
                         daemon=True).start()
        isolate_p2p_daemon()
        guard_msgpack_depth()
        static_relays()  # a relayed server's daemon reserves its relay at once (see the compat module)
        super().run()

    def shutdown(self) -> None:
        """Shut the node down gracefully (hivemind's grace period), else kill it; return when it is gone."""
        if not self.is_alive():
            return
        try:
            super().shutdown()  # asks the node to stop, waits ``shutdown_timeout``, then SIGTERM (ignored)
        except (OSError, ValueError) as exc:  # its pipe is closed: a shutdown was asked already
            logger.debug("DHT shutdown request: %r", exc)
            self.join(self.shutdown_timeout)
        if self.is_alive():
            logger.warning("DHT process %s did not stop; killing it", self.pid)
            self.kill_now()

    def kill_now(self) -> None:
        """SIGKILL the node (one not ready yet has no graceful path); its p2p daemon follows it.

        When no other node of this process is left running, hivemind's reply locks are renewed: the killed one
        may have held one, which would block every later node of the process."""
        if self.is_alive():
            self.kill()
            self.join(KILL_TIMEOUT)
            if not any(isinstance(c, DHT) for c in multiprocessing.active_children()):  # ours or plain ones
                renew_future_locks()


def shutdown_all() -> None:
    """Shut down every `NodeProcess` this process started that is still running."""
    for child in multiprocessing.active_children():
        if isinstance(child, NodeProcess) and getattr(child, "_distconf_parent", None) == os.getpid():
            child.shutdown()


def _install_exit_hook() -> None:
    # atexit runs hooks last-registered first: this one runs before multiprocessing's own
    # exit function (registered when multiprocessing was imported), which would wait for
    # ever on a child that ignores its SIGTERM.
    global _exit_hook_installed
    with _exit_hook:
        if not _exit_hook_installed:
            atexit.register(shutdown_all)
            _exit_hook_installed = True


def set_last_will(key: Hashable, store: Callable[[], Awaitable[Any]] | None) -> None:
    """In a DHT process, on its event loop: await ``store()`` if the parent process dies (None forgets ``key``'s).

    Used by `distconf.dht.announce` for a server's OFFLINE records. Without a parent watch
    (a plain ``hivemind.DHT``) a will is never run.
    """
    global _will_loop
    with _wills_lock:
        _will_loop = asyncio.get_running_loop()
        if store is None:
            _wills.pop(key, None)
        else:
            _wills[key] = store


def _run_wills(timeout: float = WILL_TIMEOUT) -> None:
    with _wills_lock:
        loop, wills = _will_loop, list(_wills.values())
    if loop is None or not wills:
        return

    async def run_all() -> None:
        await asyncio.gather(*(will() for will in wills), return_exceptions=True)

    try:
        asyncio.run_coroutine_threadsafe(run_all(), loop).result(timeout)
    except Exception as exc:  # the parent is gone: nothing to report to but the log
        logger.warning("DHT process %d: its last will was not stored: %r", os.getpid(), exc)


def _exit_with_parent(parent_pid: int, poll: float = PARENT_POLL) -> None:
    while os.getppid() == parent_pid:
        time.sleep(poll)
    logger.warning("parent process %d is gone: DHT process %d exits", parent_pid, os.getpid())
    _run_wills()
    os._exit(0)  # p2pd gets its death signal; nothing here is worth flushing

