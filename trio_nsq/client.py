"""The Trio client's public name: `from trio_nsq.client import Producer, Consumer` (trio_nsq.shared.client)."""

from trio_nsq.shared.client import (
    Connection,
    Consumer,
    HTTPProducer,
    Message,
    NSQConnectionError,
    NSQError,
    Producer,
    tls_context,
)

__all__ = ["Connection", "Consumer", "HTTPProducer", "Message", "NSQConnectionError", "NSQError", "Producer", "tls_context"]
