"""bench_batching's figures: one `Cell` per (mode, sessions) and the side-by-side table with the targets."""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Cell", "TARGETS", "print_table"]

TARGETS = ((8, "tok/s", 4.0, ">="), (8, "p50", 2.5, "<="))
"""(sessions, figure, ratio to 1 session, comparison): the issue's targets for batching on."""


def _percentile(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


@dataclass
class Cell:
    """The figures of one mode at one number of concurrent sessions, over all rounds."""

    sessions: int
    rates: list[float] = field(default_factory=list)
    """Aggregate tokens/s of each round."""
    gaps: list[float] = field(default_factory=list)
    """Seconds between consecutive tokens of one session, every session of every round."""
    steps: int = 0
    """Inference steps the servers received during the cell (summed over the servers)."""
    batches: int = 0
    """Batches the servers computed during the cell (summed over the servers)."""
    tokens: int = 0
    """Tokens generated, every session of every round."""
    cpu: dict[str, float] = field(default_factory=dict)
    """CPU seconds used during the cell: ``servers``, ``clients`` (with their DHT and P2P children), ``machine``."""

    def add(self, results: list[dict[str, Any]], before: list[dict[str, int]], after: list[dict[str, int]],
            cpu: dict[str, float]) -> None:
        """Add one round: the client processes' results, the servers' stats before and after it, the CPU used."""
        tokens = sum(len(r["tokens"]) for r in results)
        self.tokens += tokens
        for key, seconds in cpu.items():
            self.cpu[key] = self.cpu.get(key, 0.0) + seconds
        window = max(r["end"] for r in results) - min(r["start"] for r in results)
        self.rates.append(tokens / window)
        for r in results:
            self.gaps += [b - a for a, b in itertools.pairwise(r["stamps"])]
        for b, a in zip(before, after):
            self.steps += sum(a.get(k, 0) - b.get(k, 0) for k in ("steps", "pushed_steps"))
            self.batches += a.get("batches", 0) - b.get("batches", 0)

    @property
    def tokens_per_s(self) -> float:
        """Median aggregate tokens/s over the rounds."""
        return statistics.median(self.rates) if self.rates else float("nan")

    @property
    def p50_ms(self) -> float:
        """Median per-token latency, ms."""
        return 1000 * _percentile(self.gaps, 50)

    @property
    def p95_ms(self) -> float:
        """95th percentile per-token latency, ms."""
        return 1000 * _percentile(self.gaps, 95)

    @property
    def rows_per_batch(self) -> float:
        """Mean rows (session steps) per computed batch on the servers."""
        return self.steps / self.batches if self.batches else float("nan")

    def cpu_ms_per_token(self, key: str) -> float:
        """CPU ms of ``key`` (``servers``, ``clients``, ``machine``) per generated token."""
        return 1000 * self.cpu.get(key, float("nan")) / self.tokens if self.tokens else float("nan")

    def summary(self) -> dict[str, Any]:
        """The cell's figures for ``--json``."""
        return {"sessions": self.sessions, "tokens_per_s": self.tokens_per_s, "rounds_tokens_per_s": self.rates,
                "p50_ms": self.p50_ms, "p95_ms": self.p95_ms, "rows_per_batch": self.rows_per_batch,
                "steps": self.steps, "batches": self.batches, "gaps": len(self.gaps),
                "cpu_ms_per_token": {k: self.cpu_ms_per_token(k) for k in self.cpu}}


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _others(cell: Cell) -> float:
    return cell.cpu_ms_per_token("machine") - cell.cpu_ms_per_token("servers") - cell.cpu_ms_per_token("clients")


def _cores(cell: Cell) -> float:
    wall = cell.cpu.get("wall", 0.0)
    return cell.cpu.get("machine", float("nan")) / wall if wall else float("nan")


def print_table(title: str, cells: dict[str, dict[int, Cell]], floors: dict[int, float],
                final: dict[str, list[dict[str, int]]], *, targets: bool = True) -> dict[str, Any]:
    """Print batching on vs off side by side (ratios to off and to 1 session) and the targets; return the figures."""
    on, off = cells["on"], cells["off"]
    first = min(on)
    print(f"\n== {title}")
    print(f"{'':9}| {'aggregate tokens/s':^37} | {'p50 ms/token':^31} | {'p95 ms/token':^15} | "
          f"{'rows/batch':^11} | local fwd")
    print(f"{'sessions':>9}| {'on':>7} {'off':>7} {'on/off':>6} {'on/1':>6} {'off/1':>6} | {'on':>7} {'off':>7} "
          f"{'on/off':>6} {'on/1':>6} {'off/1':>6} | {'on':>7} {'off':>7} | {'on':>5} {'off':>5} | ms, 1 thr")
    for n in on:
        a, b = on[n], off[n]
        print(f"{n:>9}| {a.tokens_per_s:7.1f} {b.tokens_per_s:7.1f} {_ratio(a.tokens_per_s, b.tokens_per_s):5.2f}x "
              f"{_ratio(a.tokens_per_s, on[first].tokens_per_s):5.2f}x "
              f"{_ratio(b.tokens_per_s, off[first].tokens_per_s):5.2f}x | {a.p50_ms:7.1f} {b.p50_ms:7.1f} "
              f"{_ratio(a.p50_ms, b.p50_ms):5.2f}x {_ratio(a.p50_ms, on[first].p50_ms):5.2f}x "
              f"{_ratio(b.p50_ms, off[first].p50_ms):5.2f}x | {a.p95_ms:7.1f} {b.p95_ms:7.1f} | "
              f"{a.rows_per_batch:5.2f} {b.rows_per_batch:5.2f} | {floors.get(n, float('nan')):7.1f}")
    print("CPU ms per generated token (others: the machine's busy CPU minus this benchmark's processes), "
          "and the machine's busy cores during the cell (2 cores here)")
    print(f"{'sessions':>9}| {'servers on':>10} {'off':>6} | {'clients on':>10} {'off':>6} | {'others on':>9} "
          f"{'off':>6} | {'busy cores on':>13} {'off':>5}")
    for n in on:
        a, b = on[n], off[n]
        print(f"{n:>9}| {a.cpu_ms_per_token('servers'):10.1f} {b.cpu_ms_per_token('servers'):6.1f} | "
              f"{a.cpu_ms_per_token('clients'):10.1f} {b.cpu_ms_per_token('clients'):6.1f} | "
              f"{_others(a):9.1f} {_others(b):6.1f} | {_cores(a):13.2f} {_cores(b):5.2f}")
    results: dict[str, Any] = {"title": title, "cells": {m: [c.summary() for c in cells[m].values()] for m in cells},
                               "local_forward_ms": floors, "final_server_stats": final, "targets": []}
    for mode, stats in final.items():
        print(f"server stats at the end, batching {mode}: " + "; ".join(
            f"server {i}: {s.get('batches', 0)} batches, {s.get('batched_rows', 0)} batched rows, "
            f"max {s.get('max_batch_rows', 0)} rows" for i, s in enumerate(stats)))
    if not targets:
        return results
    for n, figure, bound, op in TARGETS:
        if n not in on or first != 1:
            continue
        get = (lambda c: c.tokens_per_s) if figure == "tok/s" else (lambda c: c.p50_ms)
        ratio, ref = _ratio(get(on[n]), get(on[1])), _ratio(get(off[n]), get(off[1]))
        met = ratio >= bound if op == ">=" else ratio <= bound
        what = "aggregate tokens/s" if figure == "tok/s" else "p50 per-token latency"
        print(f"target: {what} at {n} sessions {op} {bound}x 1 session's, batching on: {ratio:.2f}x -> "
              f"{'met' if met else 'MISSED'}   (batching off: {ref:.2f}x)")
        results["targets"].append({"sessions": n, "figure": figure, "bound": bound, "op": op, "ratio": ratio,
                                   "met": met, "off_ratio": ref})
    return results
