"""The delivery-to-FIN histogram (broker/latency.py) in process: its percentiles against the exact ones,
its window, and a channel recording every FIN of a run (under MockClock: exact times, nothing timed)."""

from __future__ import annotations

import random

import trio
import trio.testing

from trio_nsq.broker.latency import BUCKETS, QUANTILES, TOP, LatencyHistogram, bucket_of, bucket_value_ns
from trio_nsq.broker.message import Message
from trio_nsq.broker.topic import Topic
from tests.topic_owner import Owner, kill


def exact(values: list[float], q: float) -> float:
    """nsqd's percentile of the sorted values (broker/quantile.py's result_from)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.5) - 1))]


def messages(latencies: list[float], now: float) -> list[Message]:
    out = []
    for i, latency in enumerate(latencies):
        msg = Message(b"%016d" % i, b"x")
        msg.delivery_ts = now - latency
        out.append(msg)
    return out


def test_percentiles_are_within_a_bucket_of_the_exact_ones():
    rng = random.Random(848)
    # a spread from microseconds to minutes: log-uniform, and a slow tail
    latencies = [10 ** rng.uniform(-5, 2) for _ in range(20_000)] + [300.0] * 30
    h = LatencyHistogram()
    h.record_many(messages(latencies, 1000.0), 1000.0)
    count, values = h.figures(1000.0)
    assert count == len(latencies)
    for q, value in zip(QUANTILES, values):
        want = exact(latencies, q) * 1e9
        assert abs(value - want) / want < 0.05, (q, value, want)  # a bucket is 2^(1/8) wide: ±4.5 %


def test_one_delivery_batch_is_one_bucket_and_every_message_counts():
    h = LatencyHistogram()
    batch = messages([0.25] * 500, 50.0)
    h.record_many(batch[:200], 50.0)
    h.record_many(batch[200:], 50.0)  # the cached bucket of the batch
    h.record_many(batch[:1], 60.0)  # the same batch ten seconds later: another bucket
    count, values = h.figures(60.0)
    assert count == 501
    assert values == [bucket_value_ns(bucket_of(0.25))] * 4  # 500 of 501 in the batch's bucket
    assert abs(values[0] - 0.25e9) / 0.25e9 < 0.05
    assert h.figures(60.0, (1.0,)) == (501, [bucket_value_ns(bucket_of(10.25))])


def test_buckets_cover_under_a_microsecond_to_hours():
    assert bucket_of(0.0) == bucket_of(-1.0) == bucket_of(0.9e-6) == 0
    assert bucket_of(1e-6) == 1
    assert bucket_of(86400.0 * 365) == TOP == BUCKETS - 1
    for seconds in (3e-6, 0.001, 0.5, 42.0, 3600.0):
        assert abs(bucket_value_ns(bucket_of(seconds)) - seconds * 1e9) / (seconds * 1e9) < 0.05


def test_the_window_drops_what_is_older_than_it():
    h = LatencyHistogram(window=600.0)
    h.record(1.0, 0.0)  # the first FIN starts the first half-window (300 s)
    h.record(1.0, 299.0)
    assert h.figures(299.0)[0] == 2
    h.record(2.0, 301.0)  # a new half-window: the first one is kept beside it
    assert h.figures(301.0)[0] == 3
    assert h.figures(599.0)[0] == 3
    count, values = h.figures(601.0)  # the first half-window is gone
    assert count == 1 and values[0] == bucket_value_ns(bucket_of(2.0))
    assert h.figures(1300.0) == (0, [0, 0, 0, 0])  # a whole window without FINs: nothing
    h.record(0.5, 1300.0)
    assert h.figures(1300.0)[0] == 1


async def test_a_channel_records_each_fin_of_a_run_from_delivery(tmp_path, mock_clock):
    topic = Topic(Owner(tmp_path, mock_clock, mem_queue_size=0), "t")  # type: ignore[arg-type]
    channel = topic.get_channel("c")
    topic.publish([b"m%d" % i for i in range(10)])
    msgs = channel.take(10)
    channel.start_in_flight_many(msgs[:6], 1, trio.current_time(), 60.0)
    mock_clock.jump(0.5)
    channel.start_in_flight_many(msgs[6:], 1, trio.current_time(), 60.0)
    mock_clock.jump(1.5)
    finished, error = channel.finish_messages(1, [m.id for m in msgs])
    assert (finished, error) == (10, None)
    # six of ten FIN'd 2 s after their delivery, four 1.5 s after theirs
    count, values = channel.fin_latency.figures(trio.current_time())
    assert count == 10 and values == [bucket_value_ns(bucket_of(2.0))] * 4
    count, (p10, p50) = channel.fin_latency.figures(trio.current_time(), (0.1, 0.5))
    assert abs(p10 - 1.5e9) / 1.5e9 < 0.05 and abs(p50 - 2.0e9) / 2.0e9 < 0.05
    # a FIN that does not apply records nothing
    finished, error = channel.finish_messages(1, [msgs[0].id])
    assert finished == 0 and error is not None
    assert channel.fin_latency.figures(trio.current_time())[0] == 10
    kill(topic)
