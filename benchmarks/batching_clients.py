"""Client processes for bench_batching: each one its own Python process and its own distributed models.

A client process (``python batching_clients.py --peers ... --swarm NAME SOURCE PREFIX ...``) joins
the swarm with one client-mode DHT node, builds one ``AutoDistributedModelForCausalLM`` per
``--swarm`` (the same model source, served under different DHT prefixes), prints ``BENCH_READY``
and then reads one JSON job per line on stdin: ``{"swarm": NAME, "ids": [...], "new_tokens": n,
"pad_token_id": p}``.
For each it runs one greedy generation of exactly ``n`` tokens and prints ``BENCH_RESULT {json}``
with the new tokens, the time each token's logits were ready and the start and end of the call
(``time.perf_counter``, which on Linux is the system-wide monotonic clock, so stamps of different
processes compare). It exits when its stdin ends.

`ClientPool` (used by the benchmark process) starts such processes through the servers'
harness (`distconf.tools.serving.ServerProcess`: a session of its own, logs, bounded waits).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
READY = "BENCH_READY"
RESULT = "BENCH_RESULT"
CLIENT_THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
"""A client process's threads: many clients share 2 cores with the servers; their own work is small."""


def client_env() -> dict[str, str]:
    """Environment of a client process: the thread settings above unless the user set them."""
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), str(HERE)])}
    env.update({k: os.environ.get(k, v) for k, v in CLIENT_THREADS.items()})
    return env


class ClientPool:
    """``count`` client processes, each with a model per swarm of ``swarms`` (name -> (source, dht prefix))."""

    def __init__(self, count: int, peers: Sequence[str], swarms: dict[str, tuple[str, str]], log_dir: Path, *,
                 gguf_cache: Path | None = None, deadline_s: float = 600.0) -> None:
        from distconf.tools.serving import ServerProcess

        cmd = [sys.executable, str(Path(__file__).resolve()), "--peers", *peers]
        for name, (source, prefix) in swarms.items():
            cmd += ["--swarm", name, source, prefix]
        if gguf_cache is not None:
            cmd += ["--gguf-cache", str(gguf_cache)]
        self.clients = [ServerProcess(cmd, log_dir / f"client-{i}.log", name=f"client-{i}", env=client_env(),
                                      stdin=True) for i in range(count)]
        try:
            deadline = time.monotonic() + deadline_s
            for client in self.clients:
                client.expect(READY, deadline)
        except BaseException:
            self.close()
            raise

    def run(self, jobs: Sequence[dict[str, Any]], timeout_s: float = 600.0) -> list[dict[str, Any]]:
        """Give job ``i`` to client ``i`` (all sent before any is awaited); return their results in order."""
        if len(jobs) > len(self.clients):
            raise ValueError(f"{len(jobs)} jobs for {len(self.clients)} client processes")
        for client, job in zip(self.clients, jobs):
            client.send(json.dumps(job))
        deadline = time.monotonic() + timeout_s
        return [json.loads(client.expect(RESULT, deadline).split(maxsplit=1)[1]) for client in self.clients[:len(jobs)]]

    def close(self) -> None:
        """End every client process (its stdin closed: it shuts its models down), killing any that hangs."""
        for client in self.clients:
            client.stop(timeout=30.0)


def _serve_jobs(models: dict[str, Any]) -> None:
    import torch
    from decode_timing import timed_greedy

    print(READY, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        ids = torch.tensor([job["ids"]], dtype=torch.long)
        start = time.perf_counter()
        tokens, stamps = timed_greedy(models[job["swarm"]], ids, int(job["new_tokens"]),
                                      pad_token_id=int(job.get("pad_token_id", 0)), full_length=True)
        end = time.perf_counter()
        print(RESULT, json.dumps({"tokens": tokens, "stamps": stamps, "start": start, "end": end}), flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run one client process (see the module docstring)."""
    parser = argparse.ArgumentParser(description="a client process of bench_batching")
    parser.add_argument("--peers", nargs="+", required=True)
    parser.add_argument("--swarm", nargs=3, action="append", metavar=("NAME", "SOURCE", "PREFIX"), required=True)
    parser.add_argument("--gguf-cache", default=None)
    args = parser.parse_args(argv)
    for key, value in CLIENT_THREADS.items():  # before torch is imported
        os.environ.setdefault(key, value)
    from distconf.client import AutoDistributedModelForCausalLM
    from distconf.client.swarm import release_dht
    from distconf.dht import start_local_dht

    dht = start_local_dht(args.peers, client_mode=True)
    models: dict[str, Any] = {}
    try:
        for name, source, prefix in args.swarm:
            models[name] = AutoDistributedModelForCausalLM.from_pretrained(
                source, dht=dht, dht_prefix=prefix, gguf_cache_dir=args.gguf_cache, max_retries=2)
        _serve_jobs(models)
    finally:
        for model in models.values():
            model.shutdown()
        release_dht(dht)
    return 0


if __name__ == "__main__":
    sys.exit(main())
