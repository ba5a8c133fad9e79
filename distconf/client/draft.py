"""The draft model of speculative decoding, loaded on the client from a folder, a GGUF file or a hub id in cache.

``load_draft_model("SmolLM2-135M-Instruct.Q4_1.gguf", quant="int8")`` gives a local transformers causal LM, in
eval mode, its decoder layers quantized as a server quantizes its blocks (`distconf.blocks.quant`). A draft
must share the target's tokenizer (the same model, quantized, is the natural choice); `check_draft` says when
its vocabulary does not fit.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["check_draft", "load_draft_model"]


def load_draft_model(source: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32, quant: str | None = None,
                     cache_dir: str | os.PathLike[str] | None = None) -> Any:
    """A local causal LM from ``source`` (any model source `distconf.sources.open_source` opens), optionally with
    its decoder layers quantized (``"int8"``, ``"nf4"``); `distconf.errors.ModelSourceError` when it cannot."""
    from transformers import AutoModelForCausalLM

    from distconf.blocks.quant import normalize_quant, quantize_block
    from distconf.client.layer_fit import decoder_layer_list
    from distconf.sources import open_source

    opened = open_source(source, cache_dir=cache_dir)
    model = AutoModelForCausalLM.from_pretrained(str(opened.checkpoint_dir), dtype=dtype, local_files_only=True)
    quant = normalize_quant(quant)
    if quant is not None:
        _, layers = decoder_layer_list(model, opened.config)
        for layer in layers:
            quantize_block(layer, quant)
    return model.eval().requires_grad_(False)


def check_draft(draft: Any, target_config: Any) -> None:
    """`ValueError` when ``draft`` cannot propose tokens for the target (another vocabulary)."""
    draft_vocab = int(draft.get_output_embeddings().weight.shape[0])
    target_vocab = int(target_config.vocab_size)
    if draft_vocab != target_vocab:
        raise ValueError(f"the draft model's vocabulary has {draft_vocab} tokens, the target's {target_vocab}: "
                         "a draft must share the target's tokenizer")
