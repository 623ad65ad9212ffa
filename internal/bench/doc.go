// Package bench is the performance instrument behind make bench: it starts
// the built stopgate binary (and, to compare a change, an earlier build of
// it beside it in the main table), a plain goproxy baseline, the peers
// (stripe/smokescreen, Squid: peers.go) and redis-server as separate
// processes on loopback, drives them with a closed-loop load
// generator, reads their CPU time from /proc, and prints Markdown tables —
// the per-request cost side by side, cancel-to-cut latency across
// instances, Redis memory per run and per intent, and the cost with many
// runs already stored. docs/bench.md says what each figure means.
//
// It treats stopgate as a black box (its binary, its proxy listener, its
// control API), except to bulk-load stores through the store code
// (preload.go). It never asserts a speed: it measures and prints.
package bench
