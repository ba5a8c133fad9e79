"""hivemind across networks: static relays, circuit addresses, connects, 8-bit compressions (items 14 to 17).

The third part of `distconf.dht.hivemind_compat`'s numbering, checked by the same version rule on
import. Each item was read against hivemind 1.1.12 and the p2pd it bundles (go-libp2p-daemon
v0.5.0.hivemind1, go-libp2p v0.32.1); ``tests/test_hivemind_compat.py`` has one test per item and
``tests/test_lab_swarm.py`` shows what they are for on real hosts.

14. `static_relays` wraps the static method ``P2P._make_process_args`` (process-wide) so that a
    daemon started with ``use_auto_relay=True`` and ``trusted_relays`` gets ``-relayDiscovery=0``:
    its autorelay then uses exactly those relays. *Why*: without it p2pd feeds the trusted relays to
    go-libp2p's autorelay as a peer source, whose relay finder reserves a slot only once it has 4
    candidates or after a 3-minute boot delay (measured in the lab: the circuit address appeared
    after 180.9 s with one relay; with static relays, after 0.2 s). *If hivemind changes it*: the
    flag is no longer passed and relayed servers take minutes to become reachable (the test reading
    the daemon's arguments fails).
15. `daemon_peer_ids_as_multihash` replaces ``to_bytes`` of hivemind's vendored multiaddr codec for
    ``/p2p/`` (process-wide). *Why*: hivemind encodes a ``/p2p/`` value as a CIDv1 (``01 72 ...``)
    where the daemon (go-multiaddr) expects the peer id's multihash, so any address with a ``/p2p/``
    inside, which every circuit address has (``.../p2p/RELAY/p2p-circuit/p2p/PEER``), is refused by
    the daemon with "length greater than remaining number of bytes in buffer". The text form is
    unchanged. *If hivemind changes it*: explicit dials through a relay fail again (the round-trip
    test against go's encoding fails).
16. `connect_peer` and `disconnect_peer` send the daemon's CONNECT and DISCONNECT through
    ``P2P._client`` (hivemind has no public call): a probe dials a server through a given relay, and a
    server drops its relay so that autorelay takes a new reservation. *If it changes*: the calls raise
    ``AttributeError``, which the callers treat as a failed dial or a failed disconnect.
17. `scalar_headers_for_numpy` replaces the module global ``np`` of ``hivemind.compression.quantization`` with
    a view of numpy whose ``frombuffer(..., count=1)`` returns a 0-d array (process-wide). *Why*: the 8-bit
    compressions (QUANTILE_8BIT, UNIFORM_8BIT, BLOCKWISE_8BIT: Petals' ``--compression``) read their size
    headers with ``int(np.frombuffer(buffer, count=1, ...))``, which NumPy 2.4 refuses ("only 0-dimensional
    arrays can be converted to Python scalars"): every such tensor failed to decode. *If hivemind changes
    it*: the view is not used, or the headers are read another way (the round-trip test of every
    compression tells).
"""

from __future__ import annotations

from typing import Any

from distconf.dht.hivemind_compat import _lock, _mark, _marked, check_hivemind_version

__all__ = ["connect_peer", "daemon_peer_ids_as_multihash", "disconnect_peer", "scalar_headers_for_numpy",
           "static_relays"]

check_hivemind_version()


# ----------------------------------------------------------------------------- 14. static relays
def static_relays() -> None:
    """Make daemons given ``trusted_relays`` with ``use_auto_relay`` use exactly those relays. Idempotent."""
    from hivemind.p2p import P2P

    with _lock:
        unguarded = P2P.__dict__["_make_process_args"].__func__
        if _marked(unguarded):
            return

        def _make_process_args(*args: Any, **kwargs: Any) -> list[str]:
            if kwargs.get("trustedRelays") and kwargs.get("autoRelay"):
                kwargs["relayDiscovery"] = False
            return unguarded(*args, **kwargs)

        _make_process_args.__wrapped__ = unguarded  # type: ignore[attr-defined]
        P2P._make_process_args = staticmethod(_mark(_make_process_args))  # type: ignore[method-assign]


# ----------------------------------------------------------------------------- 15. /p2p/ bytes
def daemon_peer_ids_as_multihash() -> None:
    """Encode ``/p2p/ID`` in binary multiaddrs as the peer id's multihash, as the daemon reads it. Idempotent."""
    import base58
    from hivemind.utils.multiaddr.codecs import cid as cid_codec

    with _lock:
        unguarded = cid_codec.to_bytes
        if _marked(unguarded):
            return

        def to_bytes(proto: Any, string: str) -> bytes:
            if proto.name != "p2p":
                return unguarded(proto, string)
            if string.startswith(("Qm", "1")):  # base58 multihash: the peer id's own bytes
                return base58.b58decode(string)
            import cid

            return bytes(cid.from_string(string).multihash)

        to_bytes.__wrapped__ = unguarded  # type: ignore[attr-defined]
        cid_codec.to_bytes = _mark(to_bytes)


# ----------------------------------------------------------------------------- 16. connect, disconnect
async def connect_peer(p2p: Any, peer_id: Any, maddrs: list[str]) -> None:
    """Open a connection of ``p2p``'s daemon to ``peer_id`` at ``maddrs`` (call `daemon_peer_ids_as_multihash` first
    when they hold ``/p2p/``)."""
    from hivemind.utils.multiaddr import Multiaddr

    await p2p._client.connect(peer_id, [Multiaddr(m) for m in maddrs])


async def disconnect_peer(p2p: Any, peer_id: Any) -> None:
    """Close every connection of ``p2p``'s daemon to ``peer_id`` (the daemon's DISCONNECT request)."""
    await p2p._client.disconnect(peer_id)


# ----------------------------------------------------------------------------- 17. 8-bit compression headers
class _NumpyScalarHeaders:
    """numpy, except that ``frombuffer(..., count=1)`` is a 0-d array (``int()`` of it works on every NumPy)."""

    def __init__(self, numpy: Any) -> None:
        self._numpy = numpy

    def frombuffer(self, *args: Any, **kwargs: Any) -> Any:
        array = self._numpy.frombuffer(*args, **kwargs)
        return array.reshape(()) if kwargs.get("count") == 1 else array

    def __getattr__(self, name: str) -> Any:
        return getattr(self._numpy, name)


def scalar_headers_for_numpy() -> None:
    """Let hivemind's 8-bit compressions decode their headers on NumPy 2.4 and later. Idempotent."""
    from hivemind.compression import quantization

    with _lock:
        if isinstance(quantization.np, _NumpyScalarHeaders):
            return
        quantization.np = _NumpyScalarHeaders(quantization.np)
