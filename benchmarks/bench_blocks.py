"""Benchmark of blocks built from family files, side by side in one run.

The model is a shipped preset (``--preset``; default: the preset whose bf16 block is
closest to 400 MB), so nothing here is specific to a family.

(a) Time and peak memory to load one block of a locally generated multi-shard checkpoint
    (>= 2 GB, bf16, the preset's layer shapes) with `distconf.blocks.weights.load_block_weights`
    (as stored, and cast to fp32), against `safetensors.torch.load_file` of the shard holding
    most of the block, and against per-tensor `safe_open(...).get_tensor` (memory-mapped).
    Each variant runs in its own subprocess; its anonymous RSS and its file-backed RSS (pages
    of memory-mapped files: reclaimable, the kernel can drop and re-read them) are sampled
    from outside the process every ~0.5 ms, and the exact total high-water mark (VmHWM) is read
    at the end. Figures are shown against the bytes loaded and, for time (wall clock and
    process CPU time), against distconf.
(b) `block_size_bytes` for the largest presets (meta build): milliseconds per call and
    RSS growth over many calls.
(c) Forward time of the adapted block against calling the HF decoder layer directly on the
    same input and the same weight tensors, with the arguments a transformers model passes
    (prefill of 32 tokens, and a one-token decode step after 32 cached).

Usage: .venv/bin/python benchmarks/bench_blocks.py [--preset HUB_ID] [--keep DIR] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LAYER = 3
TARGET_BLOCK_BYTES = 400e6
MIN_CHECKPOINT_BYTES = 2.1e9


def pick_preset() -> str:
    """The shipped preset whose bf16 block is closest to 400 MB (any family)."""
    from distconf import load_preset
    from distconf.blocks.sizing import block_size_bytes
    from distconf.loader.presets import list_presets

    sizes = {}
    for hub_id in list_presets():
        try:
            sizes[hub_id] = block_size_bytes(load_preset(hub_id))
        except Exception:  # presets of families that are not built in are skipped
            continue
    return min(sizes, key=lambda h: abs(sizes[h] - TARGET_BLOCK_BYTES))


def bench_config(preset: str, layers: int | None = None):
    """The preset's config, optionally with fewer/more layers."""
    from distconf import load_preset

    config = load_preset(preset)
    if layers is not None:
        config.num_hidden_layers = layers
    return config


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _status(pid: int | str = "self") -> dict[str, int]:
    """Anonymous, file-backed and shared-memory RSS and the total high-water mark, in bytes."""
    keys = {"RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem", "VmHWM:": "hwm"}
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            key = line.split(None, 1)[0] if line.strip() else ""
            if key in keys:
                out[keys[key]] = int(line.split()[1]) * 1024
    if len(out) != len(keys):
        raise RuntimeError(f"/proc/{pid}/status lacks {set(keys.values()) - set(out)}")
    return out


# --------------------------------------------------------------------------- (a)

def make_checkpoint(directory: Path, preset: str, shard_bytes: int = 1 << 30) -> dict:
    """Write a bf16 checkpoint of the preset's layer shapes (>= 2 GB), in several shards."""
    import math

    import torch
    from safetensors.torch import save_file

    from distconf.blocks import build_block
    from distconf.blocks.sizing import block_param_count

    per_layer = block_param_count(bench_config(preset)) * 2
    layers = max(LAYER + 2, math.ceil(MIN_CHECKPOINT_BYTES / per_layer))
    config = bench_config(preset, layers)
    prefix = type(config).family_spec.block.prefix
    tensors: list[tuple[str, tuple[int, ...]]] = []
    for i in range(layers):
        tensors += [(f"{prefix}.{i}.{name}", tuple(t.shape))
                    for name, t in build_block(config, i).state_dict().items()]
    weight_map, shard, size, files = {}, {}, 0, []

    def flush() -> None:
        nonlocal shard, size
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(directory / name))
            files.append(name)
            weight_map.update(dict.fromkeys(shard, name))
            shard, size = {}, 0

    generator = torch.Generator().manual_seed(0)
    for name, shape in tensors:
        tensor = (torch.randn(shape, generator=generator, dtype=torch.float32) * 0.02).to(torch.bfloat16)
        nbytes = tensor.numel() * 2
        if size and size + nbytes > shard_bytes:
            flush()
        shard[name] = tensor
        size += nbytes
    flush()
    total = sum(os.path.getsize(directory / f) for f in files)
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    layer_files = sorted({weight_map[n] for n in weight_map if n.startswith(f"{prefix}.{LAYER}.")})
    return {"preset": preset, "layers": layers, "files": len(files), "total_bytes": total,
            "layer_files": layer_files}


MODES = ("distconf", "distconf_f32", "safe_open", "load_file")
RUNS = 5


def _child(mode: str, directory: str) -> None:
    """Run one loading variant; print a JSON line when it starts and one with its results."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    from distconf.blocks import build_block
    from distconf.blocks.weights import checkpoint_files, layer_keys, load_block_weights

    info = json.loads((Path(directory) / "bench-info.json").read_text())
    config = bench_config(info["preset"], info["layers"])
    files = checkpoint_files(directory)
    _, names = layer_keys(files, config, LAYER)
    # Warm the code paths (imports, a meta build) without reading any tensor data.
    build_block(config, LAYER)
    import transformers.core_model_loading  # noqa: F401 - used by the loader's key conversion

    baseline = _status()
    print(json.dumps({"phase": "start", "baseline": baseline}), flush=True)
    start, cpu_start = time.perf_counter(), time.process_time()
    if mode in ("distconf", "distconf_f32"):
        dtype = torch.bfloat16 if mode == "distconf" else torch.float32
        state = load_block_weights(directory, config, LAYER, dtype=dtype)
    elif mode == "load_file":  # the whole shard holding most of the block
        biggest = max({files[n] for n in names}, key=lambda f: sum(files[n] == f for n in names))
        state = load_file(str(biggest))
    elif mode == "safe_open":
        state = {}
        for path in sorted({files[n] for n in names}):
            with safe_open(str(path), framework="pt") as f:
                for n in names:
                    if files[n] == path:
                        state[n] = f.get_tensor(n)
    else:
        raise SystemExit(f"unknown mode {mode}")
    for tensor in state.values():  # use the data (a server copies it to its device): maps every page
        for chunk in tensor.reshape(-1).split(1 << 22):
            chunk.max()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    loaded = sum(t.numel() * t.element_size() for t in state.values())
    print(json.dumps({"phase": "end", "mode": mode, "seconds": seconds, "cpu": cpu, "baseline": baseline,
                      "end": _status(), "loaded_bytes": loaded, "tensors": len(state)}), flush=True)


def _messages(lines) -> list[dict]:
    """The JSON messages among a child's output lines (anything else it prints is skipped)."""
    out = []
    while not lines.empty():
        line = lines.get().strip()
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def _run_child(mode: str, directory: Path) -> dict:
    """One child run; its anonymous and file-backed RSS are sampled from here while it loads."""
    import queue
    import threading

    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen([sys.executable, __file__, "--child", mode, str(directory)],
                                stdout=subprocess.PIPE, stderr=errors, text=True)
        lines: queue.Queue = queue.Queue()
        reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True)
        reader.start()
        peak = {"anon": 0, "file": 0}
        started, result = False, None
        deadline = time.monotonic() + 600
        while result is None and proc.poll() is None and time.monotonic() < deadline:
            for message in _messages(lines):
                started = started or message.get("phase") == "start"
                result = message if message.get("phase") == "end" else result
            if started and result is None:
                with contextlib.suppress(OSError, RuntimeError):
                    now = _status(proc.pid)
                    peak = {k: max(peak[k], now[k]) for k in peak}
            time.sleep(0.0005)
        if proc.poll() is None and result is None:
            proc.kill()
        proc.wait(timeout=60)
        reader.join(timeout=10)
        result = result or next((m for m in _messages(lines) if m.get("phase") == "end"), None)
        if result is None:
            errors.seek(0)
            raise RuntimeError(f"{mode} run failed: {errors.read()[-2000:]}")
    base, end_status = result["baseline"], result["end"]
    peak = {k: max(peak[k], end_status[k]) for k in peak}
    return {**result, "extra_anon": peak["anon"] - base["anon"], "extra_file": peak["file"] - base["file"],
            "extra_peak": end_status["hwm"] - (base["anon"] + base["file"] + base["shmem"])}


def bench_loading(directory: Path, preset: str) -> dict:
    from distconf.blocks.sizing import block_param_count

    info_path = directory / "bench-info.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else None
    if info is None or info["preset"] != preset:
        for old in directory.glob("model*"):
            old.unlink()
        info = make_checkpoint(directory, preset)
        info_path.write_text(json.dumps(info))
    block_bytes = block_param_count(bench_config(preset, info["layers"]), LAYER) * 2
    results = {}
    for mode in MODES:
        runs = [_run_child(mode, directory) for _ in range(RUNS)]  # the first run also warms the page cache
        best = min(runs, key=lambda r: r["seconds"])
        results[mode] = {"seconds": best["seconds"], "cpu": min(r["cpu"] for r in runs),
                         "loaded_bytes": best["loaded_bytes"],
                         **{key: max(r[key] for r in runs) for key in ("extra_anon", "extra_file", "extra_peak")}}
    return {"checkpoint": info, "block_bytes": block_bytes, "results": results}


# --------------------------------------------------------------------------- (b)

def bench_sizing(repeats: int) -> list[dict]:
    import gc

    from distconf import load_preset
    from distconf.blocks import sizing
    from distconf.blocks.sizing import block_size_bytes
    from distconf.errors import FamilyNotFoundError
    from distconf.loader.presets import list_presets

    rows = []
    for hub_id in list_presets():
        try:
            config = load_preset(hub_id)
        except (FamilyNotFoundError, LookupError, ValueError):
            continue
        block_size_bytes(config)  # imports
        gc.collect()
        before = _rss()
        sizing._counts.clear()  # cold: every layer built once on meta
        start = time.perf_counter()
        block_size_bytes(config)
        cold = time.perf_counter() - start
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            size = block_size_bytes(config)
            times.append(time.perf_counter() - start)
        gc.collect()
        rows.append({"preset": hub_id, "bf16_bytes": size, "layers": config.num_hidden_layers,
                     "cold_ms": cold * 1000, "ms_median": statistics.median(times) * 1000,
                     "rss_growth_bytes": _rss() - before})
    rows.sort(key=lambda r: -r["bf16_bytes"])
    return rows


# --------------------------------------------------------------------------- (c)

def _paired(reference, candidate, repeats: int) -> tuple[float, float]:
    """Median CPU seconds of two callables, timed alternately.

    One torch thread and the calling thread's CPU time (not wall time): other processes on
    a shared machine then barely disturb the comparison.
    """
    for _ in range(3):
        reference()
        candidate()
    ref, cand = [], []
    for i in range(repeats):
        order = ((reference, ref), (candidate, cand)) if i % 2 == 0 else ((candidate, cand), (reference, ref))
        for fn, samples in order:  # alternate which one runs first
            start = time.thread_time()
            fn()
            samples.append(time.thread_time() - start)
    return statistics.median(ref), statistics.median(cand)


def bench_forward(preset: str, repeats: int) -> dict:
    import torch
    from transformers import DynamicCache

    from distconf.blocks import build_block, constructor_kwargs

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = bench_config(preset, 1)
    block = build_block(config, 0, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    layer_class = type(block).layer_class  # the family's decoder layer, without the adapter
    with torch.device("meta"):
        layer = layer_class(**constructor_kwargs(config, 0))
    layer.load_state_dict(block.state_dict(), assign=True)  # the very same weight tensors: no layout bias
    layer.eval()
    hidden = config.hidden_size
    out: dict = {"preset": preset, "layer": layer_class.__name__}
    with torch.no_grad():
        x = torch.randn(1, 32, hidden)
        kwargs = block.layer_kwargs(x, 0, None)  # what the model computes once per forward

        def first(o):
            return o[0] if isinstance(o, (tuple, list)) else o

        torch.testing.assert_close(block(x)[0], first(layer(x, **kwargs)), atol=1e-5, rtol=0)
        hf_time, ours = _paired(lambda: layer(x, **kwargs), lambda: block(x), repeats)
        out["prefill_32"] = {"hf_ms": hf_time * 1000, "adapter_ms": ours * 1000, "overhead": ours / hf_time - 1}

        _, past = block(x, use_cache=True)
        cache = DynamicCache(config=config)
        layer(x, **block.layer_kwargs(x, 0, cache))
        step = torch.randn(1, 1, hidden)
        step_kwargs = block.layer_kwargs(step, 32, cache)

        def hf_step() -> None:
            layer(step, **step_kwargs)
            cache.crop(-1)

        hf_time, ours = _paired(hf_step, lambda: block(step, layer_past=past, use_cache=True), repeats * 4)
        out["decode_after_32"] = {"hf_ms": hf_time * 1000, "adapter_ms": ours * 1000, "overhead": ours / hf_time - 1}
    return out


# --------------------------------------------------------------------------- output

MB = 1 / 2**20


def print_loading(a: dict) -> None:
    """Part (a): each variant's time and memory, as ratios to distconf's time and to the bytes loaded."""
    ckpt = a["checkpoint"]
    print(f"(a) loading block {LAYER} of a {ckpt['files']}-shard, {ckpt['layers']}-layer checkpoint of "
          f"{ckpt['preset']} shapes ({ckpt['total_bytes'] / 1e9:.2f} GB, bf16; block in "
          f"{len(ckpt['layer_files'])} shard(s)); block = {a['block_bytes'] * MB:.1f} MB")
    ref, ref_cpu = a["results"]["distconf"]["seconds"], a["results"]["distconf"]["cpu"]
    print(f"    {'variant':13s} {'time':>8s} {'/distconf':>9s}   {'CPU':>7s} {'/distconf':>9s}   {'peak anon':>9s} "
          f"{'/loaded':>7s}   {'file-backed':>11s} {'/loaded':>7s}   {'VmHWM':>8s} {'/loaded':>7s}   loaded")
    for mode, r in a["results"].items():
        loaded = r["loaded_bytes"]
        print(f"    {mode:13s} {r['seconds'] * 1000:6.0f} ms {r['seconds'] / ref:8.2f}x   "
              f"{r['cpu'] * 1000:4.0f} ms {r['cpu'] / ref_cpu:8.2f}x   "
              f"{r['extra_anon'] * MB:6.0f} MB {r['extra_anon'] / loaded:6.2f}x   "
              f"{r['extra_file'] * MB:8.0f} MB {r['extra_file'] / loaded:6.2f}x   "
              f"{r['extra_peak'] * MB:5.0f} MB {r['extra_peak'] / loaded:6.2f}x   {loaded * MB:.0f} MB")
    print(f"    (best of {RUNS} runs each; time: wall clock, CPU: process CPU time, steadier on a busy machine; "
          "anon: private memory the process holds;\n     file-backed: pages of memory-mapped checkpoint files, "
          "reclaimable by the kernel; VmHWM: exact peak of both)")


def print_sizing(rows: list[dict], repeats: int) -> None:
    """Part (b)."""
    print("(b) block_size_bytes (meta build of every layer on first use, then cached), largest presets first")
    for r in rows:
        print(f"    {r['preset']:36s} {r['bf16_bytes'] / 2**30:6.2f} GiB  first {r['cold_ms']:6.1f} ms "
              f"({r['layers']} layers)  then {r['ms_median']:5.2f} ms   RSS growth "
              f"{r['rss_growth_bytes'] / 1024:.0f} KiB over {repeats + 1} calls")


def print_forward(c: dict) -> None:
    """Part (c)."""
    print(f"(c) forward: adapted block vs {c['layer']} called directly ({c['preset']} shapes, fp32, 1 thread, "
          "median CPU time, same weights)")
    for name, r in c.items():
        if not isinstance(r, dict):
            continue
        print(f"    {name:18s} HF {r['hf_ms']:8.2f} ms   adapter {r['adapter_ms']:8.2f} ms   "
              f"overhead {r['overhead'] * 100:+.1f} %")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=2, metavar=("MODE", "DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--preset", help="hub id of a shipped preset (default: block closest to 400 MB)")
    parser.add_argument("--keep", type=Path, help="generate/reuse the checkpoint in this folder")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--parts", default="abc", help="which parts to run, e.g. 'a' (default: abc)")
    args = parser.parse_args()
    if args.child:
        _child(*args.child)
        return 0
    import logging

    logging.disable(logging.WARNING)
    import torch

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    repeats = 5 if args.quick else 20
    preset = args.preset or pick_preset()
    report: dict = {}
    if "a" in args.parts and args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        report["a"] = bench_loading(args.keep, preset)
    elif "a" in args.parts:
        with tempfile.TemporaryDirectory(prefix="distconf-bench-") as tmp:
            report["a"] = bench_loading(Path(tmp), preset)
    if "b" in args.parts:
        report["b"] = bench_sizing(repeats)
    if "c" in args.parts:
        report["c"] = bench_forward(preset, repeats)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    if "a" in report:
        print_loading(report["a"])
    if "b" in report:
        print_sizing(report["b"], repeats)
    if "c" in report:
        print_forward(report["c"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
