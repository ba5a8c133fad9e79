"""Keep the last good snapshot of a swarm, read again every refresh period in a background thread.

The web server never reads the DHT itself: requests take `Monitor.snapshot` (an immutable
object, swapped whole when a read finishes) and report its age, so a slow or hanging DHT
read delays only the next snapshot, never a page. A failed read keeps the previous data
and says why (per model, and for the listing).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from distconf.monitor.snapshot import ListingRead, ModelWanted, describe_error, read_listing, read_model, with_error
from distconf.monitor.state_schema import ModelStateV1

if TYPE_CHECKING:  # pragma: no cover
    from hivemind import DHT

__all__ = ["DEFAULT_MAX_MODELS", "MODEL_READERS", "Monitor", "Snapshot", "dht_reader"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODELS = 64
"""Most models read per refresh (those named on the command line first, then listed ones by prefix)."""
MODEL_READERS = 4
"""Models read at once (each read is one batched DHT request, bounded by the read timeout)."""


@dataclass(frozen=True)
class Snapshot:
    """One complete read of the swarm (``read_at`` None: nothing read yet)."""

    models: dict[str, ModelStateV1] = field(default_factory=dict)
    read_at: float | None = None
    read_seconds: float = 0.0
    error: str | None = None
    models_not_read: int = 0
    skipped_listings: int = 0


Reader = Callable[[Snapshot], Snapshot]
"""Reads the swarm once, given the previous snapshot (whose data it keeps for what fails)."""


def dht_reader(dht: DHT, extra_models: Mapping[str, int] | None = None, *, max_models: int = DEFAULT_MAX_MODELS,
               timeout: float = 30.0, repositories: Mapping[str, str] | None = None) -> Reader:
    """A `Reader` over ``dht``: the listing, then each model (``extra_models``: {prefix: num_blocks};
    ``repositories``: {prefix: shipped preset} for extra models the listing does not name, for their figures)."""
    extra = dict(extra_models or {})
    named = dict(repositories or {})

    def read(previous: Snapshot) -> Snapshot:
        began = time.time()
        error = None
        try:
            listing = read_listing(dht, extra, max_models=max_models, timeout=timeout, repositories=named)
        except Exception as exc:  # a failed listing read keeps the models read before
            error = f"reading the model listing failed: {describe_error(exc)}"
            logger.warning("%s", error)
            known = [ModelWanted(m.dht_prefix, m.num_blocks, m.repository, m.listed)
                     for m in previous.models.values()]
            known += [ModelWanted(p, n, named.get(p), False) for p, n in extra.items() if p not in previous.models]
            listing = ListingRead(known, previous.models_not_read, previous.skipped_listings)

        def one(wanted: ModelWanted) -> ModelStateV1:
            try:
                return read_model(dht, wanted, timeout=timeout)
            except Exception as exc:  # one model's failure never hides the others
                logger.warning("reading %r failed: %s", wanted.dht_prefix, describe_error(exc))
                return with_error(previous.models.get(wanted.dht_prefix), wanted, describe_error(exc))

        with ThreadPoolExecutor(max_workers=max(1, min(MODEL_READERS, len(listing.models)))) as pool:
            models = {m.dht_prefix: m for m in pool.map(one, listing.models)}
        return Snapshot(dict(sorted(models.items())), began, time.time() - began, error, listing.not_read,
                        listing.skipped)

    return read


class Monitor:
    """Runs a `Reader` every ``refresh`` seconds in a daemon thread; `snapshot` is the last result.

    >>> monitor = Monitor(dht_reader(dht), refresh=10.0)   # doctest: +SKIP
    >>> monitor.start(); monitor.snapshot; monitor.stop()  # doctest: +SKIP
    """

    def __init__(self, reader: Reader, *, refresh: float = 10.0) -> None:
        if not refresh > 0:
            raise ValueError(f"refresh must be > 0 seconds, got {refresh!r}")
        self.reader = reader
        self.refresh = float(refresh)
        self.snapshot = Snapshot()
        self.refreshing = False
        self.rounds = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start reading in the background (the first read begins at once)."""
        if self._thread is not None:
            raise RuntimeError("monitor already started")
        self._thread = threading.Thread(target=self._run, name="distconf-monitor", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the thread to stop and wait up to ``timeout`` seconds (a read in flight ends on its own timeout)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def read_once(self) -> Snapshot:
        """Read the swarm now (in the calling thread) and keep the result as the snapshot."""
        self.refreshing = True
        try:
            snapshot = self.reader(self.snapshot)
        except Exception as exc:  # a reader bug must not kill the refresher: keep the last good data
            self.failures += 1
            logger.exception("reading the swarm failed")
            snapshot = replace(self.snapshot, error=f"reading the swarm failed: {describe_error(exc)}")
        finally:
            self.refreshing = False
        self.snapshot = snapshot
        self.rounds += 1
        return snapshot

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            self.read_once()
            self._stop.wait(max(0.0, self.refresh - (time.monotonic() - began)))
