// Package serve is `stopgate serve`: its configuration (the flags, their
// STOPGATE_* variables, and every value checked before anything starts) and
// the wiring of one instance, which Run reads top to bottom: the
// listeners, the store, the policy and the CA, the control plane's
// secrets, the edges on them (egress proxy, browser guard, transparent
// listener, control API), the loops behind them, and the shutdown in the
// reverse order.
//
// It owns no rule and decides nothing about a run or an effect: the
// packages it wires do (state and its stores, intents, proxy, browserguard,
// control, policy). It parses no command line but serve's, and writes
// nothing but its log and what those packages keep in the data directory.
package serve

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"runtime/debug"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"

	"github.com/stopgate/stopgate/browserguard"
	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/intents"
	"github.com/stopgate/stopgate/internal/readyfile"
	"github.com/stopgate/stopgate/policy"
	"github.com/stopgate/stopgate/proxy"
	"github.com/stopgate/stopgate/refusal"
	"github.com/stopgate/stopgate/runwatch"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/stores"
	"github.com/stopgate/stopgate/telemetry"
)

// Bounds of the listeners: a slow or stuck client holds a connection for at
// most these.
const (
	readHeaderTimeout = proxy.ReadHeaderTimeout
	idleTimeout       = proxy.KeepAliveTimeout
	maxHeaderBytes    = proxy.MaxHeaderBytes
	// The control API answers in one store call or a few; the proxy and the
	// browser guard carry streams and long provider calls, so they have no
	// read or write timeout of their own.
	controlReadTimeout  = 30 * time.Second
	controlWriteTimeout = 60 * time.Second
	// openTimeout bounds opening the store at start.
	openTimeout = 15 * time.Second
	// shutdownTimeout bounds the graceful part of a shutdown.
	shutdownTimeout = 10 * time.Second
	// repeatWindow: a warning that repeats (a loop retrying a store that
	// is down) is said at most once a window, with the count held back.
	repeatWindow = 30 * time.Second
	// gcPercent is serve's garbage collection target (GOGC) unless the
	// environment sets one: the proxy's live heap is a few MB while each
	// request leaves garbage behind, so Go's default (100) collects many
	// times a second under load. 400 trades a few MB for that CPU.
	gcPercent = 400
)

// Main is `stopgate serve ARGS`: the configuration read from args over the
// environment (getenv), the log on stderr, served until ctx ends.
func Main(ctx context.Context, args []string, getenv func(string) string, stderr io.Writer) error {
	cfg, err := ParseConfig(args, getenv)
	if err != nil {
		return err
	}
	if getenv("GOGC") == "" {
		debug.SetGCPercent(gcPercent)
	}
	return Run(ctx, cfg, cfg.logger(stderr))
}

// Run runs stopgate until ctx ends (SIGINT, SIGTERM): it opens the store,
// builds the instance on it, serves, then shuts down in the reverse order:
// listeners first, the store last, so nothing still serving ever finds the
// store closed.
func Run(ctx context.Context, cfg Config, base *slog.Logger) (err error) {
	// The loops that retry while the store is down (and the store's own
	// client) say so once a window; the decision lines, each the one
	// record of a request, are never held back.
	log := slog.New(telemetry.Repeats(base.Handler(), repeatWindow))
	redis.SetLogger(redisLogger{log.With("component", "redis")})
	// Every listener is taken before anything is opened or written (the
	// store, the CA, the tokens), so that a taken port fails the start
	// with the flag named and leaves the data directory as it was.
	lns, err := listenAll(cfg)
	if err != nil {
		return err
	}
	opened, err := openStore(ctx, cfg, log)
	if err != nil {
		lns.close()
		return err
	}
	defer func() {
		if cerr := opened.Store.Close(); cerr != nil {
			log.Error("closing the store", "err", cerr)
			err = errors.Join(err, cerr)
		}
		log.Info("store closed; stopgate stopped")
	}()
	inst, err := build(cfg, opened, lns, log, base.With("component", "decisions"))
	if err != nil {
		return err
	}
	return inst.run(ctx)
}

// instance is one stopgate: its edges, the loops behind them, and the
// listeners they serve on.
type instance struct {
	cfg   Config
	log   *slog.Logger
	store stores.Opened
	// measured is the store as every part calls it: timed and counted.
	measured state.Store
	tel      *telemetry.Telemetry
	owner    string
	// pol is the policy read at start; policy holds the one in force,
	// which SIGHUP and POST /v1/policy/reload replace.
	pol     policy.Policy
	policy  *policyHolder
	lns     *listeners
	watcher *runwatch.Watcher
	// sweeper ticks draining runs; the watch tells it of every cancel.
	sweeper  *intents.Sweeper
	ledger   *intents.Ledger
	egress   *proxy.Proxy
	launcher *browserguard.Launcher
	guard    *browserguard.Guard
	// transparent is the listener for kernel-redirected connections and
	// the bindings exec --isolate asks for (off without --transparent-addr).
	transparent *transparentParts
	api         *control.Handler
	// metrics serves /metrics, on the control API and on --metrics-addr.
	metrics http.Handler
}

// build wires the instance top to bottom: the policy and the CA, what the
// edges share (the decisions' account, this instance's ledger, one watch
// on runs), the listeners, then the edges and the control API.
func build(cfg Config, opened stores.Opened, lns *listeners, log, decisions *slog.Logger) (_ *instance, err error) {
	defer func() {
		if err != nil {
			lns.close()
		}
	}()
	pol, rules, err := loadPolicy(cfg)
	if err != nil {
		return nil, configErrorf("--config: %v", err)
	}
	ca, err := loadCA(cfg)
	if err != nil {
		return nil, err
	}
	secrets, err := loadControlSecrets(cfg, log)
	if err != nil {
		return nil, err
	}
	tokens := secrets.signer

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	tel := telemetry.New(telemetry.Options{Registry: reg, Logger: decisions, Store: opened.Kind, AccessLog: cfg.AccessLog})
	// Every part calls the store through its measure: one place times and
	// counts the store's work, whoever asks.
	store := tel.Store(opened.Store)
	tel.Totals(reg, store)
	inst := &instance{cfg: cfg, log: log, store: opened, measured: store, tel: tel, owner: instanceName(), pol: pol, lns: lns}
	inst.metrics = promhttp.HandlerFor(reg, promhttp.HandlerOpts{})
	inst.policy = newPolicyHolder(cfg, pol, tel.Metrics(), log.With("component", "policy"))
	inst.ledger = intents.NewLedger(store, intents.LedgerOptions{
		Owner: inst.owner, LeaseTTL: cfg.LeaseTTL, StoreTimeout: cfg.StoreTimeout, Logger: log.With("component", "ledger"),
	})
	inst.sweeper = &intents.Sweeper{Store: store, Interval: cfg.SweepInterval, Actor: "sweeper:" + inst.owner, StoreTimeout: cfg.StoreTimeout,
		Retention: cfg.Retention, Logger: log.With("component", "sweeper"),
		Drained: func(run state.Run) {
			tel.Metrics().Drained(string(run.Status), run.UpdatedAt.Sub(run.CancelledAt))
		}}
	inst.watcher = runwatch.New(store, runwatch.Options{Interval: cfg.RecheckInterval, StoreTimeout: cfg.StoreTimeout,
		Logger: log.With("component", "watch"), Heard: inst.sweeper.Watch})

	inst.egress, err = proxy.New(proxy.Config{
		Ledger: inst.ledger, Watcher: inst.watcher, Telemetry: tel, CA: ca, StaticRun: cfg.Run, AutoAdmit: cfg.AutoAdmit,
		Tokens: tokens, RequireToken: cfg.RequireRunToken, Rules: rules,
		MaxBody: cfg.MaxBody, SpoolDir: cfg.SpoolDir, Logger: log.With("component", "proxy"),
		Protected: inst.protected(), Runs: store, StoreTimeout: cfg.StoreTimeout,
		MaxConns: cfg.MaxConns, MaxConnsPerRun: cfg.MaxConnsPerRun,
		HandshakeTimeout: cfg.TunnelHandshakeTimeout, IdleTimeout: cfg.ClientIdleTimeout,
	})
	var sandbox browserguard.Sandbox
	if err == nil {
		sandbox, err = browserSandbox(cfg)
	}
	if err == nil {
		inst.policy.egress = inst.egress
		inst.launcher, err = browserguard.NewLauncher(browserguard.LauncherConfig{
			Chromium: cfg.Chromium, Ledger: inst.ledger, Watcher: inst.watcher, Egress: inst.egress.ForRun,
			GuardAddr: inst.lns.browser.Addr().String(), AutoAdmit: cfg.AutoAdmit, Budget: inst.policy.autoBudget, Linger: cfg.BrowserLinger, MaxBrowsers: cfg.BrowserMax,
			Logger: log.With("component", "launcher"), Telemetry: inst.tel,
			Sandbox: sandbox, Tokens: tokens, RequireToken: cfg.RequireRunToken,
		})
	}
	if err == nil {
		inst.guard, err = browserguard.New(browserguard.Config{
			Store: store, Ledger: inst.ledger, Watcher: inst.watcher, Browsers: inst.launcher.DevTools, AutoAdmit: cfg.AutoAdmit, Budget: inst.policy.autoBudget,
			StoreTimeout: cfg.StoreTimeout, Logger: log.With("component", "browserguard"), Telemetry: inst.tel,
			Tokens: tokens, RequireToken: cfg.RequireRunToken, Uploads: cfg.BrowserUploadDir,
		})
	}
	if err == nil {
		inst.transparent, err = startTransparent(cfg, inst.lns.transparent, inst.egress, log.With("component", "transparent"))
	}
	if err == nil {
		inst.api, err = control.New(control.Options{
			Store: store, Token: secrets.operator, ReadToken: secrets.read, Open: secrets.open, DrainTimeout: cfg.DrainTimeout, StoreTimeout: cfg.StoreTimeout, Logger: log.With("component", "control"), Telemetry: inst.tel,
			CACertPEM: ca.PEM, Metrics: inst.metrics, WebhookSecret: inst.policy.secret,
			ReloadPolicy: inst.policy.reloader(), Budgets: inst.policy.budget,
			Tokens: tokens, Browsers: browserLauncher(inst.launcher),
			Endpoints: control.Endpoints{
				Proxy: inst.lns.proxy.Addr().String(), Transparent: inst.transparent.addr, RunTokens: runTokenMode(tokens, cfg.RequireRunToken),
			},
			Transparent: inst.transparent.binder, Watcher: inst.watcher,
			Watch: control.WatchOptions{Max: cfg.MaxWatches, MaxPerRun: cfg.MaxWatchesPerRun},
		})
	}
	if err != nil {
		if inst.transparent != nil {
			inst.transparent.close()
		}
		return nil, err
	}
	return inst, nil
}

// bound are the addresses the listeners took (port 0 resolved).
func (inst *instance) bound() readyfile.Addrs {
	a := readyfile.Addrs{Proxy: inst.lns.proxy.Addr().String(), Control: inst.lns.control.Addr().String(), Browser: inst.lns.browser.Addr().String()}
	if inst.lns.metrics != nil {
		a.Metrics = inst.lns.metrics.Addr().String()
	}
	for _, ln := range inst.lns.transparent {
		a.Transparent = append(a.Transparent, ln.Addr().String())
	}
	return a
}

// protected are the addresses the egress proxy never connects to: this
// instance's listeners and its store.
func (inst *instance) protected() []proxy.Protected {
	out := []proxy.Protected{
		{Addr: inst.lns.proxy.Addr().String(), What: "egress proxy"},
		{Addr: inst.lns.control.Addr().String(), What: "control API"},
		{Addr: inst.lns.browser.Addr().String(), What: "browser guard"},
	}
	if inst.lns.metrics != nil {
		out = append(out, proxy.Protected{Addr: inst.lns.metrics.Addr().String(), What: "metrics listener"})
	}
	for _, ln := range inst.lns.transparent {
		out = append(out, proxy.Protected{Addr: ln.Addr().String(), What: "transparent listener"})
	}
	for _, a := range inst.store.Addrs {
		out = append(out, proxy.Protected{Addr: a, What: "store"})
	}
	return out
}

// run serves until ctx ends or a listener fails, then shuts down: the
// control API first, so no new cancel arrives during the shutdown; then
// browsers, whose open actions are recorded UNKNOWN and whose pages'
// requests end before the egress proxy does; then the proxy, with what is
// still open cut and recorded rather than left to lease expiry; the loops
// last.
func (inst *instance) run(ctx context.Context) error {
	cfg, log := inst.cfg, inst.log
	store := inst.measured
	loops, stopLoops := startLoops(ctx, inst.watcher, inst.ledger,
		inst.sweeper,
		&intents.Reconciler{Store: store, Lookups: inst.pol.Lookups, Actor: "reconciler:" + inst.owner, StoreTimeout: cfg.StoreTimeout, Logger: log.With("component", "reconciler")},
	)
	servers := newServers(log)
	servers.start("egress proxy", inst.lns.proxy, inst.egress, 0, 0)
	servers.start("browser guard", inst.lns.browser, inst.guard, 0, 0)
	servers.start("control API", inst.lns.control, inst.api, controlReadTimeout, controlWriteTimeout)
	if inst.lns.metrics != nil {
		servers.start("metrics", inst.lns.metrics, metricsOnly(inst.metrics), controlReadTimeout, controlWriteTimeout)
	}
	inst.logStart()
	if cfg.ReadyFile != "" {
		if err := readyfile.Write(cfg.ReadyFile, inst.bound()); err != nil {
			log.Error("the ready file could not be written: a caller waiting for it waits in vain", "err", err)
		} else {
			defer os.Remove(cfg.ReadyFile)
		}
	}

	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	var err error
	for done := false; !done; {
		select {
		case <-ctx.Done():
			log.Info("shutting down", "cause", context.Cause(ctx))
			done = true
		case err = <-servers.failed:
			done = true
		case <-hup:
			// The outcome is logged and counted by the reload itself.
			_, _ = inst.policy.reload(ctx, "signal:SIGHUP")
		}
	}
	shutdownCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), shutdownTimeout)
	defer cancel()
	if inst.lns.metrics != nil {
		err = errors.Join(err, servers.shutdown(shutdownCtx, "metrics"))
	}
	// Watch streams never end by themselves: ended first, they do not hold
	// the control API's shutdown.
	inst.api.EndWatches()
	err = errors.Join(err,
		servers.shutdown(shutdownCtx, "control API"),
		servers.shutdown(shutdownCtx, "browser guard"),
		inst.guard.Close(shutdownCtx), inst.launcher.Close(shutdownCtx),
		servers.shutdown(shutdownCtx, "egress proxy"),
	)
	inst.transparent.close()
	inst.egress.CutAll(state.ReasonShutdown)
	_ = inst.egress.Close()
	stopLoops()
	loops.Wait()
	return err
}

// openStore opens the configured store and says in the log what it is and
// what an acknowledged cancel survives.
func openStore(ctx context.Context, cfg Config, log *slog.Logger) (stores.Opened, error) {
	ctx, cancel := context.WithTimeout(ctx, openTimeout)
	defer cancel()
	sc := cfg.storeConfig()
	sc.Logger = log.With("component", "store")
	opened, err := stores.Open(ctx, sc)
	if errors.Is(err, state.ErrInvalid) {
		return opened, configErrorf("--store (or STOPGATE_STORE): %v", err)
	}
	if errors.Is(err, stores.ErrNotDurable) {
		return opened, fmt.Errorf("--require-durable: %w (or drop --require-durable)", err)
	}
	if err != nil {
		return opened, err
	}
	level := slog.LevelInfo
	if !opened.Durable {
		level = slog.LevelWarn
	}
	log.Log(ctx, level, "store: "+opened.Kind, "where", opened.Where, "durable", opened.Durable, "durability", opened.Durability)
	for _, w := range opened.Warnings {
		log.Warn("store: "+w, "where", opened.Where)
	}
	return opened, nil
}

// loadCA is the operator's CA when serve is given one (--ca-cert,
// --ca-key), else the one in the data directory, created on first start.
func loadCA(cfg Config) (*proxy.CA, error) {
	if cfg.CACert != "" {
		ca, err := proxy.LoadCA(cfg.CACert, cfg.CAKey)
		if err != nil {
			return nil, fmt.Errorf("--ca-cert, --ca-key: %w", err)
		}
		return ca, nil
	}
	ca, err := proxy.LoadOrCreateCA(cfg.DataDir)
	if err != nil {
		return nil, fmt.Errorf("--data-dir %s: %w", cfg.DataDir, err)
	}
	return ca, nil
}

// browserSandbox is how serve's browsers are kept from the machine: this
// binary sets up their namespaces, and what serve keeps secret is hidden
// from them.
func browserSandbox(cfg Config) (browserguard.Sandbox, error) {
	sb := browserguard.Sandbox{Isolation: browserguard.Isolation(cfg.BrowserIsolation), UID: cfg.BrowserUID, Uploads: cfg.BrowserUploadDir}
	if sb.Isolation == browserguard.IsolateNamespaces {
		exe, err := os.Executable()
		if err != nil {
			return sb, fmt.Errorf("the browsers' sandbox helper (this binary): %w", err)
		}
		sb.Helper = exe
	}
	for _, p := range []string{cfg.DataDir, cfg.ControlTokenFile, cfg.ReadTokenFile, cfg.RunTokenSecretFile, cfg.CAKey, cfg.SpoolDir} {
		if p != "" {
			sb.Hide = append(sb.Hide, p)
		}
	}
	return sb, nil
}

// browserLauncher adapts the launcher to the control API's endpoint.
func browserLauncher(l *browserguard.Launcher) control.BrowserLauncher {
	return func(ctx context.Context, req control.BrowserLaunch) (control.BrowserLaunched, error) {
		b, err := l.Launch(ctx, browserguard.LaunchRequest{Run: req.RunID, Observed: req.ObservedVersion, Actor: req.Actor, Token: req.Token})
		if errors.Is(err, browserguard.ErrBrowserLimit) {
			err = browserLimit{err}
		}
		return control.BrowserLaunched{Guard: b.Guard, WSURL: b.WSURL, CancelVersion: b.Version, Created: b.Created}, err
	}
}

// browserLimit is the launcher's refusal past its cap on browsers, as the
// control API knows it; its text is the launcher's.
type browserLimit struct{ error }

func (browserLimit) Is(target error) bool { return target == control.ErrBrowserLimit }

// listeners are serve's sockets, taken before anything serves; metrics is
// nil without --metrics-addr.
type listeners struct {
	proxy, browser, control, metrics net.Listener
	// transparent are the transparent listeners (none without
	// --transparent-addr): IPv4 and, on loopback, IPv6 on the same port.
	transparent []net.Listener
}

func listenAll(cfg Config) (*listeners, error) {
	lns := &listeners{}
	for _, l := range []struct {
		flag, addr string
		into       *net.Listener
	}{
		{"--proxy-addr", cfg.ProxyAddr, &lns.proxy},
		{"--browser-addr", cfg.BrowserAddr, &lns.browser},
		{"--control-addr", cfg.ControlAddr, &lns.control},
		{"--metrics-addr", cfg.MetricsAddr, &lns.metrics},
	} {
		if l.addr == "" {
			continue
		}
		ln, err := net.Listen("tcp", l.addr)
		if err != nil {
			lns.close()
			return nil, fmt.Errorf("%s %s: %w", l.flag, l.addr, err)
		}
		*l.into = ln
	}
	if cfg.TransparentAddr != "" {
		tl, err := proxy.ListenTransparent(cfg.TransparentAddr)
		if err != nil {
			lns.close()
			return nil, fmt.Errorf("--transparent-addr %s: %w", cfg.TransparentAddr, err)
		}
		lns.transparent = tl
	}
	return lns, nil
}

// close closes what is still open; a listener a server took is closed by it.
func (l *listeners) close() {
	for _, ln := range append([]net.Listener{l.proxy, l.browser, l.control, l.metrics}, l.transparent...) {
		if ln != nil {
			_ = ln.Close()
		}
	}
}

// startLoops runs the background loops until the returned stop is called.
func startLoops(ctx context.Context, watcher *runwatch.Watcher, ledger *intents.Ledger, sweeper *intents.Sweeper, reconciler *intents.Reconciler) (*sync.WaitGroup, func()) {
	runCtx, stop := context.WithCancel(context.WithoutCancel(ctx))
	var loops sync.WaitGroup
	for _, loop := range []func(context.Context){watcher.Run, ledger.Run, sweeper.Run, reconciler.Run} {
		loops.Go(func() { loop(runCtx) })
	}
	return &loops, stop
}

// servers are serve's HTTP servers, by name.
type servers struct {
	log    *slog.Logger
	byName map[string]*http.Server
	// failed carries the first error of a server that stopped by itself.
	failed chan error
}

func newServers(log *slog.Logger) *servers {
	return &servers{log: log, byName: map[string]*http.Server{}, failed: make(chan error, 4)}
}

func (s *servers) start(name string, ln net.Listener, h http.Handler, read, write time.Duration) {
	srv := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: readHeaderTimeout,
		ReadTimeout:       read,
		WriteTimeout:      write,
		IdleTimeout:       idleTimeout,
		MaxHeaderBytes:    maxHeaderBytes,
		ErrorLog:          slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
	}
	s.byName[name] = srv
	go func() {
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			s.failed <- fmt.Errorf("%s on %s: %w", name, ln.Addr(), err)
		}
	}()
}

func (s *servers) shutdown(ctx context.Context, name string) error {
	srv := s.byName[name]
	if err := srv.Shutdown(ctx); err != nil {
		s.log.Warn(name+" did not drain in time; closing its connections", "err", err)
		_ = srv.Close()
		return fmt.Errorf("%s: %w", name, err)
	}
	return nil
}

func (inst *instance) logStart() {
	cfg, log, lns, pol := inst.cfg, inst.log, inst.lns, inst.pol
	attrs := []any{"addr", lns.proxy.Addr().String(), "instance", inst.owner, "static_run", cfg.Run, "auto_admit", cfg.AutoAdmit}
	counts := pol.RuleCounts()
	counts["allow_dest"] += len(cfg.AllowDest)
	for _, k := range policy.RuleKinds {
		attrs = append(attrs, k, counts[k])
	}
	attrs = append(attrs, "dest_default", pol.Destinations.InForce(), "max_conns", cfg.MaxConns, "max_conns_per_run", cfg.MaxConnsPerRun)
	log.Info("egress proxy serving", attrs...)
	log.Info("browser guard serving", "addr", lns.browser.Addr().String(), "chromium", cfg.Chromium, "linger", cfg.BrowserLinger, "max_browsers", cfg.BrowserMax,
		"isolation", cfg.BrowserIsolation, "require_run_token", cfg.RequireRunToken, "upload_dir", cfg.BrowserUploadDir)
	if cfg.BrowserIsolation == string(browserguard.IsolateNone) {
		log.Warn("browsers run without isolation (--browser-isolation=none): as serve's own user, with their egress listeners open to every local process; the guard's refusals still hold, the operating system's do not")
	}
	if _, err := exec.LookPath(cfg.Chromium); err != nil {
		log.Warn("no Chromium: launching a browser for a run fails until it is installed (apt-get install chromium) or --chromium names it", "chromium", cfg.Chromium, "err", err)
	}
	log.Info("control API serving", "addr", lns.control.Addr().String(), "auth", cfg.ControlAuth, "drain_timeout", cfg.DrainTimeout, "store", inst.store.Kind)
	if lns.metrics != nil {
		log.Info("metrics serving", "addr", lns.metrics.Addr().String(), "path", "/metrics")
	}
	if cfg.ControlAuth == authNone {
		warnOpen(log, lns.control.Addr().String(), isLoopback(lns.control.Addr()))
	}
}

// redisLogger is go-redis's log (its pool's and its reconnects' lines) in
// serve's, as warnings of component redis. Their text varies (addresses,
// attempts), so it is an attribute: one message, which a store that is
// down repeats once a window.
type redisLogger struct{ log *slog.Logger }

func (l redisLogger) Printf(ctx context.Context, format string, v ...any) {
	l.log.WarnContext(ctx, "redis client", "said", strings.TrimSpace(fmt.Sprintf(format, v...)))
}

// metricsOnly serves /metrics and nothing else: the listener a scraper
// reaches, which opens no part of the control API.
func metricsOnly(metrics http.Handler) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", metrics)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		refusal.New(refusal.NotFound, "this listener (--metrics-addr) serves GET /metrics only; the control API listens on --control-addr").WriteHTTP(w)
	})
	return mux
}

// instanceName names this process in leases and the audit log; the random
// part keeps a restarted process (same host, maybe same pid) apart from
// the one whose leases it must not renew.
func instanceName() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "unknown-host"
	}
	var b [3]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("stopgate@%s/%d-%x", host, os.Getpid(), b)
}

func isLoopback(a net.Addr) bool {
	ta, ok := a.(*net.TCPAddr)
	return ok && ta.IP.IsLoopback()
}
