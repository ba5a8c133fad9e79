"""A first open of a GGUF file: the conversion's CPU with one parse of the file, and with transformers' three.

transformers reads a ``.gguf`` three times to convert it (config, weights, tokenizer); distconf's
`distconf.sources.gguf_compat.shared_gguf_reads` lets the three share one parsed ``gguf.GGUFReader``
and one tensor name map. Each conversion runs in a process of its own into an empty cache (imports done
before the clock starts), the two ways interleaved, for each real model the project installs
(SmolLM2-135M-Instruct Q4_1, Gemma 3 270M Q4_K_M). Printed: CPU seconds (user + system of the process)
and wall seconds of each way, and the ratio shared / plain (the median of the rounds).

Usage: .venv/bin/python benchmarks/bench_gguf_convert.py [--rounds N] [--models smollm2,gemma]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = ("smollm2", "gemma")


def child(way: str, model: str) -> None:
    """In a process of its own: convert ``model``'s GGUF ``way`` ("shared" or "plain"); print the figures as JSON."""
    import logging
    import os

    logging.disable(logging.WARNING)
    sys.path.insert(0, str(REPO))
    import transformers.modeling_utils  # noqa: F401  (imports are not the conversion's cost)

    from distconf.sources import gguf_compat
    from distconf.sources.resolve import open_source
    from distconf.tools.real_model import gguf_path, second_gguf_path

    if way == "plain":
        gguf_compat._supported = lambda: False  # transformers' own three reads
    file = gguf_path() if model == "smollm2" else second_gguf_path()
    with tempfile.TemporaryDirectory() as cache:
        cpu, wall = os.times(), time.monotonic()
        open_source(file, cache_dir=cache)
        used = os.times()
    print(json.dumps({"cpu": used.user + used.system - cpu.user - cpu.system, "wall": time.monotonic() - wall}))


def measure(way: str, model: str) -> dict[str, float]:
    """One conversion in a new process."""
    done = subprocess.run([sys.executable, __file__, "--child", way, model], capture_output=True, text=True,
                          timeout=1800, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{way} conversion of {model} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1, help="conversions of each way per model (default 1)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: smollm2, gemma")
    parser.add_argument("--child", nargs=2, metavar=("WAY", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    with open("/proc/loadavg") as f:
        print(f"load average at start: {f.read().split()[0]}")
    print(f"{'model':<8} {'shared cpu s':>12} {'plain cpu s':>11} {'ratio':>6} {'shared wall s':>13} "
          f"{'plain wall s':>12}")
    for model in args.models.split(","):
        runs: dict[str, list[dict[str, float]]] = {"shared": [], "plain": []}
        for _ in range(args.rounds):
            for way in runs:
                runs[way].append(measure(way, model))
        cpu = {way: statistics.median(r["cpu"] for r in rs) for way, rs in runs.items()}
        wall = {way: statistics.median(r["wall"] for r in rs) for way, rs in runs.items()}
        print(f"{model:<8} {cpu['shared']:>12.1f} {cpu['plain']:>11.1f} {cpu['shared'] / cpu['plain']:>5.2f}x "
              f"{wall['shared']:>13.1f} {wall['plain']:>12.1f}")


if __name__ == "__main__":
    main()
