"""/stats' text report (broker/stats_text.py) without a broker: nsqd's channel line as it was, then what
trio-nsqd adds after it (delivery-to-FIN percentiles, the oldest unfinished message's age) when there is
something to say."""

from __future__ import annotations

from trio_nsq.broker.stats import ChannelStats, E2eLatency, NsqdStats, Percentile, TopicStats
from trio_nsq.broker.stats_text import stats_text

FIN = E2eLatency(4, (Percentile(0.5, 1_500_000.0), Percentile(0.9, 2_000_000.0), Percentile(0.99, 3.5e9),
                     Percentile(0.999, 4e9)))


def channel_line(channel: ChannelStats) -> str:
    topic = TopicStats("t", (channel,), 0, 0, 0, 0, False, E2eLatency(), 0)
    [line] = [x for x in stats_text(NsqdStats("OK", 1, (topic,), None, None)).splitlines() if "[ch " in x]
    return line


def test_the_channel_line_ends_with_fin_percentiles_and_the_oldest_age():
    line = channel_line(ChannelStats("ch", 1, 0, 2, 0, 3, 0, 0, 0, None, False, E2eLatency(), 3, 61_500, FIN))
    assert line.startswith("      [ch                       ] depth: 1     be-depth: 0     inflt: 2    def: 0    "
                           "re-q: 0     timeout: 0     msgs: 3        e2e%: ")
    assert line.endswith("e2e%:  fin%: 1.5ms, 2.0ms, 3.5s, 4.0s oldest: 61.5s")


def test_nothing_is_added_while_there_is_nothing_to_say():
    idle = E2eLatency(0, tuple(Percentile(q, 0.0) for q in (0.5, 0.9, 0.99, 0.999)))
    line = channel_line(ChannelStats("ch", 0, 0, 0, 0, 0, 0, 0, 0, None, False, E2eLatency(), 0, 0, idle))
    assert line.endswith("msgs: 0        e2e%: ")
