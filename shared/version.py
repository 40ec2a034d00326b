"""Versions: the NSQ release whose wire, HTTP and disk contracts we implement, and our own."""

# Reported as "version" in IDENTIFY, /info and lookupd registrations: tools compare it to NSQ releases.
VERSION = "1.3.0"
PACKAGE_VERSION = "0.1.0"
USER_AGENT = f"trio-nsq/{PACKAGE_VERSION}"
