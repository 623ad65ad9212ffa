package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/stopgate/stopgate/control"
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

	api, err := control.New(control.Options{
		Store:        store,
		Token:        cfg.ControlToken,
		DrainTimeout: cfg.DrainTimeout,
		Logger:       log.With("component", "control"),
	})
	if err != nil {
		return err
	}
	// Listen before serving so that a taken port fails the start, with
	// the flag named, instead of a log line after "serving".
	ln, err := net.Listen("tcp", cfg.ControlAddr)
	if err != nil {
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

	stopOthers, err := startComponents(ctx, cfg, store, log)
	if err != nil {
		_ = ln.Close()
		return err
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
	if serr := stopOthers(shutdownCtx); serr != nil {
		log.Error("stopping components", "err", serr)
		err = errors.Join(err, serr)
	}
	return err
}

// startComponents starts the parts of serve besides the control API and
// returns how to stop them; serve calls stop before it closes the store.
//
// TODO(lead): start here, on the open store and cfg, the egress proxy
// listener (cfg.ProxyAddr, cfg.Run, cfg.AutoAdmit, cfg.Config), the
// finalizer loop (Tick of live runs, and of each run in store.Cancels),
// and the MITM CA kept in cfg.DataDir. Nothing of them exists yet, so
// nothing starts: the control API alone is served.
func startComponents(ctx context.Context, cfg serveConfig, store state.Store, log *slog.Logger) (stop func(context.Context) error, err error) {
	_, _, _, _ = ctx, cfg, store, log
	return func(context.Context) error { return nil }, nil
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
