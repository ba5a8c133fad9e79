"""Weight commitments: a manifest of per-block weight digests, and the servers a client refuses by it.

``distconf manifest MODEL`` writes a `WeightsManifest` (JSON: `MANIFEST_FORMAT`, version
`MANIFEST_VERSION`, the model's ``dht_prefix``, ``num_blocks``, and per weights form such as
``"float32"`` or ``"bfloat16+int8"`` the sha256 of every block, `distconf.server.integrity.block_digests`).
Servers announce the same digests in ``rpc_info`` (``block_sha256``, ``weights_form``).
A client whose ``weights_manifest`` names such a file refuses, for its lifetime, every server
whose announced digests for the form it serves differ from the manifest's on a block of its
span, or that announces no digests or a form the manifest lacks (`check_server`, `Commitments`). A manifest may
also list LoRA adapters (``adapters``: name -> the sha256 of its tensors for every block,
`distconf.blocks.lora.layer_digest`); a client using an adapter refuses, for that adapter, servers whose announced
``adapter_sha256`` differ, and every server when the manifest does not list the adapter.

An announced digest is a claim a server makes about itself: a server that lies about its
weights passes this check; the client's spot checks (``verify_fraction``) are what catch it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distconf.errors import ConfigValueError

__all__ = ["MANIFEST_FORMAT", "MANIFEST_VERSION", "Commitments", "ManifestError", "WeightsManifest",
           "check_server", "read_manifest", "write_manifest"]

logger = logging.getLogger(__name__)

MANIFEST_FORMAT = "distconf-weights-manifest"
"""The manifest's ``format`` tag."""
MANIFEST_VERSION = 1
"""The manifest format version this code writes and reads."""
MAX_MANIFEST_BYTES = 64 * 2**20
"""A larger file is refused unread (a manifest holds 65 bytes per block and form)."""
_HEX = re.compile(r"[0-9a-f]{64}")


class ManifestError(ConfigValueError):
    """A weights manifest that cannot be used; the message names the file and what is wrong."""


@dataclass(frozen=True)
class WeightsManifest:
    """Per-block weight digests of one model, per weights form (see the module docstring)."""

    dht_prefix: str
    num_blocks: int
    forms: Mapping[str, tuple[str, ...]]
    model: str = ""
    path: str | None = field(default=None, compare=False)
    adapters: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """LoRA adapter name -> the sha256 of its tensors for every block (any weights form)."""

    def to_dict(self) -> dict[str, Any]:
        """The manifest's JSON object."""
        out = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "model": self.model,
               "dht_prefix": self.dht_prefix, "num_blocks": self.num_blocks,
               "forms": {form: list(digests) for form, digests in sorted(self.forms.items())}}
        if self.adapters:
            out["adapters"] = {name: list(digests) for name, digests in sorted(self.adapters.items())}
        return out


def _problem(path: str | os.PathLike[str], what: str) -> ManifestError:
    return ManifestError(f"weights manifest {os.fspath(path)}: {what}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_manifest(data: Any, path: str | os.PathLike[str]) -> WeightsManifest:
    """The `WeightsManifest` of a decoded JSON value; `ManifestError` naming ``path`` and the first problem."""
    if not isinstance(data, dict):
        raise _problem(path, f"expected a JSON object, got {type(data).__name__}")
    if data.get("format") != MANIFEST_FORMAT:
        raise _problem(path, f"'format' is {data.get('format')!r}, not {MANIFEST_FORMAT!r} (not a manifest "
                             "written by `distconf manifest`)")
    if not _is_int(data.get("version")) or data["version"] != MANIFEST_VERSION:
        raise _problem(path, f"'version' is {data.get('version')!r}; this distconf reads version {MANIFEST_VERSION}")
    prefix, model, num_blocks = data.get("dht_prefix"), data.get("model", ""), data.get("num_blocks")
    if not isinstance(prefix, str) or not prefix:
        raise _problem(path, "'dht_prefix' must be a non-empty string")
    if not isinstance(model, str):
        raise _problem(path, "'model' must be a string")
    if not _is_int(num_blocks) or num_blocks < 1:
        raise _problem(path, f"'num_blocks' must be a positive integer, got {num_blocks!r}")
    forms = data.get("forms")
    if not isinstance(forms, dict) or not forms:
        raise _problem(path, "'forms' must be a non-empty object (weights form -> list of block digests)")
    parsed: dict[str, tuple[str, ...]] = {}
    for form, digests in forms.items():
        if not form:
            raise _problem(path, "a weights form has an empty name")
        if not isinstance(digests, list) or len(digests) != num_blocks:
            size = len(digests) if isinstance(digests, list) else type(digests).__name__
            raise _problem(path, f"form {form!r}: expected a list of {num_blocks} block digests, got {size}")
        for i, digest in enumerate(digests):
            if not isinstance(digest, str) or not _HEX.fullmatch(digest):
                raise _problem(path, f"form {form!r}, block {i}: {str(digest)[:80]!r} is not a sha256 hex digest "
                                     "(64 lowercase hex digits)")
        parsed[form] = tuple(digests)
    adapters = data.get("adapters", {})
    if not isinstance(adapters, dict):
        raise _problem(path, "'adapters' must be an object (adapter name -> list of block digests)")
    parsed_adapters: dict[str, tuple[str, ...]] = {}
    for name, digests in adapters.items():
        if not name or not isinstance(digests, list) or len(digests) != num_blocks or not all(
                isinstance(d, str) and _HEX.fullmatch(d) for d in digests):
            raise _problem(path, f"adapter {str(name)[:80]!r}: expected a list of {num_blocks} sha256 hex digests")
        parsed_adapters[name] = tuple(digests)
    return WeightsManifest(dht_prefix=prefix, num_blocks=num_blocks, forms=parsed, model=model, path=os.fspath(path),
                           adapters=parsed_adapters)


def read_manifest(path: str | os.PathLike[str]) -> WeightsManifest:
    """Read and validate the manifest at ``path``; `ManifestError` naming the file and what is wrong."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise _problem(path, f"cannot be read: {exc.strerror or exc}") from None
    if len(raw) > MAX_MANIFEST_BYTES:
        raise _problem(path, f"larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise _problem(path, f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise _problem(path, f"not JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    return parse_manifest(data, path)


def write_manifest(manifest: WeightsManifest, path: str | os.PathLike[str]) -> Path:
    """Write ``manifest`` to ``path`` atomically (a temporary file in the same folder, then renamed)."""
    target = Path(path)
    text = json.dumps(manifest.to_dict(), indent=1) + "\n"
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as an ordinary new file (mkstemp makes it private)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def check_server(manifest: WeightsManifest, info: Mapping[str, Any], start: int, end: int,
                 adapter: str | None = None) -> str | None:
    """Why a server whose ``rpc_info`` is ``info`` is refused for blocks ``start..end-1`` (through the LoRA
    ``adapter``), or None if it is not.

    Refused: no weights form or no block digests announced, a form the manifest lacks,
    digests that do not cover the span, or one block's digest unlike the manifest's; with an adapter, the same
    for its digests (``adapter_sha256``), and an adapter the manifest does not list.
    """
    reason = _check_blocks(manifest, info, start, end)
    if reason is not None or adapter is None:
        return reason
    if adapter not in manifest.adapters:
        return f"the manifest lists no digests for adapter {adapter!r}"
    announced = info.get("adapter_sha256")
    digests = announced.get(adapter) if isinstance(announced, dict) else None
    first = info.get("start_block")
    if not isinstance(digests, (list, tuple)) or not _is_int(first) or not first <= start < end <= first + len(digests):
        return f"it announces no digests of adapter {adapter!r} for blocks {start}..{end - 1} (adapter_sha256)"
    for i in range(start, end):
        if digests[i - first] != manifest.adapters[adapter][i]:
            return (f"block {i}: its announced sha256 of adapter {adapter!r} {str(digests[i - first])[:16]}... "
                    f"differs from the manifest's {manifest.adapters[adapter][i][:16]}...")
    return None


def _check_blocks(manifest: WeightsManifest, info: Mapping[str, Any], start: int, end: int) -> str | None:
    """`check_server`'s judgement of the base weights."""
    form = info.get("weights_form")
    if not isinstance(form, str) or not form:
        return "it announces no weights form (a server without per-block weight digests)"
    if form not in manifest.forms:
        return (f"it serves weights form {form!r}, which the manifest has no digests for "
                f"(it has {', '.join(sorted(manifest.forms))})")
    digests, first = info.get("block_sha256"), info.get("start_block")
    if digests is None:
        return "it announces no per-block weight digests (block_sha256; started with --no-block-digests?)"
    if not isinstance(digests, (list, tuple)) or not _is_int(first) or not all(isinstance(d, str) for d in digests):
        return "its block_sha256 / start_block are malformed"
    if not first <= start < end <= first + len(digests) or end > manifest.num_blocks:
        return f"its digests cover blocks {first}..{first + len(digests) - 1}, not its span {start}..{end - 1}"
    expected = manifest.forms[form]
    for i in range(start, end):
        announced = digests[i - first]
        if announced != expected[i]:
            return (f"block {i}: its announced sha256 {announced[:16]}... differs from the manifest's "
                    f"{expected[i][:16]}... ({form})")
    return None


def _covers(info: Mapping[str, Any], start: int, end: int) -> bool:
    """Whether ``info`` speaks of blocks ``start..end-1`` (else it may predate a span move)."""
    first, last = info.get("start_block"), info.get("end_block")
    return _is_int(first) and _is_int(last) and first <= start and end <= last


class Commitments:
    """The servers one client refuses by its weights manifest (for the client's lifetime).

    `left_out` is called with each swarm state a route is planned on: it fetches (once, in
    parallel) the ``rpc_info`` of ONLINE servers not judged yet, judges them with
    `check_server`, logs each refusal once at WARNING, and returns the peers to leave out:
    those refused, and for now those whose ``rpc_info`` could not be read.
    """

    def __init__(self, manifest: WeightsManifest, dht_prefix: str, num_blocks: int) -> None:
        """Raises `ManifestError` if ``manifest`` is for another model (prefix or number of blocks)."""
        where = manifest.path or "(in memory)"
        if manifest.dht_prefix != dht_prefix:
            raise _problem(where, f"it is for model {manifest.dht_prefix!r}, not {dht_prefix!r}")
        if manifest.num_blocks != num_blocks:
            raise _problem(where, f"it has {manifest.num_blocks} blocks, the model {num_blocks}")
        self.manifest = manifest
        self.refused: dict[str, str] = {}
        """Refused peer id -> the reason (never forgotten)."""
        self.refused_for: dict[str, dict[str, str]] = {}
        """LoRA adapter -> {peer refused for sessions of that adapter: the reason} (its base weights may be fine)."""
        self._accepted: set[tuple[str, int, int, str | None]] = set()
        self._unreadable: dict[str, float] = {}  # peer -> when to try its rpc_info again
        self._lock = threading.Lock()

    @classmethod
    def for_config(cls, config: Any, dht_prefix: str, num_blocks: int) -> Commitments | None:
        """The commitments of ``config.weights_manifest`` (None when it names no manifest)."""
        path = getattr(config, "weights_manifest", None)
        return None if path is None else cls(read_manifest(path), dht_prefix, num_blocks)

    def left_out(self, manager: Any, spans: Iterable[Any]) -> set[str]:
        """Peers of ``spans`` a route must not use (see the class docstring).

        ``manager`` is the `distconf.client.sequence_manager.SequenceManager`: its ``rpc_infos``
        cache is filled, its ``swarm`` reached, its ``usable`` filter and config applied.
        """
        now = time.monotonic()
        adapter = manager.adapter
        refused_here = self.refusals(adapter)
        with self._lock:
            todo = [s for s in spans if manager.usable(s) and s.peer_id not in refused_here
                    and (s.peer_id, s.start, s.end, adapter) not in self._accepted]
            stale = [s for s in todo if s.peer_id in manager.rpc_infos
                     and not _covers(manager.rpc_infos[s.peer_id], s.start, s.end)]
            for span in stale:  # the server moved since its info was read
                manager.rpc_infos.pop(span.peer_id, None)
            wanted = {s.peer_id: s for s in todo if s.peer_id not in manager.rpc_infos
                      and self._unreadable.get(s.peer_id, -1.0) <= now}
            manager.rpc_infos.update(self._fetch(manager, list(wanted.values())))
            skipped: set[str] = set()
            for span in todo:
                info = manager.rpc_infos.get(span.peer_id)
                if info is None:
                    skipped.add(span.peer_id)
                    continue
                reason = check_server(self.manifest, info, span.start, span.end)
                if reason is None and adapter is not None:
                    adapter_reason = check_server(self.manifest, info, span.start, span.end, adapter)
                    if adapter_reason is not None:
                        self.refused_for.setdefault(adapter, {})[span.peer_id] = adapter_reason
                        logger.warning("refusing server %s (blocks %d..%d) for adapter %r: %s (weights manifest %s)",
                                       span.peer_id, span.start, span.end - 1, adapter, adapter_reason,
                                       self.manifest.path)
                        continue
                if reason is None:
                    self._accepted.add((span.peer_id, span.start, span.end, adapter))
                elif not _covers(info, span.start, span.end):
                    skipped.add(span.peer_id)  # its records and its info disagree: judged once they agree
                else:
                    self.refused[span.peer_id] = reason
                    logger.warning("refusing server %s (blocks %d..%d) for this client's lifetime: %s "
                                   "(weights manifest %s)", span.peer_id, span.start, span.end - 1, reason,
                                   self.manifest.path)
            return self.refusals(adapter) | skipped

    def refusals(self, adapter: str | None) -> set[str]:
        """Peers refused for sessions of ``adapter`` (None: the base model): for their weights, or the adapter's."""
        return set(self.refused) | set(self.refused_for.get(adapter, {}) if adapter is not None else ())

    def _fetch(self, manager: Any, spans: list[Any]) -> dict[str, dict[str, Any]]:
        """``rpc_info`` of each span's server, read in parallel; an unreadable one is retried after
        ``update_period``."""
        if not spans:
            return {}
        from distconf.rpc.calls import call_info
        from distconf.rpc.protocol import chain_uid

        swarm, timeout = manager.swarm, float(manager.config.request_timeout)

        async def gather() -> list[Any]:
            calls = [call_info(swarm.p2p, s.peer_id, chain_uid(manager.dht_prefix, s.start, s.start + 1),
                               timeout=timeout) for s in spans]
            return await asyncio.gather(*calls, return_exceptions=True)

        try:
            results = swarm.run(gather(), timeout=timeout + 1)
        except Exception as exc:  # the whole call timed out: every one is unreadable for now
            results = [exc] * len(spans)
        infos: dict[str, dict[str, Any]] = {}
        retry = time.monotonic() + float(manager.config.update_period)
        for span, result in zip(spans, results):
            if isinstance(result, dict):
                infos[span.peer_id] = result
            else:
                self._unreadable[span.peer_id] = retry
                logger.info("server %s left out for now: its rpc_info could not be read to check its weight "
                            "digests (%r)", span.peer_id, result)
        return infos
