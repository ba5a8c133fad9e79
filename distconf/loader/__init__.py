"""The family core: family files, their validation, and the synthesized config classes.

The modules form one chain, each importing only the ones before it::

    formula, yamlsafe, files, naming -> spec_types -> spec_block -> spec -> mixins
      -> source (read + validate one file, with locations) -> search (the search path)
      -> presets -> synthesis -> registry (class cache, pickle home) -> auto -> schema

Nothing here imports torch or transformers until a class is synthesized.
"""

from distconf.loader.registry import get_family_spec, load_family
from distconf.loader.search import list_families, validate_paths
from distconf.loader.source import FamilySource, read_family_file

__all__ = ["FamilySource", "get_family_spec", "list_families", "load_family", "read_family_file", "validate_paths"]
