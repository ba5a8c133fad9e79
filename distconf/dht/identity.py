"""RSA peer identities, so that a node's records can be owned by its peer id.

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

__all__ = ["rsa_identity"]


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
