"""The client half of bench_wan.py: the real model's client in a lab host, timing what it is asked to.

``python benchmarks/wan_client.py PEER`` loads the client once, prints ``ready``, then reads one JSON
command per line on stdin and answers each with one JSON line:

- ``{"op": "decode", "allowed": [peer, ...], "push": bool, "tokens": N}``: the gaps between decode steps
  (ms) of one greedy generation of exactly N tokens through those servers;
- ``{"op": "prefill", "allowed": [...], "prompt_tokens": N}``: seconds to the first token of a greedy
  generation from an N-token prompt, and the greedy chat answer's tokens through the same servers.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import itertools

from decode_timing import timed_greedy


def main(peer: str) -> None:
    from distconf.client import AutoDistributedModelForCausalLM
    from distconf.sources import open_source
    from distconf.tools import real_model as rm

    source = open_source(rm.gguf_path())
    tokenizer = source.load_tokenizer()
    model = AutoDistributedModelForCausalLM.from_pretrained(source, initial_peers=[peer], dtype=torch.float32,
                                                            max_retries=3, show_route=False)
    prompt = rm.chat_ids(tokenizer, "Write a long story about a lighthouse keeper and a storm.")
    long_ids = tokenizer(rm.FIXED_TEXT * 40, return_tensors="pt")["input_ids"]
    print("ready", flush=True)
    try:
        for line in sys.stdin:
            command = json.loads(line)
            model.remote.manager.allowed = set(command["allowed"])
            model.config.use_server_to_server = bool(command.get("push", True))
            if command["op"] == "decode":
                tokens, stamps = timed_greedy(model, prompt, command["tokens"], full_length=True,
                                              pad_token_id=tokenizer.eos_token_id)
                gaps = [1000 * (b - a) for a, b in itertools.pairwise(stamps)]
                answer: dict[str, Any] = {"gaps_ms": gaps, "tokens": tokens}
            else:
                ids = long_ids[:, : command["prompt_tokens"]]
                start = time.perf_counter()
                _, stamps = timed_greedy(model, ids, 1, pad_token_id=tokenizer.eos_token_id)
                answer = {"first_token_s": stamps[0] - start,
                          "answer": rm.greedy_answer(model, tokenizer, max_new_tokens=24)[1]}
            print(json.dumps(answer), flush=True)
    finally:
        model.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
