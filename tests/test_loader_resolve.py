"""Dotted paths named in a family file resolve through one loader function whose errors point at the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from blockhelpers import family_config

from distconf.blocks import build_block
from distconf.errors import FamilyValidationError
from distconf.loader import load_family
from distconf.loader.data import builtin_families_dir
from distconf.loader.search import FAMILIES_PATH_ENV
from distconf.loader.synthesis import resolve_object

ROTARY = "transformers.models.llama.modeling_llama.LlamaRotaryEmbedding"


def test_resolve_object_imports_objects_and_classes() -> None:
    source = load_family("llama").family_source
    from transformers.models.llama import modeling_llama

    assert resolve_object(source, ("block", "position", "rotary_class"), ROTARY) is modeling_llama.LlamaRotaryEmbedding
    function = "transformers.models.llama.modeling_llama.rotate_half"
    assert resolve_object(source, ("x",), function) is modeling_llama.rotate_half
    with pytest.raises(FamilyValidationError) as info:
        resolve_object(source, ("block", "attention_class"), function, want_class=True)
    assert "block.attention_class" in str(info.value) and "is not a class" in str(info.value)


def test_a_missing_rotary_class_is_reported_at_its_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         fresh_cache) -> None:
    """The block adapter resolves ``block.position.rotary_class`` lazily; its error names that field."""
    text = (builtin_families_dir() / "llama.yaml").read_text(encoding="utf-8")
    assert ROTARY in text
    families = tmp_path / "families"
    families.mkdir()
    (families / "llama.yaml").write_text(text.replace(ROTARY, ROTARY + "Missing"), encoding="utf-8")
    monkeypatch.setenv(FAMILIES_PATH_ENV, str(families))
    config, _, _ = family_config("llama")
    with pytest.raises(FamilyValidationError) as info:
        build_block(config, 0)
    message = str(info.value)
    assert "block.position.rotary_class" in message and "LlamaRotaryEmbeddingMissing" in message
