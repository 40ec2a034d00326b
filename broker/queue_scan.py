"""queue_scan_loop: nsqd's sampling sweep of in-flight and deferred queues (nsqd.go queueScanLoop).

Every queue_scan_interval it samples queue_scan_selection_count channels, hands them to a pool of
workers, and samples again at once while more than queue_scan_dirty_percent of them had work. The pool
is sized to a quarter of the channels (1..queue_scan_worker_pool_max) every refresh interval. Workers are
tasks; the pool shrinks by cancelling one worker's scope. The channel list is also refreshed early when
channels come or go, so a new channel's timeouts are not left unswept for a whole refresh interval.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from trio_nsq.broker.channel import Channel
    from trio_nsq.broker.nsqd import NSQD


async def queue_scan_worker(
    work: trio.MemoryReceiveChannel[Channel],
    responses: trio.MemorySendChannel[bool],
    *,
    task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED,
) -> None:
    with trio.CancelScope() as scope:
        task_status.started(scope)
        async for channel in work:
            now = trio.current_time()
            dirty = channel.process_in_flight_queue(now)
            dirty = channel.process_deferred_queue(now) or dirty
            await responses.send(dirty)


async def queue_scan_loop(nsqd: NSQD) -> None:
    opts = nsqd.options
    work_send, work_recv = trio.open_memory_channel(opts.queue_scan_selection_count)
    resp_send, resp_recv = trio.open_memory_channel(opts.queue_scan_selection_count)
    workers: list[trio.CancelScope] = []

    async with trio.open_nursery() as nursery:

        async def resize_pool(num_channels: int) -> None:
            ideal = int(num_channels * 0.25)
            ideal = max(1, min(ideal, opts.queue_scan_worker_pool_max))
            while len(workers) > ideal:
                workers.pop().cancel()
            while len(workers) < ideal:
                workers.append(await nursery.start(queue_scan_worker, work_recv, resp_send))

        # the channel list, taken again at each refresh and when channels came or went (not at every
        # scan: ten thousand channels copied ten times a second were the idle broker's CPU)
        live = [ch for ch in nsqd.all_channels() if not ch.exiting]
        generation = nsqd.channels_generation
        await resize_pool(len(live))
        next_refresh = trio.current_time() + opts.queue_scan_refresh_interval
        next_scan = trio.current_time() + opts.queue_scan_interval

        while True:
            await trio.sleep_until(next_scan)
            now = trio.current_time()
            next_scan = now + opts.queue_scan_interval
            if now >= next_refresh or generation != nsqd.channels_generation:
                live = [ch for ch in nsqd.all_channels() if not ch.exiting]
                generation = nsqd.channels_generation
                await resize_pool(len(live))
                if now >= next_refresh:
                    next_refresh = now + opts.queue_scan_refresh_interval
            while live:
                num = min(opts.queue_scan_selection_count, len(live))
                sample = random.sample(live, num)
                if any(channel.exiting for channel in sample):
                    live = [ch for ch in live if not ch.exiting]  # gone since the list was taken
                    continue
                for channel in sample:
                    await work_send.send(channel)
                dirty = 0
                for _ in range(num):
                    if await resp_recv.receive():
                        dirty += 1
                if dirty / num <= opts.queue_scan_dirty_percent:
                    break
