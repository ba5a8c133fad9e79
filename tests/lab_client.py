"""A client run inside a lab host: the real model's greedy chat answer through the swarm, as one JSON line.

``python tests/lab_client.py '{"peers": [...], ...}'`` prints ``{"tokens": [...], "text": ..., "seconds": ...,
"failovers": ..., "killed": ...}`` or ``{"error": ...}``. Options: ``allowed_servers``, ``max_retries``,
``kill_after`` (a number of new tokens) with ``pids`` (peer id -> pid): the server of the last span is
SIGKILLed (its process group) once that many tokens are out, to show a failover across hosts;
``max_new_tokens``; ``client`` (more client config fields). ``records`` in the result: each server's
``using_relay``, ``throughput``, ``forward_rps`` and ``state`` as the DHT says after the generation.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any


def main(options: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    from distconf.client import AutoDistributedModelForCausalLM
    from distconf.sources import open_source
    from distconf.tools import real_model as rm

    source = open_source(rm.gguf_path())
    tokenizer = source.load_tokenizer()
    fields = {"max_retries": options.get("max_retries", 3), "min_backoff": 0.2, **options.get("client", {})}
    if options.get("allowed_servers"):
        fields["allowed_servers"] = options["allowed_servers"]
    model = AutoDistributedModelForCausalLM.from_pretrained(source, initial_peers=options["peers"],
                                                            dtype=torch.float32, **fields)
    ids = rm.chat_ids(tokenizer)
    killed: list[str] = []
    pids: dict[str, int] = options.get("pids", {})

    class KillLastSpan(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if not killed and options.get("kill_after") and input_ids.shape[1] == ids.shape[1] + options["kill_after"]:
                victim = cache.session.sessions[-1].peer_id
                os.killpg(pids[victim], signal.SIGKILL)
                killed.append(victim)
            return scores

    try:
        start = time.perf_counter()
        with torch.no_grad(), model.inference_session(ids.shape[1] + 64) as cache:
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=options.get(
                "max_new_tokens", 24), do_sample=False, cache=cache, logits_processor=LogitsProcessorList(
                [KillLastSpan()]))
            failovers = cache.session.failovers
        tokens = out[0, ids.shape[1]:].tolist()
        state = model.remote.manager.update(force=True)
        records = {s.peer_id: {"using_relay": s.info.using_relay, "throughput": s.info.throughput,
                               "forward_rps": s.info.forward_rps, "state": int(s.info.state)} for s in state.spans}
        return {"tokens": tokens, "text": tokenizer.decode(tokens, skip_special_tokens=True).strip(),
                "seconds": time.perf_counter() - start, "failovers": failovers, "killed": killed,
                "records": records}
    finally:
        model.shutdown()


if __name__ == "__main__":
    try:
        result = main(json.loads(sys.argv[1]))
    except Exception as exc:  # the test reads the error from the JSON line
        result = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result), flush=True)
