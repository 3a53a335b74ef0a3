"""Latency for the netlab without `netem`: a transparent TCP proxy in each delayed node's namespace.

This kernel has neither `netem` nor a qdisc that holds packets until a departure time (`fq`, `etf`), so the delay
lives in user space. An iptables rule in the node's namespace redirects every TCP connection the node opens to
another lab address to this proxy (`REDIRECT` in the nat table's OUTPUT chain). The proxy reads where the
connection was going (`SO_ORIGINAL_DST`), waits one round trip (the handshake), dials it from the same namespace
(its own sockets carry a firewall mark the rule skips, so they are not redirected again), and relays both
directions, holding every chunk for the one-way delay before writing it on. Both ends keep their addresses:
the far end sees a connection from the node's own address, and the node's link shaping (tbf) still applies.

A connection's one-way delay is the dialer's access latency plus the far end's (`--delays`), so a lab node's
`latency_ms` is that of its access link, and a round trip between two nodes is twice their sum. What it models:
the time every request, reply and message spends in flight. What it does not: TCP's own reaction to a long round
trip (each end talks TCP to a nearby socket, so slow start and the congestion window see loopback times; a real
long path ramps up slower).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import logging
import socket
import struct
import sys

MARK = 0x4E4C
"""The firewall mark on the proxy's own outgoing sockets: the redirect rule skips them."""
SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
CHUNK = 64 * 1024
QUEUED_CHUNKS = 256
"""At most this many chunks in flight per direction (16 MiB: a 1 Gbit/s link's 130 ms of data); a full queue
stops reading, so the sender's TCP window closes instead of the proxy's memory growing."""

log = logging.getLogger(__name__)


def redirect_rules(lab_subnet: str, own_address: str, port: int) -> list[list[str]]:
    """The iptables arguments (after `iptables`, in order) that send the node's outgoing lab connections, except
    to itself and the proxy's own, to the proxy."""
    chain = ["-t", "nat", "-A", "OUTPUT", "-p", "tcp"]
    return [[*chain, "-d", own_address, "-j", "RETURN"],
            [*chain, "-d", lab_subnet, "-m", "mark", "!", "--mark", str(MARK), "-j", "REDIRECT", "--to-ports",
             str(port)]]  # fmt: skip


def original_destination(sock: socket.socket) -> tuple[str, int]:
    """Where a redirected connection was headed before the REDIRECT rule rewrote it."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, packed = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(packed), port


class DelayProxy:
    """Accepts redirected connections and relays them with `delay_s(destination)` each way."""

    def __init__(self, delays_ms: dict[str, float], default_ms: float) -> None:
        self.delays_ms, self.default_ms = delays_ms, default_ms

    def delay_s(self, address: str) -> float:
        return self.delays_ms.get(address, self.default_ms) / 1000

    async def serve(self, port: int) -> asyncio.Server:
        return await asyncio.start_server(self._connection, "127.0.0.1", port, limit=CHUNK)

    async def _connection(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        address, port = original_destination(client_writer.get_extra_info("socket"))
        delay = self.delay_s(address)
        upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        upstream.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, MARK)
        upstream.setblocking(False)
        try:
            await asyncio.sleep(2 * delay)  # the handshake's round trip
            await asyncio.get_running_loop().sock_connect(upstream, (address, port))
            reader, writer = await asyncio.open_connection(sock=upstream, limit=CHUNK)
        except OSError as e:  # refused or unreachable: the dialer sees its connection close, as it would
            log.debug("%s:%d: %r", address, port, e)
            upstream.close()
            client_writer.close()
            return
        try:
            await asyncio.gather(relay(client_reader, writer, delay), relay(reader, client_writer, delay))
        finally:
            writer.close()
            client_writer.close()


async def relay(source: asyncio.StreamReader, sink: asyncio.StreamWriter, delay: float) -> None:
    """Copy `source` to `sink`, each chunk written `delay` seconds after it was read, in order; end of stream is
    passed on the same way (half-close). A reset on either side closes `sink` (the other direction then ends)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUED_CHUNKS)

    async def read() -> None:
        while chunk := await source.read(CHUNK):
            await queue.put((loop.time() + delay, chunk))
        await queue.put((loop.time() + delay, b""))

    async def deliver() -> None:
        while True:
            due, chunk = await queue.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            if not chunk:
                if sink.can_write_eof():
                    sink.write_eof()
                return
            sink.write(chunk)
            await sink.drain()

    tasks = [asyncio.ensure_future(read()), asyncio.ensure_future(deliver())]
    for task in tasks:  # a reset is how a connection ends, not an error to log ("exception was never retrieved")
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:  # also when the connection's other direction failed and cancelled us
        for task in tasks:
            task.cancel()
    if any(not task.cancelled() and task.exception() is not None for task in done):
        sink.close()


def parse_delays(text: str) -> dict[str, float]:
    """`{"10.213.0.2": 45.0, ...}`: one-way milliseconds per destination address, checked."""
    delays = json.loads(text)
    if not isinstance(delays, dict):
        raise ValueError("--delays must be a JSON object of address -> milliseconds")
    for address, ms in delays.items():
        ipaddress.IPv4Address(address)
        if type(ms) not in (int, float) or ms < 0:
            raise ValueError(f"--delays: {address} needs a non-negative number of milliseconds, got {ms!r}")
    return {a: float(ms) for a, ms in delays.items()}


async def _main(args: argparse.Namespace) -> None:
    proxy = DelayProxy(parse_delays(args.delays), args.default_ms)
    server = await proxy.serve(args.port)
    print("ready", flush=True)  # the lab waits for this line before it redirects anything here
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True, help="Loopback port to listen on.")
    parser.add_argument("--delays", default="{}", help="JSON: destination address -> one-way delay in ms.")
    parser.add_argument("--default-ms", type=float, default=0.0, help="One-way delay to any other address.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(args))


if __name__ == "__main__":
    main()
