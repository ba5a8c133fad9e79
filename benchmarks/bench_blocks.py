"""Benchmark of blocks built from family files (issue 3), side by side in one run.

The model is a shipped preset (``--preset``; default: the preset whose bf16 block is
closest to 400 MB), so nothing here is specific to a family.

(a) Peak RSS and time to load one block of a locally generated multi-shard checkpoint
    (>= 2 GB, bf16, the preset's layer shapes) with `distconf.weights.load_block_weights`,
    against the block's own size, against `safetensors.torch.load_file` of the shard
    holding it, and against per-tensor `safe_open(...).get_tensor` (memory-mapped). Each
    variant runs in its own subprocess so its peak RSS is measured alone.
(b) `block_size_bytes` for the largest presets (meta build): milliseconds per call and
    RSS growth over many calls.
(c) Forward time of the adapted block against calling the HF decoder layer directly on the
    same input and the same weight tensors, with the arguments a transformers model passes
    (prefill of 32 tokens, and a one-token decode step after 32 cached).

Usage: .venv/bin/python benchmarks/bench_blocks.py [--preset HUB_ID] [--keep DIR] [--quick] [--json]
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LAYER = 3
TARGET_BLOCK_BYTES = 400e6
MIN_CHECKPOINT_BYTES = 2.1e9


def pick_preset() -> str:
    """The shipped preset whose bf16 block is closest to 400 MB (any family)."""
    from distconf import load_preset
    from distconf.blocks.sizing import block_size_bytes
    from distconf.family.presets import list_presets

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


def _peak_rss() -> int:
    """High-water RSS of this process image (VmHWM: unlike ru_maxrss, not inherited across exec)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


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


def _child(mode: str, directory: str) -> None:
    """Run one loading variant; print a JSON line with time, baseline and peak RSS."""
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

    baseline = _rss()
    start = time.perf_counter()
    if mode == "distconf":
        state = load_block_weights(directory, config, LAYER, dtype=torch.bfloat16)
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
    seconds = time.perf_counter() - start
    loaded = sum(t.numel() * t.element_size() for t in state.values())
    print(json.dumps({"mode": mode, "seconds": seconds, "baseline": baseline, "peak": _peak_rss(),
                      "loaded_bytes": loaded, "tensors": len(state)}))


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
    for mode in ("distconf", "safe_open", "load_file"):
        runs = []
        for _ in range(3):  # first run also warms the page cache
            out = subprocess.run([sys.executable, __file__, "--child", mode, str(directory)],
                                 check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            runs.append(json.loads(out))
        best = min(runs, key=lambda r: r["seconds"])
        extra = max(r["peak"] - r["baseline"] for r in runs)
        results[mode] = {"seconds": best["seconds"], "extra_peak_bytes": extra,
                         "loaded_bytes": best["loaded_bytes"], "ratio_to_block": extra / block_bytes}
    return {"checkpoint": info, "block_bytes": block_bytes, "results": results}


# --------------------------------------------------------------------------- (b)

def bench_sizing(repeats: int) -> list[dict]:
    import gc

    from distconf import load_preset
    from distconf.blocks import sizing
    from distconf.blocks.sizing import block_size_bytes
    from distconf.errors import FamilyNotFoundError
    from distconf.family.presets import list_presets

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=2, metavar=("MODE", "DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--preset", help="hub id of a shipped preset (default: block closest to 400 MB)")
    parser.add_argument("--keep", type=Path, help="generate/reuse the checkpoint in this folder")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
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
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        report["a"] = bench_loading(args.keep, preset)
    else:
        with tempfile.TemporaryDirectory(prefix="distconf-bench-") as tmp:
            report["a"] = bench_loading(Path(tmp), preset)
    report["b"] = bench_sizing(repeats)
    report["c"] = bench_forward(preset, repeats)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    mb = 1 / 2**20
    a = report["a"]
    ckpt = a["checkpoint"]
    print(f"(a) loading block {LAYER} of a {ckpt['files']}-shard, {ckpt['layers']}-layer checkpoint of "
          f"{ckpt['preset']} shapes ({ckpt['total_bytes'] / 1e9:.2f} GB, bf16; block in "
          f"{len(ckpt['layer_files'])} shard(s)); block = {a['block_bytes'] * mb:.1f} MB")
    for mode, r in a["results"].items():
        print(f"    {mode:10s} {r['seconds'] * 1000:8.0f} ms   extra peak RSS {r['extra_peak_bytes'] * mb:8.1f} MB"
              f"   = {r['ratio_to_block']:.2f} x block   (loaded {r['loaded_bytes'] * mb:.0f} MB)")
    print("(b) block_size_bytes (meta build of every layer on first use, then cached), largest presets first")
    for r in report["b"]:
        print(f"    {r['preset']:36s} {r['bf16_bytes'] / 2**30:6.2f} GiB  first {r['cold_ms']:6.1f} ms "
              f"({r['layers']} layers)  then {r['ms_median']:5.2f} ms   RSS growth "
              f"{r['rss_growth_bytes'] / 1024:.0f} KiB over {repeats + 1} calls")
    c = report["c"]
    print(f"(c) forward: adapted block vs {c['layer']} called directly ({c['preset']} shapes, fp32, 1 thread, "
          "median CPU time, same weights)")
    for name, r in c.items():
        if not isinstance(r, dict):
            continue
        print(f"    {name:18s} HF {r['hf_ms']:8.2f} ms   adapter {r['adapter_ms']:8.2f} ms   "
              f"overhead {r['overhead'] * 100:+.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
