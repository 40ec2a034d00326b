"""Protocol V2: one connection's io_loop, message_pump and heartbeats, and every command (nsqd/protocol_v2.go).

Parsing is sans-IO (trio_nsq.shared.protocol.CommandParser); this module decides what each command does and
owns the connection's tasks in one nursery, so ending any of them ends the connection.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import ssl
from typing import TYPE_CHECKING

import trio

from trio_nsq.broker.auth import AuthError, AuthState, query_any_authd
from trio_nsq.broker.storage.backend import BackendError
from trio_nsq.broker.channel import ChannelError
from trio_nsq.broker.client_state import ClientState, check_command
from trio_nsq.broker.client_v2 import ClientV2
from trio_nsq.broker.message import Message
from trio_nsq.broker.topic import ReplicationError
from trio_nsq.broker.v2_poller import EOF, READ, TIMEOUT
from trio_nsq.broker.channel import Channel
from trio_nsq.shared.streams import CompressionError
from trio_nsq.shared.names import is_valid_channel_name, is_valid_topic_name
from trio_nsq.shared.protocol import (
    CLOSE_WAIT,
    FRAME_TYPE_ERROR,
    FRAME_TYPE_RESPONSE,
    HEARTBEAT,
    MESSAGE_FRAME_HEADER,
    MSG_ID_LENGTH,
    OK,
    ClientError,
    Command,
    CommandParser,
    FatalClientError,
    IdentifyData,
    parse_int,
    parse_mpub_body,
    topology_fields,
)
from trio_nsq.shared.version import VERSION

if TYPE_CHECKING:
    from trio_nsq.broker.nsqd import NSQD

log = logging.getLogger("nsqd")

RECV_SIZE = 64 * 1024


class ProtocolV2:
    """nsqd's protocolV2: one instance per broker, stateless across connections. NSQD's TCP accept loop
    calls `serve` for each connection, which runs the connection's tasks in one nursery: io_loop (reads
    commands in batches, checks each with client_state.check_command, executes, answers once per read),
    message_pump (sends messages from the subscribed channel as RDY allows) and heartbeat_loop. A task
    that ends ends the connection and its nursery, never the broker."""

    def __init__(self, nsqd: NSQD) -> None:
        self.nsqd = nsqd
        self.options = nsqd.options

    # --- connection ---------------------------------------------------------------------------

    async def serve(self, client: ClientV2, initial: bytes = b"") -> None:
        """Run the connection until the peer leaves, a fatal error, or cancellation."""
        parser = CommandParser(lambda name, params, size: self._check_body_size(client, name, params, size))
        try:
            with trio.CancelScope() as client.exit_scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self.message_pump, client)
                    nursery.start_soon(self.heartbeat_loop, client)
                    await self.io_loop(client, parser, initial)
                    nursery.cancel_scope.cancel()
        finally:
            log.info("PROTOCOL(V2): [%s] exiting ioloop", client)
            if client.channel is not None:
                client.channel.remove_client(client)
            self.nsqd.remove_client(client)

    async def io_loop(self, client: ClientV2, parser: CommandParser, initial: bytes) -> None:
        """Execute every complete command received, then answer them with one write.

        Responses wait for the fsync of what the batch published when the broker acknowledges only
        durable messages (--sync-every=1): every command in the batch, and every other connection
        waiting at that moment, shares one fsync (group commit). A read waits at most twice the
        heartbeat interval (nsqd's read deadline). Between commands, a producer's connection waits in
        the broker's V2Poller, which serves it in place (step) until it needs this task again.
        """
        client.parser = parser
        if initial:
            parser.feed(initial)
        # one scope for every read of the connection, its deadline set while a read waits: a scope
        # entered per read (trio.fail_after) cost ~8 % of the broker's time under bench_writer
        with trio.CancelScope() as reads:
            timed_out = await self._io_loop(client, parser, reads)
        if reads.cancel_called or timed_out:
            log.error("[%s] - failed to read command - timeout after %gs", client, client.heartbeat_interval * 2)

    async def _io_loop(self, client: ClientV2, parser: CommandParser, reads: trio.CancelScope) -> bool:
        """The connection's loop; True when it ends because its read deadline passed while parked."""
        poller = self.nsqd.v2_poller
        while True:
            held = client.held
            if held is not None:  # what the poller executed and left for this task to answer
                client.held = None
                responses, error, awaiting = held
            else:
                responses, error, awaiting = self.run_commands(client, parser)
            while awaiting is not None and error is None:
                # a command that awaits: the answers before it go first, in order (IDENTIFY may
                # upgrade the stream)
                if responses or client.pending_sync:
                    if not await self._answer(client, responses, None):
                        return False
                    responses = []
                try:
                    response = await self.exec_awaiting(client, awaiting)
                except ClientError as err:
                    error = err
                    break
                if response is not None:
                    responses.append(response)
                more, error, awaiting = self.run_commands(client, parser)
                responses += more
            if not await self._answer(client, responses, error):
                return False
            if client.pump_due:
                self._pump_inline(client)
            if error is not None:
                continue
            if poller is not None and self._parkable(client):
                outcome = await poller.park(client, parser)
                if outcome != READ:
                    return outcome == TIMEOUT
                if client.out:  # an answer the socket did not take at once
                    await client.flush()
                continue
            if client.heartbeat_interval > 0:
                reads.deadline = trio.current_time() + client.heartbeat_interval * 2
            try:
                data = await client.stream.receive_some(max(RECV_SIZE, parser.wanted()))
                # past here nothing is timed (a deadline that passed meanwhile ends the loop at its
                # next checkpoint: the read came too late)
                reads.deadline = math.inf
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, CompressionError) as exc:
                log.info("[%s] - connection error - %s", client, exc)
                return False
            if not data:
                return False
            parser.feed(data)

    @staticmethod
    def _parkable(client: ClientV2) -> bool:
        """A plain connection, publishing or subscribed, with no answer left to write: the poller may
        serve it."""
        return (client.state in _PARKED_STATES and client.fd >= 0 and client.stream is client.plain
                and not client.out and not client.pending_sync)

    def step(self, client: ClientV2, parser: CommandParser) -> str | None:
        """V2Poller's turn for a readable parked connection: read, execute and answer in place.
        None: done, it stays parked; else why its task must take over (v2_poller.READ, EOF)."""
        try:
            data = os.read(client.fd, max(RECV_SIZE, parser.wanted()))
        except BlockingIOError:
            return None
        except OSError as exc:
            log.info("[%s] - connection error - %s", client, exc)
            return EOF
        if not data:
            return EOF
        parser.feed(data)
        responses, error, awaiting = self.run_commands(client, parser)
        if error is not None or awaiting is not None or client.pending_sync:
            client.held = (responses, error, awaiting)
            return READ
        if responses:
            for response in responses:
                client.write_frame(FRAME_TYPE_RESPONSE, response)
            if not client.write_now():
                return READ
        if client.pump_due:
            self._pump_inline(client)
        return None if client.state in _PARKED_STATES else READ

    def run_commands(self, client: ClientV2, parser: CommandParser) -> tuple[list[bytes], ClientError | None, Command | None]:
        """Execute the complete commands buffered, up to the first that must await (returned, for
        exec_awaiting: IDENTIFY, AUTH, or an authorisation to ask for again) or the first error.
        Returns their responses, the error and that command."""
        responses: list[bytes] = []
        awaiting: Command | None = None
        run = _PublishRun()
        # a consumer's FINs, REQs and RDYs note that the pump has room instead of waking it: the
        # caller sends for it once the answers are written (_pump_inline)
        client.inline_pump = client.state == ClientState.SUBSCRIBED
        try:
            try:
                while True:
                    fins = parser.peek_fins()
                    if fins:
                        self._finish_run(client, parser, fins)
                    command = parser.next_command()
                    if command is None:
                        break
                    name = command.name
                    if name in _RUNS:
                        if not self._add_to_run(client, run, command, responses):
                            awaiting = command
                            break
                        continue
                    if run.count:
                        self._publish_run(client, run, responses)
                    if command.body is None:  # a body command was checked by the parser before its body was read
                        check_command(name, len(command.params), client.state, self._tls_ok(client))
                    handler = _HANDLERS.get(name)
                    if handler is None:  # IDENTIFY, AUTH
                        awaiting = command
                        break
                    try:
                        response = handler(self, client, command)
                    except (_AskAuthAgain, _NameFirst):
                        awaiting = command
                        break
                    if response is not None:
                        responses.append(response)
            finally:
                client.inline_pump = False
                if run.count:
                    # what came before an error is answered before it (a fatal error of the run
                    # itself replaces the other one)
                    self._publish_run(client, run, responses)
        except ClientError as err:
            return responses, err, None
        return responses, None, awaiting

    def _add_to_run(self, client: ClientV2, run: _PublishRun, cmd: Command, responses: list[bytes]) -> bool:
        """PUB and DPUB commands that follow each other in one read, to one topic (a DPUB with one delay),
        are published as one batch: one write to the topic's log instead of one each, the same messages,
        ids, order and answers as one publish each (each answered OK, in place). False when the
        command must wait for its authorisation to be asked for again."""
        if run.count and cmd.params == run.params and cmd.name == run.name:  # the run goes on
            run.bodies.append(cmd.body or b"")
            run.count += 1
            return True
        topic_name = cmd.params[0].decode()
        delay = self._dpub_timeout(cmd.params[1]) if cmd.name == b"DPUB" else 0.0
        if run.count and (run.name != cmd.name or run.topic != topic_name or run.delay != delay):
            self._publish_run(client, run, responses)
        if not run.count:
            try:
                self._authorize(client, cmd.name.decode(), topic_name)
            except _AskAuthAgain:
                return False
            run.name, run.topic, run.delay = cmd.name, topic_name, delay
        run.params = cmd.params
        run.bodies.append(cmd.body or b"")
        run.count += 1
        return True

    def _publish_run(self, client: ClientV2, run: _PublishRun, responses: list[bytes]) -> None:
        """Publish a run; its commands are answered OK up to the first one the topic could not store,
        which gets the command's fatal E_<cmd>_FAILED."""
        command = run.name.decode()
        bodies = run.bodies
        run.count = 0
        run.bodies = []
        try:
            topic = self.nsqd.topic_for_client(run.topic)
            published = topic.publish(bodies, run.delay)
        except BackendError as exc:
            responses.extend([OK] * exc.stored)
            client.published(run.topic, exc.stored)
            raise _publish_failed(command, exc) from None
        if published.sync is not None:
            client.pending_sync.setdefault(published.sync, command)
        self._await_name(client, command, run.topic)
        client.published(run.topic, published.count)
        responses.extend([OK] * len(bodies))

    def _await_name(self, client: ClientV2, command: str, topic: str, channel: str = "") -> None:
        """A command that made its topic (or channel), or came while another's making of it is not on disk
        yet, is answered once nsqd.dat names it (as an fsync is awaited: pending_sync). Only a creation
        pays: `unnamed` is empty otherwise."""
        meta = self.nsqd.meta
        if meta.unnamed and not meta.is_named(topic, channel):
            client.pending_sync.setdefault(meta.names, command)

    async def heartbeat_loop(self, client: ClientV2) -> None:
        """Send _heartbeat_ every heartbeat_interval; IDENTIFY restarts the schedule with its interval."""
        identified = client.identified
        while True:
            interval = client.heartbeat_interval
            restart = False  # set when IDENTIFY came first: the schedule restarts with its interval
            with trio.move_on_after(interval if interval > 0 else math.inf):
                if identified.is_set():
                    await trio.sleep_forever()
                else:
                    await identified.wait()
                    restart = True
            if restart:
                continue
            client.write_frame(FRAME_TYPE_RESPONSE, HEARTBEAT)
            await client.flush()

    async def message_pump(self, client: ClientV2) -> None:
        """Send up to RDY − in-flight messages at a time, encoded into one buffer and written together.

        Data is flushed as soon as no more can be sent right now (nothing queued, RDY used up), or when
        the buffer passes output_buffer_size; so it never waits longer than output_buffer_timeout.
        What FINs, REQs and RDYs make room for is sent by the io path itself (_pump_inline), without
        waking this task; it waits for new messages in the channel, SUB, and what the io path leaves it.
        """
        while True:
            taken = self._pump_step(client)
            if not taken:
                if client.out:
                    # straight to the socket when it takes it all; else flushing awaits: look again
                    # afterwards rather than sleep on a stale answer
                    if not client.write_now():
                        await client.flush()
                    continue
                await client.wait(client.channel if taken == 0 else None)
                continue
            if len(client.out) >= client.output_buffer_size or client.output_buffer_timeout == 0:
                await client.flush()
            else:
                # let the io_loop read FINs before the next batch; the loop flushes when it runs dry
                await trio.lowlevel.checkpoint()

    def _pump_step(self, client: ClientV2) -> int | None:
        """Take what RDY allows from the channel and encode it into the output buffer. Returns how many
        were taken (0: the channel had none), or None when the client can take none now (no channel,
        paused, not subscribed, RDY used up)."""
        channel = client.channel
        if channel is None or channel.paused or client.state != ClientState.SUBSCRIBED:
            return None
        want = client.ready_count - client.in_flight_count
        if want <= 0:
            return None
        msgs = channel.take(want)
        if not msgs:
            return 0
        taken = len(msgs)
        now = trio.current_time()
        if client.sample_rate:
            msgs = self._sample(channel, msgs, client.sample_rate)
        frame_header = MESSAGE_FRAME_HEADER.pack
        out = client.out
        for msg in msgs:
            if msg.attempts < 0xFFFF:
                msg.attempts += 1
            body = msg.body
            out += frame_header(30 + len(body), 2, msg.timestamp, msg.attempts)
            out += msg.id
            out += body
        channel.start_in_flight_many(msgs, client.id, now, client.msg_timeout)
        client.in_flight_count += len(msgs)
        client.message_count += len(msgs)
        return taken

    def _pump_inline(self, client: ClientV2) -> None:
        """After the commands of a read made room (FIN, REQ, RDY; their wake-up of the pump held back):
        send what the pump would send now, from here. The pump is woken only for what it must do
        itself: wait on the channel for new messages while RDY has room, or flush what the socket
        did not take."""
        client.pump_due = False
        self._pump_step(client)
        if client.out and not client.write_now():
            client.wake()
            return
        channel = client.channel
        if channel is not None and client.ready_room() > 0 and client not in channel.waiters:
            client.wake()

    @staticmethod
    def _sample(channel: Channel, msgs: list[Message], sample_rate: int) -> list[Message]:
        """nsqd's sample_rate: this share of the stream is delivered, the rest is done with."""
        kept = []
        for msg in msgs:
            if random.randrange(100) > sample_rate:
                channel.drop_sampled(msg)
            else:
                kept.append(msg)
        return kept

    async def _answer(self, client: ClientV2, responses: list[bytes], error: ClientError | None) -> bool:
        """Write the batch's responses (after the group-commit fsync if one is owed) and its error;
        False when the connection must end."""
        if client.pending_sync:
            sync_error = await self._sync_published(client)
            if sync_error is not None:
                # not durable: no publish of this batch may be answered OK (the connection ends)
                responses, error = [], sync_error
        for response in responses:
            client.write_frame(FRAME_TYPE_RESPONSE, response)
        if error is not None:
            log.error("[%s] - %s", client, error)
            client.write_frame(FRAME_TYPE_ERROR, error.frame_data())
        if (responses or error is not None) and not client.write_now():
            await client.flush()
        return error is None or not error.fatal

    async def _sync_published(self, client: ClientV2) -> ClientError | None:
        backends, client.pending_sync = client.pending_sync, {}
        for backend, cmd in backends.items():
            try:
                await backend.sync()
            except BackendError as exc:
                return _publish_failed(cmd, exc)
        return None

    # --- commands -----------------------------------------------------------------------------

    def _check_body_size(self, client: ClientV2, name: bytes, params: tuple[bytes, ...], size: int | None) -> None:
        """nsqd's checks of a body command, in nsqd's order: the params as soon as the line is read
        (size None), then the declared size before the body is buffered. A publishing line the same as
        the last one that passed (a producer's next PUB) passes again: publishing is allowed in every
        state, and the TLS policy only ever allows more."""
        opts = self.options
        if size is None:
            if client.checked_line == (name, params):
                return
            check_command(name, len(params), client.state, self._tls_ok(client))
        if name == b"PUB" or name == b"DPUB":
            if size is None:
                if not is_valid_topic_name(params[0]):
                    raise FatalClientError("E_BAD_TOPIC", f"{name.decode()} topic name {_quote(params[0])} is not valid")
                if name == b"DPUB":
                    self._dpub_timeout(params[1])
                client.checked_line = (name, params)
            elif size <= 0:
                raise FatalClientError("E_BAD_MESSAGE", f"{name.decode()} invalid message body size {size}")
            elif size > opts.max_msg_size:
                raise FatalClientError("E_BAD_MESSAGE", f"{name.decode()} message too big {size} > {opts.max_msg_size}")
        elif name == b"MPUB":
            if size is None:
                if not is_valid_topic_name(params[0]):
                    # sic: nsqd repeats the code inside the description
                    raise FatalClientError("E_BAD_TOPIC", f"E_BAD_TOPIC MPUB topic name {_quote(params[0])} is not valid")
                client.checked_line = (name, params)
            elif size <= 0:
                raise FatalClientError("E_BAD_BODY", f"MPUB invalid body size {size}")
            elif size > opts.max_body_size:
                raise FatalClientError("E_BAD_BODY", f"MPUB body too big {size} > {opts.max_body_size}")
        elif size is not None:  # IDENTIFY, AUTH
            if size > opts.max_body_size:
                raise FatalClientError("E_BAD_BODY", f"{name.decode()} body too big {size} > {opts.max_body_size}")
            elif size <= 0:
                raise FatalClientError("E_BAD_BODY", f"{name.decode()} invalid body size {size}")

    def _tls_ok(self, client: ClientV2) -> bool:
        return client.tls or not self.nsqd.tls_required

    async def exec_awaiting(self, client: ClientV2, cmd: Command) -> bytes | None:
        """A command run_commands could not execute in place (its checks are done): IDENTIFY and AUTH,
        or one whose expired authorisation must be asked for again first (nsqd's CheckAuth)."""
        handler = _AWAITING.get(cmd.name)
        if handler is not None:
            return await handler(self, client, cmd)
        if cmd.name == b"SUB":
            return await self._sub_awaiting(client, cmd)
        await self._ask_auth_again(client)
        try:
            if cmd.name in _RUNS:
                run = _PublishRun()
                responses: list[bytes] = []
                if not self._add_to_run(client, run, cmd, responses):
                    raise AssertionError("an authorisation just given asked for again")
                self._publish_run(client, run, responses)
                return responses[0]
            return _HANDLERS[cmd.name](self, client, cmd)
        finally:
            client.auth_refreshed = False

    async def _ask_auth_again(self, client: ClientV2) -> None:
        try:
            await self._query_authd(client)
        except AuthError as exc:
            log.warning("PROTOCOL(V2): [%s] AUTH failed %s", client, exc)
            raise FatalClientError("E_AUTH_FAILED", "AUTH failed") from None
        client.auth_refreshed = True  # what authd just said counts, even with a ttl already gone

    async def _sub_awaiting(self, client: ClientV2, cmd: Command) -> bytes | None:
        """A SUB that could not be done in place: its authorisation to ask for again, or its topic or
        channel, made by it or by a command not answered yet, to be named on disk first (nsqd.dat), so
        that a crash after its OK keeps the channel and what it is owed. Not subscribed meanwhile: no
        message goes out before the OK."""
        try:
            while True:
                try:
                    return self.SUB(client, cmd)
                except _AskAuthAgain:
                    await self._ask_auth_again(client)
                except _NameFirst:
                    try:
                        await self.nsqd.meta.names.sync()
                    except BackendError as exc:
                        raise FatalClientError("E_SUB_FAILED", f"SUB failed {exc}") from None
        finally:
            client.auth_refreshed = False

    async def IDENTIFY(self, client: ClientV2, cmd: Command) -> bytes | None:
        data = IdentifyData.from_json(cmd.body or b"")
        try:
            client.identify(data)
        except ValueError as exc:
            raise FatalClientError("E_BAD_BODY", f"IDENTIFY {exc}") from None
        log.info("[%s] IDENTIFY: client_id=%s hostname=%s user_agent=%s", client, data.client_id, data.hostname, data.user_agent)
        if not data.feature_negotiation:
            return OK
        opts = self.options
        tls = self.nsqd.tls_context is not None and data.tls_v1
        deflate = opts.deflate and data.deflate
        deflate_level = 6
        if deflate and data.deflate_level > 0:
            deflate_level = data.deflate_level
        deflate_level = min(deflate_level, opts.max_deflate_level)
        snappy = opts.snappy and data.snappy
        if deflate and snappy:
            raise FatalClientError("E_IDENTIFY_FAILED", "cannot enable both deflate and snappy compression")
        response = {
            "max_rdy_count": opts.max_rdy_count,
            "version": VERSION,
            "max_msg_timeout": int(opts.max_msg_timeout * 1000),
            "msg_timeout": int(client.msg_timeout * 1000),
            "tls_v1": tls,
            "deflate": deflate,
            "deflate_level": deflate_level,
            "max_deflate_level": opts.max_deflate_level,
            "snappy": snappy,
            "sample_rate": client.sample_rate,
            "auth_required": self.nsqd.auth_enabled,
            "output_buffer_size": client.output_buffer_size,
            "output_buffer_timeout": int(client.output_buffer_timeout * 1000),
            **topology_fields(opts.topology_zone, opts.topology_region),
        }
        client.write_frame(FRAME_TYPE_RESPONSE, json.dumps(response, separators=(",", ":")).encode())
        await client.flush()
        try:
            if tls:
                log.info("PROTOCOL(V2): [%s] upgrading connection to TLS", client)
                await client.upgrade_tls(self.nsqd.tls_context, self._buffered(client))
                client.write_frame(FRAME_TYPE_RESPONSE, OK)
                await client.flush()
            if snappy:
                log.info("PROTOCOL(V2): [%s] upgrading connection to snappy", client)
                client.upgrade_snappy(self._buffered(client))
                client.write_frame(FRAME_TYPE_RESPONSE, OK)
                await client.flush()
            if deflate:
                log.info("PROTOCOL(V2): [%s] upgrading connection to deflate (level %d)", client, deflate_level)
                client.upgrade_deflate(deflate_level, self._buffered(client))
                client.write_frame(FRAME_TYPE_RESPONSE, OK)
                await client.flush()
        except (ssl.SSLError, trio.BrokenResourceError, trio.TooSlowError, ValueError) as exc:
            raise FatalClientError("E_IDENTIFY_FAILED", f"IDENTIFY failed {exc}") from None
        return None

    @staticmethod
    def _buffered(client: ClientV2) -> bytes:
        """What the client sent after IDENTIFY: it belongs to the upgraded stream."""
        return client.parser.take_buffered() if client.parser is not None else b""

    @staticmethod
    def _channel(client: ClientV2) -> Channel:
        channel = client.channel
        assert channel is not None, "check_command lets only subscribed clients FIN, REQ or TOUCH"
        return channel

    async def AUTH(self, client: ClientV2, cmd: Command) -> bytes | None:
        if client.auth_state is not None and client.auth_state.authorizations:
            raise FatalClientError("E_INVALID", "AUTH already set")
        if not self.nsqd.auth_enabled:
            raise FatalClientError("E_AUTH_DISABLED", "AUTH disabled")
        client.auth_secret = (cmd.body or b"").decode(errors="replace")
        try:
            state = await self._query_authd(client)
        except AuthError as exc:
            log.warning("PROTOCOL(V2): [%s] AUTH failed %s", client, exc)
            raise FatalClientError("E_AUTH_FAILED", "AUTH failed") from None
        if not state.authorizations:
            raise FatalClientError("E_UNAUTHORIZED", "AUTH no authorizations found")
        response = {"identity": state.identity, "identity_url": state.identity_url,
                    "permission_count": len(state.authorizations)}
        client.write_frame(FRAME_TYPE_RESPONSE, json.dumps(response, separators=(",", ":")).encode())
        await client.flush()
        return None

    async def _query_authd(self, client: ClientV2) -> AuthState:
        opts = self.options
        client.auth_state = state = await query_any_authd(
            opts.auth_http_addresses, client.remote_address.rsplit(":", 1)[0].strip("[]"), client.tls,
            client.tls_common_name(), client.auth_secret, method=opts.auth_http_request_method,
            connect_timeout=opts.http_client_connect_timeout, request_timeout=opts.http_client_request_timeout,
        )
        return state

    def _authorize(self, client: ClientV2, cmd: str, topic: str, channel: str = "") -> None:
        """nsqd's CheckAuth: with auth enabled, a client must AUTH first and be allowed this topic/channel;
        an expired authorisation is asked for again (_AskAuthAgain: the command goes to exec_awaiting,
        nothing done yet)."""
        if not self.nsqd.auth_enabled:
            return
        state = client.auth_state
        if state is None or not state.authorizations:
            raise FatalClientError("E_AUTH_FIRST", f"AUTH required before {cmd}")
        if state.is_expired() and not client.auth_refreshed:
            raise _AskAuthAgain()
        if not state.is_allowed(topic, channel):
            raise FatalClientError("E_UNAUTHORIZED", f"AUTH failed for {cmd} on {_quote(topic.encode())} {_quote(channel.encode())}")

    def SUB(self, client: ClientV2, cmd: Command) -> bytes | None:
        if client.heartbeat_interval <= 0:
            raise FatalClientError("E_INVALID", "cannot SUB with heartbeats disabled")
        if len(cmd.params) < 2:
            raise FatalClientError("E_INVALID", "SUB insufficient number of parameters")
        topic_name, channel_name = cmd.params[0], cmd.params[1]
        if not is_valid_topic_name(topic_name):
            raise FatalClientError("E_BAD_TOPIC", f"SUB topic name {_quote(topic_name)} is not valid")
        if not is_valid_channel_name(channel_name):
            raise FatalClientError("E_BAD_CHANNEL", f"SUB channel name {_quote(channel_name)} is not valid")
        self._authorize(client, "SUB", topic_name.decode(), channel_name.decode())
        try:
            topic = self.nsqd.topic_for_client(topic_name.decode())
        except ReplicationError as not_here:  # cluster mode: not a replica of the topic
            # (its own name: mypyc types a function's `exc` by its first binding, and a ChannelError is
            # caught as `exc` below)
            raise FatalClientError("E_SUB_FAILED", f"SUB failed: {not_here}") from None
        if topic.replica is not None:
            refused = topic.replica.refuses_consumers()
            if refused:  # cluster mode: only the topic's leader delivers
                raise FatalClientError("E_SUB_FAILED", f"SUB failed: {refused}")
        channel = topic.get_channel(channel_name.decode())
        try:
            channel.add_client(client, self.options.max_channel_consumers)
        except ChannelError as exc:
            raise FatalClientError("E_SUB_FAILED", f"SUB failed {exc}") from None
        if not self.nsqd.meta.is_named(topic.name, channel.name):
            raise _NameFirst()  # made, not on disk yet: subscribed once it is (_sub_awaiting)
        client.state = ClientState.SUBSCRIBED
        client.channel = channel
        client.wake()
        return OK

    def RDY(self, client: ClientV2, cmd: Command) -> bytes | None:
        if client.state == ClientState.CLOSING:
            log.info("PROTOCOL(V2): [%s] ignoring RDY after CLS in state ClientStateV2Closing", client)
            return None
        count = 1
        if cmd.params:
            try:
                count = parse_int(cmd.params[0])
            except ValueError:
                raise FatalClientError("E_INVALID", f"RDY could not parse count {cmd.params[0].decode(errors='replace')}") from None
        if count < 0 or count > self.options.max_rdy_count:
            raise FatalClientError("E_INVALID", f"RDY count {count} out of range 0-{self.options.max_rdy_count}")
        client.set_ready_count(count)
        return None

    @staticmethod
    def _message_id(cmd: Command) -> bytes:
        msg_id = cmd.params[0]
        if len(msg_id) != MSG_ID_LENGTH:
            raise FatalClientError("E_INVALID", "invalid message ID")
        return msg_id

    def FIN(self, client: ClientV2, cmd: Command) -> bytes | None:
        msg_id = self._message_id(cmd)
        try:
            self._channel(client).finish_message(client.id, msg_id)
        except ChannelError as exc:
            raise ClientError("E_FIN_FAILED", f"FIN {msg_id.decode(errors='replace')} failed {exc}") from None
        client.finished_messages(1)
        return None

    def _finish_run(self, client: ClientV2, parser: CommandParser, ids: list[bytes]) -> None:
        """A run of FIN commands at once, each exactly as FIN() would do it (the same checks and
        errors, in order); the parser consumes those executed, so after an error the rest follow as
        usual."""
        check_command(b"FIN", 1, client.state, self._tls_ok(client))
        finished, error = self._channel(client).finish_messages(client.id, ids)
        client.finished_messages(finished)
        if error is not None:
            parser.skip_fins(finished + 1)  # this one is answered with its error
            raise ClientError("E_FIN_FAILED", f"FIN {ids[finished].decode(errors='replace')} failed {error}")
        parser.skip_fins(finished)

    def REQ(self, client: ClientV2, cmd: Command) -> bytes | None:
        msg_id = self._message_id(cmd)
        try:
            timeout_ms = _parse_signed(cmd.params[1])
        except ValueError:
            raise FatalClientError("E_INVALID", f"REQ could not parse timeout {cmd.params[1].decode(errors='replace')}") from None
        timeout = timeout_ms / 1000
        max_req = self.options.max_req_timeout
        clamped = min(max(timeout, 0.0), max_req)
        if clamped != timeout:
            log.info("PROTOCOL(V2): [%s] REQ timeout %dms out of range 0-%dms. Setting to %dms",
                     client, timeout_ms, max_req * 1000, clamped * 1000)
        try:
            self._channel(client).requeue_message(client.id, msg_id, clamped)
        except ChannelError as exc:
            raise ClientError("E_REQ_FAILED", f"REQ {msg_id.decode(errors='replace')} failed {exc}") from None
        client.requeued_message()
        return None

    def TOUCH(self, client: ClientV2, cmd: Command) -> bytes | None:
        msg_id = self._message_id(cmd)
        try:
            self._channel(client).touch_message(client.id, msg_id, client.msg_timeout, self.options.max_msg_timeout)
        except ChannelError as exc:
            raise ClientError("E_TOUCH_FAILED", f"TOUCH {msg_id.decode(errors='replace')} failed {exc}") from None
        return None

    def CLS(self, client: ClientV2, cmd: Command) -> bytes | None:
        client.start_close()
        return CLOSE_WAIT

    def NOP(self, client: ClientV2, cmd: Command) -> bytes | None:
        return None

    def MPUB(self, client: ClientV2, cmd: Command) -> bytes | None:
        topic_name = cmd.params[0].decode()
        self._authorize(client, "MPUB", topic_name)
        bodies = parse_mpub_body(cmd.body or b"", self.options.max_msg_size, self.options.max_body_size)
        self._publish(client, "MPUB", topic_name, bodies)
        return OK

    def _dpub_timeout(self, raw: bytes) -> float:
        try:
            timeout_ms = _parse_signed(raw)
        except ValueError:
            raise FatalClientError("E_INVALID", f"DPUB could not parse timeout {raw.decode(errors='replace')}") from None
        max_ms = int(self.options.max_defer * 1000)
        if timeout_ms < 0 or timeout_ms > max_ms:
            raise FatalClientError("E_INVALID", f"DPUB timeout {timeout_ms} out of range 0-{max_ms}")
        return timeout_ms / 1000

    def _publish(self, client: ClientV2, command: str, topic_name: str, bodies: list[bytes],
                 deferred: float = 0.0) -> None:
        """Topic.publish for MPUB (its AUTH checked; PUB and DPUB go in runs, _add_to_run): its error is
        the command's fatal E_<cmd>_FAILED; an fsync the answer waits for is owed once for the whole read
        (_sync_published)."""
        try:
            topic = self.nsqd.topic_for_client(topic_name)
            published = topic.publish(bodies, deferred)
        except BackendError as exc:
            raise _publish_failed(command, exc) from None
        if published.sync is not None:
            client.pending_sync.setdefault(published.sync, command)
        self._await_name(client, command, topic_name)
        client.published(topic_name, published.count)


def _publish_failed(command: str, exc: BackendError) -> FatalClientError:
    """E_<cmd>_FAILED for a publish the topic refused or could not make durable; the replication's
    reason first (`PUB failed: NOT_LEADER (leader host:port)`)."""
    if isinstance(exc, ReplicationError):
        return FatalClientError(f"E_{command}_FAILED", f"{command} failed: {exc}")
    return FatalClientError(f"E_{command}_FAILED", f"{command} failed {exc}")


# commands published in runs (_add_to_run)
_RUNS = frozenset({b"PUB", b"DPUB"})


class _PublishRun:
    """PUB or DPUB commands of one read, to one topic with one delay, not published yet."""

    __slots__ = ("name", "params", "topic", "delay", "bodies", "count")

    def __init__(self) -> None:
        self.name = b""
        self.params: tuple[bytes, ...] = ()
        self.topic = ""
        self.delay = 0.0
        self.bodies: list[bytes] = []
        self.count = 0

# a connection in these states may wait in the V2Poller between its reads
_PARKED_STATES = frozenset({ClientState.INIT, ClientState.SUBSCRIBED})
# commands executed in place (run_commands): none awaits
_HANDLERS = {
    b"SUB": ProtocolV2.SUB,
    b"RDY": ProtocolV2.RDY,
    b"FIN": ProtocolV2.FIN,
    b"REQ": ProtocolV2.REQ,
    b"TOUCH": ProtocolV2.TOUCH,
    b"CLS": ProtocolV2.CLS,
    b"NOP": ProtocolV2.NOP,
    b"MPUB": ProtocolV2.MPUB,
}
# commands that await (exec_awaiting): they write their own answer and may upgrade the stream
_AWAITING = {
    b"IDENTIFY": ProtocolV2.IDENTIFY,
    b"AUTH": ProtocolV2.AUTH,
}


class _AskAuthAgain(Exception):
    """An expired authorisation must be asked for again before this command (an await): raised before
    the command changed anything."""


class _NameFirst(Exception):
    """A SUB whose topic or channel is not named on disk yet (nsqd.dat): it goes to exec_awaiting, which
    awaits the metadata write, then subscribes."""


def _parse_signed(value: bytes) -> int:
    # REQ/DPUB timeouts: nsqd's ByteToBase10 takes digits only; a leading '-' is refused the same way
    return parse_int(value)


def _quote(name: bytes) -> str:
    """Go's %q of a name, for error texts."""
    return json.dumps(name.decode(errors="replace"))
