"""What consumes a config: served blocks, their weights, their KV cache and their size.

Built from a synthesized config class alone (the family file's ``block`` and
``kv_cache`` sections), with no family name in code. Importing this package imports no
torch; building a block does.
"""

from distconf.blocks.adapter import BlockAdapter, prepare_config
from distconf.blocks.build import block_class_for, build_block, constructor_kwargs, make_block_class
from distconf.blocks.kvcache import BlockKVCache, KVGeometry, kv_geometry
from distconf.blocks.sizing import block_param_count, block_size_bytes, bytes_per_value, kv_cache_bytes_per_token
from distconf.blocks.weights import BlockWeightsError, load_block, load_block_weights

__all__ = [
    "BlockAdapter", "BlockKVCache", "BlockWeightsError", "KVGeometry", "block_class_for", "block_param_count",
    "block_size_bytes", "build_block", "bytes_per_value", "constructor_kwargs", "kv_cache_bytes_per_token",
    "kv_geometry", "load_block", "load_block_weights", "make_block_class", "prepare_config",
]
