"""Blocks built from the family file alone match the transformers layers exactly."""

from __future__ import annotations

import pickle

import pytest
import torch
from blockhelpers import (
    SEED_CASES,
    falcon_caches_expanded_heads,
    family_config,
    hf_layer,
    hf_model,
    record_layers,
    write_family,
)

from distconf.blocks import build_block, make_block_class
from distconf.blocks.kvcache import kv_geometry
from distconf.errors import FamilyValidationError
from distconf.loader import load_family

SEQ = 9
ATOL = 1e-5


def _blocks_from_model(model, config):
    blocks = []
    for i in range(config.num_hidden_layers):
        block = build_block(config, i, device="meta", dtype=torch.float32)
        block.load_state_dict(hf_layer(model, config, i).state_dict(), strict=True, assign=True)
        blocks.append(block)
    return blocks


def _run_chunks(blocks, hidden, chunks):
    caches = [None] * len(blocks)
    outs, start = [], 0
    with torch.no_grad():
        for size in chunks:
            h = hidden[:, start:start + size]
            for i, block in enumerate(blocks):
                h, caches[i] = block(h, layer_past=caches[i], use_cache=True)
            outs.append(h)
            start += size
    return torch.cat(outs, dim=1), caches


@pytest.mark.parametrize(("family", "variant"), SEED_CASES, ids=[f"{f}-{v}" for f, v in SEED_CASES])
def test_exact_match_full_and_incremental(family: str, variant: int) -> None:
    config, hf_config, _ = family_config(family, variant)
    model = hf_model(hf_config)
    ids = torch.randint(0, hf_config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(3))
    records = record_layers(model, config, ids, use_cache=False)
    blocks = _blocks_from_model(model, config)

    # Full sequence, layer by layer on the reference inputs: exact.
    with torch.no_grad():
        for i, block in enumerate(blocks):
            out, cache = block(records[i][0])
            assert cache is None
            torch.testing.assert_close(out, records[i][1], atol=ATOL, rtol=0)

    # Token by token, and in uneven chunks after a prefix, with the cache.
    for chunks in ([1] * SEQ, [4, 3, 1, 1]):
        out, caches = _run_chunks(blocks, records[0][0], chunks)
        torch.testing.assert_close(out, records[-1][1], atol=ATOL, rtol=0)
        geometry = kv_geometry(config)
        for key, value in caches:
            assert key.shape == (2, geometry.num_kv_heads, SEQ, geometry.key_head_dim)
            assert value.shape == (2, geometry.num_kv_heads, SEQ, geometry.value_head_dim)


def test_falcon_cache_is_compressed_to_kv_heads() -> None:
    from transformers import DynamicCache

    config, hf_config, _ = family_config("falcon", 0)
    assert config.new_decoder_architecture and config.num_kv_heads == 2 and config.num_attention_heads == 8
    model = hf_model(hf_config)
    ids = torch.randint(0, hf_config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(4))
    hf_cache = DynamicCache(config=hf_config)
    records = record_layers(model, config, ids, use_cache=True, cache=hf_cache)
    hf_keys = hf_cache.layers[0].keys
    repeat = 4 if falcon_caches_expanded_heads() else 1  # transformers <= 5.24 keeps every expanded head
    assert hf_keys.shape[1] == 2 * repeat

    block = _blocks_from_model(model, config)[0]
    with torch.no_grad():
        _, (key, value) = block(records[0][0], use_cache=True)
    assert key.shape == (1, 2, 5, 8) and value.shape == (1, 2, 5, 8)  # ours: the 2 real KV heads, either way
    torch.testing.assert_close(key.repeat_interleave(repeat, dim=1), hf_keys, atol=1e-6, rtol=0)
    torch.testing.assert_close(value.repeat_interleave(repeat, dim=1), hf_cache.layers[0].values, atol=1e-6, rtol=0)
    assert key.numel() * repeat == hf_keys.numel()


def test_block_class_is_the_layer_plus_adapter() -> None:
    cls = load_family("llama")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    block_cls = cls.block_class
    assert block_cls is make_block_class(cls)  # cached per config class
    assert issubclass(block_cls, LlamaDecoderLayer)
    assert block_cls.__name__ == "DistributedLlamaBlock"
    assert pickle.loads(pickle.dumps(block_cls)) is block_cls
    config, hf_config, _ = family_config("llama")
    block = build_block(config, 1)
    names = set(block.state_dict())
    assert names == set(LlamaDecoderLayer(hf_config, 1).state_dict())


def test_meta_build_allocates_nothing_and_uses_layer_idx() -> None:
    config, _, _ = family_config("mixtral")
    block = build_block(config, 2)
    assert all(p.is_meta for p in block.parameters())
    assert block.self_attn.layer_idx == 2
    block = build_block(config, 1, device="cpu", dtype=torch.bfloat16)
    assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in block.parameters())
    with pytest.raises(IndexError):
        build_block(config, 3)


def test_constructor_arguments_come_from_the_family_file(tmp_path, fresh_cache) -> None:
    path = write_family(tmp_path, "llama", "llama_ctor", lambda t: t.replace(
        "  base_model_prefix: model\n",
        "  base_model_prefix: model\n  constructor:\n    layer_idx_argument: index\n"))
    cls = load_family(path)
    config = cls(**cls.family_spec.tiny_config)
    with pytest.raises(FamilyValidationError) as err:
        build_block(config, 0)
    assert "block.constructor" in str(err.value) and "llama_ctor.yaml" in str(err.value)


def test_sliding_window_knob_matches_a_sliding_model(tmp_path, fresh_cache) -> None:
    """A family not built in (Mistral) described with the mask knobs alone."""
    text = """\
family: mistral_test
model_type: mistral
config_class: transformers.MistralConfig
block:
  layer_class: transformers.models.mistral.modeling_mistral.MistralDecoderLayer
  attention_class: transformers.models.mistral.modeling_mistral.MistralAttention
  prefix: model.layers
  position:
    rotary_class: transformers.models.mistral.modeling_mistral.MistralRotaryEmbedding
  mask:
    kind: sliding_window
    sliding_window: sliding_window
kv_groups: num_attention_heads // num_key_value_heads
dht_prefix: {name: full}
tiny_config: {vocab_size: 64, hidden_size: 32, intermediate_size: 48, num_hidden_layers: 2,
              num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16, sliding_window: 3}
"""
    path = tmp_path / "mistral_test.yaml"
    path.write_text(text, encoding="utf-8")
    cls = load_family(path)
    values = dict(cls.family_spec.tiny_config)
    config = cls(**values)
    from transformers import MistralConfig

    model = hf_model(MistralConfig(**values))
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(5))
    records = record_layers(model, config, ids, use_cache=False)
    blocks = _blocks_from_model(model, config)
    out, _ = _run_chunks(blocks, records[0][0], [SEQ])
    torch.testing.assert_close(out, records[-1][1], atol=ATOL, rtol=0)
    out, _ = _run_chunks(blocks, records[0][0], [5, 1, 2, 1])
    torch.testing.assert_close(out, records[-1][1], atol=ATOL, rtol=0)
    # The window matters: a causal-only block differs.
    config.sliding_window = None
    plain = [build_block(config, i, dtype=torch.float32) for i in range(2)]
    for block, ref in zip(plain, blocks):
        block.load_state_dict(ref.state_dict(), assign=True)
    out, _ = _run_chunks(plain, records[0][0], [SEQ])
    assert (out - records[-1][1]).abs().max() > 1e-3


def test_block_class_called_directly_is_adapted() -> None:
    """``config.block_class(config, i)`` works like build_block (no hidden set-up step)."""
    config, _, _ = family_config("falcon", 0)
    assert config._attn_implementation is None
    with torch.device("meta"):
        block = type(config).block_class(config, layer_idx=2)
    assert config._attn_implementation == "sdpa"  # set as a model would, before the layer is built
    assert block.layer_idx_in_model == 2
    reference = build_block(config, 2, dtype=torch.float32)
    assert set(block.state_dict()) == set(reference.state_dict())
