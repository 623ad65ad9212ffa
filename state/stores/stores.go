// Package stores opens the state.Store a configuration names: the embedded
// store in a data directory when no URL is given, the Redis store for a
// redis://, rediss://, redis-sentinel:// or redis-cluster:// URL. It says
// what it opened, whether an acknowledged cancel survives a crash of the
// store, and what else could take one away (a Redis that asks no password,
// one that evicts keys, one whose marker says it was reset), and refuses a
// store that may lose one when durability is required.
//
// A store URL is read by redisstore.URL alone, here as everywhere: what it
// names, its addresses, how it is shown (redacted). This package never
// serves anything and never keeps the store it opens.
package stores

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/filestore"
	"github.com/stopgate/stopgate/state/redisstore"
)

// EmbeddedFile is the embedded store's file inside the data directory.
const EmbeddedFile = "stopgate.db"

// Config names a store.
type Config struct {
	// URL is a Redis URL, or empty for the embedded store in DataDir.
	URL string
	// DataDir holds the embedded store's file.
	DataDir string
	// RequireDurable refuses a store that may lose an acknowledged write.
	RequireDurable bool
	// OpTimeout bounds each Redis operation (redisstore's default when zero).
	OpTimeout time.Duration
	// CancelReplicas makes a Redis cancel wait until that many replicas
	// have it (WAIT) before it is acknowledged; 0: the primary's word.
	CancelReplicas int
	// Password authenticates to Redis in place of one in the URL (read
	// from a file or the environment, so that no command line shows it).
	Password string
	Logger   *slog.Logger
}

// MarkerFile is where a Redis store keeps, in the data directory, what it
// saw of the store's marker (redisstore.Options.MarkerFile), so that a
// restart after Redis was emptied still knows it saw one.
const MarkerFile = "redis-marker.json"

// Opened is an open store and what is known of it.
type Opened struct {
	Store state.Store
	// Kind is "file" or "redis", for logs and metric labels.
	Kind string
	// Where is the file's path or the URL, redacted.
	Where string
	// Durable says an acknowledged write survives a crash of the store
	// and a power loss.
	Durable bool
	// Durability says so in words, for the start-up log.
	Durability string
	// Warnings are what else may take an acknowledged cancel away, a
	// sentence each, for the start-up log: a Redis that asks no password,
	// one that evicts keys, a store whose marker says it was reset.
	Warnings []string
	// Addrs are the store's network addresses as the URL names them
	// (host:port, the default port filled in) and each host resolved, so
	// that the egress proxy can refuse them; none for the embedded store.
	// Nodes a Sentinel or a Cluster announces later are not among them.
	Addrs []string
}

// ErrNotDurable is a store refused because durability is required and it
// may lose an acknowledged write.
var ErrNotDurable = errors.New("the store may lose an acknowledged cancel")

// Check reports what is wrong with cfg without opening anything. Its
// errors wrap state.ErrInvalid and never show a password.
func Check(cfg Config) error {
	if cfg.CancelReplicas < 0 {
		return fmt.Errorf("%w: cancel replicas %d is negative", state.ErrInvalid, cfg.CancelReplicas)
	}
	if cfg.URL == "" {
		if cfg.Password != "" {
			return fmt.Errorf("%w: a store password needs a Redis store URL: the embedded store has none", state.ErrInvalid)
		}
		if cfg.DataDir == "" {
			return fmt.Errorf("%w: no store URL and no data directory for the embedded store", state.ErrInvalid)
		}
		if cfg.CancelReplicas > 0 {
			return fmt.Errorf("%w: cancel replicas %d: the embedded store has no replicas (it needs a Redis store URL)", state.ErrInvalid, cfg.CancelReplicas)
		}
		return nil
	}
	u, err := redisstore.ParseURL(cfg.URL)
	if err != nil {
		return err
	}
	_, err = u.WithPassword(cfg.Password)
	return err
}

// Open opens the store cfg names.
func Open(ctx context.Context, cfg Config) (Opened, error) {
	if err := Check(cfg); err != nil {
		return Opened{}, err
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.URL == "" {
		return openEmbedded(cfg)
	}
	return openRedis(ctx, cfg)
}

func openEmbedded(cfg Config) (Opened, error) {
	if err := os.MkdirAll(cfg.DataDir, 0o700); err != nil {
		return Opened{}, fmt.Errorf("data directory %s: %w", cfg.DataDir, err)
	}
	path := filepath.Join(cfg.DataDir, EmbeddedFile)
	s, err := filestore.Open(path, filestore.Options{Logger: cfg.Logger})
	if err != nil {
		return Opened{}, fmt.Errorf("opening the embedded store %s: %w", path, err)
	}
	// Every write transaction of the embedded store is fsynced before it
	// returns: durability holds by construction.
	return Opened{Store: s, Kind: "file", Where: path, Durable: true,
		Durability: "every acknowledged write is fsynced to " + path + " before it is acknowledged"}, nil
}

func openRedis(ctx context.Context, cfg Config) (Opened, error) {
	where := redisstore.Redact(cfg.URL)
	opts := redisstore.Options{Logger: cfg.Logger, OpTimeout: cfg.OpTimeout, CancelReplicas: cfg.CancelReplicas, Password: cfg.Password}
	if cfg.DataDir != "" {
		opts.MarkerFile = filepath.Join(cfg.DataDir, MarkerFile)
	}
	s, err := redisstore.Open(ctx, cfg.URL, opts)
	if err != nil {
		if errors.Is(err, state.ErrInvalid) {
			return Opened{}, err
		}
		return Opened{}, fmt.Errorf("opening the Redis store %s: %w", where, err)
	}
	out := Opened{Store: s, Kind: "redis", Where: where, Addrs: addrs(ctx, cfg.URL)}
	d, err := s.Durability(ctx)
	if err != nil {
		if cfg.RequireDurable {
			_ = s.Close()
			return Opened{}, fmt.Errorf("%w: Redis at %s does not say whether it persists writes: %w", ErrNotDurable, where, err)
		}
		out.Durability = "unknown: " + err.Error()
		return out, nil
	}
	out.Durable, out.Durability = d.Safe(), d.Describe()
	if cfg.RequireDurable && !out.Durable {
		_ = s.Close()
		return Opened{}, fmt.Errorf("%w: Redis at %s: %s; set appendonly yes and appendfsync always", ErrNotDurable, where, out.Durability)
	}
	if x, err := s.Exposure(ctx); err != nil {
		out.Warnings = []string{"could not tell whether Redis asks for a password and whether it evicts keys: " + err.Error()}
	} else {
		out.Warnings = x.Problems()
	}
	if cfg.RequireDurable && len(out.Warnings) > 0 {
		_ = s.Close()
		return Opened{}, fmt.Errorf("%w: Redis at %s: %s", ErrNotDurable, where, strings.Join(out.Warnings, "; and "))
	}
	if m, err := s.Marker(ctx); err == nil && m.State == redisstore.MarkerReset {
		out.Warnings = append(out.Warnings, "the store's marker says it lost writes it had acknowledged (reset at "+
			m.ResetAt.UTC().Format(time.RFC3339)+" by "+m.ResetBy+": "+m.ResetReason+"): every admission is refused until an operator "+
			"re-cancels the runs that were lost and acknowledges the reset (stopgate store acknowledge-reset --reason R)")
	}
	return out, nil
}

// addrs lists the servers of a store URL that Check accepted, each as the
// URL names it and as resolved.
func addrs(ctx context.Context, raw string) []string {
	u, err := redisstore.ParseURL(raw)
	if err != nil {
		return nil
	}
	var out []string
	for _, hp := range u.Addrs() {
		out = append(out, hp)
		h, port, err := net.SplitHostPort(hp)
		if err != nil {
			continue
		}
		if ips, err := net.DefaultResolver.LookupHost(ctx, h); err == nil {
			for _, ip := range ips {
				out = append(out, net.JoinHostPort(ip, port))
			}
		}
	}
	return out
}
