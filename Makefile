# rowrelay — two commands on a fresh machine:  make run  |  make test
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
UV_VERSION := 0.13.9
ROWRELAY_HOME ?= $(HOME)/.cache/rowrelay
export ROWRELAY_HOME
STACK_ENV := $(ROWRELAY_HOME)/stack.env
# uv through the interpreter that installed it: works whether pip put it in ~/.local/bin, a pyenv or a venv.
UV := python3 -m uv
PY := .venv/bin/python
# Load the stack's connection settings (written by `python -m stack up`) into a recipe's environment.
WITH_ENV := set -a; source $(STACK_ENV); set +a;

.PHONY: help install stack stack-down stack-status run test test-unit test-faults test-bench test-cluster lint bench clean explore shape

help:
	@echo "make run    - install, start the local stack, create demo tables + writer, serve the Dagster UI on :3000"
	@echo "make test   - install, start the local stack, run the test suite (make test-faults: fault scenarios)"
	@echo "make stack | stack-down | stack-status | lint | bench"

# The lock file pins every package; `uv sync --frozen` reproduces it exactly. --compile-bytecode writes the .pyc
# files at install: where PYTHONDONTWRITEBYTECODE is set (this machine), every process would otherwise compile
# Dagster, pandas and PySpark from source at import (~2 s of CPU per process: CLI, daemon, code server, run).
.venv/.synced: pyproject.toml uv.lock
	$(UV) --version >/dev/null 2>&1 || python3 -m pip install --quiet "uv==$(UV_VERSION)"
	$(UV) sync --frozen --compile-bytecode
	touch $@

# The publisher's per-row loop in C (resources/arrow_produce.py). Without a C compiler rowrelay still works: it
# produces every row through confluent-kafka (slower) and says so in its log.
NATIVE := resources/native/produce_rows.so
$(NATIVE): resources/native/produce_rows.c
	cc -O2 -Wall -Werror -shared -fPIC -o $@ $< || { rm -f $@; echo "rowrelay: no C compiler: rows are produced through confluent-kafka"; }

install: .venv/.synced $(NATIVE)

stack: install
	$(PY) -m stack up

stack-down:
	$(PY) -m stack down

stack-status:
	$(PY) -m stack status

run: stack
	$(WITH_ENV) $(PY) -m stack.demo setup
	$(WITH_ENV) ./stack/run-demo.sh

# Three pytest workers on the two cores, a test file per worker at a time (loadfile): most of a test's time is
# spent waiting on the stack (Spark, Kafka, the daemon), and every test has its own databases, topics and Dagster
# instance. Time bounds left in tests are there to catch hangs, far from what a loaded host takes; two workers
# took 13m41s on this session's host, three 11m01s.
test: stack lint
	$(WITH_ENV) $(PY) -m pytest -q -n 3 --dist loadfile --durations=25 tests -m "not faults and not bench and not cluster"

test-unit: install
	$(PY) -m pytest -q tests -m "not integration and not faults and not bench and not cluster"

# Fault scenarios against the Dagster daemon (broker/database restarts, SIGKILL loop, zombie publisher).
test-faults: stack
	$(WITH_ENV) $(PY) -m pytest -q -s tests -m faults

# A replicated Kafka cluster (three KRaft nodes, production settings) with its nodes SIGKILLed, frozen, two of three
# down, restarted one by one during a backfill, and its coordinator frozen mid-commit while slices publish
# (tests/test_kafka_cluster.py, about fifteen minutes; not in the CI run's budget).
test-cluster: stack
	$(WITH_ENV) $(PY) -m pytest -q -s tests -m cluster

# The randomized schedule explorer (tests/explorer): SEED= replays a schedule (default: a fresh seed, printed
# first), MINUTES= how long it explores, BROKER_FAULTS=1 also stops its broker mid-run (a private broker of its own),
# SPARK_FAULTS=1 its Spark Connect server (a private one), DAEMON_FAULTS=1 its Dagster daemon (the world's own).
SEED ?=
MINUTES ?= 10
BROKER_FAULTS ?=
SPARK_FAULTS ?=
DAEMON_FAULTS ?=
explore: stack
	$(WITH_ENV) $(PY) -m tests.explorer --minutes $(MINUTES) $(if $(SEED),--seed $(SEED)) $(if $(BROKER_FAULTS),--broker-faults) \
		$(if $(SPARK_FAULTS),--spark-faults) $(if $(DAEMON_FAULTS),--daemon-faults)

# The benchmark peers' own tests (Debezium's JVM runs, ~1 min): not part of `make test`.
test-bench: stack
	$(WITH_ENV) $(PY) -m pytest -q tests -m bench

# Checks that need no service: style, the direction of imports (.importlinter), the documents' links, anchors
# and README size (tests/test_docs.py), and the code's shape: module and function sizes, import circles, hidden
# imports, changelog comments (tests/test_shape.py over bench/shape.py).
lint: install
	$(PY) -m ruff check .
	.venv/bin/lint-imports --no-cache
	$(PY) -m pytest -q tests/test_docs.py tests/test_shape.py

# The code's shape: lines per module, the longest functions, import circles (bench/shape.py; limits in
# tests/test_shape.py, part of `make lint`).
shape: install
	$(PY) -m bench.shape

# Not part of `make test`. BENCH_ARGS="--rows 200000 --rss-rows 0 ..." for a quicker run (see bench/run.py).
BENCH_ARGS ?=
bench: stack
	$(WITH_ENV) $(PY) -m bench.run $(BENCH_ARGS)

clean:
	rm -rf .venv .pytest_cache .ruff_cache .dagster_home
