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


@pytest.mark.parametrize("family", list_families())
def test_speculative_streams_give_plain_greedy_tokens_for_every_family(family: str, tmp_path: Path) -> None:
    """For every built-in family: prompt lookup and a draft model (the local model) give plain greedy's tokens
    through the client (blocks in process, rolled back on rejection); a family whose blocks keep a recurrent state
    is refused with the reason."""
    from distconf.client.speculative import DraftModel, PromptLookup, Speculation, refusal_for_family
    from distconf.client.textgen import Sampling, stream_text
    from distconf.loader.positions import max_positions

    model_dir, local = make_model_dir(tmp_path / family, family, layers=_num_layers(family))
    model, _ = local_client_model(model_dir)
    vocab = local.config.vocab_size
    prompt = [int(t) % vocab for t in (5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6)]
    greedy = Sampling(max_tokens=min(10, (max_positions(model.config) or 99) - len(prompt)), temperature=0)
    refusal = refusal_for_family(model.config)
    if refusal is not None:
        with pytest.raises(ValueError, match="recurrent state"):
            stream_text(model, None, prompt, greedy, Speculation(PromptLookup()))
        return
    plain = [p.token_id for p in stream_text(model, None, prompt, greedy)]
    for source in (PromptLookup(), DraftModel(local)):
        speculation = Speculation(source)
        assert [p.token_id for p in stream_text(model, None, prompt, greedy, speculation)] == plain, source
    assert speculation.controller.rounds > 0  # the draft model (the same weights) always proposes


def test_a_stream_past_the_models_positions_is_refused_before_any_step(tmp_path: Path) -> None:
    """MPT's blocks cannot compute past max_seq_len (``block.position.max_positions``): a stream asking for more is
    refused at once with the numbers, not failed by a server mid-generation."""
    from distconf.client.textgen import Sampling, stream_text

    model_dir, _ = make_model_dir(tmp_path, "mpt", layers=_num_layers("mpt"))
    model, remote = local_client_model(model_dir)
    with pytest.raises(ValueError, match="12 prompt tokens \\+ max_tokens 5 exceed the model's 16 positions"):
        stream_text(model, None, list(range(12)), Sampling(max_tokens=5, temperature=0))
    assert remote.inputs == []
