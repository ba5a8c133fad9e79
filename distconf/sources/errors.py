"""`ModelSourceError`: the one error a model source that cannot be served raises."""

from __future__ import annotations

__all__ = ["ModelSourceError"]

_MAX_REASON = 1000


class ModelSourceError(ValueError):
    """A model source (a folder, a GGUF file, a hub id) cannot be served; names the source and why.

    ``source`` is what the user named, ``reason`` one sentence (cut to a bounded length:
    reasons may quote a third-party error about an untrusted file).
    """

    def __init__(self, source: object, reason: str) -> None:
        self.source = str(source)
        reason = str(reason)
        self.reason = reason if len(reason) <= _MAX_REASON else reason[: _MAX_REASON - 3] + "..."
        super().__init__(f"{self.source}: cannot be served: {self.reason}")
