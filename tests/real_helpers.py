"""The real model for tests: its GGUF converted once into a cache every real-model test and run shares.

The cache is ``$DISTCONF_CACHE/gguf`` when that is set, else a folder in pytest's own cache
(``.pytest_cache/d/distconf-real-model/gguf``): the ~40 s conversion happens once per checkout,
not once per test run, and nothing is written outside the checkout.
"""

from __future__ import annotations

import contextlib
import os
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
    """Where the real model's GGUF is converted to, for this test run."""
    if os.environ.get("DISTCONF_CACHE"):
        return Path(os.environ["DISTCONF_CACHE"]).expanduser() / "gguf"
    # pytest's cache folder, also when its cache plugin is off (``-p no:cacheprovider``)
    return Path(config.rootpath) / ".pytest_cache" / "d" / "distconf-real-model" / "gguf"


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
