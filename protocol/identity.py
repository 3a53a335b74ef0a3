"""A node's one key: its libp2p identity (RSA) also signs its DHT records, so a record's author is its peer id.

Why one key: a peer record names the peer id everyone dials, stages stream to and groups trust. If any key could
sign a record claiming any id, one forged record would rewrite another peer's role, slot and fingerprints in
everyone's view. A libp2p peer id of an RSA key is the sha256 multihash of that public key, and hivemind's
`RSASignatureValidator` puts the signing public key in the record's subkey (`[owner:ssh-rsa ...]`), so a reader
checks offline, with no round trip, that the key that signed a record is the key of the id the record claims
(`owner_peer_id`).

The identity file is libp2p's format (a protobuf `PrivateKey` holding a DER RSA key), the one hivemind and p2pd
write and read, so `--identity FILE` keeps the peer id and the record key together across restarts. A node
without `--identity` gets a fresh key in a temporary file that lives only while p2pd starts.
"""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import base58
import multihash
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from google.protobuf.message import DecodeError
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from hetero_node.protocol.errors import ConfigError

_OWNER = re.compile(rb"^\[owner:(ssh-rsa [A-Za-z0-9+/=]+)\]$")
STANDARD_EXPONENT = 65537
MIN_KEY_BITS = 2048
"""What hivemind and p2pd generate. Any other RSA key is refused as an owner: varying the public exponent of one
modulus grinds ~40,000 peer ids a second per core (the review's eclipse of the lowest ids), while a standard key
costs a 2048-bit key generation per id."""


def is_standard_key(public_key: rsa.RSAPublicKey) -> bool:
    return public_key.public_numbers().e == STANDARD_EXPONENT and public_key.key_size >= MIN_KEY_BITS


def create_identity(path: Path) -> None:
    """Write a new RSA identity in libp2p's format (mode 0400), as hivemind would."""
    from hivemind.p2p import P2P

    path.parent.mkdir(parents=True, exist_ok=True)
    P2P.generate_identity(str(path))


def load_identity(path: Path) -> RSAPrivateKey:
    """The RSA key in a libp2p identity file, as the key hivemind signs records with."""
    try:
        stored = crypto_pb2.PrivateKey.FromString(path.read_bytes())
        if stored.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError("not an RSA key")
        loaded = serialization.load_der_private_key(stored.data, password=None)
    except (OSError, ValueError, TypeError, DecodeError) as e:
        raise ConfigError(f"{path} is not a libp2p RSA identity file ({e}); move it away to create a new one") from None
    if not isinstance(loaded, rsa.RSAPrivateKey):
        raise ConfigError(f"{path} holds a non-RSA key; move it away to create a new one")
    if not is_standard_key(loaded.public_key()):
        raise ConfigError(
            f"{path} holds an RSA key peers refuse (exponent 65537 and at least 2048 bits are required); "
            "move it away to create a new one"
        )
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key._private_key = loaded  # hivemind has no public constructor from an existing key
    return key


def peer_id_of(public_key: rsa.RSAPublicKey) -> str:
    """The libp2p peer id (base58) of an RSA public key."""
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return base58.b58encode(digest).decode()


@lru_cache(maxsize=4096)
def _owner_peer_id(subkey: bytes) -> str | None:
    match = _OWNER.match(subkey)
    if match is None:
        return None
    try:
        public_key = RSAPublicKey.from_bytes(match.group(1))._public_key
    except (ValueError, TypeError):
        return None
    if not (isinstance(public_key, rsa.RSAPublicKey) and is_standard_key(public_key)):
        return None
    return peer_id_of(public_key)


def owner_peer_id(subkey: Any) -> str | None:
    """The peer id of the key that signed a record stored under `subkey`; None if the subkey names no RSA owner."""
    return _owner_peer_id(subkey) if isinstance(subkey, bytes) else None
