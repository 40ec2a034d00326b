"""The storage of trio-nsqd: a topic's log (go-diskqueue's files) read by position, a cursor per channel,
the deadlines of deferred records, and the sync group that alone fsyncs them. It imports nothing of the
broker above it (tests/test_layout.py): what it knows of a message is the record's bytes."""
