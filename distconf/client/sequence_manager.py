"""Which servers a client sends each block to: discovery, bans, allow/block lists, pings, retries.

`SequenceManager` reads the swarm from the DHT (`find_block_servers`, refreshed every
``update_period`` seconds or on demand), keeps ONLINE servers only (a JOINING server is
still loading its blocks), applies ``allowed_servers`` / ``blocked_servers`` and the
temporary bans (``ban_timeout``) of servers that failed, applies the liveness policy of
`distconf.dht.liveness` (``max_pinged`` candidates per hop, ``ping_timeout`` each; peers
that did not answer are left out when others can take their place), and plans the chain
with `distconf.dht.routing.make_route` (`SequenceManager.plan_route`). It also owns the
client's one retry loop (`SequenceManager.with_retries`: ``max_retries``, ``min_backoff``,
``max_backoff``) and the route log (``show_route``). With ``weights_manifest``, servers whose
announced weight digests differ from the manifest are left out (`distconf.client.commitments`).
"""

from __future__ import annotations

import copy
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from distconf.client.commitments import Commitments
from distconf.dht import NoRouteError, RemoteSpan, ServerState, SwarmState, find_block_servers, make_route
from distconf.dht.liveness import ping_candidates, unreachable_peers
from distconf.loader.config_protocol import DistributedConfig
from distconf.rpc.calls import call_info
from distconf.rpc.protocol import KEY_ACTIVE_ADAPTER, KEY_POINTS, NOT_SERVED, chain_uid

__all__ = ["SequenceManager", "RetriesExhausted"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


class RetriesExhausted(RuntimeError):
    """A request failed ``max_retries + 1`` times; the last error is chained."""


class SequenceManager:
    """Routes blocks of one model through the swarm for one client (see the module docstring)."""

    def __init__(self, config: DistributedConfig, swarm: Any) -> None:
        self.config = config
        self.swarm = swarm
        self.num_blocks = swarm.num_blocks
        self.dht_prefix = swarm.dht_prefix
        self.state: SwarmState | None = None
        self.last_update = -math.inf
        self.bans: dict[str, float] = {}
        self.ban_reasons: dict[str, str] = {}  # why each peer was banned last (named when no route is left)
        self.moved: dict[str, float] = {}
        self.pings: dict[str, float] = {}
        self.rpc_infos: dict[str, dict[str, Any]] = {}
        self._lock = threading.RLock()
        self.allowed = None if config.allowed_servers is None else set(config.allowed_servers)
        self.blocked = set(config.blocked_servers or ())
        self.commitments = Commitments.for_config(config, self.dht_prefix, self.num_blocks)  # None: no manifest
        self.adapter: str | None = config.active_adapter or None
        """The LoRA adapter requests ask for (``active_adapter``); routes use only servers that serve it."""

    def with_adapter(self, adapter: str | None) -> SequenceManager:
        """This manager for sessions of ``adapter`` (None: the base model): the same swarm, bans and pings."""
        if (adapter or None) == self.adapter:
            return self
        other = copy.copy(self)
        other.adapter = adapter or None
        return other

    # ------------------------------------------------------------------ swarm state
    def update(self, force: bool = False) -> SwarmState:
        """Re-read the swarm from the DHT if ``update_period`` has passed (or ``force``); ping candidates."""
        with self._lock:
            now = time.monotonic()
            if not force and self.state is not None and now - self.last_update < float(self.config.update_period):
                return self.state
            state = find_block_servers(self.swarm.dht, self.config, timeout=float(self.config.request_timeout))
            self.state, self.last_update = state, time.monotonic()
            self._ping(state)
            logger.debug("swarm of %r: %d spans from %d peers", self.dht_prefix, len(state.spans), len(state.peers))
            return state

    def _ping(self, state: SwarmState) -> None:
        """Ping the candidates `distconf.dht.liveness.ping_candidates` picks among usable servers."""
        usable = [s for s in state.spans if self.usable(s)]
        chosen = ping_candidates(usable, self.num_blocks, int(self.config.max_pinged))
        self.pings = self.swarm.ping(chosen, float(self.config.ping_timeout)) if chosen else {}
        logger.debug("pings: %s", {p[-6:]: round(v, 4) for p, v in self.pings.items()})

    def usable(self, span: RemoteSpan) -> bool:
        """Whether the server of ``span`` may be routed through or check others: ONLINE, allowed, not blocked or
        refused, serving the ``active_adapter`` when one is asked for."""
        peer_id = span.peer_id
        if span.state != ServerState.ONLINE or peer_id in self.blocked:
            return False
        if self.commitments is not None and peer_id in self.commitments.refusals(self.adapter):  # nor a checker
            return False
        if not self._holds_adapter(span):
            return False
        return self.allowed is None or peer_id in self.allowed

    def _holds_adapter(self, span: RemoteSpan) -> bool:
        return not self.adapter or self.adapter in (span.info.adapters or ())

    def banned(self) -> set[str]:
        """Peers banned right now."""
        now = time.monotonic()
        with self._lock:
            return {peer for peer, until in self.bans.items() if until > now}

    # ------------------------------------------------------------------ routes
    def plan_route(self, start: int = 0, end: int | None = None, *, inference: bool = False,
                   cache_tokens_needed: int | None = None) -> list[RemoteSpan]:
        """This client's chain of ONLINE spans over blocks ``start..end-1`` (`make_route` with its policy).

        Leaves out banned and blocked peers, and, while others can take their place, peers
        that did not answer a ping and (with ``cache_tokens_needed``) those short of cache.

        Refreshes the swarm state first when it is older than ``update_period``, and once
        more when no route exists. Raises `NoRouteError` when none can be found.
        """
        end = self.num_blocks if end is None else end
        try:
            route = self._route(self.update(), start, end, cache_tokens_needed)
        except NoRouteError:
            route = self._route(self.update(force=True), start, end, cache_tokens_needed)
        show = self.config.show_route
        if show is True or (show == "inference" and inference):
            logger.info("Route found: %s", " => ".join(f"{s.start}:{s.end} via …{s.peer_id[-6:]}" for s in route))
        return route

    def _route(self, state: SwarmState, start: int, end: int, cache_tokens_needed: int | None) -> list[RemoteSpan]:
        short: set[str] = set()
        if cache_tokens_needed is not None:  # Petals 2.x units: cache_tokens_left counts 2 per token and block
            short = {s.peer_id for s in state.spans if s.info.cache_tokens_left is not None
                     and s.info.cache_tokens_left < cache_tokens_needed * 2 * s.length}
        refused = self.commitments.left_out(self, state.spans) if self.commitments is not None else set()
        banned = self.banned()
        lacking = {s.peer_id for s in state.spans if not self._holds_adapter(s)}
        try:
            return make_route(state, min_state=ServerState.ONLINE,
                              blocked_peers=self.blocked | banned | refused | lacking,
                              allowed_peers=self.allowed, start=start, end=end,
                              avoid_if_possible=[unreachable_peers(self.pings), short])
        except NoRouteError as exc:
            if lacking and any(s.start <= exc.block < s.end for s in state.spans if s.peer_id in lacking):
                raise NoRouteError(f"{exc}; the servers there do not serve adapter {self.adapter!r} "
                                   "(active_adapter)", exc.block,
                                   exc.dht_prefix) from None
            failed = [f"{s.peer_id} (blocks {s.start}..{s.end - 1}) failed: {self.ban_reasons[s.peer_id]}"
                      for s in state.spans if s.peer_id in banned and s.peer_id in self.ban_reasons
                      and s.start <= exc.block < s.end]
            if not failed:
                raise
            raise NoRouteError(f"{exc}; left out for {self.config.ban_timeout:g} s: {'; '.join(failed)}",
                               exc.block, exc.dht_prefix) from None

    def chain_uid(self, span: RemoteSpan) -> str:
        """Uids of the blocks of ``span`` joined into one chain string."""
        return chain_uid(self.dht_prefix, span.start, span.end)

    # ------------------------------------------------------------------ failures and retries
    def on_failure(self, peer_id: str | None, error: BaseException | None = None) -> None:
        """Ban ``peer_id`` for ``ban_timeout`` seconds.

        A server that answers it no longer serves the blocks asked for has most likely moved
        (rebalancing) since the swarm was read: the first such answer within ``ban_timeout``
        re-reads the swarm instead of banning it; a second one bans it (a server that keeps
        announcing blocks it refuses is not trusted twice).
        """
        if peer_id is None:
            return
        now = time.monotonic()
        with self._lock:
            if NOT_SERVED in str(error) and self.moved.get(peer_id, -math.inf) <= now:
                self.moved[peer_id] = now + float(self.config.ban_timeout)
                self.last_update = -math.inf
                logger.debug("%s no longer serves the blocks asked for: re-reading the swarm", peer_id)
                return
            self.bans[peer_id] = now + float(self.config.ban_timeout)
            if error is not None:
                self.ban_reasons[peer_id] = _short_reason(error)
        logger.debug("banned %s for %s s after: %r", peer_id, self.config.ban_timeout, error)

    def ban(self, peer_id: str, until: float) -> None:
        """Leave ``peer_id`` out of routes until ``until`` (``time.monotonic`` seconds; never shortens a ban)."""
        with self._lock:
            self.bans[peer_id] = max(self.bans.get(peer_id, -math.inf), until)

    def lift_ban(self, peer_id: str, *, unless_after: float, until: float) -> None:
        """End a ban of ``peer_id`` that runs past ``unless_after`` at ``until`` instead."""
        with self._lock:
            if self.bans.get(peer_id, -math.inf) > unless_after:
                self.bans[peer_id] = until

    def on_success(self, peer_id: str) -> None:
        """Forget an expired ban of ``peer_id``."""
        with self._lock:
            until = self.bans.get(peer_id)
            if until is not None and until <= time.monotonic():
                del self.bans[peer_id]

    def retry_delay(self, attempt: int) -> float:
        """Seconds to wait before retry ``attempt`` (0: none; then min_backoff doubling up to max_backoff)."""
        if attempt <= 0:
            return 0.0
        return min(float(self.config.min_backoff) * 2 ** (attempt - 1), float(self.config.max_backoff))

    def retries_left(self, attempt: int) -> bool:
        """Whether a request that failed on ``attempt`` (0-based) may be tried again."""
        limit = self.config.max_retries
        return limit is None or attempt < int(limit)

    def with_retries(self, what: str, attempt_fn: Callable[[int], T]) -> T:
        """Run ``attempt_fn(attempt)`` until it succeeds; after a failure wait `retry_delay` and retry.

        The client's one retry loop (forward, backward and inference steps all go through
        it). ``attempt_fn`` reports failed peers itself (`on_failure`) and re-routes when
        ``attempt > 0``. Gives up with `RetriesExhausted` after ``max_retries`` retries.
        """
        attempt = 0
        while True:
            try:
                return attempt_fn(attempt)
            except Exception as exc:
                if not self.retries_left(attempt):
                    raise RetriesExhausted(f"{what} failed after {attempt + 1} attempt(s): {exc!r}") from exc
                attempt += 1
                delay = self.retry_delay(attempt)
                logger.warning("%s failed (%r); retry %d in %.3g s", what, exc, attempt, delay)
                time.sleep(delay)

    # ------------------------------------------------------------------ server info
    def rpc_info(self, span: RemoteSpan) -> dict[str, Any]:
        """The server's ``rpc_info`` for the first block of ``span`` (cached per peer)."""
        info = self.rpc_infos.get(span.peer_id)
        if info is None:
            uid = chain_uid(self.dht_prefix, span.start, span.start + 1)
            timeout = float(self.config.request_timeout)
            info = self.swarm.run(call_info(self.swarm.p2p, span.peer_id, uid, timeout=timeout), timeout=timeout + 1)
            self.rpc_infos[span.peer_id] = info
        return info

    def server_dtype(self, span: RemoteSpan) -> Any:
        """The dtype the server computes in (from its ``rpc_info``), or None if it does not say.

        Hidden states travel in this dtype, as Petals 2.x clients send them.
        """
        import torch

        info = self.rpc_info(span)
        dtype = None
        try:
            dtype = info["inference_schema"][0][0].dtype
        except (KeyError, IndexError, TypeError, AttributeError):
            name = info.get("torch_dtype")
            if isinstance(name, str):
                dtype = getattr(torch, name.removeprefix("torch."), None)
        return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None

    def server_compression(self, span: RemoteSpan) -> int:
        """The hivemind compression the server asks for the hidden states it receives (0, NONE, when it says none).

        Read from its ``rpc_info`` schema, as Petals 2.x clients read it (the server's ``--compression``).
        """
        from distconf.rpc.protocol import COMPRESSIONS

        try:
            code = int(self.rpc_info(span)["inference_schema"][0][0].compression)
        except (KeyError, IndexError, TypeError, AttributeError, ValueError):
            return 0
        return code if code in COMPRESSIONS.values() else 0

    def request_metadata(self) -> dict[str, Any]:
        """Metadata every request carries: ``active_adapter`` and ``points``."""
        return {KEY_ACTIVE_ADAPTER: self.adapter or "", KEY_POINTS: 0}


_DIAL_ERRORS = {
    "routing: not found": "no address of it is known in the swarm (routing: not found)",
    "all dials failed": "it cannot be dialled (all dials failed)",
    "NO_RESERVATION": "its relay holds no reservation for it (NO_RESERVATION)",
}
"""What the p2p daemon's dial errors mean, in a few words; the daemon's own text follows in the reason."""


def _short_reason(error: BaseException, limit: int = 300) -> str:
    """An error on one line, cut to ``limit`` characters (a daemon's dial errors list every address tried)."""
    text = " ".join(str(error).split()) or type(error).__name__
    meaning = next((m for key, m in _DIAL_ERRORS.items() if key in text), None)
    if meaning is not None and meaning not in text:
        text = f"{meaning}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."
