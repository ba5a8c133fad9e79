"""Where a model's weights come from: a Hugging Face folder, a GGUF file, or the local Hugging Face cache.

`open_source(name)` returns one `ModelSource` for any of them: the family's distributed
config (``dht_prefix`` resolved), the tokenizer, and a local safetensors folder that
`distconf.blocks.weights` reads block by block. Anything that cannot be served raises one
`ModelSourceError` naming the source and the reason. Modules, each one job::

    base (ModelSource, the checks; `distconf.errors.ModelSourceError`) -> folder, gguf_header, gguf_cache, gguf_convert
      -> gguf -> hub -> resolve (open_source)
"""

from distconf.errors import ModelSourceError
from distconf.sources.base import ModelSource
from distconf.sources.folder import open_folder
from distconf.sources.gguf import open_gguf
from distconf.sources.hub import open_hub
from distconf.sources.resolve import open_source

__all__ = ["ModelSource", "ModelSourceError", "open_folder", "open_gguf", "open_hub", "open_source"]
