"""A Trio client for NSQ, built on the sans-IO trio_nsq.shared.protocol.

- Producer: publish over TCP (pipelined, reconnecting); HTTPProducer: publish over HTTP in batches.
- Consumer: subscribe on brokers given directly or found through nsqlookupd, with NSQ's RDY and
  backoff rules (go-nsq's; ExponentialBackoff or FullJitterBackoff); handlers get Message objects.
- Connection: one V2 connection, for anything the others do not cover.

Logs go to the "trio_nsq.client" logger.
"""

from trio_nsq.client.backoff import ExponentialBackoff, FullJitterBackoff
from trio_nsq.client.connection import Connection, NSQConnectionError, NSQError, tls_context
from trio_nsq.client.consumer import Consumer, Message
from trio_nsq.client.http_producer import HTTPProducer
from trio_nsq.client.producer import Producer

__all__ = ["Connection", "Consumer", "ExponentialBackoff", "FullJitterBackoff", "HTTPProducer", "Message",
           "NSQConnectionError", "NSQError", "Producer", "tls_context"]
