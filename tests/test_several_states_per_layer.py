"""Several conv / recurrent states per layer (cache ``state_idx`` 0, 1, ...), as the architecture sweep found them.

A layer of the inkling family keeps four short-convolution windows next to its K/V (two on the
keys and values, two on the attention and MLP outputs), each under its own ``state_idx``; the
family file lists their shapes (``state.conv_shape`` as a list of shapes), a server's block
cache holds every one, sizes them all, and a session's beam reorder and rewind refusal cover them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers  # noqa: F401  (first imported outside capsys: its log handler keeps the session's stderr)
import yaml
from blockhelpers import hf_model, record_layers, save_checkpoint
from sessionhelpers import served, session_with_beam_and_restart, steps

from distconf.blocks.sizing import state_bytes_per_sequence
from distconf.blocks.state import BlockStateCache, state_geometry
from distconf.blocks.weights import load_block
from distconf.errors import ConfigValueError
from distconf.loader import load_family
from distconf.loader.spec_state import StateSpec

_TINY = {
    "bos_token_id": 1, "eos_token_id": 2, "conv_kernel_size": 4, "d_rel": 4, "head_dim": 16, "hidden_act": "silu",
    "hidden_size": 64, "intermediate_size": 128, "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding"],
    "log_scaling_alpha": 0.1, "max_position_embeddings": 128, "mlp_layer_types": ["dense", "sparse", "dense"],
    "moe_intermediate_size": 32, "n_routed_experts": 4, "n_shared_experts": 1, "num_attention_heads": 4,
    "num_experts_per_tok": 2, "num_hidden_layers": 3, "num_key_value_heads": 2, "rel_extent": 1024,
    "sliding_window_size": 4, "swa_head_dim": 16, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2,
    "vocab_size": 256,
}
_FAMILY = {
    "family": "inkling_text_h1",
    "model_type": "inkling_text",
    "config_class": "transformers.InklingTextConfig",
    "block": {
        "layer_class": "transformers.models.inkling.modeling_inkling.InklingDecoderLayer",
        "attention_class": "transformers.models.inkling.modeling_inkling.InklingAttention",
        "prefix": "model.layers", "base_model_prefix": "model",
        "call": {"position_ids_argument": None, "position_embeddings_argument": None},
        "mask": {"layer_types_field": "layer_types", "sliding_window": "sliding_window",
                 "layer_kinds": {"hybrid_sliding": "sliding_window", "hybrid": "causal"}},
    },
    "kv_groups": "num_attention_heads // num_key_value_heads",
    "kv_cache": {"layer_kinds": ["hybrid_sliding", "hybrid"]},
    "state": {"conv_shape": [["swa_head_dim * swa_num_key_value_heads", "conv_kernel_size"],
                             ["swa_head_dim * swa_num_key_value_heads", "conv_kernel_size"],
                             ["hidden_size", "conv_kernel_size"], ["hidden_size", "conv_kernel_size"]]},
    "dht_prefix": {"name": "repo"},
    "tiny_config": _TINY,
}


@pytest.fixture(scope="module")
def inkling(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, object, list[object]]:
    """A tiny inkling (three hybrid layers, each keeping K/V and four conv states) and its served blocks."""
    folder = tmp_path_factory.mktemp("inkling")
    path = folder / "inkling_text_h1.yaml"
    path.write_text(yaml.safe_dump(_FAMILY, sort_keys=False), encoding="utf-8")
    cls = load_family(path)
    config = cls(**_TINY)
    model = hf_model(cls.hf_config_class(**_TINY))
    save_checkpoint(model, folder / "ckpt")
    blocks = [load_block(folder / "ckpt", config, i, dtype=torch.float32) for i in range(config.num_hidden_layers)]
    return config, model, blocks


def test_a_layer_keeps_every_conv_state_after_its_kv(inkling: tuple) -> None:
    config, _, blocks = inkling
    _, pasts = steps(blocks, torch.randn(2, 5, config.hidden_size), [5])
    key, value, *convs, recurrent = pasts[0]  # the family keeps no recurrent state: its one entry is None
    assert key.shape[-2] == value.shape[-2] == 5 and recurrent is None
    assert [tuple(c.shape) for c in convs] == [(2, 32, 4), (2, 32, 4), (2, 64, 4), (2, 64, 4)]


def test_incremental_steps_equal_the_model(inkling: tuple) -> None:
    """Prefill then decode steps (the layer updates its conv windows in place) give the model's layers."""
    config, model, blocks = inkling
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    records = record_layers(model, config, ids, use_cache=False)
    with torch.no_grad():
        for block, (inputs, outputs) in zip(blocks, records):
            torch.testing.assert_close(block(inputs)[0], outputs, rtol=1e-5, atol=1e-5)
    hidden = records[0][0]
    whole, _ = steps(blocks, hidden, [9])
    torch.testing.assert_close(whole, records[-1][1], rtol=1e-5, atol=1e-5)
    for sizes in ([1] * 9, [4, 1, 1, 3]):
        stepped, _ = steps(blocks, hidden, sizes)
        torch.testing.assert_close(stepped, whole, rtol=1e-5, atol=1e-5)


def test_a_session_holds_sizes_and_reorders_every_state(inkling: tuple) -> None:
    """A served session (prefill, decode, beam reorder, refused rewind, restart) and its budget count all states."""
    from distconf.server.session_cache import SessionCache

    config, _, blocks = inkling
    geometry = state_geometry(config, 0)
    assert geometry is not None and len(geometry.conv_shapes) == 4
    assert state_bytes_per_sequence(config, torch.float32, 0) == (32 * 4 * 2 + 64 * 4 * 2) * 4
    chain = served(config, blocks)
    assert [b.state_width for b in chain] == [5] * 3  # four conv states, no recurrent one
    assert SessionCache.nbytes(chain, 3, 16) == sum(b.kv_bytes_per_token * 3 * 16 + b.state_bytes_per_sequence * 3
                                                    for b in chain)
    session_with_beam_and_restart(config, blocks)


def test_one_shape_keeps_the_two_entry_state() -> None:
    """A family with one conv shape keeps ``(conv, recurrent)``; a list of shapes gives one entry per state_idx."""
    one = StateSpec(conv_shape=["hidden_size", 4], recurrent_shape=["hidden_size", 8])
    assert one.slots == (1, 1) and len(one.conv_shapes) == 1 and one.conv_shapes[0][1] == 4
    several = StateSpec(conv_shape=[["hidden_size", 4], [8, 4]])
    assert several.slots == (2, 1) and len(several.conv_shapes) == 2


def test_a_state_idx_the_family_does_not_declare_is_named() -> None:
    cache = BlockStateCache(None, (2, 1))
    cache.update_conv_state(torch.zeros(1, 3, 2), state_idx=1, conv_kernel_size=4)
    assert cache.present is not None and cache.present[0] is None and cache.present[1].shape == (1, 3, 4)
    with pytest.raises(ConfigValueError, match=r"conv state 2, but the family's state\.conv_shape declares 2"):
        cache.update_conv_state(torch.zeros(1, 3, 2), state_idx=2)


def test_several_states_of_a_layer_get_a_shape_each() -> None:
    """The drafter lists one shape per cache state_idx (four conv windows: two per KV head, two per hidden)."""
    from transformers import InklingTextConfig

    from distconf.tools.drafting.layer_state import LayerState
    from distconf.tools.drafting.state_layout import state_layout

    config = InklingTextConfig(**_TINY)

    def layer(c: object) -> LayerState:
        kv = (c.num_key_value_heads * c.head_dim, c.conv_kernel_size)  # type: ignore[attr-defined]
        hidden = (c.hidden_size, c.conv_kernel_size)  # type: ignore[attr-defined]
        return LayerState(conv=kv, extra_convs=(kv, hidden, hidden), kv=True)

    def perturb(name: str, value: int) -> tuple[object, list[LayerState]] | None:
        try:
            changed = InklingTextConfig(**{**_TINY, name: value})
        except Exception:  # the class refuses inconsistent sizes, as the tiny run would
            return None
        return changed, [layer(changed)] * 3

    layout = state_layout(config, {}, [layer(config)] * 3, lambda: None, perturb)
    assert layout is not None and layout.problem is None
    shapes = layout.state["conv_shape"]
    assert len(shapes) == 4 and shapes[2] == shapes[3] == ["hidden_size", "conv_kernel_size"]
    assert shapes[0] == shapes[1] and shapes[0][1] == "conv_kernel_size"


@pytest.mark.parametrize(("layer_type", "kind"), [
    ("hybrid_sliding", "sliding_window"), ("hybrid", "causal"), ("local_chunked", "chunked"),
    ("sliding_attention", "sliding_window"),
])
def test_a_layer_type_named_by_its_kind_gets_that_mask(layer_type: str, kind: str) -> None:
    from distconf.tools.drafting.sections import mask_kind_of

    assert mask_kind_of(layer_type) == kind


def test_float32_conv_states_of_a_bfloat16_block_are_sized_in_float32(tmp_path: Path) -> None:
    """``state.conv_dtype: float32``: the layers run their short convolutions in float32 whatever the block's
    dtype; the bytes per sequence count them so, and equal what a bfloat16 block keeps."""
    family = {**_FAMILY, "family": "inkling_text_h1_f32", "state": {**_FAMILY["state"], "conv_dtype": "float32"}}
    path = tmp_path / "inkling_text_h1_f32.yaml"
    path.write_text(yaml.safe_dump(family, sort_keys=False), encoding="utf-8")
    cls = load_family(path)
    config = cls(**_TINY)
    save_checkpoint(hf_model(cls.hf_config_class(**_TINY)), tmp_path / "ckpt")
    blocks = [load_block(tmp_path / "ckpt", config, i, dtype=torch.bfloat16) for i in range(config.num_hidden_layers)]
    _, pasts = steps(blocks, torch.randn(2, 6, config.hidden_size, dtype=torch.bfloat16), [4, 1, 1])
    convs = [t for t in pasts[0][2:] if t is not None]
    assert len(convs) == 4 and all(t.dtype == torch.float32 for t in convs)
    held = sum(t.numel() * t.element_size() for t in convs) // 2
    assert state_bytes_per_sequence(config, torch.bfloat16, 0) == held == (32 * 4 * 2 + 64 * 4 * 2) * 4
