"""ClientV2: one TCP connection's state (nsqd/client_v2.go) and its output buffer."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

import trio

from trio_nsq.broker.client_state import ClientState
from trio_nsq.shared.protocol import FRAME_HEADER, IdentifyData
from trio_nsq.shared.streams import DeflateStream, PrefixedStream, SnappyStream

if TYPE_CHECKING:
    from trio_nsq.broker.auth import AuthState
    from trio_nsq.shared.protocol import CommandParser
    from trio_nsq.broker.channel import Channel
    from trio_nsq.broker.nsqd import NSQD

log = logging.getLogger("nsqd")



def _setting(value: int, current: float, what: str, low: float, high: float, *,
             off: float | None = None, unit: int = 1000) -> float:
    """One IDENTIFY setting as nsqd reads it: 0 keeps the current value, -1 turns it off where it can be
    (`off`), a value in [low, high] is taken (in `unit`s: milliseconds become seconds), anything else
    is nsqd's error."""
    if value == 0:
        return current
    if value == -1 and off is not None:
        return off
    if low <= value <= high:
        return value / unit
    raise ValueError(f"{what} ({value}) is invalid")

class ClientV2:
    """One TCP client's state (nsqd's clientV2): identity and negotiated features, RDY and in-flight
    counts, the output buffer and the stream (with its TLS/snappy/deflate layers). Written by its
    connection's tasks (ProtocolV2.io_loop, message_pump, heartbeat_loop) and, while it is parked,
    by V2Poller's in-place step; read by /stats; woken by
    its Channel (`wake`) when messages or RDY room appear."""

    def __init__(self, client_id: int, stream: trio.abc.Stream, remote_address: str, nsqd: NSQD) -> None:
        opts = nsqd.options
        self.id = client_id
        self.stream = stream
        self.remote_address = remote_address
        self.nsqd = nsqd
        self.state = ClientState.INIT
        self.connect_time = time.time()

        self.client_id = remote_address.rsplit(":", 1)[0]
        self.hostname = self.client_id
        self.user_agent = ""
        self.tls = False
        self.snappy = False
        self.deflate = False
        self.deflate_level = 0
        # the io_loop's CommandParser, for upgrades that take its buffered bytes
        self.parser: CommandParser | None = None
        self.auth_secret = ""
        self.auth_state: AuthState | None = None  # once AUTH succeeded
        self._tls_common_name = ""

        self.heartbeat_interval = opts.heartbeat_interval
        self.msg_timeout = opts.msg_timeout
        self.output_buffer_size = 16 * 1024
        self.output_buffer_timeout = opts.output_buffer_timeout
        self.sample_rate = 0

        self.channel: Channel | None = None
        self.ready_count = 0
        self.in_flight_count = 0
        self.message_count = 0
        self.finish_count = 0
        self.requeue_count = 0
        self.pub_counts: dict[str, int] = {}

        self.out = bytearray()
        # the plain TCP (or unix) stream and its socket's fd, written to directly by write_now() while
        # no TLS, snappy or deflate layer has replaced it
        self.plain = stream if isinstance(stream, trio.SocketStream) else None
        self.fd = self.plain.socket.fileno() if self.plain is not None else -1
        # what V2Poller's in-place step executed and left for the connection's task: the
        # responses, the error and the command that awaits (ProtocolV2.run_commands' result)
        self.held: tuple | None = None
        # set while ProtocolV2.run_commands executes a subscribed client's commands; pump_due: they
        # made room the io path sends for (ProtocolV2._pump_inline)
        self.inline_pump = False
        self.pump_due = False
        # the last publishing command line whose checks passed (ProtocolV2._check_body_size)
        self.checked_line: tuple = ()
        # set by ProtocolV2.exec_awaiting while a command runs on the authorisation just asked for
        self.auth_refreshed = False
        # backends that hold this batch's published messages and must fsync before we answer OK, each
        # with the first command that put there (its error code answers a failed fsync)
        self.pending_sync: dict = {}
        self._send_lock = trio.StrictFIFOLock()
        self._wake = trio.Event()
        self.identified = trio.Event()
        # set when the connection should end (fatal error, channel deleted, shutdown)
        self.exit_scope: trio.CancelScope | None = None

    def __repr__(self) -> str:
        return f"{self.remote_address}"

    # --- IDENTIFY -----------------------------------------------------------------------------

    def identify(self, data: IdentifyData) -> None:
        """Apply IDENTIFY; raises ValueError with nsqd's text for an out-of-range setting."""
        opts = self.nsqd.options
        self.client_id = data.client_id
        self.hostname = data.hostname
        self.user_agent = data.user_agent

        heartbeat = _setting(data.heartbeat_interval, self.heartbeat_interval, "heartbeat interval",
                             1000, opts.max_heartbeat_interval * 1000, off=0.0)
        buffer_timeout = _setting(data.output_buffer_timeout, self.output_buffer_timeout, "output buffer timeout",
                                  opts.min_output_buffer_timeout * 1000, opts.max_output_buffer_timeout * 1000, off=0.0)
        buffer_size = int(_setting(data.output_buffer_size, self.output_buffer_size, "output buffer size",
                                   64, opts.max_output_buffer_size, off=1, unit=1))
        if data.output_buffer_size == -1:
            buffer_timeout = 0.0  # no buffer: every write goes out at once
        if not 0 <= data.sample_rate <= 99:
            raise ValueError(f"sample rate ({data.sample_rate}) is invalid")
        msg_timeout = _setting(data.msg_timeout, self.msg_timeout, "msg timeout", 1000, opts.max_msg_timeout * 1000)

        self.heartbeat_interval = heartbeat
        self.output_buffer_timeout = buffer_timeout
        self.output_buffer_size = buffer_size
        self.sample_rate = data.sample_rate
        self.msg_timeout = msg_timeout
        self.identified.set()
        self.wake()

    # --- readiness (the message pump waits on this) ---------------------------------------------

    def wake(self) -> None:
        self._wake.set()

    async def wait(self, channel: Channel | None) -> None:
        """Sleep until something may let the pump send: RDY, FIN/REQ/timeout, SUB, unpause, or (when a
        channel is given) a new message in it. A wake() since the last wait returns at once, so no
        wake-up is lost between the caller's check and this call."""
        if not self._wake.is_set():
            if channel is not None:
                channel.waiters.add(self)
            try:
                await self._wake.wait()
            finally:
                if channel is not None:
                    channel.waiters.discard(self)
        self._wake = trio.Event()

    def ready_room(self) -> int:
        return self.ready_count - self.in_flight_count

    def _room_changed(self) -> None:
        # while ProtocolV2.run_commands executes a consumer's commands, the io path sends for the
        # pump afterwards (_pump_inline) instead of waking it
        if self.inline_pump:
            self.pump_due = True
        else:
            self.wake()

    def set_ready_count(self, count: int) -> None:
        self.ready_count = count
        self._room_changed()

    def finished_messages(self, n: int) -> None:
        if n:
            self.finish_count += n
            self.in_flight_count -= n
            self._room_changed()

    def requeued_message(self) -> None:
        self.requeue_count += 1
        self.in_flight_count -= 1
        self._room_changed()

    def timed_out_message(self) -> None:
        self.in_flight_count -= 1
        self.wake()

    def empty(self) -> None:
        self.in_flight_count = 0
        self.wake()

    def published(self, topic: str, count: int) -> None:
        self.pub_counts[topic] = self.pub_counts.get(topic, 0) + count

    def start_close(self) -> None:
        # nsqd: RDY 0 and state closing; the client closes once its in-flight messages are done
        self.ready_count = 0
        self.state = ClientState.CLOSING
        self.wake()

    async def close(self) -> None:
        """Ask the connection to end (its channel was deleted, or the broker is exiting)."""
        if self.exit_scope is not None:
            self.exit_scope.cancel()

    # --- output -------------------------------------------------------------------------------

    def write_frame(self, frame_type: int, data: bytes) -> None:
        self.out += FRAME_HEADER.pack(len(data) + 4, frame_type)
        self.out += data

    async def upgrade_tls(self, context, prefix: bytes) -> None:
        """Server side of the TLS upgrade after IDENTIFY; bytes already read go to the TLS layer."""
        stream = trio.SSLStream(PrefixedStream(self.stream, prefix), context, server_side=True)
        with trio.fail_after(self.nsqd.options.client_timeout):
            await stream.do_handshake()
        self.stream = stream
        self.tls = True
        # kept now: later upgrades (snappy, deflate) wrap the SSLStream and hide its certificate
        for rdn in (stream.getpeercert() or {}).get("subject", ()):
            for key, value in rdn:
                if key == "commonName":
                    self._tls_common_name = value

    def tls_common_name(self) -> str:
        return self._tls_common_name

    def upgrade_snappy(self, prefix: bytes) -> None:
        self.stream = SnappyStream(self.stream, prefix)
        self.snappy = True

    def upgrade_deflate(self, level: int, prefix: bytes) -> None:
        self.stream = DeflateStream(self.stream, level, prefix)
        self.deflate = True
        self.deflate_level = level

    def write_now(self) -> bool:
        """Write the buffer straight to a plain socket, without awaiting: True when it took all of it.
        For the io_loop's answers, which a read follows at once (the read is its checkpoint); what is
        left (a full socket buffer, a flush under way, an upgraded stream, an error) is flush()'s."""
        if self.stream is not self.plain or self._send_lock.locked() or not self.out:
            return not self.out
        try:
            sent = os.write(self.fd, self.out)
        except OSError:
            return False  # would block, or broken: flush() waits, or raises as the stream does
        del self.out[:sent]
        return not self.out

    async def flush(self) -> None:
        """Write what is buffered, in order; a peer that does not read within the write timeout
        (heartbeat interval, as nsqd's write deadline) is cut off instead of stalling the broker."""
        async with self._send_lock:
            if not self.out:
                return
            data, self.out = self.out, bytearray()
            timeout = self.heartbeat_interval if self.heartbeat_interval > 0 else self.nsqd.options.client_timeout
            try:
                with trio.fail_after(timeout):
                    await self.stream.send_all(data)
            except trio.TooSlowError:
                log.error("[%s] - write timeout after %gs, closing (the client is not reading)", self, timeout)
                raise
