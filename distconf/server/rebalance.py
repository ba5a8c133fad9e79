"""Whether a running server should move to other blocks (Petals 2.x's ``--balance_quality`` rule).

Pure: the swarm's records in, a `Rebalance` decision out (no DHT, no I/O). The rule is
Petals 2.x's ``should_choose_other_blocks``, written anew:

- A server's throughput counts on every block it announces as JOINING or ONLINE (OFFLINE
  records do not count), as in Petals: a server that is moving announces its new span
  JOINING with its real throughput, so the others do not all rush into the same hole.
- The swarm's throughput is the minimum over blocks of the summed throughputs.
- This server takes its span out (with a small extra ``eps`` so that, all else equal, it
  prefers where it is) and finds its best place with the placement rule of
  `distconf.planning.choose_blocks` (the window whose sorted throughputs are smallest).
  Leaving must not disconnect a swarm that is whole; if the best place is where it is,
  it stays.
- Otherwise it simulates the move, then lets every server (in random order) re-place
  itself the same way until none moves, and compares: with ``quality = old / new``
  swarm throughput, it moves when ``quality < balance_quality - eps``. So with the
  default 0.75 a server moves when the swarm would become more than 1/0.75 = 1.33x
  faster; a hole (old throughput 0) is always filled when the rest stays whole.
- ``balance_quality > 1`` forces a move whenever a better place exists (Petals uses it
  for debugging; Petals would reload even when the best place is the current one, we do
  not); ``balance_quality <= 0`` disables rebalancing.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

from distconf.dht.records import ServerInfo, ServerState
from distconf.planning import choose_blocks

__all__ = ["EPS", "MAX_SIMULATION_ROUNDS", "Rebalance", "SwarmSpan", "decide_rebalance", "swarm_spans"]

EPS = 1e-3
"""Relative margin (Petals' ``eps``): against float noise, and to prefer the current place in a tie."""
MAX_SIMULATION_ROUNDS = 100
"""Most rounds of the every-server re-placement simulation (Petals loops until stable; we bound it)."""


@dataclass
class SwarmSpan:
    """One server's blocks ``start..end-1`` and throughput, as the simulation moves it."""

    start: int
    end: int
    throughput: float

    @property
    def length(self) -> int:
        """Blocks held."""
        return self.end - self.start


@dataclass(frozen=True)
class Rebalance:
    """The decision: ``move`` to ``start`` (same length) or stay, and why.

    ``quality`` is old / new swarm throughput when the move was simulated, else None.
    """

    move: bool
    reason: str
    start: int | None = None
    old_throughput: float = 0.0
    new_throughput: float | None = None
    quality: float | None = None


def swarm_spans(servers: Sequence[Mapping[str, ServerInfo]]) -> tuple[dict[str, SwarmSpan], list[float]]:
    """Per peer its span (first to last non-OFFLINE block) and per block the summed throughput.

    ``servers[i]`` maps peer id to its record for block ``i`` (`SwarmState.servers`). Peers
    are summed in sorted order, so every server computes the same floats from the same records.
    """
    spans: dict[str, SwarmSpan] = {}
    totals = [0.0] * len(servers)
    for block, records in enumerate(servers):
        for peer, info in sorted(records.items()):
            if info.state == ServerState.OFFLINE:
                continue
            if peer in spans:
                spans[peer].end = block + 1
            else:
                spans[peer] = SwarmSpan(block, block + 1, float(info.throughput))
            totals[block] += info.throughput
    return spans, totals


def _best_start(totals: list[float], length: int) -> int:
    """Where a span of ``length`` blocks helps most (the one placement rule: `choose_blocks`)."""
    return choose_blocks(SimpleNamespace(num_hidden_layers=len(totals)), length, totals)[0]


def _add(totals: list[float], span: SwarmSpan, amount: float) -> None:
    for block in range(span.start, span.end):
        totals[block] += amount


def _settle(spans: dict[str, SwarmSpan], totals: list[float], rng: random.Random) -> None:
    """Let every server re-place itself (random order) until none moves (bounded)."""
    for _ in range(MAX_SIMULATION_ROUNDS):
        moved = False
        peers = sorted(spans)
        rng.shuffle(peers)
        for peer in peers:
            span = spans[peer]
            _add(totals, span, -span.throughput * (1 + EPS))
            start = _best_start(totals, span.length)
            _add(totals, span, span.throughput * EPS)
            if start != span.start:
                span.start, span.end = start, start + span.length
                moved = True
            _add(totals, span, span.throughput)
        if not moved:
            return


def decide_rebalance(local_peer: str, servers: Sequence[Mapping[str, ServerInfo]], balance_quality: float,
                     rng: random.Random | None = None) -> Rebalance:
    """Should ``local_peer`` move, and where to (see the module docstring for the rule).

    :param local_peer: this server's peer id (base58), as in the records.
    :param servers: per block, ``{peer: ServerInfo}`` (`SwarmState.servers`).
    :param balance_quality: Petals' ``--balance_quality`` (default 0.75; <= 0 disables).
    :param rng: shuffles the simulation's order (default: a fresh `random.Random`).
    """
    if balance_quality <= 0:
        return Rebalance(False, "rebalancing is disabled (balance quality 0)")
    spans, totals = swarm_spans(servers)
    old = min(totals) if totals else 0.0
    local = spans.get(local_peer)
    if local is None:
        return Rebalance(False, "this server's span is not in the swarm's records", old_throughput=old)
    _add(totals, local, -local.throughput * (1 + EPS))
    if old > EPS and min(totals) <= 0 and balance_quality <= 1:
        return Rebalance(False, "leaving would cut the swarm's chain", old_throughput=old)
    start = _best_start(totals, local.length)
    if start == local.start:
        return Rebalance(False, "this server is at its best place already", old_throughput=old)
    if balance_quality > 1:
        return Rebalance(True, "forced (balance quality > 1)", start=start, old_throughput=old)
    _add(totals, local, local.throughput * EPS)
    local.start, local.end = start, start + local.length
    _add(totals, local, local.throughput)
    _settle(spans, totals, rng or random.Random())
    new = min(totals)
    if new < old or new < EPS:
        return Rebalance(False, "moving would not raise the swarm's throughput", old_throughput=old,
                         new_throughput=new)
    quality = old / new
    if quality < balance_quality - EPS:
        return Rebalance(True, f"swarm throughput {old:.2f} -> {new:.2f} (quality {quality:.2f} < "
                         f"{balance_quality:g})", start=start, old_throughput=old, new_throughput=new, quality=quality)
    return Rebalance(False, f"the gain is too small (quality {quality:.2f} >= {balance_quality:g})",
                     old_throughput=old, new_throughput=new, quality=quality)
