"""What a ``distconf`` command costs at its exit: the console script as it is, against the same script without
its `gc.freeze` before the interpreter ends.

A command that imported torch and transformers leaves a few million objects behind. The interpreter's
last garbage collection visits all of them (most live in no reference cycle and are freed by refcount
anyway); `distconf.cli.main` freezes them first, so that collection skips them. Both variants run
the same command as new interpreters, interleaved (A B B A ...) so that load from elsewhere slows both
alike; the benchmark prints each one's median CPU seconds (user + system, the process and its children)
and wall seconds, and their ratio to the reference. Prints only; no assertions.

Usage: ``python benchmarks/bench_cli_exit.py [--rounds 6] [-- COMMAND ARGS...]`` (default: `default_command`).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time


def default_command() -> list[str]:
    """A command that imports torch and transformers and does little else: a capacity plan of the first preset."""
    from distconf.loader.presets import list_presets

    return ["plan", list_presets()[0], "--memory", "24GiB", "--json"]

VARIANTS = {
    "no freeze (reference)": ("import gc, sys; gc.freeze = lambda: None; from distconf.cli import main; "
                              "sys.exit(main())"),
    "distconf (freeze)": "import sys; from distconf.cli import main; sys.exit(main())",
}


def run_once(code: str, command: list[str]) -> tuple[float, float]:
    """CPU and wall seconds of one new interpreter running ``code`` with ``command`` as its arguments."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, *command], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, timeout=300)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"the command failed ({proc.returncode}): {proc.stderr[-500:]}")
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help="runs of each variant (interleaved)")
    parser.add_argument("command", nargs="*", help="the distconf command and its arguments")
    args = parser.parse_args()
    command = list(args.command or default_command())
    names = list(VARIANTS)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for i in range(args.rounds):
        for name in names if i % 2 == 0 else reversed(names):
            results[name].append(run_once(VARIANTS[name], command))
    load = os.getloadavg()
    print(f"distconf {' '.join(command)}: {args.rounds} runs each, load average {load[0]:.1f} {load[1]:.1f}")
    ref_cpu = statistics.median(c for c, _ in results[names[0]])
    ref_wall = statistics.median(w for _, w in results[names[0]])
    print(f"{'':24} {'CPU s':>7} {'ratio':>6} {'wall s':>7} {'ratio':>6}")
    for name in names:
        cpu = statistics.median(c for c, _ in results[name])
        wall = statistics.median(w for _, w in results[name])
        print(f"{name:24} {cpu:7.2f} {cpu / ref_cpu:5.2f}x {wall:7.2f} {wall / ref_wall:5.2f}x")


if __name__ == "__main__":
    main()
