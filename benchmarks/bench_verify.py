"""What spot checks cost: greedy generation on the real model with verify_fraction 0, 0.05, 0.1, 0.25, in one run.

Four ``distconf serve`` processes on 127.0.0.1 serve the real model (SmolLM2-135M-Instruct
from its GGUF, fp32): blocks 0:15 twice and 15:30 twice, so every span has an independent
server to check it. One client model per setting, all on the same swarm:

* ``0``: no checks (server-to-server push on, the default);
* ``0 no push``: no checks, steps through the client (``use_server_to_server=False``), the
  path checks take: the difference between the two is the push's share of the cost;
* ``0.05``, ``0.1``, ``0.25``: ``verify_fraction``.

Rounds are interleaved (each round generates once with every setting, in a rotated order)
so all share the machine's state. Prints per setting: tokens/s over whole generations
(chat prompt, ``--new-tokens`` greedy tokens, no early stop; prompt included in the time),
the mean ms per decode step, their ratios to ``0``, whether the tokens equal the unchecked
ones, and the verification events (none expected: every server is honest). The target is
<= 20 % slower at 0.1. Prints the load average before and after.

    .venv/bin/python benchmarks/bench_verify.py [--new-tokens 32] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
from decode_timing import timed_greedy

REPO = Path(__file__).resolve().parents[1]
SPANS = ("0:15", "0:15", "15:30", "15:30")
START_DEADLINE = 600.0
PREFIX = "bench-verify"
SETTINGS: dict[str, dict[str, Any]] = {
    "0": {"verify_fraction": 0.0},
    "0 no push": {"verify_fraction": 0.0, "use_server_to_server": False},
    "0.05": {"verify_fraction": 0.05},
    "0.1": {"verify_fraction": 0.1},
    "0.25": {"verify_fraction": 0.25},
}


def start_swarm(gguf: Path, peers: list[str], log_dir: Path, env: dict[str, str]) -> list[Any]:
    """The four servers (two per span), started together; returns once all are ready."""
    from distconf.tools.serving import ServerProcess, serve_command, wait_all_ready

    servers = [ServerProcess(serve_command(gguf, "--initial-peers", *peers, "--blocks", span, "--host", "127.0.0.1",
                                           "--dtype", "float32", "--dht-prefix", PREFIX),
                             log_dir / f"server-{i}.log", name=f"server-{i}", env=env)
               for i, span in enumerate(SPANS)]
    try:
        wait_all_ready(servers, time.monotonic() + START_DEADLINE)
    except BaseException:
        from distconf.tools.serving import stop_all

        stop_all(servers)
        raise
    return servers


def one_generation(model: Any, ids: torch.Tensor, new_tokens: int) -> tuple[list[int], float, list[float]]:
    """(new tokens, seconds for the whole generation, seconds between decode steps)."""
    begin = time.perf_counter()
    tokens, stamps = timed_greedy(model, ids, new_tokens, pad_token_id=2, full_length=True)
    gaps = [b - a for a, b in pairwise(stamps)]
    return tokens, stamps[-1] - begin, gaps


def run(new_tokens: int, rounds: int, threads: int, cache: Path, root: Path) -> None:
    """Start the swarm, time every setting round by round, print the table; stop everything."""
    from distconf.client import AutoDistributedModelForCausalLM
    from distconf.client.swarm import release_dht
    from distconf.dht import start_local_dht, visible_maddrs
    from distconf.sources import open_source
    from distconf.tools import real_model as rm
    from distconf.tools.serving import stop_all

    gguf = rm.gguf_path()
    env = {"PYTHONPATH": str(REPO), "DISTCONF_CACHE": str(cache), "OMP_NUM_THREADS": str(threads)}
    source = open_source(gguf, cache_dir=cache / "gguf")
    ids = rm.chat_ids(source.load_tokenizer())
    dht = start_local_dht()
    servers: list[Any] = []
    models: dict[str, Any] = {}
    try:
        began = time.monotonic()
        servers = start_swarm(gguf, visible_maddrs(dht), root, env)
        print(f"4 servers ready in {time.monotonic() - began:.0f} s")
        for name, settings in SETTINGS.items():
            models[name] = AutoDistributedModelForCausalLM.from_pretrained(
                gguf, dht=dht, dtype=torch.float32, dht_prefix=PREFIX, gguf_cache_dir=cache / "gguf",
                max_retries=2, **settings)
        for model in models.values():  # warm every path and every server up
            one_generation(model, ids, 4)
        seconds: dict[str, list[float]] = {name: [] for name in models}
        gaps: dict[str, list[float]] = {name: [] for name in models}
        tokens: dict[str, list[list[int]]] = {name: [] for name in models}
        names = list(models)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                got, total, step_gaps = one_generation(models[name], ids, new_tokens)
                seconds[name].append(total)
                gaps[name] += step_gaps
                tokens[name].append(got)
        report(models, seconds, gaps, tokens, ids.shape[1], new_tokens, rounds, threads)
    finally:
        for model in models.values():
            model.shutdown()
        stop_all(servers)
        release_dht(dht)


def report(models: dict[str, Any], seconds: dict[str, list[float]], gaps: dict[str, list[float]],
           tokens: dict[str, list[list[int]]], prompt: int, new_tokens: int, rounds: int, threads: int) -> None:
    """The side-by-side table, as ratios to no checks."""
    speed = {name: new_tokens * len(s) / sum(s) for name, s in seconds.items()}
    step = {name: 1000 * statistics.fmean(g) for name, g in gaps.items()}
    base = "0"
    print(f"\n== SmolLM2-135M-Instruct fp32, 4 servers on loopback (0:15 x2, 15:30 x2), batch 1, chat prompt of "
          f"{prompt} tokens + {new_tokens} greedy tokens x {rounds} rounds interleaved, {threads} compute "
          "thread(s) per process")
    print(f"{'verify_fraction':<16}{'tokens/s':>9}{'ratio':>8}{'slower':>8}{'ms/step':>9}{'ratio':>8}"
          f"{'same tokens':>13}{'events':>8}")
    for name, model in models.items():
        same = all(t == tokens[base][0] for t in tokens[name])
        events = len(getattr(model, "verification_events", []) or [])
        print(f"{name:<16}{speed[name]:>9.2f}{speed[name] / speed[base]:>7.2f}x"
              f"{100 * (1 - speed[name] / speed[base]):>7.0f}%{step[name]:>9.1f}{step[name] / step[base]:>7.2f}x"
              f"{'yes' if same else 'NO':>13}{events:>8}")
    target = 1 - speed["0.1"] / speed[base]
    print(f"at verify_fraction 0.1: {100 * target:.0f} % slower than unchecked (target <= 20 %: "
          f"{'met' if target <= 0.20 else 'missed'})")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="compute threads of this process and of every server (default 1: 2 shared cores)")
    parser.add_argument("--cache", type=Path, default=None,
                        help="conversion cache (default $DISTCONF_CACHE, else the tests' cache in .pytest_cache)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    torch.set_num_threads(args.threads)
    cache = args.cache or Path(os.environ.get("DISTCONF_CACHE") or REPO / ".pytest_cache/d/distconf-real-model")
    load = os.getloadavg()
    print(f"load average: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    with tempfile.TemporaryDirectory(prefix="bench-verify-") as tmp:
        run(args.new_tokens, args.rounds, args.threads, cache.expanduser(), Path(tmp))
    load = os.getloadavg()
    print(f"load average: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
