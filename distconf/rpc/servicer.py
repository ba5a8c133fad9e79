"""The servicer interface of a block server: the ``rpc_*`` handlers both sides name.

hivemind turns each ``rpc_*`` method of a ``ServicerBase`` into a P2P handler named
``f"{class name}.{method}"``. `BlockServicer` declares the Petals 2.x set of handlers
under `HANDLER_CLASS_NAME` whatever the subclass is called, so a server implementing it
is reachable by Petals 2.x clients, and ``BlockServicer.get_stub(p2p, peer)`` reaches any
server speaking the protocol.
"""

from __future__ import annotations

from typing import AsyncIterator, Optional  # noqa: UP035 (hivemind reads typing.AsyncIterator hints)

from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto import runtime_pb2

from distconf.rpc.protocol import HANDLER_CLASS_NAME

__all__ = ["BlockServicer", "RPC_NAMES", "handle_name"]

RPC_NAMES = ("rpc_info", "rpc_forward", "rpc_forward_stream", "rpc_backward", "rpc_backward_stream",
             "rpc_inference", "rpc_push", "rpc_push_stream")
"""The handlers of a block server (``rpc_push_stream`` is distconf's own: Petals servers take ``rpc_push`` only)."""


def handle_name(method_name: str) -> str:
    """The p2p handler name of a block server's ``method_name`` (what hivemind's stubs and Petals call)."""
    return f"{HANDLER_CLASS_NAME}.{method_name}"


class BlockServicer(ServicerBase):
    """Declares the block server's RPCs (a server subclass implements them with the same signatures)."""

    @classmethod
    def _get_handle_name(cls, namespace: Optional[str], method_name: str) -> str:  # noqa: UP045 (hivemind's hint)
        # hivemind's hook for handler names (its servicer pattern): every subclass answers under Petals' names
        name = handle_name(method_name)
        return f"{namespace}::{name}" if namespace is not None else name

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        """Server and block information (msgpack dict in ``serialized_info``)."""
        raise NotImplementedError

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext
                          ) -> runtime_pb2.ExpertResponse:
        """Forward through a chain of blocks (unary)."""
        raise NotImplementedError

    async def rpc_forward_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                                 ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Forward through a chain of blocks (inputs and outputs split in parts)."""
        raise NotImplementedError
        yield  # pragma: no cover

    async def rpc_backward(self, request: runtime_pb2.ExpertRequest, context: P2PContext
                           ) -> runtime_pb2.ExpertResponse:
        """Gradients w.r.t. the inputs (and deep prompts) of a chain of blocks (unary)."""
        raise NotImplementedError

    async def rpc_backward_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                                  ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Gradients, stream form."""
        raise NotImplementedError
        yield  # pragma: no cover

    async def rpc_inference(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                            ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """A session over a chain of blocks with a server-side KV cache (one reply per step)."""
        raise NotImplementedError
        yield  # pragma: no cover

    async def rpc_push(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """Outputs of the previous server of a session's chain, fed into that session as a step."""
        raise NotImplementedError

    async def rpc_push_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                              ) -> runtime_pb2.ExpertResponse:
        """``rpc_push`` messages of any sessions on one long-lived stream from the previous server (distconf's
        extension: a unary push opens a stream per step, which costs more than a small model's step)."""
        raise NotImplementedError
