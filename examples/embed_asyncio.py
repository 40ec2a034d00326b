"""An asyncio program with nsqd inside it (on a thread of its own): publish two, consume one, exit.

    python examples/embed_asyncio.py [DATA_PATH]

The client side is plain asyncio streams speaking NSQ's V2 protocol; any asyncio client works the same
way against nsqd.tcp_address. With DATA_PATH, the unconsumed message is on disk afterwards.
"""

import asyncio
import struct
import sys

from trio_nsq import nsqd_in_thread


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    size, frame_type = struct.unpack(">ii", await reader.readexactly(8))
    return frame_type, await reader.readexactly(size - 4)


async def command(writer, reader, line: bytes, body: bytes | None = None) -> tuple[int, bytes]:
    writer.write(line + b"\n" + (struct.pack(">i", len(body)) + body if body is not None else b""))
    await writer.drain()
    return await read_frame(reader)


async def main(tcp_address: str) -> None:
    host, port = tcp_address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"  V2")
    await command(writer, reader, b"PUB events", b"one")
    await command(writer, reader, b"SUB events worker")
    writer.write(b"RDY 1\n")
    frame_type, data = await read_frame(reader)
    while frame_type != 2:  # skip heartbeats/responses until the message frame
        frame_type, data = await read_frame(reader)
    message_id, body = data[10:26], data[26:]
    print("consumed", body.decode())
    writer.write(b"FIN " + message_id + b"\nRDY 0\n")
    await writer.drain()
    # a second connection publishes what stays queued
    reader2, writer2 = await asyncio.open_connection(host, int(port))
    writer2.write(b"  V2")
    await command(writer2, reader2, b"PUB events", b"two")
    writer.write(b"CLS\n")  # the subscriber closes cleanly; the publisher just hangs up
    for w in (writer, writer2):
        w.close()
        await w.wait_closed()


if __name__ == "__main__":
    with nsqd_in_thread(data_path=sys.argv[1] if len(sys.argv) > 1 else "") as nsqd:
        asyncio.run(main(nsqd.tcp_address))
