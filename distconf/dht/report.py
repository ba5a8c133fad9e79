"""Plain-text views of a swarm: coverage per peer and block, and the chosen route.

Every view is bounded whatever the swarm holds: at most `MAX_ROWS` span rows, `max_columns`
block columns and `MAX_HOPS_SHOWN` hops are printed, each with a count of what was left out.
"""

from __future__ import annotations

from distconf.dht.discovery import SwarmState
from distconf.dht.records import ServerState
from distconf.dht.routing import NoRouteError, make_route

__all__ = ["MAX_HOPS_SHOWN", "MAX_ROWS", "STATE_MARKS", "format_coverage", "format_route"]

MAX_ROWS = 40
"""Most span rows `format_coverage` prints."""
MAX_HOPS_SHOWN = 16
"""Most hops `format_route` lists."""

STATE_MARKS = {ServerState.ONLINE: "O", ServerState.JOINING: "J", ServerState.OFFLINE: "x"}
"""One character per (peer, block) cell: O online, J joining, x offline, . not served."""


def _printable(text: str, width: int) -> str:
    """``text`` cut to ``width``, with control characters (terminal escapes a peer could send) replaced."""
    return "".join(c if c.isprintable() else "?" for c in text[:width])


def _short(peer: str, width: int = 14) -> str:
    return peer if len(peer) <= width else ".." + peer[-(width - 2):]


def format_coverage(state: SwarmState, *, max_columns: int = 100, max_rows: int = MAX_ROWS) -> str:
    """A table with one row per peer span and one character per block, plus totals.

    Columns: peer, span, state, throughput, cache tokens left, name, then the block map
    (``O`` online, ``J`` joining, ``x`` offline, ``.`` not served). The last rows give
    servers per block (``+`` for 10 or more) and blocks nobody serves. At most
    ``max_rows`` spans (the first by start block) and ``max_columns`` blocks are shown.
    """
    n = state.num_blocks
    shown = min(n, max_columns)
    rows = []
    for span in state.spans[:max_rows]:
        cells = ["."] * shown
        for b in range(span.start, min(span.end, shown)):
            cells[b] = STATE_MARKS[span.state]
        info = span.info
        rows.append([
            _short(span.peer_id), f"{span.start}..{span.end - 1}", span.state.name.lower(),
            f"{info.throughput:.2f}", "-" if info.cache_tokens_left is None else f"{info.cache_tokens_left:,}",
            _printable(info.public_name or "-", 16), "".join(cells),
        ])
    counts = []
    for block in state.servers[:shown]:
        k = sum(1 for s in block.values() if s.state != ServerState.OFFLINE)
        counts.append(str(k) if k < 10 else "+")
    headers = ["peer", "blocks", "state", "rps", "cache left", "name",
               f"blocks 0..{shown - 1}" + ("" if shown == n else f" (of {n})")]
    if len(state.spans) > max_rows:
        rows.append([f"... {len(state.spans) - max_rows} more span(s)", "", "", "", "", "", ""])
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
    if state.failed:
        summary += f", search failed for {len(state.failed)} block(s)"
    return summary + "\n" + "\n".join(lines)


def format_route(state: SwarmState, min_state: ServerState = ServerState.ONLINE) -> tuple[bool, str]:
    """``(route exists, text)``: the chosen chain of spans (ONLINE servers by default), or why there is none."""
    try:
        route = make_route(state, min_state=min_state)
    except NoRouteError as e:
        return False, f"no full route: {e}"
    hops = " -> ".join(f"{_short(h.peer_id)}[{h.start}..{h.end - 1}]" for h in route[:MAX_HOPS_SHOWN])
    if len(route) > MAX_HOPS_SHOWN:
        hops += f" -> ... ({len(route) - MAX_HOPS_SHOWN} more)"
    bottleneck = min(h.throughput for h in route)
    return True, f"full route in {len(route)} hop(s), bottleneck {bottleneck:.2f} rps: {hops}"
