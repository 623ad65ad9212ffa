package main

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/stopgate/stopgate/browserguard"
	"github.com/stopgate/stopgate/control"
	"github.com/stopgate/stopgate/intents"
	"github.com/stopgate/stopgate/policy"
	"github.com/stopgate/stopgate/proxy"
	"github.com/stopgate/stopgate/runtoken"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/filestore"
	"github.com/stopgate/stopgate/state/redisstore"
)

// Bounds of the control API server: a slow or stuck client holds a
// connection for at most these.
const (
	readHeaderTimeout = 5 * time.Second
	readTimeout       = 30 * time.Second
	writeTimeout      = 60 * time.Second
	idleTimeout       = 2 * time.Minute
	maxHeaderBytes    = 64 << 10
	// openTimeout bounds opening the store at start.
	openTimeout = 15 * time.Second
	// shutdownTimeout bounds the graceful part of a shutdown.
	shutdownTimeout = 10 * time.Second
)

func (c *cli) serve(ctx context.Context, args []string) error {
	cfg, err := parseServeConfig(args, c.getenv)
	if err != nil {
		return err
	}
	log := slog.New(slog.NewTextHandler(c.stderr, &slog.HandlerOptions{Level: cfg.LogLevel}))
	return serve(ctx, cfg, log)
}

// serve runs until ctx ends (SIGINT, SIGTERM), then shuts down in the
// reverse order of start: listeners first, the store last, so nothing
// still serving ever finds the store closed.
func serve(ctx context.Context, cfg serveConfig, log *slog.Logger) (err error) {
	store, err := openStore(ctx, cfg, log)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := store.Close(); cerr != nil {
			log.Error("closing the store", "err", cerr)
			err = errors.Join(err, cerr)
		}
		log.Info("store closed; stopgate stopped")
	}()

	comp, err := startComponents(ctx, cfg, store, log)
	if err != nil {
		return err
	}
	api, err := control.New(control.Options{
		Store:         store,
		Token:         cfg.ControlToken,
		DrainTimeout:  cfg.DrainTimeout,
		Logger:        log.With("component", "control"),
		CACertPEM:     comp.caPEM,
		Metrics:       comp.metrics,
		WebhookSecret: comp.webhookSecret,
		Tokens:        comp.tokens,
		Browsers:      comp.browsers,
	})
	if err != nil {
		_ = comp.stop(ctx)
		return err
	}
	// Listen before serving so that a taken port fails the start, with
	// the flag named, instead of a log line after "serving".
	ln, err := net.Listen("tcp", cfg.ControlAddr)
	if err != nil {
		_ = comp.stop(ctx)
		return fmt.Errorf("--control-addr %s: %w", cfg.ControlAddr, err)
	}
	if cfg.ControlToken == "" && !isLoopback(ln.Addr()) {
		log.Warn("the control API listens beyond loopback without a token: anyone who reaches it can cancel and complete runs; set --control-token", "addr", ln.Addr().String())
	}
	srv := &http.Server{
		Handler:           api,
		ReadHeaderTimeout: readHeaderTimeout,
		ReadTimeout:       readTimeout,
		WriteTimeout:      writeTimeout,
		IdleTimeout:       idleTimeout,
		MaxHeaderBytes:    maxHeaderBytes,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}

	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve(ln) }()
	log.Info("control API serving", "addr", ln.Addr().String(), "auth", cfg.ControlToken != "", "drain_timeout", cfg.DrainTimeout)

	select {
	case <-ctx.Done():
		log.Info("shutting down", "cause", context.Cause(ctx))
	case err = <-serveErr:
		err = fmt.Errorf("control API on %s: %w", cfg.ControlAddr, err)
	}

	shutdownCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), shutdownTimeout)
	defer cancel()
	if serr := srv.Shutdown(shutdownCtx); serr != nil {
		log.Warn("control API did not drain in time; closing its connections", "err", serr)
		_ = srv.Close()
	}
	if serr := comp.stop(shutdownCtx); serr != nil {
		log.Error("stopping components", "err", serr)
		err = errors.Join(err, serr)
	}
	return err
}

// components are the parts of serve besides the control API: the egress
// proxy with its ledger, the browser guard and its launcher, the sweeper
// that moves cancelled runs on, and the reconciler of UNKNOWN intents.
type components struct {
	caPEM         []byte
	metrics       http.Handler
	webhookSecret func(source string) ([]byte, bool)
	browsers      control.BrowserLauncher
	tokens        *runtoken.Signer
	stop          func(context.Context) error
}

// startComponents starts them on the open store; stop ends them before the
// store closes.
func startComponents(ctx context.Context, cfg serveConfig, store state.Store, log *slog.Logger) (*components, error) {
	pol, err := policy.Load(cfg.Config)
	if err != nil {
		return nil, usagef("serve", "--config: %v", err)
	}
	pass, err := proxy.NewHostSet(pol.PassThrough)
	if err != nil {
		return nil, usagef("serve", "--config: pass_through: %v", err)
	}
	delivery, err := proxy.NewHostSet(pol.Delivery)
	if err != nil {
		return nil, usagef("serve", "--config: delivery: %v", err)
	}
	ca, err := proxy.LoadOrCreateCA(cfg.DataDir)
	if err != nil {
		return nil, fmt.Errorf("--data-dir %s: %w", cfg.DataDir, err)
	}
	var tokens *runtoken.Signer
	if cfg.RunTokenSecret != "" {
		if tokens, err = runtoken.New([]byte(cfg.RunTokenSecret)); err != nil {
			return nil, usagef("serve", "--run-token-secret: %v", err)
		}
	}
	owner := instanceName()
	ledger := intents.NewLedger(store, intents.LedgerOptions{
		Owner: owner, LeaseTTL: cfg.LeaseTTL, StoreTimeout: cfg.StoreTimeout, Logger: log.With("component", "ledger"),
	})
	egress, err := proxy.New(proxy.Config{
		Store: store, Ledger: ledger, CA: ca, StaticRun: cfg.Run, AutoAdmit: cfg.AutoAdmit, Tokens: tokens, RequireToken: cfg.RequireRunToken,
		PassThrough: pass, Delivery: delivery, MaxBody: cfg.MaxBody, SpoolDir: cfg.SpoolDir,
		RecheckInterval: cfg.RecheckInterval, StoreTimeout: cfg.StoreTimeout, Logger: log.With("component", "proxy"),
	})
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", cfg.ProxyAddr)
	if err != nil {
		return nil, fmt.Errorf("--proxy-addr %s: %w", cfg.ProxyAddr, err)
	}
	bln, err := net.Listen("tcp", cfg.BrowserAddr)
	if err != nil {
		_ = ln.Close()
		return nil, fmt.Errorf("--browser-addr %s: %w", cfg.BrowserAddr, err)
	}
	closeListeners := func() { _ = ln.Close(); _ = bln.Close() }
	launcher, err := browserguard.NewLauncher(browserguard.LauncherConfig{
		Chromium: cfg.Chromium, Store: store, Ledger: ledger, Egress: egress.ForRun, GuardAddr: bln.Addr().String(),
		AutoAdmit: cfg.AutoAdmit, Linger: cfg.BrowserLinger, MaxBrowsers: cfg.BrowserMax,
		RecheckInterval: cfg.RecheckInterval, StoreTimeout: cfg.StoreTimeout, Logger: log.With("component", "launcher"),
	})
	if err != nil {
		closeListeners()
		return nil, err
	}
	guard, err := browserguard.New(browserguard.Config{
		Store: store, Ledger: ledger, Browsers: launcher.DevTools, AutoAdmit: cfg.AutoAdmit,
		RecheckInterval: cfg.RecheckInterval, StoreTimeout: cfg.StoreTimeout, Logger: log.With("component", "browserguard"),
	})
	if err != nil {
		closeListeners()
		return nil, err
	}
	// No read or write timeout: streams and long provider calls are the
	// traffic. Headers are still bounded.
	srv := &http.Server{
		Handler:           egress,
		ReadHeaderTimeout: readHeaderTimeout,
		IdleTimeout:       idleTimeout,
		MaxHeaderBytes:    maxHeaderBytes,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}

	// Like the proxy's: CDP connections are long-lived, headers are bounded.
	bsrv := &http.Server{
		Handler:           guard,
		ReadHeaderTimeout: readHeaderTimeout,
		IdleTimeout:       idleTimeout,
		MaxHeaderBytes:    maxHeaderBytes,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}

	runCtx, stopLoops := context.WithCancel(context.WithoutCancel(ctx))
	var loops sync.WaitGroup
	loops.Go(func() { egress.Run(runCtx) })
	loops.Go(func() { guard.Run(runCtx) })
	loops.Go(func() { launcher.Run(runCtx) })
	loops.Go(func() { ledger.Run(runCtx) })
	sweeper := &intents.Sweeper{Store: store, Interval: cfg.SweepInterval, Actor: "sweeper:" + owner, StoreTimeout: cfg.StoreTimeout, Logger: log.With("component", "sweeper")}
	loops.Go(func() { sweeper.Run(runCtx) })
	reconciler := &intents.Reconciler{Store: store, Lookups: pol.Lookups, Actor: "reconciler:" + owner, StoreTimeout: cfg.StoreTimeout, Logger: log.With("component", "reconciler")}
	loops.Go(func() { reconciler.Run(runCtx) })
	serveErr := make(chan error, 2)
	go func() { serveErr <- srv.Serve(ln) }()
	go func() { serveErr <- bsrv.Serve(bln) }()
	log.Info("browser guard serving", "addr", bln.Addr().String(), "chromium", cfg.Chromium, "linger", cfg.BrowserLinger, "max_browsers", cfg.BrowserMax)
	if _, err := exec.LookPath(cfg.Chromium); err != nil {
		log.Warn("no Chromium: launching a browser for a run fails until it is installed (apt-get install chromium) or --chromium names it", "chromium", cfg.Chromium, "err", err)
	}
	log.Info("egress proxy serving", "addr", ln.Addr().String(), "instance", owner, "static_run", cfg.Run, "auto_admit", cfg.AutoAdmit,
		"pass_through", len(pol.PassThrough), "delivery", len(pol.Delivery), "lookups", len(pol.Lookups), "webhooks", len(pol.Webhooks))

	reg := prometheus.NewRegistry()
	reg.MustRegister(egress.Collector(), collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return &components{
		caPEM:         ca.PEM,
		metrics:       promhttp.HandlerFor(reg, promhttp.HandlerOpts{}),
		webhookSecret: pol.Secret,
		tokens:        tokens,
		browsers: func(ctx context.Context, req control.BrowserLaunch) (control.BrowserLaunched, error) {
			b, err := launcher.Launch(ctx, req.RunID, req.ObservedVersion, req.Actor)
			if errors.Is(err, browserguard.ErrBrowserLimit) {
				err = browserLimit{err}
			}
			return control.BrowserLaunched{Guard: b.Guard, WSURL: b.WSURL, CancelVersion: b.Version, Created: b.Created}, err
		},
		stop: func(ctx context.Context) error {
			// Browsers first: their open actions are recorded UNKNOWN and
			// their pages' requests end before the egress proxy does.
			err := bsrv.Shutdown(ctx)
			if err != nil {
				_ = bsrv.Close()
			}
			err = errors.Join(err, guard.Close(ctx), launcher.Close(ctx))
			if serr := srv.Shutdown(ctx); serr != nil {
				_ = srv.Close()
				err = errors.Join(err, serr)
			}
			// What is still open now (tunnels, streams, calls that did not
			// finish in time) is cut and recorded, not left to lease expiry.
			egress.CutAll("stopgate_shutdown")
			stopLoops()
			loops.Wait()
			for range 2 {
				select {
				case serr := <-serveErr:
					if !errors.Is(serr, http.ErrServerClosed) {
						err = errors.Join(err, serr)
					}
				default:
				}
			}
			return err
		},
	}, nil
}

// browserLimit is the launcher's refusal past its cap on browsers, as the
// control API knows it; its text is the launcher's.
type browserLimit struct{ error }

func (browserLimit) Is(target error) bool { return target == control.ErrBrowserLimit }

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

// openStore opens the configured store: Redis when --store is set, else the
// embedded file in the data directory. With --require-durable it refuses a
// store that may lose an acknowledged cancel.
func openStore(ctx context.Context, cfg serveConfig, log *slog.Logger) (state.Store, error) {
	ctx, cancel := context.WithTimeout(ctx, openTimeout)
	defer cancel()
	if cfg.Store == "" {
		if err := os.MkdirAll(cfg.DataDir, 0o700); err != nil {
			return nil, fmt.Errorf("--data-dir %s: %w", cfg.DataDir, err)
		}
		path := cfg.EmbeddedPath()
		s, err := filestore.Open(path, filestore.Options{Logger: log.With("component", "store")})
		if err != nil {
			return nil, fmt.Errorf("opening the embedded store %s: %w", path, err)
		}
		// Every write transaction of the embedded store is fsynced before
		// it returns: --require-durable holds by construction.
		log.Info("store: embedded", "path", path, "durable", true)
		return s, nil
	}
	where := redactURL(cfg.Store)
	s, err := redisstore.Open(ctx, cfg.Store, redisstore.Options{Logger: log.With("component", "store")})
	if errors.Is(err, state.ErrInvalid) {
		return nil, usagef("serve", "--store (or STOPGATE_STORE): %v", err)
	}
	if err != nil {
		return nil, fmt.Errorf("opening the Redis store %s: %w", where, err)
	}
	d, err := s.Durability(ctx)
	if err != nil {
		if cfg.RequireDurable {
			_ = s.Close()
			return nil, fmt.Errorf("--require-durable: cannot tell whether Redis at %s persists writes: %w", where, err)
		}
		log.Warn("store: redis; cannot tell whether it persists writes", "url", where, "err", err)
		return s, nil
	}
	if cfg.RequireDurable && !d.Safe() {
		_ = s.Close()
		return nil, fmt.Errorf("--require-durable: Redis at %s may lose an acknowledged cancel: %s; set appendonly yes and appendfsync always, or drop --require-durable", where, d.Describe())
	}
	level := slog.LevelInfo
	if !d.Safe() {
		level = slog.LevelWarn
	}
	log.Log(ctx, level, "store: redis", "url", where, "durability", d.Describe(), "durable", d.Safe())
	return s, nil
}

func isLoopback(a net.Addr) bool {
	ta, ok := a.(*net.TCPAddr)
	return ok && ta.IP.IsLoopback()
}
