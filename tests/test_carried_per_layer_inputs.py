"""Per-layer inputs a model computes before its layers travel on the wire (issue 23: gemma4_text).

gemma4_text computes ``per_layer_inputs`` (``[batch, seq, layers, hidden_size_per_layer_input]``) once, from the
token ids and embeddings, with ``model.project_per_layer_inputs``, and hands layer ``i`` its part
``per_layer_inputs[:, :, i, :]``. ``distconf new`` drafts ``hidden_state.carried`` with ``computed_by``: the
client's model computes the value as the model does, the wire carries every layer's part after the hidden
state and each block passes its own. Each test drafts the family from transformers' defaults, as the sweep
does; check proves the blocks against transformers' model and fails, located, on a wrong method.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from sweephelpers import new_from_defaults

from distconf.cli import main

FAMILY = "gemma4_text_ple"  # its own name: another test may draft gemma4_text in the same worker
CARRIED = {"argument": "per_layer_input", "width": "hidden_size_per_layer_input",
           "computed_by": "model.project_per_layer_inputs"}


@pytest.fixture(scope="module")
def drafted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gemma4_text")
    assert new_from_defaults("gemma4_text", folder, family=FAMILY) == 0
    return folder / "out" / f"{FAMILY}.yaml"


def _edited(drafted: Path, folder: Path, **changes: Any) -> Path:
    """The draft with ``changes`` made to its carried value, under the same family name."""
    family = yaml.safe_load(drafted.read_text())
    family["hidden_state"]["carried"][0].update(changes)
    family["hidden_state"]["carried"][0] = {k: v for k, v in family["hidden_state"]["carried"][0].items()
                                            if v is not None}
    path = folder / f"{FAMILY}.yaml"
    path.write_text(yaml.safe_dump(family, sort_keys=False))
    return path


def test_the_drafted_per_layer_inputs_pass_check(drafted: Path, fresh_cache: Any,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # before: distconf new refused ("the model hands each layer 'per_layer_input' ... no family file can serve")
    assert yaml.safe_load(drafted.read_text())["hidden_state"] == {"carried": [CARRIED]}
    code = main(["check", str(drafted)])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err


def test_the_wire_holds_every_layers_part(drafted: Path, fresh_cache: Any) -> None:
    from distconf.loader import load_family

    cls = load_family(drafted)
    config = cls(**{k: v for k, v in cls.family_spec.tiny_config.items() if k != "variants"})
    assert config.wire_width == config.hidden_size + config.num_hidden_layers * config.hidden_size_per_layer_input


@pytest.mark.parametrize(("changes", "message"), [
    ({"output_index": 1}, "give exactly one of output_index"),
    ({"computed_by": None}, "give exactly one of output_index"),
])
def test_a_carried_value_has_exactly_one_source(drafted: Path, tmp_path: Path, fresh_cache: Any,
                                                changes: dict[str, Any], message: str) -> None:
    from distconf.errors import FamilyValidationError
    from distconf.loader import load_family

    with pytest.raises(FamilyValidationError) as raised:
        load_family(_edited(drafted, tmp_path, **changes))
    assert message in str(raised.value) and "hidden_state.carried.0" in str(raised.value)
    assert f"{FAMILY}.yaml:" in str(raised.value)  # located: the file and line


@pytest.mark.parametrize(("method", "message"), [
    ("model.get_per_layer_inputs", "not its part [..., 0, :] of what model.get_per_layer_inputs returned"),
    ("model.no_such_method", "has no method 'model.no_such_method'"),
])
def test_check_fails_at_a_wrong_method(drafted: Path, tmp_path: Path, fresh_cache: Any, method: str, message: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    # get_per_layer_inputs is the token-identity part only: its slices are not what the layers get
    code = main(["check", str(_edited(drafted, tmp_path, computed_by=method))])
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert code == 1
    assert any(message in x and "hidden_state.carried.0.computed_by" in x for x in out.splitlines()), out


def test_the_client_model_computes_the_per_layer_inputs(drafted: Path, tmp_path: Path, fresh_cache: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from client_swarm import make_model_dir
    from local_remote import local_client_model

    from distconf.loader.auto import AutoDistributedConfig
    from distconf.loader.search import FAMILIES_PATH_ENV

    monkeypatch.setenv(FAMILIES_PATH_ENV, str(drafted.parent))
    model_dir, local = make_model_dir(tmp_path / FAMILY, FAMILY, layers=3, noise=0.05)
    config = AutoDistributedConfig.from_pretrained(str(model_dir))
    model, remote = local_client_model(model_dir)  # no swarm: the blocks run here
    ids = torch.tensor([[5, 9, 2, 7, 1]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, local(ids).logits, atol=1e-4)
        greedy = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
        ours = model.generate(ids, attention_mask=torch.ones_like(ids), **greedy)
        theirs = local.generate(ids, attention_mask=torch.ones_like(ids), **greedy)
    assert ours.tolist() == theirs.tolist()
    width = config.hidden_size + 3 * config.hidden_size_per_layer_input
    assert {x.shape[-1] for x in remote.inputs} == {width} and [x.shape[1] for x in remote.inputs][1:3] == [5, 1]
    with torch.no_grad():  # the wire holds every layer's part, as the model computes it
        embeds = local.model.embed_tokens(ids)
        whole = local.model.project_per_layer_inputs(embeds, local.model.get_per_layer_inputs(ids, embeds))
    assert torch.allclose(remote.inputs[0][..., config.hidden_size:], whole.flatten(-2), atol=1e-6)
