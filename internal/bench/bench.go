package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/stopgate/stopgate/internal/redisserver"
)

// Config is one run of the instrument.
type Config struct {
	// Stopgate is the built stopgate binary (go build ./cmd/proxy).
	Stopgate string
	// Baseline is the built plain-goproxy binary.
	Baseline string
	// Before is a second stopgate binary, built from an earlier commit:
	// given, the main table measures it beside Stopgate on each store, in
	// the same repeats, and adds the before-and-after table. Empty
	// measures Stopgate alone.
	Before string
	// BeforeLabel names Before in the tables (its commit, say); empty or
	// "before" names it "stopgate before" alone.
	BeforeLabel string
	// Smokescreen and Squid are the peers' binaries (scripts/bench-deps
	// makes them); a peer whose binary is missing is printed as not
	// measured, with the reason in PATH.why if there is one.
	Smokescreen, Squid string
	// WorkDir holds the stores, data directories and logs; empty makes a
	// temporary one, removed at the end unless Keep.
	WorkDir string
	Keep    bool
	// ScratchDir is where stores are bulk-loaded before they are copied to
	// WorkDir (a tmpfs, so the load's fsyncs cost nothing); empty uses
	// /dev/shm when it exists, else WorkDir.
	ScratchDir string
	// CacheDir keeps bulk-loaded stores for the next run of the same bench
	// binary; empty loads every time.
	CacheDir string
	// CacheKey names the store code that loads the cache's stores; empty
	// uses this binary's hash.
	CacheKey string

	// Repeats of every measurement; medians are printed with the spread.
	Repeats int
	// Warmup before, and Window of, each measurement.
	Warmup, Window time.Duration
	// Conns are the connection counts of the main table.
	Conns []int
	// Post adds a small POST at the largest connection count.
	Post bool
	// RunPerConn adds an HTTP GET at the largest connection count in which
	// each connection is its own run, as a fleet with one agent per run
	// sends; the other rows put all connections on one run.
	RunPerConn bool

	// Cancels is how many cancels the cut latency is measured over.
	Cancels int
	// MemRuns and MemIntents are admitted (control API) and sent (proxy)
	// to measure Redis memory per run and per intent.
	MemRuns, MemIntents int
	// StoredSmall and StoredLarge runs are stored before the per-request
	// cost is measured again; StoredLargeEmbedded is the large count for
	// the embedded store. FatIntents are stored in one run.
	StoredSmall, StoredLarge, StoredLargeEmbedded, FatIntents int

	// Skip names phases not to run: matrix, cancel, memory, stored.
	Skip []string
	// Commit names the code under test in the header.
	Commit string

	// Out receives the tables; Log receives progress.
	Out, Log io.Writer
}

func (c *Config) skip(phase string) bool {
	for _, s := range c.Skip {
		if s == phase {
			return true
		}
	}
	return false
}

func (c *Config) logf(format string, args ...any) {
	fmt.Fprintf(c.Log, "%s  %s\n", time.Now().Format("15:04:05"), fmt.Sprintf(format, args...))
}

// beforeName is the before binary's name in the tables.
func (c *Config) beforeName() string {
	if c.BeforeLabel == "" || c.BeforeLabel == "before" {
		return "stopgate before"
	}
	return "stopgate before (" + c.BeforeLabel + ")"
}

func (c *Config) check() error {
	var errs []error
	bins := map[string]*string{"stopgate": &c.Stopgate, "plain-goproxy": &c.Baseline}
	if c.Before != "" {
		bins["before (-before)"] = &c.Before
	}
	for name, path := range bins {
		if st, err := os.Stat(*path); err != nil || st.IsDir() {
			errs = append(errs, fmt.Errorf("the %s binary %q: not a file (build it first: make bench does)", name, *path))
			continue
		}
		// The processes start in the work directory.
		abs, err := filepath.Abs(*path)
		if err != nil {
			errs = append(errs, err)
		}
		*path = abs
	}
	if c.Repeats < 1 || c.Window <= 0 || c.Warmup < 0 || len(c.Conns) == 0 {
		errs = append(errs, errors.New("repeats, window and connection counts must be positive"))
	}
	for _, n := range c.Conns {
		if n < 1 {
			errs = append(errs, fmt.Errorf("connection count %d", n))
		}
	}
	for _, s := range c.Skip {
		switch s {
		case "matrix", "cancel", "memory", "stored":
		default:
			errs = append(errs, fmt.Errorf("unknown phase %q to skip: want matrix, cancel, memory or stored", s))
		}
	}
	return errors.Join(errs...)
}

// env is what every phase shares: the upstream and the processes of the
// main table.
type env struct {
	cfg       *Config
	dir       string
	up        *upstream
	policy    string
	allowDest bool
	cache     *cache
	figures   figures
	notes     []string
}

// Run runs every phase and prints the tables.
func Run(ctx context.Context, cfg Config) (err error) {
	if err := cfg.check(); err != nil {
		return err
	}
	started := time.Now()
	loadBefore := loadAverage()
	dir := cfg.WorkDir
	if dir == "" {
		if dir, err = os.MkdirTemp("", "stopgate-bench-"); err != nil {
			return err
		}
		// Kept after a failure: the logs of the processes explain it.
		defer func() {
			if err == nil && !cfg.Keep {
				_ = os.RemoveAll(dir)
			} else {
				cfg.logf("work directory kept: %s", dir)
			}
		}()
	}
	if dir, err = filepath.Abs(dir); err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	cfg.logf("work directory %s", dir)
	up, err := startUpstream(dir)
	if err != nil {
		return err
	}
	defer up.close()
	e := &env{cfg: &cfg, dir: dir, up: up, allowDest: true, figures: figures{}}
	if e.cache, err = openCache(cfg.CacheDir, cfg.CacheKey); err != nil {
		return err
	}
	// The pass-through port is tunnelled unseen, for the cancel phase's tunnels.
	e.policy = filepath.Join(dir, "policy.yaml")
	if err := os.WriteFile(e.policy, []byte(fmt.Sprintf("pass_through:\n  - %q\n", strings.TrimPrefix(up.TunnelURL, "https://"))), 0o644); err != nil {
		return err
	}

	if cfg.Before != "" && cfg.skip("matrix") {
		e.note("The before binary %s was not measured: it is measured in the main table only, and -skip matrix left that out.", cfg.Before)
	}
	var tables []*table
	if !cfg.skip("matrix") || !cfg.skip("cancel") || !cfg.skip("memory") {
		ts, err := e.mainPhases(ctx)
		tables = append(tables, ts...)
		if err != nil {
			e.printAll(tables, started, loadBefore)
			return err
		}
	}
	if !cfg.skip("stored") {
		ts, err := e.storedPhase(ctx)
		tables = append(tables, ts...)
		if err != nil {
			e.printAll(tables, started, loadBefore)
			return err
		}
	}
	e.printAll(tables, started, loadBefore)
	return nil
}

func (e *env) note(format string, args ...any) {
	e.notes = append(e.notes, fmt.Sprintf(format, args...))
	e.cfg.logf(format, args...)
}

func (e *env) printAll(tables []*table, started time.Time, loadBefore string) {
	w := e.cfg.Out
	host, _ := os.Hostname()
	fmt.Fprintf(w, "## stopgate-bench — commit %s, %s\n\n", orUnknown(e.cfg.Commit), started.Format("2006-01-02 15:04 MST"))
	fmt.Fprintf(w, "Machine %s: %d CPUs (%s), %s/%s, %s. Load average before %s, after %s.\n",
		host, runtime.NumCPU(), cpuModel(), runtime.GOOS, runtime.GOARCH, runtime.Version(), loadBefore, loadAverage())
	if e.cfg.Before != "" {
		fmt.Fprintf(w, "Before and after: %s is %s, measured beside this commit's stopgate on each store in the main table.\n", e.cfg.beforeName(), e.cfg.Before)
	}
	fmt.Fprintf(w, "Each measurement: %s warm-up, then a %s window; %d repeats, median shown with (min–max).\n\n",
		e.cfg.Warmup, e.cfg.Window, e.cfg.Repeats)
	for _, t := range tables {
		t.print(w)
	}
	e.targetTable(slices.Max(e.cfg.Conns)).print(w)
	for _, n := range e.notes {
		fmt.Fprintln(w, "- "+n)
	}
	fmt.Fprintf(w, "\nTook %s.\n", time.Since(started).Round(time.Second))
}

func orUnknown(s string) string {
	if s == "" {
		return "(unknown)"
	}
	return s
}

func cpuModel() string {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return "?"
	}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return "?"
}

// startStopgate starts one stopgate serve, learning on the first start
// whether the binary knows --allow-dest (loopback upstreams need it once
// destinations are checked; before that the flag does not exist).
func (e *env) startStopgate(ctx context.Context, name, store, dataDir string) (*stopgate, error) {
	o := stopgateOpts{Name: name, Store: store, DataDir: dataDir, Config: e.policy, UpstreamCert: e.up.CertFile, AllowDest: e.allowDest}
	s, err := startStopgate(ctx, e.cfg.Stopgate, e.dir, o)
	if errors.Is(err, errNoAllowDest) {
		e.allowDest = false
		e.note("This stopgate has no --allow-dest flag: it was started without one, and reached the loopback upstream unchecked.")
		o.AllowDest = false
		s, err = startStopgate(ctx, e.cfg.Stopgate, e.dir, o)
	}
	return s, err
}

// startBefore starts one stopgate serve of the before binary with the
// flags the after binary was started with. Unlike startStopgate it never
// falls back to fewer flags: a before binary started otherwise than the
// after would be measured doing something else, so its own error ends the
// run.
func (e *env) startBefore(ctx context.Context, name, store, dataDir string) (*stopgate, error) {
	o := stopgateOpts{Name: name, Store: store, DataDir: dataDir, Config: e.policy, UpstreamCert: e.up.CertFile, AllowDest: e.allowDest}
	s, err := startStopgate(ctx, e.cfg.Before, e.dir, o)
	if err != nil {
		return nil, fmt.Errorf("the before binary %s (%s) does not serve as the instrument starts stopgate, with the flags the after binary took (docs/bench.md, Before and after): %w",
			e.cfg.Before, e.cfg.beforeName(), err)
	}
	return s, nil
}

// mainProcs are the processes of the main table, the cancel phase and the
// memory phase.
type mainProcs struct {
	everysec, always *redisProc
	base             *baseline
	peers            []*peerTarget
	embedded         *stopgate
	sgEverysec       *stopgate
	sgAlways         *stopgate
	// before is the before binary's cases (Config.Before), or nil.
	before *beforeProcs
}

// beforeProcs are the before binary's cases of the main table: each store
// on its own data directory and redis-server, as the after binary's are,
// so that neither reads the other's keys or Redis CPU.
type beforeProcs struct {
	everysec, always *redisProc
	embedded         *stopgate
	sgEverysec       *stopgate
	sgAlways         *stopgate
}

func (p *mainProcs) stop() {
	stopgates := []*stopgate{p.embedded, p.sgEverysec, p.sgAlways}
	redises := []*redisProc{p.everysec, p.always}
	if b := p.before; b != nil {
		stopgates = append(stopgates, b.embedded, b.sgEverysec, b.sgAlways)
		redises = append(redises, b.everysec, b.always)
	}
	for _, s := range stopgates {
		if s != nil {
			s.stop()
		}
	}
	if p.base != nil {
		p.base.stop()
	}
	for _, pt := range p.peers {
		if pt.proc != nil {
			pt.proc.stop()
		}
	}
	for _, r := range redises {
		if r != nil {
			r.stop()
		}
	}
}

// startBeforeProcs starts the before binary's three cases; p.before holds
// what started, for p.stop, even when one does not.
func (e *env) startBeforeProcs(ctx context.Context, p *mainProcs) error {
	b := &beforeProcs{}
	p.before = b
	e.cfg.logf("starting the before binary %s as %s: redis-server (AOF everysec, AOF always) and three stopgate serve of its own", e.cfg.Before, e.cfg.beforeName())
	var err error
	if b.everysec, err = startRedis("redis-before-everysec", filepath.Join(e.dir, "redis-before-everysec"), redisserver.Options{AppendFsyncEverySec: true}); err != nil {
		return err
	}
	if b.always, err = startRedis("redis-before-always", filepath.Join(e.dir, "redis-before-always"), redisserver.Options{AppendFsyncAlways: true}); err != nil {
		return err
	}
	if b.embedded, err = e.startBefore(ctx, "stopgate-before-embedded", "", filepath.Join(e.dir, "data-before-embedded")); err != nil {
		return err
	}
	if b.sgEverysec, err = e.startBefore(ctx, "stopgate-before-everysec", b.everysec.URL(), filepath.Join(e.dir, "data-before-everysec")); err != nil {
		return err
	}
	b.sgAlways, err = e.startBefore(ctx, "stopgate-before-always", b.always.URL(), filepath.Join(e.dir, "data-before-always"))
	return err
}

func (e *env) mainPhases(ctx context.Context) ([]*table, error) {
	p := &mainProcs{}
	defer p.stop()
	var err error
	e.cfg.logf("starting redis-server (AOF everysec, AOF always), plain goproxy, the peers, and three stopgate serve")
	if p.everysec, err = startRedis("redis-everysec", filepath.Join(e.dir, "redis-everysec"), redisserver.Options{AppendFsyncEverySec: true}); err != nil {
		return nil, err
	}
	if p.always, err = startRedis("redis-always", filepath.Join(e.dir, "redis-always"), redisserver.Options{AppendFsyncAlways: true}); err != nil {
		return nil, err
	}
	if p.base, err = startBaseline(ctx, e.cfg.Baseline, e.dir, e.up.CertFile); err != nil {
		return nil, err
	}
	if !e.cfg.skip("matrix") {
		p.peers = e.startPeers(ctx)
	}
	if p.embedded, err = e.startStopgate(ctx, "stopgate-embedded", "", filepath.Join(e.dir, "data-embedded")); err != nil {
		return nil, err
	}
	if p.sgEverysec, err = e.startStopgate(ctx, "stopgate-everysec", p.everysec.URL(), filepath.Join(e.dir, "data-everysec")); err != nil {
		return nil, err
	}
	if p.sgAlways, err = e.startStopgate(ctx, "stopgate-always", p.always.URL(), filepath.Join(e.dir, "data-always")); err != nil {
		return nil, err
	}
	// After the after binary's: the before binary takes the flags it took.
	if e.cfg.Before != "" && !e.cfg.skip("matrix") {
		if err := e.startBeforeProcs(ctx, p); err != nil {
			return nil, err
		}
	}
	if rtt, err := p.everysec.pingRTT(ctx, 1000); err == nil {
		e.figures.set("ping", rtt.Seconds())
		e.note("Redis PING round trip on loopback (median of 1 000): %s.", dur(rtt))
	}
	var tables []*table
	if !e.cfg.skip("matrix") {
		ts, err := e.matrixPhase(ctx, p)
		if err != nil {
			return tables, err
		}
		tables = append(tables, ts...)
	}
	if !e.cfg.skip("cancel") {
		t, err := e.cancelPhase(ctx, p)
		if err != nil {
			return tables, err
		}
		tables = append(tables, t)
	}
	if !e.cfg.skip("memory") {
		t, err := e.memoryPhase(ctx, p)
		if err != nil {
			return tables, err
		}
		tables = append(tables, t)
	}
	return tables, nil
}
