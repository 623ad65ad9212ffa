GO ?= go
BIN := bin/stopgate

.PHONY: build run test test-deps vet bench

build:
	$(GO) build -o $(BIN) ./cmd/proxy

# Serves the egress proxy and the control API on the embedded store in ./stopgate-data.
run: build
	./$(BIN) serve

test-deps:
	./scripts/test-deps

# Every test, against a real redis-server the tests start themselves.
test: test-deps
	$(GO) vet ./...
	$(GO) test -race -count=1 -timeout 20m ./...

bench: build
	$(GO) test -run '^$$' -bench . -benchtime 2s ./...
