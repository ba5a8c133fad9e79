"""Memory per served block: measured RSS against `distconf plan`'s figure, for fp32, bf16, int8 and nf4.

For each setting a fresh subprocess opens the real model (SmolLM2-135M-Instruct, from its
GGUF through `distconf.sources`; the converted copy is reused from the cache), loads one
block to pay one-time costs (imports, kernels), then loads blocks 1..15 through the
server's own `distconf.server.loading.load_blocks` and runs one token through each (so a
memory-mapped fp32 block's pages are resident, as in serving). It prints the growth of the
process's resident memory (anonymous + file-backed) against the planner's bytes for those
15 blocks (`distconf.blocks.sizing.block_size_bytes`, what `distconf plan` and the server
size with), as a ratio. Prints only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

SETTINGS = [("float32", None), ("bfloat16", None), ("float32", "int8"), ("float32", "nf4")]

CHILD = r"""
import ctypes, gc, json, sys
import torch
torch.set_num_threads(1)
from distconf.blocks.sizing import block_size_bytes
from distconf.server.loading import load_blocks
from distconf.sources import open_source
from distconf.tools.real_model import gguf_path

dtype, quant = getattr(torch, sys.argv[1]), (None if sys.argv[2] == "none" else sys.argv[2])

def resident_mib():
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return sum(int(fields[k].split()[0]) for k in ("RssAnon", "RssFile")) / 1024

def touch(blocks):
    with torch.inference_mode():
        for block in blocks:
            block(torch.zeros(1, 1, source.config.hidden_size, dtype=dtype))

source = open_source(gguf_path())
touch(load_blocks(source.checkpoint_dir, source.config, 0, 1, dtype, quant=quant))
before = resident_mib()
blocks = load_blocks(source.checkpoint_dir, source.config, 1, 16, dtype, quant=quant)
touch(blocks)
after = resident_mib()
plan = sum(block_size_bytes(source.config, dtype, quant, layer_idx=i) for i in range(1, 16)) / 2**20
print(json.dumps({"measured": after - before, "plan": plan}))
"""


def main() -> int:
    """Print the table."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(f"{'setting':<16}{'measured MiB/block':>20}{'plan MiB/block':>16}{'measured/plan':>15}")
    for dtype, quant in SETTINGS:
        out = subprocess.run([sys.executable, "-c", CHILD, dtype, quant or "none"], capture_output=True, text=True,
                             env=env, timeout=600, check=True).stdout
        row = json.loads(out.strip().splitlines()[-1])
        label = f"{dtype}/{quant or 'none'}"
        ratio = row["measured"] / row["plan"]
        print(f"{label:<16}{row['measured'] / 15:>20.2f}{row['plan'] / 15:>16.2f}{ratio:>14.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
