"""A local swarm on 127.0.0.1: real DHT, server processes loading real weights, a client.

`run_swarm_demo` (called by ``distconf demo``) does, within a bounded time:

1. writes a tiny checkpoint of a family (its family file's ``tiny_config``, with 8
   layers; random weights, real safetensors) and saves its distributed config with a
   ``dht_prefix`` next to it (`model`);
2. starts a bootstrap DHT node on 127.0.0.1 (`orchestrator`);
3. starts several server *processes* (``python -m distconf.tools.demo serve ...``,
   `server`). Each joins the DHT, reads the swarm, sizes itself with `plan_server` for
   its memory budget, picks its span with `choose_blocks` (weakest window), announces
   JOINING, loads the real weights of its blocks with `distconf.blocks.weights.load_block`,
   runs them once to measure a throughput, and announces ONLINE;
4. a client that knows only the DHT prefix reads the block count from the model
   listing, finds the servers in one batched request, prints the coverage and route;
   then one server leaves (announcing OFFLINE) and the client reports the gap;
5. stops every server (they announce OFFLINE) and the DHT nodes.

Servers are started together (imports overlap) but choose their blocks one after
another, so each sees its predecessors: that is what the placement rule needs. The
orchestrator talks to each server over a one-line-per-message protocol on its
stdin/stdout (`process`).
"""

from distconf.tools.demo.model import DEMO_LAYERS, demo_family, demo_prefix, make_tiny_checkpoint
from distconf.tools.demo.orchestrator import run_swarm_demo
from distconf.tools.demo.server import serve

__all__ = ["DEMO_LAYERS", "demo_family", "demo_prefix", "make_tiny_checkpoint", "run_swarm_demo", "serve"]
