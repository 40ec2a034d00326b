"""nsq_tail in miniature: print the bodies of a topic's messages, one per line.

    python -m shared.tail --nsqd-tcp-address 127.0.0.1:4150 --topic test [--channel tail] [-n 10]

A command-line tool, so it prints. It speaks protocol V2 through shared.protocol with a plain socket.
"""

from __future__ import annotations

import argparse
import random
import socket
import sys

from shared.http import split_host_port
from shared.protocol import (
    FRAME_TYPE_ERROR,
    FRAME_TYPE_MESSAGE,
    HEARTBEAT,
    MAGIC_V2,
    FrameParser,
    decode_message,
    encode_fin,
    encode_identify,
    encode_nop,
    encode_rdy,
    encode_sub,
)
from shared.version import USER_AGENT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nsqd-tcp-address", default="127.0.0.1:4150")
    parser.add_argument("--topic", required=True)
    parser.add_argument("--channel", default=f"tail{random.randrange(1000000)}#ephemeral")
    parser.add_argument("-n", "--total-messages", type=int, default=0, help="exit after this many (0 = forever)")
    args = parser.parse_args(argv)
    host, port = split_host_port(args.nsqd_tcp_address, default_host="127.0.0.1")
    sock = socket.create_connection((host, port))
    sock.sendall(MAGIC_V2 + encode_identify({"user_agent": USER_AGENT}) + encode_sub(args.topic, args.channel)
                 + encode_rdy(200))
    frames = FrameParser()
    count = 0
    out = sys.stdout.buffer
    while True:
        data = sock.recv(65536)
        if not data:
            return 1
        frames.feed(data)
        for kind, payload in frames:
            if kind == FRAME_TYPE_MESSAGE:
                msg = decode_message(payload)
                out.write(msg.body + b"\n")
                out.flush()
                sock.sendall(encode_fin(msg.id))
                count += 1
                if args.total_messages and count >= args.total_messages:
                    return 0
            elif kind == FRAME_TYPE_ERROR:
                print(payload.decode(errors="replace"), file=sys.stderr)
                return 1
            elif payload == HEARTBEAT:
                sock.sendall(encode_nop())


if __name__ == "__main__":
    raise SystemExit(main())
