"""Versions: the NSQ release whose wire, HTTP and disk contracts we implement, and our own."""

# Reported as "version" in IDENTIFY, /info and lookupd registrations: tools compare it to NSQ releases.
VERSION = "1.3.0"
PACKAGE_VERSION = "0.1.0"
USER_AGENT = f"trio-nsq/{PACKAGE_VERSION}"


def version_line(daemon: str) -> str:
    """`nsqd v1.3.0 (built w/python3.11.7)`: nsqd's --version and first log line, which harnesses match
    with a regex (one token after `w/`, as Go's `go1.19.8`)."""
    import platform

    return f"{daemon} v{VERSION} (built w/python{platform.python_version()})"
