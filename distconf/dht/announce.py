"""Server side of discovery: announce the blocks a server holds on a hivemind DHT.

A server stores, for every block uid it serves, one record under its own subkey (its
peer id in base58; on a node started with ``signed_records=True``, its peer id followed
by its owner key, and the record is signed) and lists the model under ``_petals.models``
(unless the prefix is private, i.e. starts with ``_``), with ``repository`` set to
``https://huggingface.co/<hub id>`` when the config was loaded by hub id (as Petals 2.x
servers do) or from a Hugging Face cache snapshot. Records expire; `BlockAnnouncer`
refreshes them every ``update_period`` seconds until stopped.

hivemind is imported lazily: importing this module stays cheap.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distconf.dht.records import MODELS_REGISTRY_KEY, ModelInfo, ServerInfo, ServerState
from distconf.loader.config_protocol import DistributedConfig
from distconf.loader.naming import block_uids, config_dht_prefix, config_num_blocks

if TYPE_CHECKING:  # pragma: no cover
    from hivemind import DHT
    from hivemind.dht import DHTNode

__all__ = [
    "MAX_EXPIRATION", "MAX_RECORD_BYTES", "BlockAnnouncer", "announce_blocks", "default_expiration", "hub_repository",
    "record_subkey",
]

logger = logging.getLogger(__name__)

MAX_EXPIRATION = 7 * 24 * 3600.0
"""Longest record lifetime accepted by `announce_blocks` (seconds)."""
MAX_RECORD_BYTES = 2048
"""Largest serialized server record `announce_blocks` sends. hivemind hands work to its
DHT process through a pipe it reads non-blocking, from several threads; messages under
the 4 KiB atomic pipe-write size stay whole."""
MIN_EXPIRATION = 3.0
"""Shortest default lifetime: covers clock discrepancies between peers (as in Petals 2.x)."""


_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})?")
_CACHE_SNAPSHOT = re.compile(r"models--([^/\\]+)--([^/\\]+)[/\\]snapshots[/\\]")


def hub_repository(name_or_path: str | os.PathLike[str] | None) -> str | None:
    """``https://huggingface.co/<org>/<name>`` of the Hub repository a model was loaded from, else None.

    ``name_or_path`` is what the model was loaded from: a hub id (``org/name``, not an
    existing local path), or a local directory inside a Hugging Face cache snapshot
    (``.../models--org--name/snapshots/<revision>``). Any other local path gives None.
    """
    if name_or_path is None:
        return None
    name = os.fspath(name_or_path)
    if not isinstance(name, str) or not name:
        return None
    if not os.path.exists(name):
        if not _HUB_ID.fullmatch(name) or ".." in name or "--" in name:
            return None
        return f"https://huggingface.co/{name}"
    match = _CACHE_SNAPSHOT.search(str(Path(name).resolve()) + "/")
    return f"https://huggingface.co/{match.group(1)}/{match.group(2)}" if match else None


def _loaded_from(config: DistributedConfig) -> str | None:
    """What ``config`` was loaded from (``name_or_path``), if it says."""
    name = getattr(config, "name_or_path", None)
    return name if isinstance(name, str) else None


def default_expiration(config: DistributedConfig) -> float:
    """Record lifetime used when none is given: ``max(2 * update_period, 3)`` seconds."""
    return max(2.0 * float(getattr(config, "update_period", 60)), MIN_EXPIRATION)


def _subkey(node: DHTNode) -> str:
    from distconf.dht.guard import install_guard

    guard = install_guard(node)
    peer = node.peer_id.to_base58()
    # on a signing node hivemind's RSASignatureValidator signs every record stored under this subkey
    return peer + guard.owner_marker if guard.signed else peer


async def _record_subkey(_dht: DHT, node: DHTNode) -> str:
    return _subkey(node)


def record_subkey(dht: DHT, timeout: float = 10.0) -> str:
    """The subkey ``dht``'s server records are stored under: its peer id, plus its owner key when signing."""
    return dht.run_coroutine(_record_subkey, return_future=True).result(timeout=timeout)


async def _store_records(
    dht: DHT,
    node: DHTNode,
    prefix: str,
    start: int,
    end: int,
    value: tuple,
    registry: tuple[str, dict] | None,
    expiration_time: float,
    num_blocks: int | None = None,
) -> dict[str, bool]:
    from distconf.dht.guard import install_guard

    install_guard(node).validator.register_model(prefix, num_blocks or end)
    peer = _subkey(node)
    uids = block_uids(prefix, start, end)  # built here: the pipe message stays small
    keys: list[Any] = list(uids)
    subkeys: list[Any] = [peer] * len(uids)
    values: list[Any] = [value] * len(uids)
    if registry is not None:
        keys.append(MODELS_REGISTRY_KEY)
        subkeys.append(registry[0])
        values.append(registry[1])
    num_workers = max(1, min(len(keys), dht.num_workers or len(keys)))
    result = await node.store_many(
        keys=keys, subkeys=subkeys, values=values, expiration_time=expiration_time, num_workers=num_workers
    )
    _leave_offline_will(node, (prefix, start, end), uids, peer, value, expiration_time, num_workers)
    return {str(k[0] if isinstance(k, tuple) else k): bool(v) for k, v in result.items()}


def _leave_offline_will(node: DHTNode, span: tuple[str, int, int], uids: list[str], peer: str, value: tuple,
                        expiration_time: float, num_workers: int) -> None:
    """In the DHT process: if the server dies unannounced, store ``span``'s records as OFFLINE (same lifetime).

    An OFFLINE announcement of ``span`` forgets the will. See `distconf.dht.node_process.set_last_will`.
    """
    from hivemind.utils import get_dht_time

    from distconf.dht.node_process import set_last_will

    if value[0] == ServerState.OFFLINE:
        set_last_will(span, None)
        return
    offline = (int(ServerState.OFFLINE), *value[1:])
    lifetime = max(expiration_time - get_dht_time(), MIN_EXPIRATION)

    async def store_offline() -> Any:
        return await node.store_many(keys=list(uids), subkeys=[peer] * len(uids), values=[offline] * len(uids),
                                     expiration_time=get_dht_time() + lifetime, num_workers=num_workers)

    set_last_will(span, store_offline)


def announce_blocks(
    dht: DHT,
    config: DistributedConfig,
    start: int,
    end: int,
    info: ServerInfo,
    expiration: float | None = None,
    *,
    repository: str | None = None,
    timeout: float | None = 30.0,
) -> dict[str, bool]:
    """Announce that this DHT peer serves blocks ``start..end-1`` of ``config``'s model.

    :param dht: a running ``hivemind.DHT``; records are stored under its peer id.
    :param config: a distributed config (needs ``dht_prefix`` and ``num_hidden_layers``).
    :param start: first block served. :param end: one past the last block served.
    :param info: the server record; its ``start_block``/``end_block`` are set to the span.
    :param expiration: lifetime of the records in **seconds from now** (not an absolute
        time); default `default_expiration` (``max(2 * update_period, 3)``).
    :param repository: stored in the ``_petals.models`` listing (public prefixes only);
        default: `hub_repository` of ``config.name_or_path`` (a hub id or a cache snapshot).
    :param timeout: give up waiting for the DHT after this many seconds.
    :returns: for each stored key (block uids, plus ``_petals.models`` when listed),
        whether the store succeeded.
    """
    from hivemind.utils import get_dht_time

    num_blocks = config_num_blocks(config)
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= num_blocks):
        raise ValueError(f"span {start}..{end} is not inside the model's {num_blocks} blocks (need 0 <= start < end)")
    if expiration is None:
        expiration = default_expiration(config)
    if not 0 < expiration <= MAX_EXPIRATION:
        raise ValueError(
            f"expiration={expiration!r} must be a lifetime in seconds in (0, {MAX_EXPIRATION:.0f}], "
            "not an absolute time"
        )
    from hivemind.utils.serializer import MSGPackSerializer

    prefix = config_dht_prefix(config)
    record = info.model_copy(update={"start_block": start, "end_block": end})
    record = ServerInfo.model_validate(record.model_dump())  # re-validate the updated copy
    size = len(MSGPackSerializer.dumps(record.to_wire()))
    if size > MAX_RECORD_BYTES:
        raise ValueError(f"server record is {size} bytes serialized; at most {MAX_RECORD_BYTES} are allowed")
    registry = None
    if not prefix.startswith("_"):  # private prefixes stay out of the listing, as in Petals 2.x
        if repository is None:
            repository = hub_repository(_loaded_from(config))
        registry = (prefix, ModelInfo(num_blocks=num_blocks, repository=repository).to_wire())
    expiration_time = get_dht_time() + expiration
    future = dht.run_coroutine(
        partial(
            _store_records,
            prefix=prefix,
            start=start,
            end=end,
            value=record.to_wire(),
            registry=registry,
            expiration_time=expiration_time,
            num_blocks=num_blocks,
        ),
        return_future=True,
    )
    try:
        result = future.result(timeout=timeout)
    except BaseException:
        future.cancel()
        raise
    failed = [k for k, ok in result.items() if not ok]
    if failed:
        logger.warning("announce of %s.%d..%d: %d of %d stores failed (%s...)", prefix, start, end - 1,
                       len(failed), len(result), failed[0])
    else:
        logger.debug("announced %s blocks %d..%d as %s until %.1f", prefix, start, end - 1,
                     record.state.name, expiration_time)
    return result


class BlockAnnouncer:
    """Keeps a server's records alive: announces now, then every ``update_period`` seconds.

    >>> announcer = BlockAnnouncer(dht, config, 0, 4, info)   # doctest: +SKIP
    >>> announcer.start(); ...; announcer.stop()              # doctest: +SKIP

    ``stop()`` re-announces the span as OFFLINE with the full lifetime (as Petals 2.x
    does on shutdown), so clients stop routing to it at once.
    """

    def __init__(
        self,
        dht: DHT,
        config: DistributedConfig,
        start: int,
        end: int,
        info: ServerInfo,
        *,
        update_period: float | None = None,
        expiration: float | None = None,
        repository: str | None = None,
    ) -> None:
        self.dht, self.config, self.start_block, self.end_block = dht, config, start, end
        self.info = info
        self.update_period = float(update_period if update_period is not None else config.update_period)
        self.expiration = expiration if expiration is not None else max(2 * self.update_period, MIN_EXPIRATION)
        self.repository = repository
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def announce(self, info: ServerInfo | None = None) -> dict[str, bool]:
        """Announce now (optionally with a new record, e.g. after switching to ONLINE).

        The lock guards the record only, not the DHT call: a refresh stuck on a slow DHT must
        not hold `stop` past its timeout.
        """
        with self._lock:
            if info is not None:
                self.info = info
            record = self.info
        return announce_blocks(self.dht, self.config, self.start_block, self.end_block, record,
                               self.expiration, repository=self.repository)

    def start(self) -> None:
        """Announce once (synchronously), then keep refreshing in a daemon thread."""
        self.announce()
        self._thread = threading.Thread(target=self._run, name="distconf-announcer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.update_period):
            try:
                self.announce()
            except Exception as e:
                if not self._stop.is_set():
                    logger.warning("refreshing DHT records failed: %s", e)

    def stop(self, offline: bool = True, timeout: float = 10.0) -> None:
        """Stop refreshing; if ``offline``, announce the span as OFFLINE; return within about ``timeout`` s.

        The OFFLINE records outlive any refresh still in flight by a second: hivemind keeps,
        per subkey, the value that expires last, so they must expire after the ONLINE ones.
        """
        deadline = time.monotonic() + timeout
        self._stop.set()
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()) / 2)  # the rest is the OFFLINE store's
        if offline:
            with self._lock:
                info = self.info.model_copy(update={"state": ServerState.OFFLINE})
            try:
                announce_blocks(self.dht, self.config, self.start_block, self.end_block, info,
                                min(self.expiration + 1.0, MAX_EXPIRATION), repository=self.repository,
                                timeout=max(0.5, deadline - time.monotonic()))
            except Exception as e:
                logger.warning("announcing OFFLINE failed: %s", e)
