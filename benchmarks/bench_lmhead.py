"""Benchmark of the client's LM head on CPU in bfloat16: chunked against plain, side by side in one run.

The head is a 128k-token vocabulary x hidden size 4096 bfloat16 weight (``--vocab``,
``--hidden``), built without a float32 temporary. For hidden states of shape [1, 1, hidden]
(one generation step) and [1, 128, hidden] (a prompt) it runs:

(a) plain   -- `distconf.client.lmhead.LMHead` with ``use_chunked_forward=False``: one
               bfloat16 ``F.linear``;
(b) chunked -- the same head with ``use_chunked_forward=True``: ``--step`` vocabulary rows at
               a time in bfloat16, written into one preallocated output;
(c) Petals 2.x's way -- every chunk of the weight upcast to float32, float32 hidden states and
               float32 logits (written here inline as the reference).

Each (variant, shape) runs in a fresh subprocess, under ``torch.no_grad()`` as in generation:
one warm-up call, then ``--repeats`` timed calls (median and best reported). Peak extra memory
is the process's peak resident set size during those calls minus its resident set size just
before them (the weight and hidden states already allocated, and the matmul libraries already
initialised by a bf16 and an fp32 ``F.linear`` of the same hidden states on 256 rows, the same
for every variant): the peak is Linux's VmHWM after resetting it through /proc/self/clear_refs,
or, where that is not allowed, the ``getrusage(RUSAGE_SELF).ru_maxrss`` high-water mark
(building the weight has no transient, so that baseline is the same). torch's CPU allocator is
invisible to tracemalloc, hence the RSS.
The subprocesses run with ``MALLOC_MMAP_THRESHOLD_`` fixed at 128 KiB, so glibc returns every
freed large block to the system at once instead of keeping it for reuse: the RSS then follows
the live tensors, and a block freed by the warm-up cannot hide the next call's peak.

Usage: .venv/bin/python benchmarks/bench_lmhead.py [--vocab N] [--hidden N] [--step N] [--repeats N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VARIANTS = ("plain", "chunked", "petals2")
LABELS = {"plain": "plain (bf16)", "chunked": "chunked (bf16)", "petals2": "Petals 2.x way (fp32 chunks)"}
MB = 1e6
MMAP_THRESHOLD = 128 * 1024


def _status() -> dict[str, int]:
    """Current and peak resident set size of this process, in bytes."""
    text = Path("/proc/self/status").read_text(encoding="ascii")
    found = dict(re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", text, re.MULTILINE))
    return {key: int(value) * 1024 for key, value in found.items()}


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False if not allowed here."""
    try:
        Path("/proc/self/clear_refs").write_text("5", encoding="ascii")
    except OSError:
        return False
    return True


def petals2_forward(hidden_states, weight, step: int):
    """Petals 2.x's chunked head: float32 hidden states, each weight chunk upcast to float32, float32 logits."""
    import torch
    import torch.nn.functional as F

    hidden = hidden_states.float()
    out = torch.empty(*hidden.shape[:-1], weight.shape[0], dtype=torch.float32)
    for i in range(0, weight.shape[0], step):
        out[..., i:i + step] = F.linear(hidden, weight[i:i + step].float())
    return out


def _child(variant: str, seq: int, vocab: int, hidden_size: int, step: int, repeats: int) -> dict:
    """Run one variant on one shape in this (fresh) process; return its figures."""
    import torch

    from distconf.client.lmhead import LMHead
    from distconf.loader.mixins import LMHeadConfig

    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):  # initialise the matmul kernels for this shape outside the figures
        rows = torch.ones(256, hidden_size, dtype=dtype)
        torch.nn.functional.linear(torch.ones(1, seq, hidden_size, dtype=dtype), rows)
    weight = torch.empty(vocab, hidden_size, dtype=torch.bfloat16).normal_(0, 0.02)
    hidden = torch.randn(1, seq, hidden_size).to(torch.bfloat16)
    config = LMHeadConfig(use_chunked_forward=variant == "chunked", chunked_forward_step=step)
    linear = torch.nn.Linear(hidden_size, vocab, bias=False, device="meta")  # no allocation; weight set next
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    head = LMHead(linear, config)
    if variant == "petals2":
        def run():
            return petals2_forward(hidden, weight, step)
    else:
        def run():
            return head(hidden)

    reset = _reset_peak()
    before = _status()["VmRSS"]
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    with torch.no_grad():
        out = run()  # warm-up
        del out
        for _ in range(repeats):
            start = time.perf_counter()
            out = run()
            times.append(time.perf_counter() - start)
            dtype, out_bytes = str(out.dtype).removeprefix("torch."), out.numel() * out.element_size()
            del out
        peak = _status()["VmHWM"] if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        extra = peak - (before if reset else maxrss_before)
        out = run()
        head.config.use_chunked_forward = False
        diff = (out.float() - head(hidden).float()).abs().max().item()  # against plain, after measuring
    return {"variant": variant, "seq": seq, "median_s": statistics.median(times), "best_s": min(times),
            "peak_extra": extra, "out_dtype": dtype, "out_bytes": out_bytes, "max_diff": diff,
            "memory_method": "VmHWM" if reset else "ru_maxrss", "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__}


def run_all(args: argparse.Namespace) -> list[dict]:
    """Every (shape, variant) in its own subprocess, one after the other."""
    results = []
    for seq in args.seqs:
        for variant in VARIANTS:
            cmd = [sys.executable, __file__, "--child", variant, str(seq), "--vocab", str(args.vocab),
                   "--hidden", str(args.hidden), "--step", str(args.step), "--repeats", str(args.repeats)]
            env = {**os.environ, "PYTHONPATH": str(REPO), "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"{variant} seq={seq} failed:\n{proc.stderr[-2000:]}")
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return results


def print_table(args: argparse.Namespace, results: list[dict], seconds: float) -> None:
    """The side-by-side table and the ratios to plain."""
    weight_mb = args.vocab * args.hidden * 2 / MB
    first = results[0]
    print(f"LM head, vocabulary {args.vocab} x hidden {args.hidden}, bfloat16 weight ({weight_mb:.0f} MB), CPU, "
          f"{first['threads']} torch threads ({first['cpu_capability']} kernels, torch {first['torch']}), "
          f"chunk {args.step} rows, torch.no_grad()")
    print(f"{'hidden states':15s} {'variant':29s} {'median':>9s} {'best':>9s} {'peak extra':>11s} "
          f"{'logits':>15s} {'max|diff|':>9s}  {'time/plain':>10s} {'mem/plain':>9s}")
    for seq in args.seqs:
        rows = {r["variant"]: r for r in results if r["seq"] == seq}
        plain = rows["plain"]
        for variant in VARIANTS:
            r = rows[variant]
            mem_ratio = r["peak_extra"] / plain["peak_extra"] if plain["peak_extra"] > 0 else float("nan")
            print(f"{[1, seq, args.hidden]!s:15s} {LABELS[variant]:29s} {r['median_s'] * 1e3:6.1f} ms "
                  f"{r['best_s'] * 1e3:6.1f} ms {r['peak_extra'] / MB:8.1f} MB "
                  f"{r['out_dtype']:>8s} {r['out_bytes'] / MB:4.1f}MB {r['max_diff']:9.2e}  "
                  f"{r['median_s'] / plain['median_s']:9.2f}x {mem_ratio:8.2f}x")
    method = results[0]["memory_method"]
    reset = " reset via /proc/self/clear_refs" if method == "VmHWM" else ""
    print(f"time: median (and best) of {args.repeats} calls after one warm-up; each (variant, shape) in a fresh "
          "subprocess.")
    print(f"peak extra: peak RSS during the calls ({method}{reset}) minus RSS just before them; glibc is told to "
          f"unmap freed large blocks at once\n  (MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}) so RSS follows the live "
          "tensors; it includes the logits kept alive (column 'logits').")
    print(f"max|diff|: largest absolute difference of the logits from the plain head's.  Whole run: {seconds:.0f} s.")


def main() -> int:
    """Parse the options, run every variant, print the table (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "SEQ"), help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=128256, help="vocabulary rows (default: 128256)")
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size (default: 4096)")
    parser.add_argument("--step", type=int, default=16384, help="vocabulary rows per chunk (default: 16384)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per variant after a warm-up (default: 3)")
    parser.add_argument("--seqs", type=lambda s: [int(x) for x in s.split(",")], default=[1, 128],
                        help="comma-separated sequence lengths of the hidden states (default: 1,128)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    if min(args.vocab, args.hidden, args.step, args.repeats) <= 0:
        parser.error("--vocab, --hidden, --step and --repeats must be > 0")
    if args.child:
        variant, seq = args.child
        result = _child(variant, int(seq), args.vocab, args.hidden, args.step, args.repeats)
        print(json.dumps(result), flush=True)
        return 0
    start = time.perf_counter()
    results = run_all(args)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_table(args, results, time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
