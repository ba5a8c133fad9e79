"""Co-located processes: ms per token with torch's default threading against distconf's thread policy.

For each model (a tiny random model of the first plain family, and a 386 MB one: hidden 1024,
16 heads, 8 KV heads, 8 layers, vocabulary 1000, float32) and each *configuration* (``default``:
``DISTCONF_THREADS=off``, torch's own threads and OpenMP wait policy; ``policy``: what
`distconf.threads` chooses), the benchmark starts 2 ``distconf serve`` processes (blocks split
in half) and one client process, all with that configuration's environment. Every configuration's
swarm runs at the same time (its own DHT prefix) and the rounds are interleaved (A B B A ...),
so load from elsewhere slows all alike. A round asks each client to generate greedily
through its swarm, then with the same model loaded locally while its servers sit idle. It
prints the median ms per decode step (batch 1) of each, the ratio to ``default``, and the
CPU seconds each configuration's server processes, their p2p daemons and their DHT node processes used
during the rounds.

``--config NAME=VAR=VALUE,VAR=VALUE`` adds a configuration (its variables for every process of
it; ``NAME=...;VAR=VALUE`` after ``;`` for its client only), to try other choices.
The variables `distconf.threads` manages are removed from this process's environment first.
Prints only; no assertions.

Measured here (2 cores shared with other users' jobs, load average 6-12; 5 rounds; ms per token,
ratio to default; ``passiveall``: PASSIVE with every process on both cores; ``spinall``: both cores
and ``GOMP_SPINCOUNT=10000``, a short spin, instead of PASSIVE)::

                 tiny swarm     tiny local      386 MB swarm    386 MB local
    default       9.45 1.00x    57.12 1.00x     38.70 1.00x     79.91 1.00x
    policy        8.42 0.89x     1.72 0.03x     38.66 1.00x     29.92 0.37x
    passiveall    7.15 0.76x     4.91 0.09x     44.07 1.14x     32.93 0.41x
    spinall       7.13 0.76x     8.01 0.14x     42.93 1.11x     51.02 0.64x

Over five such runs the policy's ratios were 0.89-1.30x (tiny swarm), 0.02-0.07x (tiny local),
0.90-1.57x (386 MB swarm) and 0.30-1.09x (386 MB local): the swarm figures move with the other
load, the local model beside idle servers gains almost every time (torch's default spin, about
3 ms after every parallel region, lets a descheduled thread stall each barrier when the cores are
oversubscribed). The p2p daemons used 12-50 % of the servers' CPU time in the rounds, the DHT node
processes 0-7 %.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO / "tests"), str(REPO)]

LARGE = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
         "num_key_value_heads": 8, "vocab_size": 1000, "max_position_embeddings": 2048}
TINY = {"num_hidden_layers": 4}
START_DEADLINE = 300.0
STEP_DEADLINE = 300.0


def worker(model_dir: str, prefix: str, peers: list[str]) -> int:
    """A client process: load the model locally and through the swarm, then answer ``local N``/``swarm N`` lines."""
    from distconf.threads import apply_thread_policy

    apply_thread_policy()
    import torch
    from decode_timing import step_gaps
    from transformers import AutoModelForCausalLM

    from distconf.client import AutoDistributedModelForCausalLM

    local = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    remote = AutoDistributedModelForCausalLM.from_pretrained(model_dir, dht_prefix=prefix, initial_peers=peers,
                                                             max_retries=2)
    ids = torch.randint(0, local.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    models = {"local": local, "swarm": remote}
    for model in models.values():
        step_gaps(model, ids, 4, full_length=True)  # warm up
    print(f"WORKER_READY {torch.get_num_threads()} {os.environ.get('OMP_WAIT_POLICY', '-')}", flush=True)
    try:
        for line in sys.stdin:
            what, _, count = line.strip().partition(" ")
            gaps = step_gaps(models[what], ids, int(count), full_length=True)
            print("GAPS " + json.dumps(gaps), flush=True)
    finally:
        remote.shutdown()
    return 0


def cpu_seconds(pid: int) -> tuple[float, float, float]:
    """CPU seconds (user + system) of a process, of its live p2p daemon descendants, and of its other ones."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    times: dict[int, tuple[str, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            head, _, tail = (entry / "stat").read_text().rpartition(")")
        except OSError:
            continue
        fields = tail.split()
        children.setdefault(int(fields[1]), []).append(int(entry.name))
        times[int(entry.name)] = (head.partition("(")[2], (int(fields[11]) + int(fields[12])) / tick)
    todo, p2pd, rest = list(children.get(pid, [])), 0.0, 0.0
    while todo:
        p = todo.pop()
        name, used = times.get(p, ("", 0.0))
        if "p2pd" in name:
            p2pd += used
        else:
            rest += used
        todo += children.get(p, [])
    return times.get(pid, ("", 0.0))[1], p2pd, rest


class Setup:
    """One configuration's processes for one model: 2 servers and a client worker, with its environment."""

    def __init__(self, name: str, env: dict[str, str], client_env: dict[str, str], model_dir: Path, layers: int,
                 peers: list[str], logs: Path) -> None:
        from distconf.tools.serving import ServerProcess, serve_command

        self.name, self.prefix = name, f"bench-threads-{model_dir.name}-{name}"
        base = {"PYTHONPATH": str(REPO), **env}
        half = layers // 2
        self.servers = [
            ServerProcess(serve_command(model_dir, "--initial-peers", *peers, "--blocks", span, "--dtype", "fp32",
                                        "--host", "127.0.0.1", "--dht-prefix", self.prefix),
                          logs / f"{self.prefix}-{i}.log", name=f"{self.prefix}-{i}", env=base)
            for i, span in enumerate((f"0:{half}", f"{half}:{layers}"))]
        self.model_dir, self.peers, self.logs, self.client_env = model_dir, peers, logs, {**base, **client_env}
        self.client: Any = None
        self.gaps: dict[str, list[float]] = {"swarm": [], "local": []}
        self.threads = ""

    def start_client(self, deadline: float) -> None:
        """Wait for the servers, then start the client worker and wait for it."""
        from distconf.tools.serving import ServerProcess, wait_all_ready

        wait_all_ready(self.servers, deadline)
        cmd = [sys.executable, __file__, "--worker", str(self.model_dir), self.prefix, *self.peers]
        self.client = ServerProcess(cmd, self.logs / f"{self.prefix}-client.log", name=f"{self.prefix}-client",
                                    env=self.client_env, stdin=True)
        _, threads, policy = self.client.expect("WORKER_READY", deadline).split()
        self.threads = f"{threads} thr, {policy}"

    def run(self, what: str, tokens: int) -> None:
        """One generation (``local`` or ``swarm``) in the client; keep its step gaps."""
        self.client.send(f"{what} {tokens}")
        line = self.client.expect("GAPS", time.monotonic() + STEP_DEADLINE)
        self.gaps[what] += json.loads(line.split(maxsplit=1)[1])

    def server_cpu(self) -> tuple[float, ...]:
        """CPU seconds of the server processes, of their p2p daemons and of their other children (DHT nodes)."""
        triples = [cpu_seconds(s.proc.pid) for s in self.servers]
        return tuple(sum(t[i] for t in triples) for i in range(3))

    def stop(self) -> None:
        """Stop the client, then the servers."""
        from distconf.tools.serving import stop_all

        if self.client is not None:
            self.client.stop(30.0)
        stop_all(self.servers)


def parse_config(text: str) -> tuple[str, dict[str, str], dict[str, str]]:
    """``NAME=VAR=VALUE,...[;VAR=VALUE,...]`` -> (name, environment of all its processes, extra for its client)."""
    name, _, rest = text.partition("=")
    every, _, client = rest.partition(";")

    def pairs(part: str) -> dict[str, str]:
        return dict(item.split("=", 1) for item in part.split(",") if item)

    return name, pairs(every), pairs(client)


def bench(label: str, overrides: dict[str, Any], configs: list[tuple[str, dict[str, str], dict[str, str]]],
          root: Path, peers: list[str], tokens: int, rounds: int) -> None:
    """Start every configuration's swarm for one model, run interleaved rounds, print the table."""
    from bench_swarm import make_model, plain_family

    family = plain_family()
    model_dir, local = make_model(root / label, family, overrides)
    size = sum(p.numel() * p.element_size() for p in local.parameters()) / 1e6
    layers = local.config.num_hidden_layers
    del local
    setups = [Setup(name, env, client_env, model_dir, layers, peers, root) for name, env, client_env in configs]
    try:
        deadline = time.monotonic() + START_DEADLINE
        for setup in setups:
            setup.start_client(deadline)
        cpu_before = [s.server_cpu() for s in setups]
        for r in range(rounds):
            for setup in setups if r % 2 == 0 else reversed(setups):
                setup.run("swarm", tokens)
                setup.run("local", tokens)
        cpu = [tuple(b - a for a, b in zip(before, s.server_cpu())) for before, s in zip(cpu_before, setups)]
        load = os.getloadavg()
        print(f"\n== {label}: {family} family, {size:,.0f} MB fp32, 2 servers + 1 client per configuration, batch 1, "
              f"{tokens} tokens x {rounds} interleaved rounds; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
        ref = {what: statistics.median(setups[0].gaps[what]) for what in ("swarm", "local")}
        print(f"{'configuration':16}{'client':>18}{'swarm ms':>10}{'ratio':>8}{'local ms':>10}{'ratio':>8}"
              f"{'CPU s: servers':>16}{'p2pd':>6}{'DHT':>6}")
        for setup, (own, p2pd, dht) in zip(setups, cpu):
            swarm, local_ms = (statistics.median(setup.gaps[w]) for w in ("swarm", "local"))
            print(f"{setup.name:16}{setup.threads:>18}{1000 * swarm:10.2f}{swarm / ref['swarm']:7.2f}x"
                  f"{1000 * local_ms:10.2f}{local_ms / ref['local']:7.2f}x{own:16.1f}{p2pd:6.1f}{dht:6.1f}")
    finally:
        for setup in setups:
            setup.stop()


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, with ``--worker``, one client process of it)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1], argv[2], argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--skip-large", action="store_true", help="only the tiny model")
    parser.add_argument("--skip-tiny", action="store_true", help="only the 386 MB model")
    parser.add_argument("--config", action="append", default=[], metavar="NAME=VAR=VALUE,...",
                        help="another configuration to compare (repeatable)")
    args = parser.parse_args(argv)
    from distconf.threads import MANAGED, MARKER, SWITCH

    for name in (*MANAGED, MARKER, SWITCH):
        os.environ.pop(name, None)
    configs = [("default", {SWITCH: "off"}, {}), ("policy", {}, {}), *map(parse_config, args.config)]
    from distconf.client.swarm import release_dht
    from distconf.dht import start_local_dht, visible_maddrs

    dht = start_local_dht()
    try:
        peers = visible_maddrs(dht)
        with tempfile.TemporaryDirectory(prefix="bench-threads-") as tmp:
            if not args.skip_tiny:
                bench("tiny", TINY, configs, Path(tmp), peers, args.new_tokens, args.rounds)
            if not args.skip_large:
                bench("386MB", LARGE, configs, Path(tmp), peers, args.new_tokens, args.rounds)
    finally:
        release_dht(dht)
    print(f"\nuptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
