"""`RemoteCache`: a transformers ``Cache`` that stands for an inference session on the swarm.

Hugging Face's ``generate`` keeps a cache object and asks it for the sequence length
(positions, masks) and to reorder (beam search) or crop (rewind) itself. Here the keys
and values live on the servers, so the cache holds only the position; ``reorder_cache``
becomes the next step's ``hypo_ids`` and ``crop`` its ``start_from_position``. The
decoder-layer stand-in finds this object among its arguments and runs the step
through `RemoteCache.step`.

With prompt tuning, the session's first step carries the trained prompts in front of
the user's positions; the cache reports only the user's positions to transformers
(the prompt positions stay on the servers for the whole session, rewinds included).
Its per-layer objects (transformers internals) are `distconf.client.hf_generation.PositionLayer`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache

from distconf.client.hf_generation import PositionLayer
from distconf.client.verifier import VerificationRollback

if TYPE_CHECKING:  # pragma: no cover
    from distconf.client.ptune import PromptTuning
    from distconf.client.session import InferenceSession

__all__ = ["RemoteCache"]

logger = logging.getLogger(__name__)


class RemoteCache(Cache):
    """The remote KV cache of a generation: an inference session over the whole model.

    :param remote: the model's `RemoteSequential` (opens the session on the first step).
    :param max_length: most tokens the session will hold (prompt + new tokens).
    :param num_layers: number of decoder layers (for code that counts cache layers).
    :param prompts: the model's trained prompts (`PromptTuning`), sent on the first step.

    Use it as ``model.generate(..., cache=cache)`` to continue a session across calls, or
    let ``generate`` make one. Close it (or use ``with``) to free the servers' memory.
    """

    def __init__(self, remote: Any, max_length: int, num_layers: int, prompts: PromptTuning | None = None,
                 adapter: str | None = None) -> None:
        super().__init__(layers=[PositionLayer(self) for _ in range(num_layers)])
        self.remote = remote
        self.adapter = adapter  # the LoRA adapter of this session (None: the config's active_adapter)
        self.max_length = int(max_length)
        self.prompts = prompts
        self.prefix = prompts.pre_seq_len if prompts is not None else 0
        self.position = 0
        self.session: InferenceSession | None = None
        self._hypo_ids: torch.Tensor | None = None
        self._rewind: int | None = None

    # ------------------------------------------------------------------ what transformers asks
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens processed so far (the same for every layer)."""
        return self.position

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for the mask transformers builds (the servers build their own)."""
        return self.position + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """The session's ``max_length``."""
        return self.max_length

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: the next step reorders the servers' caches by ``beam_idx`` (``hypo_ids``)."""
        beam_idx = beam_idx.detach().to("cpu", torch.int64)
        self._hypo_ids = beam_idx if self._hypo_ids is None else self._hypo_ids[beam_idx]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices`` (same batch size only: a server's cache has a fixed batch)."""
        if self.position == 0:
            return
        self.reorder_cache(torch.as_tensor(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Only before the first step (a server's cache has a fixed batch size)."""
        if self.position and repeats != 1:
            raise NotImplementedError("a remote session cannot change its batch size after the first step")

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (transformers 5's meaning: ``crop(0)`` removes nothing).

        A positive value keeps that many tokens (the meaning transformers 4 gave it, which 5 refuses).
        Assisted generation crops the candidates the model did not accept, ``crop(-0)`` when it took them
        all: read as "keep 0" it started the session over, and the text went wrong.
        """
        keep = self.position + tokens_to_remove if tokens_to_remove <= 0 else tokens_to_remove
        if not 0 <= keep <= self.position:
            raise ValueError(f"cannot crop a cache of {self.position} tokens to {keep}")
        self._move_to(keep)

    def reset(self) -> None:
        """Start over from position 0 (the servers rewind on the next step)."""
        self._move_to(0)

    def _move_to(self, position: int) -> None:
        if position != self.position:
            self.position = position
            self._rewind = position

    # ------------------------------------------------------------------ running steps
    def step(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Run new hidden states ``[batch, new_tokens, hidden]`` through every block of the swarm."""
        if self.session is None:
            of = {"adapter": self.adapter} if self.adapter else {}  # stand-ins for the swarm take no adapter
            self.session = self.remote.inference_session(self.max_length + self.prefix, **of)
        if self._rewind is not None:
            self.session.rewind(min(self._rewind + self.prefix, self.session.position))
            self._rewind = None
        hypo_ids, self._hypo_ids = self._hypo_ids, None
        n_user = hidden_states.shape[1]
        deep = None
        with torch.no_grad():
            if self.prompts is not None and self.session.position == 0:
                prefix = self.prompts.input_prompts(hidden_states.shape[0], hidden_states.dtype)
                hidden_states = torch.cat([prefix.to(hidden_states.device), hidden_states], dim=1)
                deep = self.prompts.deep_prompts(hidden_states.dtype)
            try:
                outputs = self.session.step(hidden_states, hypo_ids=hypo_ids, prompts=deep)
            except VerificationRollback as rollback:
                raise self._rolled_back(rollback) from None
        self.position = self.session.position - self.prefix
        return outputs[:, outputs.shape[1] - n_user:]

    # ------------------------------------------------------------------ spot checks
    @property
    def verified(self) -> int:
        """Tokens whose results a spot check covered on every span (all of them without spot checks)."""
        if self.session is None:
            return self.position
        return max(0, min(self.position, self.session.verified - self.prefix))

    def verify(self) -> None:
        """Check every token not verified yet, now; raises `VerificationRollback` if a server is caught.

        After a rollback the cache is at the first wrong position (``rollback.position``, in
        tokens): feed the tokens from there on again.
        """
        if self.session is not None:
            try:
                self.session.verify()
            except VerificationRollback as rollback:
                raise self._rolled_back(rollback) from None

    def _rolled_back(self, rollback: VerificationRollback) -> VerificationRollback:
        """The rollback in this cache's positions (before the trained prompts: back to the start)."""
        assert self.session is not None
        if self.session.position < self.prefix:
            self.session.rewind(0)
        self.position = max(0, self.session.position - self.prefix)
        self._hypo_ids = self._rewind = None
        return VerificationRollback(self.position, rollback.events)

    def close(self) -> None:
        """End the session on every server (frees their cache)."""
        if self.session is not None:
            self.session.close()
            self.session = None

    def __enter__(self) -> RemoteCache:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteCache(position={self.position}, max_length={self.max_length})"
