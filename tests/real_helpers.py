"""The real model for tests: its GGUF converted once into a cache every real-model test and run shares.

The cache is distconf's own (`distconf.sources.gguf_cache.cache_root`: ``$DISTCONF_CACHE/gguf``, else
``~/.cache/distconf/gguf``), the one ``make demo`` and every user's run fill: a conversion (40 s for SmolLM2, over
three minutes for Gemma 3 270M here) happens once per machine, not once per checkout or virtualenv (its key is the
file's contents, not its path or mtime).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from distconf.sources import ModelSource, open_source
from distconf.tools.real_model import gguf_path

QUALITY = {"bf16": (0.91, 1.03), "int8": (0.91, 1.04), "nf4": (0.68, 1.30)}
"""Least top-1 agreement with fp32 and largest perplexity ratio to fp32 on `FIXED_TEXT`, per dtype/quant.

Measured (tests/test_real_model.py's table): bf16 96.4 % / 0.998, int8 96.4 % / 1.002, nf4 73.4 % / 1.224;
the bounds are 5 points of agreement and a few percent of perplexity below them.
"""


def real_cache_dir(config: pytest.Config) -> Path:
    """Where the real models' GGUF files are converted to: distconf's cache, as for a user."""
    from distconf.sources.gguf_cache import cache_root

    return cache_root()


def open_real_source(config: pytest.Config) -> ModelSource:
    """The real model's GGUF as a `ModelSource` (converted on first use)."""
    return open_source(gguf_path(), cache_dir=real_cache_dir(config))


@contextlib.contextmanager
def local_sessions(model: Any, cache_class: type) -> Iterator[Any]:
    """``model`` whose ``inference_session(max_length)`` opens a ``cache_class()`` for the duration."""
    model.inference_session = lambda max_length: cache_class()
    try:
        yield model
    finally:
        del model.inference_session
