"""nsqd's options: flag names, TOML keys and defaults as Go nsqd has them (nsqd/options.go)."""

from __future__ import annotations

import hashlib
import socket
import zlib

import attrs

from trio_nsq.shared.options import load_options, option


def _default_node_id() -> int:
    # as nsqd: crc32(md5(hostname)) % 1024
    return zlib.crc32(hashlib.md5(socket.gethostname().encode()).digest()) % 1024


@attrs.define
class Options:
    node_id: int = option(_default_node_id(), "unique part for message IDs, (int) in range [0,1024)", flag="--node-id", cfg="id")
    log_level: str = option("info", "set log verbosity: debug, info, warn, error, or fatal", kind="log_level")
    log_prefix: str = option("[nsqd] ", "log message prefix")

    tcp_address: str = option("0.0.0.0:4150", "<addr>:<port> to listen on for TCP clients")
    http_address: str = option("0.0.0.0:4151", "<addr>:<port> to listen on for HTTP clients")
    broadcast_address: str = option(socket.gethostname(), "address that will be registered with lookupd")
    broadcast_tcp_port: int = option(0, "TCP port that will be registered with lookupd (default: listening port)")
    broadcast_http_port: int = option(0, "HTTP port that will be registered with lookupd (default: listening port)")
    nsqlookupd_tcp_addresses: list = option(
        [], "lookupd TCP address (may be given multiple times)", flag="--lookupd-tcp-address", repeat=True
    )

    data_path: str = option("", "path to store disk-backed messages (default: current directory)")
    mem_queue_size: int = option(10000, "number of messages to keep in memory (per topic/channel)")
    max_bytes_per_file: int = option(100 * 1024 * 1024, "number of bytes per diskqueue file before rolling")
    sync_every: int = option(2500, "number of messages per diskqueue fsync")
    sync_timeout: float = option(2.0, "duration of time per diskqueue fsync", kind="duration")
    # not in Go nsqd: a topic's log keeps what its channels finished for this long / up to this size, so
    # a channel can seek back (/channel/seek); 0 and 0: a segment goes once every channel is past it
    retention_time: float = option(0.0, "keep a topic's finished messages this long for /channel/seek (0: not at all)", kind="duration")
    retention_bytes: int = option(0, "keep up to this many bytes of a topic's log for /channel/seek (0: no size limit of its own)")
    # not in Go nsqd: a positional reader's cursor (POST /log/commit) keeps the log from its position; one
    # not committed this long (an abandoned query) stops keeping it. 7 days: Kafka's offsets.retention.minutes
    cursor_idle_timeout: float = option(7 * 86400.0, "a /log/commit cursor not committed this long stops keeping its topic's log (0: never)", kind="duration")
    # not in Go nsqd: the defaults of what POST /topic/config and /channel/config set per topic/channel
    max_depth: int = option(0, "most messages a channel (or a topic without channels) queues (0: no limit)")
    depth_policy: str = option("refuse", "what a publish past --max-depth gets: 'refuse' (E_PUB_FAILED, HTTP 503) or 'drop-oldest'")
    message_ttl: float = option(0.0, "a message older than this is not delivered (0: messages do not expire)", kind="duration")
    max_attempts: int = option(0, "deliveries after which a requeued or timed-out message goes to its channel's dead-letter topic (0: no limit)")

    queue_scan_interval: float = option(0.1, "how often the queue scan loop runs", kind="duration")
    queue_scan_refresh_interval: float = option(5.0, "how often the set of scanned channels is refreshed", kind="duration")
    queue_scan_selection_count: int = option(20, "number of channels sampled per queue scan")
    queue_scan_worker_pool_max: int = option(4, "max number of queue scan workers")
    queue_scan_dirty_percent: float = option(0.25, "fraction of dirty channels that makes a scan repeat at once")

    msg_timeout: float = option(60.0, "default duration to wait before auto-requeing a message", kind="duration")
    max_msg_timeout: float = option(900.0, "maximum duration before a message will timeout", kind="duration")
    max_msg_size: int = option(1024 * 1024, "maximum size of a single message in bytes")
    max_body_size: int = option(5 * 1024 * 1024, "maximum size of a single command body")
    max_req_timeout: float = option(3600.0, "maximum requeuing timeout for a message", kind="duration")
    # not in Go nsqd, which caps DPUB at --max-req-timeout: a deferred publish waits in its topic's log,
    # not in memory, so it may wait for days
    max_defer_time: float = option(
        0.0, "maximum delay of a deferred publish (DPUB, /pub?defer=) (0: --max-req-timeout)", kind="duration"
    )
    client_timeout: float = option(60.0, "default heartbeat interval basis for clients", kind="duration")

    max_heartbeat_interval: float = option(60.0, "maximum client configurable duration of time between client heartbeats", kind="duration")
    max_rdy_count: int = option(2500, "maximum RDY count for a client")
    max_output_buffer_size: int = option(64 * 1024, "maximum client configurable size (in bytes) for a client output buffer")
    max_output_buffer_timeout: float = option(30.0, "maximum client configurable duration of time between flushing to a client", kind="duration")
    min_output_buffer_timeout: float = option(0.025, "minimum client configurable duration of time between flushing to a client", kind="duration")
    output_buffer_timeout: float = option(0.25, "default duration of time between flushing data to clients", kind="duration")
    max_channel_consumers: int = option(0, "maximum channel consumer connection count per nsqd instance (0 = unlimited)")

    https_address: str = option("0.0.0.0:4152", "<addr>:<port> to listen on for HTTPS clients (served when --tls-cert/--tls-key are set)")
    tls_cert: str = option("", "path to certificate file")
    tls_key: str = option("", "path to key file")
    tls_root_ca_file: str = option("", "path to certificate authority file")
    tls_client_auth_policy: str = option("", "client certificate auth policy ('require' or 'require-verify')")
    tls_required: str = option("false", "require TLS for client connections (true, false, tcp-https)", kind="tls_required")
    tls_min_version: str = option("tls1.2", "minimum SSL/TLS version acceptable ('tls1.2' or 'tls1.3')")

    snappy: bool = option(True, "enable snappy feature negotiation (client compression)")
    deflate: bool = option(True, "enable deflate feature negotiation (client compression)")
    max_deflate_level: int = option(6, "max deflate compression level a client can negotiate (> values == > nsqd CPU usage)")

    auth_http_addresses: list = option(
        [], "<addr>:<port> or a full url to query auth server (may be given multiple times)",
        flag="--auth-http-address", repeat=True,
    )
    auth_http_request_method: str = option("get", "HTTP method to use for auth server requests (get or post)")
    http_client_connect_timeout: float = option(2.0, "timeout for HTTP connect", kind="duration")
    http_client_request_timeout: float = option(5.0, "timeout for HTTP request", kind="duration")

    statsd_address: str = option("", "UDP <addr>:<port> of a statsd daemon for pushing stats")
    statsd_prefix: str = option("nsq.%s", "prefix used for keys sent to statsd (%s for host replacement)")
    statsd_interval: float = option(60.0, "duration between pushing to statsd", kind="duration")
    statsd_mem_stats: bool = option(True, "toggle sending memory and GC stats to statsd")
    statsd_udp_packet_size: int = option(508, "the size in bytes of statsd UDP packets")
    e2e_processing_latency_percentiles: list = option(
        [], "message processing time percentiles (as float (0, 1.0]) to track (can be specified multiple times or comma separated '1.0,0.99,0.95')",
        flag="--e2e-processing-latency-percentile", repeat=True, kind="floats",
    )
    statsd_exclude_ephemeral: bool = option(False, "skip ephemeral topics and channels when sending stats to statsd")
    topology_region: str = option("", "the region this nsqd is in (reported in IDENTIFY)")
    topology_zone: str = option("", "the availability zone this nsqd is in (reported in IDENTIFY)")
    enable_experiment: list = option([], "experimental features to enable (accepted; none is implemented)", repeat=True)
    # Idempotency-Key on /pub and /mpub. 1,000,000 keys: a day of Spark retries at typical batch sizes
    # (a key per /mpub of ~1,000-10,000 rows covers 1-10 billion rows a day per topic); held in memory,
    # ~270 bytes a key of 60 characters (measured), so ~270 MB for a full table (a journal line each on disk).
    idempotency_window: float = option(
        86400.0, "how long a topic remembers an accepted Idempotency-Key of /pub and /mpub", kind="duration"
    )
    max_idempotency_keys: int = option(
        1_000_000, "most Idempotency-Keys a topic remembers (the oldest is forgotten first); "
        "the default holds a day of Spark write retries at typical batch sizes"
    )
    # not in Go nsqd: replication of topics' logs through etcd (cluster mode, on when endpoints are given)
    etcd_endpoints: list = option(
        [], "etcd endpoint URL, e.g. http://127.0.0.1:2379 (may be given multiple times or comma separated): "
        "turns cluster mode on (every non-ephemeral topic is replicated)", repeat=True,
    )
    etcd_prefix: str = option("/trio-nsq", "prefix of the keys this cluster keeps in etcd")
    etcd_lease_ttl: float = option(10.0, "TTL of this broker's etcd lease: a broker whose lease expires is dead to the others", kind="duration")
    replicas: int = option(1, "how many brokers hold each topic a broker creates in cluster mode")
    min_isr: int = option(1, "fewest in-sync replicas (the leader included) a publish needs to be answered OK")
    replica_lag_time: float = option(10.0, "a follower not caught up for this long leaves the in-sync replicas", kind="duration")
    replica_ack_timeout: float = option(5.0, "how long a publish waits for its in-sync replicas before E_PUB_FAILED", kind="duration")
    e2e_processing_latency_window_time: float = option(
        600.0, "calculate end to end latency quantiles for this duration of time", kind="duration"
    )

    @property
    def heartbeat_interval(self) -> float:
        # nsqd: HeartbeatInterval = ClientTimeout / 2
        return self.client_timeout / 2

    @property
    def max_defer(self) -> float:
        """The longest delay a deferred publish may ask for: --max-defer-time, or nsqd's cap
        (--max-req-timeout) when it is 0."""
        return self.max_defer_time or self.max_req_timeout


    @property
    def etcd_endpoint_list(self) -> list[str]:
        """--etcd-endpoints, repeated or comma separated."""
        return [url.strip() for value in self.etcd_endpoints for url in str(value).split(",") if url.strip()]

    def check(self) -> None:
        """What nsqd's New() refuses at start, with its messages; raises ValueError."""
        if not 1 <= self.max_deflate_level <= 9:
            raise ValueError("--max-deflate-level must be [1,9]")
        if not 0 <= self.node_id < 1024:
            raise ValueError("--node-id must be [0,1024)")
        if self.idempotency_window <= 0:
            raise ValueError("--idempotency-window must be > 0")
        if self.max_defer_time < 0:
            raise ValueError("--max-defer-time must be >= 0")
        if self.retention_time < 0:
            raise ValueError("--retention-time must be >= 0")
        if self.retention_bytes < 0:
            raise ValueError("--retention-bytes must be >= 0")
        if self.cursor_idle_timeout < 0:
            raise ValueError("--cursor-idle-timeout must be >= 0")
        if self.max_depth < 0:
            raise ValueError("--max-depth must be >= 0")
        if self.depth_policy not in ("refuse", "drop-oldest"):
            raise ValueError("--depth-policy must be 'refuse' or 'drop-oldest'")
        if self.message_ttl < 0:
            raise ValueError("--message-ttl must be >= 0")
        if not 0 <= self.max_attempts <= 0xFFFF:
            raise ValueError("--max-attempts must be [0,65535]")
        if self.max_idempotency_keys < 1:
            raise ValueError("--max-idempotency-keys must be >= 1")
        if self.replicas < 1:
            raise ValueError("--replicas must be >= 1")
        if self.min_isr < 1:
            raise ValueError("--min-isr must be >= 1")
        if self.etcd_endpoints:
            if self.etcd_lease_ttl < 1:
                raise ValueError("--etcd-lease-ttl must be >= 1s")
            if self.replica_lag_time <= 0:
                raise ValueError("--replica-lag-time must be > 0")
            if self.replica_ack_timeout <= 0:
                raise ValueError("--replica-ack-timeout must be > 0")
            for url in self.etcd_endpoint_list:
                if not url.startswith(("http://", "https://")):
                    raise ValueError(f"--etcd-endpoints: {url!r} is not an http:// or https:// URL")
        for value in self.e2e_processing_latency_percentiles:
            if not 0 < value <= 1:
                raise ValueError(f"invalid E2E processing latency percentile: {value:g}")


# flags nsqd 1.3.0 still accepts and ignores (booleans there too)
DEPRECATED = {"verbose": "has no effect, use --log-level", "worker-id": "use --node-id"}


def parse_command_line(argv: list[str] | None = None) -> tuple[Options, list[str]]:
    """The options and the deprecated flags given (for main to warn about once logging is set up)."""
    return load_options(Options, argv, "nsqd", DEPRECATED)


def parse_options(argv: list[str] | None = None) -> Options:
    return parse_command_line(argv)[0]
