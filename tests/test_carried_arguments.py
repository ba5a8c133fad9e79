"""``block.call.carried_arguments`` and ``kv_cache.indexer_types_field``: hy_v4's shared sparse-attention layers.

hy_v4's ``indexer_types`` gives each layer its own indexer (``full``) or has it reuse the top-k key
indices of the layer before (``shared``, handed on as ``prev_topk_indices``). A block is handed hidden
states only: it passes every key's index instead, which is the model's value while there are at most
``index_topk`` keys (longer steps are refused), and only ``full`` layers keep the indexer's key cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sweephelpers import draft_and_check

from distconf.cli import main

CARRIED = ("  call:\n    carried_arguments:\n      prev_topk_indices:\n        stand_in: all_keys\n"
           "        exact_up_to: index_topk\n")
INDEXER = "  indexer_layer_kinds:\n  - full\n  indexer_types_field: indexer_types\n"


@pytest.fixture(scope="module")
def drafted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hy_v4")
    code, text = draft_and_check("hy_v4", folder)
    assert code == 0, text  # the sweep's line: hy_v4 drafts and checks
    return folder / "out" / "hy_v4.yaml"


def test_the_drafter_writes_the_stand_in_and_the_indexer_layers(drafted: Path) -> None:
    text = drafted.read_text()
    assert CARRIED in text and INDEXER in text
    assert "TODO review" not in text  # the carried value's notes are answered


def test_a_step_past_the_bound_is_refused(drafted: Path, tmp_path: Path) -> None:
    import torch
    from blockhelpers import hf_model, save_checkpoint

    from distconf.blocks.weights import load_block
    from distconf.loader import load_family

    cls = load_family(drafted)
    values = {**cls.family_spec.tiny_config, "index_topk": 4}
    config = cls(**values)
    save_checkpoint(hf_model(cls.hf_config_class(**values)), tmp_path / "ckpt")
    block = load_block(tmp_path / "ckpt", config, 2, dtype=torch.float32)  # a shared layer
    hidden = torch.randn(1, 4, config.wire_width)
    out, past = block(hidden, use_cache=True)
    assert out.shape == hidden.shape
    with pytest.raises(ValueError, match=r"5 tokens: .* only up to 4 keys"):
        block(hidden[:, :1], layer_past=past, use_cache=True)


def test_only_full_layers_keep_the_indexer_cache(drafted: Path) -> None:
    from distconf.blocks.kvcache import kv_geometry
    from distconf.loader import load_family

    cls = load_family(drafted)
    config = cls(**cls.family_spec.tiny_config)
    assert config.indexer_types == ["full", "full", "shared"]
    assert [kv_geometry(config, i).indexer_head_dim for i in range(3)] == [64, 64, 0]


@pytest.mark.parametrize(("name", "edit", "where"), [
    ("bound", lambda t: t.replace("exact_up_to: index_topk", "exact_up_to: max_position_embeddings"),
     "block.call.carried_arguments.prev_topk_indices.exact_up_to: with max_position_embeddings=3"),
    ("keyword", lambda t: t.replace("      prev_topk_indices:\n", "      topk_before:\n"),
     "block.call.carried_arguments.topk_before: HYV4Model hands its layers no value"),
    ("indexer", lambda t: t.replace("  indexer_types_field: indexer_types\n", ""),
     "kv_cache.indexer_layer_kinds names 'full', which block.mask.layer_kinds does not map"),
])
def test_a_wrong_knob_fails_at_its_place(drafted: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         name: str, edit: object, where: str) -> None:
    family = f"hy_v4_{name}"
    path = tmp_path / f"{family}.yaml"
    path.write_text(edit(drafted.read_text()).replace("family: hy_v4\n", f"family: {family}\n"))  # type: ignore[operator]
    assert main(["check", str(path)]) == 1
    captured = capsys.readouterr()
    assert where in captured.out + captured.err
