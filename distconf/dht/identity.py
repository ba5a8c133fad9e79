"""Peer identities: a server's stable one (``--identity-path``), and RSA ones that own signed records.

`load_identity` is what ``distconf serve --identity-path PATH`` uses (Petals' flag): the private key
is created on first start, readable by its owner only (mode 0600), and its peer id is the server's on
every later start, so clients' bans and the swarm page follow the server across restarts. A key file
that others may read is refused (as ssh refuses such keys): whoever reads it can be this server.

hivemind's ``RSASignatureValidator`` signs with an RSA key. A libp2p peer id made from
an RSA key is the sha2-256 hash of that key (hivemind's ``P2P.generate_identity`` makes
exactly such identities). A node whose identity *is* its signing key can prove that a
record naming its peer id is its own: `distconf.dht.peerids.owner_matches_peer`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

__all__ = ["IdentityError", "load_identity", "rsa_identity"]


class IdentityError(ValueError):
    """An identity file cannot be used: it is readable by others, unreadable, or not a libp2p private key."""


def load_identity(path: str) -> str:
    """The peer id (base58) of the libp2p private key at ``path``, creating the key (mode 0600) if missing.

    Raises `IdentityError` naming the file and why when it is readable by group or others, cannot be
    read or written, or does not hold a libp2p private key.
    """
    import stat

    from hivemind.p2p import PeerID
    from hivemind.proto import crypto_pb2
    from hivemind.utils.crypto import RSAPrivateKey

    try:
        info = os.stat(path)
    except FileNotFoundError:
        info = None
    except OSError as exc:
        raise IdentityError(f"{path}: {exc.strerror}") from None
    if info is None:
        data = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes())
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data.SerializeToString())
        except OSError as exc:
            raise IdentityError(f"{path}: cannot create the identity key: {exc.strerror}") from None
    elif not stat.S_ISREG(info.st_mode):
        raise IdentityError(f"{path}: not a regular file")
    elif info.st_mode & 0o077:
        raise IdentityError(f"{path}: permissions {stat.S_IMODE(info.st_mode):04o} are too open: a private key "
                            f"must be readable by its owner only (chmod 600 {path})")
    try:
        with open(path, "rb") as f:
            raw = f.read(1 << 16)
        key = crypto_pb2.PrivateKey.FromString(raw)
        if not key.data:
            raise ValueError("empty key")
        return PeerID.from_identity(raw).to_base58()
    except OSError as exc:
        raise IdentityError(f"{path}: {exc.strerror}") from None
    except Exception:  # protobuf and key parsing raise several types
        raise IdentityError(f"{path}: not a libp2p private key (make a new one by giving a path that does "
                            "not exist yet)") from None


def rsa_identity(path: str | None = None) -> tuple[Any, str, Callable[[], None] | None]:
    """``(hivemind RSAPrivateKey, identity file path, cleanup or None)`` for a signing node.

    With ``path`` of an existing libp2p identity file, its RSA key is used (`ValueError`
    if the file holds another key type). With ``path`` of a missing file, a new RSA key is
    written there (mode 0400). Without ``path``, a new key is written to a private
    temporary file, and ``cleanup`` removes it (call it once the node has started).
    """
    from hivemind.proto import crypto_pb2
    from hivemind.utils.crypto import RSAPrivateKey

    from distconf.dht.hivemind_compat import rsa_private_key_from_der

    if path is not None and os.path.isfile(path):
        with open(path, "rb") as f:
            stored = crypto_pb2.PrivateKey.FromString(f.read())
        if stored.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError(f"{path}: signed records need an RSA identity, this one holds key type {stored.key_type}")
        try:
            key = rsa_private_key_from_der(stored.data)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        return key, path, None
    key = RSAPrivateKey()
    data = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes()).SerializeToString()
    cleanup = None
    if path is None:
        directory = tempfile.mkdtemp(prefix="distconf-identity-")
        path = os.path.join(directory, "identity.key")
        cleanup = lambda: shutil.rmtree(directory, ignore_errors=True)  # noqa: E731
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return key, path, cleanup
