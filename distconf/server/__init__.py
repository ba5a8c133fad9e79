"""``distconf serve``: a block server speaking the Petals 2.x protocol.

- `server`: `BlockServer` / `ServeOptions` (DHT presence, loading, announcements, lifecycle);
- `loading`: planning and placing a span, loading blocks with progress, measuring throughput
  (shared with the demo's servers);
- `handler`: the P2P servicer (``rpc_info``, ``rpc_forward``/``_stream``,
  ``rpc_backward``/``_stream``, ``rpc_inference``, ``rpc_push``), with its `settings`;
- `sessions` and `inference`: the one owner of open inference sessions (registry, push
  queues, de-duplication by session id) and the messages a session reads;
- `compute`: forward, backward and cached inference steps on the blocks;
- `memory`: the one KV-cache budget shared by all sessions;
- `validation`: the checks that turn a bad request into a clear error for its caller.

Importing this package is cheap; torch and hivemind are imported by the modules that need them.
"""

from distconf.server.block_server import BlockServer, ServeOptions, hub_repository

__all__ = ["BlockServer", "ServeOptions", "hub_repository"]
