"""Private swarms: a shared secret only authorised peers hold (`--swarm-key FILE`, made by `hetero-node swarm-key`).

libp2p's private networks (a pre-shared key on every connection) are not exposed by hivemind's p2pd, so membership
is proved where hetero-node reads and serves things: a member's proof is HMAC-SHA256(key, peer id). A peer id is
bound to its libp2p identity (a record is signed by that key, streams and averaging groups authenticate it), so a
proof read from the DHT is worth nothing to anyone else. With a key:

* a peer's record carries its proof; DHT nodes refuse to store a record without a valid one (`MemberProofValidator`)
  and readers drop it, so an outsider never appears in anyone's view (no role, no slot, no neighbour);
* blobs (messages, manifests, states) are served only to peers whose record is in the view;
* averaging groups leave out members whose gathered metadata carries no valid proof (every member sees the same
  metadata, so all leave out the same ones);
* records and the run announcement are sealed (`seal_value`): AES-256-GCM under a key derived from the swarm key,
  bound to their author. What stays in the clear is what DHT nodes check before storing (the author's peer id, its
  proof, "private"), so an outsider who knows the bootstrap learns no address, hardware, role or run config.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from hetero_node.protocol.errors import ConfigError

KEY_BYTES = 32
NONCE_BYTES = 12
SEALED_FIELD = "sealed"
"""The field of a sealed DHT value that holds its encrypted content."""
PROOF_PATTERN = r"^([0-9a-f]{64})?$"
"""A proof in a record or group metadata: 64 hex digits, or "" in a public swarm."""


def create_swarm_key(path: Path) -> None:
    """Write a new random key as hex, readable by its owner only; refuse to overwrite one."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(f"{path} already exists: a swarm key is never overwritten") from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(KEY_BYTES) + "\n")


def load_swarm_key(path: Path | None) -> bytes | None:
    """The key in `path` (hex, as `create_swarm_key` writes it), None without a path (a public swarm); ConfigError
    saying what is wrong otherwise."""
    if path is None:
        return None
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--swarm-key {path}: cannot read it ({e})") from None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ConfigError(f"--swarm-key {path}: not a hex key (make one with `hetero-node swarm-key FILE`)") from None
    if len(key) < KEY_BYTES:
        raise ConfigError(f"--swarm-key {path}: {len(key)} bytes; a key has at least {KEY_BYTES}")
    return key


def member_proof(key: bytes | None, peer_id: str) -> str:
    """This peer's proof of membership ("" without a key)."""
    return "" if key is None else hmac.new(key, peer_id.encode(), hashlib.sha256).hexdigest()


def is_member(key: bytes | None, peer_id: Any, proof: Any) -> bool:
    """Whether `proof` proves `peer_id` holds the key (always true without a key: a public swarm)."""
    if key is None:
        return True
    if not (isinstance(peer_id, str) and isinstance(proof, str)):
        return False
    return hmac.compare_digest(member_proof(key, peer_id), proof)


@functools.lru_cache(maxsize=4)
def _cipher(key: bytes) -> AESGCM:
    """The sealing cipher of a swarm key: its own derived key, so the HMAC proofs and the cipher never share one."""
    derived = HKDF(algorithm=SHA256(), length=32, salt=None, info=b"hetero-node sealed values").derive(key)
    return AESGCM(derived)


def seal_value(key: bytes, value: Any, context: str) -> bytes:
    """`value` (anything the DHT's msgpack stores) encrypted and authenticated under `key`, bound to `context` (who
    wrote it, what it is): a member cannot pass another's sealed value off as its own."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    return nonce + _cipher(key).encrypt(nonce, DHTProtocol.serializer.dumps(value), context.encode())


def open_value(key: bytes, sealed: Any, context: str) -> Any | None:
    """What `seal_value` sealed under `key` and `context`; None when it was not (another key or context, a changed
    byte, not bytes at all)."""
    if not isinstance(sealed, bytes) or len(sealed) <= NONCE_BYTES:
        return None
    try:
        plain = _cipher(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], context.encode())
    except InvalidTag:
        return None
    try:
        return DHTProtocol.serializer.loads(plain)
    except Exception:  # msgpack's own error types: a member sealed bytes that are not a value
        return None


class MemberProofValidator(RecordValidatorBase):
    """Refuses to store, under one run's peers key, a record without a valid member proof (module level: hivemind
    pickles validators into its DHT process)."""

    def __init__(self, key: bytes, peers_key: str) -> None:
        self.key, self.key_id = key, DHTID.generate(source=peers_key).to_bytes()

    def validate(self, record: DHTRecord) -> bool:
        if record.key != self.key_id:
            return True
        try:
            value = DHTProtocol.serializer.loads(record.value)
        except Exception:  # whatever the bytes are, they are not a member's record
            return False
        return isinstance(value, dict) and is_member(self.key, value.get("peer_id"), value.get("member_proof"))

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False
