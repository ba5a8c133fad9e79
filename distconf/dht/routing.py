"""Route selection: a chain of server spans that covers every block of a model.

`make_route` picks, among all chains of (possibly clipped) spans covering blocks
``0..N-1``, the one that is best by, in order:

1. fewest blocks served by JOINING servers (only when ``min_state=JOINING`` is asked
   for: by default only ONLINE servers are used; OFFLINE never);
2. highest bottleneck throughput (the slowest server on the chain limits the chain);
3. fewest hops (each hop costs a network round trip);
4. least estimated compute time, sum of ``blocks / throughput`` over the hops (faster
   servers take more of the chain).

It is exact for that order. With all usable spans, one sweep over the span boundaries
finds the fewest joining blocks; a binary search over the distinct throughputs finds the
highest bottleneck that still reaches it; the sweep restricted to spans at least that
fast then minimises hops and estimated time. Switching servers only ever needs to
happen at a span boundary, and all remaining costs are additive, so each sweep is an
exact dynamic program in O(boundaries x spans).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from distconf.dht.discovery import RemoteSpan, SwarmState
from distconf.dht.peerids import is_peer_id
from distconf.dht.records import ServerState

__all__ = ["NoRouteError", "make_route", "route_summary"]


class NoRouteError(ValueError):
    """No chain of usable servers covers the model; ``block`` is the first uncovered block."""

    def __init__(self, message: str, block: int, dht_prefix: str | None = None) -> None:
        super().__init__(message)
        self.block = block
        self.dht_prefix = dht_prefix


def make_route(
    spans: SwarmState | Iterable[RemoteSpan],
    num_blocks: int | None = None,
    *,
    min_state: ServerState = ServerState.ONLINE,
    blocked_peers: Iterable[str] = (),
    allowed_peers: Iterable[str] | None = None,
    start: int = 0,
    end: int | None = None,
    avoid_if_possible: Sequence[Iterable[str]] = (),
) -> list[RemoteSpan]:
    """Choose a chain of spans covering blocks ``start..end-1`` (default: the whole model).

    :param spans: a `SwarmState` (from `find_block_servers`) or its spans. Spans whose
        ``peer_id`` is not a well-formed libp2p peer id are ignored.
    :param num_blocks: block count (taken from the `SwarmState` when given one).
    :param min_state: weakest state a server may have to be used: ONLINE by default, as
        Petals 2.x clients route (a JOINING server is still loading its blocks); pass
        ``ServerState.JOINING`` to use joining servers too. OFFLINE is never used.
    :param blocked_peers: peers never to use. :param allowed_peers: if given, use only these.
    :param avoid_if_possible: groups of peers to leave out while the others still cover
        the blocks, most important first: the route avoids every group if it can, else
        every group but the last, and so on (the client passes the peers that did not
        answer a ping, see `distconf.dht.liveness`, then those short of cache).
    :returns: the chain: spans clipped to the blocks each one serves on the route,
        consecutive and covering ``start..end-1`` exactly.
    :raises NoRouteError: naming the first block no usable server covers (without the
        ``avoid_if_possible`` peers left out).
    """
    prefix = None
    if isinstance(spans, SwarmState):
        prefix = spans.dht_prefix
        num_blocks = spans.num_blocks if num_blocks is None else num_blocks
        spans = spans.spans
    if num_blocks is None:
        raise TypeError("num_blocks is required when passing spans rather than a SwarmState")
    end = num_blocks if end is None else end
    if not 0 <= start < end <= num_blocks:
        raise ValueError(f"cannot route blocks {start}..{end - 1} of a {num_blocks}-block model")
    min_state = max(ServerState(min_state), ServerState.JOINING)
    blocked = set(blocked_peers)
    allowed = None if allowed_peers is None else set(allowed_peers)
    candidates = [
        s for s in spans
        if s.peer_id not in blocked and (allowed is None or s.peer_id in allowed)
        and s.end > start and s.start < end and is_peer_id(s.peer_id)
    ]
    groups = [set(g) for g in avoid_if_possible]
    for kept in range(len(groups), 0, -1):
        avoided = set().union(*groups[:kept])
        try:
            return _best_route([s for s in candidates if s.peer_id not in avoided], start, end, num_blocks,
                               min_state, prefix)
        except NoRouteError:
            continue
    return _best_route(candidates, start, end, num_blocks, min_state, prefix)


def _best_route(candidates: list[RemoteSpan], start: int, end: int, num_blocks: int, min_state: ServerState,
                prefix: str | None) -> list[RemoteSpan]:
    usable = [RemoteSpan(s.peer_id, max(s.start, start), min(s.end, end), s.info)
              for s in candidates if s.state >= min_state]
    covered = [False] * (end - start)
    for s in usable:
        for b in range(s.start, s.end):
            covered[b - start] = True
    if not all(covered):
        first = start + covered.index(False)
        raise NoRouteError(_gap_message(candidates, first, start, num_blocks, min_state, prefix), first, prefix)

    # The fewest joining blocks is reached with every usable span; the best bottleneck is the
    # highest throughput threshold that still reaches it (monotone: binary search).
    thresholds = sorted({s.throughput for s in usable})
    lowest = _cheapest_chain(usable, start, end)
    assert lowest is not None  # every block is covered, so all usable spans always route
    fewest_joining = lowest[0][0]
    lo, hi, best = 0, len(thresholds) - 1, lowest
    while lo < hi:
        mid = (lo + hi + 1) // 2
        found = _cheapest_chain([s for s in usable if s.throughput >= thresholds[mid]], start, end)
        if found is not None and found[0][0] <= fewest_joining:
            lo, best = mid, found
        else:
            hi = mid - 1
    return best[1]


def _gap_message(candidates: list[RemoteSpan], first: int, start: int, num_blocks: int, min_state: ServerState,
                 prefix: str | None) -> str:
    reached = f"blocks {start}..{first - 1} are served" if first > start else "no block before it is served"
    who = f" of {prefix!r}" if prefix else ""
    joining = min_state == ServerState.ONLINE and any(
        s.state == ServerState.JOINING and s.start <= first < s.end for s in candidates)
    if joining:
        what = f"no online server covers block {first}{who} (only joining servers, still loading, do)"
    else:
        what = f"no online or joining server covers block {first}{who}"
    return f"{what} ({reached}; model has {num_blocks} blocks)"


_Cost = tuple[int, int, float]  # (blocks on joining servers, hops, sum of blocks / throughput)


def _cheapest_chain(spans: Sequence[RemoteSpan], start: int, end: int) -> tuple[_Cost, list[RemoteSpan]] | None:
    """Min-cost chain from ``start`` to ``end``, or None: one sweep over span boundaries.

    State: "standing" at a boundary (between hops) or "riding" span s. Boarding costs a
    hop; riding costs per block (joining blocks, blocks / throughput); alighting is free.
    All costs are additive and non-negative, so one left-to-right sweep is exact.
    O(boundaries x spans).
    """
    ordered = sorted(spans, key=lambda s: (-s.throughput, s.peer_id, s.start))  # deterministic ties
    joining = [s.state != ServerState.ONLINE for s in ordered]
    per_block = [1.0 / max(s.throughput, 1e-9) for s in ordered]
    points = sorted({start, end} | {s.start for s in ordered} | {s.end for s in ordered})
    # riding[i] = (cost, boarding point, path before boarding); a path is a linked tuple
    # (previous path, span index, first block, end) or None at the start.
    riding: list[tuple[_Cost, int, Any] | None] = [None] * len(ordered)
    previous = start
    for p in points:
        step = p - previous
        if step:
            for i, ride in enumerate(riding):
                if ride is not None:
                    c = ride[0]
                    riding[i] = ((c[0] + (step if joining[i] else 0), c[1], c[2] + step * per_block[i]),
                                 ride[1], ride[2])
        previous = p
        standing: tuple[_Cost, Any] | None = ((0, 0, 0.0), None) if p == start else None
        for i, ride in enumerate(riding):
            if ride is not None and (standing is None or ride[0] < standing[0]):
                standing = (ride[0], (ride[2], i, ride[1], p))
            if ride is not None and ordered[i].end <= p:
                riding[i] = None
        if p == end:
            break
        if standing is None:
            continue
        boarded: _Cost = (standing[0][0], standing[0][1] + 1, standing[0][2])
        for i, s in enumerate(ordered):
            if s.start <= p < s.end and (riding[i] is None or boarded < riding[i][0]):
                riding[i] = (boarded, p, standing[1])
    if standing is None or p != end:
        return None
    chain: list[RemoteSpan] = []
    path = standing[1]
    while path is not None:
        path, i, first, stop = path
        chain.append(RemoteSpan(ordered[i].peer_id, first, stop, ordered[i].info))
    chain.reverse()
    return standing[0], chain


def route_summary(route: Sequence[RemoteSpan]) -> str:
    """One line per hop: ``blocks a..b  peer  STATE  throughput``."""
    lines = []
    for s in route:
        lines.append(f"blocks {s.start:>3}..{s.end - 1:<3} {s.peer_id[-12:]:>12}  {s.state.name:<7} "
                     f"{s.throughput:10.2f} rps")
    return "\n".join(lines)
