"""LoRA adapters beside served blocks: the same outputs as a local ``peft`` model, sessions of different adapters
in one batch each equal to running alone, and an adapter that cannot be served refused in one line naming it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from blockhelpers import family_config, hf_model, save_checkpoint

from distconf.blocks.lora import AdapterError, adapter_rows, attach, read_lora
from distconf.blocks.weights import load_block
from distconf.server.adapters import parse_adapters
from distconf.server.compute import ServedBlock, backward_chain, forward_chain
from distconf.server.session_cache import SessionCache, StepPart, batch_key, step_together
from distconf.server.validation import RequestError, check_adapter


def peft() -> Any:
    """``peft``, imported at first use: it takes about 2 s, which collecting the suite need not pay."""
    import peft as module

    return module

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _lora(model: Any, folder: Path, seed: int, targets: list[str] = TARGETS, rank: int = 4) -> Any:
    """A PEFT LoRA of ``model`` with random (non-zero) A and B, saved to ``folder``; returns the PEFT model."""
    torch.manual_seed(seed)
    config = peft().LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0,
                             init_lora_weights=False)
    tuned = peft().get_peft_model(model, config)
    tuned.save_pretrained(str(folder))
    return tuned


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny llama checkpoint, its served blocks carrying two adapters, and the PEFT models they came from."""
    root = tmp_path_factory.mktemp("lora")
    config, hf_config, _ = family_config("llama")
    base = hf_model(hf_config)
    save_checkpoint(base, root / "ckpt")
    blocks = [load_block(root / "ckpt", config, i, dtype=torch.float32) for i in range(config.num_hidden_layers)]
    models = {}
    for name, seed in (("first", 1), ("second", 2)):
        models[name] = _lora(hf_model(hf_config), root / name, seed)
        adapter = read_lora(root / name, name, config, range(config.num_hidden_layers), torch.float32)
        for i, block in enumerate(blocks):
            attach(adapter, block, i)
    served = [ServedBlock(f"b.{i}", i, b, torch.float32, _geometry(config, i), 1024) for i, b in enumerate(blocks)]
    return {"config": config, "hf_config": hf_config, "served": served, "models": models, "root": root,
            "base": base}


def _geometry(config: Any, layer: int) -> Any:
    from distconf.blocks.kvcache import kv_geometry

    return kv_geometry(config, layer)


def _layers_output(model: Any, hidden: torch.Tensor, *, grad: bool = False) -> torch.Tensor:
    """What ``model``'s decoder layers make of ``hidden`` (its own forward, captured around the layer list); with
    ``grad``, differentiable with respect to ``hidden``."""
    layers = model.get_decoder().layers
    seen: dict[str, torch.Tensor] = {}
    first = layers[0].register_forward_pre_hook(lambda _m, args, kwargs: ((hidden, *args[1:]), kwargs),
                                                with_kwargs=True)
    last = layers[-1].register_forward_hook(lambda _m, _a, out: seen.setdefault("out", out[0] if isinstance(
        out, tuple) else out))
    try:
        with torch.set_grad_enabled(grad):
            model(input_ids=torch.zeros(hidden.shape[:2], dtype=torch.long), use_cache=False)
    finally:
        first.remove()
        last.remove()
    return seen["out"]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max().clamp(min=1.0)))


def test_blocks_with_an_adapter_give_the_peft_models_outputs(tiny: dict[str, Any]) -> None:
    hidden = torch.randn(2, 5, tiny["config"].hidden_size, generator=torch.Generator().manual_seed(0))
    prompts = [None] * len(tiny["served"])
    base = forward_chain(tiny["served"], hidden, prompts)
    assert _close(base, _layers_output(tiny["base"], hidden))
    for name, model in tiny["models"].items():
        out = forward_chain(tiny["served"], hidden, prompts, name)
        assert _close(out, _layers_output(model, hidden)), name
        assert not _close(out, base), f"adapter {name} changes nothing: the test would not see a wrong delta"


def test_sessions_of_different_adapters_in_one_batch_each_equal_alone(tiny: dict[str, Any]) -> None:
    served, width = tiny["served"], tiny["config"].hidden_size
    g = torch.Generator().manual_seed(3)
    adapters = [None, "first", "second", "first"]
    inputs = [[torch.randn(r, n, width, generator=g) for n in (4, 1, 1)] for r in (1, 2, 1, 1)]
    alone = [SessionCache(served, x[0].shape[0], 16, adapter=a) for a, x in zip(adapters, inputs)]
    together = [SessionCache(served, x[0].shape[0], 16, adapter=a) for a, x in zip(adapters, inputs)]
    for cache in (*alone, *together):
        cache.allocate()
    prompts = [None] * len(served)
    for k in range(3):
        expected = [c.step(x[k], prompts, None) for c, x in zip(alone, inputs)]
        parts = [StepPart(c, x[k], prompts) for c, x in zip(together, inputs)]
        assert len({batch_key(p) for p in parts}) == 1  # adapters never split a batch
        for out, ref in zip(step_together(parts), expected):
            assert _close(out, ref)
    # the adapters' sessions really differ from the base one's
    same_inputs = [SessionCache(served, 1, 16, adapter=a) for a in (None, "first")]
    for cache in same_inputs:
        cache.allocate()
    x = inputs[0][0]
    base, tuned = step_together([StepPart(c, x, prompts) for c in same_inputs])
    assert not _close(base, tuned)


def test_backward_runs_through_the_adapter(tiny: dict[str, Any]) -> None:
    served, width = tiny["served"], tiny["config"].hidden_size
    x = torch.randn(1, 3, width, generator=torch.Generator().manual_seed(5))
    grads = torch.ones(1, 3, width)
    (base,) = backward_chain(served, x, grads, None)
    (tuned,) = backward_chain(served, x, grads, None, "first")
    x.requires_grad_(True)
    model = tiny["models"]["first"]
    out = _layers_output(model, x, grad=True)
    (expected,) = torch.autograd.grad(out, x, grads)
    assert _close(tuned, expected) and not _close(tuned, base)


def test_a_call_outside_any_adapter_context_is_the_base_model(tiny: dict[str, Any]) -> None:
    hidden = torch.randn(1, 2, tiny["config"].hidden_size)
    block = tiny["served"][0].module
    with torch.no_grad():
        plain, _ = block(hidden)
        with adapter_rows([(None, slice(0, 1))]):
            none, _ = block(hidden)
    assert torch.equal(plain, none)


def test_a_request_for_an_adapter_not_served_is_refused_naming_what_is() -> None:
    assert check_adapter({}, ("a",)) is None and check_adapter({"active_adapter": ""}, ()) is None
    assert check_adapter({"active_adapter": "a"}, ("a", "b")) == "a"
    with pytest.raises(RequestError, match=r"adapter 'c' is not served here \(it serves 'a', 'b'\)"):
        check_adapter({"active_adapter": "c"}, ("a", "b"))
    with pytest.raises(RequestError, match="this server has no adapters"):
        check_adapter({"active_adapter": "c"}, ())
    with pytest.raises(RequestError, match="not a string"):
        check_adapter({"active_adapter": 3}, ("a",))


def _edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _bad_adapter(root: Path, how: str, hf_config: Any) -> Path:
    from safetensors.torch import load_file, save_file

    folder = root / how
    targets = {"lm_head": ["q_proj", "lm_head"]}.get(how, TARGETS)
    _lora(hf_model(hf_config), folder, 7, targets=targets)
    weights = folder / "adapter_model.safetensors"
    if how == "not_lora":
        _edit_config(folder, peft_type="IA3")
    elif how == "bias":
        _edit_config(folder, bias="all")
    elif how == "pickle_only":
        weights.rename(folder / "adapter_model.bin")
    elif how in ("missing_b", "wrong_shape", "no_module"):
        tensors = load_file(str(weights))
        key = next(k for k in tensors if "layers.0.self_attn.q_proj.lora_B" in k)
        if how == "missing_b":
            del tensors[key]
        elif how == "wrong_shape":
            tensors[key.replace("lora_B", "lora_A")] = torch.zeros(4, 7)
        else:
            tensors[key.replace("q_proj", "qq_proj")] = tensors.pop(key)
            a = key.replace("lora_B", "lora_A")
            tensors[a.replace("q_proj", "qq_proj")] = tensors.pop(a)
        save_file(tensors, str(weights))
    return folder


@pytest.mark.parametrize(("how", "why"), [
    ("not_lora", "peft_type is 'IA3'; only LoRA adapters are served"),
    ("bias", "it trains biases"),
    ("pickle_only", "has only adapter_model.bin, a pickle: no adapter_model.safetensors"),
    ("lm_head", "outside the transformer blocks; a server serves blocks only"),
    ("missing_b", "layer 0 self_attn.q_proj has lora_A without lora_B"),
    ("wrong_shape", "maps 64 to 64 values, the adapter 7 to 64"),
    ("no_module", "layer 0 has no module 'self_attn.qq_proj'"),
])
def test_an_adapter_that_cannot_be_served_is_one_error_naming_it_and_why(tiny: dict[str, Any], how: str,
                                                                         why: str) -> None:
    config, hf_config = tiny["config"], tiny["hf_config"]
    folder = _bad_adapter(tiny["root"], how, hf_config)
    with pytest.raises(AdapterError) as caught:
        adapter = read_lora(folder, how, config, range(config.num_hidden_layers), torch.float32)
        block = load_block(tiny["root"] / "ckpt", config, 0, dtype=torch.float32)
        attach(adapter, block, 0)
    message = str(caught.value)
    assert f"adapter {how!r}" in message and why in message and "\n" not in message


def test_adapter_arguments_take_a_name_or_are_served_as_given() -> None:
    sources = parse_adapters(["./a", "support=./b", "org/lora"])
    assert [(s.name, s.source) for s in sources] == [("./a", "./a"), ("support", "./b"), ("org/lora", "org/lora")]
    with pytest.raises(AdapterError, match="given twice"):
        parse_adapters(["x=./a", "x=./b"])
    with pytest.raises(AdapterError, match="not an adapter folder or a hub id"):
        sources[0].folder()
