"""A block server: DHT node, loaded blocks, Petals 2.x handlers on the P2P daemon, announcements.

`BlockServer.start()` (= `join()` then `serve()`) joins (or starts) a DHT on the given host, plans and places its span,
announces JOINING, loads its blocks with progress, measures its throughput, registers its
handlers and announces ONLINE; records are refreshed every ``update_period`` with the cache
tokens left. `BlockServer.stop()` announces OFFLINE and releases everything. With
``verify_weights``, the served weights are hashed (`distconf.server.integrity.weights_digest`)
after loading and again at stop, and the server logs whether they are unchanged. With
``block_digests`` (the default), each block's digest (`distconf.server.integrity.block_digests`)
and the weights' form are announced in ``rpc_info`` (``block_sha256``, ``weights_form``): a
client given a ``distconf manifest`` refuses servers whose digests differ.
A server placed by the swarm (no ``blocks``) checks every ``mean_balance_check_period``
(randomized) whether moving would raise the swarm's throughput enough
(`distconf.server.rebalance`, Petals' ``--balance_quality``) and moves (`distconf.server.span_moves`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from distconf.dht import BlockAnnouncer, ServerInfo, ServerState, visible_maddrs
from distconf.dht.announce import hub_repository  # re-exported: distconf.server.hub_repository
from distconf.loader.config_protocol import DistributedConfig
from distconf.loader.layer_stack import model_layer
from distconf.loader.naming import config_num_blocks
from distconf.server.adapters import ServedAdapters, parse_adapters
from distconf.server.logfilter import install_refused_request_filter
from distconf.server.serve_options import ServeOptions  # re-exported: distconf.server.ServeOptions
from distconf.server.span_moves import SpanMoves

__all__ = ["BlockServer", "ServeOptions", "hub_repository"]

logger = logging.getLogger(__name__)

VERSION = "distconf"
RELAY_PENALTY = 0.2
"""A relayed server announces its throughput times this (Petals' ``relay_penalty``): routes prefer direct ones."""


class _LiveAnnouncer(BlockAnnouncer):
    """Refreshes the record's ``cache_tokens_left`` on every announcement."""

    def __init__(self, *args: Any, tokens_left: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tokens_left = tokens_left

    def announce(self, info: ServerInfo | None = None) -> dict[str, bool]:
        """Announce ``info`` (default: the current record) with the current cache tokens left."""
        base = self.info if info is None else info
        return super().announce(base.model_copy(update={"cache_tokens_left": int(self._tokens_left())}))


class BlockServer(SpanMoves):
    """One server process's blocks, handlers and DHT presence (see the module docstring)."""

    announcer_class = _LiveAnnouncer
    """The announcer of a span (a move announces its new span with one)."""

    def __init__(self, options: ServeOptions, config: DistributedConfig | None = None, *,
                 stop_event: threading.Event | None = None, source: Any = None) -> None:
        """``stop_event``: when set while blocks load, `serve` stops early (`InterruptedError`).

        ``source``: an opened `distconf.sources.ModelSource` (default: `join` opens
        ``options.model_dir``); ``config``: a distributed config whose weights are in
        ``options.model_dir`` (skips opening a source).
        """
        install_refused_request_filter()
        self.options = options
        self.config = config if config is not None or source is None else source.config
        self.source = source
        self.checkpoint_dir = str(source.checkpoint_dir) if source is not None else options.model_dir
        self.device: Any = None
        self.quant: str | None = None
        self.stop_event = stop_event
        self.dht: Any = None
        self.handler: Any = None
        self.announcer: _LiveAnnouncer | None = None
        self.rpc: Any = None
        self.executor: ThreadPoolExecutor | None = None
        self.start_block = self.end_block = 0
        self.throughput = 0.0
        self.forward_rps = 0.0  # measured forward tokens/s per block (sizes the default forward token cap)
        self.modules: list[Any] = []
        self.adapters: ServedAdapters | None = None  # --adapters, read once the span is known
        self.weights_sha256: str | None = None  # at load, with ``verify_weights``
        self.block_sha256: list[str] | None = None  # per served block, with ``block_digests``
        self.weights_form: str | None = None  # dtype (+ quantization) of the served weights
        self._rebalancer: threading.Thread | None = None
        self._rebalance_stop = threading.Event()
        self.using_relay = False  # reached through a libp2p circuit relay (peers cannot dial it directly)
        self.relay: str | None = None  # the relay that carried the relayed-path check
        self._reachability: Any = None  # answers Petals' rpc_check for servers that join later

    # ------------------------------------------------------------------ properties

    @property
    def peer_id(self) -> str:
        """This server's peer id (base58): the DHT node's."""
        return self.dht.peer_id.to_base58()

    @property
    def maddrs(self) -> list[str]:
        """Full multiaddrs other peers use to join through this server's DHT node."""
        return visible_maddrs(self.dht, latest=self.using_relay)

    def cache_tokens_left(self) -> int:
        """The DHT record's ``cache_tokens_left``: Petals 2.x units (2 x free bytes // KV bytes per token)."""
        if self.handler is None:
            return 2 * self.budget_bytes // max(self.kv_bytes_per_token, 1)
        return 2 * self.handler.budget.bytes_left // self.handler.max_kv_bytes_per_token

    # ------------------------------------------------------------------ start / stop

    def start(self) -> BlockServer:
        """Join the swarm, then load and serve (`join` + `serve`); returns once the server is ONLINE."""
        self.join()
        return self.serve()

    def join(self) -> BlockServer:
        """Read the config and start the DHT node (joining ``initial_peers`` or a new swarm)."""
        try:
            self._join()
        except BaseException:
            self.stop(offline=False)
            raise
        return self

    def serve(self) -> BlockServer:
        """Plan and place the span, announce JOINING, load, measure, register handlers, announce ONLINE."""
        try:
            self._serve()
        except BaseException:
            self.stop(offline=self.announcer is not None)
            raise
        self._start_rebalancing()
        return self

    def _join(self) -> None:
        import torch

        from distconf.blocks.device import default_quant, resolve_compute_dtype, resolve_device
        from distconf.blocks.quant import normalize_quant

        o = self.options
        if not o.initial_peers and not o.new_swarm:
            raise ValueError("give --initial-peers to join a swarm, or --new-swarm to start one")
        self.device = resolve_device(o.device)
        self.quant = normalize_quant(o.quant if o.quant is not None else default_quant(self.device))
        if self.config is None:
            from distconf.sources import open_source

            self.source = open_source(o.model_dir, dht_prefix=o.dht_prefix, hub=o.hub)
            self.config, self.checkpoint_dir = self.source.config, str(self.source.checkpoint_dir)
        self.dtype_name, why = resolve_compute_dtype(o.dtype, self.config, self.device)
        self.dtype = getattr(torch, self.dtype_name)
        logger.info("device %s, dtype %s (%s), quant %s", self.device, self.dtype_name, why, self.quant or "none")
        from distconf.server.integrity import weights_form

        self.weights_form = weights_form(self.dtype_name, self.quant, self.device.type)
        self._start_node([] if o.new_swarm else list(o.initial_peers))

    def _start_node(self, peers: list[str]) -> None:
        """Start the DHT node where peers can reach it, directly or relayed (`distconf.server.network`)."""
        from distconf.server.network import start_network

        node = start_network(self.options.network, peers, num_workers=max(1, config_num_blocks(self.config)))
        self.dht, self.rpc, self.using_relay, self.relay = node.dht, node.rpc, node.using_relay, node.relay
        self._reachability = node.reachability

    def _serve(self) -> None:
        from distconf.blocks.quant import petals_quant_type
        from distconf.blocks.sizing import kv_cache_bytes_per_token
        from distconf.server.loading import plan_span

        if self.dht is None:
            self.join()
        o, config, dtype_name = self.options, self.config, self.dtype_name
        memory: int | str = o.memory if o.memory is not None else 2**50  # a given span: memory does not limit it
        sized = o.memory is None and o.blocks is None and o.num_blocks is None
        if sized:
            from distconf.blocks.device import available_memory

            seen = available_memory(self.device)
            memory = seen.usable
        self.adapters = ServedAdapters(parse_adapters(o.adapters), config, self.dtype, token=o.token,
                                       cache_dir=o.cache_dir)
        span = plan_span(config, memory, dtype_name, dht=self.dht, blocks=o.blocks, num_blocks=o.num_blocks,
                         attn_cache_tokens=o.attn_cache_tokens, quant=self.quant, device_type=self.device.type,
                         adapter_bytes_per_block=self.adapters.bytes_per_block())
        if sized:
            logger.info("sized from memory: %.2f GiB available (%s) - %.2f GiB margin = %.2f GiB -> %d of %d "
                        "blocks (%.1f MiB each, %s, quant %s), %d cache tokens per block", seen.available / 2**30,
                        seen.source, seen.margin / 2**30, seen.usable / 2**30, span.num_blocks,
                        config_num_blocks(config), span.plan.block_bytes / 2**20, dtype_name,
                        self.quant or "none", span.plan.attn_cache_tokens)
        self.start_block, self.end_block = span.start, span.end
        self.kv_bytes_per_token = kv_cache_bytes_per_token(config, self.dtype)
        self.budget_bytes = span.plan.cache_bytes_per_block * span.num_blocks
        self.adapters.read(span.start, span.end)  # checked before any block is loaded
        info = ServerInfo(state=ServerState.JOINING, throughput=0.0, public_name=o.public_name, version=VERSION,
                          torch_dtype=dtype_name, quant_type=petals_quant_type(self.quant),
                          start_block=span.start, end_block=span.end, using_relay=self.using_relay,
                          adapters=self.adapters.names)
        self.announcer = _LiveAnnouncer(self.dht, config, span.start, span.end, info, update_period=o.update_period,
                                        repository=o.repository or hub_repository(o.model_dir),
                                        tokens_left=self.cache_tokens_left)
        self.announcer.start()
        logger.info("serving blocks %d..%d of %s (%s, quant %s, on %s), cache budget %.1f MiB", span.start,
                    span.end - 1, config.dht_prefix, dtype_name, self.quant or "none", self.device,
                    self.budget_bytes / 2**20)
        self._load_and_serve(span, dtype_name)

    def _load_and_serve(self, span: Any, dtype_name: str) -> None:
        from distconf.blocks.quant import held_bytes
        from distconf.rpc.calls import RpcLoop
        from distconf.server.integrity import weights_digest
        from distconf.server.loading import measure_throughput


        o, config = self.options, self.config
        modules = self._load_span(span.start, span.end)
        self.modules = modules
        held = max(held_bytes(m) for m in modules)
        logger.info("block bytes: planned %.2f MiB per block (%s, quant %s, with the 1%% margin), held %.2f MiB "
                    "(largest loaded block, %.1f%% of the plan)", span.plan.block_bytes / 2**20, self.dtype_name,
                    self.quant or "none", held / 2**20, 100 * held / max(span.plan.block_bytes, 1))
        if o.verify_weights:
            self.weights_sha256 = weights_digest(modules, first_block=span.start)
            logger.info("weights sha256 of blocks %d..%d at load: %s", span.start, span.end - 1, self.weights_sha256)
        self.block_sha256 = self._block_digests(span.start, modules)
        speed = measure_throughput(modules, config.wire_width, self.dtype)
        self.throughput, self.forward_rps = speed.throughput, speed.forward_rps
        if self.using_relay:
            self.throughput *= RELAY_PENALTY
        self.executor = ThreadPoolExecutor(o.compute_threads or 1, thread_name_prefix="distconf-compute")
        self.handler = self._make_handler(span.start, modules)
        if self.rpc is None:
            self.rpc = RpcLoop(self.dht)
        self.rpc.run(self.handler.start(self.rpc.p2p), timeout=30)
        assert self.announcer is not None
        self.announcer.announce(self.announcer.info.model_copy(update={
            "state": ServerState.ONLINE, "throughput": self.throughput, "inference_rps": speed.inference_rps,
            "forward_rps": speed.forward_rps}))
        logger.info("ONLINE: blocks %d..%d, peer %s; measured per block: %.0f tokens/s in inference steps, "
                    "%.0f in forward passes; announced throughput %.1f%s", span.start, span.end - 1, self.peer_id,
                    speed.inference_rps, speed.forward_rps, self.throughput,
                    f" (x{RELAY_PENALTY:g}: reached through a relay)" if self.using_relay else "")

    def _block_digests(self, start: int, modules: list[Any], known: dict[int, str] | None = None
                       ) -> list[str] | None:
        """Per-block digests of ``modules`` (blocks ``start..``), None without ``block_digests``.

        ``known``: digests already taken, by block index (blocks kept through a span move).
        """
        from distconf.server.integrity import block_digests

        if not self.options.block_digests:
            return None
        known = known or {}
        t0 = time.perf_counter()
        digests = [known.get(start + i) or block_digests([m], first_block=start + i)[0] for i, m in enumerate(modules)]
        logger.info("block sha256 of blocks %d..%d (%s): %d new in %.2f s", start, start + len(modules) - 1,
                    self.weights_form, sum(1 for i in range(len(modules)) if start + i not in known),
                    time.perf_counter() - t0)
        return digests

    def _check_stop(self, _block: int) -> None:
        if self.stop_event is not None and self.stop_event.is_set():
            raise InterruptedError(f"stopped while loading blocks {self.start_block}..{self.end_block - 1}")

    def _load_span(self, start: int, end: int) -> list[Any]:
        """Load blocks ``start..end-1`` as this server serves them (source, dtype, quant, device)."""
        from distconf.server.loading import load_blocks

        if self.source is not None and self.source.hub is not None:  # a hub id: the shards of these blocks only
            if self.stop_event is not None:  # Ctrl-C / SIGTERM ends a download at once (it resumes next start)
                self.source.hub.should_stop = self.stop_event.is_set
            self.source.hub.fetch_layers(self.config, [model_layer(self.config, i) for i in range(start, end)])
        modules = load_blocks(self.checkpoint_dir, self.config, start, end, self.dtype, on_block=self._check_stop,
                              quant=self.quant, device=self.device)
        if self.adapters is not None:
            self.adapters.attach(modules, start)  # hooks beside the blocks: their weights and digests unchanged
        return modules

    def _make_handler(self, start: int, modules: list[Any], *, weights_sha256: str | None = None,
                      block_sha256: list[str] | None = None) -> Any:
        """A `BlockHandler` (not registered yet) serving ``modules`` as blocks ``start..``, with a fresh budget.

        Its ``rpc_info`` reports ``weights_sha256`` and ``block_sha256`` (default: this server's).
        """
        from distconf.blocks.kvcache import kv_geometry
        from distconf.blocks.sizing import kv_cache_bytes_per_token, state_bytes_per_sequence
        from distconf.loader.naming import block_uids
        from distconf.planning import autograd_reserve_bytes, batch_activation_bytes, default_max_length
        from distconf.rpc.protocol import compression_code
        from distconf.server.compute import ServedBlock
        from distconf.server.handler import BlockHandler, HandlerSettings
        from distconf.server.memory import CacheBudget
        from distconf.server.scheduler import BatchLimits
        from distconf.server.settings import default_forward_tokens

        o, config = self.options, self.config
        uids = block_uids(config.dht_prefix, start, start + len(modules))
        served = [ServedBlock(uid, start + i, m, self.dtype, kv_geometry(config, model_layer(config, start + i)),
                              kv_cache_bytes_per_token(config, self.dtype, start + i),
                              state_bytes_per_sequence(config, self.dtype, start + i))
                  for i, (uid, m) in enumerate(zip(uids, modules))]
        settings = HandlerSettings(
            dht_prefix=config.dht_prefix, hidden_size=config.wire_width, dtype=self.dtype,
            inference_max_length=o.inference_max_length or default_max_length(config),
            request_timeout=o.request_timeout, session_timeout=o.session_timeout, step_timeout=o.step_timeout,
            version=VERSION, dht_client_mode=self.using_relay,
            weights_sha256=weights_sha256 or self.weights_sha256, block_sha256=block_sha256 or self.block_sha256,
            weights_form=self.weights_form, max_peer_cache_share=o.max_peer_cache_share,
            compression=compression_code(o.compression),
            adapters=self.adapters.names if self.adapters is not None else (),
            adapter_sha256=self.adapters.digests(start, start + len(modules)) if self.adapters is not None else None,
            max_forward_tokens=o.max_forward_tokens or default_forward_tokens(
                default_max_length(config), self.forward_rps, o.request_timeout, len(modules)))
        limits = BatchLimits(max_batch_size=o.max_batch_size, prefill_chunk=o.prefill_chunk,
                             max_batch_tokens=o.max_batch_tokens or default_max_length(config),
                             max_batch_bytes=int(autograd_reserve_bytes(config)), max_batch_wait=o.max_batch_wait)
        activation = functools.partial(batch_activation_bytes, config, dtype=self.dtype,
                                       kv_bytes_per_token=self.kv_bytes_per_token)
        return BlockHandler(served, CacheBudget(self.budget_bytes, o.max_alloc_timeout), settings, self.executor,
                            limits, activation)

    def verify_weights(self) -> bool | None:
        """Hash the served weights again and log whether they equal the digest taken at load.

        Returns True if unchanged, False if changed (logged as an ERROR), None when no
        digest was taken at load (``verify_weights`` off, or loading did not finish).
        """
        from distconf.server.integrity import weights_digest

        if self.weights_sha256 is None or not self.modules:
            return None
        now = weights_digest(self.modules, first_block=self.start_block)
        span = f"blocks {self.start_block}..{self.end_block - 1}"
        if now == self.weights_sha256:
            logger.info("weights sha256 of %s at stop: %s (unchanged)", span, now)
            return True
        logger.error("weights sha256 of %s at stop: %s (CHANGED since load)", span, now)
        return False

    def stop(self, offline: bool = True, timeout: float = 10.0) -> None:
        """Announce OFFLINE (when announced), stop serving, check the weights (with ``verify_weights``),
        shut the DHT node down. Idempotent.

        ``timeout`` bounds the network stages together (the OFFLINE store, the handlers, the
        RPC transport), so a server on a slow DHT still stops in about that time; hashing the
        weights and the DHT node's own grace period come on top.
        """
        deadline = time.monotonic() + timeout

        def left(share: float = 1.0) -> float:
            return max(0.5, (deadline - time.monotonic()) * share)

        self._stop_rebalancing(left(0.25))
        if self.announcer is not None:
            self.announcer.stop(offline=offline, timeout=left(0.6))
            self.announcer = None
        if self.rpc is not None:
            if self._reachability is not None:
                with contextlib.suppress(Exception):
                    self.rpc.run(self._reachability.stop(), timeout=left(0.25))
                self._reachability = None
            if self.handler is not None:
                try:
                    self.rpc.run(self.handler.stop(), timeout=left(0.5))
                except Exception as exc:
                    logger.debug("removing handlers failed: %r", exc)
            self.rpc.shutdown(timeout=left(0.5))
            self.rpc = None
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
            self.executor = None
        if self.modules:
            try:
                self.verify_weights()
            except Exception as exc:  # stopping goes on regardless
                logger.error("weights of blocks %d..%d could not be hashed at stop: %r", self.start_block,
                             self.end_block - 1, exc)
            self.modules = []
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None

