"""Plain-text views of a swarm: coverage per peer and block, and the chosen route."""

from __future__ import annotations

from distconf.dht.discovery import SwarmState
from distconf.dht.records import ServerState
from distconf.dht.routing import NoRouteError, make_route

__all__ = ["STATE_MARKS", "format_coverage", "format_route"]

STATE_MARKS = {ServerState.ONLINE: "O", ServerState.JOINING: "J", ServerState.OFFLINE: "x"}
"""One character per (peer, block) cell: O online, J joining, x offline, . not served."""


def _short(peer: str, width: int = 14) -> str:
    return peer if len(peer) <= width else ".." + peer[-(width - 2):]


def format_coverage(state: SwarmState, *, max_columns: int = 100) -> str:
    """A table with one row per peer span and one character per block, plus totals.

    Columns: peer, span, state, throughput, cache tokens left, name, then the block map
    (``O`` online, ``J`` joining, ``x`` offline, ``.`` not served). The last rows give
    servers per block (``+`` for 10 or more) and blocks nobody serves.
    """
    n = state.num_blocks
    shown = min(n, max_columns)
    rows = []
    for span in state.spans:
        cells = ["."] * shown
        for b in range(span.start, min(span.end, shown)):
            cells[b] = STATE_MARKS[span.state]
        info = span.info
        rows.append([
            _short(span.peer_id), f"{span.start}..{span.end - 1}", span.state.name.lower(),
            f"{info.throughput:.2f}", "-" if info.cache_tokens_left is None else f"{info.cache_tokens_left:,}",
            (info.public_name or "-")[:16], "".join(cells),
        ])
    counts = []
    for block in state.servers[:shown]:
        k = sum(1 for s in block.values() if s.state != ServerState.OFFLINE)
        counts.append(str(k) if k < 10 else "+")
    headers = ["peer", "blocks", "state", "rps", "cache left", "name",
               f"blocks 0..{shown - 1}" + ("" if shown == n else f" (of {n})")]
    cells = [headers, *rows, ["servers per block", "", "", "", "", "", "".join(counts)]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.insert(len(lines) - 1, "  ".join("-" * w for w in widths))
    uncovered = state.uncovered_blocks()
    throughputs = state.throughputs()
    summary = (f"{state.dht_prefix}: {n} blocks, {len(state.peers)} peer(s), "
               f"min block throughput {min(throughputs) if throughputs else 0:.2f} rps")
    if uncovered:
        summary += f", {len(uncovered)} block(s) not served (first: {uncovered[0]})"
    if state.skipped:
        summary += f", {len(state.skipped)} unparsable record(s) skipped"
    return summary + "\n" + "\n".join(lines)


def format_route(state: SwarmState, min_state: ServerState = ServerState.JOINING) -> tuple[bool, str]:
    """``(route exists, text)``: the chosen chain of spans, or why there is none."""
    try:
        route = make_route(state, min_state=min_state)
    except NoRouteError as e:
        return False, f"no full route: {e}"
    hops = " -> ".join(f"{_short(h.peer_id)}[{h.start}..{h.end - 1}]" for h in route)
    bottleneck = min(h.throughput for h in route)
    return True, f"full route in {len(route)} hop(s), bottleneck {bottleneck:.2f} rps: {hops}"
