"""A broker and a lookupd inside your program and your tests: embed (run_nsqd, nsqd_in_thread, ...) and
the pytest plugin (its fixtures), above the daemons they run."""
