"""A consumer shaped like the Spark source, for tests/bench/versus.py: reads `count` waiting messages over
`connections` connections with RDY `rdy` each, holds them and FINs them in runs of `hold` (the source
FINs a micro-batch's messages after its commit), then prints {"messages", "seconds"} as JSON.

    python -m tests.bench.backlog_reader HOST PORT TOPIC CHANNEL COUNT CONNECTIONS RDY HOLD

Plain blocking sockets in one process: what it costs is the same whichever broker it reads.
"""

from __future__ import annotations

import json
import selectors
import socket
import sys
import time

from trio_nsq.shared.protocol import (FRAME_TYPE_ERROR, FRAME_TYPE_MESSAGE, MAGIC_V2, FrameParser, encode_identify,
                                      encode_rdy, encode_sub)

HEARTBEAT = b"_heartbeat_"


def _answer(sock: socket.socket, parser: FrameParser) -> bytes:
    while (frame := parser.next_frame()) is None:
        parser.feed(sock.recv(65536))
    if frame[0] == FRAME_TYPE_ERROR:
        raise SystemExit(f"broker answered {frame[1]!r}")
    return frame[1]


def main(host: str, port: int, topic: str, channel: str, count: int, connections: int, rdy: int, hold: int) -> None:
    selector = selectors.DefaultSelector()
    socks = []
    for _ in range(connections):
        sock = socket.create_connection((host, port))
        parser = FrameParser()
        sock.sendall(MAGIC_V2 + encode_identify({"output_buffer_size": 65536, "output_buffer_timeout": 250}))
        _answer(sock, parser)
        sock.sendall(encode_sub(topic, channel))
        _answer(sock, parser)
        selector.register(sock, selectors.EVENT_READ, parser)
        socks.append(sock)
    started = time.perf_counter()
    for sock in socks:
        sock.sendall(encode_rdy(rdy))
    received, held, held_count = 0, {}, 0
    while received < count:
        events = selector.select(timeout=30)
        if not events:
            raise SystemExit(f"nothing for 30 s after {received} of {count} messages")
        for key, _ in events:
            sock, parser = key.fileobj, key.data
            data = sock.recv(1 << 20)
            if not data:
                raise SystemExit("the broker closed a connection")
            parser.feed(data)
            run = parser.message_run()
            while (frame := parser.next_frame()) is not None:
                if frame[0] == FRAME_TYPE_MESSAGE:
                    run.append(frame[1])
                elif frame[1] == HEARTBEAT:
                    sock.sendall(b"NOP\n")
            if run:
                received += len(run)
                held.setdefault(sock, []).extend(frame[10:26] for frame in run)
                held_count += len(run)
            if held_count >= hold or received >= count:
                for owner, ids in held.items():
                    owner.sendall(b"".join([b"FIN " + msg_id + b"\n" for msg_id in ids]))
                held, held_count = {}, 0
    seconds = time.perf_counter() - started
    for sock in socks:
        sock.close()
    print(json.dumps({"messages": received, "seconds": seconds}))


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], int(a[1]), a[2], a[3], int(a[4]), int(a[5]), int(a[6]), int(a[7]))
