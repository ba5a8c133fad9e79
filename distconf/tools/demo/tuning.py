"""The demo's prompt-tuning step: train deep prompts through the swarm, servers' weights frozen.

`tune_prompts` opens a client with ``tuning_mode="deep_ptune"`` on the demo model and
runs a few Adam steps teaching it to answer the demo prompt with a chosen token: the
forward and backward passes of every step run on the servers (``rpc_forward`` and
``rpc_backward`` with deep prompts); only the prompts, on the client, change.
`weights_report` reads the servers' log for their load/stop weight digests.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["PRE_SEQ_LEN", "STEPS", "TuningResult", "target_token", "tune_prompts", "weights_report"]

PRE_SEQ_LEN = 4
"""Prompt positions trained."""
STEPS = 20
"""Optimizer steps."""
LEARNING_RATE = 0.1


@dataclass
class TuningResult:
    """What `tune_prompts` measured."""

    target: int
    losses: list[float] = field(default_factory=list)
    answer_before: int = -1
    answer_after: int = -1
    trainable: int = 0
    seconds_per_step: float = 0.0

    @property
    def halved(self) -> bool:
        """Whether the loss fell to half its first value or less."""
        return bool(self.losses) and self.losses[-1] <= 0.5 * self.losses[0]


def target_token(prompt: Sequence[int], vocab_size: int) -> int:
    """The token the tuned model should answer (fixed by the prompt, not one it already answers)."""
    return (sum(prompt) * 7 + 11) % vocab_size


def _next_token(model: Any, ids: Any) -> int:
    import torch

    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return int(out[0, -1])


def tune_prompts(model_dir: str | Path, dht: Any, prompt: Sequence[int], vocab_size: int,
                 client_settings: dict[str, Any], steps: int = STEPS) -> TuningResult:
    """Train ``deep_ptune`` prompts through the swarm so that ``prompt`` is answered by `target_token`."""
    import time

    import torch

    from distconf.client import AutoDistributedModelForCausalLM

    torch.manual_seed(0)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        model_dir, dht=dht, dtype="float32", tuning_mode="deep_ptune", pre_seq_len=PRE_SEQ_LEN, **client_settings)
    try:
        ids = torch.tensor([list(prompt)])
        result = TuningResult(target=target_token(prompt, vocab_size))
        result.trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        result.answer_before = _next_token(model, ids)
        target = torch.tensor([result.target])
        optimizer = torch.optim.Adam(model.prompts.parameters(), lr=LEARNING_RATE)
        t0 = time.perf_counter()
        for _ in range(steps):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(ids, use_cache=False).logits[:, -1], target)
            loss.backward()
            optimizer.step()
            result.losses.append(loss.item())
        result.seconds_per_step = (time.perf_counter() - t0) / max(1, steps)
        result.answer_after = _next_token(model, ids)
        return result
    finally:
        model.shutdown()


def weights_report(log_text: str) -> tuple[int, int]:
    """``(servers whose weights were unchanged at stop, servers that checked)`` from the servers' log."""
    unchanged = len(re.findall(r"weights sha256 of blocks \S+ at stop: [0-9a-f]{64} \(unchanged\)", log_text))
    changed = len(re.findall(r"weights sha256 of blocks \S+ at stop: [0-9a-f]{64} \(CHANGED", log_text))
    return unchanged, unchanged + changed
