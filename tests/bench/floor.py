"""The platform's floor for a one-process Python broker: what a Python process answers when it does
nothing but epoll, read and write (issue 33). `tests/bench/single.py` and `tests/bench/http_versus.py`
run it beside Go nsqd and trio-nsqd, as the "floor" side, on the same input.

    python -m tests.bench.floor --tcp-address=127.0.0.1:P --http-address=127.0.0.1:Q

TCP speaks just enough of protocol V2 for NSQ's bench_writer and go-nsq's consumers (nsq_tail): the
magic, IDENTIFY (a fixed answer), SUB and PUB/MPUB/DPUB (`OK`), RDY and FIN (one 200-byte message out
for each message of room: RDY sets it, a FIN gives one back), NOP, CLS (`CLOSE_WAIT`). HTTP answers every
request `200 OK` once its Content-Length body is in. No topic, no storage, no checks: a ceiling, not a
broker. One epoll, one loop, no Trio; its rate is the most a one-process Python broker could reach here.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import struct

_FRAME = struct.Struct(">ii")
_SIZE = struct.Struct(">i")
OK = _FRAME.pack(6, 0) + b"OK"
CLOSE_WAIT = _FRAME.pack(14, 0) + b"CLOSE_WAIT"
IDENTIFY = json.dumps({"max_rdy_count": 2500, "version": "1.3.0", "max_msg_timeout": 900000, "msg_timeout": 60000,
                       "tls_v1": False, "deflate": False, "deflate_level": 0, "max_deflate_level": 6,
                       "snappy": False, "sample_rate": 0, "auth_required": False, "output_buffer_size": 16384,
                       "output_buffer_timeout": 250}).encode()
IDENTIFY_FRAME = _FRAME.pack(len(IDENTIFY) + 4, 0) + IDENTIFY
_BODY = b"m" * 200
MESSAGE = _FRAME.pack(4 + 26 + len(_BODY), 2) + struct.pack(">qH", 0, 1) + b"0" * 16 + _BODY
HTTP_OK = (b"HTTP/1.1 200 \r\ncontent-type: text/plain; charset=utf-8\r\nx-nsq-content-type: nsq; version=1.0\r\n"
           b"content-length: 2\r\ndate: Fri, 27 Nov 2026 00:00:00 GMT\r\nserver: hypercorn-h11\r\n\r\nOK")


class TCPConn:
    close = False

    def __init__(self) -> None:
        self.buf = bytearray()
        self.magic = False
        self.rdy = 0
        self.in_flight = 0

    def feed(self, data: bytes) -> bytes:
        buf = self.buf
        buf += data
        if not self.magic:
            if len(buf) < 4:
                return b""
            del buf[:4]
            self.magic = True
        out = []
        at = 0
        while True:
            nl = buf.find(b"\n", at)
            if nl < 0:
                break
            line = bytes(buf[at:nl])
            name = line.split(b" ", 1)[0]
            if name in (b"PUB", b"MPUB", b"DPUB", b"IDENTIFY", b"AUTH"):  # a body follows
                if len(buf) < nl + 5:
                    break
                end = nl + 5 + _SIZE.unpack_from(buf, nl + 1)[0]
                if len(buf) < end:
                    break
                out.append(IDENTIFY_FRAME if name == b"IDENTIFY" else OK)
                at = end
                continue
            at = nl + 1
            if name == b"SUB":
                out.append(OK)
            elif name == b"RDY":
                self.rdy = int(line.split(b" ")[1])
            elif name == b"FIN":
                self.in_flight -= 1
            elif name == b"CLS":
                out.append(CLOSE_WAIT)
                self.rdy = 0
            if self.rdy > self.in_flight:  # as nsqd: a message for each free place under RDY
                out.append(MESSAGE * (self.rdy - self.in_flight))
                self.in_flight = self.rdy
        del buf[:at]
        return b"".join(out)


class HTTPConn:
    def __init__(self) -> None:
        self.buf = b""
        self.close = False  # a request said `Connection: close`: closed once answered

    def feed(self, data: bytes) -> bytes:
        buf = self.buf + data
        answers = 0
        while True:
            head_end = buf.find(b"\r\n\r\n")
            if head_end < 0:
                break
            head = buf[:head_end].lower()
            length = 0
            at = head.find(b"content-length:")
            if at >= 0:
                length = int(head[at + 15:head.find(b"\r\n", at) if head.find(b"\r\n", at) > 0 else None])
            if len(buf) < head_end + 4 + length:
                break
            buf = buf[head_end + 4 + length:]
            answers += 1
            if b"connection: close" in head:
                self.close = True
                break
        self.buf = buf
        return HTTP_OK * answers


def _listener(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, int(port)))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def serve(tcp_address: str, http_address: str) -> None:
    listeners = {s.fileno(): (s, kind) for s, kind in ((_listener(tcp_address), TCPConn),
                                                        (_listener(http_address), HTTPConn))}
    poll = select.epoll()
    for fd in listeners:
        poll.register(fd, select.EPOLLIN)
    conns: dict[int, tuple[socket.socket, TCPConn | HTTPConn]] = {}
    while True:
        for fd, _ in poll.poll():
            if fd in listeners:
                sock, kind = listeners[fd]
                try:
                    conn, _ = sock.accept()
                except BlockingIOError:
                    continue
                conn.setblocking(False)
                conns[conn.fileno()] = (conn, kind())
                poll.register(conn.fileno(), select.EPOLLIN)
                continue
            sock, state = conns[fd]
            try:
                data = os.read(fd, 262144)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                poll.unregister(fd)
                conns.pop(fd)[0].close()
                continue
            answer = state.feed(data)
            if answer:
                sock.setblocking(True)  # a floor, not a broker: a full socket just blocks
                try:
                    sock.sendall(answer)
                except OSError:
                    pass
                sock.setblocking(False)
            if state.close:
                poll.unregister(fd)
                conns.pop(fd)[0].close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tcp-address", required=True)
    parser.add_argument("--http-address", required=True)
    parser.add_argument("--data-path", default="", help="ignored (Broker passes one)")
    parser.add_argument("--log-level", default="", help="ignored")
    args, _ = parser.parse_known_args()
    serve(args.tcp_address, args.http_address)


if __name__ == "__main__":
    main()
