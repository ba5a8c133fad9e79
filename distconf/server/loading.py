"""Sizing, placing, loading and measuring a server's blocks (shared by ``distconf serve`` and the demo).

- `plan_span`: blocks a server takes (the planner, or the caller's choice) and where
  (the placement rule over the swarm it sees);
- `load_blocks`: loads real weights block by block with `distconf.blocks.weights.load_block`,
  reporting progress (blocks and bytes) through a `Progress`;
- `measure_throughput`: the speeds a server announces, in Petals 2.x's units (tokens/s per block).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from distconf.loader.config_protocol import DistributedConfig
from distconf.loader.naming import config_num_blocks

__all__ = ["Progress", "SpanPlan", "Throughput", "load_blocks", "measure_throughput", "plan_span"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpanPlan:
    """Where a server sits: blocks ``start..end-1``, and the capacity plan behind it."""

    start: int
    end: int
    plan: Any  # distconf.planning.ServerPlan

    @property
    def num_blocks(self) -> int:
        """Blocks served."""
        return self.end - self.start


def plan_span(config: DistributedConfig, memory: int | str, dtype: str, *, dht: Any = None,
              blocks: tuple[int, int] | None = None, num_blocks: int | None = None,
              attn_cache_tokens: int | None = None, quant: str | None = None, device_type: str = "cpu",
              timeout: float = 10.0, adapter_bytes_per_block: int = 0) -> SpanPlan:
    """Choose the span: ``blocks`` as given; else ``num_blocks`` (or as many as ``memory`` holds)
    placed with `choose_blocks` over the swarm ``dht`` sees (an empty swarm without a DHT).

    The capacity plan is `distconf.planning.plan_server`'s with the same ``quant`` and device
    as ``distconf plan --quant``, so a plan and a server agree on the bytes of a block.
    """
    from distconf.dht import find_block_servers
    from distconf.planning import choose_blocks, plan_server

    plan = plan_server(config, memory, dtype, quant, attn_cache_tokens=attn_cache_tokens, device_type=device_type,
                       adapter_bytes_per_block=adapter_bytes_per_block)
    layers = config_num_blocks(config)
    if blocks is not None:
        start, end = blocks
        if not 0 <= start < end <= layers:
            raise ValueError(f"--blocks {start}:{end} is not inside the model's {layers} blocks")
        return SpanPlan(start, end, plan)
    n = num_blocks if num_blocks is not None else plan.num_blocks
    if n < 1:
        raise ValueError(f"not one block fits in {plan.memory_bytes} bytes (block {plan.block_bytes} B + cache "
                         f"{plan.cache_bytes_per_block} B + autograd reserve {plan.autograd_reserve_bytes} B)")
    swarm = find_block_servers(dht, config, timeout=timeout) if dht is not None else None
    start, end = choose_blocks(config, min(n, layers), swarm)
    if swarm is not None:
        logger.info("swarm throughputs %s -> blocks %d..%d", [round(t, 1) for t in swarm.throughputs()],
                    start, end - 1)
    return SpanPlan(start, end, plan)


class Progress:
    """Loading progress: a line rewritten in place on a terminal, log records otherwise."""

    def __init__(self, total_blocks: int, total_bytes: int, stream: IO[str] | None = None) -> None:
        self.total_blocks, self.total_bytes = total_blocks, total_bytes
        self.stream = sys.stderr if stream is None else stream
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.blocks = self.bytes = 0
        self.t0 = time.monotonic()

    def advance(self, nbytes: int) -> None:
        """One more block of ``nbytes`` loaded."""
        self.blocks += 1
        self.bytes += nbytes
        text = (f"loading blocks: {self.blocks}/{self.total_blocks}, {self.bytes / 2**20:.1f}/"
                f"{self.total_bytes / 2**20:.1f} MiB, {time.monotonic() - self.t0:.1f} s")
        if self.tty:
            end = "\n" if self.blocks >= self.total_blocks else ""
            self.stream.write("\r" + text + end)
            self.stream.flush()
        else:
            logger.info(text)


def load_blocks(model_dir: str | Path, config: DistributedConfig, start: int, end: int, dtype: Any, *,
                progress: Progress | None = None, on_block: Callable[[int], None] | None = None,
                quant: str | None = None, device: Any = None) -> list[Any]:
    """Load blocks ``start..end-1`` from ``model_dir`` (one block's memory at a time), frozen, in eval mode.

    Each block is loaded in ``dtype``, moved to ``device`` (default cpu) and then quantized with
    `distconf.blocks.quant.quantize_block` (``quant``: None/"none", "int8", "nf4"); progress
    counts the bytes each block holds once quantized (`held_bytes`).
    """
    from distconf.blocks.device import move_block
    from distconf.blocks.quant import held_bytes, quantize_block
    from distconf.blocks.sizing import block_size_bytes
    from distconf.blocks.weights import load_block

    device_type = getattr(device, "type", None) or str(device or "cpu").split(":")[0]
    if progress is None:
        total = sum(block_size_bytes(config, dtype, quant, layer_idx=i, device_type=device_type)
                    for i in range(start, end))
        progress = Progress(end - start, total)
    blocks = []
    for i in range(start, end):
        block = load_block(model_dir, config, i, dtype=dtype)
        if device is not None:
            block = move_block(block, device)
        block.requires_grad_(False)
        block.eval()
        quantize_block(block, quant)
        blocks.append(block)
        progress.advance(held_bytes(block))
        if on_block is not None:
            on_block(i)
    return blocks


@dataclass(frozen=True)
class Throughput:
    """Announced speeds, in Petals 2.x's units: tokens per second of ONE block.

    ``throughput`` (the record's main figure, used for placement and routing) is
    ``forward_rps / ((num_blocks + 1) / 2)``: an average request enters the span at a
    uniformly random block and runs to its end, as Petals 2.x assumes.
    """

    inference_rps: float
    forward_rps: float
    throughput: float


def _median_seconds(fn: Callable[[], Any], steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return max(sorted(times)[len(times) // 2], 1e-9)


def measure_throughput(blocks: list[Any], hidden_size: int, dtype: Any, *, steps: int = 5,
                       forward_tokens: int = 128) -> Throughput:
    """Measure the loaded ``blocks``: one-token steps with a KV cache through all of them
    (``inference_rps``), and a ``forward_tokens``-token forward of the first block
    (``forward_rps``); checks that the outputs are finite. ``hidden_size``: the blocks' wire width
    (``config.wire_width``)."""
    import torch

    from distconf.blocks.device import block_device

    device = block_device(blocks[0])
    g = torch.Generator().manual_seed(0)
    token = torch.randn(1, 1, hidden_size, generator=g).to(device, dtype)
    chunk = torch.randn(1, forward_tokens, hidden_size, generator=g).to(device, dtype)
    outputs = []

    def inference() -> None:
        h = token
        for block in blocks:
            h, _ = block(h, layer_past=prefix[block], use_cache=True)
        outputs.append(h)

    with torch.inference_mode():
        prefix = {block: block(token, use_cache=True)[1] for block in blocks}  # warm-up, and a 1-token cache
        per_token = _median_seconds(inference, steps) / len(blocks)
        per_chunk = _median_seconds(lambda: outputs.append(blocks[0](chunk)[0]), max(2, steps // 2))
    if not all(torch.isfinite(h).all() for h in outputs):
        raise RuntimeError("the loaded blocks produced non-finite outputs")
    forward_rps = forward_tokens / per_chunk
    return Throughput(inference_rps=1.0 / per_token, forward_rps=forward_rps,
                      throughput=forward_rps / ((len(blocks) + 1) / 2))
