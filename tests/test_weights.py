"""Loading one block's tensors from real safetensors checkpoints written here."""

from __future__ import annotations

import json

import pytest
import torch
from blockhelpers import family_config, hf_layer, hf_model, save_checkpoint, write_family
from safetensors.torch import load_file, save_file

from distconf.blocks.weights import BlockWeightsError, checkpoint_files, load_block, load_block_weights
from distconf.loader import load_family


def _assert_same_as_layer(state, model, config, layer_idx):
    reference = hf_layer(model, config, layer_idx).state_dict()
    assert set(state) == set(reference)
    for name, tensor in reference.items():
        torch.testing.assert_close(state[name], tensor, atol=0, rtol=0)


@pytest.fixture(scope="module")
def llama_model():
    config, hf_config, _ = family_config("llama")
    return config, hf_model(hf_config)


def test_single_file_checkpoint(tmp_path, llama_model) -> None:
    config, model = llama_model
    save_checkpoint(model, tmp_path, shards=1)
    assert (tmp_path / "model.safetensors").is_file()
    assert not (tmp_path / "model.safetensors.index.json").exists()
    for i in range(config.num_hidden_layers):
        _assert_same_as_layer(load_block_weights(tmp_path, config, i), model, config, i)


def test_sharded_checkpoint_opens_only_the_needed_shards(tmp_path, llama_model) -> None:
    config, model = llama_model
    save_checkpoint(model, tmp_path, shards=6)
    files = checkpoint_files(tmp_path)
    assert len(set(files.values())) >= 4
    report: dict = {}
    state = load_block_weights(tmp_path, config, 1, report=report)
    _assert_same_as_layer(state, model, config, 1)
    needed = {files[n] for n in files if n.startswith("model.layers.1.")}
    assert set(report["files"]) == needed
    assert len(needed) < len(set(files.values()))


def test_dtype_conversion_and_loaded_block(tmp_path, llama_model) -> None:
    config, model = llama_model
    save_checkpoint(model, tmp_path, shards=3)
    block = load_block(tmp_path, config, 2, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and not p.is_meta for p in block.parameters())
    reference = hf_layer(model, config, 2).state_dict()
    for name, tensor in block.state_dict().items():
        torch.testing.assert_close(tensor, reference[name].to(torch.bfloat16), atol=0, rtol=0)


@pytest.mark.parametrize("family", ["bloom", "llama"])
def test_checkpoint_without_base_model_prefix(tmp_path, family) -> None:
    """BLOOM hub checkpoints store 'h.0.*'; the family prefix may be either form."""
    config, hf_config, _ = family_config(family)
    model = hf_model(hf_config)
    base = type(config).family_spec.block.base_model_prefix
    state = {k.removeprefix(base + "."): v.contiguous() for k, v in model.state_dict().items()
             if k.startswith(base + ".")}
    assert any(k.startswith(("h.0.", "layers.0.")) for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    for i in range(config.num_hidden_layers):
        _assert_same_as_layer(load_block_weights(tmp_path, config, i), model, config, i)


def test_mixtral_per_expert_checkpoint_is_converted(tmp_path) -> None:
    config, hf_config, _ = family_config("mixtral")
    model = hf_model(hf_config)
    save_checkpoint(model, tmp_path, shards=4)
    names = checkpoint_files(tmp_path)
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in names  # legacy layout on disk
    for i in range(config.num_hidden_layers):
        report: dict = {}
        _assert_same_as_layer(load_block_weights(tmp_path, config, i, report=report), model, config, i)
        # Experts are copied one by one into the fused tensors (no stacked/concatenated copies).
        assert report["converted"] == {"mlp.experts.gate_up_proj": "streamed", "mlp.experts.down_proj": "streamed"}
    state = load_block_weights(tmp_path, config, 1, dtype=torch.bfloat16)  # cast while streaming
    for name, tensor in hf_layer(model, config, 1).state_dict().items():
        torch.testing.assert_close(state[name], tensor.to(torch.bfloat16), atol=0, rtol=0)


def test_wrong_prefix_names_the_field(tmp_path, llama_model, fresh_cache) -> None:
    _, model = llama_model
    save_checkpoint(model, tmp_path / "ckpt", shards=2)
    path = write_family(tmp_path, "llama", "llama_badprefix",
                        lambda t: t.replace("prefix: model.layers", "prefix: model.blocks"))
    cls = load_family(path)
    bad = cls(**cls.family_spec.tiny_config)
    with pytest.raises(BlockWeightsError) as err:
        load_block_weights(tmp_path / "ckpt", bad, 0)
    text = str(err.value)
    assert err.value.field == "block.prefix"
    assert "block.prefix" in text and "'model.blocks.0.'" in text and "'model.layers'" in text


def _rewrite(directory, change):
    """Apply change(state) to every shard of a checkpoint and fix its index."""
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    weight_map = {}
    for file in sorted(set(index["weight_map"].values())):
        state = load_file(str(directory / file))
        state = change(state)
        save_file(state, str(directory / file))
        weight_map.update(dict.fromkeys(state, file))
    index["weight_map"] = weight_map
    index_path.write_text(json.dumps(index))


def test_missing_unexpected_and_misshaped_in_one_error(tmp_path, llama_model) -> None:
    config, model = llama_model
    save_checkpoint(model, tmp_path, shards=3)

    def change(state):
        state.pop("model.layers.1.mlp.up_proj.weight", None)
        if "model.layers.1.self_attn.q_proj.weight" in state:
            state["model.layers.1.self_attn.q_proj.weight"] = torch.zeros(3, 5)
        if "model.layers.1.input_layernorm.weight" in state:
            state["model.layers.1.extra.weight"] = torch.zeros(2)
        return state

    _rewrite(tmp_path, change)
    with pytest.raises(BlockWeightsError) as err:
        load_block_weights(tmp_path, config, 1)
    text = str(err.value)
    assert "missing (1): model.layers.1.mlp.up_proj.weight" in text
    assert "unexpected (1): model.layers.1.extra.weight" in text
    assert "wrong shape (1): model.layers.1.self_attn.q_proj.weight: checkpoint [3, 5], block [64, 64]" in text
    assert err.value.missing == ["mlp.up_proj.weight"]
    # Other layers are untouched and still load.
    _assert_same_as_layer(load_block_weights(tmp_path, config, 0), model, config, 0)


def test_missing_checkpoint_is_clear(tmp_path, llama_model) -> None:
    config, _ = llama_model
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        load_block_weights(tmp_path, config, 0)
