"""Per-hop overhead of the swarm at batch 1: swarm time per token minus the local compute, per server.

For hidden sizes 64, 1024 and 4096 (random models of the first plain family, few layers,
float32, few heads and a small MLP so that compute stays small next to the messages), the
blocks are split over N ``distconf serve`` processes on 127.0.0.1 and a greedy generation
runs through them with and without server-to-server push, and locally in this process.
Rounds are interleaved (local, push, no push, local, ...) so that the machine's load slows
all alike; each figure is the median time between decode steps. Prints, per hidden size:

- local ms/token (the compute of the same blocks, plus the embeddings and head the client
  runs in both cases): the reference;
- swarm ms/token with push and without;
- the per-hop overhead ``(swarm - local) / N`` in ms, against the target (2 ms);
- the same without the one-machine penalty: each server's own compute time per step (from its
  ``rpc_info`` stats) minus the same blocks' compute in this process (timed in the local rounds).
  On one machine a server's weights are evicted from the CPU caches by the other processes between
  its steps (measured: a 4096-wide layer takes 1.5 ms back to back and 2.5 ms after 64 MB of other
  memory traffic), which separate machines do not pay; this column is the step's own overhead.

Every process runs with ``OMP_WAIT_POLICY=PASSIVE`` and one OpenMP thread unless the
environment says otherwise (spinning OpenMP threads of idle processes would take the cores
from the busy one and the figure would measure that instead). Prints only; no assertions.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP; servers inherit it
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import contextlib
import itertools
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from bench_swarm import make_model, per_token_ms, plain_family

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

TARGET_MS = 2.0
"""The per-hop overhead the swarm should stay under at batch 1 on loopback."""


def shapes(layers: int) -> dict[int, dict[str, Any]]:
    """Config overrides per hidden size (the family's tiny config for the rest).

    Four heads of 64 (16 for hidden 64), an MLP of 256 and a vocabulary of 256 whatever the
    hidden size: the messages of a wide model with the compute of a small one, so that the
    compute's noise on this shared machine does not hide the overhead being measured.
    """
    def sized(hidden: int, head_dim: int, mlp: int) -> dict[str, Any]:
        return {"hidden_size": hidden, "intermediate_size": mlp, "num_hidden_layers": layers,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": head_dim,
                "vocab_size": 256, "max_position_embeddings": 2048}

    return {64: sized(64, 16, 128), 1024: sized(1024, 64, 256), 4096: sized(4096, 64, 256)}


def uptime() -> str:
    """The machine's load averages (it is shared)."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def bench(hidden: int, family: str, overrides: dict[str, Any], root: Path, servers_n: int, new_tokens: int,
          repeats: int) -> dict[str, float]:
    """Median ms per token locally, through the swarm with push and without; per-hop figures."""
    from client_swarm import server_info, start_servers, stop_all

    from distconf.client import AutoDistributedModelForCausalLM
    from distconf.client.swarm import release_dht
    from distconf.dht import start_local_dht, visible_maddrs

    model_dir, local = make_model(root / f"hidden{hidden}", family, overrides)
    n = local.config.num_hidden_layers
    cuts = [n * i // servers_n for i in range(servers_n + 1)]
    dht = start_local_dht()
    servers = start_servers([(model_dir, f"{a}:{b}") for a, b in itertools.pairwise(cuts)], visible_maddrs(dht), root)
    try:
        ids = torch.randint(0, local.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
        push = AutoDistributedModelForCausalLM.from_pretrained(model_dir, dht=dht, use_server_to_server=True,
                                                               max_retries=2)
        plain = AutoDistributedModelForCausalLM.from_pretrained(model_dir, dht=dht, use_server_to_server=False,
                                                                max_retries=2)
        models = {"local": local, "push": push, "plain": plain}
        per_token_ms(models, ids, 4, 1)  # warm up every path and the servers
        before = [server_info(plain, s.peer_id)["stats"] for s in servers]
        with layer_timer(local) as layer_ms:
            times = per_token_ms(models, ids, new_tokens, repeats)
        after = [server_info(plain, s.peer_id)["stats"] for s in servers]
        push.shutdown()
        plain.shutdown()
    finally:
        stop_all(servers)
        release_dht(dht)
    times["local_blocks"] = sum(layer_ms)
    times["server_blocks"] = sum(1000 * (a.get("step_seconds", 0) - b.get("step_seconds", 0))
                                 / max(1, a.get("batches", 0) - b.get("batches", 0)) for a, b in zip(after, before))
    penalty = times["server_blocks"] - times["local_blocks"]
    for name in ("push", "plain"):
        times[f"hop_{name}"] = (times[name] - times["local"]) / servers_n
        times[f"own_{name}"] = (times[name] - times["local"] - penalty) / servers_n
    return times


@contextlib.contextmanager
def layer_timer(model: Any) -> Iterator[list[float]]:
    """Median ms of each decoder layer of a local model per call, filled in when the block ends."""
    layers = model.model.layers
    spans: list[list[float]] = [[] for _ in layers]
    starts: dict[int, float] = {}
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(lambda _m, _a, i=i: starts.__setitem__(i, time.perf_counter())))
        hooks.append(layer.register_forward_hook(
            lambda _m, _a, _o, i=i: spans[i].append(time.perf_counter() - starts[i])))
    result: list[float] = []
    try:
        yield result
    finally:
        for hook in hooks:
            hook.remove()
        result.extend(1000 * statistics.median(s) for s in spans if s)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default=None, help="family to benchmark (default: the first plain one)")
    parser.add_argument("--hidden", type=int, nargs="*", default=[64, 1024, 4096])
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2, help="layers of each model (split over the servers)")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    family = args.family or plain_family()
    rows = {}
    print(f"before: {uptime()}")
    with tempfile.TemporaryDirectory(prefix="bench-hop-") as tmp:
        for hidden in args.hidden:
            rows[hidden] = bench(hidden, family, shapes(args.layers)[hidden], Path(tmp), args.servers,
                                 args.new_tokens, args.repeats)
    print(f"after:  {uptime()}")
    print(f"\n== per-hop overhead: {family} family, {args.layers} layers over {args.servers} servers on loopback, "
          f"float32, batch 1, {args.new_tokens} new tokens x {args.repeats} interleaved rounds, "
          f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, {torch.get_num_threads()} thread(s); target "
          f"<= {TARGET_MS:g} ms/hop")
    print(f"{'hidden':>7}{'local ms/tok':>14}{'push ms/tok':>13}{'plain ms/tok':>14}{'ms/hop push':>13}"
          f"{'ms/hop plain':>14}{'blocks here':>13}{'on servers':>12}{'own/hop push':>14}{'own/hop plain':>15}"
          f"{'own push vs target':>20}")
    for hidden, t in rows.items():
        print(f"{hidden:>7}{t['local']:14.2f}{t['push']:13.2f}{t['plain']:14.2f}{t['hop_push']:13.2f}"
              f"{t['hop_plain']:14.2f}{t['local_blocks']:13.2f}{t['server_blocks']:12.2f}{t['own_push']:14.2f}"
              f"{t['own_plain']:15.2f}{t['own_push'] / TARGET_MS:19.2f}x")
    print("blocks here / on servers: ms per step of the same blocks in this process (back to back) and on the "
          "servers (their own timing); own/hop: the per-hop overhead without that difference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
