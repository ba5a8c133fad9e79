"""Thread counts and the OpenMP wait policy of distconf's own processes, chosen before torch is imported.

Why: torch's CPU build here runs its kernels on GNU OpenMP (libgomp, with MKL on top of it).
By default an OpenMP worker thread *spins* on its core for a while after every parallel
region, waiting for the next one. One process alone gains a little from that; several
processes on one machine lose a lot: a server's spinning threads take the cores from the next
process of the pipeline (the client, the next server), which then waits for the scheduler.
`distconf serve`, the client, the demo (three servers and a client) and the test suite's
swarms all put several of our processes on one machine, so they use ``OMP_WAIT_POLICY=PASSIVE``
(idle threads sleep at once). The thread counts per role are `role_threads`; the figures
behind both choices come from ``benchmarks/bench_threads.py`` and are quoted in its docstring.

The rule, applied by `apply_thread_policy` at each entry point (``distconf``,
``python -m distconf...``, the tests' conftest), before anything imports torch:

- a variable the user set (`MANAGED` ones: ``OMP_WAIT_POLICY``, ``OMP_NUM_THREADS``,
  ``MKL_NUM_THREADS``) is kept as it is;
- ``DISTCONF_THREADS=off`` keeps torch's own defaults for every variable the user did not set;
  ``DISTCONF_THREADS=N`` uses N compute threads whatever the role;
- otherwise the missing ones get this module's defaults. Which ones it set is recorded in
  ``DISTCONF_THREADS_SET`` so that a child process (a server the demo starts) can tell
  inherited defaults from the user's own variables and choose for its own role.

Measured (``benchmarks/bench_threads.py``, 2 cores, other load 6-12, five runs): beside idle
servers a local tiny model ran 14-50x faster, a 386 MB one 2.6x faster (median; 0.9x to 3.3x); the
swarm's own ms per token moved within the noise of the other load (0.9-1.6x; 1.0x in the run quoted
there). A lone server on a big machine keeps half its cores; ``DISTCONF_THREADS=N`` or
``OMP_NUM_THREADS`` gives it more, and ``GOMP_SPINCOUNT`` (which libgomp lets win over the wait
policy) a short spin instead. The hivemind children (the DHT node,
the Go p2p daemon) run no torch kernels: they inherit the variables, which do not concern them.
Intel/LLVM OpenMP's ``KMP_*`` variables do not apply either: torch 2.13's CPU wheel loads only libgomp.

Importing this module imports nothing heavy (no torch): it must run before torch.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping

__all__ = ["MANAGED", "ROLES", "SWITCH", "MARKER", "role_threads", "machine_cores", "policy_defaults",
           "apply_thread_policy"]

logger = logging.getLogger(__name__)

MANAGED: tuple[str, ...] = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""The variables this module chooses when the user did not set them."""

SWITCH = "DISTCONF_THREADS"
"""``off``: leave torch's defaults; a positive integer: that many compute threads; unset/``auto``: the rule."""

MARKER = "DISTCONF_THREADS_SET"
"""Comma-separated names of the variables `apply_thread_policy` set (not the user's), for child processes."""

ROLES: tuple[str, ...] = ("server", "process")
"""``server``: a ``distconf serve`` process; ``process``: any other (a client, the demo, a benchmark, a test)."""


def role_threads(role: str, cores: int) -> int:
    """Compute threads for ``role`` on a machine with ``cores`` cores.

    A server leaves half the cores to the processes it is likely to share the machine with
    (the client, the other servers of a swarm on one host): on 2 cores, one thread each. Any
    other process uses every core.
    """
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; one of {', '.join(ROLES)}")
    return max(1, cores // 2) if role == "server" else cores


def machine_cores() -> int:
    """Cores this process may run on (its CPU affinity)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def policy_defaults(role: str = "process", switch: str | None = None) -> dict[str, str]:
    """The values the rule gives `MANAGED` variables for ``role`` (``server`` or ``process``) and ``switch``.

    Empty when ``switch`` is ``off``; ``switch`` a positive integer sets the thread count.
    """
    value = (switch or "auto").strip().lower()
    if value in ("off", "0", "false", "no"):
        return {}
    if value.isdigit():
        threads = int(value)
    elif value == "auto":
        threads = role_threads(role, machine_cores())
    else:
        raise ValueError(f"{SWITCH} must be 'auto', 'off' or a positive integer, got {switch!r}")
    return {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def apply_thread_policy(role: str = "process", environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the `MANAGED` variables the user did not set to the defaults for ``role``; return those set.

    ``environ`` defaults to ``os.environ`` (then it must run before torch is imported, which
    reads them once; a warning says so otherwise). Variables an earlier call set (named in
    `MARKER`, e.g. inherited from the parent process) are chosen again for this role.
    """
    env = os.environ if environ is None else environ
    ours = [name for name in env.get(MARKER, "").split(",") if name in MANAGED]
    for name in ours:
        env.pop(name, None)
    chosen = {name: value for name, value in policy_defaults(role, env.get(SWITCH)).items() if name not in env}
    env.update(chosen)
    if chosen:
        env[MARKER] = ",".join(chosen)
    else:
        env.pop(MARKER, None)
    if chosen and environ is None and "torch" in sys.modules:
        logger.warning("thread policy %s set after torch was imported: it applies to child processes only", chosen)
    return chosen
