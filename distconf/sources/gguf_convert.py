"""Read a GGUF file through transformers' GGUF support and write it as a plain safetensors folder.

The one home of transformers' GGUF API here: ``from_pretrained(folder, gguf_file=name)``
dequantizes every tensor (it needs the ``gguf`` and ``accelerate`` packages). A model loaded
so refuses ``save_pretrained`` (its config carries a GGUF ``quantization_config``), so its
state dict is moved into a fresh model of the same class built, on the meta device, from the
same config without ``quantization_config``; that one saves a normal folder.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from distconf.errors import ModelSourceError
from distconf.sources.gguf_compat import shared_gguf_reads

__all__ = ["load_gguf_model", "load_gguf_tokenizer", "write_checkpoint", "convert_gguf"]

logger = logging.getLogger(__name__)

GGUF_PACKAGES = "serving a GGUF file needs the 'gguf' and 'accelerate' packages (pip install gguf accelerate)"


def _brief(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_gguf_model(file: Path, name: str) -> Any:
    """The causal LM in ``file``, dequantized to float32 (``ModelSourceError`` if transformers cannot read it)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32,
                                                    local_files_only=True)
    except ImportError as exc:
        raise ModelSourceError(name, f"{GGUF_PACKAGES}; {_brief(exc)}") from None
    except Exception as exc:  # transformers' GGUF path raises ValueError, KeyError, NotImplementedError, ...
        raise ModelSourceError(name, f"transformers cannot read this GGUF file: {_brief(exc)}") from None


def load_gguf_tokenizer(file: Path) -> Any | None:
    """The tokenizer stored in ``file``, or None (logged) when it holds none transformers can read."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name, local_files_only=True)
    except Exception as exc:  # a GGUF without (or with an unusual) tokenizer is still servable
        logger.warning("%s: no tokenizer read from the GGUF file (%s)", file, _brief(exc))
        return None


def write_checkpoint(model: Any, folder: Path) -> None:
    """Save ``model``'s weights and config (without ``quantization_config``) as safetensors in ``folder``."""
    import torch

    values = model.config.to_dict()
    values.pop("quantization_config", None)
    config = type(model.config).from_dict(values)
    config.dtype = torch.float32
    with torch.device("meta"):
        fresh = type(model)(config)
    fresh.load_state_dict(model.state_dict(), strict=True, assign=True)  # shares the tensors: no copy
    fresh.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)


def convert_gguf(file: Path, folder: Path, name: str, check_config: Any = None) -> None:
    """Dequantize ``file`` and write it (and its tokenizer) into ``folder``, logging each step.

    ``check_config(config)`` (optional) runs on the loaded config before anything is
    written: a model no family serves fails there.
    """
    size_mb = file.stat().st_size / 2**20
    logger.info("converting GGUF %s (%.0f MB) into %s; done once, later opens reuse it", file, size_mb, folder)
    start = time.monotonic()
    with shared_gguf_reads():  # the three reads below parse the file once
        model = load_gguf_model(file, name)
        if check_config is not None:
            check_config(model.config)
        logger.info("%s: read and dequantized in %.1f s", file.name, time.monotonic() - start)
        step = time.monotonic()
        write_checkpoint(model, folder)
        del model
        written = sum(p.stat().st_size for p in folder.iterdir() if p.is_file()) / 2**20
        logger.info("%s: %.0f MB of safetensors written in %.1f s", file.name, written, time.monotonic() - step)
        step = time.monotonic()
        tokenizer = load_gguf_tokenizer(file)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
            logger.info("%s: tokenizer saved in %.1f s", file.name, time.monotonic() - step)
        logger.info("%s: converted in %.1f s", file.name, time.monotonic() - start)
