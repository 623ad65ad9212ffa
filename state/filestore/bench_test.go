package filestore_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stopgate/stopgate/state"
	"github.com/stopgate/stopgate/state/filestore"
)

// BenchmarkGuardFinish is one guarded request as the proxy makes it: a
// guard with a derived key on an auto-admitted run, then its outcome; from
// 1 and from 64 goroutines. Each step is durable (fsynced) before it
// returns; concurrent steps may share a commit.
func BenchmarkGuardFinish(b *testing.B) {
	for _, conns := range []int{1, 64} {
		b.Run(fmt.Sprintf("conns=%d", conns), func(b *testing.B) {
			measure(b, conns, func(s *filestore.Store, i int) {
				guardFinish(b, s, "bench", fmt.Sprintf("d-0123456789abcdef%08d", i), i)
			})
		})
	}
}

// BenchmarkGuardFinishSameRequest is BenchmarkGuardFinish at 64
// goroutines with every request the same (one derived key base for all,
// as a poll of one URL makes, or a load test of one): the store numbers
// them base.2, base.3, … with a counter it updates on every guard.
func BenchmarkGuardFinishSameRequest(b *testing.B) {
	measure(b, 64, func(s *filestore.Store, i int) {
		guardFinish(b, s, "bench", "d-0123456789abcdef01234567", i)
	})
}

// BenchmarkGuardFinishManyRuns is BenchmarkGuardFinish at 64 goroutines
// with the requests spread over 64 runs, as a fleet with an agent per run
// sends them: steps of different runs share a commit, but each run's steps
// write that run's own pages.
func BenchmarkGuardFinishManyRuns(b *testing.B) {
	measure(b, 64, func(s *filestore.Store, i int) {
		guardFinish(b, s, fmt.Sprintf("bench-%d", i%64), fmt.Sprintf("d-0123456789abcdef%08d", i), i)
	})
}

// measure runs request b.N times from conns goroutines (one: a plain
// loop) on a new data file, and reports the process's CPU time and the
// bytes it wrote per request.
func measure(b *testing.B, conns int, request func(s *filestore.Store, i int)) {
	s := open(b, filepath.Join(b.TempDir(), "stopgate.db"))
	defer s.Close()
	var n atomic.Int64
	cpu0, w0 := processCPU(b), written(b)
	b.ResetTimer()
	if conns == 1 {
		for i := range b.N {
			request(s, i)
		}
	} else {
		b.SetParallelism(conns / 2)
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				request(s, int(n.Add(1)))
			}
		})
	}
	b.StopTimer()
	b.ReportMetric(float64((processCPU(b)-cpu0).Microseconds())/float64(b.N), "cpu-µs/op")
	b.ReportMetric(float64(written(b)-w0)/float64(b.N), "disk-B/op")
}

// guardFinish guards and finishes one request of run under the derived key base.
func guardFinish(b *testing.B, s *filestore.Store, run, base string, i int) {
	ctx := context.Background()
	res, err := s.Guard(ctx, state.GuardRequest{
		RunID: run, Key: base, Boundary: state.BoundaryHTTP,
		Method: "GET", Target: "http://127.0.0.1:8000/small", AutoAdmit: true,
		LeaseOwner: "proxy:bench-host-1234", LeaseTTL: 15 * time.Second, Actor: "proxy:bench-host-1234",
		NotAfter: time.Now().Add(10 * time.Second),
	})
	if err != nil || !res.Admitted {
		b.Errorf("guard %d: %+v %v", i, res, err)
		return
	}
	_, err = s.Finish(ctx, state.FinishRequest{RunID: run, Key: res.Intent.Key, Attempt: res.Intent.Attempts,
		Outcome: state.IntentResponded, StatusCode: 200, Actor: "proxy:bench-host-1234"})
	if err != nil {
		b.Errorf("finish %d: %v", i, err)
	}
}

// processCPU is the user and system time this process has used: the
// store's work, the benchmark's own and the runtime's.
func processCPU(tb testing.TB) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		tb.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// written is how many bytes this process has written (wchar in
// /proc/self/io: every write and pwrite, whatever the page cache did).
func written(tb testing.TB) int64 {
	raw, err := os.ReadFile("/proc/self/io")
	if err != nil {
		tb.Fatal(err)
	}
	for _, line := range strings.Split(string(raw), "\n") {
		if v, ok := strings.CutPrefix(line, "wchar: "); ok {
			n, _ := strconv.ParseInt(v, 10, 64)
			return n
		}
	}
	tb.Fatal("no wchar in /proc/self/io")
	return 0
}
