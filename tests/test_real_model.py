"""Quality of the real model (SmolLM2-135M-Instruct from its GGUF) as served: fp32, bf16, int8 and nf4.

Library level (no swarm): the local transformers model built from the converted GGUF, and
copies with every decoder layer's Linear modules quantized by `quantize_block` (what a
``--quant`` server holds; the client's embeddings, norms and LM head stay unquantized).
Over `FIXED_TEXT` (364 tokens), measured here (transformers 5.24, torch CPU):

======  ==================  ==========  ==========
dtype   top-1 vs fp32       perplexity  ratio
======  ==================  ==========  ==========
fp32    100 %               14.32       1
bf16    96.4 %              14.28       0.998
int8    96.4 %              14.35       1.002
nf4     73.4 %              17.52       1.224
======  ==================  ==========  ==========

The bounds below are those figures with a margin of 5 points of agreement and a few percent
of perplexity. nf4 is 4-bit over weights that were already 4-bit (the GGUF is Q4_1), hence
its larger loss; its greedy chat answer still begins "The capital of France is Paris".
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from real_helpers import QUALITY, open_real_source

from distconf.sources import ModelSource
from distconf.tools import real_model as rm

pytestmark = pytest.mark.slow

FP32_PERPLEXITY = (12.5, 16.5)
"""Bounds of the fp32 model's perplexity on the fixed text (measured 14.32): a wrong conversion misses them."""


@pytest.fixture(scope="module")
def source(request: pytest.FixtureRequest) -> ModelSource:
    return open_real_source(request.config)


@pytest.fixture(scope="module")
def tokenizer(source: ModelSource) -> Any:
    return source.load_tokenizer()


@pytest.fixture(scope="module")
def text_ids(tokenizer: Any) -> torch.Tensor:
    return tokenizer(rm.FIXED_TEXT, return_tensors="pt")["input_ids"]


@pytest.fixture(scope="module")
def fp32(source: ModelSource) -> Any:
    return rm.local_model(source.checkpoint_dir)


@pytest.fixture(scope="module")
def fp32_logits(fp32: Any, text_ids: torch.Tensor) -> torch.Tensor:
    return rm.next_token_logits(fp32, text_ids)


def variant(source: ModelSource, name: str) -> Any:
    """The local model as served with ``name``: bf16, or fp32 with int8/nf4 decoder layers."""
    if name == "bf16":
        return rm.local_model(source.checkpoint_dir, torch.bfloat16)
    return rm.quantize_layers(rm.local_model(source.checkpoint_dir), name)


def test_fixed_text_is_a_few_hundred_tokens(text_ids: torch.Tensor) -> None:
    assert 300 <= text_ids.shape[1] <= 500


def test_fp32_chat_answer(fp32: Any, tokenizer: Any) -> None:
    text, tokens = rm.greedy_answer(fp32, tokenizer)
    assert text == rm.ANSWER
    assert tokens[-1] == tokenizer.eos_token_id  # the answer ends there, not at max_new_tokens


def test_fp32_perplexity(fp32_logits: torch.Tensor, text_ids: torch.Tensor) -> None:
    low, high = FP32_PERPLEXITY
    assert low <= rm.perplexity(fp32_logits, text_ids) <= high


@pytest.mark.parametrize("name", sorted(QUALITY))
def test_quality_against_fp32(name: str, source: ModelSource, fp32_logits: torch.Tensor,
                              text_ids: torch.Tensor) -> None:
    logits = rm.next_token_logits(variant(source, name), text_ids)
    least_agreement, largest_ratio = QUALITY[name]
    agreement = rm.agreement(fp32_logits, logits)
    ratio = rm.perplexity(logits, text_ids) / rm.perplexity(fp32_logits, text_ids)
    assert agreement >= least_agreement, f"{name}: top-1 agreement {agreement:.3f}"
    assert 1 / largest_ratio <= ratio <= largest_ratio, f"{name}: perplexity ratio {ratio:.3f}"


def test_quantized_layers_hold_quantized_linears(source: ModelSource) -> None:
    """Every decoder-layer Linear is replaced (SmolLM2's shapes are all quantizable); the LM head is not."""
    from torch import nn

    for name in ("int8", "nf4"):
        model = variant(source, name)
        plain = [n for n, m in model.model.layers.named_modules() if type(m) is nn.Linear]
        assert plain == [], f"{name}: {plain[:3]} not quantized"
        assert type(model.lm_head) is nn.Linear


@pytest.mark.parametrize("name", ["bf16", "int8"])
def test_chat_answer_unchanged(name: str, source: ModelSource, tokenizer: Any) -> None:
    assert rm.greedy_answer(variant(source, name), tokenizer)[0] == rm.ANSWER


def test_nf4_chat_answer_starts_right(source: ModelSource, tokenizer: Any) -> None:
    assert rm.greedy_answer(variant(source, "nf4"), tokenizer)[0].startswith("The capital of France is Paris")
