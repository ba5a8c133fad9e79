"""``distconf check``: prove a family file on a tiny real model.

For each variant of the family's ``tiny_config`` (a dict of config values; an optional
``variants`` list holds dicts applied on top of the rest, one model each), the check runs
these steps, one module each:

1. `reference` — build the Hugging Face model (float32, random weights) from the family's
   HF config class and save it as a sharded safetensors checkpoint in a temporary folder;
2. `layout` — check that ``block.prefix`` selects exactly the tensors of each layer, that
   the model's layer there is a ``block.layer_class``, then build and load every block
   through the family metadata only and check that ``block.attention_class`` occurs in it
   and is the module the KV cache is handed to;
3. `runs` — run the blocks in sequence and compare with the HF model's per-layer hidden
   states: full sequence, token by token with the KV cache, and in multi-token steps after
   a prefix;
4. `sizes` — compare the cache each block really holds with ``kv_cache_bytes_per_token``
   and each loaded block's size with ``block_size_bytes``;
5. `failures` — any mismatch becomes a `CheckFailure` located in the family file and
   naming the field to fix.

Once per family, `kinds` lists the layer kinds of the real model (its presets, else the
tiny config at full depth) and fails at ``tiny_config`` naming those no variant runs.

`run` ties the steps together (`check_family`).
"""

from distconf.tools.checker.failures import CheckFailure
from distconf.tools.checker.reference import tiny_variants
from distconf.tools.checker.result import TOLERANCE, CheckResult
from distconf.tools.checker.run import check_family

__all__ = ["CheckResult", "CheckFailure", "check_family", "tiny_variants", "TOLERANCE"]
