# millrace: `make run` starts the whole system on embedded defaults,
# `make test` runs every test (installing what they need when it is missing).
GO      ?= go
BIN     := bin/millrace
VERSION := $(shell git describe --always --dirty 2>/dev/null || echo devel)

.PHONY: all build run test test-short bench bench-ab proto proto-check lint deps clean

all: build

build:
	$(GO) build -ldflags "-X main.version=$(VERSION)" -o $(BIN) ./cmd/millrace

run: build
	bash scripts/deps.sh run
	./$(BIN) dev

# Unit, integration, fault and end-to-end tests (real PostgreSQL, embedded
# JetStream, real Bazel), with the race detector.
test:
	bash scripts/deps.sh test
	bash scripts/test.sh

# Loads and benchmarks; writes JSON reports under loadtest/results/.
bench: build
	bash scripts/deps.sh run
	$(GO) run ./loadtest/cmd/bench -out loadtest/results

# The same scenarios against REV's binary (A) and the working tree's, or
# REV_B's (B), run alternately in one bench; ab-*.json under loadtest/results/.
# BENCH_FLAGS are the bench's: e.g. '-scenarios edge-embedded -rounds 5'.
bench-ab:
	@test -n "$(REV)" || { echo "usage: make bench-ab REV=<revision> [REV_B=<revision>] [BENCH_FLAGS='-scenarios ...']" >&2; exit 2; }
	bash scripts/deps.sh run
	bash scripts/bench-ab.sh $(REV) $(REV_B) -- -out loadtest/results $(BENCH_FLAGS)

proto:
	bash scripts/deps.sh proto
	bash schemas/gen.sh

# Regenerating the committed code must leave git clean.
proto-check: proto
	git diff --exit-code -- schemas/

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go' | grep -v '\.pb\.go$$')); if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
	$(GO) vet ./... ./schemas/...

clean:
	rm -rf bin
