"""The client's LM head: logits over the vocabulary, in chunks when memory is tight.

A client runs the embeddings and the LM head itself; the decoder blocks live on the swarm.
For a large vocabulary the head is the biggest thing it holds (128k rows x 4096 is 1 GB in
bfloat16), so a small machine runs it on CPU in half precision. `LMHead` replaces the
model's output embedding (`install_lm_head`) and computes logits in one of two ways:

- plain: one ``F.linear`` in the weight's dtype, exactly what the Hugging Face head does;
- chunked (``use_chunked_forward``; ``"auto"`` picks it on CPU in half precision): the
  vocabulary is taken ``chunked_forward_step`` rows at a time. Without autograd each chunk's
  result is written into one preallocated output, so the transient memory of the matmul is
  one ``batch x seq x step`` block whatever the vocabulary size; with autograd the chunks
  are concatenated so gradients reach the hidden states (and the weight, if unfrozen).

Each chunk is multiplied in the weight's own dtype: current torch builds have fast CPU
kernels for bfloat16 and float16, and upcasting every chunk to float32 (Petals 2.x's way,
written when those kernels were slow) costs an order of magnitude in time and a float32
copy of each chunk in memory. Only when this torch build has no ``F.linear`` kernel for the
weight's dtype on its device (probed once per device type and dtype) is each chunk upcast to
float32, and the logits are then float32.

`LMHead` keeps the SAME parameter objects as the module it replaces, so a head tied to the
input embedding stays tied and state-dict keys (``<name>.weight``, ``<name>.bias``) do not
change. It reads its two settings from the config at every call.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from distconf.loader.config_protocol import DistributedConfig

__all__ = ["LMHead", "chunked_forward_wanted", "install_lm_head", "has_linear_kernel"]

logger = logging.getLogger(__name__)

HALF_DTYPES = (torch.bfloat16, torch.float16)
"""Dtypes for which ``use_chunked_forward="auto"`` chunks on CPU."""

_KERNELS: dict[tuple[str, torch.dtype], bool] = {}


def chunked_forward_wanted(setting: bool | str, device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether the head computes logits in chunks for this setting, device and weight dtype.

    ``True``/``False`` force it; ``"auto"`` chunks exactly when the head runs on CPU in half
    precision (bfloat16 or float16), where bounding the transient memory matters most.
    """
    if setting is True or setting is False:
        return setting
    if setting != "auto":
        raise ValueError(f"use_chunked_forward={setting!r} is invalid: expected True, False or 'auto'")
    return torch.device(device).type == "cpu" and dtype in HALF_DTYPES


def has_linear_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``F.linear`` runs for ``dtype`` on ``device``'s type (probed once, then cached)."""
    key = (torch.device(device).type, dtype)
    known = _KERNELS.get(key)
    if known is not None:
        return known
    try:
        with torch.no_grad():
            probe = torch.ones(1, 2, device=device).to(dtype)
            F.linear(probe, torch.ones(3, 2, device=device).to(dtype))
        ok = True
    except (RuntimeError, TypeError) as exc:  # NotImplementedError is a RuntimeError
        ok = False
        logger.debug("no F.linear kernel for %s on %s (%s): the chunked LM head upcasts each chunk to float32",
                     dtype, key[0], str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    _KERNELS[key] = ok
    return ok


class LMHead(nn.Module):
    """Output embedding that computes logits plainly or in vocabulary chunks (see the module docstring).

    Built from an existing ``nn.Linear``-like module (``.weight`` of shape [vocab, hidden],
    optional ``.bias`` of shape [vocab]) whose Parameter objects it takes over, and a config
    with ``use_chunked_forward`` and ``chunked_forward_step``, read at every call.
    """

    def __init__(self, linear: nn.Module, config: DistributedConfig) -> None:
        super().__init__()
        weight, bias = _checked_weights(linear)
        self.weight = weight
        self.register_parameter("bias", bias)
        self.config = config

    @property
    def in_features(self) -> int:
        """Hidden size (like ``nn.Linear.in_features``)."""
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        """Vocabulary size (like ``nn.Linear.out_features``)."""
        return int(self.weight.shape[0])

    def extra_repr(self) -> str:
        """Shape, bias and the current settings."""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"use_chunked_forward={self.config.use_chunked_forward!r}, "
                f"chunked_forward_step={self.config.chunked_forward_step}")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits ``[..., vocab]`` of ``hidden_states`` ``[..., hidden]``."""
        weight = self.weight
        if not chunked_forward_wanted(self.config.use_chunked_forward, weight.device, weight.dtype):
            return F.linear(hidden_states.to(weight.dtype), weight, self.bias)
        return self.chunked_forward(hidden_states, int(self.config.chunked_forward_step))

    def chunked_forward(self, hidden_states: torch.Tensor, step: int) -> torch.Tensor:
        """Logits computed ``step`` vocabulary rows at a time.

        In the weight's dtype when this torch has a kernel for it, else in float32 (float32
        logits). Without autograd the chunks are written into one preallocated output.
        """
        if step <= 0:
            raise ValueError(f"chunked_forward_step={step!r} is invalid: expected an integer > 0")
        weight, bias = self.weight, self.bias
        upcast = not has_linear_kernel(weight.device, weight.dtype)
        compute_dtype = torch.float32 if upcast else weight.dtype
        hidden = hidden_states.to(compute_dtype)
        vocab = weight.shape[0]

        def chunk(i: int) -> torch.Tensor:
            w = weight[i:i + step].to(compute_dtype)
            b = None if bias is None else bias[i:i + step].to(compute_dtype)
            return F.linear(hidden, w, b)

        params = (hidden_states, weight) if bias is None else (hidden_states, weight, bias)
        if torch.is_grad_enabled() and any(t.requires_grad for t in params):
            return torch.cat([chunk(i) for i in range(0, vocab, step)], dim=-1)
        with torch.no_grad():
            out = torch.empty(*hidden.shape[:-1], vocab, dtype=compute_dtype, device=weight.device)
            for i in range(0, vocab, step):
                out[..., i:i + step] = chunk(i)
        return out


def _checked_weights(linear: Any) -> tuple[nn.Parameter, nn.Parameter | None]:
    """The (weight, bias) parameters of an output embedding, or a ValueError saying what is wrong."""
    name = type(linear).__name__
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, nn.Parameter):
        raise ValueError(f"output embeddings {name} have no .weight parameter (got {type(weight).__name__})")
    if weight.dim() != 2:
        raise ValueError(f"output embeddings {name}: .weight must have shape [vocab, hidden], "
                         f"got {tuple(weight.shape)}")
    bias = getattr(linear, "bias", None)
    if bias is not None and (not isinstance(bias, nn.Parameter) or tuple(bias.shape) != (weight.shape[0],)):
        raise ValueError(f"output embeddings {name}: .bias must be a parameter of shape [{weight.shape[0]}], "
                         f"got {type(bias).__name__} {tuple(getattr(bias, 'shape', ()))}")
    return weight, bias


def install_lm_head(model: nn.Module, config: DistributedConfig) -> LMHead:
    """Replace ``model``'s output embeddings by an `LMHead` reading ``config``; return the head.

    The head takes over the existing parameters (ties and state-dict keys are kept). Installing
    again returns the installed head (now reading ``config``) instead of wrapping it twice.
    Raises ValueError if the model has no output embeddings with a [vocab, hidden] weight.
    """
    getter = getattr(model, "get_output_embeddings", None)
    current = getter() if callable(getter) else None
    if current is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (get_output_embeddings() gave None "
                         "or is missing): there is no LM head to install")
    if isinstance(current, LMHead):
        current.config = config
        return current
    head = LMHead(current, config)
    model.set_output_embeddings(head)
    if model.get_output_embeddings() is not head:
        raise ValueError(f"{type(model).__name__}.set_output_embeddings did not replace the output embeddings "
                         f"{type(current).__name__}")
    logger.debug("installed the LM head on %s: vocab=%d hidden=%d", type(model).__name__,
                 head.out_features, head.in_features)
    return head
