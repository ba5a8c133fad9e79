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

Importing this package is cheap (the command line imports `distconf.server.ready` without torch): torch and
hivemind are imported by the modules that need them, and `BlockServer` on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distconf.server.block_server import BlockServer, ServeOptions, hub_repository

__all__ = ["BlockServer", "ServeOptions", "hub_repository"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from distconf.server import block_server

        return getattr(block_server, name)
    raise AttributeError(f"module 'distconf.server' has no attribute {name!r}")
