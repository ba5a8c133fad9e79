"""`Arrivals`: which sessions' next steps a server expects soon (to gather them into one batch).

A server in a pipeline sees the steps of a group of sessions arrive one message at a time
(the previous server pushes each session's outputs separately, clients answer at their
own pace). Starting a batch with the first arrival would split the group at every hop:
the rest arrive while it computes and form the next, smaller batch, and the weights are
read once per fragment. So the scheduler waits a little (``BatchLimits.max_batch_wait``)
for the rest of a group: a session that was computed in the same batch as a queued one last
time, steps steadily, and is due within that wait (its last step plus its usual gap between
steps falls before the deadline, and less than twice its gap passed since its last step).
Groups form by themselves when steps queue up behind a busy server; separate groups are not
merged by waiting (two groups half a cycle apart keep both servers of a pipeline busy), and
nobody waits for a session that stalls or has ended (its cache released).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from distconf.server.session_cache import SessionCache

__all__ = ["Arrivals"]

DUE_FACTOR = 2.0
"""A steady session is due while less than this many of its usual gaps passed since its last step."""
FORGET_AFTER = 600.0
"""Seconds after which a silent session is forgotten."""



@dataclass
class _Pace:
    cache: SessionCache
    last: float
    gap: float | None = None
    batch: int = -1  # the last batch this session's step was computed in


class Arrivals:
    """The pace of every session that sends steps (used under the scheduler's lock)."""

    def __init__(self) -> None:
        self._paces: dict[int, _Pace] = {}

    def arrived(self, cache: SessionCache, now: float) -> None:
        """A step of ``cache``'s session arrived at ``now`` (monotonic seconds)."""
        pace = self._paces.get(id(cache))
        if pace is None or pace.cache is not cache:
            self._paces[id(cache)] = _Pace(cache, now)
            return
        gap = now - pace.last
        pace.gap = gap if pace.gap is None else 0.5 * pace.gap + 0.5 * gap
        pace.last = now

    def computed(self, caches: Iterable[SessionCache], batch: int) -> None:
        """The steps of ``caches`` were computed together, in batch number ``batch``."""
        for cache in caches:
            pace = self._paces.get(id(cache))
            if pace is not None and pace.cache is cache:
                pace.batch = batch

    def due(self, now: float, deadline: float, queued: Iterable[SessionCache], chain: tuple[str, ...]) -> bool:
        """Whether a steady session over ``chain`` that is not in ``queued`` but was in the last batch of
        one that is, is due to send its step by ``deadline`` (its last step plus its usual gap), and is
        not late (see `DUE_FACTOR`)."""
        waiting = {id(c) for c in queued}
        mates = {p.batch for k, p in self._paces.items() if k in waiting and p.batch >= 0}
        due = False
        for key, pace in list(self._paces.items()):
            if not pace.cache.allocated or now - pace.last > FORGET_AFTER:  # ended (cache released) or long silent
                del self._paces[key]
                continue
            if key in waiting or pace.gap is None or pace.batch not in mates:
                continue
            if tuple(b.uid for b in pace.cache.blocks) != chain:
                continue
            if pace.last + pace.gap <= deadline and now - pace.last < DUE_FACTOR * pace.gap:
                due = True
        return due
