"""A family file's ``block.adapter`` builds the served block class everywhere blocks are built.

The user's factory lives in a user package trusted through ``DISTCONF_TRUSTED_MODULES``;
`build_block`, sizing and the server loader must all get the class it returns.
"""

from __future__ import annotations

import io
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from blockhelpers import family_config, hf_model, save_checkpoint

from distconf.blocks import block_class_for, build_block, make_block_class
from distconf.blocks.sizing import block_size_bytes, layer_param_counts
from distconf.errors import FamilyValidationError
from distconf.loader import load_family
from distconf.loader.data import builtin_families_dir
from distconf.loader.search import FAMILIES_PATH_ENV
from distconf.loader.spec_types import TRUSTED_MODULES_ENV
from distconf.server.loading import Progress, load_blocks

ADAPTER_MODULE = '''
"""A user block adapter: the default block class, plus a record of every block built."""

from distconf.blocks import make_block_class

BUILT = []
CALLS = []


def tagged_block_class(config_cls):
    CALLS.append(config_cls)
    base = make_block_class(config_cls)

    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        BUILT.append(kwargs.get("layer_idx"))

    return type("TaggedBlock", (base,), {"__module__": __name__, "__init__": __init__})


def not_a_class(config_cls):
    return 42
'''


@pytest.fixture
def user_adapter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_cache):
    """Install the ``myblocks`` package and a user ``llama`` family file whose ``block.adapter`` names it."""
    package = tmp_path / "pkgs" / "myblocks"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(ADAPTER_MODULE), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    monkeypatch.delitem(sys.modules, "myblocks", raising=False)
    monkeypatch.setenv(TRUSTED_MODULES_ENV, "myblocks")

    def write(factory: str) -> None:
        families = tmp_path / "families"
        families.mkdir(exist_ok=True)
        text = (builtin_families_dir() / "llama.yaml").read_text(encoding="utf-8")
        assert "\nblock:\n" in text
        text = text.replace("\nblock:\n", f"\nblock:\n  adapter: myblocks.{factory}\n", 1)
        (families / "llama.yaml").write_text(text, encoding="utf-8")
        monkeypatch.setenv(FAMILIES_PATH_ENV, str(families))

    write("tagged_block_class")
    import myblocks

    yield myblocks, write
    sys.modules.pop("myblocks", None)


def test_build_block_uses_the_family_adapter(user_adapter) -> None:
    myblocks, _ = user_adapter
    config, _, _ = family_config("llama", num_hidden_layers=2)
    cls = block_class_for(config)
    assert cls.__name__ == "TaggedBlock" and cls.__module__ == "myblocks"
    assert cls is type(config).block_class
    assert issubclass(cls, make_block_class(type(config)))
    block = build_block(config, 1)
    assert type(block) is cls and myblocks.BUILT == [1]
    build_block(config, 0)
    assert block_class_for(config) is cls and myblocks.CALLS == [type(config)]  # the factory ran once


def test_sizing_builds_the_user_class(user_adapter) -> None:
    myblocks, _ = user_adapter
    config, _, _ = family_config("llama", num_hidden_layers=3)
    counts = layer_param_counts(config)
    assert myblocks.BUILT == [0, 1, 2]
    default = sum(p.numel() for p in make_block_class(type(config))(config=config, layer_idx=0).parameters())
    assert counts == (default,) * 3
    assert block_size_bytes(config, torch.float32) == int(default * 4 * 1.01)


def test_server_loader_loads_the_user_class(user_adapter, tmp_path: Path) -> None:
    myblocks, _ = user_adapter
    _, hf_cfg, _ = family_config("llama", num_hidden_layers=2)
    save_checkpoint(hf_model(hf_cfg), tmp_path / "model", shards=1)
    config = load_family("llama").from_pretrained(str(tmp_path / "model"), dht_prefix="adapter-test")
    blocks = load_blocks(tmp_path / "model", config, 0, 2, torch.float32, progress=Progress(2, 1, io.StringIO()))
    assert [type(b).__name__ for b in blocks] == ["TaggedBlock", "TaggedBlock"]
    assert all(type(b).__module__ == "myblocks" for b in blocks) and myblocks.BUILT[-2:] == [0, 1]
    hidden = torch.randn(1, 3, hf_cfg.hidden_size)
    out, _ = blocks[0](hidden)
    assert out.shape == hidden.shape and torch.isfinite(out).all()


def test_an_adapter_returning_no_class_is_reported_at_its_field(user_adapter) -> None:
    _, write = user_adapter
    write("not_a_class")
    config, _, _ = family_config("llama")
    with pytest.raises(FamilyValidationError) as info:
        build_block(config, 0)
    assert "block.adapter" in str(info.value) and "myblocks.not_a_class returned 42, not a class" in str(info.value)
