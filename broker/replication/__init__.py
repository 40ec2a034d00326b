"""Replication of a topic's log across brokers (issue 52): the pure rules in core.py, the broker's side around them."""
