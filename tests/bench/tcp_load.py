"""TCP load tools for `make bench`: a writer of pre-encoded PUB/MPUB frames and a frame-counting reader.

Both are plain blocking sockets in their own processes, doing as little per message as possible so the
figure measured is the broker's: the writer sends batches of pre-built commands and counts OK replies by
byte count; the reader walks frames with struct offsets (no message objects) and FINs in one write per
receive.
"""

from __future__ import annotations

import socket
import struct
import time

from trio_nsq.shared.protocol import (
    MAGIC_V2,
    encode_identify,
    encode_mpub,
    encode_pub,
    encode_rdy,
    encode_sub,
)

_FRAME = struct.Struct(">ii")
_OK_FRAME_LEN = 10  # [size=6][type=0]"OK"
_NS = struct.Struct(">q")


def _connect(address: tuple[str, int]) -> socket.socket:
    sock = socket.create_connection(address)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(MAGIC_V2)
    return sock


def writer(address: tuple[str, int], topic: str, batch: int, size: int, duration: float, depth: int = 8, *, result) -> None:
    """Publish `batch` messages per command (1 = PUB) for `duration` s; `depth` commands in flight."""
    body = b"x" * size
    command = encode_pub(topic, body) if batch == 1 else encode_mpub(topic, [body] * batch)
    burst = command * depth
    sock = _connect(address)
    sent = 0
    pending_bytes = 0
    deadline = time.perf_counter() + duration
    start = time.perf_counter()
    while time.perf_counter() < deadline:
        sock.sendall(burst)
        pending_bytes += depth * _OK_FRAME_LEN
        while pending_bytes > 0:
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("broker closed the connection")
            if data[4:8] == b"\x00\x00\x00\x01":
                raise RuntimeError(f"broker error: {data[8:]!r}")
            pending_bytes -= len(data)
        sent += depth * batch
    elapsed = time.perf_counter() - start
    sock.close()
    result.put(("writer", sent, elapsed))


def reader(
    address: tuple[str, int], topic: str, channel: str, duration: float, rdy: int = 2500,
    stop_after: int = 0, latency: bool = False, *, result,
) -> None:
    """Consume for `duration` s (or until `stop_after` messages), FIN'ing everything.

    With latency=True, each body starts with the publisher's time.time_ns() and the reader records
    publish-to-delivery latencies.
    """
    sock = _connect(address)
    sock.sendall(encode_identify({"feature_negotiation": True, "output_buffer_timeout": -1} if latency else {}))
    sock.sendall(encode_sub(topic, channel) + encode_rdy(rdy))
    buf = bytearray()
    count = 0
    lat: list[int] = []
    unpack_frame = _FRAME.unpack_from
    unpack_ns = _NS.unpack_from
    start = time.perf_counter()
    first = None
    deadline = start + duration
    sock.settimeout(0.5)
    while time.perf_counter() < deadline and (not stop_after or count < stop_after):
        try:
            data = sock.recv(1 << 20)
        except socket.timeout:
            continue
        if not data:
            break
        if first is None:
            first = time.perf_counter()
        buf += data
        pos = 0
        fins = []
        end = len(buf)
        now = time.time_ns() if latency else 0
        while end - pos >= 8:
            size, frame_type = unpack_frame(buf, pos)
            if end - pos < 4 + size:
                break
            if frame_type == 2:
                fins.append(b"FIN " + buf[pos + 18 : pos + 34] + b"\n")
                if latency:
                    lat.append(now - unpack_ns(buf, pos + 34)[0])
            elif frame_type == 0 and buf[pos + 8 : pos + 4 + size] == b"_heartbeat_":
                fins.append(b"NOP\n")
            pos += 4 + size
        del buf[:pos]
        if fins:
            count += len(fins)
            sock.sendall(b"".join(fins))
    elapsed = time.perf_counter() - (first or start)
    sock.close()
    result.put(("reader", count, elapsed, lat))


def paced_writer(address: tuple[str, int], topic: str, rate: int, size: int, duration: float, *, result) -> None:
    """PUB at a fixed rate (in 1 ms ticks), each body stamped with time.time_ns() for latency."""
    sock = _connect(address)
    pad = b"x" * max(0, size - 8)
    per_tick = max(1, rate // 1000)
    sent = 0
    start = time.perf_counter()
    next_tick = start
    deadline = start + duration
    pending = 0
    sock.setblocking(True)
    while time.perf_counter() < deadline:
        now = time.perf_counter()
        if now < next_tick:
            time.sleep(next_tick - now)
        frames = b"".join(encode_pub(topic, _NS.pack(time.time_ns()) + pad) for _ in range(per_tick))
        sock.sendall(frames)
        pending += per_tick * _OK_FRAME_LEN
        sent += per_tick
        next_tick += 0.001
        sock.setblocking(False)
        try:
            while pending > 0:
                data = sock.recv(65536)
                if not data:
                    raise ConnectionError("broker closed the connection")
                pending -= len(data)
        except BlockingIOError:
            pass
        sock.setblocking(True)
    sock.close()
    result.put(("writer", sent, time.perf_counter() - start))
