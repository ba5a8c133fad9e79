"""The architecture sweep's steps for one model type, for tests pinning what the sweep found.

As `benchmarks/sweep_architectures.py` does: a transformers config class's defaults written to a
config.json, drafted with ``distconf new``, proved with ``distconf check`` (in process).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from distconf.cli import main


def new_from_defaults(model_type: str, folder: Path, family: str | None = None) -> int:
    """``distconf new`` from ``model_type``'s defaults into ``folder / "out"``; its exit code. ``family``: the
    family's name (default: the sweep's, derived from the model type; another avoids a clash with a test that
    loads that family in the same process)."""
    from transformers import AutoConfig

    from distconf.loader.registry import clear_cache

    clear_cache()  # each `distconf new` is its own process: a draft of the same family from another test is not a clash
    AutoConfig.for_model(model_type).save_pretrained(folder / "config")
    family = family or re.sub(r"[^a-z0-9_]", "_", model_type.lower())  # as the sweep names it
    return main(["new", family, "--from-config", str(folder / "config"), "--out", str(folder / "out") + "/"])


def draft_and_check(model_type: str, folder: Path) -> tuple[int, str]:
    """``distconf new`` from ``model_type``'s defaults, then ``distconf check`` of the draft: (its code, the draft)."""
    assert new_from_defaults(model_type, folder) == 0
    (draft,) = (folder / "out").glob("*.yaml")
    return main(["check", str(draft)]), draft.read_text()


def new_fails(model_type: str, folder: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """``distconf new`` from ``model_type``'s defaults fails; its one line of stderr."""
    assert new_from_defaults(model_type, folder) == 1
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("distconf new:")]
    assert len(lines) == 1 and "Traceback" not in err and "drafter bug" not in err, err
    return lines[0]


def drafted_tiny_blocks(model_type: str, folder: Path, pick: Any = None,
                        check: bool = True) -> tuple[Any, Any, list[Any], Path]:
    """``model_type``'s defaults drafted and checked (asserted; ``check=False``: drafted only), then its tiny config
    (the first variant ``pick`` accepts, default the first) as (distributed config, HF model, loaded float32 blocks,
    the draft's path)."""
    import torch
    from blockhelpers import hf_model, save_checkpoint

    from distconf.blocks.weights import load_block
    from distconf.loader import load_family
    from distconf.loader.naming import config_num_blocks
    from distconf.tools.checker import tiny_variants

    if check:
        code, text = draft_and_check(model_type, folder)
        assert code == 0, text
    else:
        assert new_from_defaults(model_type, folder) == 0
    path = next((folder / "out").glob("*.yaml"))
    cls = load_family(path)
    values = next(v for _, v in tiny_variants(cls.family_spec.tiny_config) if pick is None or pick(v))
    config = cls(**values)
    model = hf_model(cls.hf_config_class(**values))
    save_checkpoint(model, folder / "ckpt")
    blocks = [load_block(folder / "ckpt", config, i, dtype=torch.float32) for i in range(config_num_blocks(config))]
    return config, model, blocks, path


def drafted_fixture(model_type: str) -> Any:
    """A module-scoped fixture: ``distconf new`` + ``distconf check`` of ``model_type``'s defaults, as (check's exit
    code, the draft's path); the family registry is emptied after, so later tests load the built-in families."""

    @pytest.fixture(scope="module")
    def drafted(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
        from distconf.loader.registry import clear_cache

        folder = tmp_path_factory.mktemp(model_type)
        code, _ = draft_and_check(model_type, folder)
        clear_cache()
        (draft,) = (folder / "out").glob("*.yaml")
        return code, draft

    return drafted
