GO ?= go
BIN := bin/stopgate

.PHONY: build run test test-deps bench soak

build:
	$(GO) build -o $(BIN) ./cmd/proxy

# Serves the egress proxy and the control API on the embedded store in ./stopgate-data.
run: build
	./$(BIN) serve

test-deps:
	./scripts/test-deps

# Every test, against a real redis-server the tests start themselves, a real
# Chromium, and the real CDP clients test-deps installs (puppeteer-core,
# playwright-core).
test: test-deps
	$(GO) vet ./...
	$(GO) test -race -count=1 -timeout 20m ./...

# Benchmarks, side by side in one run: a POST direct and through stopgate on
# each store, and the guard alone on each store.
bench: test-deps
	$(GO) test -run '^$$' -bench 'BenchmarkPOST|BenchmarkGuard$$' -benchtime 3s -count 3 ./proxy ./state/filestore ./state/redisstore

# The cancel races, repeated: 200 rounds of concurrent POSTs racing a cancel
# through the proxy (embedded store, and two instances on Redis), and 100
# rounds of guards racing a cancel in each store.
soak: test-deps
	STOPGATE_RACE_ROUNDS=200 $(GO) test -count=1 -run 'Race' ./proxy
	STOPGATE_RACE_ROUNDS=100 $(GO) test -count=1 -run 'TestConformance/GuardRacing' ./state/filestore ./state/redisstore
