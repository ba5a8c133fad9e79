"""Block size and KV-cache bytes per token, from the family files alone."""

from __future__ import annotations

import pytest
import torch
from blockhelpers import family_config, write_family

from distconf import load_preset
from distconf.blocks.kvcache import kv_geometry
from distconf.blocks.quant import nf4_cpu_packed, quantized_linear_bytes
from distconf.blocks.sizing import block_param_count, block_size_bytes, bytes_per_value, kv_cache_bytes_per_token
from distconf.errors import ConfigValueError
from distconf.loader import load_family

KNOWN_KV_BF16 = {
    "bigscience/bloom": 57344,
    "meta-llama/Llama-2-70b-hf": 4096,
    "tiiuae/falcon-40b": 2048,
    "tiiuae/falcon-7b": 256,
    "mistralai/Mixtral-8x7B-v0.1": 4096,
}


@pytest.mark.parametrize("hub_id", sorted(KNOWN_KV_BF16))
def test_known_kv_bytes_per_token(hub_id: str) -> None:
    config = load_preset(hub_id)
    assert kv_cache_bytes_per_token(config, torch.bfloat16) == KNOWN_KV_BF16[hub_id]
    assert kv_cache_bytes_per_token(config) == KNOWN_KV_BF16[hub_id]  # bf16 is the default
    assert kv_cache_bytes_per_token(config, torch.float32) == 2 * KNOWN_KV_BF16[hub_id]


def test_geometry_of_presets() -> None:
    assert kv_geometry(load_preset("tiiuae/falcon-40b")).num_kv_heads == 8  # compressed, not 128
    assert kv_geometry(load_preset("tiiuae/falcon-7b")).num_kv_heads == 1
    mixtral = kv_geometry(load_preset("mistralai/Mixtral-8x7B-v0.1"))
    assert (mixtral.num_kv_heads, mixtral.key_head_dim) == (8, 128)  # not Petals 2.x's 32 heads
    bloom = kv_geometry(load_preset("bigscience/bloom"))
    assert (bloom.num_kv_heads, bloom.key_head_dim, bloom.values_per_token) == (112, 128, 28672)


def quantized_nf4_other_layout(linear: int) -> int:
    """nf4 bytes of Llama-2-70b's seven Linear weights in bitsandbytes' double-quantized layout."""
    shapes = [(8192, 8192), (1024, 8192), (1024, 8192), (8192, 8192), (28672, 8192), (28672, 8192), (8192, 28672)]
    assert sum(o * i for o, i in shapes) == linear
    return sum(quantized_linear_bytes(o, i, "nf4", torch.bfloat16, device_type="cuda") for o, i in shapes)


def test_block_size_of_llama_2_70b() -> None:
    config = load_preset("meta-llama/Llama-2-70b-hf")
    # q, o: 8192^2 each; k, v: 8192 x 1024 each; MLP 3 x 8192 x 28672; two norms.
    params = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192
    assert block_param_count(config) == params
    assert block_size_bytes(config) == int(params * 2 * 1.01)
    assert block_size_bytes(config, torch.float32) == int(params * 4 * 1.01)
    # Quantized: Linear weights as stored by quantize_block, the norms in bf16.
    linear, rows, norms = params - 2 * 8192, 2 * 8192 + 2 * 1024 + 2 * 28672 + 8192, 2 * 8192
    assert block_size_bytes(config, quant="int8") == int((linear + rows * 2 + norms * 2) * 1.01)  # bf16 row scales
    # nf4 on an AVX512-BF16 CPU (bitsandbytes' CPU layout): 4 bits + a bf16 absmax per 64, codebook and offset.
    nf4 = linear * 4.25 / 8 + 7 * (64 + 4) if nf4_cpu_packed() else quantized_nf4_other_layout(linear)
    assert block_size_bytes(config, quant="nf4") == int((nf4 + norms * 2) * 1.01)
    with pytest.raises(ValueError, match="quant"):
        block_size_bytes(config, quant="int3")


def test_sizes_match_the_real_layer() -> None:
    config, hf_config, _ = family_config("falcon", 0)
    from transformers.models.falcon.modeling_falcon import FalconDecoderLayer

    hf_config._attn_implementation = "sdpa"
    layer = FalconDecoderLayer(hf_config, 0)
    params = sum(p.numel() for p in layer.parameters())
    assert block_size_bytes(config, torch.float16) == int(params * 2 * 1.01)
    assert bytes_per_value(torch.float16) == 2 and bytes_per_value(quant="nf4") == 4.25 / 8


QWEN3_MOE = """\
family: qwen3_moe_test
model_type: qwen3_moe
config_class: transformers.Qwen3MoeConfig
block:
  layer_class: transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeDecoderLayer
  attention_class: transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeAttention
  prefix: model.layers
  position:
    rotary_class: transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeRotaryEmbedding
kv_groups: num_attention_heads // num_key_value_heads
dht_prefix: {name: repo}
"""


def test_block_size_per_layer_index(tmp_path, fresh_cache) -> None:
    """Blocks differ per layer when the constructor decides by index (dense + MoE layers)."""
    path = tmp_path / "qwen3_moe_test.yaml"
    path.write_text(QWEN3_MOE, encoding="utf-8")
    cls = load_family(path)
    config = cls(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[0])
    dense, sparse = block_param_count(config, 0), block_param_count(config, 1)
    assert dense != sparse and block_param_count(config, 2) == sparse
    assert block_param_count(config) == max(dense, sparse)  # default: the largest block
    assert block_size_bytes(config) == int(max(dense, sparse) * 2 * 1.01)
    assert block_size_bytes(config, layer_idx=0) == int(dense * 2 * 1.01)
    with pytest.raises(IndexError):
        block_size_bytes(config, layer_idx=3)


def test_kv_formulas_from_the_family_file(tmp_path, fresh_cache) -> None:
    path = write_family(tmp_path, "llama", "llama_kv", lambda t: t.replace(
        "kv_cache: {}\n", "kv_cache:\n  num_kv_heads: num_key_value_heads\n  key_head_dim: 24\n"
                          "  value_head_dim: head_dim // 2\n"))
    cls = load_family(path)
    config = cls(hidden_size=256, num_attention_heads=8, num_key_value_heads=2)
    geometry = kv_geometry(config)
    assert (geometry.num_kv_heads, geometry.key_head_dim, geometry.value_head_dim) == (2, 24, 16)
    assert kv_cache_bytes_per_token(config) == 2 * (24 + 16) * 2


def test_values_per_token_override_and_head_dim_default(tmp_path, fresh_cache) -> None:
    path = write_family(tmp_path, "llama", "llama_latent", lambda t: t.replace(
        "kv_cache: {}\n", "kv_cache:\n  values_per_token: hidden_size // 4 + 8\n"))
    cls = load_family(path)
    config = cls(hidden_size=256, num_attention_heads=8, num_key_value_heads=2)
    assert kv_cache_bytes_per_token(config, torch.float32) == (256 // 4 + 8) * 4
    # head_dim given explicitly differs from hidden_size / heads: the default uses it.
    llama = load_family("llama")(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    assert kv_geometry(llama).key_head_dim == 64


def test_bad_kv_formula_names_the_field(tmp_path, fresh_cache) -> None:
    path = write_family(tmp_path, "llama", "llama_zero", lambda t: t.replace(
        "kv_cache: {}\n", "kv_cache:\n  key_head_dim: hidden_size - hidden_size\n"))
    cls = load_family(path)
    with pytest.raises(ConfigValueError, match=r"kv_cache\.key_head_dim"):
        kv_cache_bytes_per_token(cls())


def test_sizing_allocates_nothing() -> None:
    import tracemalloc

    config = load_preset("tiiuae/falcon-40b")
    block_size_bytes(config)  # warm imports
    config.num_hidden_layers = 7  # new contents: every layer is built again on meta
    tracemalloc.start()
    size = block_size_bytes(config)
    for _ in range(3):
        assert block_size_bytes(config) == size  # cached
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 16 << 20  # 1.4 GB blocks built on meta: bookkeeping only
