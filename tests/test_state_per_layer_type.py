"""State and K/V geometry that differ per layer type, as the architecture sweep found them on inkling_text.

Its sliding layers cache 16 KV heads, its full layers 8 (``swa_num_key_value_heads`` and
``num_key_value_heads``), and the two short-convolution windows on the keys and values are sized
by them. The shrink keeps the two fields apart in the tiny config (their ratio, 4 vs 2), so the
drafter sees the difference and writes ``kv_cache.layer_overrides`` and ``state.layer_overrides``;
the drafted formulas, evaluated on the real defaults, give the real model's sizes per layer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers  # noqa: F401  (first imported outside capsys: its log handler keeps the session's stderr)
from blockhelpers import hf_model, save_checkpoint
from sessionhelpers import session_with_beam_and_restart
from sweephelpers import drafted_fixture

from distconf.blocks.kvcache import kv_geometry
from distconf.blocks.sizing import state_bytes_per_sequence
from distconf.blocks.state import state_geometry
from distconf.blocks.weights import load_block
from distconf.loader import load_family
from distconf.loader.registry import clear_cache
from distconf.loader.spec_state import StateSpec

pytestmark = pytest.mark.slow  # each test drafts a model type from its defaults: seconds on its own


drafted = drafted_fixture("inkling_text")
"""``distconf new`` + ``distconf check`` of inkling_text's defaults: (check's exit code, the draft)."""


def test_inkling_defaults_draft_and_check(drafted: tuple[int, Path]) -> None:
    """before: the tiny config gave both KV-heads fields 2, and the draft was refused in one line."""
    code, draft = drafted
    text = draft.read_text()
    assert code == 0
    assert "layer_overrides:\n    hybrid:\n      num_kv_heads: num_key_value_heads" in text
    assert "swa_num_key_value_heads: 4" in text and "num_key_value_heads: 2" in text  # the ratio 16 : 8 kept


def _real_layer(config: object, layer_idx: int) -> object:
    """The real model's decoder layer ``layer_idx`` (on the meta device: shapes only)."""
    from transformers.models.inkling.modeling_inkling import InklingDecoderLayer

    with torch.device("meta"):
        return InklingDecoderLayer(config, layer_idx)


def test_drafted_formulas_give_the_real_sizes_per_layer_type(drafted: tuple[int, Path]) -> None:
    """On the real defaults: 16 KV heads and 2048-channel K/V conv windows on sliding layers, 8 and 1024 on full
    ones, as the real layers build them."""
    from transformers import AutoConfig
    from transformers.models.inkling.modeling_inkling import InklingShortConvolution

    real = AutoConfig.for_model("inkling_text")
    cls = load_family(drafted[1])
    config = cls(**real.to_dict())
    sliding, full = real.layer_types.index("hybrid_sliding"), real.layer_types.index("hybrid")
    assert (kv_geometry(config, sliding).num_kv_heads, kv_geometry(config, full).num_kv_heads) == (16, 8)
    for layer_idx in (sliding, full):
        layer = _real_layer(real, layer_idx)
        attention = layer.self_attn  # type: ignore[attr-defined]
        geometry = kv_geometry(config, layer_idx)
        assert geometry.num_kv_heads == attention.num_key_value_heads
        assert geometry.key_head_dim == geometry.value_head_dim == attention.head_dim
        convs = sorted((m for m in layer.modules() if isinstance(m, InklingShortConvolution)),  # type: ignore[attr-defined]
                       key=lambda m: m.conv_idx)
        expected = tuple((m.conv1d.out_channels, m.conv1d.kernel_size[0]) for m in convs)
        state = state_geometry(config, layer_idx)
        assert state is not None and state.conv_shapes == expected
        assert state_bytes_per_sequence(config, torch.bfloat16, layer_idx) == 4 * sum(c * k for c, k in expected)
    assert state_geometry(config, sliding).conv_shapes[0] == (2048, 4)  # type: ignore[union-attr]
    assert state_geometry(config, full).conv_shapes[0] == (1024, 4)  # type: ignore[union-attr]
    assert state_geometry(config) == state_geometry(config, sliding)  # the largest, for a server's budget


def test_a_session_over_the_drafted_tiny_blocks(drafted: tuple[int, Path], tmp_path: Path) -> None:
    """Prefill, decode, beam reorder, refused rewind and restart through blocks of both layer types."""
    cls = load_family(drafted[1])
    tiny = {k: v for k, v in cls.family_spec.tiny_config.items() if k != "variants"}
    config = cls(**tiny)
    save_checkpoint(hf_model(cls.hf_config_class(**tiny)), tmp_path / "ckpt")
    blocks = [load_block(tmp_path / "ckpt", config, i, dtype=torch.float32) for i in range(config.num_hidden_layers)]
    kinds = {config.layer_types[i]: state_geometry(config, i).conv_shapes[0] for i in range(len(blocks))}  # type: ignore[union-attr]
    assert kinds == {"hybrid_sliding": (128, 4), "hybrid": (64, 4)}
    session_with_beam_and_restart(config, blocks)


def test_an_override_lists_as_many_states_as_the_section() -> None:
    with pytest.raises(ValueError, match=r"layer_overrides\.b\.conv_shape lists 1 shapes, state\.conv_shape 2"):
        StateSpec(conv_shape=[["hidden_size", 4], [8, 4]], layer_overrides={"b": {"conv_shape": [16, 4]}})
    spec = StateSpec(conv_shape=[["hidden_size", 4], [8, 4]],
                     layer_overrides={"b": {"conv_shape": [[16, 4], [8, 4]]}})
    assert spec.shapes_for("conv", "b")[0][0] == 16 and spec.shapes_for("conv", "a")[0][0].source == "hidden_size"


def test_a_kv_heads_field_other_than_the_anchor_keeps_its_ratio() -> None:
    """A second KV-heads field equal to the anchor shrinks as it does; one differing keeps the ratio."""
    from distconf.tools.drafting.shrink import shrink_config

    base = {"model_type": "inkling_text", "hidden_size": 6144, "num_attention_heads": 64, "num_key_value_heads": 8,
            "head_dim": 128, "num_hidden_layers": 4, "vocab_size": 1000}
    assert shrink_config({**base, "swa_num_key_value_heads": 16})["swa_num_key_value_heads"] == 4
    assert shrink_config({**base, "swa_num_key_value_heads": 8})["swa_num_key_value_heads"] == 2
    assert shrink_config({**base, "swa_num_key_value_heads": 64})["swa_num_key_value_heads"] == 4  # capped: MHA


def test_check_holds_each_layer_type_to_its_own_state(drafted: tuple[int, Path], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Without the override, the full layers' K/V conv windows (64 channels on the tiny model) disagree with the
    section's (128): check names the block and the state."""
    import yaml

    from distconf.cli import main

    family = yaml.safe_load(drafted[1].read_text())
    del family["state"]["layer_overrides"]
    path = tmp_path / drafted[1].name
    path.write_text(yaml.safe_dump(family, sort_keys=False), encoding="utf-8")
    clear_cache()
    try:
        assert main(["check", str(path)]) == 1
    finally:
        clear_cache()
    err = capsys.readouterr().err
    assert "keeps a conv state of shape (64, 4) per sequence, the family declares (128, 4) (conv_shape[0])" in err
