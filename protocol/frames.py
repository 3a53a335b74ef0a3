"""A cap on the frames hivemind reads from a libp2p stream, checked at the frame's header, before any allocation.

hivemind's stream reader takes an 8-byte length and then `readexactly(length)`, so a peer that declares a 256 MiB
frame gets all of it buffered before any handler of ours sees a byte (measured). Every frame hetero-node sends is
at most a 1 MiB piece plus its framing, and libp2p refuses messages above 4 MiB anyway, so a frame declared larger
than `MAX_FRAME_BYTES` is refused at its header and the stream is closed. Installed once per process, before
hivemind forks its DHT child, by every node (`PeerRuntime`, the bootstrap).
"""

from __future__ import annotations

import asyncio

from hetero_node.protocol.errors import PayloadError

MAX_FRAME_BYTES = 8 << 20


async def receive_bounded_frame(reader: asyncio.StreamReader) -> bytes:
    """hivemind's `P2P.receive_raw_data`, refusing a declared length above `MAX_FRAME_BYTES`."""
    from hivemind.p2p import P2P

    length = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
    if length > MAX_FRAME_BYTES:
        raise PayloadError(f"a peer declared a {length}-byte frame; the limit is {MAX_FRAME_BYTES}")
    return await reader.readexactly(length)


def bound_hivemind_frames() -> None:
    """Make every hivemind stream in this process (and in children forked later) read through the cap."""
    from hivemind.p2p import P2P

    P2P.receive_raw_data = staticmethod(receive_bounded_frame)
