"""The client model without servers: non-block weights, the layer stand-in, the remote cache, retry policy.

The transformers patches (cache hook, cache layers, layer-loop probe) are tested in test_client_hf_generation.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from client_swarm import make_model_dir
from swarm_harness import Swarm

FAMILIES = ["bloom", "llama", "falcon", "mixtral", "qwen3", "gemma2", "deepseek_v2", "gpt_neox", "phi3",
            "starcoder2", "granite", "qwen2", "qwen3_moe", "mistral"]


@pytest.fixture(scope="module")
def dht() -> Any:
    with Swarm() as s:
        yield s.dht


@pytest.mark.parametrize("family", FAMILIES)
def test_only_non_block_weights_are_loaded(family: str, dht: Any, tmp_path: Path) -> None:
    from distconf.blocks.weights import layer_prefixes
    from distconf.client import AutoDistributedModelForCausalLM
    from distconf.client.model import RemoteLayers

    model_dir, local = make_model_dir(tmp_path / family, family, layers=2)
    model = AutoDistributedModelForCausalLM.from_pretrained(model_dir, dht=dht)
    try:
        assert isinstance(model, type(local))  # the family's own transformers class
        layers = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
        assert any(len(m) == 1 and isinstance(m[0], RemoteLayers) for m in layers)
        reference = local.state_dict()
        state = model.state_dict()
        block_forms = tuple(p for i in range(2) for p in layer_prefixes(model.config, i))
        assert not [k for k in state if k.startswith(block_forms)], "no block tensor may be local"
        assert set(reference) - set(state) == {k for k in reference if k.startswith(block_forms)}
        for name, tensor in state.items():
            assert torch.equal(tensor, reference[name]), name
        for name, buffer in model.named_buffers():
            assert torch.allclose(buffer, dict(local.named_buffers())[name]), name
        # the stand-in's output convention: a pass-through stand-in gives the model without its blocks
        stand_in = model.remote_layers
        stand_in.probing = True
        ids = torch.tensor([[1, 2, 3]])
        with torch.no_grad():
            out = model(ids, use_cache=False).logits
        stand_in.probing = False
        assert out.shape == (1, 3, local.config.vocab_size) and torch.isfinite(out).all()
    finally:
        model.shutdown()


def test_missing_non_block_tensor_is_named(dht: Any, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from distconf.client import AutoDistributedModelForCausalLM

    model_dir, _ = make_model_dir(tmp_path / "llama", "llama", layers=2)
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.norm.weight"]
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        AutoDistributedModelForCausalLM.from_pretrained(model_dir, dht=dht)


class _Recorder:
    """A stand-in inference session recording what the cache asks of it."""

    def __init__(self) -> None:
        self.position = 0
        self.calls: list[tuple[str, Any]] = []

    def step(self, hidden: torch.Tensor, hypo_ids: torch.Tensor | None = None, prompts: Any = None) -> torch.Tensor:
        self.calls.append(("step", None if hypo_ids is None else hypo_ids.tolist()))
        self.position += hidden.shape[1]
        return hidden

    def rewind(self, position: int) -> None:
        self.calls.append(("rewind", position))
        self.position = position


def test_remote_cache_maps_reorder_and_crop_to_the_protocol() -> None:
    from distconf.client import RemoteCache

    session = _Recorder()
    cache = RemoteCache(remote=None, max_length=16, num_layers=3)
    cache.session = session  # type: ignore[assignment]
    cache.step(torch.zeros(2, 4, 8))
    assert cache.get_seq_length() == 4 and cache.get_mask_sizes(1, 0) == (5, 0)
    cache.reorder_cache(torch.tensor([1, 0]))
    cache.reorder_cache(torch.tensor([1, 1]))  # composed: row i takes row beam[i] of the previous order
    cache.step(torch.zeros(2, 1, 8))
    cache.crop(-2)
    assert cache.get_seq_length() == 3
    cache.step(torch.zeros(2, 1, 8))
    assert session.calls == [("step", None), ("step", [0, 0]), ("rewind", 3), ("step", None)]
    assert cache.get_seq_length() == 4


def test_remote_cache_crop_zero_removes_nothing_as_in_transformers_5() -> None:
    """transformers 5's assisted generation calls ``crop(-0)`` when every candidate was accepted: nothing to remove
    (read as "keep 0 tokens", the session started over and the text went wrong)."""
    from transformers import DynamicCache

    from distconf.client import RemoteCache

    session = _Recorder()
    cache = RemoteCache(remote=None, max_length=16, num_layers=3)
    cache.session = session  # type: ignore[assignment]
    cache.step(torch.zeros(1, 5, 8))
    cache.crop(0)
    cache.crop(-0)
    assert cache.get_seq_length() == 5
    cache.crop(-3)
    assert cache.get_seq_length() == 2
    cache.reset()
    assert cache.get_seq_length() == 0
    cache.step(torch.zeros(1, 1, 8))
    assert session.calls == [("step", None), ("rewind", 0), ("step", None)]
    local = DynamicCache()  # transformers' own semantics, which the remote cache follows
    local.update(torch.zeros(1, 1, 5, 2), torch.zeros(1, 1, 5, 2), 0)
    local.crop(0)
    assert local.get_seq_length() == 5


def test_retry_delays_follow_backoff_fields() -> None:
    from distconf.client import SequenceManager
    from distconf.loader import load_family

    config = load_family("llama")(min_backoff=0.5, max_backoff=3.0, max_retries=2, dht_prefix="x")

    class _Swarm:
        num_blocks, dht_prefix = 2, "x"

    manager = SequenceManager(config, _Swarm())
    assert [manager.retry_delay(a) for a in range(5)] == [0.0, 0.5, 1.0, 2.0, 3.0]
    assert [manager.retries_left(a) for a in range(3)] == [True, True, False]


def test_tied_embeddings_are_loaded_once_and_stay_shared(dht: Any, tmp_path: Path) -> None:
    """A head tied to the input embedding is one tensor, read once, even if the checkpoint names it twice."""
    from safetensors.torch import load_file, save_file

    from distconf.blocks.checkpoint import Checkpoint
    from distconf.client import AutoDistributedModelForCausalLM, LMHead
    from distconf.client.local_weights import load_non_block_weights

    model_dir, local = make_model_dir(tmp_path / "qwen3", "qwen3", layers=2)
    assert local.config.tie_word_embeddings
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    assert "lm_head.weight" not in tensors  # transformers saves a tied tensor once
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()  # a checkpoint naming it twice
    save_file(tensors, path, metadata={"format": "pt"})
    model = AutoDistributedModelForCausalLM.from_pretrained(model_dir, dht=dht)
    try:
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()
        assert isinstance(head, LMHead)
        assert head.weight is embed.weight and head.weight.data_ptr() == embed.weight.data_ptr()
        unique = {id(p) for p in model.state_dict(keep_vars=True).values()}
        with Checkpoint(model_dir) as checkpoint:
            assert load_non_block_weights(model, model.config, checkpoint) == len(unique)
        assert len(unique) == len(model.state_dict()) - 1  # the two names hold one tensor
        assert torch.equal(head.weight, local.get_input_embeddings().weight)
    finally:
        model.shutdown()
