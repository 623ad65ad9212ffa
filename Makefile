GO ?= go
BIN := bin/stopgate

.PHONY: build run test test-deps bench bench-micro soak fuzz load evidence

build:
	$(GO) build -o $(BIN) ./cmd/proxy

# Serves the egress proxy and the control API on the embedded store in ./stopgate-data.
run: build
	./$(BIN) serve

test-deps:
	./scripts/test-deps

# Every test, against a real redis-server the tests start themselves, a real
# Chromium, and the real CDP clients test-deps installs (puppeteer-core,
# playwright-core). deploy/ is a Go module of its own (its tests decode the
# Kubernetes manifests into the API's types, which stopgate does not run on).
# The fault suite (internal/evidence, 2 rounds of each failure here) runs
# alone after the others: it starts many processes, and other packages'
# tests with tight store timeouts should not share the machine with it.
test: test-deps
	$(GO) vet ./...
	cd deploy && $(GO) vet ./...
	$(GO) test -race -count=1 -timeout 20m $$($(GO) list ./... | grep -v /internal/evidence)
	cd deploy && $(GO) test -race -count=1 -timeout 10m ./...
	$(GO) test -race -count=1 -timeout 10m ./internal/evidence

# The performance instrument (docs/bench.md): the built stopgate against direct,
# plain goproxy and the peers (stripe/smokescreen, Squid: scripts/bench-deps),
# on each store, side by side in one run, each proxy its own process; Markdown
# tables on stdout. Takes minutes; CI does not run it.
# Flags through BENCH_FLAGS, e.g. BENCH_FLAGS="-skip stored -repeats 5".
# BENCH_BEFORE=<git rev> also builds that revision's stopgate (in a git
# worktree under bin/, removed afterwards) into bin/stopgate-before and
# measures it beside this one in the main table, with a before-and-after table.
BENCH_BEFORE ?=
BENCH_BEFORE_SRC := bin/.stopgate-before-src
bench: test-deps
	GO=$(GO) ./scripts/bench-deps
	$(GO) build -o $(BIN) ./cmd/proxy
ifneq ($(BENCH_BEFORE),)
	@rev=$$(git rev-parse --verify --quiet "$(BENCH_BEFORE)^{commit}") || { echo "BENCH_BEFORE=$(BENCH_BEFORE): not a commit"; exit 1; }; \
	git worktree remove --force $(BENCH_BEFORE_SRC) 2>/dev/null; rm -rf $(BENCH_BEFORE_SRC); \
	git worktree add --force --detach --quiet $(BENCH_BEFORE_SRC) $$rev || exit 1; \
	(cd $(BENCH_BEFORE_SRC) && $(GO) build -o $(CURDIR)/bin/stopgate-before ./cmd/proxy); rc=$$?; \
	git worktree remove --force $(BENCH_BEFORE_SRC); exit $$rc
endif
	$(GO) build -o bin/plain-goproxy ./internal/bench/cmd/plain-goproxy
	$(GO) build -o bin/stopgate-bench ./internal/bench/cmd/stopgate-bench
	./bin/stopgate-bench -stopgate $(BIN) -baseline bin/plain-goproxy -smokescreen bin/smokescreen -squid bin/squid \
		-commit "$$(git rev-parse --short HEAD)$$(git diff --quiet HEAD -- || echo +uncommitted)" \
		-cache-key "$$( ($(GO) version; find state intents internal/bench/preload.go go.mod go.sum -type f | sort | xargs sha256sum) | sha256sum | cut -c1-16)" \
		$(if $(BENCH_BEFORE),-before bin/stopgate-before -before-label "$$(git rev-parse --short "$(BENCH_BEFORE)^{commit}")") \
		$(BENCH_FLAGS)

# Go micro-benchmarks: a POST direct and through the in-process proxy on each
# store, and the guard alone on each store.
bench-micro: test-deps
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
FUZZ_TARGETS := ./proxy:FuzzIdentify ./proxy:FuzzSpool ./proxy:FuzzDestinationCheck ./policy:FuzzPolicyParse ./control:FuzzDecode ./browserguard:FuzzParseCommand
fuzz:
	@for t in $(FUZZ_TARGETS); do pkg=$${t%%:*}; name=$${t##*:}; \
		echo "== $$name in $$pkg for $(FUZZTIME)"; \
		$(GO) test -run '^$$' -fuzz "^$$name\$$" -fuzztime $(FUZZTIME) -fuzzminimizetime 10s $$pkg || exit 1; \
	done

# What a stopgate process holds (memory, descriptors) under 2 000 idle
# CONNECTs and 2 000 trickling request bodies, with the default caps and
# with caps raised past the load (STOPGATE_LOAD_CONNS sets the count), and
# under 100 intercepted tunnels each sending an 8 MB header line.
load:
	STOPGATE_LOAD=1 $(GO) test -count=1 -run "^TestLoad" -v -timeout 20m ./cmd/proxy

# The evidence, large: every injected failure repeated EVIDENCE_RUNS times
# against real stopgate binaries, redis-server and upstreams, printed as one
# table (make test runs 2 rounds of each); the linearizability check of both
# stores over LIN_SEEDS histories, and the planted read-then-write guard it
# must catch; the conformance suite on a three-master Redis Cluster and the
# failover tests. Each part's output is kept in bin/evidence-*.txt.
EVIDENCE_RUNS ?= 20
LIN_SEEDS ?= 200
evidence: test-deps
	@mkdir -p bin
	@rc=0; \
	STOPGATE_EVIDENCE_RUNS=$(EVIDENCE_RUNS) STOPGATE_EVIDENCE_TABLE=$(CURDIR)/bin/evidence-table.txt \
		$(GO) test -count=1 -timeout 60m -run '^TestEvidence$$' ./internal/evidence > bin/evidence-faults.txt 2>&1 || rc=1; \
	STOPGATE_LIN_SEEDS=$(LIN_SEEDS) $(GO) test -count=1 -v -timeout 30m -run '^(TestLinearizable|TestReadThenWriteGuardIsCaught)$$' \
		./state/lincheck ./state/filestore ./state/redisstore > bin/evidence-lincheck.txt 2>&1 || rc=1; \
	$(GO) test -count=1 -v -timeout 10m -run '^(TestClusterOfThreeMasters|TestCancelReplicas.*|TestFailoverWithoutCancelReplicas.*)$$' \
		./state/redisstore > bin/evidence-cluster.txt 2>&1 || rc=1; \
	echo "== injected failures ($(EVIDENCE_RUNS) rounds each) =="; \
	cat bin/evidence-table.txt 2>/dev/null || tail -40 bin/evidence-faults.txt; \
	grep -E '^\s+evidence_test.go:[0-9]+: round' bin/evidence-faults.txt || true; \
	echo; echo "== linearizability (porcupine, $(LIN_SEEDS) histories per store) =="; \
	grep -hoE 'lincheck: .*' bin/evidence-lincheck.txt || tail -20 bin/evidence-lincheck.txt; \
	echo; echo "== Redis Cluster (three masters) and failover =="; \
	grep -hE '^(---|    ---) |replicas_test.go:[0-9]+: ' bin/evidence-cluster.txt | sed 's/^ *//' || tail -20 bin/evidence-cluster.txt; \
	exit $$rc
