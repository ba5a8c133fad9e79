"""The client's transformers compat module: the version guard and one test per patch, on the installed transformers."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from client_swarm import make_model_dir
from swarm_harness import Swarm

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dht() -> Any:
    with Swarm() as s:
        yield s.dht


# --------------------------------------------------------------------------- version guard
def test_supported_range_is_pyprojects() -> None:
    from distconf.client.hf_generation import SUPPORTED_TRANSFORMERS

    requirement = re.search(r'"transformers([^"]*)"', (ROOT / "pyproject.toml").read_text())
    assert requirement is not None and requirement.group(1) == SUPPORTED_TRANSFORMERS


@pytest.mark.parametrize("version", ["4.57.1", "5.19.9", "5.26.0", "5.26.0.dev0", "6.0.0", "not-a-version"])
def test_version_check_refuses_out_of_range(version: str) -> None:
    from distconf.client.hf_generation import UnsupportedTransformersError, check_transformers_version

    with pytest.raises(UnsupportedTransformersError) as info:
        check_transformers_version(version)
    message = str(info.value)
    assert version in message and ">=5.20,<5.26" in message and "tested with 5.24 and 5.25" in message


@pytest.mark.parametrize("version", ["5.20.0", "5.24.0", "5.25.0", "5.25.9", "5.25.0.dev0"])
def test_version_check_accepts_the_range(version: str) -> None:
    from distconf.client.hf_generation import check_transformers_version

    assert check_transformers_version(version) == version


def test_installed_transformers_is_supported() -> None:
    import transformers

    from distconf.client.hf_generation import check_transformers_version

    assert check_transformers_version() == transformers.__version__


# --------------------------------------------------------------------------- patch: CacheLayerMixin
def test_position_layers_answer_transformers_cache_questions() -> None:
    """transformers' ``Cache`` asks its layers (CacheLayerMixin) what the cache is; ours say: the position only."""
    from transformers.cache_utils import CacheLayerMixin

    from distconf.client import RemoteCache

    class _Session:
        position = 0

        def step(self, hidden: torch.Tensor, hypo_ids: Any = None, prompts: Any = None) -> torch.Tensor:
            self.position += hidden.shape[1]
            return hidden

    cache = RemoteCache(remote=None, max_length=16, num_layers=3)
    cache.session = _Session()  # type: ignore[assignment]
    cache.step(torch.zeros(1, 5, 4))
    assert len(cache) == 3 and all(isinstance(layer, CacheLayerMixin) for layer in cache.layers)
    assert cache.is_initialized and cache.is_croppable and not cache.is_compileable
    assert cache.is_sliding == [False] * 3 and cache.is_linear == [False] * 3 and cache.is_dummy == [False] * 3
    assert [layer.get_seq_length() for layer in cache.layers] == [5] * 3
    assert cache.layers[1].get_mask_sizes(2) == (7, 0) and cache.layers[2].get_max_length() == 16
    assert cache.get_query_offset(1) == 5  # transformers' own method, through our get_seq_length
    with pytest.raises(NotImplementedError, match="the client keeps none locally"):
        cache.layers[0].update(torch.zeros(1), torch.zeros(1))


# --------------------------------------------------------------------------- patch: _prepare_cache_for_generation
class _FakeRemote(torch.nn.Module):
    """Stands for `RemoteSequential`: sessions pass hidden states through and record their steps."""

    def __init__(self) -> None:
        super().__init__()
        self.sessions: list[Any] = []

    def inference_session(self, max_length: int) -> Any:
        remote = self

        class _Session:
            def __init__(self) -> None:
                self.max_length, self.position, self.steps, self.closed = max_length, 0, [], False
                remote.sessions.append(self)

            def step(self, hidden: torch.Tensor, hypo_ids: Any = None, prompts: Any = None) -> torch.Tensor:
                self.steps.append(hidden.shape[1])
                self.position += hidden.shape[1]
                return hidden

            def rewind(self, position: int) -> None:
                self.position = position

            def close(self) -> None:
                self.closed = True

        return _Session()


def test_generate_without_a_cache_gets_a_remote_session_and_closes_it(dht: Any, tmp_path: Path) -> None:
    from distconf.client import AutoDistributedModelForCausalLM, RemoteCache

    model_dir, _ = make_model_dir(tmp_path / "llama", "llama", layers=2)
    model = AutoDistributedModelForCausalLM.from_pretrained(model_dir, dht=dht)
    real = model.remote
    try:
        fake = _FakeRemote()
        model.remote_layers.remote = fake
        ids = torch.tensor([[1, 2, 3, 4]])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                                 pad_token_id=0)
        assert out.shape == (1, 7)
        (session,) = fake.sessions
        assert session.max_length >= 6 and session.steps == [4, 1, 1] and session.closed  # the last token is never fed
        assert model._created_caches == []
        with RemoteCache(fake, 16, model.config.num_hidden_layers) as cache, torch.no_grad():  # a caller's cache
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                           pad_token_id=0, cache=cache)
            assert len(fake.sessions) == 2 and cache.get_seq_length() == 5 and not fake.sessions[1].closed
        assert fake.sessions[1].closed
    finally:
        model.remote_layers.remote = real
        model.shutdown()


# --------------------------------------------------------------------------- the load-time layer-loop probe
def test_layer_output_convention_is_found_once_per_class(dht: Any, tmp_path: Path) -> None:
    from distconf.client import AutoDistributedModelForCausalLM
    from distconf.client.hf_generation import _loop_reads_tuple

    found = {}
    for i, family in enumerate(("bloom", "llama", "llama")):  # the second llama reuses the first one's answer
        model_dir, _ = make_model_dir(tmp_path / f"{family}-{i}", family, layers=2)
        model = AutoDistributedModelForCausalLM.from_pretrained(model_dir, dht=dht)
        found[family] = model.remote_layers.returns_tuple
        assert not model.remote_layers.probing
        base = model.get_submodule(type(model.config).family_spec.block.base_model_prefix)
        assert _loop_reads_tuple[type(base)] == (found[family], 0)
        model.shutdown()
    assert found == {"bloom": True, "llama": False}  # bloom's loop reads outputs[0]; llama's takes the tensor


def test_the_supported_ranges_are_pyprojects() -> None:
    """The compat modules' ranges are read from pyproject's dependencies (written once)."""
    import tomllib
    from pathlib import Path

    from distconf.client.hf_generation import SUPPORTED_TRANSFORMERS
    from distconf.dht.hivemind_compat import SUPPORTED_HIVEMIND

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    deps = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["dependencies"]
    assert f"transformers{SUPPORTED_TRANSFORMERS}" in deps and f"hivemind{SUPPORTED_HIVEMIND}" in deps
