"""What per-block weight digests cost a server at start: hashing next to loading and measuring the blocks.

On the real model (SmolLM2-135M-Instruct's GGUF, converted once into the tests' cache), for
each weights form (float32, bfloat16, float32+int8) one run does what ``distconf serve`` does
at start, in this process: `load_blocks` for every block, `block_digests` (on by default,
``--no-block-digests`` turns it off), and `measure_throughput`. Prints the seconds of each
stage and the digests' share of the three. The first form hashes pages of the mapped
checkpoint for the first time, so it also shows the cost on a cold cache (of this process).
Prints only; no assertions.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    """Print one line per form: load, digest and measure seconds, and the digests' share."""
    from distconf.server.integrity import block_digests, weights_form
    from distconf.server.loading import load_blocks, measure_throughput
    from distconf.sources import open_source
    from distconf.tools.real_model import gguf_path

    cache = Path(os.environ.get("DISTCONF_CACHE", REPO / ".pytest_cache/d/distconf-real-model")) / "gguf"
    source = open_source(gguf_path(), cache_dir=cache)
    config = source.config
    n = int(config.num_hidden_layers)
    print(f"{gguf_path().name}: {n} blocks; load average {os.getloadavg()[0]:.2f}")
    for dtype, quant in ((torch.float32, None), (torch.bfloat16, None), (torch.float32, "int8")):
        t0 = time.perf_counter()
        blocks = load_blocks(source.checkpoint_dir, config, 0, n, dtype, quant=quant)
        t1 = time.perf_counter()
        digests = block_digests(blocks)
        t2 = time.perf_counter()
        measure_throughput(blocks, config.hidden_size, dtype)
        t3 = time.perf_counter()
        load, digest, measure = t1 - t0, t2 - t1, t3 - t2
        print(f"{weights_form(dtype, quant):14s} load {load:6.2f} s  digests {digest:5.2f} s ({len(digests)})  "
              f"measure {measure:5.2f} s  digests / (load + digests + measure) = "
              f"{digest / (load + digest + measure):.2f}", flush=True)
        del blocks


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
