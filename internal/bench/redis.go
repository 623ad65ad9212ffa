package bench

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/stopgate/stopgate/internal/redisserver"
)

// redisProc is a redis-server the instrument started, with a client of its
// own for INFO (never for stopgate's keys).
type redisProc struct {
	*redisserver.Process
	name   string
	client *redis.Client
}

func startRedis(name, dir string, opts redisserver.Options) (*redisProc, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	var lastErr error
	for range 3 {
		port, err := redisserver.FreePort()
		if err != nil {
			return nil, err
		}
		p, err := redisserver.Launch(dir, port, opts)
		if err != nil {
			lastErr = err
			continue
		}
		return &redisProc{Process: p, name: name, client: redis.NewClient(&redis.Options{Addr: p.Addr(), MaxRetries: -1})}, nil
	}
	return nil, fmt.Errorf("%s: %w", name, lastErr)
}

func (r *redisProc) stop() {
	_ = r.client.Close()
	r.Kill()
}

// info reads one field of INFO section.
func (r *redisProc) info(ctx context.Context, section, field string) (string, error) {
	s, err := r.client.Info(ctx, section).Result()
	if err != nil {
		return "", fmt.Errorf("%s INFO %s: %w", r.name, section, err)
	}
	for _, line := range strings.Split(s, "\r\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			return v, nil
		}
	}
	return "", fmt.Errorf("%s INFO %s has no %s", r.name, section, field)
}

// usedMemory is INFO memory used_memory, in bytes.
func (r *redisProc) usedMemory(ctx context.Context) (int64, error) {
	v, err := r.info(ctx, "memory", "used_memory")
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(v, 10, 64)
}

// settle rewrites the AOF and waits for the rewrite to end, so that no
// background rewrite (a fork and a disk write of the whole data set) falls
// into a measured window after a bulk load.
func (r *redisProc) settle(ctx context.Context) error {
	if err := r.client.BgRewriteAOF(ctx).Err(); err != nil && !strings.Contains(err.Error(), "already in progress") {
		return fmt.Errorf("%s BGREWRITEAOF: %w", r.name, err)
	}
	deadline := time.Now().Add(5 * time.Minute)
	for time.Now().Before(deadline) {
		busy, err := r.info(ctx, "persistence", "aof_rewrite_in_progress")
		if err != nil {
			return err
		}
		sched, err := r.info(ctx, "persistence", "aof_rewrite_scheduled")
		if err != nil {
			return err
		}
		if busy == "0" && sched == "0" {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	return fmt.Errorf("%s: AOF rewrite still running after 5 minutes", r.name)
}

// pingRTT is the median round trip of PING on a kept-alive connection:
// the unit of the one-connection target (two Redis round trips + 100 µs).
func (r *redisProc) pingRTT(ctx context.Context, n int) (time.Duration, error) {
	lat := make([]time.Duration, 0, n)
	for range n {
		t := time.Now()
		if err := r.client.Ping(ctx).Err(); err != nil {
			return 0, fmt.Errorf("%s PING: %w", r.name, err)
		}
		lat = append(lat, time.Since(t))
	}
	sortDurations(lat)
	return percentile(lat, 50), nil
}
