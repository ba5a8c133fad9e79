"""Quantized Linear layers on this CPU: which library to serve int8 and nf4 with.

A decoder-shaped set of Linear layers (q, k, v, o, gate, up, down: what one decoder block
multiplies by) for hidden 576 (SmolLM2-135M: 9 heads / 3 KV heads, intermediate 1536) and
2048 (TinyLlama-1.1B: 32 / 4, intermediate 5632), at 1 and 16 tokens. Side by side in one
run, interleaved rounds (the machine is shared; the median round is reported):

- fp32 and bf16 ``nn.Linear``;
- int8 weight-only: bitsandbytes ``Linear8bitLt`` (Petals 2.x's settings: threshold 6.0,
  no fp16 weights), torchao ``Int8WeightOnlyConfig``, and our own per-output-channel int8
  (``torch._weight_int8pack_mm``, and dequantize-then-matmul);
- nf4 (bitsandbytes' codebook, blocksize 64): bitsandbytes ``Linear4bit`` with and without
  double-quantized statistics (Petals 2.x uses ``compress_statistics=True``), torchao
  ``to_nf4`` + ``linear_nf4``, and our own torch dequantize-then-matmul of bitsandbytes'
  packed data;
- ``distconf``: the path `distconf.blocks.quant.quantize_block` takes.

Quantized layers compute in fp32 (``--compute bf16`` adds bf16 rows). For each: ms per call
of the whole set, ratio to fp32, relative error of the output against fp32, and bytes per
weight parameter measured (every tensor the module holds, its quantization statistics
included, counted once per storage).

Columns: ms per call (median round), its ratio to fp32, the ratio of the fastest rounds ("min x"),
relative error, bytes per weight parameter. A candidate whose library is missing (torchao is not
a project dependency: ``pip install torchao`` to compare it) or that fails on a shape is listed
as FAILED with its reason.

Usage: .venv/bin/python benchmarks/bench_quant.py [--rounds N] [--calls N] [--compute fp32,bf16]
       [--hidden 576,2048] [--threads N]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch import nn  # noqa: E402

SHAPES = {  # hidden: (intermediate, heads, kv heads)
    576: (1536, 9, 3),
    2048: (5632, 32, 4),
}
TOKENS = (1, 16)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def linear_set(hidden: int, seed: int = 0) -> list[nn.Linear]:
    """q, k, v, o, gate, up, down of a gated-MLP decoder block with ``hidden``, fp32, random weights."""
    inter, heads, kv_heads = SHAPES[hidden]
    kv = hidden // heads * kv_heads
    shapes = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden),
              (hidden, inter), (hidden, inter), (inter, hidden)]
    torch.manual_seed(seed)
    layers = []
    for fan_in, fan_out in shapes:
        layer = nn.Linear(fan_in, fan_out, bias=False)
        nn.init.normal_(layer.weight, std=fan_in ** -0.5)
        layers.append(layer.eval().requires_grad_(False))
    return layers


def module_bytes(module: nn.Module) -> int:
    """Bytes of every tensor ``module`` holds (`distconf.blocks.quant.held_bytes`, plus bitsandbytes' int8 state)."""
    from distconf.blocks.quant import held_bytes

    extra = 0
    for m in module.modules():
        state = getattr(m, "state", None)  # bitsandbytes Linear8bitLt moves CB/SCB here at the first call
        for attr in ("SCB",):
            t = getattr(state, attr, None) if state is not None else None
            if isinstance(t, torch.Tensor):
                extra += t.numel() * t.element_size()
        for p in m.parameters(recurse=False):
            t = getattr(p, "SCB", None)
            if isinstance(t, torch.Tensor):
                extra += t.numel() * t.element_size()
    if any(type(t).__name__ != "Tensor" and hasattr(t, "__tensor_flatten__") for t in module.parameters()):
        return sum(_subclass_bytes(t) for t in module.parameters())
    return held_bytes(module) + extra


def _subclass_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor subclass (torchao): its inner tensors."""
    if type(t).__name__ in ("Tensor", "Parameter") or not hasattr(t, "__tensor_flatten__"):
        return t.numel() * t.element_size()
    names, _ = t.__tensor_flatten__()
    return sum(_subclass_bytes(getattr(t, n)) for n in names)


# -- candidates: a function fp32 Linear -> module computing in `compute` dtype -----------------

def make_plain(dtype: torch.dtype) -> Callable[[nn.Linear, torch.dtype], nn.Module]:
    def make(layer: nn.Linear, compute: torch.dtype) -> nn.Module:
        out = nn.Linear(layer.in_features, layer.out_features, bias=False, dtype=dtype)
        out.weight.data.copy_(layer.weight.data)
        return out.eval().requires_grad_(False)
    return make


def bnb_int8(layer: nn.Linear, compute: torch.dtype) -> nn.Module:
    import bitsandbytes as bnb

    out = bnb.nn.Linear8bitLt(layer.in_features, layer.out_features, bias=False, has_fp16_weights=False,
                              threshold=6.0)
    out.weight = bnb.nn.Int8Params(layer.weight.data.to(compute), requires_grad=False, has_fp16_weights=False)
    return out.to("cpu").eval()


def torchao_int8(layer: nn.Linear, compute: torch.dtype) -> nn.Module:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    out = make_plain(compute)(layer, compute)
    quantize_(out, Int8WeightOnlyConfig())
    return out


class OwnInt8(nn.Module):
    """Per-output-channel symmetric int8 weights; ``mode`` 'pack' (torch's int8 CPU kernel), 'pack-bf16' (the
    kernel on activations rounded to bf16) or 'deq' (dequantize, then matmul)."""

    def __init__(self, layer: nn.Linear, compute: torch.dtype, mode: str) -> None:
        super().__init__()
        w = layer.weight.data.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        self.register_buffer("weight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(compute))
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode.startswith("pack"):
            shape, dtype = x.shape, x.dtype
            compute = torch.bfloat16 if self.mode == "pack-bf16" else dtype
            out = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(compute), self.weight,
                                            self.scale.to(compute))
            return out.to(dtype).reshape(*shape[:-1], -1)
        return nn.functional.linear(x, self.weight.to(x.dtype)) * self.scale


def bnb_nf4(compress: bool) -> Callable[[nn.Linear, torch.dtype], nn.Module]:
    def make(layer: nn.Linear, compute: torch.dtype) -> nn.Module:
        import bitsandbytes as bnb

        out = bnb.nn.Linear4bit(layer.in_features, layer.out_features, bias=False, compute_dtype=compute,
                                compress_statistics=compress, quant_type="nf4")
        out.weight = bnb.nn.Params4bit(layer.weight.data.to(compute), requires_grad=False, quant_type="nf4",
                                       blocksize=64, compress_statistics=compress)
        return out.to("cpu").eval()
    return make


class TorchaoNF4(nn.Module):
    """torchao's NF4Tensor (blocksize 64, scalers double-quantized per 256) and ``linear_nf4``."""

    def __init__(self, layer: nn.Linear, compute: torch.dtype) -> None:
        super().__init__()
        from torchao.quantization import to_nf4

        self.weight = nn.Parameter(to_nf4(layer.weight.data.to(compute), 64, 256), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        return linear_nf4(x, self.weight)


class OwnNF4(nn.Module):
    """bitsandbytes' packed nf4 data and fp32 absmax (no double quant), dequantized in torch per call."""

    def __init__(self, layer: nn.Linear, compute: torch.dtype) -> None:
        super().__init__()
        import bitsandbytes.functional as bf

        packed, state = bf.quantize_4bit(layer.weight.data.float(), blocksize=64, quant_type="nf4",
                                         compress_statistics=False)
        self.register_buffer("packed", packed.flatten())
        self.register_buffer("absmax", state.absmax.float())
        self.register_buffer("code", state.code.to(compute))
        self.out_features, self.in_features = layer.out_features, layer.in_features

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        idx = torch.stack((self.packed >> 4, self.packed & 15), dim=1).flatten().long()
        values = self.code[idx].view(-1, 64) * self.absmax.to(dtype)[:, None]
        return values.view(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.dequantize(x.dtype))


def distconf_path(quant: str) -> Callable[[nn.Linear, torch.dtype], nn.Module]:
    def make(layer: nn.Linear, compute: torch.dtype) -> nn.Module:
        from distconf.blocks.quant import quantize_block

        holder = nn.Sequential(make_plain(compute)(layer, compute))
        quantize_block(holder, quant)
        return holder
    return make


CANDIDATES: list[tuple[str, str, Callable[[nn.Linear, torch.dtype], nn.Module]]] = [
    # (quant type, name, factory)
    ("int8", "bitsandbytes Linear8bitLt", bnb_int8),
    ("int8", "torchao Int8WeightOnly", torchao_int8),
    ("int8", "own _weight_int8pack_mm", lambda layer, c: OwnInt8(layer, c, "pack")),
    ("int8", "own dequant+matmul", lambda layer, c: OwnInt8(layer, c, "deq")),
    ("int8", "own pack, bf16 activations", lambda layer, c: OwnInt8(layer, c, "pack-bf16")),
    ("int8", "distconf", distconf_path("int8")),
    ("nf4", "bitsandbytes Linear4bit dq", bnb_nf4(True)),
    ("nf4", "bitsandbytes Linear4bit", bnb_nf4(False)),
    ("nf4", "torchao NF4Tensor", TorchaoNF4),
    ("nf4", "own torch dequant+matmul", OwnNF4),
    ("nf4", "distconf", distconf_path("nf4")),
]


def time_calls(layers: list[nn.Module], tokens: int, dtype: torch.dtype, calls: int) -> float:
    """ms per call of the whole set (each layer on a fresh input of its fan-in)."""
    inputs = [torch.randn(tokens, _FAN_IN[id(m)]).to(dtype) for m in layers]
    with torch.no_grad():
        start = time.perf_counter()
        for _ in range(calls):
            for m, inp in zip(layers, inputs):
                m(inp)
        return (time.perf_counter() - start) / calls * 1e3


_FAN_IN: dict[int, int] = {}


def rel_error(layers: list[nn.Module], ref: list[nn.Linear], tokens: int, dtype: torch.dtype) -> float:
    """Largest relative (Frobenius) error of the set's outputs against fp32."""
    worst = 0.0
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for m, r in zip(layers, ref):
            x = torch.randn(tokens, r.in_features, generator=gen)
            y, y_ref = m(x.to(dtype)).float(), r(x)
            worst = max(worst, ((y - y_ref).norm() / y_ref.norm()).item())
    return worst


def build(factory: Callable, ref: list[nn.Linear], compute: torch.dtype) -> list[nn.Module]:
    layers = [factory(layer, compute) for layer in ref]
    for m, r in zip(layers, ref):
        _FAN_IN[id(m)] = r.in_features
    return layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=0, help="calls per round (default: ~0.3 s per variant)")
    parser.add_argument("--compute", default="fp32", help="compute dtypes of the quantized rows: fp32,bf16")
    parser.add_argument("--hidden", default="576,2048")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    import importlib.metadata as metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    print(f"torch {torch.__version__}, bitsandbytes {version('bitsandbytes')}, torchao {version('torchao')}, "
          f"threads {torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '')}")
    print("load before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    computes = [DTYPES[c] for c in args.compute.split(",")]
    for hidden in (int(h) for h in args.hidden.split(",")):
        ref = linear_set(hidden)
        params = sum(r.weight.numel() for r in ref)
        variants: list[tuple[str, str, torch.dtype, list[nn.Module]]] = [
            ("fp32", "nn.Linear", torch.float32, build(make_plain(torch.float32), ref, torch.float32)),
            ("bf16", "nn.Linear", torch.bfloat16, build(make_plain(torch.bfloat16), ref, torch.bfloat16)),
        ]
        for compute in computes:
            for quant, name, factory in CANDIDATES:
                try:
                    variants.append((quant, name, compute, build(factory, ref, compute)))
                except Exception as exc:  # a candidate that cannot run here is reported, not fatal
                    print(f"  {quant} {name} ({compute}): FAILED {type(exc).__name__}: {exc}")
        for tokens in TOKENS:
            times: dict[int, list[float]] = {i: [] for i in range(len(variants))}
            calls = {}
            for i, (_, _, dtype, layers) in enumerate(variants):
                time_calls(layers, tokens, dtype, 2)  # warm-up
                one = time_calls(layers, tokens, dtype, 3)
                calls[i] = args.calls or max(3, int(300 / max(one, 1e-3)))
            for _ in range(args.rounds):
                for i, (_, _, dtype, layers) in enumerate(variants):
                    times[i].append(time_calls(layers, tokens, dtype, calls[i]))
            base, base_min = statistics.median(times[0]), min(times[0])
            print(f"\nhidden {hidden}, {tokens} token(s), {params / 1e6:.2f} M weight params per set")
            print(f"  {'quant':5} {'candidate':28} {'compute':8} {'ms/call':>8} {'x fp32':>7} {'min x':>6} "
                  f"{'rel err':>8} {'B/param':>8}")
            for i, (quant, name, dtype, layers) in enumerate(variants):
                ms = statistics.median(times[i])
                err = rel_error(layers, ref, tokens, dtype)
                nbytes = sum(module_bytes(m) for m in layers) / params
                print(f"  {quant:5} {name:28} {str(dtype).removeprefix('torch.'):8} {ms:8.3f} {ms / base:7.2f} "
                      f"{min(times[i]) / base_min:6.2f} {err:8.4f} {nbytes:8.4f}")
    print("\nload after:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
