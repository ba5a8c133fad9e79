"""The client half of bench_speculative.py: the real model's client in a lab host, generating as it is asked.

``python benchmarks/speculative_client.py PEER`` loads the client and the draft (the same GGUF, its layers int8)
once, prints ``ready``, then answers one JSON line per command line:
``{"source": "none|draft|lookup|wrong", "tokens": N}``: greedy generation of up to N tokens for each of the
fixed chat prompts through `distconf.client.textgen.stream_text`, giving the new tokens per prompt, the seconds,
the speculative rounds and the proposals kept.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch

PROMPTS = (
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle works, step by step.",
    "Repeat exactly, twice: The quick brown fox jumps over the lazy dog near the river bank.",
    "List the planets of the solar system, with one fact about each.",
)


class WrongDraft:
    """A draft that is always wrong: the int8 draft's tokens, each shifted by one (a bad draft's cost, no use)."""

    drafts_ahead = True

    def __init__(self, inner: Any, vocab: int) -> None:
        self.inner, self.vocab = inner, vocab

    def propose(self, ids: Any, k: int, distribution: Any = None, generator: Any = None) -> Any:
        from distconf.client.speculative import Proposal

        proposal = self.inner.propose(ids, k, distribution, generator)
        return Proposal([(t + 1) % self.vocab for t in proposal.tokens])

    def close(self) -> None:
        self.inner.close()


def main(peer: str) -> None:
    from distconf.client import AutoDistributedModelForCausalLM
    from distconf.client.draft import load_draft_model
    from distconf.client.speculative import DraftModel, PromptLookup, Speculation, SpeculationController
    from distconf.client.textgen import Sampling, chat_input_ids, stream_text
    from distconf.sources import open_source
    from distconf.tools import real_model as rm

    source = open_source(rm.gguf_path())
    tokenizer = source.load_tokenizer()
    model = AutoDistributedModelForCausalLM.from_pretrained(source, initial_peers=[peer], dtype=torch.float32,
                                                            max_retries=3, show_route=False)
    draft = load_draft_model(rm.gguf_path(), quant="int8")
    prompts = [chat_input_ids(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]

    def speculation(name: str, controller: SpeculationController) -> Speculation | None:
        if name == "none":
            return None
        if name == "lookup":
            return Speculation(PromptLookup(), controller)
        inner = DraftModel(draft)
        return Speculation(inner if name == "draft" else WrongDraft(inner, model.config.vocab_size), controller)

    print("ready", flush=True)
    try:
        for line in sys.stdin:
            command = json.loads(line)
            tokens, seconds = [], 0.0
            controller = SpeculationController(max_tokens=8)  # one per command, as the CLI keeps one
            for ids in prompts:
                spec = speculation(command["source"], controller)
                start = time.perf_counter()
                out = [p.token_id for p in stream_text(model, tokenizer, ids, Sampling(max_tokens=command["tokens"],
                                                                                         temperature=0), spec)]
                seconds += time.perf_counter() - start
                tokens.append(out)
            print(json.dumps({"tokens": tokens, "seconds": seconds, "rounds": controller.rounds,
                              "kept": controller.accepted, "proposed": controller.proposed,
                              "steps": {str(w): round(1000 * t, 1) for w, t in sorted(controller.step_seconds.items())},
                              "draft_ms": round(1000 * (controller.draft_seconds or 0), 1)}), flush=True)
    finally:
        model.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
