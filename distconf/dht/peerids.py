"""Peer ids and record owners, parsed strictly.

A libp2p peer id is a multihash: either the sha2-256 hash of the peer's public key
(``Qm...``, RSA keys) or the key itself inlined as an "identity" multihash
(``12D3KooW...``, Ed25519). hivemind's ``PeerID.from_base58`` accepts any base58 text,
so a peer could advertise made-up ids; `parse_peer_id` accepts only well-formed ones.

Signed records (see `distconf.dht.validators`) use a subkey ``"<peer id>[owner:<RSA
public key>]"``: hivemind's ``RSASignatureValidator`` checks that the owner signed the
record, and `owner_matches_peer` checks that the peer id is the hash of that key, so a
record about a peer can only come from that peer.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

__all__ = [
    "MAX_PEER_ID_LEN",
    "OWNER_PREFIX",
    "is_peer_id",
    "owner_matches_peer",
    "parse_peer_id",
    "peer_id_problem",
    "split_subkey",
]

MAX_PEER_ID_LEN = 64
"""Longest base58 peer id accepted (Ed25519 ids are 52 characters, RSA ids 46)."""
OWNER_PREFIX = "[owner:"
"""Start of hivemind's owner marker (``RSASignatureValidator.PUBLIC_KEY_FORMAT``)."""
MAX_OWNER_KEY_LEN = 2048
"""Longest public key accepted in an owner marker (an RSA-2048 key is about 380 bytes)."""

_SHA2_256, _IDENTITY = 0x12, 0x00
# An inlined ("identity") key is the protobuf PublicKey {1: key type, 2: key bytes}; only
# Ed25519 (type 1, 32 bytes) and Secp256k1 (type 2, 33 bytes) keys are short enough to inline.
_INLINE_KEY_HEADERS = (bytes([0x08, 1, 0x12, 32]), bytes([0x08, 2, 0x12, 33]))


@functools.lru_cache(maxsize=8192)
def _peer_id_problem(text: str) -> tuple[bytes, str | None]:
    import base58

    try:
        raw = base58.b58decode(text)
    except ValueError:
        return b"", "not base58"
    if len(raw) < 2 or raw[1] != len(raw) - 2:
        return raw, "not a multihash"
    code, digest = raw[0], raw[2:]
    if code == _SHA2_256:
        if len(digest) != 32:
            return raw, "a sha2-256 peer id holds a 32-byte digest"
    elif code == _IDENTITY:
        if not any(digest.startswith(h) and len(digest) == len(h) + h[3] for h in _INLINE_KEY_HEADERS):
            return raw, "the inlined public key is not an Ed25519 or Secp256k1 key"
    else:
        return raw, f"multihash code {code:#x} is not a peer id hash"
    if base58.b58encode(raw).decode() != text:
        return raw, "not in canonical base58 form"
    return raw, None


def peer_id_problem(text: Any) -> str | None:
    """Why ``text`` is not a well-formed base58 libp2p peer id, or None if it is (no hivemind import)."""
    if not isinstance(text, str) or not 0 < len(text) <= MAX_PEER_ID_LEN or not text.isascii():
        return "not a base58 string of a peer id's length"
    return _peer_id_problem(text)[1]


def parse_peer_id(text: Any) -> Any:
    """A ``hivemind.PeerID`` for a well-formed base58 libp2p peer id; `ValueError` otherwise."""
    problem = peer_id_problem(text)
    if problem is not None:
        raise ValueError(f"{text!r:.70} is not a libp2p peer id: {problem}")
    from hivemind.p2p import PeerID

    return PeerID(_peer_id_problem(text)[0])


def is_peer_id(text: Any) -> bool:
    """Whether ``text`` is a well-formed base58 libp2p peer id (see `parse_peer_id`)."""
    return peer_id_problem(text) is None


def split_subkey(subkey: Any) -> tuple[str, bytes | None]:
    """``(peer id text, owner public key or None)`` of a server-record subkey.

    Accepts ``"<peer id>"`` (Petals 2.x) and ``"<peer id>[owner:<public key>]"`` (signed
    records). Raises `ValueError` for anything else; the peer id itself is not checked here.
    """
    if not isinstance(subkey, str) or len(subkey) > MAX_PEER_ID_LEN + MAX_OWNER_KEY_LEN + 8:
        raise ValueError(f"subkey {subkey!r:.70} is not a peer id")
    peer, marker, rest = subkey.partition(OWNER_PREFIX)
    if not marker:
        return peer, None
    if not rest.endswith("]") or "]" in rest[:-1] or "[" in rest or not rest[:-1]:
        raise ValueError("subkey has a malformed owner marker")
    return peer, rest[:-1].encode()


@functools.lru_cache(maxsize=4096)
def owner_matches_peer(peer_id: str, public_key: bytes) -> bool:
    """Whether ``peer_id`` is the libp2p id of the RSA key ``public_key`` (OpenSSH form).

    A libp2p RSA peer id is the sha2-256 multihash of the protobuf-encoded public key
    (DER SubjectPublicKeyInfo), as hivemind's ``PeerID.from_identity`` computes it.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from hivemind.proto import crypto_pb2

    try:
        key = serialization.load_ssh_public_key(public_key)
        if not isinstance(key, rsa.RSAPublicKey):
            return False
        der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
        expected = bytes([_SHA2_256, 32]) + hashlib.sha256(encoded).digest()
        return peer_id_problem(peer_id) is None and _peer_id_problem(peer_id)[0] == expected
    except Exception:
        return False
