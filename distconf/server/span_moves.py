"""`SpanMoves`: how a `BlockServer` checks the swarm's balance and moves to other blocks.

Petals' ``--balance_quality``: a server placed by the swarm (no ``--blocks``) checks every
``mean_balance_check_period`` seconds on average (each wait random in 0..2x) whether moving
would raise the swarm's throughput enough (the pure decision: `distconf.server.rebalance`),
and moves make-before-break (`SpanMoves.move_to`). A mixin of `BlockServer`: it uses the
server's DHT node, announcer, handler, loaded modules and options.
"""

from __future__ import annotations

import logging
import random
import threading
from typing import Any

from distconf.dht import ServerInfo, ServerState
from distconf.loader.naming import config_num_blocks
from distconf.rpc.protocol import NOT_SERVED

__all__ = ["SpanMoves"]

logger = logging.getLogger(__name__)


class SpanMoves:
    """The balance check and the move of a `BlockServer` (see the module docstring)."""

    def _start_rebalancing(self) -> None:
        """Start the periodic balance check (not with ``--blocks``: a span given by hand stays, as in Petals)."""
        o = self.options
        if o.balance_quality <= 0 or o.blocks is not None or self._rebalancer is not None:
            return
        self._rebalancer = threading.Thread(target=self._rebalance_loop, name="distconf-rebalance", daemon=True)
        self._rebalancer.start()

    def _stop_rebalancing(self, timeout: float) -> None:
        self._rebalance_stop.set()
        if self._rebalancer is not None and self._rebalancer is not threading.current_thread():
            self._rebalancer.join(timeout)
            if self._rebalancer.is_alive():
                logger.warning("the balance check did not end within %.1f s", timeout)
        self._rebalancer = None

    def _rebalance_loop(self) -> None:
        period = max(self.options.mean_balance_check_period, 0.1)  # a zero period would spin
        while not self._rebalance_stop.wait(random.random() * 2 * period):
            if self.stop_event is not None and self.stop_event.is_set():
                return
            try:
                self.rebalance()
            except InterruptedError:
                return
            except Exception as exc:  # the server goes on serving its span
                logger.warning("balance check failed: %r", exc)

    def rebalance(self) -> Any:
        """Read the swarm once and move when that raises its throughput enough (`distconf.server.rebalance`).

        Returns the `distconf.server.rebalance.Rebalance` decision.
        """
        from distconf.dht import find_block_servers
        from distconf.server.rebalance import Rebalance, decide_rebalance

        swarm = find_block_servers(self.dht, self.config, timeout=30.0)
        if swarm.failed:
            decision = Rebalance(False, f"the records of {len(swarm.failed)} block(s) could not be read")
        else:
            decision = decide_rebalance(self.peer_id, swarm.servers, self.options.balance_quality)
        if decision.move and decision.start is not None:
            logger.info("swarm is imbalanced (%s): moving from blocks %d..%d to %d..%d", decision.reason,
                        self.start_block, self.end_block - 1, decision.start,
                        decision.start + self.end_block - self.start_block - 1)
            self.move_to(decision.start)
        else:
            logger.debug("balance check: staying on blocks %d..%d (%s)", self.start_block, self.end_block - 1,
                         decision.reason)
        return decision

    def move_to(self, start: int) -> None:
        """Serve as many blocks from ``start`` on instead of the current span, make before break.

        Announces the new span JOINING (with this server's throughput, so other servers do not
        move into the same place), loads the blocks it lacks (blocks in both spans are kept),
        switches the handlers to the new span (its ``rpc_info`` reports the new span's digests:
        blocks kept are not hashed again), announces ONLINE there and OFFLINE on the blocks
        it left, and frees them. Sessions open on the old span end with an error at their next
        step (clients fail over). If loading fails, the server stays on its old span.
        """
        old_start, old_end = self.start_block, self.end_block
        end = start + old_end - old_start
        if not 0 <= start < end <= config_num_blocks(self.config):
            raise ValueError(f"cannot move to blocks {start}..{end - 1}: outside the model")
        old_announcer, old_handler, rpc = self.announcer, self.handler, self.rpc
        if start == old_start or old_announcer is None or old_handler is None or rpc is None:
            return
        online = old_announcer.info
        new_announcer = self.announcer_class(self.dht, self.config, start, end,
                                       online.model_copy(update={"state": ServerState.JOINING}),
                                       update_period=self.options.update_period, repository=old_announcer.repository,
                                       tokens_left=self.cache_tokens_left)
        new_announcer.start()
        kept = {old_start + i: m for i, m in enumerate(self.modules)}
        try:
            modules = []
            for a, b in _ranges([i for i in range(start, end) if i not in kept]):
                loaded = dict(zip(range(a, b), self._load_span(a, b)))
                kept.update(loaded)
                if self._rebalance_stop.is_set():
                    raise InterruptedError("stopped while moving")
            modules = [kept[i] for i in range(start, end)]
            weights_sha256 = None
            if self.options.verify_weights:
                from distconf.server.integrity import weights_digest

                weights_sha256 = weights_digest(modules, first_block=start)
            known = dict(zip(range(old_start, old_end), self.block_sha256 or []))
            block_sha256 = self._block_digests(start, modules, known)
            handler = self._make_handler(start, modules, weights_sha256=weights_sha256, block_sha256=block_sha256)
            reason = (f"{NOT_SERVED} blocks {old_start}..{old_end - 1} any more: it moved to {start}..{end - 1}; "
                      "open a new session")
            rpc.run(_switch_handlers(old_handler, handler, rpc.p2p, reason), timeout=30)
        except BaseException:
            new_announcer.stop(offline=False)
            self._announce_offline(start, end, keep=(old_start, old_end), info=online)
            old_announcer.announce()  # the old span's records are the newest again
            raise
        self.handler, self.modules, self.start_block, self.end_block = handler, modules, start, end
        self.weights_sha256, self.block_sha256 = weights_sha256, block_sha256
        self.announcer = new_announcer
        old_announcer.stop(offline=False)
        self._announce_offline(old_start, old_end, keep=(start, end), info=online)
        new_announcer.announce(online)
        logger.info("ONLINE: moved to blocks %d..%d (from %d..%d), peer %s", start, end - 1, old_start,
                    old_end - 1, self.peer_id)

    def _announce_offline(self, start: int, end: int, *, keep: tuple[int, int], info: ServerInfo) -> None:
        """Announce blocks ``start..end-1`` OFFLINE, except those in ``keep`` (still served)."""
        from distconf.dht import announce_blocks

        assert self.announcer is not None
        lifetime = self.announcer.expiration
        gone = [i for i in range(start, end) if not keep[0] <= i < keep[1]]
        for a, b in _ranges(gone):
            try:
                announce_blocks(self.dht, self.config, a, b, info.model_copy(update={"state": ServerState.OFFLINE}),
                                lifetime, repository=self.announcer.repository)
            except Exception as exc:
                logger.warning("announcing blocks %d..%d OFFLINE failed: %s", a, b - 1, exc)


def _ranges(blocks: list[int]) -> list[tuple[int, int]]:
    """Sorted block indices as ``(start, end)`` runs of consecutive blocks."""
    runs: list[tuple[int, int]] = []
    for i in sorted(blocks):
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


class _RetiredCompute:
    """Stands in for a replaced handler's compute thread: every step of its open sessions fails with ``reason``."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    async def run(self, fn: Any, *args: Any) -> Any:
        """Refuse: the blocks moved."""
        from distconf.server.validation import RequestError

        raise RequestError(self.reason)


async def _switch_handlers(old: Any, new: Any, p2p: Any, reason: str) -> None:
    """Unregister ``old``, register ``new`` on ``p2p``, and make ``old``'s open sessions fail with ``reason``."""
    await old.stop()
    await new.start(p2p)
    old.compute = old.sessions.compute = _RetiredCompute(reason)
