"""RegistrationDB: which producers (brokers) have which topics and channels (nsqlookupd/registration_db.go).

Registrations are (category, key, subkey): ("client", "", ""), ("topic", topic, ""), ("channel", topic,
channel). Each holds producers by peer id (the broker connection's remote address).
"""

from __future__ import annotations

import time

import attrs

from trio_nsq.shared.protocol import topology_fields


@attrs.frozen
class Registration:
    category: str
    key: str
    subkey: str

    def is_match(self, category: str, key: str, subkey: str) -> bool:
        return (self.category == category and (key == "*" or self.key == key)
                and (subkey == "*" or self.subkey == subkey))


@attrs.define(eq=False)
class PeerInfo:
    """What an nsqd said about itself in IDENTIFY; shared by all of its Producers, so a PING refreshes
    every registration of the peer at once. `last_update` is time.monotonic()."""

    id: str
    remote_address: str = ""
    hostname: str = ""
    broadcast_address: str = ""
    tcp_port: int = 0
    http_port: int = 0
    version: str = ""
    topology_zone: str = ""
    topology_region: str = ""
    last_update: float = attrs.field(factory=time.monotonic)

    def public(self) -> dict:
        return {
            "remote_address": self.remote_address, "hostname": self.hostname,
            "broadcast_address": self.broadcast_address, "tcp_port": self.tcp_port,
            "http_port": self.http_port, "version": self.version,
            **topology_fields(self.topology_zone, self.topology_region),
        }


@attrs.define(eq=False)
class Producer:
    """One peer under one registration; a tombstone is per (topic, peer)."""

    peer: PeerInfo
    tombstoned: bool = False
    tombstoned_at: float = 0.0

    def tombstone(self) -> None:
        self.tombstoned = True
        self.tombstoned_at = time.monotonic()

    def is_tombstoned(self, lifetime: float) -> bool:
        return self.tombstoned and time.monotonic() - self.tombstoned_at < lifetime


def filter_active(producers: list[Producer], inactivity_timeout: float, tombstone_lifetime: float) -> list[Producer]:
    """Go's Producers.FilterByActive: drop producers not heard from within the timeout, and tombstoned ones
    whose tombstone is younger than its lifetime (a lifetime of 0 keeps every tombstoned producer)."""
    now = time.monotonic()
    return [p for p in producers
            if now - p.peer.last_update <= inactivity_timeout and not p.is_tombstoned(tombstone_lifetime)]


@attrs.define
class RegistrationDB:
    """Registration -> {peer id: Producer}. Only the Trio thread touches it, so it needs no lock.

    As in Go, removing a registration's last producer leaves the registration (a topic stays listed
    until deleted over HTTP), except that UNREGISTER drops an ephemeral one.
    """

    registrations: dict[Registration, dict[str, Producer]] = attrs.field(factory=dict)
    # counts every change of registrations, producers and tombstones: an HTTP answer kept from an
    # earlier generation is stale (lookupd/http_api.py's AnswerCache)
    generation: int = 0

    def add_registration(self, key: Registration) -> None:
        if key not in self.registrations:
            self.registrations[key] = {}
            self.generation += 1

    def add_producer(self, key: Registration, producer: Producer) -> bool:
        producers = self.registrations.setdefault(key, {})
        self.generation += 1  # the registration may be new even when the producer is not
        if producer.peer.id in producers:
            return False
        producers[producer.peer.id] = producer
        return True

    def remove_producer(self, key: Registration, peer_id: str) -> tuple[bool, int]:
        producers = self.registrations.get(key)
        if producers is None:
            return False, 0
        removed = producers.pop(peer_id, None) is not None
        self.generation += removed
        return removed, len(producers)

    def remove_registration(self, key: Registration) -> None:
        if self.registrations.pop(key, None) is not None:
            self.generation += 1

    def tombstone(self, producer: Producer) -> None:
        producer.tombstone()
        self.generation += 1

    def find_registrations(self, category: str, key: str, subkey: str) -> list[Registration]:
        if key != "*" and subkey != "*":
            k = Registration(category, key, subkey)
            return [k] if k in self.registrations else []
        return [k for k in self.registrations if k.is_match(category, key, subkey)]

    def find_producers(self, category: str, key: str, subkey: str) -> list[Producer]:
        seen: dict[str, Producer] = {}
        for k in self.find_registrations(category, key, subkey):
            for peer_id, producer in self.registrations[k].items():
                seen.setdefault(peer_id, producer)
        return list(seen.values())

    def lookup_registrations(self, peer_id: str) -> list[Registration]:
        return [k for k, producers in self.registrations.items() if peer_id in producers]


def filter_registrations(registrations: list[Registration], category: str, key: str, subkey: str) -> list[Registration]:
    """Go's Registrations.Filter."""
    return [r for r in registrations if r.is_match(category, key, subkey)]


def keys(registrations: list[Registration]) -> list[str]:
    """Go's Registrations.Keys (one per registration: duplicates are kept, as Go keeps them)."""
    return [r.key for r in registrations]


def subkeys(registrations: list[Registration]) -> list[str]:
    """Go's Registrations.SubKeys."""
    return [r.subkey for r in registrations]
