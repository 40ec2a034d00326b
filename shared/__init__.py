"""What nsqd and nsqlookupd both use: the sans-IO protocol, names, options, logs, HTTP and TCP serving,
and the client, connector and embedding built on them. Installed as trio_nsq.shared; the public API is
imported from trio_nsq itself (see trio_nsq/__init__.py)."""
