package redisstore_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/stopgate/stopgate/internal/redisserver"
	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/redisstore"
)

// BenchmarkGuardFinish is one guarded request as the proxy makes it: a
// guard with a derived key on an auto-admitted run, then its outcome. It
// runs from 1 and from 64 goroutines, with AOF everysec and always, and
// reports what Redis spent per request: from INFO commandstats (the
// commands' own time) and from /proc (the whole server process: scripts,
// commands, network, AOF).
func BenchmarkGuardFinish(b *testing.B) {
	for _, aof := range []string{"everysec", "always"} {
		for _, conns := range []int{1, 64} {
			b.Run(fmt.Sprintf("aof=%s/conns=%d", aof, conns), func(b *testing.B) {
				measureRedis(b, aof, conns, func(s *redisstore.Store, i int) { guardFinish(b, s, "bench", i) })
			})
		}
	}
}

// measureRedis runs request b.N times from conns goroutines (one: a plain
// loop) against a fresh server with AOF fsync aof, after one warm-up, and
// reports what Redis spent per request: from /proc (the whole server
// process: scripts, commands, network, AOF) and from INFO commandstats (the
// commands' own time, and how many there were).
func measureRedis(b *testing.B, aof string, conns int, request func(s *redisstore.Store, i int)) {
	srv := benchServer(b, "--appendonly", "yes", "--appendfsync", aof)
	admin := raw(b, srv.addr)
	ctx := context.Background()
	// Emptied before the store opens: emptied under it, the store would
	// take the flush for a loss (marker.go) and refuse every guard.
	if err := admin.FlushAll(ctx).Err(); err != nil {
		b.Fatal(err)
	}
	s := open(b, "redis://"+srv.addr+"/0", redisstore.Options{OpTimeout: benchTimeout()})
	request(s, 0)
	if err := admin.ConfigResetStat(ctx).Err(); err != nil {
		b.Fatal(err)
	}
	cpu0 := procCPU(b, srv.pid)
	b.ResetTimer()
	if conns == 1 {
		for i := range b.N {
			request(s, i+1)
		}
	} else {
		var n atomic.Int64
		b.SetParallelism((conns + 1) / 2)
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				request(s, int(n.Add(1)))
			}
		})
	}
	b.StopTimer()
	ops := float64(b.N)
	b.ReportMetric(float64((procCPU(b, srv.pid)-cpu0).Microseconds())/ops, "redis-cpu-µs/op")
	if testing.Verbose() {
		info := must(admin.Info(ctx, "commandstats").Result())(b)
		b.Logf("%d ops:\n%s", b.N, info)
	}
	usec, calls := commandStats(b, admin)
	b.ReportMetric(usec/ops, "redis-cmd-µs/op")
	b.ReportMetric(calls/ops, "redis-calls/op")
}

func guardFinish(b *testing.B, s *redisstore.Store, run string, i int) {
	guardFinishKey(b, s, run, fmt.Sprintf("d-0123456789abcdef%08d", i), i)
}

// guardFinishKey guards and finishes one request under a derived key base:
// a new base each time is a new request, the same base again is the same
// request repeated (a poll), which the store numbers base.2, base.3, ….
func guardFinishKey(b *testing.B, s *redisstore.Store, run, base string, i int) {
	ctx := context.Background()
	res, err := s.Guard(ctx, state.GuardRequest{
		RunID: run, Key: base, Boundary: state.BoundaryHTTP,
		Method: "GET", Target: "http://127.0.0.1:8000/small", AutoAdmit: true,
		LeaseOwner: "proxy:bench-host-1234", LeaseTTL: 15 * time.Second, Actor: "proxy:bench-host-1234",
		NotAfter: time.Now().Add(benchTimeout()),
	})
	if err != nil || !res.Admitted {
		b.Fatalf("guard %d: %+v %v", i, res, err)
	}
	_, err = s.Finish(ctx, state.FinishRequest{RunID: run, Key: res.Intent.Key, Attempt: res.Intent.Attempts,
		Outcome: state.IntentResponded, StatusCode: 200, Actor: "proxy:bench-host-1234"})
	if err != nil {
		b.Fatalf("finish %d: %v", i, err)
	}
}

// BenchmarkGuardFinishSameRequest is BenchmarkGuardFinish at 64
// goroutines, AOF everysec, with every request the same (one derived key
// base for all, as a poll of one URL makes).
func BenchmarkGuardFinishSameRequest(b *testing.B) {
	measureRedis(b, "everysec", 64, func(s *redisstore.Store, i int) {
		guardFinishKey(b, s, "bench", "d-0123456789abcdef01234567", i)
	})
}

// BenchmarkGuardFinishManyRuns is BenchmarkGuardFinish at 64 goroutines,
// AOF everysec, with the requests spread over 64 runs, as a fleet with an
// agent per run sends them: steps of different runs share calls.
func BenchmarkGuardFinishManyRuns(b *testing.B) {
	measureRedis(b, "everysec", 64, func(s *redisstore.Store, i int) {
		guardFinish(b, s, fmt.Sprintf("bench-%d", i%64), i)
	})
}

// procCPU is the user and system time the process has used.
func procCPU(tb testing.TB, pid int) time.Duration {
	tb.Helper()
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		tb.Fatal(err)
	}
	// Fields after the command name (which is in parentheses).
	f := strings.Fields(string(raw[strings.LastIndexByte(string(raw), ')')+2:]))
	utime, _ := strconv.ParseInt(f[11], 10, 64)
	stime, _ := strconv.ParseInt(f[12], 10, 64)
	const ticks = 100 // USER_HZ
	return time.Duration(utime+stime) * time.Second / ticks
}

// commandStats sums the time and calls of every command since the last
// CONFIG RESETSTAT.
func commandStats(tb testing.TB, c *redis.Client) (usec, calls float64) {
	tb.Helper()
	info, err := c.Info(context.Background(), "commandstats").Result()
	if err != nil {
		tb.Fatal(err)
	}
	for _, line := range strings.Split(info, "\n") {
		_, rest, ok := strings.Cut(strings.TrimSpace(line), ":")
		if !ok || !strings.HasPrefix(line, "cmdstat_") || strings.HasPrefix(line, "cmdstat_info:") {
			continue
		}
		for _, kv := range strings.Split(rest, ",") {
			k, v, _ := strings.Cut(kv, "=")
			x, _ := strconv.ParseFloat(v, 64)
			switch k {
			case "usec":
				usec += x
			case "calls":
				calls += x
			}
		}
	}
	return usec, calls
}

// benchServer is the server a benchmark measures: its own, or with
// STOPGATE_BENCH_REDIS=host:port one already running (under a profiler
// that counts instructions, say, where CPU time on a shared machine is too
// noisy to compare two versions of the scripts). The benchmark empties it.
func benchServer(b *testing.B, args ...string) benchTarget {
	addr := os.Getenv("STOPGATE_BENCH_REDIS")
	if addr == "" {
		srv := redisserver.Start(b, redisserver.Options{Args: args})
		return benchTarget{addr: srv.Addr(), pid: srv.PID()}
	}
	pid, _ := strconv.Atoi(os.Getenv("STOPGATE_BENCH_REDIS_PID"))
	if pid == 0 {
		pid = os.Getpid() // no server process to read: the figures are this one's
	}
	return benchTarget{addr: addr, pid: pid}
}

// benchTarget is the server a benchmark talks to, and the process whose
// CPU time it reports.
type benchTarget struct {
	addr string
	pid  int
}

// benchTimeout bounds each store call of a benchmark: generous, since a
// server under a profiler runs many times slower.
func benchTimeout() time.Duration {
	if os.Getenv("STOPGATE_BENCH_REDIS") != "" {
		return time.Minute
	}
	return 10 * time.Second
}
