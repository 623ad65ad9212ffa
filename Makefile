GO ?= go
BIN := bin/stopgate

.PHONY: build run test test-deps bench soak fuzz load

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

# The fuzz targets, one after the other, each for FUZZTIME (make test runs
# their seeds only). A finding stops the run and is kept under the package's
# testdata/fuzz as a regression seed.
FUZZTIME ?= 2m
FUZZ_TARGETS := ./proxy:FuzzIdentify ./proxy:FuzzSpool ./proxy:FuzzDestinationCheck ./policy:FuzzPolicyParse
fuzz:
	@for t in $(FUZZ_TARGETS); do pkg=$${t%%:*}; name=$${t##*:}; \
		echo "== $$name in $$pkg for $(FUZZTIME)"; \
		$(GO) test -run '^$$' -fuzz "^$$name\$$" -fuzztime $(FUZZTIME) -fuzzminimizetime 10s $$pkg || exit 1; \
	done

# What a stopgate process holds (memory, descriptors) under 2 000 idle
# CONNECTs and 2 000 trickling request bodies, with the default caps and
# with caps raised past the load (STOPGATE_LOAD_CONNS sets the count).
load:
	STOPGATE_LOAD=1 $(GO) test -count=1 -run TestLoadHeldConnections -v -timeout 20m ./cmd/proxy
