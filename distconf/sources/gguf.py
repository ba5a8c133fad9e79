"""A ``.gguf`` file (or a folder holding exactly one), served from a safetensors copy converted once.

`open_gguf` reads the file's header (fast, no tensor read) to refuse at once what
transformers cannot read (an unknown architecture, a tensor type gguf cannot dequantize),
then finds or makes the converted copy in the cache (`distconf.sources.gguf_cache`) and
opens it like any folder. The DHT prefix is derived from the file's name (``Model.Q4_1.gguf``
-> ``Model-Q4_1`` -> the family's rule): the dequantized weights are not the original
model's, so they do not join the original model's swarm.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from distconf.errors import ModelSourceError
from distconf.sources.base import ModelSource, family_class_for, open_checkpoint
from distconf.sources.gguf_cache import FORMAT_VERSION, MANIFEST, cache_key, cache_root, entry_name, publish_once
from distconf.sources.gguf_convert import GGUF_PACKAGES, convert_gguf
from distconf.sources.gguf_header import GGUFHeader, GGUFHeaderError, read_gguf_header

__all__ = ["find_gguf", "open_gguf", "unreadable_tensor_types"]

logger = logging.getLogger(__name__)


def find_gguf(path: Path, name: str) -> Path:
    """The ``.gguf`` file ``path`` names: the file itself, or the only one in the folder ``path``."""
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.suffix == ".gguf" and p.is_file())
        if len(found) != 1:
            listed = ", ".join(p.name for p in found[:5]) or "none"
            raise ModelSourceError(name, f"the folder {path} must hold exactly one .gguf file; it holds "
                                         f"{len(found)} ({listed}): name the file")
        return found[0]
    if not path.is_file():
        raise ModelSourceError(name, f"{path} is not a file or a folder")
    if path.suffix != ".gguf":
        raise ModelSourceError(name, f"{path} is not a .gguf file")
    return path


def unreadable_tensor_types(type_ids: Iterable[int]) -> list[str]:
    """Names of the GGML tensor types among ``type_ids`` that gguf cannot dequantize (so transformers cannot)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    bad = []
    for type_id in sorted(set(type_ids)):
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            bad.append(f"type {type_id} (unknown)")
            continue
        try:
            dequantize(np.zeros(GGML_QUANT_SIZES[qtype][1], dtype=np.uint8), qtype)  # one block of zeros
        except NotImplementedError:
            bad.append(qtype.name)
        except Exception:  # any other failure on a zero block: let transformers judge the real data
            pass
    return bad


def _check_header(name: str, header: GGUFHeader) -> None:
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:  # transformers' own check runs at load time
        GGUF_SUPPORTED_ARCHITECTURES = None
    arch = header.architecture
    if arch is None:
        raise ModelSourceError(name, "unknown architecture: the GGUF header has no general.architecture")
    supported = GGUF_SUPPORTED_ARCHITECTURES
    # transformers renames a few GGUF architecture names (``-`` to ``_``, ``moe`` suffixes, ...) before its check
    candidates = {arch, arch.replace("-", "_"), arch.replace("moe", "_moe"), arch.replace("encoder", "")}
    if supported is not None and not candidates & set(supported):
        raise ModelSourceError(name, f"unsupported architecture: transformers cannot read GGUF architecture "
                                     f"{arch[:80]!r}")
    try:
        bad = unreadable_tensor_types(header.tensor_types)
    except ImportError:
        raise ModelSourceError(name, GGUF_PACKAGES) from None
    if bad:
        raise ModelSourceError(name, f"unsupported GGUF tensor type(s) {', '.join(bad)}: transformers "
                                     "(through gguf) cannot dequantize them")


def _squashed(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


def family_for_architecture(name: str, architecture: str) -> type:
    """The family serving a GGUF of ``architecture`` (its header's ``general.architecture``): the one whose
    ``model_type`` is that name up to ``-`` and ``_``, or which lists it in ``gguf_architectures``; else
    `ModelSourceError` (the same one line as after a conversion)."""
    from distconf.loader import list_families, load_family

    wanted = _squashed(architecture)
    for family in list_families():
        try:
            spec = load_family(family).family_spec
        except (ValueError, LookupError):  # an invalid user family serves nothing; `distconf validate` says why
            continue
        if wanted in {_squashed(spec.model_type), *map(_squashed, spec.gguf_architectures)}:
            return family_class_for(name, spec.model_type)
    return family_class_for(name, architecture)


def open_gguf(path: str | Path, *, dht_prefix: str | None = None, cache_dir: str | os.PathLike[str] | None = None,
              name: str | None = None) -> ModelSource:
    """Open a GGUF file (or a folder holding one), converting it into the cache on first use.

    ``cache_dir`` is the folder converted copies go into (default `cache_root`);
    ``dht_prefix`` overrides the prefix derived from the file's name.
    """
    shown = name or str(path)
    file = find_gguf(Path(path), shown)
    try:
        header = read_gguf_header(file)
    except GGUFHeaderError as exc:
        raise ModelSourceError(shown, f"not a readable GGUF file: {exc}") from None
    except OSError as exc:
        raise ModelSourceError(shown, f"cannot read {file}: {exc}") from None
    root = cache_root(cache_dir)
    key = cache_key(file, header.header_bytes)
    entry = entry_name(file, key)
    if not (root / entry / MANIFEST).is_file():
        _check_header(shown, header)
        family_for_architecture(shown, header.architecture or "")  # none: said before a conversion of minutes

    def check_config(config: Any) -> None:
        family_class_for(shown, str(config.model_type))

    stat = file.stat()
    manifest = {"format": FORMAT_VERSION, "gguf": str(file.resolve()), "size": stat.st_size,
                "mtime_ns": stat.st_mtime_ns, "key": key, "general.name": header.metadata.get("general.name")}
    folder, converted = publish_once(root, entry, lambda tmp: convert_gguf(file, tmp, shown, check_config), manifest)
    if not converted:
        logger.info("%s: using the converted copy %s", shown, folder)
    return open_checkpoint(shown, "gguf", file, folder, dht_prefix=dht_prefix,
                           derive_from=file.stem.replace(".", "-"))
