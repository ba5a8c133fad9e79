"""Every built-in family's client model is transformers' model: its own model-level modules (embeddings,
streams and carried values, final norm, LM head) run here around the family's blocks, run in process too.

The swarm tests prove the wire and the servers for a few families; this proves the client side for all.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from blockhelpers import family_config
from client_swarm import make_model_dir, prompts
from local_remote import local_client_model

from distconf.loader.naming import config_num_blocks
from distconf.loader.search import list_families

pytestmark = pytest.mark.slow  # a model per family

ATOL = 1e-5


def _num_layers(family: str) -> int:
    """The tiny config's layer count (the family's own field for it), so per-layer lists keep their length."""
    config, _, _ = family_config(family)
    return config_num_blocks(config)


@pytest.mark.parametrize("family", list_families())
def test_client_model_equals_transformers(family: str, tmp_path: Path) -> None:
    model_dir, local = make_model_dir(tmp_path / family, family, layers=_num_layers(family))
    model, remote = local_client_model(model_dir)
    ids = prompts(2, 5, vocab=local.config.vocab_size, seed=1)
    greedy = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, local(ids).logits, atol=ATOL)
        assert model.generate(ids, **greedy).tolist() == local.generate(ids, **greedy).tolist()
    assert remote.inputs and remote.inputs[0].shape[:2] == ids.shape  # the blocks ran: the client did not


def test_the_base_model_is_found_without_base_model_prefix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama 4's causal LM says its base model is ``language_model`` but holds it as ``model``: a family file
    without ``base_model_prefix`` (as `distconf new` drafts it) takes the base model from the layers' prefix."""
    from distconf.loader.search import FAMILIES_PATH_ENV

    builtin = Path(__file__).resolve().parents[1] / "families" / "llama4_text.yaml"
    text = builtin.read_text(encoding="utf-8")
    assert "base_model_prefix: model" in text
    (tmp_path / "families").mkdir()
    (tmp_path / "families" / "llama4_text.yaml").write_text(text.replace("base_model_prefix: model", ""),
                                                            encoding="utf-8")
    monkeypatch.setenv(FAMILIES_PATH_ENV, str(tmp_path / "families"))  # the user's file shadows the built-in
    test_client_model_equals_transformers("llama4_text", tmp_path)
