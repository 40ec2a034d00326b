"""NSQ's utilities on the Trio client, one module per app as nsqio/nsq's apps/: nsq_tail, nsq_stat,
to_nsq, nsq_to_file, nsq_to_nsq, nsq_to_http. Installed as console scripts with Go's names and flags."""
