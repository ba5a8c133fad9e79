"""Clients' reports of servers their spot checks caught computing wrong, kept on the DHT.

A client that verifies (``verify_fraction > 0``) and catches a server publishes a
**report** under the model's `distconf.loader.naming.reports_key` (``"<dht_prefix>.reports"``)
with subkey = the client's own peer id (plus its owner key on a signing node, as server
records) and value ``{"caught": [entry, ...]}``: at most `MAX_CAUGHT` entries, each the
culprit's peer id, the span (``start``, ``end``), the largest ``difference`` seen, the
``kind`` of check, how many times (``count``) and the last time (``when``, unix seconds).
`ReportPublisher` is the verifier listener that keeps one client's report and stores it
again on every new event (without waiting: a DHT store never slows a generation).

A report is a **claim** by a client, not a proof: any peer can write any report (in
Petals-compatible mode even under another peer's subkey). The monitor shows reports as
such. Like server records, reports are parsed strictly (`distconf.dht.report_records`),
refused at the door by every guarded node (`distconf.dht.validators`), bounded
(``MAX_REPORT_BYTES``, the guard's records per key) and expire (`REPORT_LIFETIME`).
"""

from __future__ import annotations

import logging
import math
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from distconf.dht.discovery import _record_peer
from distconf.dht.fetch import DEFAULT_BEAM_SIZE, _fetch
from distconf.dht.records import RecordError
from distconf.dht.report_records import MAX_CAUGHT, CaughtServer, ClientReport
from distconf.loader.naming import reports_key

if TYPE_CHECKING:  # pragma: no cover
    from hivemind import DHT
    from hivemind.dht import DHTNode

__all__ = ["REPORT_LIFETIME", "DetectedEvent", "ReportPublisher", "ReportsRead", "read_reports"]

logger = logging.getLogger(__name__)

REPORT_LIFETIME = 3600.0
"""Seconds a published report lives on the DHT after the client's last detection."""


# --------------------------------------------------------------------------- publishing
class DetectedEvent(Protocol):
    """What `ReportPublisher` reads of an event (`distconf.client.verify_events.VerificationEvent`)."""

    peer_id: str
    start: int
    end: int
    difference: float
    kind: str
    when: float


async def _store_report(_dht: DHT, node: DHTNode, key: str, value: dict[str, Any], expiration_time: float,
                        prefix: str, num_blocks: int) -> bool:
    """Runs in the DHT process: store ``value`` under ``key`` with this node's record subkey."""
    from distconf.dht.announce import _subkey
    from distconf.dht.guard import install_guard

    install_guard(node).validator.register_model(prefix, num_blocks)
    return bool(await node.store(key, value, expiration_time, subkey=_subkey(node)))


@dataclass
class ReportPublisher:
    """A verifier listener: publishes this client's report of caught servers on every new event.

    >>> model.remote.verifier.listeners.append(ReportPublisher(dht, "m-hf", 30))  # doctest: +SKIP

    :param dht: the client's running ``hivemind.DHT``.
    :param dht_prefix: the model's prefix (the report key is `reports_key` of it).
    :param num_blocks: the model's block count (the local node learns the model's keys).
    :param lifetime: seconds the report lives after the latest event.
    """

    dht: Any
    dht_prefix: str
    num_blocks: int
    lifetime: float = REPORT_LIFETIME
    caught: dict[tuple[str, int, int], CaughtServer] = field(default_factory=dict)
    published: int = 0
    failed: int = 0
    _pending: Future | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __call__(self, event: DetectedEvent) -> None:
        """Add ``event`` to the report and store it (returns at once; failures are logged)."""
        try:
            report = self._add(event)
        except (ValueError, TypeError) as e:  # an event this format cannot hold: the ban stands, no report
            logger.warning("not publishing a report of %s: %s", getattr(event, "peer_id", "?"), e)
            return
        from hivemind.utils import get_dht_time

        job = partial(_store_report, key=reports_key(self.dht_prefix), value=report.to_wire(),
                      expiration_time=get_dht_time() + self.lifetime, prefix=self.dht_prefix,
                      num_blocks=self.num_blocks)
        try:
            future = self.dht.run_coroutine(job, return_future=True)
        except Exception as e:  # the DHT is gone (shutting down): nothing to publish to
            logger.warning("publishing the report of server %s failed: %s", event.peer_id, e)
            return
        future.add_done_callback(self._done)
        self._pending = future

    def _add(self, event: DetectedEvent) -> ClientReport:
        with self._lock:
            key = (str(event.peer_id), int(event.start), int(event.end))
            old = self.caught.get(key)
            difference = float(event.difference)
            if math.isnan(difference):
                difference = math.inf
            entry = CaughtServer(peer_id=key[0], start=key[1], end=key[2], kind=str(event.kind),
                                 difference=max(difference, old.difference) if old else difference,
                                 count=old.count + 1 if old else 1, when=float(event.when))
            self.caught.pop(key, None)
            self.caught[key] = entry  # newest last
            while len(self.caught) > MAX_CAUGHT:
                self.caught.pop(next(iter(self.caught)))
            return ClientReport(caught=tuple(self.caught.values()))

    def _done(self, future: Future) -> None:
        try:
            ok = bool(future.result())
        except Exception as e:
            ok = False
            logger.warning("publishing a verification report failed: %r", e)
        else:
            if not ok:
                logger.warning("publishing a verification report: no DHT peer stored it")
        with self._lock:
            if ok:
                self.published += 1
            else:
                self.failed += 1

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait (at most ``timeout`` s) for the latest store; True when it succeeded or nothing was pending."""
        future = self._pending
        if future is None:
            return True
        try:
            return bool(future.result(timeout=timeout))
        except Exception:
            return False


# --------------------------------------------------------------------------- reading
@dataclass(frozen=True)
class ReportsRead:
    """The valid reports of a model (``{reporter peer id: ClientReport}``) and why others were skipped."""

    reports: dict[str, ClientReport]
    skipped: dict[str, str]
    failed: str | None = None


def read_reports(dht: DHT, dht_prefix: str, *, num_blocks: int | None = None, timeout: float | None = 30.0,
                 latest: bool = True) -> ReportsRead:
    """The clients' reports stored under `reports_key` of ``dht_prefix``; a bad record is skipped alone.

    ``num_blocks`` (when known) drops entries naming blocks past the model's end.
    """
    from hivemind.utils import get_dht_time

    key = reports_key(dht_prefix)
    fetched = _fetch(dht, [key], latest=latest, timeout=timeout, beam_size=DEFAULT_BEAM_SIZE)
    skipped = {sub: f"{why} (refused on arrival)" for sub, why in fetched.refused.get(key, ())}
    raw = fetched.items.get(key)
    reports: dict[str, ClientReport] = {}
    if raw is not None and raw[0] != "subkeys":
        skipped["(plain value)"] = "not a dictionary of client reports"
    elif raw is not None:
        now = get_dht_time()
        for subkey, value, expiration in raw[1]:
            if expiration is not None and expiration < now:
                continue
            shown = subkey[:60] if isinstance(subkey, str) else repr(subkey)[:60]
            try:
                reporter = _record_peer(subkey, fetched.signed)
                report = ClientReport.from_wire(value)
                if num_blocks is not None and any(c.end > num_blocks for c in report.caught):
                    raise RecordError(f"names blocks past the model's {num_blocks}")
                reports[reporter] = report
            except (RecordError, ValueError) as e:
                skipped[shown] = str(e)[:300]
    if skipped:
        logger.debug("skipped %d client report(s) of %r: %s", len(skipped), dht_prefix,
                     "; ".join(f"{s[:12]}: {why}" for s, why in list(skipped.items())[:3]))
    return ReportsRead(reports, skipped, fetched.failed.get(key))
