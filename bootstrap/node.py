"""A bootstrap node: a DHT peer with a stable identity and port that everyone else joins through.

It trains nothing. Its jobs: be reachable at the same multiaddr across restarts (identity file + fixed port);
publish the run definition, signed with its identity's RSA key, so a joiner needs nothing but the join line; tell a
joiner which key that is (over the authenticated libp2p connection); answer bandwidth probes; introduce a joiner to the
running nodes (those in its routing table: `protocol/introduction.py`); keep its routing table and its announcement
fresh. It validates the run's peer records like every peer, so a forged or
malformed record is not even stored here.
"""

from __future__ import annotations

import errno
import logging
import multiprocessing
import socket
import threading
from functools import partial
from importlib.metadata import version
from typing import Any

from hetero_node.bootstrap.config import BootstrapConfig
from hetero_node.protocol.errors import PeerAddressError
from hetero_node.protocol.frames import bound_hivemind_frames
from hetero_node.protocol.identity import create_identity, load_identity
from hetero_node.protocol.introduction import register_introduction_handler
from hetero_node.protocol.keys import RUN_KEY_HANDLER, peers_key, runs_key
from hetero_node.protocol.probe import register_probe_handlers
from hetero_node.protocol.proto_build import load_proto_module
from hetero_node.protocol.reachability import register_dialback_handler
from hetero_node.protocol.records import RunAnnouncement, base_validators, run_validators, sealed_announcement
from hetero_node.protocol.run_config import RunConfig
from hetero_node.protocol.socket_dir import use_private_socket_dir
from hetero_node.protocol.swarm_key import MemberProofValidator, load_swarm_key

logger = logging.getLogger(__name__)
wire = load_proto_module("wire")


def require_free_port(host: str, port: int) -> None:
    """Refuse a port another process listens on, before anything is created. p2pd binds with SO_REUSEPORT, so a
    second bootstrap on a taken port would start without a word and share it with the first, each answering some
    of the joiners; a plain socket's bind fails instead (SO_REUSEADDR: a restart may bind over the connections its
    last run left in TIME_WAIT)."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise PeerAddressError(
                    f"port {port} on {host} is already in use by another process (another bootstrap?): "
                    "stop it or give this one another --port"
                ) from None
            raise PeerAddressError(f"cannot listen on {host}:{port}: {e.strerror}") from None


class BootstrapNode:
    """Runs the DHT until `stop` is set; see the module docstring."""

    def __init__(self, cfg: BootstrapConfig, run: RunConfig, data_source: str) -> None:
        import hivemind
        from hivemind.dht.crypto import RSASignatureValidator

        self.cfg, self.run_config = cfg, run
        announce = None
        if cfg.announce:
            proto = "ip6" if ":" in cfg.announce else ("ip4" if cfg.announce.replace(".", "").isdigit() else "dns4")
            announce = [f"/{proto}/{cfg.announce}/tcp/{cfg.port}"]
        self.swarm_key = swarm_key = load_swarm_key(cfg.swarm_key)
        private = [] if swarm_key is None else [MemberProofValidator(swarm_key, peers_key(run.run_id))]
        require_free_port(cfg.host, cfg.port)
        fresh = not cfg.identity.exists()
        if fresh:
            create_identity(cfg.identity)
        self.signer = RSASignatureValidator(load_identity(cfg.identity))  # its peer id's key signs the run
        bound_hivemind_frames()
        use_private_socket_dir()
        multiprocessing.set_start_method("fork", force=True)  # hivemind's DHT process only works when forked
        try:
            self.dht = hivemind.DHT(
                host_maddrs=[f"/ip4/{cfg.host}/tcp/{cfg.port}"],
                announce_maddrs=announce,
                identity_path=str(cfg.identity),
                check_if_identity_free=not fresh,
                record_validators=[*base_validators(self.signer), *run_validators(run.run_id), *private],
                start=True,
            )
        except Exception as e:  # port in use, unreadable identity, ...: say so in one line
            raise PeerAddressError(f"could not start the bootstrap DHT on {cfg.host}:{cfg.port}: {e}") from None
        announcement = RunAnnouncement(
            peer_id=str(self.dht.peer_id),
            run_id=run.run_id,
            software_version=version("hetero-node"),
            protocol_version=run.protocol_version,
            data_source=data_source,
            config=run.to_dict(),
            private=swarm_key is not None,
        ).dict()
        self.announcement = sealed_announcement(announcement, swarm_key)
        """What the DHT holds: the run announcement, sealed in a private swarm."""
        self.dht.run_coroutine(partial(_serve_requests, public_key=self.signer.local_public_key, run_id=run.run_id))
        self.stop = threading.Event()
        self.announced = threading.Event()
        """Set once the run announcement is stored: joiners can learn the run here (`/readyz`)."""

    @property
    def join_addresses(self) -> list[str]:
        """Multiaddrs others should pass to --peers (loopback ones only when that is all there is)."""
        maddrs = [str(a) for a in self.dht.get_visible_maddrs()]
        public = [a for a in maddrs if "/127.0.0.1/" not in a]
        return public or maddrs

    def publish_run(self) -> bool:
        """(Re-)store the signed run announcement; it outlives a few missed heartbeats."""
        from hivemind.utils import get_dht_time

        return self.dht.store(
            runs_key(),
            subkey=self.signer.local_public_key,
            value=self.announcement,
            expiration_time=get_dht_time() + 4 * self.cfg.heartbeat_s,
        )

    def serve_forever(self) -> None:
        """Publish and refresh until stopped; always shuts the DHT (and its p2pd) down."""
        try:
            if self.publish_run():
                self.announced.set()
            else:
                logger.warning("storing the run announcement failed; retrying at the next heartbeat")
            while not self.stop.wait(self.cfg.heartbeat_s):
                if self.publish_run():
                    self.announced.set()
                peers = self.dht.run_coroutine(_refresh_routing_table)
                logger.info("bootstrap %s alive, %d peers in the routing table", self.dht.peer_id, peers)
        finally:
            self.dht.shutdown()


async def _serve_requests(_dht: Any, node: Any, public_key: bytes, run_id: str) -> None:
    """Runs inside the DHT process (via a picklable partial): answer run-key requests, introductions and bandwidth
    probes on the DHT's own P2P instance, so all share the bootstrap's peer id. An introduction names the DHT nodes
    in the routing table: each has talked to us over an authenticated connection, which a record-only id never did."""

    async def answer_run_key(_request: Any, _context: Any) -> Any:
        return wire.RunKeyReply(public_key=public_key, run_id=run_id)

    await node.p2p.add_protobuf_handler(RUN_KEY_HANDLER, answer_run_key, wire.RunKeyRequest)
    await register_introduction_handler(node.p2p, lambda: list(node.protocol.routing_table.uid_to_peer_id.values()))
    await register_probe_handlers(node.p2p)
    await register_dialback_handler(node.p2p)


async def _refresh_routing_table(_dht: object, node: Any) -> int:
    """A lookup of our own id touches the closest buckets, keeping the table fresh (as hivemind-dht does)."""
    await node.find_nearest_nodes([node.node_id])
    return len(node.protocol.routing_table.uid_to_peer_id)
