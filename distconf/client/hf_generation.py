"""The client's one home for transformers internals: generation's cache hook, cache layers, the layer loop.

The client plugs a remote inference session into Hugging Face's ``generate``. Three
things it needs are not part of transformers' stable API, so they live here, written
for the range `SUPPORTED_TRANSFORMERS` (pyproject's requirement, read from the package's metadata;
tested with `TESTED_TRANSFORMERS`):

* `RemoteCacheGenerationMixin` overrides the private
  ``GenerationMixin._prepare_cache_for_generation`` so that ``generate`` without a cache
  gets a `distconf.client.cache.RemoteCache` sized for the whole generation;
* `PositionLayer` subclasses ``transformers.cache_utils.CacheLayerMixin`` (a cache is a
  list of such layers; the remote one only holds the session's position);
* `layer_output_is_tuple` runs the model once or twice at load time to learn how its
  decoder-layer loop reads a layer's output (see its docstring for why a probe).

Importing this module checks the installed transformers first
(`check_transformers_version`) and fails with one `UnsupportedTransformersError`
outside the range, instead of an obscure error deep inside ``generate``.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from distconf.blocks.hf_compat import (
    SUPPORTED_TRANSFORMERS,
    TESTED_TRANSFORMERS,
    UnsupportedTransformersError,
    check_transformers_version,
)

__all__ = ["SUPPORTED_TRANSFORMERS", "TESTED_TRANSFORMERS", "PositionLayer", "RemoteCacheGenerationMixin",
           "UnsupportedTransformersError", "check_transformers_version", "layer_output_is_tuple"]

logger = logging.getLogger(__name__)

check_transformers_version()

from transformers.cache_utils import CacheLayerMixin  # noqa: E402  (only once the version is known good)


class _SessionPosition(Protocol):
    """What a `PositionLayer` reads from its cache."""

    position: int
    max_length: int


class PositionLayer(CacheLayerMixin):
    """One model layer's view of a remote cache: only the shared position (keys and values live on servers)."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, owner: _SessionPosition) -> None:
        super().__init__()
        self.owner = owner
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate locally."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Never called by a served block's layer (those run on servers); a model-level layer is refused."""
        raise NotImplementedError(
            "an attention layer outside the served blocks (a model-level encoder or decoder of this family) asked "
            "the session's cache for its keys and values; the client keeps none locally, so this family generates "
            "through the swarm only without a cache: pass use_cache=False to generate")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for a mask over the cached tokens plus the query."""
        return self.owner.position + query_length, 0

    def get_seq_length(self) -> int:
        """Tokens processed by the session so far."""
        return self.owner.position

    def get_max_length(self) -> int:
        """The session's ``max_length``."""
        return self.owner.max_length

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Handled by the owner."""

    def crop(self, tokens_to_remove: int) -> None:
        """Handled by the owner."""

    def reset(self) -> None:
        """Handled by the owner."""


class RemoteCacheGenerationMixin:
    """Gives ``generate`` a remote cache when the caller passes none.

    The class it is mixed into provides ``inference_session(max_length)`` (returning the
    cache) and ``_created_caches`` (a list; the model closes what ``generate`` created).
    """

    _created_caches: list[Any]

    def inference_session(self, max_length: int) -> Any:  # pragma: no cover - provided by the model
        """A remote cache holding up to ``max_length`` tokens."""
        raise NotImplementedError

    def _prepare_cache_for_generation(self, generation_config: Any, model_kwargs: dict[str, Any], *args: Any,
                                      **kwargs: Any) -> Any:
        """``generate`` without a cache gets a remote cache sized for the whole generation.

        transformers 5.x calls it as ``(generation_config, model_kwargs, generation_mode,
        batch_size, max_cache_length)``.
        """
        if model_kwargs.get("cache") is None and generation_config.use_cache is not False:
            max_cache_length = int(args[-1] if args else kwargs["max_cache_length"])
            mode = args[0] if len(args) >= 3 else kwargs.get("generation_mode")
            if "assisted" in str(getattr(mode, "value", mode)):
                # the last check of candidates feeds up to max_length tokens (an assistant model), or the
                # tokens so far plus prompt_lookup_num_tokens (prompt lookup caps an index, not the length)
                max_cache_length += 1 + int(getattr(generation_config, "prompt_lookup_num_tokens", None) or 0)
            cache = self.inference_session(max_cache_length)
            self._created_caches.append(cache)
            model_kwargs["cache"] = cache
        return super()._prepare_cache_for_generation(  # type: ignore[misc]
            generation_config, model_kwargs, *args, **kwargs)


class _ProbedStandIn(Protocol):
    """The decoder-layer stand-in as `layer_output_is_tuple` drives it."""

    probing: bool
    returns_tuple: bool
    tuple_padding: int


_loop_reads_tuple: dict[type, tuple[bool, int]] = {}
"""Per class of base model: (its loop reads a tuple, Nones after the hidden states in that tuple)."""
_CONVENTIONS = ((False, 0), (True, 0), (True, 1))
"""The tensor, a 1-tuple, and ``(hidden, None)`` for a loop that unpacks a second value it passes on (e.g. a layer's
top-k indices handed to the next layer, which the stand-in for the whole list never needs)."""


def layer_output_is_tuple(base: torch.nn.Module, stand_in: _ProbedStandIn, hidden_size: int) -> bool:
    """Whether ``base``'s decoder-layer loop reads a layer's output as ``output[0]`` (else as is).

    Why a probe: what a decoder layer returns is not part of transformers' API and differs
    between models of one release (in 5.24 four built-in families' loops read ``outputs[0]``,
    the others take the tensor), and a family file may name any
    model. So ``base`` runs on a 2x3 dummy input with ``stand_in.probing`` set (the stand-in
    passes hidden states through: only embeddings and norms compute), first returning the
    tensor, then a 1-tuple, then a pair ``(hidden, None)``; the convention that gives back
    ``[2, 3, hidden_size]`` is the one. The answer is kept per class of ``base``. Leaves
    ``stand_in.returns_tuple`` and ``stand_in.tuple_padding`` set.
    """
    known = _loop_reads_tuple.get(type(base))
    if known is not None:
        stand_in.returns_tuple, stand_in.tuple_padding = known
        return known[0]
    ids = torch.zeros((2, 3), dtype=torch.long)
    stand_in.probing = True
    try:
        for returns_tuple, padding in _CONVENTIONS:
            stand_in.returns_tuple, stand_in.tuple_padding = returns_tuple, padding
            try:
                with torch.no_grad():
                    out = base(input_ids=ids, use_cache=False)
                hidden = out[0] if isinstance(out, (tuple, list)) else out.last_hidden_state
            except Exception as exc:
                logger.debug("layer output probe (tuple=%s) failed: %r", returns_tuple, exc)
                continue
            if tuple(hidden.shape) == (2, 3, hidden_size):
                _loop_reads_tuple[type(base)] = (returns_tuple, padding)
                return returns_tuple
        raise RuntimeError(f"{type(base).__name__}: cannot tell how its layer loop reads a layer's output")
    finally:
        stand_in.probing = False
