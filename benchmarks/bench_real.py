"""The real model (SmolLM2-135M-Instruct from its GGUF) through 2 servers against the local model, in one run.

Starts, one pair after another, two ``distconf serve`` processes (blocks 0:15 and 15:30 on
127.0.0.1): fp32 from the GGUF with an empty conversion cache (stopped when ready), then
fp32, bf16, int8 and nf4 from the GGUF (int8/nf4 quantize fp32 blocks), and fp32 from a
plain folder (the converted copy without ``dht_prefix``; stopped when ready). Prints:

- load time: each pair's start-to-ready time, from the GGUF with the cache empty (the
  servers convert it: one converts, the other waits on the cache's lock), from the GGUF
  cached, and from the folder; and ``open_source`` in this process on the cached GGUF and on
  the folder;
- ms per generated token (median of the decode steps, batch 1, greedy, the chat prompt)
  through the swarm for each dtype/quant, and locally (the same quantization applied to the
  local model's decoder layers), runs interleaved round by round so all share the machine's
  state; ratios to local fp32;
- quality on `FIXED_TEXT`: top-1 agreement with the local fp32 model and perplexity, locally
  and through the swarm, and the swarm's greedy chat answer;
- each server's peak and current RSS (VmHWM and psutil's rss of the server process, with the
  resident part of its memory-mapped checkpoint; its DHT and P2P children apart) against the
  exact bytes of its 15 blocks.

Prints only; no assertions. Total run about 4-6 minutes on a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from decode_timing import step_gaps

REPO = Path(__file__).resolve().parents[1]
SPANS = ("0:15", "15:30")
START_DEADLINE = 600.0
VARIANTS = {  # name: (--dtype, --quant, client dtype)
    "fp32": ("float32", "none", torch.float32),
    "bf16": ("bfloat16", "none", torch.bfloat16),
    "int8": ("float32", "int8", torch.float32),
    "nf4": ("float32", "nf4", torch.float32),
}


def per_token_ms(models: dict[str, Any], ids: torch.Tensor, new_tokens: int, rounds: int) -> dict[str, float]:
    """Median ms per decode step of each model, the models interleaved round by round."""
    gaps: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            gaps[name] += step_gaps(model, ids, new_tokens, pad_token_id=2, full_length=True)
    return {name: 1000 * statistics.median(g) for name, g in gaps.items()}


def _hwm_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def rss_mib(pid: int) -> tuple[float, float, float, float]:
    """(peak RSS, current RSS, of which mapped checkpoint files, children's peak RSS summed), in MiB.

    The peak is Linux's VmHWM (it includes what loading and quantizing held for a moment). The
    mapped checkpoint is the resident part of memory-mapped ``.safetensors`` files (an fp32
    server's weights are views of it). The children (the DHT process, the P2P daemon) share
    pages with the server, so their sum is an upper bound.
    """
    import psutil

    try:
        process = psutil.Process(pid)
        children, now = process.children(recursive=True), process.memory_info().rss / 2**20
        mapped = sum(m.rss for m in process.memory_maps(grouped=True) if m.path.endswith(".safetensors")) / 2**20
    except psutil.Error:
        children, now, mapped = [], float("nan"), float("nan")
    return _hwm_mib(pid), now, mapped, sum(_hwm_mib(c.pid) for c in children)


def blocks_mib(config: Any, dtype: str, quant: str, count: int) -> float:
    """The exact bytes of ``count`` blocks as `distconf.blocks.sizing` counts them, in MiB."""
    from distconf.blocks.sizing import block_size_bytes

    return count * block_size_bytes(config, getattr(torch, dtype), None if quant == "none" else quant) / 2**20


def start_pair(model: Path, peers: list[str], log_dir: Path, name: str, dtype: str, quant: str, prefix: str,
               env: dict[str, str]) -> tuple[list[Any], float]:
    """Two servers of ``model`` (0:15, 15:30) started together; return them and the seconds until both are ready."""
    from distconf.tools.serving import ServerProcess, serve_command, wait_all_ready

    begin = time.monotonic()
    servers = [ServerProcess(serve_command(model, "--initial-peers", *peers, "--blocks", span, "--host", "127.0.0.1",
                                           "--dtype", dtype, "--quant", quant, "--dht-prefix", prefix),
                             log_dir / f"{name}-{i}.log", name=f"{name}-{i}", env=env)
               for i, span in enumerate(SPANS)]
    wait_all_ready(servers, begin + START_DEADLINE)
    return servers, time.monotonic() - begin


def load_times(gguf: Path, cache: Path, folder_root: Path) -> tuple[dict[str, float], Any]:
    """In-process ``open_source`` seconds: GGUF warm (cached copy), plain folder; and the source.

    The plain folder (the converted copy without ``dht_prefix``) is written to ``folder_root``.
    """
    from distconf.sources import open_source
    from distconf.tools.real_model import plain_folder

    times: dict[str, float] = {}
    begin = time.perf_counter()
    source = open_source(gguf, cache_dir=cache)
    times["GGUF, warm (cached copy)"] = time.perf_counter() - begin
    folder = plain_folder(source.checkpoint_dir, folder_root / "SmolLM2-135M-Instruct")
    begin = time.perf_counter()
    open_source(folder)
    times["plain folder"] = time.perf_counter() - begin
    return times, source


def run(root: Path, new_tokens: int, rounds: int, threads: int) -> None:
    from distconf.client import AutoDistributedModelForCausalLM
    from distconf.client.swarm import release_dht
    from distconf.dht import start_local_dht, visible_maddrs
    from distconf.tools import real_model as rm
    from distconf.tools.serving import stop_all

    began = time.monotonic()
    gguf = rm.gguf_path()
    server_cache = root / "cache"
    local_cache = server_cache / "gguf"  # the servers' conversion is reused here: one cold conversion per run
    env = {"PYTHONPATH": str(REPO), "DISTCONF_CACHE": str(server_cache), "OMP_NUM_THREADS": str(threads)}
    dht = start_local_dht()
    peers = visible_maddrs(dht)
    servers: dict[str, list[Any]] = {}
    ready_s: dict[str, float] = {}
    clients: list[Any] = []
    try:
        # the servers' own cold conversion first (nothing else running), then the cached copy, then a folder
        cold, ready_s["fp32 from GGUF, cold cache (converts)"] = start_pair(
            gguf, peers, root, "cold", "float32", "none", "bench-real-cold", env)
        stop_all(cold)
        opened, source = load_times(gguf, local_cache, root)
        servers["fp32"], ready_s["fp32 from GGUF, warm cache"] = start_pair(
            gguf, peers, root, "fp32", "float32", "none", "bench-real-fp32", env)
        folder_pair, ready_s["fp32 from plain folder"] = start_pair(
            root / "SmolLM2-135M-Instruct", peers, root, "folder", "float32", "none", "bench-real-folder", env)
        stop_all(folder_pair)  # only its load time is wanted
        for name in ("bf16", "int8", "nf4"):
            dtype, quant, _ = VARIANTS[name]
            servers[name], ready_s[f"{name} from GGUF, warm cache"] = start_pair(
                gguf, peers, root, name, dtype, quant, f"bench-real-{name}", env)

        tokenizer = source.load_tokenizer()
        ids = rm.chat_ids(tokenizer)
        models: dict[str, Any] = {}
        for name, (_, quant, client_dtype) in VARIANTS.items():
            local = rm.local_model(source.checkpoint_dir, client_dtype)
            models[f"local {name}"] = rm.quantize_layers(local, quant)
            remote = AutoDistributedModelForCausalLM.from_pretrained(
                gguf, dht=dht, dtype=client_dtype, dht_prefix=f"bench-real-{name}", gguf_cache_dir=local_cache,
                max_retries=2)
            clients.append(remote)
            models[f"swarm {name}"] = remote
        per_token_ms(models, ids, 4, 1)  # warm every path and every server up
        ms = per_token_ms(models, ids, new_tokens, rounds)
        text = tokenizer(rm.FIXED_TEXT, return_tensors="pt")["input_ids"]
        logits = {name: rm.next_token_logits(model, text) for name, model in models.items()}
        answers = {name: rm.greedy_answer(model, tokenizer)[0] for name, model in models.items()
                   if name.startswith("swarm")}

        base = ms["local fp32"]
        print(f"\n== SmolLM2-135M-Instruct (30 layers, hidden 576) from {gguf.name}: 2 servers (0:15, 15:30) on "
              f"loopback vs local, batch 1, chat prompt of {ids.shape[1]} tokens, {new_tokens} new tokens x "
              f"{rounds} rounds interleaved, {threads} compute thread(s) per process")
        print(f"{'':8}{'local ms/tok':>14}{'swarm ms/tok':>14}{'local/fp32':>12}{'swarm/fp32':>12}{'swarm/local':>13}")
        for name in VARIANTS:
            local_ms, swarm_ms = ms[f"local {name}"], ms[f"swarm {name}"]
            print(f"{name:8}{local_ms:14.2f}{swarm_ms:14.2f}{local_ms / base:11.2f}x{swarm_ms / base:11.2f}x"
                  f"{swarm_ms / local_ms:12.2f}x")
        reference = logits["local fp32"]
        base_ppl = rm.perplexity(reference, text)
        print(f"\nquality on the fixed text ({text.shape[1]} tokens): top-1 agreement with local fp32, perplexity")
        for name in VARIANTS:
            cells = []
            for where in ("local", "swarm"):
                got = logits[f"{where} {name}"]
                ppl = rm.perplexity(got, text)
                cells.append(f"{where} {100 * rm.agreement(reference, got):5.1f} % {ppl:6.2f} ({ppl / base_ppl:.3f}x)")
            print(f"  {name:6}" + "   ".join(cells) + f"   swarm answer: {answers[f'swarm {name}']!r}")
        print("\nload time (s):")
        for label, seconds in opened.items():
            print(f"  {'open_source in this process, ' + label:66}{seconds:8.2f}")
        for label, seconds in ready_s.items():
            print(f"  {'2 servers start-to-ready, ' + label:66}{seconds:8.2f}")
        print("\nRSS per server (MiB): peak (VmHWM), now (after the runs), vs its 15 blocks' exact bytes")
        config = source.config
        for name, pair in servers.items():
            dtype, quant, _ = VARIANTS[name]
            expect = blocks_mib(config, dtype, quant, 15)
            for i, server in enumerate(pair):
                peak, now, mapped, children = rss_mib(server.proc.pid)
                print(f"  {name:5} server {i} ({SPANS[i]:>5}): peak {peak:5.0f}  now {now:5.0f} (mapped checkpoint "
                      f"{mapped:4.0f})  blocks {expect:6.1f}   (DHT/P2P children's peaks {children:4.0f})")
        print(f"\ntotal run {time.monotonic() - began:.0f} s")
    finally:
        for model in clients:
            model.shutdown()
        for pair in servers.values():
            stop_all(pair)
        release_dht(dht)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="compute threads of this process and of every server (default 1: the machine has 2 "
                             "shared cores)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-real-") as tmp:
        run(Path(tmp), args.new_tokens, args.rounds, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
