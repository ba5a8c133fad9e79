"""The client model's own tensors from a checkpoint: embeddings, final norm, LM head, trained prompts.

Only the non-block tensors are read (through `distconf.blocks.checkpoint.Checkpoint`, with
its file checks); a checkpoint name matches a model tensor as it is, with or without the
base-model prefix, or after the renaming rules transformers registers for the model. A
tensor shared by tied modules is read once; shapes are checked from the file's header
before anything is read. A tensor missing or of the wrong shape is a
`distconf.sources.ModelSourceError` naming the folder.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from distconf.blocks.checkpoint import Checkpoint
from distconf.blocks.hf_compat import checkpoint_conversions, mark_initialized, rename_checkpoint_key
from distconf.blocks.weights import layer_prefixes
from distconf.loader.config_protocol import DistributedConfig
from distconf.sources import ModelSourceError

__all__ = ["checkpoint_name_map", "load_non_block_weights", "load_prompts"]

logger = logging.getLogger(__name__)


def checkpoint_name_map(config: DistributedConfig, names: list[str], wanted: set[str],
                        model_cls: type) -> dict[str, str]:
    """``{model tensor name: checkpoint name}`` for the non-block tensors of the checkpoint.

    A name matches as it is, with or without the base-model prefix, or after the renaming
    rules transformers registers for the model type or the model class.
    """
    spec = type(config).family_spec
    renamings: list[Any] = []
    if spec.block.checkpoint_conversion == "transformers":
        hf_name = next((k.__name__ for k in model_cls.__mro__ if k.__module__.startswith("transformers.")), "")
        renamings = [*checkpoint_conversions(spec.model_type)[0], *checkpoint_conversions(hf_name)[0]]
    block_forms = tuple(p[: -len("0.")] for p in layer_prefixes(config, 0))
    base = spec.block.base_model_prefix
    found: dict[str, str] = {}
    for name in names:
        if any(name.startswith(form) and name[len(form):].split(".", 1)[0].isdigit() for form in block_forms):
            continue
        candidates = [name]
        if renamings:
            candidates.append(rename_checkpoint_key(name, renamings, [])[0])
        if base:
            candidates += [f"{base}.{c}" for c in list(candidates)]
            candidates += [c[len(base) + 1:] for c in list(candidates) if c.startswith(base + ".")]
        for candidate in candidates:
            if candidate in wanted and candidate not in found:
                found[candidate] = name
                break
    return found


def load_non_block_weights(model: torch.nn.Module, config: DistributedConfig, checkpoint: Checkpoint) -> int:
    """Copy the embeddings, final norm, LM head from the checkpoint; return the number of tensors read.

    A parameter shared by tied modules (head and input embedding) is read once, whichever
    of its names the checkpoint holds.
    """
    state = model.state_dict(keep_vars=True)
    tied = dict(getattr(model, "all_tied_weights_keys", {}) or {})
    wanted = set(state)
    mapping = checkpoint_name_map(config, list(checkpoint.names), wanted, type(model))
    missing = sorted(k for k in wanted if k not in mapping and k not in tied
                     and not any(state[k] is state[m] for m in mapping))
    if missing:
        raise ModelSourceError(checkpoint.model_dir, f"the checkpoint has no tensor for {', '.join(missing)} "
                               f"(non-block weights of {type(model).__name__}; checked names with and without the "
                               "base-model prefix)")
    done: set[int] = set()
    with torch.no_grad():
        for target in sorted(mapping):
            param = state[target]
            if id(param) in done:
                continue
            _copy_tensor(checkpoint, mapping[target], param, f"{type(model).__name__}.{target}")
            done.add(id(param))
    logger.debug("loaded %d non-block tensors (%d files)", len(done), len(checkpoint.files_opened))
    return len(done)


def _copy_tensor(checkpoint: Checkpoint, name: str, param: torch.Tensor, what: str) -> None:
    """Copy checkpoint tensor ``name`` into ``param`` (shape checked from the header before reading)."""
    _, shape = checkpoint.info(name)
    if shape != tuple(param.shape):
        raise ModelSourceError(checkpoint.model_dir, f"{checkpoint.names[name]}: {name} has shape {list(shape)}, "
                               f"{what} needs {list(param.shape)}")
    param.copy_(checkpoint.tensor(name).to(param.dtype))
    mark_initialized(param)


def load_prompts(prompts: torch.nn.Module, checkpoint: Checkpoint, prefix: str) -> None:
    """Trained prompts saved with the model (``<prefix>.*`` tensors), when the checkpoint has them."""
    loaded = []
    with torch.no_grad():
        for name, param in prompts.named_parameters(prefix=prefix):
            if name in checkpoint.names:
                _copy_tensor(checkpoint, name, param, "the prompts")
                loaded.append(name)
    if loaded:
        logger.info("loaded trained prompts from %s: %s", checkpoint.model_dir, ", ".join(loaded))
    else:
        logger.info("%s holds no trained prompts: prompt tuning starts from fresh prompts", checkpoint.model_dir)
