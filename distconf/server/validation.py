"""Checks on what a caller sends, each failing with a `RequestError` that says what is wrong.

A bad request gets its error and nothing else changes on the server.
"""

from __future__ import annotations

import math
import re
import reprlib
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from distconf.rpc.protocol import (
    KEY_ACTIVE_ADAPTER,
    KEY_ARGS_STRUCTURE,
    KEY_NEXT_SERVERS,
    NOT_SERVED,
    ProtocolError,
    is_dummy,
    parse_chain,
    split_chain,
    unpack_args_kwargs,
)
from distconf.server.compute import ServedBlock

__all__ = ["MAX_ID_CHARS", "MAX_NEXT_SERVERS", "MAX_PEER_ID_CHARS", "RequestError", "check_adapter", "check_hidden",
           "check_hypo_ids", "check_id", "check_peer_id", "check_prompts", "metadata_int", "metadata_number",
           "next_servers", "served_chain", "unpack_tensors"]

MAX_PEER_ID_CHARS = 128
"""Longest base58 peer id accepted (an Ed25519 id has 52 characters, an RSA one 46): decoding base58
costs the square of its length, so a longer one is refused before it is decoded."""
MAX_ID_CHARS = 256
"""Longest session id or step id accepted (Petals sends 36-character uuids)."""
MAX_NEXT_SERVERS = 256
"""Most entries of ``next_servers`` (one per later span of the caller's chain)."""
_BASE58 = re.compile(r"[1-9A-HJ-NP-Za-km-z]+")


class RequestError(ValueError):
    """A request this server refuses (the message is sent back to the caller)."""


def served_chain(blocks: Mapping[str, ServedBlock], uids: str) -> list[ServedBlock]:
    """The served ``blocks`` named by a chain string, in order; `RequestError` if unknown or not consecutive."""
    names = split_chain(uids)
    if not names:
        raise RequestError("the request names no block uid")
    for uid in names:
        if uid not in blocks:
            raise RequestError(f"{NOT_SERVED} {uid[:120]}")
    try:
        parse_chain(uids)
    except ProtocolError as exc:
        raise RequestError(str(exc)) from None
    return [blocks[uid] for uid in names]


def unpack_tensors(flat: Sequence[torch.Tensor], metadata: dict[str, Any], names: Sequence[str]
                   ) -> list[torch.Tensor | None]:
    """The positional tensors ``names`` of a request (restored with ``args_structure`` when given).

    Missing trailing tensors are None; DUMMY tensors are returned as they are.
    """
    structure = metadata.get(KEY_ARGS_STRUCTURE)
    if structure is not None:
        try:
            args, _ = unpack_args_kwargs(flat, structure)
        except ProtocolError as exc:
            raise RequestError(str(exc)) from None
    else:
        args = tuple(flat)
    if not args or not all(isinstance(a, torch.Tensor) for a in args[: len(names)]):
        raise RequestError(f"expected tensors ({', '.join(names)}), got {[type(a).__name__ for a in args]}")
    return [args[i] if i < len(args) else None for i in range(len(names))]


def check_hidden(name: str, tensor: torch.Tensor | None, hidden_size: int, dtype: torch.dtype, *,
                 batch: int | None = None, allow_empty: bool = False) -> torch.Tensor:
    """A ``[batch, seq, hidden_size]`` floating, finite tensor, cast to ``dtype``."""
    if tensor is None:
        raise RequestError(f"{name} is missing")
    if not tensor.is_floating_point():
        raise RequestError(f"{name} must be a floating-point tensor, got dtype {tensor.dtype}")
    if tensor.ndim != 3:
        raise RequestError(f"{name} must have 3 dimensions [batch, seq, hidden], got shape {tuple(tensor.shape)}")
    if tensor.shape[2] != hidden_size:
        raise RequestError(f"{name} has hidden size {tensor.shape[2]}; the blocks take {hidden_size}")
    if tensor.shape[0] < 1:
        raise RequestError(f"{name} has batch size 0")
    if batch is not None and tensor.shape[0] != batch:
        raise RequestError(f"{name} has batch size {tensor.shape[0]}; this session was opened with {batch}")
    if tensor.shape[1] == 0 and not allow_empty:
        raise RequestError(f"{name} has no tokens")
    if not torch.isfinite(tensor).all():
        raise RequestError(f"{name} contains NaN or infinite values")
    return tensor.to(dtype)


def check_prompts(prompts: torch.Tensor | None, num_blocks: int, batch: int, hidden_size: int,
                  dtype: torch.dtype, max_tokens: int | None) -> list[torch.Tensor | None]:
    """Per-block deep prompts from ``[num_blocks, batch or 1, pre_seq_len, hidden]`` (or a DUMMY)."""
    if prompts is None or is_dummy(prompts):
        return [None] * num_blocks
    if not prompts.is_floating_point():
        raise RequestError(f"prompts must be a floating-point tensor, got dtype {prompts.dtype}")
    shape = tuple(prompts.shape)
    if (prompts.ndim != 4 or shape[0] != num_blocks or shape[1] not in (1, batch) or shape[3] != hidden_size):
        raise RequestError(f"prompts must have shape [{num_blocks}, {batch} or 1, pre_seq_len, {hidden_size}] "
                           f"(blocks, batch, tokens, hidden), got {list(shape)}")
    if max_tokens is not None and shape[2] > max_tokens:
        raise RequestError(f"prompts cover {shape[2]} tokens but the input has only {max_tokens}")
    if not torch.isfinite(prompts).all():
        raise RequestError("prompts contain NaN or infinite values")
    return [p for p in prompts.to(dtype)]


def check_hypo_ids(hypo_ids: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """``hypo_ids``: None for a DUMMY, else int64 ``[batch]`` with values in ``[0, batch)``."""
    if hypo_ids is None or is_dummy(hypo_ids):
        return None
    if hypo_ids.dtype != torch.int64:
        raise RequestError(f"hypo_ids must be int64, got {hypo_ids.dtype}")
    if hypo_ids.ndim != 1 or hypo_ids.shape[0] != batch:
        raise RequestError(f"hypo_ids must have shape [{batch}], got {list(hypo_ids.shape)}")
    if bool(((hypo_ids < 0) | (hypo_ids >= batch)).any()):
        raise RequestError(f"hypo_ids must be in [0, {batch}), got {hypo_ids.tolist()[:16]}")
    return hypo_ids


def metadata_int(metadata: dict[str, Any], key: str, *, low: int, high: int, default: Any = ...) -> Any:
    """An integer metadata field in ``[low, high]`` (``default`` when absent or None; required without one)."""
    value = metadata.get(key)
    if value is None:
        if default is ...:
            raise RequestError(f"metadata must contain an integer {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"metadata {key!r} must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise RequestError(f"metadata {key!r}={value} is out of range [{low}, {high}]")
    return value


def metadata_number(metadata: dict[str, Any], key: str, default: float) -> float:
    """A finite number >= 0 from metadata (``default`` when absent or None)."""
    value = metadata.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise RequestError(f"metadata {key!r} must be a finite number >= 0, got {value!r}")
    return float(value)


def check_peer_id(value: Any, what: str) -> str:
    """A base58 peer id of at most `MAX_PEER_ID_CHARS` characters (checked before anything decodes it)."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_PEER_ID_CHARS or not _BASE58.fullmatch(value):
        shown = f"{len(value)} characters" if isinstance(value, str) else type(value).__name__
        raise RequestError(f"{what} must be a base58 peer id of at most {MAX_PEER_ID_CHARS} characters, got {shown}")
    return value


def check_id(value: Any, key: str, types: tuple[type, ...] = (str,)) -> Any:
    """A session or step id: None, or a value of ``types`` of at most `MAX_ID_CHARS` characters (bytes)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, types):
        raise RequestError(f"metadata {key!r} must be a string, got {type(value).__name__}")
    if isinstance(value, (str, bytes)) and len(value) > MAX_ID_CHARS:
        raise RequestError(f"metadata {key!r} has {len(value)} characters; at most {MAX_ID_CHARS} are accepted")
    return value


def next_servers(value: Any) -> list[tuple[str, str, int, int]]:
    """Validate ``next_servers``: a list of ``(peer_id_base58, session_id, start, end)`` (peer ids checked
    with `check_peer_id`, session ids with `check_id`)."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or len(value) > MAX_NEXT_SERVERS:
        raise RequestError(f"metadata {KEY_NEXT_SERVERS!r} must be a list of (peer_id, session_id, start, end)")
    out = []
    for item in value:
        ok = isinstance(item, (list, tuple)) and len(item) == 4
        if ok:
            peer, session, start, end = item
            ok = (isinstance(peer, str) and isinstance(session, str) and isinstance(start, int)
                  and isinstance(end, int) and not isinstance(start, bool) and not isinstance(end, bool)
                  and 0 <= start < end)
        if not ok:
            raise RequestError(f"metadata {KEY_NEXT_SERVERS!r} entry {reprlib.repr(item)} is not (peer_id, session_id, "
                               "start, end)")
        check_peer_id(peer, f"metadata {KEY_NEXT_SERVERS!r} peer")
        check_id(session, f"{KEY_NEXT_SERVERS} session_id")
        out.append((peer, session, start, end))
    return out


def check_adapter(metadata: dict[str, Any], served: Collection[str] = ()) -> str | None:
    """The LoRA adapter a request asks for (Petals' ``active_adapter``; None or "": the base model), one of
    ``served``; a request naming another is refused rather than run without it."""
    adapter = metadata.get(KEY_ACTIVE_ADAPTER)
    if adapter is None or adapter == "":
        return None
    if not isinstance(adapter, str):
        raise RequestError(f"metadata {KEY_ACTIVE_ADAPTER!r} is a {type(adapter).__name__}, not a string")
    if adapter not in served:
        held = f"it serves {', '.join(map(repr, sorted(served)))}" if served else "this server has no adapters"
        raise RequestError(f"adapter {reprlib.repr(adapter)} is not served here ({held})")
    return adapter
