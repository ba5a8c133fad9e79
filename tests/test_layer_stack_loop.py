"""A looped layer stack (``block.layer_stack.loop``), pinned end to end on dory's defaults.

dory runs its middle layers ``n_recurrent_loops`` times in one forward pass; before, ``distconf check`` refused
the draft ("layer 1 of the model runs 2 times in one forward pass"). As the sweep does: the config class's
defaults drafted with ``distconf new`` and proved with ``distconf check``, then the blocks run against the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from sweephelpers import drafted_fixture

from distconf.cli import main
from distconf.loader.registry import clear_cache

drafted = drafted_fixture("dory")
"""``distconf new`` + ``distconf check`` of dory's defaults: (check's exit code, the draft)."""


def _edited(draft: Path, folder: Path, edit: Any) -> Path:
    """A copy of the draft (same family name, its own folder) with ``edit`` applied to its parsed text."""
    data = yaml.safe_load(draft.read_text())
    edit(data)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / draft.name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_dory_defaults_draft_the_loop_and_check(drafted: tuple[int, Path]) -> None:
    code, draft = drafted
    loop = yaml.safe_load(draft.read_text())["block"]["layer_stack"]["loop"]
    assert loop == {"start": "n_input_layers", "end": "n_input_layers + n_recurrent_layers",
                    "count": "n_recurrent_loops", "entry": "module_sum", "entry_module": "model.norm",
                    "requires": {"recurrent_kv_cache_mode": "per_loop"}}
    assert code == 0


def test_blocks_are_the_unrolled_layers(drafted: tuple[int, Path]) -> None:
    from distconf.loader import load_family
    from distconf.loader.layer_stack import model_layer
    from distconf.loader.naming import config_num_blocks
    from distconf.loader.wire_layout import wire_width_of

    _, draft = drafted
    clear_cache()
    cls = load_family(draft)
    # 2 input layers, 3 looped 3 times, 1 output layer: 12 blocks over 6 layers
    config = cls(num_hidden_layers=6, n_input_layers=2, n_recurrent_layers=3, n_output_layers=1,
                 n_recurrent_loops=3, layer_types=None)
    assert config.num_hidden_layers == 6  # the model's own count: transformers builds its layer list from it
    assert config_num_blocks(config) == 12
    assert [model_layer(config, b) for b in range(12)] == [0, 1, 2, 3, 4, 2, 3, 4, 2, 3, 4, 5]
    assert wire_width_of(config) == 2 * config.hidden_size  # the stack's input travels after the hidden state
    clear_cache()


def test_the_blocks_chain_gives_the_models_hidden_states(drafted: tuple[int, Path], tmp_path: Path) -> None:
    # the model's own last hidden state (final norm of the unrolled chain), not only the per-layer records
    import torch
    from blockhelpers import hf_model, save_checkpoint

    from distconf.blocks.weights import load_block
    from distconf.loader import load_family
    from distconf.loader.naming import config_num_blocks

    _, draft = drafted
    clear_cache()
    cls = load_family(draft)
    values = {k: v for k, v in cls.family_spec.tiny_config.items() if k != "variants"}
    values.update(n_recurrent_loops=3)
    config = cls(**values)
    model = hf_model(cls.hf_config_class(**values))
    save_checkpoint(model, tmp_path / "ckpt")
    assert config_num_blocks(config) == 5  # 1 input layer, 1 looped 3 times, 1 output layer
    blocks = [load_block(tmp_path / "ckpt", config, i, dtype=torch.float32) for i in range(5)]
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model.model(input_ids=ids, use_cache=False).last_hidden_state
        embeds = model.model.embed_tokens(ids)
        wire = torch.cat([embeds, torch.zeros_like(embeds)], dim=-1)
        for block in blocks:
            wire, _ = block(wire)
        got = model.model.norm(wire[..., :config.hidden_size])
        # and in steps with each block's cache: 4 tokens, then 3 one at a time
        caches: list[Any] = [None] * len(blocks)
        stepped = []
        for chunk in (slice(0, 4), slice(4, 5), slice(5, 6), slice(6, 7)):
            wire = torch.cat([embeds[:, chunk], torch.zeros_like(embeds[:, chunk])], dim=-1)
            for i, block in enumerate(blocks):
                wire, caches[i] = block(wire, layer_past=caches[i], use_cache=True)
            stepped.append(model.model.norm(wire[..., :config.hidden_size]))
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    assert torch.allclose(torch.cat(stepped, dim=1), want, atol=1e-5, rtol=1e-4)
    clear_cache()


def test_a_value_the_loop_is_not_exact_for_is_refused_in_one_line(drafted: tuple[int, Path]) -> None:
    from distconf.blocks import build_block
    from distconf.errors import ConfigValueError
    from distconf.loader import load_family

    _, draft = drafted
    clear_cache()
    cls = load_family(draft)
    values = {k: v for k, v in cls.family_spec.tiny_config.items() if k != "variants"}
    config = cls(**{**values, "recurrent_kv_cache_mode": "last_loop"})
    with pytest.raises(ConfigValueError) as caught:
        build_block(config, 1)
    message = str(caught.value)
    assert "block.layer_stack.loop" in message and "recurrent_kv_cache_mode='last_loop'" in message
    assert "per_loop" in message and "\n" not in message.strip()
    clear_cache()


def test_check_names_the_loop_when_its_count_is_wrong(drafted: tuple[int, Path], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    _, draft = drafted

    def wrong_count(data: dict[str, Any]) -> None:
        data["block"]["layer_stack"]["loop"]["count"] = "n_recurrent_loops + 1"

    path = _edited(draft, tmp_path / "wrong", wrong_count)
    clear_cache()
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "dory [tiny]" in x]
    assert "block.layer_stack.loop" in line and "runs 2 times" in line and "the family file says 3" in line
    assert "Traceback" not in err
    clear_cache()


def test_without_the_loop_check_says_to_declare_it(drafted: tuple[int, Path], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    _, draft = drafted

    def no_loop(data: dict[str, Any]) -> None:
        del data["block"]["layer_stack"]

    path = _edited(draft, tmp_path / "plain", no_loop)
    clear_cache()
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "dory [tiny]" in x]
    assert "declare it in block.layer_stack.loop" in line and "Traceback" not in err
    clear_cache()
