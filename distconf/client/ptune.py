"""Prompt tuning on the client: trainable prompts in front of frozen remote blocks.

A swarm's blocks stay frozen on the servers; a client fine-tunes the model by training
a few prompt vectors of its own (``PTuneConfig``):

- ``tuning_mode="ptune"``: ``pre_seq_len`` prompt vectors are prepended to the hidden
  states that enter the first block;
- ``tuning_mode="deep_ptune"``: additionally, per-block prompts ``[num_blocks,
  pre_seq_len, hidden]`` travel to the servers as the deep-prompts tensor of
  ``rpc_forward``/``rpc_backward``/``rpc_inference``; each server adds them to the first
  ``pre_seq_len`` positions of each of its blocks' inputs.

The prompts live where the blocks read them: the input of the first block, after the
model's own embedding stage (for most families that is the token embedding itself; where
the embedding stage scales, normalizes or adds absolute positions, the prompts are
learned after it). The prompt positions are cut from everything the user sees.

Prompts are kept in float32 (their optimizer state too) and cast to the model's dtype
when sent. Input prompts start as random vectors of the input embeddings' scale; deep
prompts start at zero, so an untrained ``deep_ptune`` model equals its ``ptune`` model.
"""

from __future__ import annotations

import logging

import torch

from distconf.loader.config_protocol import DistributedConfig
from distconf.loader.naming import config_num_blocks

__all__ = ["PromptTuning", "prompt_tuning_for"]

logger = logging.getLogger(__name__)


class PromptTuning(torch.nn.Module):
    """The trainable prompts of a distributed model.

    :param pre_seq_len: prompt positions.
    :param hidden_size: the model's hidden size.
    :param num_blocks: the model's number of blocks (for deep prompts).
    :param deep: whether to hold per-block deep prompts (``deep_ptune``).
    :param init_std: standard deviation of the input prompts' random start.
    """

    def __init__(self, pre_seq_len: int, hidden_size: int, num_blocks: int, *, deep: bool,
                 init_std: float = 0.02) -> None:
        super().__init__()
        if pre_seq_len <= 0:
            raise ValueError(f"prompt tuning needs pre_seq_len > 0, got {pre_seq_len}")
        self.pre_seq_len = int(pre_seq_len)
        self.prompt_embeddings = torch.nn.Parameter(
            torch.empty(pre_seq_len, hidden_size, dtype=torch.float32).normal_(0.0, float(init_std)))
        self.deep_prompt_embeddings: torch.nn.Parameter | None = None
        if deep:
            self.deep_prompt_embeddings = torch.nn.Parameter(
                torch.zeros(num_blocks, pre_seq_len, hidden_size, dtype=torch.float32))

    @property
    def deep(self) -> bool:
        """Whether per-block deep prompts are trained (``deep_ptune``)."""
        return self.deep_prompt_embeddings is not None

    def input_prompts(self, batch: int, dtype: torch.dtype) -> torch.Tensor:
        """The prompts prepended to the first block's input: ``[batch, pre_seq_len, hidden]``."""
        return self.prompt_embeddings.to(dtype).unsqueeze(0).expand(batch, -1, -1)

    def deep_prompts(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The deep-prompts tensor for the servers, ``[num_blocks, 1, pre_seq_len, hidden]`` (None for ptune).

        The batch dimension is 1: servers broadcast it over the batch, and the gradient
        they return is already summed over it.
        """
        if self.deep_prompt_embeddings is None:
            return None
        return self.deep_prompt_embeddings.to(dtype).unsqueeze(1)

    def extra_repr(self) -> str:
        """Prompt length and mode, for ``repr``."""
        return f"pre_seq_len={self.pre_seq_len}, deep={self.deep}"


def prompt_tuning_for(config: DistributedConfig, input_embeddings: torch.nn.Module | None) -> PromptTuning | None:
    """The `PromptTuning` that ``config`` asks for (``tuning_mode``), or None when it asks for none.

    The input prompts start at the scale of ``input_embeddings``' weight (0.02 when unknown).
    """
    mode = getattr(config, "tuning_mode", None)
    if not mode:
        return None
    if config.wire_width != config.hidden_size:
        raise ValueError(f"prompt tuning ({mode}) is not supported for {type(config).family_spec.family!r}: its "
                         f"hidden state between layers is {config.wire_width} values per token, not one stream of "
                         f"hidden_size {config.hidden_size} (hidden_state.streams), and prompts are hidden_size wide")
    weight = getattr(input_embeddings, "weight", None)
    std = 0.02
    if isinstance(weight, torch.Tensor) and weight.numel() > 1 and weight.device.type != "meta":
        rows = weight.detach()[:: max(1, weight.shape[0] // 4096)]  # a sample: no float32 copy of a large table
        std = float(rows.float().std()) or std
    tuning = PromptTuning(int(config.pre_seq_len), int(config.hidden_size), config_num_blocks(config),
                          deep=mode == "deep_ptune", init_std=std)
    logger.debug("prompt tuning: %s, %d prompt positions", mode, tuning.pre_seq_len)
    return tuning
