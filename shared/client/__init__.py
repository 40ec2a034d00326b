"""A Trio client for NSQ: Producer, HTTPProducer and Consumer, built on the sans-IO shared.protocol."""

from shared.client.connection import Connection, Message, NSQError
from shared.client.consumer import Consumer
from shared.client.http_producer import HTTPProducer
from shared.client.producer import Producer

__all__ = ["Connection", "Consumer", "HTTPProducer", "Message", "NSQError", "Producer"]
