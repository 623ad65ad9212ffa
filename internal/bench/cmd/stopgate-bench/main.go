// Command stopgate-bench is the performance instrument (make bench): it
// starts the built stopgate binary, a plain goproxy baseline, the peers
// (stripe/smokescreen, Squid), redis-server and a loopback upstream as
// separate processes, drives them with a closed-loop load generator, and
// prints the tables in Markdown on standard output (progress goes to
// standard error).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/stopgate/stopgate/internal/bench"
)

func main() {
	cfg, err := parseFlags(os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, "stopgate-bench:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := bench.Run(ctx, cfg); err != nil {
		fmt.Fprintln(os.Stderr, "stopgate-bench:", err)
		os.Exit(1)
	}
}

func parseFlags(args []string) (bench.Config, error) {
	cfg := bench.Config{Out: os.Stdout, Log: os.Stderr}
	fs := flag.NewFlagSet("stopgate-bench", flag.ContinueOnError)
	fs.StringVar(&cfg.Stopgate, "stopgate", "bin/stopgate", "the built stopgate binary (go build ./cmd/proxy)")
	fs.StringVar(&cfg.Baseline, "baseline", "bin/plain-goproxy", "the built plain-goproxy binary (go build ./internal/bench/cmd/plain-goproxy)")
	fs.StringVar(&cfg.Before, "before", "", "a second stopgate binary, built from an earlier commit, measured beside -stopgate on each store in the main table, with a before-and-after table (make bench BENCH_BEFORE=<rev> builds it)")
	fs.StringVar(&cfg.BeforeLabel, "before-label", "before", "names the -before binary in the tables, e.g. its commit")
	fs.StringVar(&cfg.Smokescreen, "smokescreen", "bin/smokescreen", "the stripe/smokescreen binary measured beside stopgate (scripts/bench-deps builds it); missing: not measured, with the reason in PATH.why")
	fs.StringVar(&cfg.Squid, "squid", "bin/squid", "the Squid binary measured beside stopgate (scripts/bench-deps installs it); missing: not measured, with the reason in PATH.why")
	fs.StringVar(&cfg.WorkDir, "workdir", "", "directory for stores, data directories and logs (default: a temporary directory, removed at the end)")
	fs.BoolVar(&cfg.Keep, "keep", false, "keep the temporary work directory (logs, stores)")
	fs.StringVar(&cfg.ScratchDir, "scratch", "", "tmpfs directory for bulk loads of the embedded store (default /dev/shm)")
	defaultCache := ""
	if d, err := os.UserCacheDir(); err == nil {
		defaultCache = filepath.Join(d, "stopgate-bench")
	}
	fs.StringVar(&cfg.CacheDir, "cache", defaultCache, "directory keeping bulk-loaded stores for the next run of this same bench binary")
	fs.StringVar(&cfg.CacheKey, "cache-key", "", "names the store code the cached stores were loaded by (default: this binary's hash)")
	noCache := fs.Bool("no-cache", false, "load the stored-volume stores again, ignoring and not filling the cache")
	fs.IntVar(&cfg.Repeats, "repeats", 3, "repeats of every measurement")
	fs.DurationVar(&cfg.Warmup, "warmup", 500*time.Millisecond, "warm-up before each measured window")
	fs.DurationVar(&cfg.Window, "window", 2*time.Second, "measured window of each measurement")
	conns := fs.String("conns", "1,64", "connection counts of the main table, comma-separated")
	fs.BoolVar(&cfg.Post, "post", false, "add a small POST at the largest connection count")
	fs.BoolVar(&cfg.RunPerConn, "run-per-conn", true, "add an HTTP GET at the largest connection count with each connection its own run (-run-per-conn=false leaves it out)")
	fs.IntVar(&cfg.Cancels, "cancels", 100, "cancels the cut latency is measured over")
	fs.IntVar(&cfg.MemRuns, "mem-runs", 10000, "runs admitted to measure Redis memory per run")
	fs.IntVar(&cfg.MemIntents, "mem-intents", 10000, "requests sent to measure Redis memory per intent")
	fs.IntVar(&cfg.StoredSmall, "stored-small", 1000, "runs stored for the reference of the stored-volume table")
	fs.IntVar(&cfg.StoredLarge, "stored-large", 1000000, "runs stored in Redis for the stored-volume table")
	fs.IntVar(&cfg.StoredLargeEmbedded, "stored-large-embedded", 100000, "runs stored in the embedded store for the stored-volume table")
	fs.IntVar(&cfg.FatIntents, "fat-intents", 100000, "intents stored in one run for the stored-volume table")
	skip := fs.String("skip", "", "phases not to run, comma-separated: matrix, cancel, memory, stored")
	fs.StringVar(&cfg.Commit, "commit", "", "the commit under test, for the header")
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	if *noCache {
		cfg.CacheDir = ""
	}
	if fs.NArg() > 0 {
		return cfg, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	for _, s := range strings.Split(*conns, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 1 {
			return cfg, fmt.Errorf("-conns: %q is not a positive number", s)
		}
		cfg.Conns = append(cfg.Conns, n)
	}
	if *skip != "" {
		for _, s := range strings.Split(*skip, ",") {
			cfg.Skip = append(cfg.Skip, strings.TrimSpace(s))
		}
	}
	return cfg, nil
}
