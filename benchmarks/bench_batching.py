"""Continuous batching: 1..16 concurrent client processes through 2 servers, batching on vs off, in one run.

A random model of the first plain family (hidden 1024, 16 heads, 8 KV heads, 8 layers, vocab
1000, float32: its blocks are nearly all of its ~380 MB) is saved as a checkpoint folder and
served by two pairs of ``distconf serve`` processes alive together on 127.0.0.1 (blocks 0:4 and
4:8 each; one pair with batching on, the default flags, the other with ``--no-batching``, under
distinct DHT prefixes). 16 client processes (`batching_clients`), each its own
``AutoDistributedModelForCausalLM`` from the same folder, hold a model of each swarm. For 1, 2, 4,
8 and 16 sessions at once (client ``i`` always sends prompt ``i``: different prompts and lengths,
32 new tokens, greedy), round after round, the cells interleaved (batching on and off alternate
which goes first) so that the machine's load slows all alike, it prints side by side:

- aggregate tokens/s (all sessions' tokens over the wall time from the first start to the last
  end; the median over rounds) and p50/p95 per-token latency (the time between consecutive
  tokens of one session, over every session and round), batching on vs off and vs 1 session;
- rows per batch (the servers' ``rpc_info`` stats: steps received / batches computed, during the
  cell) and the local model's forward time at that batch size (one thread, as a server has) as a
  floor for the per-token latency;
- whether the targets are met: 8 sessions >= 4x the aggregate tokens/s of 1 session, p50 latency
  at 8 sessions <= 2.5x the 1-session latency (batching on).

The random model runs once per server precision (``--precisions``): float32, bfloat16 (``--dtype
bfloat16``) and int8 (``--quant int8``). On this CPU a decode step of 8 rows costs 2.4x one row in
float32, about one row in bfloat16 and 2.1x in int8 (the "local fwd" column), so what batching can
gain differs by precision.

Then the real model (SmolLM2-135M-Instruct from its GGUF, blocks 0:15 and 15:30) at 1 and 8
sessions (chat prompts of different questions), batching on vs off, the same way.

In float32 every session's tokens must equal the local model's greedy tokens for its prompt
(computed once per prompt here): a difference prints MISMATCH and the run exits 1. In bfloat16 and
int8 the reference is the local model at that precision, and a batch of several rows may round
differently from one row, so the share of sessions whose tokens agree is printed instead. ``uptime`` is printed at the
start and the end. ``--quick``: one round, fewer sessions and tokens (a smoke run); ``--json FILE``
writes every figure. Thread settings: every process gets ``OMP_WAIT_POLICY=PASSIVE`` and one
compute thread (the servers choose their own when ``distconf/threads.py`` is in git; a variable set
by the user is kept). A full run takes about 10-15 minutes on a shared 2-core machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
for _key, _value in THREADS.items():  # this process (the local reference, the timing floor), before torch
    os.environ.setdefault(_key, _value)

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from batching_clients import ClientPool  # noqa: E402
from batching_report import Cell, print_table  # noqa: E402
from bench_swarm import make_model, plain_family  # noqa: E402
from decode_timing import timed_greedy  # noqa: E402

LARGE = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
         "num_key_value_heads": 8, "vocab_size": 1000, "max_position_embeddings": 2048}
PRECISIONS: dict[str, tuple[str, ...]] = {"float32": ("--dtype", "float32"), "bfloat16": ("--dtype", "bfloat16"),
                                          "int8": ("--dtype", "float32", "--quant", "int8")}
"""The servers' flags for each precision of the random model."""
MODES = ("on", "off")
SERVE_FLAGS = {"on": (), "off": ("--no-batching",)}
START_DEADLINE = 600.0
QUESTIONS = ("What is the capital of France?", "Name three colours of the rainbow.", "How do bees make honey?",
             "Why is the sky blue?", "What is two plus two?", "Write a haiku about rain.",
             "Who wrote Romeo and Juliet?", "How many legs does a spider have?", "What do plants need to grow?",
             "Describe a cat in one sentence.", "What is the boiling point of water?", "Why do we sleep?",
             "What is a prime number?", "Translate 'good morning' to French.", "What is the largest ocean?",
             "How does a rainbow form?")


def uptime() -> str:
    """The ``uptime`` line (load averages)."""
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def server_env(extra: dict[str, str]) -> dict[str, str]:
    """A server's environment: the thread settings, unless ``distconf/threads.py`` is in git (then the server's own)."""
    tracked = subprocess.run(["git", "-C", str(REPO), "ls-files", "--error-unmatch", "distconf/threads.py"],
                             capture_output=True, check=False).returncode == 0
    env = {"PYTHONPATH": str(REPO), **extra}
    if not tracked:
        env.update({k: os.environ.get(k, v) for k, v in THREADS.items()})
    return env


def start_swarms(source: Path, peers: list[str], spans: tuple[str, str], prefix: str, log_dir: Path,
                 env: dict[str, str], precision: tuple[str, ...] = PRECISIONS["float32"]) -> dict[str, list[Any]]:
    """Two servers per mode (one per span), all started at once; ``{mode: servers}`` once all are ready."""
    from distconf.tools.serving import ServerProcess, serve_command, wait_all_ready

    swarms = {mode: [ServerProcess(serve_command(source, "--initial-peers", *peers, "--blocks", span,
                                                 "--host", "127.0.0.1", *precision,
                                                 "--balance-quality", "0", "--dht-prefix", f"{prefix}-{mode}",
                                                 *SERVE_FLAGS[mode]),
                                   log_dir / f"{prefix}-{mode}-{i}.log", name=f"{prefix}-{mode}-{i}", env=env)
                     for i, span in enumerate(spans)] for mode in MODES}
    wait_all_ready([s for pair in swarms.values() for s in pair], time.monotonic() + START_DEADLINE)
    return swarms


def server_stats(p2p: Any, servers: list[Any]) -> list[dict[str, int]]:
    """Each server's ``rpc_info`` stats."""
    from distconf.client.swarm import SwarmClient
    from distconf.rpc.calls import call_info

    return [dict(SwarmClient.run(call_info(p2p, s.peer_id, timeout=10.0), timeout=15.0).get("stats", {}))
            for s in servers]


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of the processes ``pids`` and their live children."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for process in tree:
            try:
                times = process.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system
    return total


def cpu_snapshot(servers: list[Any], pool: ClientPool) -> dict[str, float]:
    """CPU seconds so far: the servers', the client processes', the whole machine's (busy), and the wall clock."""
    import psutil

    machine = psutil.cpu_times()
    return {"servers": cpu_seconds([s.proc.pid for s in servers]),
            "clients": cpu_seconds([c.proc.pid for c in pool.clients]),
            "machine": sum(machine) - machine.idle - getattr(machine, "iowait", 0.0), "wall": time.monotonic()}


def local_forward_ms(model: Any, batch: int, past: int = 24, steps: int = 4) -> float:
    """Median ms of one decode forward of the local model at ``batch`` rows after ``past`` cached tokens."""
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, model.config.vocab_size, (batch, past), generator=gen)
    times = []
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache = out.past_key_values
        for _ in range(steps):
            begin = time.perf_counter()
            out = model(ids[:, :1], past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - begin)
            cache = out.past_key_values
    return 1000 * statistics.median(times)


def measure(name: str, pool: ClientPool, swarms: dict[str, list[Any]], p2p: Any, prompts: list[list[int]],
            refs: list[list[int]], sessions: list[int], rounds: int, new_tokens: int, pad: int,
            mismatches: list[str], agreement: list[bool] | None = None) -> dict[str, dict[int, Cell]]:
    """Run every (mode, sessions) cell ``rounds`` times, interleaved; check every session's tokens (with
    ``agreement``: only count which sessions agree with ``refs``)."""
    cells = {mode: {n: Cell(n) for n in sessions} for mode in MODES}

    def run(mode: str, n: int, tokens: int) -> tuple[list[dict[str, Any]], list[dict[str, int]], list[dict[str, int]],
                                                     dict[str, float]]:
        before = server_stats(p2p, swarms[mode])
        jobs = [{"swarm": mode, "ids": prompts[i], "new_tokens": tokens, "pad_token_id": pad} for i in range(n)]
        cpu = cpu_snapshot(swarms[mode], pool)
        results = pool.run(jobs)
        cpu = {k: v - cpu[k] for k, v in cpu_snapshot(swarms[mode], pool).items()}
        for i, result in enumerate(results):
            if agreement is not None:
                agreement.append(result["tokens"] == refs[i][:tokens])
            elif result["tokens"] != refs[i][:tokens]:
                mismatches.append(f"{name} batching {mode}, {n} sessions, session {i}: swarm {result['tokens']} "
                                  f"!= local {refs[i][:tokens]}")
                print(f"!!! MISMATCH {mismatches[-1]}", flush=True)
        return results, before, server_stats(p2p, swarms[mode]), cpu

    for mode in MODES:  # warm every client's route and both servers up
        run(mode, len(pool.clients), 4)
    for r in range(rounds):
        for n in sessions:
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                cells[mode][n].add(*run(mode, n, new_tokens))
        print(f"  {name}: round {r + 1}/{rounds} done ({uptime()})", flush=True)
    return cells


def run_model(name: str, title: str, source: Path, client_source: str, spans: tuple[str, str], prompts: list[list[int]],
              refs: list[list[int]], local: Any, sessions: list[int], args: argparse.Namespace, root: Path,
              mismatches: list[str], *, pad: int = 0, env: dict[str, str] | None = None,
              gguf_cache: Path | None = None, targets: bool = True, precision: str = "float32") -> dict[str, Any]:
    """Serve ``source`` twice (batching on, off), run the cells from ``len(sessions)`` client processes, print."""
    from distconf.client.swarm import SwarmClient, release_dht
    from distconf.dht import start_local_dht, visible_maddrs
    from distconf.tools.serving import stop_all

    floors = {n: local_forward_ms(local, n) for n in sessions}
    dht = start_local_dht()
    swarms: dict[str, list[Any]] = {}
    pool = None
    try:
        peers = visible_maddrs(dht)
        began = time.monotonic()
        swarms = start_swarms(source, peers, spans, f"bench-batching-{name}", root, server_env(env or {}),
                              PRECISIONS[precision])
        print(f"  {name}: 4 servers ready in {time.monotonic() - began:.0f} s", flush=True)
        p2p = SwarmClient.run(dht.replicate_p2p(), timeout=30.0)
        began = time.monotonic()
        pool = ClientPool(max(sessions), peers, {mode: (client_source, f"bench-batching-{name}-{mode}")
                                                 for mode in MODES}, root, gguf_cache=gguf_cache)
        print(f"  {name}: {max(sessions)} client processes ready in {time.monotonic() - began:.0f} s", flush=True)
        agreement = None if precision == "float32" else []
        cells = measure(name, pool, swarms, p2p, prompts, refs, sessions, args.rounds, args.new_tokens, pad,
                        mismatches, agreement)
        final = {mode: server_stats(p2p, pair) for mode, pair in swarms.items()}
    finally:
        if pool is not None:
            pool.close()
        for pair in swarms.values():
            stop_all(pair)
        release_dht(dht)
    results = print_table(title, cells, floors, final, targets=targets)
    if agreement is not None:
        results["agreeing_sessions"] = [sum(agreement), len(agreement)]
        print(f"sessions whose tokens equal the local {precision} model's: {sum(agreement)}/{len(agreement)} "
              f"(rows of a batch may round differently from one row at this precision)")
    return results


def local_at(model: Any, precision: str) -> Any:
    """The local reference at a server precision: the blocks in bfloat16, or quantized to int8 as servers do."""
    import copy

    from distconf.blocks.quant import quantize_block

    if precision == "float32":
        return model
    local = copy.deepcopy(model)
    for layer in local.model.layers:
        if precision == "bfloat16":
            layer.to(torch.bfloat16)
        else:
            quantize_block(layer, precision)
    if precision == "bfloat16":  # the servers' outputs arrive in bfloat16 and go on in the client's float32
        for layer in local.model.layers:
            layer.register_forward_pre_hook(lambda _m, args, kwargs: ((args[0].to(torch.bfloat16), *args[1:]),
                                                                      _bf16(kwargs)), with_kwargs=True)
            layer.register_forward_hook(lambda _m, _a, out: out.float() if torch.is_tensor(out)
                                        else (out[0].float(), *out[1:]))
    return local


def _bf16(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else
                tuple(t.to(torch.bfloat16) for t in v) if isinstance(v, tuple) and v and torch.is_tensor(v[0]) else v)
            for k, v in kwargs.items()}


def random_model_phase(args: argparse.Namespace, root: Path, mismatches: list[str],
                       precision: str = "float32") -> dict[str, Any]:
    """The random 1024-hidden model served at ``precision``: build, reference tokens, serve, measure."""
    family = plain_family()
    folder, local = make_model(root / "hidden1024", family, LARGE)
    size = sum(p.numel() * p.element_size() for p in local.parameters()) / 1e6
    local = local_at(local, precision)
    count = max(args.sessions)
    prompts = [torch.randint(0, LARGE["vocab_size"], (8 + (i * 5) % 17,), generator=torch.Generator().manual_seed(i))
               .tolist() for i in range(count)]
    began = time.monotonic()
    refs = [timed_greedy(local, torch.tensor([p]), args.new_tokens, full_length=True)[0] for p in prompts]
    print(f"  hidden1024: local reference tokens of {count} prompts in {time.monotonic() - began:.0f} s", flush=True)
    title = (f"{family} family, random, hidden 1024, 16 heads, 8 KV heads, 8 layers, vocab 1000 ({size:.0f} MB "
             f"in float32), servers in {precision}; 2 servers (0:4, 4:8) per mode on loopback; prompts of 8-24 tokens, "
             f"{args.new_tokens} new tokens, greedy; {args.rounds} round(s) interleaved")
    return run_model(f"hidden1024-{precision}", title, folder, str(folder), ("0:4", "4:8"), prompts, refs, local,
                     args.sessions, args, root, mismatches, precision=precision)


def real_phase(args: argparse.Namespace, root: Path, mismatches: list[str]) -> dict[str, Any]:
    """The real model from its GGUF (the tests' shared conversion cache): reference tokens, serve, measure."""
    from distconf.sources import open_source
    from distconf.tools import real_model as rm

    cache_root = Path(os.environ.get("DISTCONF_CACHE") or REPO / ".pytest_cache" / "d" / "distconf-real-model")
    gguf = rm.gguf_path()
    source = open_source(gguf, cache_dir=cache_root / "gguf")
    tokenizer = source.load_tokenizer()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts = [rm.chat_ids(tokenizer, q)[0].tolist() for q in QUESTIONS[:max(args.real_sessions)]]
    local = rm.local_model(source.checkpoint_dir, torch.float32)
    refs = [timed_greedy(local, torch.tensor([p]), args.new_tokens, pad_token_id=pad, full_length=True)[0]
            for p in prompts]
    title = (f"SmolLM2-135M-Instruct (30 layers, hidden 576) from {gguf.name}, float32; 2 servers (0:15, 15:30) per "
             f"mode; chat prompts of different questions, {args.new_tokens} new tokens, greedy; {args.rounds} "
             f"round(s) interleaved")
    return run_model("smollm2", title, gguf, str(gguf), ("0:15", "15:30"), prompts, refs, local, args.real_sessions,
                     args, root, mismatches, pad=pad, env={"DISTCONF_CACHE": str(cache_root)},
                     gguf_cache=cache_root / "gguf", targets=False)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the tables; exit 1 if any session's tokens differ from the local model's."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 round, 1/4 sessions, 8 new tokens")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per cell (default 3, --quick 1)")
    parser.add_argument("--new-tokens", type=int, default=None, help="new tokens per session (default 32, --quick 8)")
    parser.add_argument("--sessions", type=int, nargs="+", default=None, help="default 1 2 4 8 16 (--quick 1 4)")
    parser.add_argument("--real-sessions", type=int, nargs="+", default=None, help="default 1 8 (--quick 1 4)")
    parser.add_argument("--skip-real", action="store_true", help="only the random 1024-hidden model")
    parser.add_argument("--precisions", nargs="+", choices=tuple(PRECISIONS), default=list(PRECISIONS),
                        help="server precisions of the random model (default: all three)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write every figure to FILE")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.new_tokens = args.new_tokens or (8 if args.quick else 32)
    args.sessions = sorted(set(args.sessions or ([1, 4] if args.quick else [1, 2, 4, 8, 16])))
    args.real_sessions = sorted(set(args.real_sessions or ([1, 4] if args.quick else [1, 8])))
    if max(len(QUESTIONS), 16) < max(args.real_sessions):
        parser.error(f"at most {len(QUESTIONS)} real-model sessions")
    began = time.monotonic()
    start_load = uptime()
    print(f"load at start: {start_load}", flush=True)
    mismatches: list[str] = []
    report: dict[str, Any] = {"load_start": start_load, "args": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory(prefix="bench-batching-") as tmp:
        for precision in args.precisions:
            report[f"hidden1024-{precision}"] = random_model_phase(args, Path(tmp), mismatches, precision)
        if not args.skip_real:
            report["smollm2"] = real_phase(args, Path(tmp), mismatches)
    report["load_end"] = uptime()
    report["mismatches"] = mismatches
    report["seconds"] = round(time.monotonic() - began, 1)
    print(f"\nload at end: {report['load_end']}\ntotal run {report['seconds']:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2), encoding="utf-8")
    if mismatches:
        print(f"\n!!! MISMATCH: {len(mismatches)} session(s) differ from the local model's greedy tokens:")
        for line in mismatches:
            print(f"!!!   {line}")
        return 1
    print("every session's tokens equal the local model's greedy tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
