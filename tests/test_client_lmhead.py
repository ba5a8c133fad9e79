"""The client's LM head: chunked logits equal plain logits, ties and keys survive, settings apply per call."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from blockhelpers import family_config, hf_model
from torch import nn
from torch.overrides import TorchFunctionMode

from distconf.client import lmhead
from distconf.client.lmhead import LMHead, chunked_forward_wanted, has_linear_kernel, install_lm_head
from distconf.loader.data import builtin_families_dir
from distconf.loader.search import list_families

FAMILIES = list_families()
STEP = 7  # divides no tiny vocabulary (128, 256): many chunks and a ragged last one
NO_KERNEL_DTYPE = torch.float8_e8m0fnu  # this CPU torch has no F.linear for it: the float32 fallback


def tiny_model(family: str, seed: int = 0) -> tuple[Any, Any]:
    """(distributed config, float32 HF causal LM) of the family's tiny config."""
    config, hf_config, _ = family_config(family)
    return config, hf_model(hf_config, seed)


def token_ids(config: Any, shape: tuple[int, int] = (2, 5)) -> torch.Tensor:
    """Random token ids inside the vocabulary."""
    return torch.randint(0, config.vocab_size, shape, generator=torch.Generator().manual_seed(3))


class LinearCalls(TorchFunctionMode):
    """Records the output shape of every ``F.linear`` call made inside it (observes, changes nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in (F.linear, torch._C._nn.linear):
            self.shapes.append(tuple(out.shape))
        return out


def test_families_are_the_builtin_ones() -> None:
    assert len(FAMILIES) >= 10
    assert {p.stem for p in builtin_families_dir().glob("*.yaml")} == set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_head_equals_plain_head(family: str) -> None:
    """The chunked head equals the plain head on every built-in family's tiny model, in float32 and bfloat16."""
    config, model = tiny_model(family)
    head = install_lm_head(model, config)
    config.chunked_forward_step = STEP
    assert head.out_features % STEP != 0
    ids = token_ids(config)
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        logits = {}
        for chunked in (False, True):
            config.use_chunked_forward = chunked
            with torch.no_grad():
                logits[chunked] = model(input_ids=ids, use_cache=False).logits
        plain, chunked_logits = logits[False], logits[True]
        assert plain.dtype == chunked_logits.dtype, family
        assert plain.dtype in (dtype, torch.float32), family  # some models return float32 logits whatever the dtype
        assert chunked_logits.shape == (*ids.shape, config.vocab_size)
        if dtype == torch.float32:
            torch.testing.assert_close(chunked_logits, plain, rtol=1e-5, atol=1e-5)
        else:
            # Both sides are float32-accumulated dot products rounded once to bfloat16; only the
            # summation order may differ, so at most one bfloat16 ulp (a relative 2**-8..2**-7),
            # plus an absolute slack for logits near zero (measured: bitwise equal here).
            scale = plain.float().abs().max().item()
            torch.testing.assert_close(chunked_logits.float(), plain.float(), rtol=2**-7, atol=2**-8 * scale)


def test_chunked_forward_wanted_table() -> None:
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert chunked_forward_wanted("auto", cpu, torch.bfloat16) is True
    assert chunked_forward_wanted("auto", cpu, torch.float16) is True
    assert chunked_forward_wanted("auto", cpu, torch.float32) is False
    assert chunked_forward_wanted("auto", torch.device("cuda"), torch.bfloat16) is False
    assert chunked_forward_wanted("auto", meta, torch.bfloat16) is False
    for device in (cpu, meta, torch.device("cuda")):
        for dtype in (torch.float32, torch.bfloat16):
            assert chunked_forward_wanted(True, device, dtype) is True
            assert chunked_forward_wanted(False, device, dtype) is False
    with pytest.raises(ValueError, match="use_chunked_forward"):
        chunked_forward_wanted("sometimes", cpu, torch.float32)


@pytest.mark.parametrize("family", FAMILIES)
def test_ties_and_state_dict_keys_survive(family: str) -> None:
    config, model = tiny_model(family)
    before = model.state_dict()
    old = model.get_output_embeddings()
    old_weight = old.weight
    tied = old_weight is model.get_input_embeddings().weight
    assert tied == bool(model.config.tie_word_embeddings), family
    head = install_lm_head(model, config)
    assert model.get_output_embeddings() is head and head.weight is old_weight and head.bias is old.bias
    if tied:
        assert head.weight is model.get_input_embeddings().weight
        model.tie_weights()  # transformers re-ties by parameter name: still the same object
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    after = model.state_dict()
    assert list(after) == list(before)
    for name, tensor in after.items():
        assert tensor.data_ptr() == before[name].data_ptr(), name


def test_some_builtin_family_ties_its_head() -> None:
    tied = [f for f in FAMILIES if family_config(f)[1].tie_word_embeddings]
    untied = [f for f in FAMILIES if not family_config(f)[1].tie_word_embeddings]
    assert tied and untied


@pytest.mark.parametrize("family", ["bloom", "llama", "gemma2"])  # tied, untied, tied with logit soft-capping
@pytest.mark.parametrize("frozen", [False, True])
def test_gradients_match_plain_head(family: str, frozen: bool) -> None:
    config, model = tiny_model(family)
    head = install_lm_head(model, config)
    config.chunked_forward_step = STEP
    model.requires_grad_(not frozen)  # frozen: only the input embeddings (prompt-tuning style) get gradients
    ids = token_ids(config)
    embeds = model.get_input_embeddings()(ids).detach()
    grads = {}
    for chunked in (False, True):
        config.use_chunked_forward = chunked
        model.zero_grad(set_to_none=True)
        inputs = embeds.clone().requires_grad_(True)
        loss = model(inputs_embeds=inputs, labels=ids, use_cache=False).loss
        loss.backward()
        grads[chunked] = {"inputs_embeds": inputs.grad}
        grads[chunked].update({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert set(grads[True]) == set(grads[False])
    assert (head.weight.grad is not None) == (not frozen)  # the head's own weight, when unfrozen
    if frozen:
        assert set(grads[True]) == {"inputs_embeds"}
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_settings_take_effect_at_call_time() -> None:
    config, model = tiny_model("llama")
    head = install_lm_head(model, config)
    vocab = head.out_features
    hidden = torch.randn(2, 3, head.in_features)

    def linear_shapes() -> list[tuple[int, ...]]:
        with torch.no_grad(), LinearCalls() as calls:
            head(hidden)
        return calls.shapes

    config.use_chunked_forward = False
    assert linear_shapes() == [(2, 3, vocab)]
    config.use_chunked_forward = True
    config.chunked_forward_step = STEP
    shapes = linear_shapes()
    assert len(shapes) == -(-vocab // STEP)
    assert all(s[:2] == (2, 3) and s[2] <= STEP for s in shapes)  # never more than one chunk at a time
    assert sum(s[2] for s in shapes) == vocab and shapes[-1][2] == vocab % STEP
    config.chunked_forward_step = 64
    assert [s[2] for s in linear_shapes()] == [64, vocab - 64]
    config.use_chunked_forward = "auto"
    assert len(linear_shapes()) == 1  # float32 on CPU: plain
    head.to(torch.bfloat16)
    assert [s[2] for s in linear_shapes()] == [64, vocab - 64]  # bfloat16 on CPU: chunked
    assert "chunked_forward_step=64" in repr(head)


def test_install_twice_does_not_wrap_twice() -> None:
    config, model = tiny_model("bloom")
    keys = list(model.state_dict())
    head = install_lm_head(model, config)
    other_config, _, _ = family_config("bloom")
    again = install_lm_head(model, other_config)
    assert again is head and again.config is other_config
    assert [m for m in model.modules() if isinstance(m, LMHead)] == [head]
    assert not list(head.children())
    assert list(model.state_dict()) == keys


def test_model_without_output_embeddings_is_refused() -> None:
    from transformers import AutoModel

    config, hf_config, _ = family_config("llama")
    base = AutoModel.from_config(hf_config)  # the decoder without an LM head
    with pytest.raises(ValueError, match="no output embeddings"):
        install_lm_head(base, config)
    with pytest.raises(ValueError, match="no output embeddings"):
        install_lm_head(nn.Sequential(nn.Linear(4, 4)), config)

    class OddHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(8)

        def get_output_embeddings(self) -> nn.Module:
            return self.norm

    with pytest.raises(ValueError, match=r"shape \[vocab, hidden\]"):
        install_lm_head(OddHead(), config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bias_is_kept_and_chunked(dtype: torch.dtype) -> None:
    config, _, _ = family_config("llama")
    config.chunked_forward_step = STEP
    torch.manual_seed(0)
    linear = nn.Linear(32, 50, bias=True).to(dtype)
    head = LMHead(linear, config)
    assert head.weight is linear.weight and head.bias is linear.bias
    assert set(head.state_dict()) == {"weight", "bias"}
    hidden = torch.randn(3, 32)
    config.use_chunked_forward = False
    with torch.no_grad():
        plain = head(hidden)
    config.use_chunked_forward = True
    with torch.no_grad():
        chunked = head(hidden)
    assert plain.dtype == chunked.dtype == dtype
    torch.testing.assert_close(chunked.float(), plain.float(), rtol=2**-7 if dtype != torch.float32 else 1e-5,
                               atol=1e-2 if dtype != torch.float32 else 1e-6)
    torch.testing.assert_close(plain, F.linear(hidden.to(dtype), linear.weight, linear.bias))


def test_float32_fallback_where_the_dtype_has_no_kernel(caplog: pytest.LogCaptureFixture) -> None:
    config, _, _ = family_config("llama")
    config.chunked_forward_step = STEP
    exponents = torch.randint(-4, 3, (40, 16), generator=torch.Generator().manual_seed(0))
    linear = nn.Linear(16, 40, bias=False)
    linear.weight = nn.Parameter((2.0 ** exponents).to(NO_KERNEL_DTYPE), requires_grad=False)
    head = LMHead(linear, config)
    lmhead._KERNELS.pop(("cpu", NO_KERNEL_DTYPE), None)  # so the probe (and its log line) runs here
    with caplog.at_level(logging.DEBUG, logger="distconf.client.lmhead"):
        assert has_linear_kernel(torch.device("cpu"), NO_KERNEL_DTYPE) is False
    assert any("upcasts each chunk to float32" in r.getMessage() for r in caplog.records)
    assert has_linear_kernel(torch.device("cpu"), torch.bfloat16) is True

    hidden = torch.randn(2, 3, 16)
    reference = F.linear(hidden, linear.weight.float())
    config.use_chunked_forward = True
    with torch.no_grad():
        out = head(hidden)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference)
    inputs = hidden.clone().requires_grad_(True)
    out = head(inputs)  # gradient path: concatenated chunks
    out.square().sum().backward()
    torch.testing.assert_close(out, reference)
    torch.testing.assert_close(inputs.grad, 2 * reference @ linear.weight.float())
    config.use_chunked_forward = False  # the plain path has no kernel for this dtype
    with pytest.raises(RuntimeError):
        head(hidden)
