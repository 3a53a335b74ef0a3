"""The RSA key a node signs its DHT records with, kept on disk so a restarted node keeps its name.

hivemind's `RSASignatureValidator` defaults to a fresh process-wide key; a node that restarts with a new key
would show up as a stranger whose old record still occupies the swarm's view until it expires. The key lives
next to the libp2p identity file (`<identity>.rsa`), so one `--identity` pins both names.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.utils.crypto import RSAPrivateKey

from hetero_node.protocol.errors import ConfigError


def signing_key_path(identity: Path) -> Path:
    return identity.with_name(identity.name + ".rsa")


def load_or_create_signing_key(path: Path | None) -> RSAPrivateKey:
    """The key at `path` (created, mode 0600, if missing); a fresh in-memory key when `path` is None."""
    if path is None:
        return RSAPrivateKey()
    if path.exists():
        try:
            loaded = serialization.load_der_private_key(path.read_bytes(), password=None)
        except (ValueError, TypeError, OSError) as e:
            raise ConfigError(f"{path} is not a readable RSA key ({e}); move it away to create a new one") from None
        if not isinstance(loaded, rsa.RSAPrivateKey):
            raise ConfigError(f"{path} holds a non-RSA key; move it away to create a new one")
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key._private_key = loaded  # hivemind has no public constructor from an existing key
        return key
    key = RSAPrivateKey()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.to_bytes())
    os.replace(tmp, path)
    return key
